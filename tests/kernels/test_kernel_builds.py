"""Every Triton kernel builds for an H200 (sm_90a PTX and cubin, with the ptxas Triton
ships), at DeepSeek-V4-Flash widths, on a machine without a GPU; and every kernel of a
module has a build. The builds run in a child without TRITON_INTERPRET
(``aot.build_module``: under the interpreter the compiler cannot build interpreted
helpers such as ``tl.sum``, and a failed build leaves triton.language patched)."""

from __future__ import annotations

import pytest

from nextn_graph.kernels import (triton_attn, triton_compress, triton_gemm, triton_indexer,
                                 triton_mhc, triton_moe, triton_norm)
from nextn_graph.kernels.aot import H200_SHARED_BYTES, build_module

pytestmark = pytest.mark.compile  # sm_90a builds of every Triton kernel

# The kernels each module defines, by name: each must have a build below.
KERNELS = {
    triton_mhc: {"hc_project_kernel", "hc_mix_kernel", "hc_post_kernel"},
    triton_moe: {"moe_gate_kernel", "moe_route_offs_kernel", "moe_route_pos_kernel",
                 "swiglu_kernel", "moe_combine_kernel"},
    triton_norm: {"rms_norm_kernel", "q_kv_norm_rope_kernel", "rope_kernel"},
    triton_gemm: {"qgemm_kernel"},
    triton_attn: {"sparse_attn_kernel"},
    triton_indexer: {"index_scores_kernel", "index_topk_kernel"},
    triton_compress: {"compress_pool_kernel"},
}
BUILDS = [(module, i, build) for module in KERNELS for i, build in enumerate(module.BUILDS)]
_built: dict[str, list[dict]] = {}


def _module_builds(module) -> list[dict]:
    """One child process per module, shared by its builds' tests."""
    if module.__name__ not in _built:
        _built[module.__name__] = build_module(module.__name__)
    return _built[module.__name__]


@pytest.mark.parametrize("module", list(KERNELS), ids=lambda m: m.__name__.split(".")[-1])
def test_every_kernel_has_a_build(module):
    defined = {name for name, k in vars(module).items()  # jit helpers are _private
               if hasattr(k, "add_pre_run_hook") and not isinstance(k, type)
               and not name.startswith("_")}
    assert defined == KERNELS[module]
    assert {b.name for b in module.BUILDS} == defined


@pytest.mark.parametrize("module,index,build", BUILDS,
                         ids=[f"{m.__name__.split('.')[-1]}-{i}-{b.name}" for m, i, b in BUILDS])
def test_kernel_builds_for_sm90a(module, index, build):
    got = _module_builds(module)[index]
    assert got["name"] == build.name and got["cubin_bytes"] > 0
    assert got["shared_bytes"] <= H200_SHARED_BYTES
    assert got["num_warps"] == build.num_warps
