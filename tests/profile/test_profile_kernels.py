"""The work profile counts what a device would run: a project op (``nextn_graph::``) is one
kernel (or the kernels it launches) only where the device has a kernel for it in the tree;
elsewhere its decomposition is counted (``kernels/registry.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.errors import InputError
from nextn_graph.kernels import REFERENCE, TRITON
from nextn_graph.kernels.registry import LAUNCHES, decompositions, has_device_kernel
from nextn_graph.profile import ProfileSettings, profile_round
from nextn_graph.profile.build import build_config, count_round, decode_round, profile_models
from nextn_graph.profile.counter import WorkCounter
from nextn_graph.profile.kinds import KindResolver

TINY = preset_config("tiny")
SMALL = ProfileSettings(bucket=2, max_requests=4, max_context=64)


def _counted(st: ProfileSettings, kernels, backend: str = "cuda") -> WorkCounter:
    models = profile_models(build_config(TINY, st.max_context), st.weights, st.dtype,
                            kernels=kernels)
    counter = WorkCounter(KindResolver(), memo=True,
                          decompose=decompositions(backend, st.dtype))
    count_round(decode_round(models, st), st.bucket, counter)
    return counter


@pytest.mark.parametrize("weights", ["dequantized", "quantized"])
def test_every_project_op_counted_has_a_kernel_on_the_device(weights):
    """On h200 with the Triton set, each ``nextn_graph`` op left in the count has a device
    kernel: the quantized GEMMs are the fused ones on the stored bits (the reference ops,
    which have none, would be counted as their decomposition), attention the sparse kernel."""
    st = dataclasses.replace(SMALL, weights=weights)
    counter = _counted(st, TRITON)
    ops = {op.replace(".", "::", 1) for (_, _, op, *_) in counter.work
           if op.startswith("nextn_graph.")}
    assert ops and all(has_device_kernel(op, "cuda", st.dtype) for op in ops), ops
    assert not any(op.startswith("nextn_graph::quant") for op in ops)
    assert {"nextn_graph::sparse_attn", "nextn_graph::index_scores", "nextn_graph::index_topk",
            "nextn_graph::compress_pool"} <= ops
    assert ("nextn_graph::fused_quant_grouped_mm" in ops) == (weights == "quantized")
    assert counter.launches == {op.replace("::", "."): n for op, n in LAUNCHES.items()
                                if op in ops}


def test_quantized_gemms_count_their_dequantization():
    """One quant op per call before; now the dequantize-then-GEMM a device runs."""
    st = dataclasses.replace(SMALL, weights="quantized")
    counted = _counted(st, REFERENCE)
    plain = WorkCounter(KindResolver(), memo=True)
    models = profile_models(build_config(TINY, st.max_context), st.weights, st.dtype)
    count_round(decode_round(models, st), st.bucket, plain)
    ones = sum(n for (_, _, op, *_), n in plain.work.items() if "quant" in op)
    assert ones > 0 and counted.kernels > plain.kernels + ones


def test_mhc_is_at_most_six_kernels_a_layer_forward():
    st = SMALL
    layers = TINY.num_hidden_layers + st.num_steps  # one verify, S NextN forwards
    heads = 1 + st.num_steps
    fused = _counted(st, TRITON)
    mhc = sum(n * fused.launches.get(op, 1) for (_, kind, op, *_), n in fused.work.items()
              if kind == "mhc")
    assert mhc == 6 * layers + 2 * heads  # 2 hc_pre of 2 kernels, 2 hc_post; hc_head 2
    reference = _counted(st, REFERENCE)
    assert reference.kernels > 2 * fused.kernels


def test_profile_reports_the_set_and_refuses_triton_off_cuda():
    auto = profile_round(TINY, SMALL, "tiny")
    ref = profile_round(TINY, dataclasses.replace(SMALL, kernels="reference"), "tiny")
    assert auto["config"]["kernels"] == {"setting": "auto", "set": "triton"}
    assert ref["config"]["kernels"] == {"setting": "reference", "set": "reference"}
    assert auto["kernels_per_round"] < ref["kernels_per_round"]
    npu = profile_round(TINY, dataclasses.replace(SMALL, device_spec="910b"), "tiny")
    assert npu["config"]["kernels"]["set"] == "reference"
    with pytest.raises(InputError, match="built for CUDA"):
        profile_round(TINY, dataclasses.replace(SMALL, device_spec="910b", kernels="triton"),
                      "tiny")
