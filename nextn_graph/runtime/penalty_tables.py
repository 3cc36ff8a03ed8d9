"""What the penalties read on the device (graph.penalties), by pool row, allocated once.
Verify row j counts the committed tokens plus drafts d1..dj, as one-at-a-time decoding
would, so acceptance stays exact against the penalised target. A round stages what it
commits into the copy it writes (``pending``); the next round reading that copy counts
it, each position once (``counted``), so a failed round's tokens are never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory.batch import Chunk
from ..penalties import MAX_BAN_IDS, MAX_LOGIT_BIAS, apply_penalties
from ..sampling import SamplingParams


@dataclass(frozen=True)
class PenaltyTables:
    presence: torch.Tensor  # [R] fp32
    frequency: torch.Tensor  # [R] fp32
    repetition: torch.Tensor  # [R] fp32, 1 = off
    bias_ids: torch.Tensor  # [R, M] int64 (padding: id 0, bias 0)
    bias: torch.Tensor  # [R, M] fp32
    ban_ids: torch.Tensor  # [R, Mb] int64: the stop ids min_tokens holds back
    ban_valid: torch.Tensor  # [R, Mb] bool
    min_end: torch.Tensor  # [R] int64: positions below it hold the ban (prompt + min_tokens)
    seen: torch.Tensor  # [R, V] bool: the prompt's tokens
    counts: torch.Tensor  # [R, V] fp32: the output's tokens at positions < counted
    counted: torch.Tensor  # [R] int64
    # by state slot (two copies per row): the tokens that copy's last round committed,
    # at positions L - n + 1 .. L of the copy's committed length L
    pending: torch.Tensor  # [2R, N] int64
    pending_n: torch.Tensor  # [2R] int64, n

    @staticmethod
    def allocate(rows: int, vocab: int, width: int, device) -> "PenaltyTables":
        f32, long = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        return PenaltyTables(
            torch.zeros(rows, **f32), torch.zeros(rows, **f32), torch.ones(rows, **f32),
            torch.zeros(rows, MAX_LOGIT_BIAS, **long), torch.zeros(rows, MAX_LOGIT_BIAS, **f32),
            torch.zeros(rows, MAX_BAN_IDS, **long),
            torch.zeros(rows, MAX_BAN_IDS, dtype=torch.bool, device=device),
            torch.zeros(rows, **long), torch.zeros(rows, vocab, dtype=torch.bool, device=device),
            torch.zeros(rows, vocab, **f32), torch.zeros(rows, **long),
            torch.zeros(2 * rows, width, **long), torch.zeros(2 * rows, **long))

    def mark_prompt(self, chunks: list[Chunk]) -> None:
        """The chunks' tokens are the prompt's; a first chunk resets the row."""
        dev = self.seen.device
        first = [c.req_index for c in chunks if c.start == 0]
        if first:
            self.seen[torch.tensor(first, device=dev)] = False
        rows = [c.req_index for c in chunks for _ in c.tokens]
        toks = [t for c in chunks for t in c.tokens]
        self.seen[torch.tensor(rows, device=dev), torch.tensor(toks, device=dev)] = True

    def admit(self, rows: list[int], params: list[SamplingParams], lengths: list[int]) -> None:
        """The final chunks' parameters, no output counted yet (``lengths``: P)."""
        dev = self.counts.device
        r = torch.tensor(rows, device=dev)
        m, mb = self.bias.shape[1], self.ban_ids.shape[1]
        cols = torch.tensor([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
                             for p in params], device=dev)
        self.presence[r], self.frequency[r], self.repetition[r] = cols.unbind(1)
        pad = [[(0, 0.0)] * (m - len(p.logit_bias)) for p in params]
        pairs = [list(p.logit_bias) + q for p, q in zip(params, pad)]
        self.bias_ids[r] = torch.tensor([[t for t, _ in row] for row in pairs], device=dev)
        self.bias[r] = torch.tensor([[v for _, v in row] for row in pairs], device=dev)
        ban = [list(p.ban_ids) + [0] * (mb - len(p.ban_ids)) for p in params]
        self.ban_ids[r] = torch.tensor(ban, device=dev)
        self.ban_valid[r] = torch.tensor([[j < len(p.ban_ids) for j in range(mb)]
                                          for p in params], device=dev)
        self.min_end[r] = torch.tensor([n + p.min_tokens for n, p in zip(lengths, params)],
                                       device=dev)
        self.counts[r] = 0
        self.counted[r] = torch.tensor(lengths, device=dev)  # P: the output starts there

    def resume(self, row: int, output: list[int], length: int) -> None:
        """A preempted request prefilled again (after ``admit``): its committed output but
        the bonus, at positions P .. L - 1, counted; the bonus is staged as at a prefill."""
        dev = self.counts.device
        self.counts[row] = torch.bincount(torch.tensor(output, dtype=torch.int64, device=dev),
                                          minlength=self.counts.shape[1]).float()
        self.counted[row] = length

    def logits(self, logits: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
               drafts: torch.Tensor) -> torch.Tensor:
        """logits [B, W, V] of rows [B] at committed lengths L [B] (row j predicts position
        L + 1 + j), after drafts [B, W - 1] (positions L + 1 ..) -> processed [B, W, V]."""
        b, w, v = logits.shape
        counts = self.counts[rows].unsqueeze(1).expand(b, w, v)  # [B, W, V]
        if w > 1:  # row j also counts drafts 1..j
            j = torch.arange(w, device=logits.device)
            upto = (j.view(1, w, 1) > j[:w - 1].view(1, 1, w - 1)).float().expand(b, w, w - 1)
            counts = counts.scatter_add(-1, drafts.unsqueeze(1).expand(b, w, w - 1), upto)
        positions = lengths.unsqueeze(1) + 1 + torch.arange(w, device=logits.device)  # [B, W]
        ban = self.ban_valid[rows].unsqueeze(1) & (
            positions < self.min_end[rows].unsqueeze(1)).unsqueeze(-1)  # [B, W, Mb]
        return apply_penalties(logits, counts, self.seen[rows], self.presence[rows],
                               self.frequency[rows], self.repetition[rows], self.bias_ids[rows],
                               self.bias[rows], self.ban_ids[rows], ban)

    def catch_up(self, rows: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Before a round of rows [B] at committed slots [B], lengths L [B]: count the
        ``pending`` tokens not counted yet (none twice; padding row 0 adds nothing)."""
        tokens, n = self.pending[slots], self.pending_n[slots]  # [B, N], [B]
        w = tokens.shape[1]
        j = torch.arange(w, device=tokens.device)
        positions = (lengths - n + 1).unsqueeze(1) + j  # [B, N]
        counted = self.counted[rows]
        new = (j < n.unsqueeze(1)) & (positions >= counted.unsqueeze(1)) & (
            rows > 0).unsqueeze(1)  # [B, N]
        # (index_add_, not an accumulating index_put_: that one sorts, and breaks a capture)
        flat = rows.unsqueeze(1) * self.counts.shape[1] + tokens  # [B, N] into counts.view(-1)
        self.counts.view(-1).index_add_(0, flat.reshape(-1), new.float().reshape(-1))
        self.counted.index_put_((rows,), torch.maximum(counted, lengths + 1))

    def stage(self, slots: torch.Tensor, tokens: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """tokens [B, W] into the copies ``slots`` [B] a round writes; accept_lens [B] commit."""
        self.pending[:, :tokens.shape[1]].index_put_((slots,), tokens)
        self.pending_n.index_put_((slots,), accept_lens)
