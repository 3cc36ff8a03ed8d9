"""The EAGLE step functions (topk 1). B requests at committed length L (the bonus at L
has no KV yet), S = num_steps, N = S + 1. Decode-time phases have static shapes, no
host sync and no data-dependent allocation, so each can be captured as it stands."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..memory.batch import Chunk, ForwardBatch
from ..memory.pool import KVPool
from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN
from ..labels import ACCEPT_SAMPLING, BOOKKEEPING, labelled
from ..sampling import DRAFT, RowParams, draw
from .prefix_reuse import NO_PREFIX, PrefillPrefix

profile_label = ACCEPT_SAMPLING  # argmax, acceptance, select_index (labels.py)


@dataclass
class SpecModels:
    """The pools share the request-row numbering."""

    target: DeepseekV4ForCausalLM
    draft: DeepseekV4ForCausalLMNextN
    target_pool: KVPool
    draft_pool: KVPool


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
    cand1, q1 = _candidate(out.logits[select_index], params, lengths + accept_lens)
    return cand1, out.hidden[select_index], q1


def _candidate(logits: torch.Tensor, params: RowParams | None, base: torch.Tensor):
    """Candidate 1 (position base + 1) -> (tokens [B], q [B, V] or None)."""
    if params is None:
        return logits.argmax(dim=-1), None
    q1 = params.probs(logits)
    return draw(q1, params.uniform(base, 1, DRAFT)), q1


def prefill(m: SpecModels, chunks: list[Chunk], nexts: list[int | None], device,
            with_draft: bool = True, params: RowParams | None = None,
            lp_rows: torch.Tensor | None = None, lp_k: int = 0, process=None,
            prefix: PrefillPrefix = NO_PREFIX, boundary_hidden: torch.Tensor | None = None,
            forced: torch.Tensor | None = None):
    """A chunk's last NextN row takes ``nexts[c]`` (the prompt's next token) or, for a
    final chunk (None), the bonus, so it needs nothing from later chunks. -> for the F
    final chunks: (bonus [F], cand1 [F], seed [F, hc*H], q1 [F, V] or None, logprobs of
    ``lp_rows`` or None). The bonus is keyed as a round based at P - 1, cand1 at P.
    ``prefix``: the rings keep page-boundary states in snapshots, ``boundary_hidden``
    [snapshots + 1, hc*H] the target's hidden before each; a chunk seeded from one (a
    prefix hit's first) gets a draft row at start - 1 (``runtime/prefix_reuse.py``).
    ``forced`` [F]: a bonus to keep instead of the one computed (a preempted request's,
    recomputed; -1: none)."""
    batch = ForwardBatch.from_chunks(chunks, device, snapshot=prefix.snapshot or None)
    out = m.target(batch, m.target_pool)
    if prefix.keep:  # the hidden before each boundary kept: a hit's first draft row reads it
        at, snap = (torch.tensor(x, device=device) for x in zip(*prefix.keep))
        boundary_hidden.index_copy_(0, snap, out.hidden[at])
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
    if forced is not None:
        bonus = torch.where(forced >= 0, forced, bonus)
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
    if prefix.seeds:
        draft_batch, hidden, dlast = seeded_draft_batch(chunks, final, prefix, batch, shifted,
                                                        out.hidden, boundary_hidden)
    else:
        draft_batch, hidden, dlast = dataclasses.replace(batch, input_ids=shifted), out.hidden, last
    dout = m.draft(draft_batch, hidden, m.draft_pool)
    cand1, q1 = _candidate(dout.logits[dlast], params, lens)
    return bonus, cand1, dout.hidden[dlast], q1, lp


def seeded_draft_batch(chunks: list[Chunk], final: list[int], prefix: PrefillPrefix,
                       batch: ForwardBatch, shifted: torch.Tensor, hidden: torch.Tensor,
                       boundary_hidden: torch.Tensor):
    """The draft's rows of a prefill where chunk c seeded from snapshot ``prefix.seeds[c]``
    starts one row early: position start - 1, this chunk's first token (the token after
    it), the kept target hidden there. -> (batch, hidden [T', hc*H], the final chunks'
    last rows [F])."""
    device, t = shifted.device, batch.num_rows
    src, dchunks, ends, at, seeds = [], [], [], 0, []
    for c, snap in zip(chunks, prefix.seeds):
        n = len(c.tokens)
        if snap:
            src.append(t + len(seeds))  # the seed row, after the forward's rows
            seeds.append((c.tokens[0], snap))
        src.extend(range(at, at + n))
        at += n
        dchunks.append(Chunk(c.req_index, c.start - bool(snap), range(n + bool(snap))))
        ends.append(len(src) - 1)
    index = torch.tensor(src, device=device)  # [T'] row of (forward rows, then seed rows)
    ids = torch.tensor([tok for tok, _ in seeds], device=device, dtype=shifted.dtype)
    snaps = torch.tensor([s for _, s in seeds], device=device)
    snap_rows = None
    if prefix.snapshot:  # a seed row's boundary is the hit's: cached already
        snap_rows = [prefix.snapshot[i] if i < t else 0 for i in src]
    draft = ForwardBatch.from_chunks(dchunks, device, snapshot=snap_rows)
    draft = dataclasses.replace(draft, input_ids=torch.cat((shifted, ids))[index])
    rows = torch.cat((hidden, boundary_hidden[snaps]))[index]  # [T', hc*H]
    return draft, rows, torch.tensor([ends[i] for i in final], device=device, dtype=torch.long)
