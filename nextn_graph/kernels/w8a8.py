"""W8A8 GEMMs as ModelSlim's ``W8A8_DYNAMIC`` checkpoints define them: int8 weights with a
per-output-channel fp32 scale, int8 activations quantized per token at run time, an exact
int32 accumulation and the scales applied in an fp32 epilogue. Custom ops (``torch.library``),
each ONE kernel to every graph backend, to Dynamo and to the ``meta`` device.

- ``quantize_rows(x [..., K])`` -> ``(q int8 [..., K], s fp32 [..., 1])``, as Ascend's
  DynamicQuant computes it per row: ``m = 127 / amax(|x|)`` (fp32, IEEE division),
  ``q = rint(x * m)`` (round half to even; |q| <= 127), ``s = 1 / m``. A row of zeros (a
  padded row of a captured graph) gives ``q = 0, s = 0``: zeros out, never NaN.
- ``nextn_graph::w8a8_linear(x [*, K], weight int8 [N, K], scale fp32 [N], out_dtype)``
  -> ``[*, N]``: ``y = out_dtype(fp32(q @ weight.T) * scale[n] * s[t])`` (fp32 products
  in that order: the epilogue every implementation computes).
- ``nextn_graph::w8a8_grouped_mm(x [A, K] sorted by group, weight int8 [G, N, K], scale
  fp32 [G, N], offs [G] int32 group ends, out_dtype)`` -> ``[A, N]``, rows past
  ``offs[-1]`` zeros: the routed experts.
- ``nextn_graph::w8a8_static_linear``: ModelSlim's static ``W8A8`` (per-tensor input
  scale and offset from calibration, an int32 ``quant_bias``, a fused ``deq_scale``).

The int32 accumulation is exact here by construction: ``torch._int_mm`` on the host;
elsewhere int8 values as fp32 over K chunks of at most ``EXACT_K`` (each chunk's sum of
products stays below 2**24, so every fp32 partial is an exact integer), summed in int32.
The device kernels are ``triton_w8a8.py`` (CUDA) and torch_npu's quantized matmuls
(``npu_gemm.py``); both are checked against these.
"""

from __future__ import annotations

import torch
from torch import Tensor

QMAX = 127  # symmetric int8: the kernels never emit -128
EXACT_K = 1024  # 1024 * 127 * 127 < 2**24: an fp32 chunk of int8 products is exact


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row dynamic int8: x [..., K] (any float dtype) -> (q int8 [..., K], s fp32 [..., 1])."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    live = amax > 0
    # true divisions (``127 / t`` in torch is ``t.reciprocal() * 127``: not IEEE's quotient)
    mult = torch.where(live, torch.div(torch.full_like(amax, QMAX), amax), 0.0)  # 0: zero row
    q = torch.round(xf * mult).clamp(-QMAX, QMAX).to(torch.int8)
    s = torch.where(live, torch.div(torch.ones_like(amax), mult), 0.0)
    return q, s


def int_mm(q: Tensor, w: Tensor, chunked: bool | None = None) -> Tensor:
    """Exact int8 x int8 -> int32: q [M, K] times w [N, K] transposed -> [M, N].
    ``chunked``: fp32 GEMMs over K chunks (default: off the host only)."""
    if not (q.device.type != "cpu" if chunked is None else chunked):
        return torch._int_mm(q, w.t())
    acc = None
    for k in range(0, q.shape[-1], EXACT_K):  # each chunk exact in fp32
        part = (q[:, k:k + EXACT_K].float() @ w[:, k:k + EXACT_K].float().t()).to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


def epilogue(acc: Tensor, scale: Tensor, s: Tensor, out_dtype: torch.dtype) -> Tensor:
    """acc int32 [M, N], scale fp32 [N] (per channel), s fp32 [M, 1] (per row) -> out_dtype."""
    return (acc.float() * scale * s).to(out_dtype)


@torch.library.custom_op("nextn_graph::w8a8_linear", mutates_args=())
def w8a8_linear(x: Tensor, weight: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    return w8a8_linear_reference(x, weight, scale, out_dtype)


def w8a8_linear_reference(x: Tensor, weight: Tensor, scale: Tensor,
                          out_dtype: torch.dtype) -> Tensor:
    """``w8a8_linear``'s body: x [*, K] -> [*, N] in ``out_dtype``."""
    lead = x.shape[:-1]
    q, s = quantize_rows(x.reshape(-1, x.shape[-1]))  # [M, K], [M, 1]
    return epilogue(int_mm(q, weight), scale, s, out_dtype).view(*lead, weight.shape[0])


@w8a8_linear.register_fake
def _(x, weight, scale, out_dtype):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)


@torch.library.custom_op("nextn_graph::w8a8_grouped_mm", mutates_args=())
def w8a8_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor,
                    out_dtype: torch.dtype) -> Tensor:
    return w8a8_grouped_reference(x, weight, scale, offs, out_dtype)


def w8a8_grouped_reference(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor,
                           out_dtype: torch.dtype, static: bool | None = None) -> Tensor:
    """``w8a8_grouped_mm``'s body: x [A, K] sorted by group -> [A, N], rows past
    ``offs[-1]`` zeros. On the host, one int GEMM per group with rows (offsets read
    there); ``static`` (default off the host), each row's group weight gathered (no host
    read: capture-safe)."""
    q, s = quantize_rows(x)  # [A, K], [A, 1]
    a, n = x.shape[0], weight.shape[1]
    if not (x.device.type != "cpu" if static is None else static):
        acc = torch.zeros(a, n, dtype=torch.int32)
        row_scale = torch.zeros(a, n, dtype=torch.float32)
        start = 0
        for g, end in enumerate(offs.tolist()):
            if end > start:
                acc[start:end] = int_mm(q[start:end], weight[g])
                row_scale[start:end] = scale[g]
            start = end
        return epilogue(acc, row_scale, s, out_dtype)
    rows = torch.arange(a, device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)  # [A]; G past the last group
    inside = (group < weight.shape[0]).unsqueeze(-1)  # [A, 1]
    group = group.clamp(max=weight.shape[0] - 1)
    acc = torch.zeros(a, n, dtype=torch.int32, device=x.device)
    for k in range(0, x.shape[-1], EXACT_K):
        w = weight[group][..., k:k + EXACT_K].float()  # [A, N, k]
        part = torch.bmm(w, q[:, k:k + EXACT_K].float().unsqueeze(-1)).squeeze(-1)
        acc = acc + part.to(torch.int32)
    out = epilogue(acc, scale[group], s, out_dtype)
    return torch.where(inside, out, torch.zeros_like(out))


@w8a8_grouped_mm.register_fake
def _(x, weight, scale, offs, out_dtype):
    return x.new_empty(x.shape[0], weight.shape[1], dtype=out_dtype)


def quantize_static(x: Tensor, input_scale: Tensor, input_offset: Tensor) -> Tensor:
    """ModelSlim's static activation quantization: ``clamp(rint(x / input_scale +
    input_offset), -128, 127)`` int8, per tensor (fp32 scalars)."""
    y = torch.round(x.float() / input_scale + input_offset)
    return y.clamp(-128, 127).to(torch.int8)


@torch.library.custom_op("nextn_graph::w8a8_static_linear", mutates_args=())
def w8a8_static_linear(x: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor,
                       input_scale: Tensor, input_offset: Tensor,
                       out_dtype: torch.dtype) -> Tensor:
    return w8a8_static_reference(x, weight, deq_scale, quant_bias, input_scale,
                                 input_offset, out_dtype)


def w8a8_static_reference(x: Tensor, weight: Tensor, deq_scale: Tensor, quant_bias: Tensor,
                          input_scale: Tensor, input_offset: Tensor,
                          out_dtype: torch.dtype) -> Tensor:
    """x [*, K] -> [*, N]: ``out_dtype(fp32(q @ weight.T + quant_bias) * deq_scale[n])``."""
    lead = x.shape[:-1]
    q = quantize_static(x.reshape(-1, x.shape[-1]), input_scale, input_offset)
    acc = int_mm(q, weight) + quant_bias  # [M, N] int32
    return (acc.float() * deq_scale).to(out_dtype).view(*lead, weight.shape[0])


@w8a8_static_linear.register_fake
def _(x, weight, deq_scale, quant_bias, input_scale, input_offset, out_dtype):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """A float weight [N, K] as ModelSlim's W8A8_DYNAMIC stores it: (int8 [N, K], fp32
    per-channel scale [N]), symmetric, ``scale = amax / 127`` (a zero row: scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1)  # [N]
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale
