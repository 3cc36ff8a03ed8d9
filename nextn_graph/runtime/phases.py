"""The per-round phases of EAGLE speculative decoding with topk 1.

Notation: B requests, committed length ``L`` (target KV exists for positions
< L), the bonus token at position L (confirmed, its KV not yet computed),
S = num_steps, N = S + 1. Every decode-time phase is a function of device
tensors with static shapes (B, N, S fixed): no host sync, no allocation that
depends on data, so each can be captured as a graph as it stands.

- ``rollout``: candidate 1 exists; S - 1 NextN decode forwards make 2..S, each
  consuming the previous candidate and the draft's own ``pre_hc_head``.
- ``verify``: the window ``[bonus, d1..dS]`` at positions L..L+S, one target
  forward over B*N rows.
- ``accept``: greedy chain acceptance -> ``accept_lens`` in [1, N], new bonus.
- ``draft_extend``: one NextN forward over the fixed B*N window (row j: the
  target's prediction after verify row j, with verify hidden j);
  ``select_index = arange(B)*N + accept_lens - 1`` picks candidate 1 and the
  seed. Rows past the accepted length write draft KV that the next round
  overwrites before reading.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..memory.batch import Chunk, ForwardBatch
from ..memory.pool import KVPool
from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN


@dataclass
class SpecModels:
    """The target, the draft and their pools (same request-row numbering)."""

    target: DeepseekV4ForCausalLM
    draft: DeepseekV4ForCausalLMNextN
    target_pool: KVPool
    draft_pool: KVPool


def window_batch(tokens: torch.Tensor, rows: torch.Tensor, start: torch.Tensor) -> ForwardBatch:
    """tokens: [B, W] at positions start..start+W-1 of request rows [B] -> B*W rows."""
    b, w = tokens.shape
    positions = start.unsqueeze(1) + torch.arange(w, device=tokens.device)  # [B, W]
    return ForwardBatch(
        input_ids=tokens.reshape(-1),
        positions=positions.reshape(-1),
        req_index=rows.unsqueeze(1).expand(b, w).reshape(-1),
        cache_start=start.unsqueeze(1).expand(b, w).reshape(-1),
        seq_end=(start + w).unsqueeze(1).expand(b, w).reshape(-1), num_chunks=b)


def rollout(m: SpecModels, rows: torch.Tensor, lengths: torch.Tensor, cand1: torch.Tensor,
            seed: torch.Tensor, num_steps: int) -> torch.Tensor:
    """-> draft_tokens [B, S]. Draft step i (1-based) runs at position L + i - 1."""
    tokens, hidden = [cand1], seed  # [B], [B, hc*H]
    for i in range(1, num_steps):
        batch = window_batch(tokens[-1].unsqueeze(1), rows, lengths + (i - 1))
        out = m.draft(batch, hidden, m.draft_pool)
        tokens.append(out.logits.argmax(dim=-1))
        hidden = out.hidden
    return torch.stack(tokens, dim=1)


def verify(m: SpecModels, rows: torch.Tensor, lengths: torch.Tensor, bonus: torch.Tensor,
           draft_tokens: torch.Tensor):
    """-> (target predictions [B, N], verify hidden [B*N, hc*H])."""
    window = torch.cat((bonus.unsqueeze(1), draft_tokens), dim=1)  # [B, N]
    out = m.target(window_batch(window, rows, lengths), m.target_pool)
    return out.logits.argmax(dim=-1).view(window.shape), out.hidden


def accept(draft_tokens: torch.Tensor, preds: torch.Tensor):
    """Greedy chain: accept_lens = 1 + leading matches [B]; new bonus = preds[a - 1] [B]."""
    s = draft_tokens.shape[1]
    matches = (draft_tokens == preds[:, :s]).long().cumprod(dim=1)  # [B, S]
    accept_lens = 1 + matches.sum(dim=1)
    bonus = preds.gather(1, (accept_lens - 1).unsqueeze(1)).squeeze(1)
    return accept_lens, bonus


def draft_extend(m: SpecModels, rows: torch.Tensor, lengths: torch.Tensor, preds: torch.Tensor,
                 hidden: torch.Tensor, accept_lens: torch.Tensor):
    """Window rows at L..L+N-1 -> (candidate 1 [B], draft hidden seed [B, hc*H])."""
    b, n = preds.shape
    out = m.draft(window_batch(preds, rows, lengths), hidden, m.draft_pool)
    select_index = torch.arange(b, device=preds.device) * n + accept_lens - 1  # [B]
    return out.logits[select_index].argmax(dim=-1), out.hidden[select_index]


def prefill(m: SpecModels, rows: list[int], prompts: list[list[int]], device,
            with_draft: bool = True):
    """Eager, variable length: target over the prompts, then draft extend for prefill.

    NextN row p pairs token p+1 with target hidden p; the last row pairs the bonus
    with the last hidden. -> (bonus [B], candidate 1 [B], seed [B, hc*H]); without
    the draft (plain decoding) candidate 1 and the seed are zeros.
    """
    batch = ForwardBatch.from_chunks([Chunk(r, 0, p) for r, p in zip(rows, prompts)], device)
    out = m.target(batch, m.target_pool)
    last = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1  # [B]
    bonus = out.logits[last].argmax(dim=-1)
    if not with_draft:
        return bonus, torch.zeros_like(bonus), torch.zeros_like(out.hidden[last])
    shifted = torch.cat((batch.input_ids[1:], batch.input_ids[:1]))  # token p+1 at row p
    shifted = shifted.index_put((last,), bonus)
    draft_batch = dataclasses.replace(batch, input_ids=shifted)
    dout = m.draft(draft_batch, out.hidden, m.draft_pool)
    return bonus, dout.logits[last].argmax(dim=-1), dout.hidden[last]
