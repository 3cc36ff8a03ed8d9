"""The kernel layer: every fused op of a round, with its exact reference beside it.

One module per family of ops: ``mhc`` (hc_pre, hc_post, hc_head), ``norm`` (RMSNorm, the
attention's q/kv norm with RoPE, RoPE), ``moe`` (the gate, the routing, SwiGLU, the
weighted combine), ``qgemm`` (grouped and quantized GEMMs: the references) with ``gemm``
(their fused forms on the stored bits), ``attention`` (V4's sparse attention over index
lists), ``indexer`` (the lightning indexer's scores and top-k), ``compress`` (the KV
compressor's pooling, norm and RoPE). Each holds the reference
(aten code: the CPU kernels and the oracle, exact) and the fused ops as ``torch.library``
ops (``triton_op``, so ``torch.compile`` sees inside) with fakes for the ``meta`` device;
``triton_<family>`` holds their Triton kernels (Triton is optional: imported when a fused
kernel first runs), ``npu`` the mapping to torch_npu's fused ops. ``select`` makes the
kernel set a model runs (``kernels: auto | reference | triton``); ``registry`` says which
ops a device has kernels for (the work profile counts the rest as their decomposition);
``aot`` builds the Triton kernels for an H200 without one.
"""

from .select import REFERENCE, TRITON, Kernels, projected_kernels, select_kernels

__all__ = ["Kernels", "REFERENCE", "TRITON", "projected_kernels", "select_kernels"]
