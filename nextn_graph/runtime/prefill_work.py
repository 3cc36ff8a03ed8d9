"""A step's prefill as data: ``PrefillWork`` is what rank 0 decided (the chunks, the
prefix cache's copies, the sampling of the final chunks) and the one argument of the
device prefill (``Prefiller.run``) on every rank: rank 0 sends it to the others as it is.
Host only, picklable."""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.batch import Chunk
from ..sampling import SamplingParams
from .request import Request


@dataclass(frozen=True)
class PrefillPrefix:
    """A prefill step's prefix-cache work on the device (``runtime/prefix_reuse.py``)."""

    # (snapshot, request row, boundary): the ring state before the boundary, copied first
    restore: tuple[tuple[int, int, int], ...] = ()
    # per forward row: the snapshot of the row's next page boundary (0: none); ()
    # when no row keeps anything (the forward then skips the snapshot writes)
    snapshot: tuple[int, ...] = ()
    # per chunk: the snapshot whose kept hidden seeds a draft row at start - 1 (0: none)
    seeds: tuple[int, ...] = ()
    keep: tuple[tuple[int, int], ...] = ()  # (forward row, snapshot): the hidden at M - 1


NO_PREFIX = PrefillPrefix()


@dataclass(frozen=True)
class Resume:
    """A preempted request's final prefill chunk: ``prompt_len`` P, ``output`` so far
    (its last token is the bonus the prefill keeps)."""

    prompt_len: int
    output: tuple[int, ...]


@dataclass(frozen=True)
class PrefillWork:
    """One step's prefill on the device, the same on every rank."""

    chunks: tuple[Chunk, ...]
    nexts: tuple[int | None, ...]  # per chunk: the prompt's next token; None: a final chunk
    params: tuple[SamplingParams, ...]  # per final chunk
    # (row, pages) of each request whose first chunk this is: rank 0 allocated them, the
    # other ranks write the same page-table rows
    tables: tuple[tuple[int, tuple[int, ...]], ...] = ()
    prefix: PrefillPrefix = NO_PREFIX
    # the prompt tokens the penalties count, where they differ from ``chunks`` (a hit's
    # cached ones, a resumed request's prompt alone); None: the chunks'
    marks: tuple[Chunk, ...] | None = None
    resumes: tuple[Resume | None, ...] = ()  # per final chunk: a preempted request's
    lp_rows: tuple[int, ...] = ()  # forward rows whose logprobs rank 0 reads back
    lp_k: int = 0  # top logprobs per row

    @property
    def finals(self) -> tuple[Chunk, ...]:
        return tuple(c for c, n in zip(self.chunks, self.nexts) if n is None)


def logprob_rows(plan: list[tuple[Request, int]]) -> tuple[dict[int, list[int]], int]:
    """-> (batch rows whose logprobs were asked, by rid: all chunk rows for prompt
    logprobs, else a final chunk's last row; the largest k asked)."""
    rows, k, at = {}, 0, 0
    for req, end in plan:
        n, final = end - req.prefilled, end == req.fill_len
        if req.output:  # resumed: its logprobs went out with its tokens
            pass
        elif req.prompt_logprobs is not None:
            rows[req.rid] = list(range(at, at + n))
        elif final and req.logprobs is not None:
            rows[req.rid] = [at + n - 1]
        if req.rid in rows:
            k = max(k, req.logprobs or 0, req.prompt_logprobs or 0)
        at += n
    return rows, k


def prompt_marks(chunk: Chunk, req: Request, seeded: int) -> Chunk:
    """The prompt tokens the penalties count for ``chunk`` of ``req``: a resumed request's
    prompt with its first chunk and nothing after; a hit's prompt up to the chunk's end
    with its first (``seeded``); else the chunk's own."""
    if req.output:
        first = chunk.start == req.cached
        return Chunk(chunk.req_index, 0 if first else chunk.start, req.prompt if first else [])
    if seeded:
        return Chunk(chunk.req_index, 0, req.prompt[:chunk.start + len(chunk.tokens)])
    return chunk
