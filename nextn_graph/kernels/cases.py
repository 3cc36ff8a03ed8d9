"""Representative calls of every fused op, fused and reference side by side: what the
device tests compare and ``perf/kernel_bench.py`` times.

``cases(rows, widths, dtype, device)`` -> one ``Case`` per op with random inputs of a
trained model's scale at DeepSeek-V4-Flash widths (``V4_FLASH``) or tiny ones (``TINY``);
``rows`` is the forward's T (a bucket of 8 verifying 4 tokens: 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from . import mhc, moe, norm


@dataclass(frozen=True)
class Widths:
    hidden: int
    heads: int
    head_dim: int
    rope_dim: int
    hc: int
    experts: int
    topk: int
    inter: int


V4_FLASH = Widths(hidden=4096, heads=64, head_dim=512, rope_dim=64, hc=4, experts=256,
                  topk=6, inter=2048)
TINY = Widths(hidden=64, heads=4, head_dim=32, rope_dim=16, hc=4, experts=4, topk=2, inter=64)
EPS, HC_EPS, ITERS, LIMIT, ROUTE_SCALE = 1e-6, 1e-6, 20, 10.0, 1.5


@dataclass(frozen=True)
class Case:
    name: str
    fused: Callable[[], object]
    reference: Callable[[], object]
    nbytes: int  # the fused kernel's unavoidable traffic: its inputs read, outputs written


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


def _rotation(rows: int, dim: int, rope: int, gen: torch.Generator) -> Tensor:
    """[T, dim/2, 2, 2] as ``RopeTable.rotation`` makes it: identity pairs, then RoPE."""
    angle = torch.rand(rows, rope // 2, generator=gen, dtype=torch.float64) * 6.3
    c = torch.ones(rows, dim // 2, dtype=torch.float64)
    s = torch.zeros(rows, dim // 2, dtype=torch.float64)
    c[:, dim // 2 - rope // 2:], s[:, dim // 2 - rope // 2:] = angle.cos(), angle.sin()
    return torch.stack((c, s, -s, c), dim=-1).unflatten(-1, (2, 2)).float()


def _route(chosen: Tensor, experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """The reference sort as ``moe_route_fused`` returns it: (order, offs, pos)."""
    _, order, offs = moe.route_reference(chosen, experts, 0, False)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                  device=order.device))
    return order, offs, pos


def cases(rows: int, w: Widths, dtype: torch.dtype, device: str, seed: int = 0) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    t, d, hc, k = rows, w.hidden, w.hc, w.topk
    eps_t = torch.full((1, 1, 1), EPS, device=device)
    out = []
    x, weight = randn(t, d), 1 + randn(d, scale=0.1)
    out.append(Case("rms_norm", lambda: norm.rms_norm_fused(x, weight, EPS),
                    lambda: norm.rms_norm(x, eps_t) * weight, _bytes(x, weight, x)))
    q, kv = randn(t, w.heads, w.head_dim), randn(t, w.head_dim)
    kv_w = 1 + randn(w.head_dim, scale=0.1)
    rot = _rotation(t, w.head_dim, w.rope_dim, gen).to(device=device, dtype=dtype)
    out.append(Case("q_kv_norm_rope", lambda: norm.q_kv_norm_rope_fused(q, kv, kv_w, EPS, rot),
                    lambda: norm.q_kv_norm_rope(q, kv, kv_w, eps_t, rot),
                    2 * _bytes(q, kv) + _bytes(rot)))
    out.append(Case("rope", lambda: norm.rope_fused(q, rot, True),
                    lambda: norm.apply_rope(q, rot, inverse=True), 2 * _bytes(q) + _bytes(rot)))
    mix = (2 + hc) * hc
    streams = randn(t, hc, d)
    fn = randn(mix, hc * d, scale=(hc * d) ** -0.5, dt=torch.float32)
    scale, base = 1 + randn(3, scale=0.1, dt=torch.float32), randn(mix, dt=torch.float32)
    consts = mhc.HcConstants.make(hc, HC_EPS, torch.device(device))
    out.append(Case("hc_pre", lambda: mhc.hc_pre_fused(streams, fn, scale, base, ITERS, HC_EPS,
                                                       EPS),
                    lambda: mhc.hc_pre(streams, fn, scale, base, ITERS, HC_EPS, EPS, consts),
                    2 * _bytes(streams) + _bytes(fn) + t * (d + hc + hc * hc) * 4))
    post = (2 * torch.rand(t, hc, generator=gen)).to(device)
    comb = torch.rand(t, hc, hc, generator=gen).softmax(-1).to(device)
    sub = randn(t, d)
    out.append(Case("hc_post", lambda: mhc.hc_post_fused(sub, streams, post, comb),
                    lambda: mhc.hc_post(sub, streams, post, comb),
                    2 * _bytes(streams) + _bytes(sub, post, comb)))
    head_fn = randn(hc, hc * d, scale=(hc * d) ** -0.5, dt=torch.float32)
    head_scale, head_base = 1 + randn(1, scale=0.1, dt=torch.float32), randn(hc, dt=torch.float32)
    out.append(Case("hc_head", lambda: mhc.hc_head_fused(streams, head_fn, head_scale, head_base,
                                                         HC_EPS, EPS),
                    lambda: mhc.hc_head(streams, head_fn, head_scale, head_base, HC_EPS, EPS),
                    _bytes(streams, head_fn, sub)))
    gate_w, bias = randn(w.experts, d, scale=d ** -0.5), randn(w.experts, scale=0.01)
    out.append(Case("moe_gate", lambda: moe.moe_gate_fused(x, gate_w, bias, None, k,
                                                           ROUTE_SCALE),
                    lambda: moe.gate_reference(x, gate_w, bias, None, k, ROUTE_SCALE),
                    _bytes(x, gate_w, bias) + t * k * 16))
    chosen = torch.stack([torch.randperm(w.experts, generator=gen)[:k] for _ in range(t)])
    chosen = chosen.to(device)
    out.append(Case("moe_route", lambda: moe.moe_route_fused(chosen, w.experts, 0),
                    lambda: _route(chosen, w.experts), _bytes(chosen) * 3 + w.experts * 4))
    a = t * k
    gate, up = randn(a, w.inter), randn(a, w.inter)
    out.append(Case("swiglu", lambda: moe.swiglu_fused(gate, up, LIMIT),
                    lambda: moe.swiglu_reference(gate, up, LIMIT), 3 * _bytes(gate)))
    key, order, offs = moe.route_reference(chosen, w.experts, 0, False)
    pos = _route(chosen, w.experts)[2]
    ys, weights = randn(a, d), torch.rand(t, k, generator=gen).to(device)
    out.append(Case("moe_combine", lambda: moe.moe_combine_fused(ys, pos, weights, offs),
                    lambda: moe.combine_reference(ys, key, order, weights, w.experts, False),
                    _bytes(ys, pos, weights) + t * d * 4))
    return out
