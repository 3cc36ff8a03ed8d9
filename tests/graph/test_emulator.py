"""The strict CPU graph emulator (``CpuGraph``) and its backend (``CpuBackend``).

What a real CUDA / NPU graph cannot hold must be refused at capture, naming the
op and the line that called it; what it can hold must replay bitwise equal to
eager, re-run in-place ops, overwrite its static outputs, follow views of its
static inputs and take host-side sequence lengths through ``update()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.graph.backends import CpuBackend
from nextn_graph.graph.emulator import CaptureError, CpuGraph
from nextn_graph.graph.updates import UpdateContext
from nextn_graph.memory.batch import Chunk, ForwardBatch
from nextn_graph.runtime.engine import SpecEngine

from helpers import SEQLEN_OP, seqlen_op, seqlen_registry

HERE = Path(__file__).name
OP_NAME = SEQLEN_OP




# -- 1. capture safety -------------------------------------------------------------
# Each case does one forbidden thing on the line right after its ``def``.

def _item(y, mask):
    return y.sum().item()


def _tolist(y, mask):
    return y.tolist()


def _bool(y, mask):
    return bool(y[0] > 0)


def _int(y, mask):
    return int(y[0])


def _nonzero(y, mask):
    return y.nonzero()


def _where_one_arg(y, mask):
    return torch.where(mask)


def _mask_index(y, mask):
    return y[mask]


def _unique(y, mask):
    return torch.unique(y)


def _repeat_interleave(y, mask):
    return y.repeat_interleave(mask.long())


def _host_tensor(y, mask):
    return y + torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def _rand(y, mask):
    return y + torch.rand(6)


def _randn(y, mask):
    return y + torch.randn(6)


def _dropout(y, mask):
    return torch.nn.functional.dropout(y, 0.5, training=True)


FORBIDDEN = [
    (_item, ".item()"), (_tolist, ".tolist()"), (_bool, "bool() of a tensor"),
    (_int, "int() of a tensor"), (_nonzero, "aten.nonzero"), (_where_one_arg, "aten.nonzero"),
    (_mask_index, "boolean-mask indexing"), (_unique, "unique"),
    (_repeat_interleave, "repeat_interleave without output_size"),
    (_host_tensor, "a tensor built from host data"), (_rand, "aten.rand."), (_randn, "aten.randn."),
    (_dropout, "RNG op bernoulli"),
]


@pytest.mark.parametrize("case, names", FORBIDDEN, ids=[c.__name__[1:] for c, _ in FORBIDDEN])
def test_capture_refuses_what_a_graph_cannot_hold(case, names):
    """A graph-unsafe op raises CaptureError naming it and this file:line, leaving no steps."""
    x = torch.arange(6.0)
    mask = x > 2
    graph = CpuGraph()

    def fn():
        y = x * 2  # recorded before the failure: a failed capture must drop it
        return case(y, mask)

    with pytest.raises(CaptureError) as info:
        graph.capture(fn)
    msg = str(info.value)
    assert names in msg, msg
    assert f"{HERE}:{case.__code__.co_firstlineno + 1}" in msg, msg
    assert graph.num_ops == 0 and graph.updates == [] and graph.outputs is None
    with pytest.raises(CaptureError, match="nothing was captured"):
        graph.replay()
    assert torch.ones(2).sum().item() == 2.0  # the capture modes are gone after the failure


def test_repeat_interleave_with_output_size_is_captured():
    """repeat_interleave with output_size is captured, and replays follow new repeat counts."""
    x, reps = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2, 3])
    graph = CpuGraph()
    out = graph.capture(lambda: x.repeat_interleave(reps, output_size=6))
    assert graph.num_ops > 0
    assert out.tolist() == [1, 2, 2, 3, 3, 3]
    reps.copy_(torch.tensor([3, 0, 3]))
    graph.replay()
    assert out.tolist() == [1, 1, 1, 3, 3, 3]


# -- 2. the real model's graphs -----------------------------------------------------

def _engine(tiny, num_steps: int, buckets=(1, 2, 4), round_mode="split") -> SpecEngine:
    return SpecEngine(tiny.target, tiny.draft,
                      SpeculativeConfig(num_steps=num_steps, num_draft_tokens=num_steps + 1),
                      PoolConfig(4, 256), GraphConfig(backend="cpu", buckets=buckets,
                                                      round=round_mode))


def test_model_phases_capture_cleanly(tiny):
    """All three phase kinds and their sampling variants capture cleanly for every bucket,
    largest first, with ops and bytes (no RNG op: the sampling variants draw keyed
    uniforms with integer tensor ops)."""
    engine = _engine(tiny, num_steps=3)
    records = engine.runner.records
    got = {(r.name, r.bucket) for r in records}
    kinds = ("rollout", "target_verify", "draft_extend")
    assert got == {(k + v, b) for k in kinds for v in ("", "+sampling") for b in (1, 2, 4)}
    assert len(records) == 18 and {(k.name, k.bucket) for k in engine.runner.graphs} == got
    assert all(r.ops > 0 and r.nbytes > 0 and r.seconds > 0 for r in records), records
    buckets = [r.bucket for r in records]
    assert buckets == sorted(buckets, reverse=True)


def test_fused_round_is_one_graph_per_bucket(tiny):
    """graph.round fused: one graph per bucket (kind "round"), holding every phase's ops."""
    split, fused = _engine(tiny, num_steps=3), _engine(tiny, num_steps=3, round_mode="fused")
    assert {(r.name, r.bucket) for r in fused.runner.records} == {
        (k, b) for k in ("round", "round+sampling") for b in (1, 2, 4)}
    for b in (1, 2, 4):
        for variant in ("", "+sampling"):
            phase_ops = sum(r.ops for r in split.runner.records
                            if r.bucket == b and r.name.endswith(variant or "_"))
            (rec,) = [r for r in fused.runner.records if (r.name, r.bucket) == ("round" + variant, b)]
            assert rec.ops > phase_ops  # the three phases, plus the in-graph slot flip


def test_one_step_captures_no_rollout(tiny):
    """With num_steps 1 (candidate 1 from draft extend) no rollout graph is captured."""
    engine = _engine(tiny, num_steps=1, buckets=(1, 2))
    got = {(r.name.removesuffix("+sampling"), r.bucket) for r in engine.runner.records}
    assert got == {(k, b) for k in ("target_verify", "draft_extend") for b in (1, 2)}


# -- 3. bitwise parity of a captured forward ----------------------------------------

PROMPT_LENS = (3, 9, 17, 20)  # around the sliding window (16) and C4 blocks (4)
ROWS_PER_STEP = 8  # the static batch: 4 requests x up to 2 rows, padded
# Per decode step: (request index, rows) for the requests that take part.
SCHEDULE = [
    [(0, 2), (1, 2), (2, 2), (3, 2)], [(0, 1), (2, 2), (3, 1)], [(3, 2)],
    [(1, 1), (0, 2)], [(0, 2), (1, 2), (2, 2), (3, 2)], [(2, 1)], [(1, 2), (3, 2)],
]


def _static_batch(rows: int) -> ForwardBatch:
    """All padding: request row 0, position 0, cache_start 0, seq_end 1."""
    zeros = lambda: torch.zeros(rows, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(zeros(), zeros(), zeros(), zeros(), torch.ones(rows, dtype=torch.int64))


def _copy_batch(static: ForwardBatch, new: ForwardBatch) -> None:
    for name in ("input_ids", "positions", "req_index", "cache_start", "seq_end"):
        getattr(static, name).copy_(getattr(new, name))


def _pool_tensors(pool) -> list[torch.Tensor]:
    out = []
    for layer in pool.layers:
        out.append(layer.swa.data)
        for c in (layer.compressed, layer.index):
            if c is not None:
                out += [c.raw.data, c.entries]
    return out


def _check_parity(tiny, make_pool, forward, hidden_rows: bool) -> None:
    """Capture ``forward(batch, hidden, pool)`` over static tensors in one pool while a
    twin pool runs eagerly; replayed decode steps must equal eager bitwise."""
    gen = torch.Generator().manual_seed(7)
    hc = tiny.cfg.hc_dim
    pool_g, pool_e = make_pool(), make_pool()
    rows = [pool_g.alloc() for _ in PROMPT_LENS]
    assert rows == [pool_e.alloc() for _ in PROMPT_LENS]
    seqs = [tiny.tokens(n, seed=100 + i).tolist() for i, n in enumerate(PROMPT_LENS)]
    prefill = ForwardBatch.from_chunks([Chunk(r, 0, s) for r, s in zip(rows, seqs)])
    h = torch.randn(prefill.num_rows, hc, generator=gen)
    assert torch.equal(forward(prefill, h, pool_g).logits, forward(prefill, h, pool_e).logits)

    static = _static_batch(ROWS_PER_STEP)
    static_hidden = torch.zeros(ROWS_PER_STEP, hc)  # [T, hc*H]
    graph = CpuGraph()
    out = graph.capture(lambda: forward(static, static_hidden, pool_g))
    forward(_static_batch(ROWS_PER_STEP), torch.zeros(ROWS_PER_STEP, hc), pool_e)  # the twin
    assert graph.num_ops > 0

    for step in SCHEDULE:
        chunks = []
        for i, n in step:
            new = tiny.tokens(n, seed=len(seqs[i]) * 31 + i).tolist()
            chunks.append(Chunk(rows[i], len(seqs[i]), new))
            seqs[i] += new
        batch = ForwardBatch.from_chunks(chunks, pad_to=ROWS_PER_STEP)
        hidden = torch.randn(ROWS_PER_STEP, hc, generator=gen) if hidden_rows else None
        _copy_batch(static, batch)
        if hidden is not None:
            static_hidden.copy_(hidden)
        graph.replay()
        eager = forward(batch, hidden, pool_e)
        assert torch.equal(out.logits, eager.logits), f"logits differ at step {step}"
        assert torch.equal(out.hidden, eager.hidden), f"hidden differs at step {step}"
    for a, b in zip(_pool_tensors(pool_g), _pool_tensors(pool_e), strict=True):
        assert torch.equal(a, b)


def test_target_forward_replays_bitwise(tiny):
    """A captured target forward replays changing padded decode batches bitwise equal to eager."""
    _check_parity(tiny, lambda: tiny.target_pool(4, 64, 4),
                  lambda batch, hidden, pool: tiny.target(batch, pool), hidden_rows=False)


def test_draft_forward_replays_bitwise(tiny):
    """A captured NextN draft forward replays new batches and hidden bitwise equal to eager."""
    _check_parity(tiny, lambda: tiny.draft_pool(4, 64, 4),
                  lambda batch, hidden, pool: tiny.draft(batch, hidden, pool), hidden_rows=True)


# -- 4. replay semantics -------------------------------------------------------------

def test_inplace_ops_rerun_on_replay():
    """In-place ops re-run on every replay: a captured counter replayed 3 times gains 3."""
    counter = torch.zeros((), dtype=torch.int64)
    table, idx = torch.zeros(4), torch.tensor([1, 3])
    graph = CpuGraph()

    def fn():
        counter.add_(1)
        table.index_put_((idx,), torch.ones(2), accumulate=True)

    graph.capture(fn)
    assert int(counter) == 1 and table.tolist() == [0, 1, 0, 1]
    for _ in range(3):
        graph.replay()
    assert int(counter) == 4 and table.tolist() == [0, 4, 0, 4]


def test_outputs_are_overwritten_by_next_replay():
    """The next replay overwrites the static output in place; an earlier clone keeps its value."""
    x = torch.arange(4.0)
    graph = CpuGraph()
    out = graph.capture(lambda: x * 2 + 1)
    ptr, kept = out.data_ptr(), out.clone()
    x.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    graph.replay()
    assert kept.tolist() == [1, 3, 5, 7]
    assert out.tolist() == [21, 41, 61, 81] and out.data_ptr() == ptr
    assert graph.outputs is out


def test_views_follow_static_inputs():
    """Views alias static inputs, and results over views / reshapes / matmul follow new inputs."""
    x = torch.arange(12.0).view(3, 4)
    w = torch.linspace(-1.0, 1.0, 8).view(4, 2)

    def fn():
        v = x[1:]  # [2, 4] view
        return v, x.t(), (v * 10).sum(0), x.t().reshape(-1), torch.matmul(x.view(1, 3, 4), w)

    graph = CpuGraph()
    outs = graph.capture(fn)
    assert outs[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    x.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(3)))
    graph.replay()
    for got, want in zip(outs, fn(), strict=True):
        assert torch.equal(got, want)


# -- 5. updates of host arguments -----------------------------------------------------

def test_update_rewrites_host_lengths_before_replay():
    """update() lens change the next replay; require_update refuses a replay without update()."""
    op = seqlen_op()
    x = torch.tensor([1.0, 2.0])
    graph = CpuGraph(require_update=True, updatable=seqlen_registry())
    out = graph.capture(lambda: op(x, [1, 2]))
    assert out.tolist() == [3, 6]
    assert graph.update_ops == [f"{OP_NAME}.default"]
    with pytest.raises(CaptureError, match="no update"):
        graph.replay()
    graph.update([{"lens": [4, 1]}])
    graph.replay()
    assert out.tolist() == [5, 10]
    with pytest.raises(CaptureError, match="no update"):  # one update serves one replay
        graph.replay()
    x.copy_(torch.tensor([-1.0, 0.5]))
    graph.update([{"lens": [2]}])
    graph.replay()
    assert out.tolist() == [-2, 1]


def test_update_dicts_per_op_count_and_broadcast():
    """Two updatable ops take one dict each in order, one dict broadcasts, other counts raise."""
    op = seqlen_op()
    x = torch.tensor([1.0])
    graph = CpuGraph(require_update=True, updatable=seqlen_registry())
    out = graph.capture(lambda: op(op(x, [1]), [2]))
    assert out.tolist() == [2] and len(graph.update_ops) == 2
    graph.update([{"lens": [3]}, {"lens": [5]}])
    graph.replay()
    assert out.tolist() == [15]
    graph.update([{"lens": [7]}])
    graph.replay()
    assert out.tolist() == [49]
    for bad in ([], [{"lens": [1]}] * 3):
        with pytest.raises(CaptureError, match=f"recorded 2 updatable op.*{len(bad)} update"):
            graph.update(bad)


def test_cpu_backend_replays_derived_updates():
    """CpuBackend graphs list updatable ops and replay dicts the registry derives from a context."""
    op = seqlen_op()
    reg = seqlen_registry()
    x = torch.tensor([1.0, 10.0])
    graph = CpuBackend(reg).capture(lambda: op(x, [0]), None)
    assert graph.update_ops == [f"{OP_NAME}.default"] and graph.ops > 0
    ctx = UpdateContext(bucket=2, width=4, rows=(3, 0), lengths=(7, 0))
    update = reg.derive(graph.update_ops, ctx)
    assert update == [{"lens": [7, 0]}]
    graph.replay(update)
    assert graph.graph.outputs.tolist() == [7, 70]
    with pytest.raises(CaptureError, match="no update"):
        graph.replay()


# -- 6. is_capturing ---------------------------------------------------------------

def test_cpu_backend_is_capturing_only_inside_capture():
    """is_capturing() is True inside the captured function only (not after success or failure)."""
    backend = CpuBackend()
    x = torch.ones(3)
    seen = []

    def fn():
        seen.append(backend.is_capturing())
        return x + 1

    assert not backend.is_capturing()
    graph = backend.capture(fn, backend.new_pool())
    assert seen == [True] and not backend.is_capturing()
    graph.replay()
    assert seen == [True]  # a replay re-runs kernels, not Python
    with pytest.raises(CaptureError):
        backend.capture(lambda: x.sum().item(), None)
    assert not backend.is_capturing()
