"""The device forward of a prefill step: the target over its prompt chunks, the bonus
of each final chunk, then the draft extend for prefill (candidate 1 and the draft's seed),
with the prefix cache's snapshot writes and seeded draft rows. Variable length: eager,
never captured."""

from __future__ import annotations

import dataclasses

import torch

from ..labels import ACCEPT_SAMPLING
from ..memory.batch import Chunk, ForwardBatch
from ..sampling import RowParams
from .eagle import candidate, token_logprobs
from .models import SpecModels
from .prefill_work import NO_PREFIX, PrefillPrefix

profile_label = ACCEPT_SAMPLING  # argmax, the bonus, candidate 1 (labels.py)


def prefill_forward(m: SpecModels, chunks: list[Chunk], nexts: list[int | None], device,
                    with_draft: bool = True, params: RowParams | None = None,
                    lp_rows: torch.Tensor | None = None, lp_k: int = 0, process=None,
                    prefix: PrefillPrefix = NO_PREFIX,
                    boundary_hidden: torch.Tensor | None = None,
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
    cand1, q1 = candidate(dout.logits[dlast], params, lens)
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
