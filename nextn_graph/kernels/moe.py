"""The MoE's routing, activation and combine: exact references and fused Triton ops.

The references are today's model math, verbatim (``model/moe.py``: ``swiglu``,
``Gate.forward``, the sort and the tail of ``MoE._routed``); they are the CPU kernels
and the oracle. The fused ops (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``):

- ``moe_gate``: the router of one row per program: the [E, D] projection, sqrt-softplus
  scores, the biased top-k (descending; ties go to the lower expert index) or the hash
  layers' given experts, gather, normalise, scale. 1 kernel.
- ``moe_route``: a stable counting sort of the T*k assignments by local expert (other
  ranks' experts last): one kernel counts the group ends ``offs``, one ranks every
  assignment (``pos``) and scatters ``order`` (``order[pos[i]] = i``). 2 kernels.
- ``swiglu``: the clamped SwiGLU of the gate and up projections, elementwise. 1 kernel.
- ``moe_combine``: each row's k expert outputs, weighted and summed in top-k order,
  read through ``pos`` (no un-permute copy); rows past ``offs[-1]`` add exactly 0. 1 kernel.

Every op is static-shaped and reads nothing back to the host, so it captures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op, wrap_triton


# ---- references: today's model math, verbatim ----------------------------------------

def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU of fp32 gate and up projections."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def swiglu_reference(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """gate, up [A, I] (model dtype) -> [A, I] gate.dtype, as ``Expert.forward`` takes it."""
    return swiglu(gate.float(), up.float(), limit).to(gate.dtype)


def gate_reference(x: Tensor, weight: Tensor, bias: Tensor | None, chosen: Tensor | None,
                   topk: int, route_scale: float) -> tuple[Tensor, Tensor]:
    """``Gate.forward``: x [T, D], weight [E, D], bias [E] (unused when ``chosen``, the hash
    layers' rows [T, k] int64, is given) -> (chosen [T, k] int64, weights [T, k] fp32)."""
    scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()  # [T, E]
    if chosen is None:  # the bias steers selection only; weights use the raw scores
        chosen = (scores + bias.float()).topk(topk, dim=-1).indices
    weights = scores.gather(1, chosen)
    return chosen, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * route_scale


def route_reference(chosen: Tensor, n_local: int, local_start: int,
                    parallel: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``MoE._routed``'s sort: chosen [T, k] -> (key [A] sorted local expert (n_local for
    another rank's), order [A] int64 stable, offs [n_local] int32 group ends)."""
    n = n_local
    key = chosen.flatten()  # [A] expert of each assignment
    if parallel:  # another rank's experts sort last, outside every group
        key = key - local_start
        key = torch.where((key >= 0) & (key < n), key, n)
    key, order = key.sort(stable=True)  # [A]: by expert
    groups = torch.arange(n, device=chosen.device)
    offs = torch.searchsorted(key, groups, right=True, out_int32=True)  # [n] group ends
    return key, order, offs


def combine_reference(ys: Tensor, key: Tensor, order: Tensor, weights: Tensor,
                      n_local: int, parallel: bool = True) -> Tensor:
    """``MoE._routed``'s tail: ys [A, D] in sorted order (rows past offs[-1] undefined),
    key/order [A] from the sort, weights [T, k] fp32 -> [T, D] fp32."""
    t, k = weights.shape
    n = n_local
    ys = ys.float() * weights.flatten()[order].unsqueeze(1)
    if parallel:  # another rank's assignments: NaN-safe, replaced, not scaled
        ys = torch.where((key < n).unsqueeze(1), ys, 0.0)
    y = torch.empty_like(ys).index_copy_(0, order, ys)  # back in (row, top-k) order
    return y.view(t, k, -1).sum(dim=1)


# ---- fused ops -------------------------------------------------------------------------

def _pow2(n: int) -> int:
    """The least power of two >= n (tl.arange sizes)."""
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(n: int, block: int) -> int:
    """The programs that cover n items in blocks (triton.cdiv, without importing Triton)."""
    return (n + block - 1) // block


@triton_op("nextn_graph::moe_gate", mutates_args=())
def moe_gate_fused(x: Tensor, weight: Tensor, bias: Tensor | None, chosen: Tensor | None,
                   topk: int, route_scale: float) -> tuple[Tensor, Tensor]:
    """``gate_reference`` in one kernel, one program per row."""
    from . import triton_moe as tk  # Triton is optional: imported when a fused kernel runs

    if chosen is None and bias is None:
        raise ValueError("moe_gate: the biased top-k needs a bias (or give chosen)")
    t, d = x.shape
    e = weight.shape[0]
    x, weight = x.contiguous(), weight.contiguous()  # [T, D], [E, D]
    hashed = chosen is not None
    given = chosen.contiguous() if hashed else x  # [T, k] int64 (unread when not hashed)
    bias_in = bias.contiguous() if bias is not None else x  # [E] (unread when hashed)
    out_chosen = torch.empty(t, topk, dtype=torch.int64, device=x.device)  # [T, k]
    out_weights = torch.empty(t, topk, dtype=torch.float32, device=x.device)  # [T, k]
    wrap_triton(tk.moe_gate_kernel)[(t,)](
        x, weight, bias_in, given, out_chosen, out_weights, d, e, float(route_scale),
        TOPK=topk, HASHED=hashed, BLOCK_E=_pow2(e), BLOCK_D=tk.GATE_BLOCK_D,
        BLOCK_K=_pow2(topk))
    return out_chosen, out_weights


@moe_gate_fused.register_fake
def _(x, weight, bias, chosen, topk, route_scale):
    t = x.shape[0]
    return (x.new_empty(t, topk, dtype=torch.int64), x.new_empty(t, topk, dtype=torch.float32))


@triton_op("nextn_graph::moe_route", mutates_args=())
def moe_route_fused(chosen: Tensor, n_local: int,
                    local_start: int) -> tuple[Tensor, Tensor, Tensor]:
    """chosen [T, k] -> (order [A] int64, offs [n_local] int32, pos [A] int64): the
    reference's order and offs (parallel branch), and pos with pos[order[i]] = i."""
    from . import triton_moe as tk  # Triton is optional: imported when a fused kernel runs

    flat = chosen.contiguous().view(-1)  # [A]
    a = flat.numel()
    order = torch.empty(a, dtype=torch.int64, device=chosen.device)  # [A]
    pos = torch.empty(a, dtype=torch.int64, device=chosen.device)  # [A]
    offs = torch.empty(n_local, dtype=torch.int32, device=chosen.device)  # [n_local]
    block_g, block_a = tk.ROUTE_BLOCK_G, tk.ROUTE_BLOCK_A
    wrap_triton(tk.moe_route_offs_kernel)[(_cdiv(n_local, block_g),)](
        flat, offs, a, n_local, local_start, BLOCK_G=block_g, BLOCK_A=block_a)
    wrap_triton(tk.moe_route_pos_kernel)[(_cdiv(a, block_a),)](
        flat, offs, order, pos, a, n_local, local_start, BLOCK=block_a)
    return order, offs, pos


@moe_route_fused.register_fake
def _(chosen, n_local, local_start):
    a = chosen.numel()
    return (chosen.new_empty(a, dtype=torch.int64), chosen.new_empty(n_local, dtype=torch.int32),
            chosen.new_empty(a, dtype=torch.int64))


@triton_op("nextn_graph::swiglu", mutates_args=())
def swiglu_fused(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """``swiglu_reference`` elementwise in one kernel: [A, I] -> [A, I] gate.dtype."""
    from . import triton_moe as tk  # Triton is optional: imported when a fused kernel runs

    gate, up = gate.contiguous(), up.contiguous()  # [A, I]
    out = torch.empty_like(gate)  # [A, I]
    n = gate.numel()
    block = tk.SWIGLU_BLOCK
    wrap_triton(tk.swiglu_kernel)[(_cdiv(n, block),)](gate, up, out, n, float(limit),
                                                          BLOCK=block)
    return out


@swiglu_fused.register_fake
def _(gate, up, limit):
    return torch.empty_like(gate)


@triton_op("nextn_graph::moe_combine", mutates_args=())
def moe_combine_fused(ys: Tensor, pos: Tensor, weights: Tensor, offs: Tensor) -> Tensor:
    """ys [A, D] sorted, pos [A], weights [T, k] fp32, offs [n_local] int32 -> [T, D] fp32:
    out[t] = sum_j weights[t, j] * ys[pos[t*k + j]], terms with pos >= offs[-1] exactly 0."""
    from . import triton_moe as tk  # Triton is optional: imported when a fused kernel runs

    t, k = weights.shape
    d = ys.shape[1]
    ys, pos = ys.contiguous(), pos.contiguous()  # [A, D], [A]
    weights, offs = weights.contiguous(), offs.contiguous()  # [T, k], [n_local]
    out = torch.empty(t, d, dtype=torch.float32, device=ys.device)  # [T, D]
    block = tk.COMBINE_BLOCK_D
    wrap_triton(tk.moe_combine_kernel)[(t, _cdiv(d, block))](
        ys, pos, weights, offs, out, d, k, offs.numel(), BLOCK_D=block)
    return out


@moe_combine_fused.register_fake
def _(ys, pos, weights, offs):
    return ys.new_empty(weights.shape[0], ys.shape[1], dtype=torch.float32)
