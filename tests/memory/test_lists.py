"""Index lists (``memory/lists.py``) name exactly the keys today's gathers read.

For every row of a forward mixing a prefill chunk, decode rows and padding, the window
list's first ``count`` entries hold the same values (ring slot or the forward's own row)
as ``Ring.gather_recent`` returns for the valid positions, in the same order; entries past
the count are in range; a compressor's candidate list reads what ``gather_recent`` reads;
C128's entry list is every finished entry of the row's request, through its pages.
"""

from __future__ import annotations

import torch

from nextn_graph.memory.batch import Chunk, ForwardBatch, ForwardPlan
from nextn_graph.memory.lists import (candidate_list, entry_list, finished_count, sequence_plan,
                                      window_list)
from nextn_graph.memory.pool import CompressedCache, Ring

SIZE, WINDOW, F = 11, 8, 3  # ring positions per request, window, features


def _forward():
    """A prefill chunk of 13 rows (request 2 from position 0), two decode windows of 3
    (requests 1 and 3, mid-sequence), two padding rows."""
    chunks = [Chunk(2, 0, list(range(13))), Chunk(1, 20, [5, 6, 7]), Chunk(3, 4, [1, 2, 3])]
    batch = ForwardBatch.from_chunks(chunks, pad_to=21)
    rows = 4 * SIZE
    ring = Ring(torch.arange(rows * F, dtype=torch.float64).view(rows, F), SIZE)
    chunk = -1 - torch.arange(batch.num_rows * F, dtype=torch.float64).view(-1, F)
    return ForwardPlan(batch), ring, chunk


def _read(ring: Ring, chunk: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    idx = idx.long()
    return torch.where((idx >= 0).unsqueeze(-1), ring.data[idx.clamp(min=0)],
                       chunk[(-1 - idx).clamp(min=0)])


def test_window_list_reads_what_gather_recent_reads():
    plan, ring, chunk = _forward()
    idx, count = window_list(plan, ring, WINDOW)
    assert idx.dtype == count.dtype == torch.int32 and idx.shape == (21, WINDOW)
    keys, ri = ring.gather_recent(chunk, plan, WINDOW)  # [T, W, F], oldest first
    got = _read(ring, chunk, idx)
    pos = plan.batch.positions
    assert torch.equal(count.long(), torch.clamp(pos + 1, max=WINDOW))
    for t in range(21):
        c = int(count[t])
        assert torch.equal(got[t, :c], keys[t][ri.valid[t]]), t
    assert int(idx.max()) < ring.data.shape[0] and int((-1 - idx).max()) < chunk.shape[0]
    assert window_list(plan, ring, WINDOW)[0] is idx  # built once per forward


def test_candidate_list_reads_what_gather_recent_reads():
    plan, ring, chunk = _forward()
    rows = plan.block_closers(4)
    idx = candidate_list(rows, ring, 8)
    keys, ri = ring.gather_recent(chunk, rows, 8)
    got = _read(ring, chunk, idx)
    assert torch.equal(got[ri.valid], keys[ri.valid])


def test_entry_list_is_every_finished_entry_of_the_request_through_its_pages():
    """Entries of 6 slots a request in pages of 4: entry j of request r is row
    ``table[r, j // 4] * 4 + j % 4``; a flat tensor's list (no cache) is 0..n-1."""
    plan, _, _ = _forward()
    table = torch.tensor([[0, 0], [5, 2], [1, 7], [3, 4]], dtype=torch.int32)  # [rows, P]
    cache = CompressedCache(Ring(torch.zeros(4, F), 1), torch.zeros(9 * 4, F), 6, 4, table)
    rows, count = entry_list(plan, cache, 6, 4)
    b = plan.batch
    assert rows.shape == (21, 6) and rows.dtype == torch.int32
    j = torch.arange(6)
    want = table[b.req_index][:, j // 4].long() * 4 + j % 4  # [T, 6]
    assert torch.equal(rows.long(), want)
    assert torch.equal(count.long(), torch.clamp((b.positions + 1) // 4, max=6))
    assert finished_count(plan, 4, 6) is count
    flat, _ = entry_list(ForwardPlan(b), None, 6, 4)
    assert torch.equal(flat.long(), j.expand(21, 6))


def test_sequence_plan_lists_only_the_sequence_rows():
    plan = sequence_plan(10, "cpu")
    idx, count = window_list(plan, Ring(torch.zeros(1, F), 1), 4)
    assert bool((idx < 0).all())
    want = torch.arange(10).unsqueeze(1) - torch.clamp(torch.arange(10) + 1, max=4).unsqueeze(1) \
        + 1 + torch.arange(4)
    own = -1 - idx.long()
    valid = torch.arange(4) < count.unsqueeze(1)
    assert torch.equal(own[valid], want[valid])
