"""The EAGLE step functions (topk 1): the math of a round's phases and of prefill.

Notation: B requests, committed length ``L`` (target KV exists for positions
< L), the bonus token at position L (confirmed, its KV not yet computed),
S = num_steps, N = S + 1. Every decode-time phase is a function of device
tensors with static shapes (B, N, S fixed): no host sync, no allocation that
depends on data, so each can be captured as a graph as it stands.

- ``rollout``: candidate 1 exists; S - 1 NextN decode forwards make 2..S, each
  consuming the previous candidate and the draft's own ``pre_hc_head``.
- ``verify``: the window ``[bonus, d1..dS]`` at positions L..L+S, one target
  forward over B*N rows.
- ``accept``: greedy chain acceptance -> ``accept_lens`` in [1, N].
  Sampling rounds use ``sampling.speculative_accept`` instead (rejection sampling).
- ``draft_extend``: one NextN forward over the fixed B*N window (row j: the
  target's prediction after verify row j, with verify hidden j);
  ``select_index = arange(B)*N + accept_lens - 1`` picks candidate 1 and the
  seed. Rows past the accepted length write draft KV that the next round
  overwrites before reading.

Sampling: given ``params`` (``RowParams``: the batch's temperatures, top-k, top-p
and seeds), every token is drawn from its row's filtered distribution with a
keyed uniform (round base L, offset j of the drawn position L + j, stream), and the
draft returns the q it drew each candidate from. Greedy rows (temperature 0) get
one-hot distributions, so they draw exactly the argmax the greedy path takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..memory.batch import Chunk, ForwardBatch
from ..memory.pool import KVPool
from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN
from ..sampling import DRAFT, RowParams, draw


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
    """-> (target predictions [B, N], or with ``params`` the filtered target
    distributions p [B, N, V]; verify hidden [B*N, hc*H]; the raw logits [B, N, V] fp32).
    ``process``: the penalties, logits [B, N, V] -> [B, N, V], before the pick."""
    window = torch.cat((bonus.unsqueeze(1), draft_tokens), dim=1)  # [B, N]
    out = m.target(window_batch(window, rows, lengths), m.target_pool)
    raw = logits = out.logits.view(*window.shape, -1)  # [B, N, V]
    if process is not None:
        logits = process(logits)
    return ((logits.argmax(dim=-1) if params is None else params.probs(logits)), out.hidden,
            raw)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """The raw log-softmax at the committed tokens: logits [..., V] fp32, tokens [...] ->
    (logprobs [..., 1+k]: the token's, then the k most likely ones'; their ids [..., k]).
    One logsumexp and one top-k, no [..., V] output: the greedy token's logprob and the
    top-1's are the same float (the same logit minus the same normaliser)."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., 1]
    top = logits.topk(k, dim=-1)  # sorted: most likely first
    chosen = logits.gather(-1, tokens.unsqueeze(-1))  # [..., 1]
    return torch.cat((chosen, top.values), dim=-1) - lse, top.indices


def accept(draft_tokens: torch.Tensor, preds: torch.Tensor) -> torch.Tensor:
    """Greedy chain: accept_lens = 1 + leading matches [B] (the round commits
    preds[:a], so the new bonus is preds[a - 1])."""
    s = draft_tokens.shape[1]
    matches = (draft_tokens == preds[:, :s]).long().cumprod(dim=1)  # [B, S]
    return 1 + matches.sum(dim=1)


def draft_extend(m: SpecModels, rows: torch.Tensor, lengths: torch.Tensor, preds: torch.Tensor,
                 hidden: torch.Tensor, accept_lens: torch.Tensor,
                 params: RowParams | None = None):
    """Window rows at L..L+N-1 -> (candidate 1 [B], draft hidden seed [B, hc*H], and
    with ``params`` the q [B, V] candidate 1 was drawn from, else None)."""
    b, n = preds.shape
    out = m.draft(window_batch(preds, rows, lengths), hidden, m.draft_pool)
    select_index = torch.arange(b, device=preds.device) * n + accept_lens - 1  # [B]
    cand1, q1 = _candidate(out.logits[select_index], params, lengths + accept_lens)
    return cand1, out.hidden[select_index], q1


def _candidate(logits: torch.Tensor, params: RowParams | None, base: torch.Tensor):
    """Candidate 1 of the round at committed length ``base`` [B] (position base + 1):
    the draft's argmax, or a draw from its q -> (tokens [B], q [B, V] or None)."""
    if params is None:
        return logits.argmax(dim=-1), None
    q1 = params.probs(logits)
    return draw(q1, params.uniform(base, 1, DRAFT)), q1


def prefill(m: SpecModels, chunks: list[Chunk], nexts: list[int | None], device,
            with_draft: bool = True, params: RowParams | None = None,
            lp_rows: torch.Tensor | None = None, lp_k: int = 0, process=None):
    """Eager, variable length: target over prompt chunks, then draft extend for them.

    Chunk c holds prompt positions ``start .. start+len-1`` of its row (KV of the
    positions before ``start`` is in the pools: chunked prefill). NextN row p pairs
    token p+1 with target hidden p: the chunk's own next token, and at its last row
    ``nexts[c]``, the prompt's next token for a chunk that ends before the prompt
    does, or None for a final chunk, whose last row pairs the bonus with the last
    hidden. So a chunk's draft extend needs nothing from later chunks.
    -> for the final chunks, in order (F of them): (bonus [F], candidate 1 [F],
    seed [F, hc*H], q of candidate 1 [F, V] or None); without the draft (plain
    decoding) candidate 1 and the seed are zeros. ``params``: the final chunks'
    (None: greedy); the bonus (position P, a round based at P - 1) and candidate 1
    (the first round's, based at P) are drawn. ``lp_rows`` [R] (rows of the batch):
    also the raw logprobs of each such row's next token (the prompt's, or the bonus at a
    final chunk's last row) and its ``lp_k`` most likely (``token_logprobs``), returned
    last (else None). ``process``: the penalties of the final chunks' first tokens,
    logits [F, V] -> [F, V].
    """
    batch = ForwardBatch.from_chunks(chunks, device)
    out = m.target(batch, m.target_pool)
    ends = [len(c.tokens) for c in chunks]
    ends = [sum(ends[:i + 1]) - 1 for i in range(len(ends))]  # each chunk's last row
    final = [i for i, n in enumerate(nexts) if n is None]
    last = torch.tensor([ends[i] for i in final], device=device, dtype=torch.long)  # [F]
    lens = torch.tensor([chunks[i].start + len(chunks[i].tokens) for i in final],
                        device=device, dtype=torch.long)  # [F] P
    head = out.logits[last] if process is None else process(out.logits[last])  # [F, V]
    if params is None:
        bonus = head.argmax(dim=-1)
    else:
        bonus = params.next_token(params.probs(head), lens - 1)
    shifted = None
    if with_draft or lp_rows is not None:
        shifted = torch.cat((batch.input_ids[1:], batch.input_ids[:1]))  # token p+1 at row p
        cont = [i for i, n in enumerate(nexts) if n is not None]
        if cont:  # a chunk that stops inside its prompt: the prompt's next token
            shifted[[ends[i] for i in cont]] = torch.tensor([nexts[i] for i in cont],
                                                            device=device, dtype=shifted.dtype)
        shifted = shifted.index_put((last,), bonus)
    lp = None if lp_rows is None else token_logprobs(out.logits[lp_rows], shifted[lp_rows], lp_k)
    if not with_draft:
        return bonus, torch.zeros_like(bonus), torch.zeros_like(out.hidden[last]), None, lp
    draft_batch = dataclasses.replace(batch, input_ids=shifted)
    dout = m.draft(draft_batch, out.hidden, m.draft_pool)
    cand1, q1 = _candidate(dout.logits[last], params, lens)
    return bonus, cand1, dout.hidden[last], q1, lp
