"""Linear layers as Ascend's ModelSlim W8A8 checkpoints store them, kept as stored.

``W8A8_DYNAMIC`` (``W8A8Linear``): ``weight`` int8 ``[out, in]``, ``weight_scale`` fp32
``[out, 1]`` (per output channel, symmetric) and ``weight_offset`` fp32 ``[out, 1]``
(zeros; kept so that a loaded model writes its checkpoint back). The activations are
quantized per token inside the op (``kernels.w8a8``): one ``w8a8_linear`` kernel.

``W8A8`` static (``W8A8StaticLinear``): int8 ``weight``, a per-tensor ``input_scale`` /
``input_offset`` from calibration, an int32 ``quant_bias`` and a fused ``deq_scale``
(fp32, or int64 holding the fp32 bits in its low word as some exports write it).

Both hold integers, and their fp32 scales as int32 bits (``float_bits``), so that no
``Module.to(dtype)`` can cast them (``model.quant.QuantLinear`` does the same); the forward
views them as fp32. ``stored_dtypes`` gives the checkpoint dtypes back for saving.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops import UsesKernels

# ModelSlim's quant types this project runs (quant_model_description.json)
W8A8_DYNAMIC, W8A8_STATIC, W4A8_DYNAMIC, FLOAT = "W8A8_DYNAMIC", "W8A8", "W4A8_DYNAMIC", "FLOAT"


class W8A8Linear(UsesKernels, nn.Module):
    """``y = x @ W.T`` with W int8 per-channel scaled and x quantized per token (dynamic).

    ``out_dtype``: the output's dtype; None = x's (every linear of the model). The routed
    experts' first GEMM keeps fp32 (``experts.W8A8Stack``), as Ascend's grouped kernels do."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", float_bits(torch.ones(out_features, 1)))
        self.register_buffer("weight_offset", float_bits(torch.zeros(out_features, 1)))

    def stored_dtypes(self) -> dict[str, torch.dtype]:
        return {"weight": torch.int8, "weight_scale": torch.float32,
                "weight_offset": torch.float32}

    def scale(self) -> torch.Tensor:
        """The per-channel scale [out] fp32."""
        return self.weight_scale.view(torch.float32).view(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.w8a8_linear(x, self.weight, self.scale(), x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, W8A8_DYNAMIC"


class W8A8StaticLinear(UsesKernels, nn.Module):
    """ModelSlim's static W8A8: ``y = fp32(q @ W.T + quant_bias) * deq_scale``, with
    ``q = clamp(rint(x / input_scale + input_offset))`` per tensor."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("deq_scale", float_bits(torch.ones(out_features)))
        self.register_buffer("quant_bias", torch.zeros(out_features, dtype=torch.int32))
        self.register_buffer("input_scale", float_bits(torch.ones(1)))
        self.register_buffer("input_offset", float_bits(torch.zeros(1)))

    def stored_dtypes(self) -> dict[str, torch.dtype]:
        return {"weight": torch.int8, "deq_scale": torch.float32, "quant_bias": torch.int32,
                "input_scale": torch.float32, "input_offset": torch.float32}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f32 = torch.float32
        return self.kernels.w8a8_static_linear(
            x, self.weight, self.deq_scale.view(f32), self.quant_bias,
            self.input_scale.view(f32), self.input_offset.view(f32), x.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, W8A8 (static)"


def float_bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 values held as their int32 bits (a buffer no dtype cast touches)."""
    return t.float().contiguous().view(torch.int32)


def deq_scale_values(stored: torch.Tensor) -> torch.Tensor:
    """A checkpoint's ``deq_scale`` as fp32: fp32 as is, int64 holding the fp32 bits in its
    low 32 bits (the form Ascend's quant matmul reads)."""
    if stored.dtype == torch.int64:  # little-endian: the low word first
        words = stored.contiguous().view(torch.int32).view(*stored.shape, 2)
        return words[..., 0].contiguous().view(torch.float32)
    return stored.float()
