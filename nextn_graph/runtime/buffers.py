"""Static state of the decode rounds, allocated once: addresses never move. Phases
gather from these tables inside the graph and mask padding (row 0), so a shrinking batch
never reads stale rows and the only per-round staging is the slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import RowParams
from ..labels import BOOKKEEPING
from .slots import SlotMap

profile_label = BOOKKEEPING  # the work profile's label of this file's code (labels.py)


@dataclass(frozen=True)
class RequestState:
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
        return self.map.rows

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def store(self, slots: torch.Tensor, lengths: torch.Tensor, bonus: torch.Tensor,
              cand1: torch.Tensor, seed: torch.Tensor) -> None:
        """Padding rows all write row-0 slots, which ``gather`` masks: harmless."""
        self.lengths.index_put_((slots,), lengths)
        self.bonus.index_put_((slots,), bonus)
        self.cand1.index_put_((slots,), cand1)
        self.seed.index_put_((slots,), seed)

    def gather(self, slots: torch.Tensor):
        """-> (lengths, bonus, cand1, seed), padding (row 0) zeroed."""
        pad = self.map.rows_of(slots) == 0  # [B]
        return (self.lengths[slots].masked_fill(pad, 0), self.bonus[slots].masked_fill(pad, 0),
                self.cand1[slots].masked_fill(pad, 0),
                self.seed[slots].masked_fill(pad.unsqueeze(1), 0))


@dataclass(frozen=True)
class RoundBuffers:
    slots: torch.Tensor  # [Bmax] committed state slots of this round's requests, 0 = padding
    hidden: torch.Tensor  # [Bmax*N, hc*H] verify pre_hc_head
    # one row per request, read back in one copy; the fields below are views of it
    readout: torch.Tensor  # [Bmax, 1 + N + S (+ N*K + ceil(N*(1+K)/2) with logprobs)]
    accept_lens: torch.Tensor  # [Bmax] in [1, N]            readout[:, 0]
    preds: torch.Tensor  # [Bmax, N] target predictions      readout[:, 1:1+N]
    draft_tokens: torch.Tensor  # [Bmax, S] the candidates   readout[:, 1+N:1+N+S]
    top_ids: torch.Tensor  # [Bmax, N, K]                     readout[:, 1+N+S:1+N+S+N*K]
    logprobs: torch.Tensor  # [Bmax, N, 1+K] fp32             readout[:, 1+N+S+N*K:] as fp32

    @staticmethod
    def allocate(max_batch: int, num_steps: int, hc_dim: int, device, dtype,
                 top_logprobs: int = 0) -> "RoundBuffers":
        n, k = num_steps + 1, top_logprobs
        long = dict(dtype=torch.int64, device=device)
        tokens = 1 + n + num_steps
        packed = (n * (1 + k) + 1) // 2 if k else 0  # K logprobs: fp32 pairs per int64
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
        return self.top_ids.shape[-1]


@dataclass(frozen=True)
class SamplingTables:
    """Allocated only where the engine samples. fp32 throughout: acceptance compares p
    with the very q a candidate was drawn from."""

    temperature: torch.Tensor  # [R] fp32, 0 = greedy (row 0, padding, stays 0)
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
        self.temperature.index_put_((rows,), params.temperature)
        self.top_p.index_put_((rows,), params.top_p)
        self.top_k.index_put_((rows,), params.top_k)
        self.seed.index_put_((rows,), params.seed)
        self.min_p.index_put_((rows,), params.min_p)

    def gather(self, rows: torch.Tensor) -> RowParams:
        return RowParams(self.temperature[rows], self.top_p[rows], self.top_k[rows],
                         self.seed[rows], self.min_p[rows])
