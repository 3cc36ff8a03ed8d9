"""KVPool layout per compress ratio, ring sizes, and the request-row allocator."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import torch

from nextn_graph.errors import CapacityError
from nextn_graph.memory.batch import Chunk, ForwardBatch
from nextn_graph.memory.pool import KVPool, PoolLayout, device_memory_bytes, pool_nbytes
from nextn_graph.model.config import NEXTN_COMPRESS_RATIO


def test_layer_storage_follows_compress_ratio(tiny):
    """Ratio 0: SWA ring only; ratio 4: SWA + compressed entries + indexer keys;
    ratio 128: SWA + compressed entries, no indexer."""
    pool = tiny.target_pool(2, 256, 4)
    ratios = tiny.target.layer_ratios()
    assert sorted(set(ratios)) == [0, 4, 128]  # the tiny preset covers every kind
    for ratio, layer in zip(ratios, pool.layers, strict=True):
        assert layer.swa is not None
        assert (layer.compressed is not None) == (ratio > 0)
        assert (layer.index is not None) == (ratio == 4)
        if ratio:
            assert layer.compressed.per_request == 256 // ratio
            assert layer.compressed.entries.shape[0] == pool.layout.rows * 256 // ratio


@pytest.mark.parametrize("verify_width", [1, 2, 4, 8])
def test_ring_sizes_leave_room_for_the_verify_window(tiny, verify_width):
    """SWA rings hold window + N - 1 positions; compressor raw rings hold one entry's
    span (2*ratio for C4, ratio for C128) + N - 1, so a rejected window never clobbers
    a position the next round still reads."""
    pool = tiny.target_pool(1, 256, verify_width)
    for ratio, layer in zip(tiny.target.layer_ratios(), pool.layers):
        assert layer.swa.size >= tiny.cfg.sliding_window + verify_width - 1
        assert layer.swa.data.shape[0] == pool.layout.rows * layer.swa.size
        for c in (layer.compressed, layer.index):
            if c is not None:
                span = (2 if ratio == 4 else 1) * ratio
                assert c.raw.size >= span + verify_width - 1


def test_alloc_hands_out_every_row_but_zero_then_raises(tiny):
    """Row 0 is padding and never allocated; a full pool raises CapacityError."""
    pool = tiny.target_pool(3, 128, 4)
    got = [pool.alloc() for _ in range(3)]
    assert sorted(got) == [1, 2, 3] and pool.free_rows == 0
    with pytest.raises(CapacityError):
        pool.alloc()
    pool.release(got[1])
    assert pool.alloc() == got[1]  # a released row is reused


@pytest.mark.parametrize("row", [0, 2, 4, -1])
def test_release_of_unallocated_row_raises(tiny, row):
    """Releasing row 0, a free row or one outside the pool is an error, not a silent
    double entry in the free list."""
    pool = tiny.target_pool(3, 128, 4)
    assert pool.alloc() == 1
    with pytest.raises(CapacityError):
        pool.release(row)
    assert pool.free_rows == 2


def test_double_release_raises(tiny):
    pool = tiny.target_pool(2, 128, 4)
    row = pool.alloc()
    pool.release(row)
    with pytest.raises(CapacityError):
        pool.release(row)


def test_context_beyond_rope_table_raises(tiny):
    """A pool longer than max_position_embeddings is refused up front."""
    with pytest.raises(CapacityError, match="max_position_embeddings"):
        KVPool(tiny.cfg, PoolLayout(1, tiny.cfg.max_position_embeddings + 1, 4),
               tiny.target.layer_ratios())


def test_short_context_pool_runs(tiny):
    """A pool shorter than one C128 block still runs and matches the reference (regression:
    it once had 0 C128 entries per request and the entry write crashed)."""
    pool = tiny.target_pool(1, 64, 4)
    ids = tiny.tokens(40, seed=80)
    out = tiny.target(ForwardBatch.from_chunks([Chunk(pool.alloc(), 0, ids.tolist())]), pool)
    torch.testing.assert_close(out.logits, tiny.target.reference(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.process
def test_pool_module_imports_first():
    """``import nextn_graph.memory.pool`` works in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", "import nextn_graph.memory.pool"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-500:]


@pytest.mark.parametrize("max_requests, max_context, verify_width, dtype, snapshots", [
    (1, 512, 1, torch.float32, 0), (3, 256, 4, torch.bfloat16, 0),
    (2, 64, 8, torch.float16, 0),
    (5, 130, 3, torch.float32, 0),  # a context that is no multiple of 4 or 128
    (3, 512, 4, torch.float32, 7),  # prefix-cache snapshots: SWA window, C4 raw block
])
def test_pool_estimate_equals_allocated_bytes(tiny, max_requests, max_context, verify_width,
                                              dtype, snapshots):
    """pool_nbytes, computed before allocating, equals nbytes() of the built pool and the
    bytes of its tensors, for target (ratios 0 / 4 / 128) and draft pools."""
    layout = PoolLayout(max_requests, max_context, verify_width, snapshots=snapshots)
    for ratios in (tiny.target.layer_ratios(), [NEXTN_COMPRESS_RATIO]):
        pool = KVPool(tiny.cfg, layout, ratios, dtype=dtype)
        tensors = [t for layer in pool.layers for t in (
            layer.swa.data, *(x for c in (layer.compressed, layer.index) if c is not None
                              for x in (c.raw.data, c.entries)))]
        tensors += [r.snapshots for r in pool.rings() if r.snapshots is not None]
        assert any(r.snapshots is not None for r in pool.rings()) == bool(snapshots)
        assert pool_nbytes(tiny.cfg, layout, ratios, dtype) == pool.nbytes()
        assert pool.nbytes() == sum(t.nbytes for t in tensors) + pool.table.nbytes
        assert pool.table.dtype == torch.int32 and pool.table.shape == (
            layout.rows, layout.pages_per_request if ratios != [NEXTN_COMPRESS_RATIO] else 0)
        assert all(t.dtype == dtype for t in tensors)


def test_absurd_pool_refused_with_figure_before_allocating(tiny):
    """pool.max_requests 100000000 once tried to allocate ~243 GB: now a CapacityError
    gives the figure in GiB and the memory it exceeds, and nothing was allocated
    (the process's peak resident memory did not grow)."""
    ratios = tiny.target.layer_ratios()
    ram = device_memory_bytes("cpu")
    per_row = pool_nbytes(tiny.cfg, PoolLayout(2, 512, 4), ratios, torch.float32) // 3
    layout = PoolLayout(max(10**8, 2 * ram // per_row), 512, 4)
    need = pool_nbytes(tiny.cfg, layout, ratios, torch.float32)
    assert need > ram
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(CapacityError) as info:
        KVPool(tiny.cfg, layout, ratios)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024
    assert str(info.value) == (
        f"the KV pool of max_requests {layout.max_requests} x max_context 512 "
        f"({layout.pages} pages of 256, verify width 4, {len(ratios)} layers, torch.float32) needs {need / 2**30:.1f} GiB, more than the "
        f"{ram / 2**30:.1f} GiB of physical memory on cpu")


@pytest.mark.parametrize("layout, needle", [
    (PoolLayout(0, 64, 4), "pool max_requests must be an int of at least 1, got 0"),
    (PoolLayout(-5, 64, 4), "pool max_requests must be an int of at least 1, got -5"),
    (PoolLayout(True, 64, 4), "pool max_requests must be an int of at least 1, got True"),
    (PoolLayout(2, 0, 4), "pool max_context must be an int of at least 1, got 0"),
    (PoolLayout(2, 64, 0), "pool verify_width must be an int of at least 1, got 0"),
])
def test_bad_pool_layout_refused(tiny, layout, needle):
    """Zero or negative sizes are a named error, not a torch error on a negative dim."""
    with pytest.raises(CapacityError) as info:
        KVPool(tiny.cfg, layout, tiny.target.layer_ratios())
    assert str(info.value) == needle


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_absurd_cuda_pool_refused_against_free_device_memory(tiny):
    """On CUDA the bound is the free device memory (torch.cuda.mem_get_info)."""
    ratios = tiny.target.layer_ratios()
    free = torch.cuda.mem_get_info()[0]
    per_row = pool_nbytes(tiny.cfg, PoolLayout(2, 512, 4), ratios, torch.float32) // 3
    layout = PoolLayout(2 * free // per_row, 512, 4)
    with pytest.raises(CapacityError, match=r"GiB of free device memory on cuda"):
        KVPool(tiny.cfg, layout, ratios, device="cuda")
    small = KVPool(tiny.cfg, PoolLayout(2, 64, 4), ratios, device="cuda")
    assert small.nbytes() == pool_nbytes(tiny.cfg, PoolLayout(2, 64, 4), ratios, torch.float32)
