"""Static state of the decode rounds, allocated once: addresses never move.

``RequestState`` holds each request's speculative state in two copies per pool row
(``runtime/slots.py``). ``RoundBuffers`` holds one round's inputs and outputs at the
largest bucket; a bucket of B requests uses the leading B rows. The phases read the
staged ``slots`` and gather everything else from the state tables inside the graph,
masking padding rows (row 0) to position 0, token 0 and zero hidden, so a shrinking
batch can never read stale rows: the only per-round staging is the copy of the slots.
KV written past the committed length is harmless: a redone round overwrites it before
anything reads it (commit by length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import RowParams
from .slots import SlotMap


@dataclass(frozen=True)
class RequestState:
    """Per-request state by slot (``SlotMap``: two copies per pool row)."""

    lengths: torch.Tensor  # [2R] committed length L (target KV exists below L)
    bonus: torch.Tensor  # [2R] the confirmed token at position L
    cand1: torch.Tensor  # [2R] draft candidate 1, for position L + 1
    seed: torch.Tensor  # [2R, hc*H] draft hidden seed for the rollout
    map: SlotMap

    @staticmethod
    def allocate(rows: int, hc_dim: int, device, dtype) -> "RequestState":
        long = dict(dtype=torch.int64, device=device)
        slots = 2 * rows
        return RequestState(torch.zeros(slots, **long), torch.zeros(slots, **long),
                            torch.zeros(slots, **long),
                            torch.zeros(slots, hc_dim, device=device, dtype=dtype),
                            SlotMap(rows))

    @property
    def rows(self) -> int:
        """R, the pool's request rows (padding row 0 included)."""
        return self.map.rows

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def store(self, slots: torch.Tensor, lengths: torch.Tensor, bonus: torch.Tensor,
              cand1: torch.Tensor, seed: torch.Tensor) -> None:
        """Write the state of ``slots`` [B]; padding rows all land in a row-0 slot,
        which ``gather`` masks, so duplicate writes there are harmless."""
        self.lengths.index_put_((slots,), lengths)
        self.bonus.index_put_((slots,), bonus)
        self.cand1.index_put_((slots,), cand1)
        self.seed.index_put_((slots,), seed)

    def gather(self, slots: torch.Tensor):
        """Per-request state of ``slots`` [B], padding rows (row 0) neutralised."""
        pad = self.map.rows_of(slots) == 0  # [B]
        return (self.lengths[slots].masked_fill(pad, 0), self.bonus[slots].masked_fill(pad, 0),
                self.cand1[slots].masked_fill(pad, 0),
                self.seed[slots].masked_fill(pad.unsqueeze(1), 0))


@dataclass(frozen=True)
class RoundBuffers:
    slots: torch.Tensor  # [Bmax] committed state slots of this round's requests, 0 = padding
    hidden: torch.Tensor  # [Bmax*N, hc*H] verify pre_hc_head
    # What the host reads back, one row per request, so a chunk's readback is one
    # copy of the leading rows; the fields below are column views of it.
    readout: torch.Tensor  # [Bmax, 1 + N + S (+ N*K + ceil(N*(1+K)/2) with logprobs)]
    accept_lens: torch.Tensor  # [Bmax] in [1, N]            readout[:, 0]
    preds: torch.Tensor  # [Bmax, N] target predictions      readout[:, 1:1+N]
    draft_tokens: torch.Tensor  # [Bmax, S] the candidates   readout[:, 1+N:1+N+S]
    # With K = graph.logprobs > 0 (else [Bmax, N, 0]): each verify row's K most likely
    # tokens, and fp32 logprobs of its committed token then of those K, packed two per
    # int64 column of the readout, so they come back in the same one copy.
    top_ids: torch.Tensor  # [Bmax, N, K]                     readout[:, 1+N+S:1+N+S+N*K]
    logprobs: torch.Tensor  # [Bmax, N, 1+K] fp32             readout[:, 1+N+S+N*K:] as fp32

    @staticmethod
    def allocate(max_batch: int, num_steps: int, hc_dim: int, device, dtype,
                 top_logprobs: int = 0) -> "RoundBuffers":
        n, k = num_steps + 1, top_logprobs
        long = dict(dtype=torch.int64, device=device)
        tokens = 1 + n + num_steps
        packed = (n * (1 + k) + 1) // 2 if k else 0  # fp32 pairs per int64 column
        readout = torch.zeros(max_batch, tokens + n * k + packed, **long)
        readout[:, 0] = 1
        if k:
            logprobs = readout[:, tokens + n * k:].view(torch.float32)[:, :n * (1 + k)]
            logprobs = logprobs.view(max_batch, n, 1 + k)
        else:
            logprobs = torch.zeros(max_batch, n, 0, device=device)
        return RoundBuffers(
            slots=torch.zeros(max_batch, **long),
            hidden=torch.zeros(max_batch * n, hc_dim, device=device, dtype=dtype),
            readout=readout, accept_lens=readout[:, 0], preds=readout[:, 1:1 + n],
            draft_tokens=readout[:, 1 + n:tokens],
            top_ids=readout[:, tokens:tokens + n * k].view(max_batch, n, k),
            logprobs=logprobs)

    @property
    def top_logprobs(self) -> int:
        """K, the top logprobs a round computes per token (0: none)."""
        return self.top_ids.shape[-1]


@dataclass(frozen=True)
class SamplingTables:
    """What sampling adds (allocated only where the engine samples): each request's
    parameters by pool row (row 0, padding, stays greedy), the draft distribution q that
    candidate 1 was drawn from by state slot (two copies, like ``RequestState``), and the
    round's q of every candidate. fp32 throughout: acceptance compares p with the very
    q a candidate was drawn from."""

    temperature: torch.Tensor  # [R] fp32, 0 = greedy
    top_p: torch.Tensor  # [R] fp32
    top_k: torch.Tensor  # [R] int64, 0 = off
    seed: torch.Tensor  # [R] int64, the request's sampling seed
    min_p: torch.Tensor  # [R] fp32, 0 = off
    q1: torch.Tensor  # [2R, V] q of candidate 1 by slot (sampled rows); [0, V] plain
    q: torch.Tensor  # [Bmax, S, V] this round's q of candidates 1..S; [0, 1, V] plain

    @staticmethod
    def allocate(rows: int, max_batch: int, num_steps: int, vocab: int,
                 device) -> "SamplingTables":
        f32, long = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        draft = num_steps > 0  # plain decoding has no draft: no q to keep (empty tables)
        return SamplingTables(torch.zeros(rows, **f32), torch.ones(rows, **f32),
                              torch.zeros(rows, **long), torch.zeros(rows, **long),
                              torch.zeros(rows, **f32),
                              torch.zeros(2 * rows if draft else 0, vocab, **f32),
                              torch.zeros(max_batch if draft else 0, max(num_steps, 1), vocab,
                                          **f32))

    def store(self, rows: torch.Tensor, params: RowParams) -> None:
        """Admission: the parameters of pool rows [B] (never row 0)."""
        self.temperature.index_put_((rows,), params.temperature)
        self.top_p.index_put_((rows,), params.top_p)
        self.top_k.index_put_((rows,), params.top_k)
        self.seed.index_put_((rows,), params.seed)
        self.min_p.index_put_((rows,), params.min_p)

    def gather(self, rows: torch.Tensor) -> RowParams:
        """The parameters of pool rows [B] (padding row 0 is greedy)."""
        return RowParams(self.temperature[rows], self.top_p[rows], self.top_k[rows],
                         self.seed[rows], self.min_p[rows])
