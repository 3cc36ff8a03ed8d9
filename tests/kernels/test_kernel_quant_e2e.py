"""The tiny trained checkpoint in the release's dtypes (FP8 linears with e8m0 block scales,
FP4 routed experts) on the Triton set under the interpreter: every quantized GEMM reads the
stored bits (``kernels/gemm.py``) and attention, the indexer and the compressor run the
sparse kernels over index lists. Its greedy speculative output equals the output of the same
checkpoint dequantized at load on the reference kernels (no-cache greedy decoding), on the
bench prompts.

Tolerance: the two differ only by rounding (the fused kernels sum exact products in another
order and keep fp32 inside; logits agree to ~1e-5 relative), so tokens are equal unless two
logits tie within that; the test asserts equality, and the logits' agreement is checked
first so a failure says which it was.
"""

from __future__ import annotations

import pytest
import torch

from nextn_graph.bench.measure import bench_prompts
from nextn_graph.checkpoint import load_checkpoint, save_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.kernels import REFERENCE, TRITON
from nextn_graph.memory.batch import Chunk, ForwardBatch
from nextn_graph.memory.pool import PoolLayout
from nextn_graph.model.ops import kernels_of
from nextn_graph.model.quant import QuantLinear
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.generate import reference_generate

pytestmark = pytest.mark.compile  # interpreted Triton over a whole quantized model

PROMPTS, NEW_TOKENS = 2, 5  # the bench's first prompts (seed 11), 16 and 24 tokens


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory, trained):
    root = tmp_path_factory.mktemp("fp8") / "tiny-fp8"
    return save_checkpoint(trained, root, quantize="fp8")


def test_quantized_triton_equals_the_dequantized_reference(fp8_dir):
    fused = load_checkpoint(fp8_dir, kernels="triton")
    plain = load_checkpoint(fp8_dir, weights="dequantized", kernels="reference")
    assert kernels_of(fused.target) is TRITON and kernels_of(plain.target) is REFERENCE
    assert any(isinstance(m, QuantLinear) for m in fused.target.modules())
    assert not any(isinstance(m, QuantLinear) for m in plain.target.modules())
    prompts = bench_prompts(fused.cfg.vocab_size, PROMPTS, seed=11)

    # one prefill: the logits agree to rounding, so the sets really differ only there
    layout = PoolLayout(1, 64, 4)
    logits = []
    for models in (fused, plain):
        pool = models.target.new_pool(layout)
        batch = ForwardBatch.from_chunks([Chunk(pool.alloc(), 0, prompts[0])])
        logits.append(models.target(batch, pool).logits)
    scale = logits[1].abs().max()
    assert not torch.equal(logits[0], logits[1])
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4 * scale)

    want = reference_generate(plain.target, prompts, NEW_TOKENS, stop_ids=set()).outputs
    engine = SpecEngine(fused.target, fused.draft, SpeculativeConfig(num_steps=3),
                        PoolConfig(max_requests=PROMPTS, max_context=64),
                        GraphConfig(backend="cpu", buckets=(PROMPTS,), round="fused"))
    got = engine.generate(prompts, NEW_TOKENS, stop_ids=[])
    assert got.outputs == want
    assert got.stats["graph_replays"] > 0 and got.stats["accepted_drafts"] > 0
