"""Distances between floating-point results in units in the last place (ULPs).

``ulps(actual, expected)`` measures ``|actual - expected|`` in ULPs of the expected
tensor's dtype at the expected value's magnitude (a kernel test states its tolerance in
these units). ``scale``, when given, is the magnitude to take the ULP at instead, e.g.
``sum_i |x_i y_i|`` for a sum whose terms may cancel: the error of such a sum is bounded
relative to the sum of the terms' magnitudes, not to the (possibly tiny) result.
Magnitudes under the dtype's smallest normal take the subnormal ULP, so an exact zero
result is 0 ULPs from an actual zero and far from anything else.
"""

from __future__ import annotations

import torch


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ULP of ``dtype`` at ``|magnitude|`` (float64): ``eps * 2**floor(log2|m|)``."""
    info = torch.finfo(dtype)
    m = magnitude.double().abs().clamp(min=info.tiny)
    _, exp = torch.frexp(m)  # m = f * 2**exp, f in [0.5, 1)
    return info.eps * torch.ldexp(torch.ones_like(m), exp - 1)


def ulps(actual: torch.Tensor, expected: torch.Tensor,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise ``|actual - expected|`` in ULPs of ``expected.dtype`` at the magnitude
    of ``expected`` (or of ``scale``, broadcast to it) -> float64. Equal values (infinities
    included) are 0 apart; a NaN on either side is infinitely far."""
    a, e = actual.double(), expected.double()
    unit = ulp(e if scale is None else scale.double().expand_as(e), expected.dtype)
    dist = (a - e).abs() / unit
    dist = torch.where(a == e, torch.zeros_like(dist), dist)
    return torch.where(a.isnan() | e.isnan(), torch.full_like(dist, float("inf")), dist)


def max_ulps(actual: torch.Tensor, expected: torch.Tensor,
             scale: torch.Tensor | None = None) -> float:
    """The largest ``ulps`` distance (0.0 for empty tensors)."""
    d = ulps(actual, expected, scale)
    return d.max().item() if d.numel() else 0.0
