"""Quantized linear weights as DeepSeek-V4 ships them, kept quantized in memory.

The release stores most linear weights as FP8 e4m3 ``[out, in]`` with a ``.scale``
per 128 x 128 block, ``[ceil(out/128), ceil(in/128)]``, and its routed experts as
FP4 e2m1, two values per byte ``[out, in/2]`` (low nibble first) with a scale per
32 inputs, ``[out, in/32]``. Scales are powers of two: ``float8_e8m0fnu`` (an
exponent byte, 2^(b - 127)), or fp32 in some exports. weight = value x its block's scale.

``QuantLinear`` holds the stored bits (``uint8``; fp32 scales as ``int32`` bits) so
that no ``Module.to(dtype)`` can cast them; its forward is one ``quant_linear`` kernel
(``kernels.qgemm``) that dequantizes inside the op, with pure tensor ops: correct on
every device and inside every graph backend. The dequantized weight is exact in fp32 and in
bf16 (an e4m3 or e2m1 value times a power of two fits both), so a quantized model
and the same checkpoint dequantized at load give identical logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, show_value
from ..kernels.qgemm import FP4_BLOCK, FP8_BLOCK, dequantize  # noqa: F401 (re-exported)
from .ops import UsesKernels

FP8_MAX = 448.0  # largest finite e4m3fn value
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 by nibble
FP4_MAX = 6.0
FP8_DTYPES = (torch.float8_e4m3fn,)
# Packed FP4 arrives as int8 (the release), uint8, or torch's float4_e2m1fn_x2.
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)


@dataclass(frozen=True)
class QuantConfig:
    """``config.json``'s ``quantization_config`` (and ``expert_dtype``), checked."""
    block: tuple[int, int]  # weight_block_size
    expert_fp4: bool  # routed experts are FP4 (expert_dtype "fp4")


_KNOWN = {"quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("ue8m0", None),
          "activation_scheme": ("dynamic",)}


def quant_config(raw: dict[str, Any], where: str) -> QuantConfig | None:
    """The checkpoint's quantization, or None when ``config.json`` declares none."""
    expert = raw.get("expert_dtype")
    if expert not in (None, "fp4", "fp8", "bf16"):
        raise CheckpointError(f"{where}: key 'expert_dtype' must be fp4, fp8 or bf16, got "
                              f"{show_value(expert)}")
    q = raw.get("quantization_config")
    if q is None:
        if expert == "fp4":
            raise CheckpointError(f"{where}: 'expert_dtype' fp4 without a quantization_config")
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: key 'quantization_config' must be an object")
    for key, allowed in _KNOWN.items():
        value = q.get(key, allowed[-1] if None in allowed else None)
        if value not in allowed:
            raise CheckpointError(f"{where}: quantization_config.{key} {show_value(value)} is "
                                  f"not supported (this library loads {list(allowed)})")
    block = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise CheckpointError(f"{where}: quantization_config.weight_block_size "
                              f"{show_value(block)} is not supported (the release uses "
                              f"[{FP8_BLOCK}, {FP8_BLOCK}])")
    return QuantConfig((FP8_BLOCK, FP8_BLOCK), expert == "fp4")


def quant_format(weight_dtype: torch.dtype) -> str | None:
    """'fp8', 'fp4' (packed), or None for a plain float weight."""
    if weight_dtype in FP8_DTYPES:
        return "fp8"
    if weight_dtype in FP4_DTYPES:
        return "fp4"
    return None


def scale_shape(fmt: str, out_features: int, in_features: int) -> tuple[int, int]:
    if fmt == "fp8":
        return math.ceil(out_features / FP8_BLOCK), math.ceil(in_features / FP8_BLOCK)
    return out_features, in_features // FP4_BLOCK


def stored_shape(fmt: str, out_features: int, in_features: int) -> tuple[int, int]:
    return (out_features, in_features) if fmt == "fp8" else (out_features, in_features // 2)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bits of a weight or scale: uint8 (1-byte formats) or int32 (fp32)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


class QuantLinear(UsesKernels, nn.Module):
    """``y = x @ W.T`` with W kept as stored: FP8 with 128 x 128 block scales, or packed
    FP4 with a scale per 32 inputs. Buffers ``weight`` and ``scale`` are the checkpoint's
    ``.weight`` and ``.scale`` tensors (as bits)."""

    def __init__(self, in_features: int, out_features: int, fmt: str, fp32_scale: bool):
        super().__init__()
        if fmt not in ("fp8", "fp4"):
            raise ValueError(f"unknown quantized format {fmt!r}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.fp32_scale = fp32_scale
        self.register_buffer("weight", torch.empty(stored_shape(fmt, out_features, in_features),
                                                   dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(scale_shape(fmt, out_features, in_features),
                                                  dtype=torch.int32 if fp32_scale else torch.uint8))
        # the e2m1 value of each nibble; made on the host even under a meta device
        self.register_buffer("fp4_values", torch.tensor(FP4_VALUES, device="cpu"),
                             persistent=False)

    def stored_dtypes(self) -> dict[str, torch.dtype]:
        """The checkpoint dtypes of ``weight`` and ``scale`` (for writing them back)."""
        return {"weight": torch.float8_e4m3fn if self.fmt == "fp8" else torch.int8,
                "scale": torch.float32 if self.fp32_scale else torch.float8_e8m0fnu}

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] in ``dtype`` (exact for fp32 and bf16)."""
        return dequantize(self.fmt, self.weight, self.scale, self.out_features,
                          self.in_features, self.fp4_values, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One ``quant_linear`` kernel of the model's set: the stored bits are read, never
        expanded in memory outside it (``kernels.qgemm``, ``kernels.gemm``)."""
        return self.kernels.quant_linear(x, self.weight, self.scale, self.fp4_values,
                                         self.fmt, self.in_features)

    def extra_repr(self) -> str:
        scale = "fp32" if self.fp32_scale else "e8m0"
        return f"{self.in_features} -> {self.out_features}, {self.fmt}, {scale} scales"


def grouped_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A linear applied per group, group g with rows ``[g*r, (g+1)*r)`` of the weight
    [G*r, in] (a block-diagonal projection). x: [G, T, in] -> [G, T, r].

    One ``bmm``, on the float weight or, for a ``QuantLinear`` whose scale blocks do not
    straddle groups, one ``quant_bmm`` kernel on the stored bits (bitwise the same)."""
    g, _, inp = x.shape
    if not isinstance(module, QuantLinear):
        return torch.bmm(x, module.weight.view(g, -1, inp).transpose(1, 2))
    r = module.out_features // g
    if module.fmt == "fp4" or r % FP8_BLOCK == 0:  # each group owns whole scale rows
        weight = module.weight.view(g, r, -1)
        scale = module.scale.view(g, -1, module.scale.shape[-1])
        return module.kernels.quant_bmm(x, weight, scale, module.fp4_values, module.fmt, inp)
    w = module.dequantized(x.dtype).view(g, r, inp)  # blocks straddle groups: whole weight
    return torch.bmm(x, w.transpose(1, 2))


def check_scale(where: str, key: str, fmt: str, weight: torch.Tensor, scale: torch.Tensor,
                out_features: int, in_features: int) -> None:
    """A stored weight and its scale agree with the module's [out, in] and each other
    (shapes and dtypes only: read from the headers, before any data)."""
    want_w = stored_shape(fmt, out_features, in_features)
    if tuple(weight.shape) != want_w:
        raise CheckpointError(f"{where}: {fmt.upper()} tensor {key}.weight has shape "
                              f"{list(weight.shape)}, expected {list(want_w)} for a "
                              f"[{out_features}, {in_features}] linear")
    if fmt == "fp4" and in_features % FP4_BLOCK:
        raise CheckpointError(f"{where}: {key}.weight is FP4 but its {in_features} inputs are "
                              f"not a multiple of {FP4_BLOCK}")
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"{where}: tensor {key}.scale has dtype {scale.dtype}, expected "
                              f"float8_e8m0fnu or float32 (powers of two)")
    want_s = scale_shape(fmt, out_features, in_features)
    if tuple(scale.shape) != want_s:
        raise CheckpointError(f"{where}: tensor {key}.scale has shape {list(scale.shape)}, "
                              f"expected {list(want_s)} for {fmt.upper()} weight "
                              f"{key}.weight {list(weight.shape)}")


def check_quant_values(where: str, key: str, t: torch.Tensor) -> None:
    """A stored FP8 weight holds no NaN (e4m3fn has no Inf); a scale is finite and > 0.
    FP4 codes are all numbers."""
    if t.dtype in FP8_DTYPES:
        bad = (as_bits(t) & 0x7F) == 0x7F
    elif t.dtype == torch.float32:  # an fp32 scale
        bad = ~torch.isfinite(t) | (t <= 0)
    elif t.dtype == torch.float8_e8m0fnu:
        bad = as_bits(t) == 0xFF  # the e8m0 NaN
    else:
        return
    if bool(bad.any()):
        raise CheckpointError(f"{where}: tensor {key!r} holds NaN, Inf or non-positive "
                              f"values")


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight [out, in] in the release's format: (stored weight, e8m0 scale).

    Each block's scale is the smallest power of two that brings its largest value
    within the format's range; FP4 rounds to the nearest e2m1 value.
    """
    w = w.float()
    out, inp = w.shape
    if fmt == "fp8":
        so, si = scale_shape("fp8", out, inp)
        padded = F.pad(w, (0, si * FP8_BLOCK - inp, 0, so * FP8_BLOCK - out))
        amax = padded.reshape(so, FP8_BLOCK, si, FP8_BLOCK).abs().amax(dim=(1, 3))  # [so, si]
        scale = _pow2_scale(amax, FP8_MAX)
        full = scale[:, None, :, None].expand(so, FP8_BLOCK, si, FP8_BLOCK)
        full = full.reshape(so * FP8_BLOCK, si * FP8_BLOCK)[:out, :inp]
        q = (w / full).to(torch.float8_e4m3fn)
        return q, scale.to(torch.float8_e8m0fnu)
    blocks = w.reshape(out, inp // FP4_BLOCK, FP4_BLOCK)
    scale = _pow2_scale(blocks.abs().amax(dim=-1), FP4_MAX)  # [out, in/32]
    scaled = (blocks / scale[..., None]).reshape(out, inp)
    grid = torch.tensor(FP4_VALUES[:8])  # magnitudes by code 0..7
    codes = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)  # nearest magnitude
    codes = codes + 8 * ((scaled < 0) & (codes > 0)).long()  # sign bit; +0 for zero
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def _pow2_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    exp = torch.ceil(torch.log2(amax.clamp(min=1e-30) / limit)).clamp(-127, 127)
    return torch.pow(2.0, exp)
