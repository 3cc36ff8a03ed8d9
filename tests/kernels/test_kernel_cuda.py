"""On a GPU: the fused Triton kernels compiled for it, against their references, and the
tiny trained checkpoint on them (graphs = eager, spec = reference token for token).
Skipped without CUDA; ``perf/device_check.py`` runs these (``-m cuda``) and
``perf/kernel_bench.py`` times each op. Not yet run on a GPU."""

from __future__ import annotations

import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint, save_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.kernels import TRITON
from nextn_graph.kernels.cases import V4_FLASH, cases
from nextn_graph.kernels.cases_sparse import gemm_cases, sparse_cases
from nextn_graph.model.ops import kernels_of
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.generate import reference_generate

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Relative to the reference's largest value: a reduction of up to 16384 terms in another
# order in fp32 (the interpreter measured <= 64 ULPs, about 8e-6), one rounding in bf16
# (2**-8), with room for the GPU's FMA contraction and its approximate exp.
REL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}


def _check(case) -> None:
    fused, ref = case.fused(), case.reference()
    fused = fused if isinstance(fused, tuple) else (fused,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for a, b in zip(fused, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, case.name
        if not b.is_floating_point():
            assert torch.equal(a, b), case.name
            continue
        scale = b.float().abs().max()
        err = (a.float() - b.float()).abs().max() / scale
        assert err <= REL[b.dtype], (case.name, float(err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_fused_ops_equal_their_references_on_the_gpu(dtype, rows):
    for case in cases(rows, V4_FLASH, dtype, "cuda"):
        _check(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 32])
def test_gemms_and_sparse_kernels_equal_their_references_on_the_gpu(dtype, rows):
    """Part 2: the GEMMs on the stored bits; sparse attention and the indexer at 4K and
    128K cached positions (``cases_sparse.py``)."""
    gen = torch.Generator().manual_seed(0)
    for case in (gemm_cases(rows, V4_FLASH, dtype, "cuda", gen)
                 + sparse_cases(rows, V4_FLASH, dtype, "cuda", gen)):
        _check(case)


def test_tiny_fp8_checkpoint_on_triton_kernels_on_the_gpu(tmp_path):
    """The release's dtypes (FP8 / FP4) on the fused GEMMs: greedy tokens equal the same
    checkpoint dequantized on the reference kernels."""
    path = save_checkpoint(load_checkpoint("builtin:tiny-trained"), tmp_path / "fp8",
                           quantize="fp8")
    fused = load_checkpoint(path, device="cuda")  # auto: Triton
    plain = load_checkpoint(path, device="cuda", weights="dequantized", kernels="reference")
    prompts = [[5, 17, 99, 3, 42, 7, 250, 11, 64], [8, 31, 200, 17, 5, 9, 90, 101, 33, 2]]
    ref = reference_generate(plain.target, prompts, 16, stop_ids=set()).outputs
    engine = SpecEngine(fused.target, fused.draft, SpeculativeConfig(num_steps=3),
                        PoolConfig(max_requests=2, max_context=64),
                        GraphConfig(backend="cuda", buckets=(1, 2), round="fused"))
    assert engine.generate(prompts, 16, stop_ids=[]).outputs == ref


def test_tiny_trained_on_triton_kernels_on_the_gpu():
    models = load_checkpoint("builtin:tiny-trained", device="cuda")  # auto: Triton
    assert kernels_of(models.target) is TRITON
    prompts = [[5, 17, 99, 3, 42, 7, 250, 11, 64], [8, 31, 200, 17, 5, 9, 90, 101, 33, 2]]
    ref = reference_generate(models.target, prompts, 16, stop_ids=set()).outputs
    spec, pool = SpeculativeConfig(num_steps=3), PoolConfig(max_requests=2, max_context=64)
    for graph in (None, GraphConfig(backend="cuda", buckets=(1, 2), round="fused"),
                  GraphConfig(backend="cuda", buckets=(1, 2), round="split")):
        engine = SpecEngine(models.target, models.draft, spec, pool, graph)
        assert engine.generate(prompts, 16, stop_ids=[]).outputs == ref, graph
