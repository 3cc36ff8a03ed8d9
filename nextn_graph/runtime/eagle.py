"""The EAGLE step functions (topk 1). B requests at committed length L (the bonus at L
has no KV yet), S = num_steps, N = S + 1. Decode-time phases have static shapes, no
host sync and no data-dependent allocation, so each can be captured as it stands."""

from __future__ import annotations

import torch

from ..memory.batch import ForwardBatch
from ..labels import ACCEPT_SAMPLING, BOOKKEEPING, labelled
from ..sampling import DRAFT, RowParams, draw
from .models import SpecModels

profile_label = ACCEPT_SAMPLING  # argmax, acceptance, select_index (labels.py)


@labelled(BOOKKEEPING)
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
            seed: torch.Tensor, num_steps: int, params: RowParams | None = None):
    """-> (draft_tokens [B, S], q of candidates 2..S [B, S-1, V] when sampling, else
    None). Draft step i (1-based) runs at position L + i - 1 and proposes L + i + 1."""
    tokens, hidden, qs = [cand1], seed, []  # [B], [B, hc*H]
    for i in range(1, num_steps):
        batch = window_batch(tokens[-1].unsqueeze(1), rows, lengths + (i - 1))
        out = m.draft(batch, hidden, m.draft_pool)
        if params is None:
            tokens.append(out.logits.argmax(dim=-1))
        else:
            qs.append(params.probs(out.logits))  # [B, V]
            tokens.append(draw(qs[-1], params.uniform(lengths, i + 1, DRAFT)))
        hidden = out.hidden
    q = torch.stack(qs, dim=1) if params is not None and qs else None
    return torch.stack(tokens, dim=1), q


def verify(m: SpecModels, rows: torch.Tensor, lengths: torch.Tensor, bonus: torch.Tensor,
           draft_tokens: torch.Tensor, params: RowParams | None = None, process=None):
    """-> (predictions [B, N], or with ``params`` p [B, N, V]; hidden [B*N, hc*H]; raw
    logits [B, N, V] fp32). ``process``: the penalties, applied before the pick."""
    window = torch.cat((bonus.unsqueeze(1), draft_tokens), dim=1)  # [B, N]
    out = m.target(window_batch(window, rows, lengths), m.target_pool)
    raw = logits = out.logits.view(*window.shape, -1)  # [B, N, V]
    if process is not None:
        logits = process(logits)
    return ((logits.argmax(dim=-1) if params is None else params.probs(logits)), out.hidden,
            raw)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """logits [..., V] fp32, tokens [...] -> (raw logprobs [..., 1+k]: the token's, then
    the top k's; ids [..., k]). The greedy token's and the top-1's are the same float."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., 1]
    top = logits.topk(k, dim=-1)  # sorted: most likely first
    chosen = logits.gather(-1, tokens.unsqueeze(-1))  # [..., 1]
    return torch.cat((chosen, top.values), dim=-1) - lse, top.indices


def accept(draft_tokens: torch.Tensor, preds: torch.Tensor) -> torch.Tensor:
    """-> accept_lens [B] = 1 + leading matches (the new bonus is preds[a - 1])."""
    s = draft_tokens.shape[1]
    matches = (draft_tokens == preds[:, :s]).long().cumprod(dim=1)  # [B, S]
    return 1 + matches.sum(dim=1)


def draft_extend(m: SpecModels, rows: torch.Tensor, lengths: torch.Tensor, preds: torch.Tensor,
                 hidden: torch.Tensor, accept_lens: torch.Tensor,
                 params: RowParams | None = None):
    """-> (candidate 1 [B], seed [B, hc*H], q1 [B, V] or None). Rows past the accepted
    length write draft KV that the next round overwrites before reading."""
    b, n = preds.shape
    out = m.draft(window_batch(preds, rows, lengths), hidden, m.draft_pool)
    select_index = torch.arange(b, device=preds.device) * n + accept_lens - 1  # [B]
    cand1, q1 = candidate(out.logits[select_index], params, lengths + accept_lens)
    return cand1, out.hidden[select_index], q1


def candidate(logits: torch.Tensor, params: RowParams | None, base: torch.Tensor):
    """Candidate 1 (position base + 1) -> (tokens [B], q [B, V] or None)."""
    if params is None:
        return logits.argmax(dim=-1), None
    q1 = params.probs(logits)
    return draw(q1, params.uniform(base, 1, DRAFT)), q1
