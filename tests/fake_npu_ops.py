"""A CPU stand-in for the torch_npu fused ops that ``nextn_graph/kernels/npu.py`` maps
(and ``npu_gemm.py``: ``npu_grouped_matmul``).

Each op is written from torch_npu's documentation (Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md``; where the doc's formula is loose, the
CPU golden of the op's own test, ``test/test_custom_ops/test_<op>.py``), in plain torch:
never by calling the project's references, so a layout or convention slip in the mapping
shows as a numeric mismatch. Signatures and return tuples are the documented ones, and
each op rejects what its doc rejects (shapes, dtypes, layouts) for the cases the mapping
uses, so a mapping that feeds a layout the device would refuse fails here too.

Compute is fp32 with one rounding to the documented output dtype: what the device
kernels do by their docs' precision notes (the fake's own rounding is not the device's,
so tests compare at fp32 tolerance, not bitwise).

``FakeTorchNpu(soc)`` (``fake_torch_npu(soc)``): ``soc`` is what
``torch_npu.npu.get_soc_version()`` returns (torch_npu ``csrc/core/npu/NpuVariables.h``:
220-225 Atlas A2, 250-256 Atlas A3, 260 Ascend 950); ``calls`` counts the ops run.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import torch
import torch.nn.functional as F

A2, A3, ASCEND950 = 220, 250, 260  # Ascend910B1, Ascend910_9391, Ascend950
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"fake torch_npu: {what}")


class FakeTorchNpu:
    """The mapped ops of ``torch_npu`` on CPU tensors (see the module docstring)."""

    def __init__(self, soc: int = A2):
        self.npu = SimpleNamespace(get_soc_version=lambda: soc)
        self.calls: Counter[str] = Counter()

    # ---- torch_npu.npu_rms_norm ((beta)torch_npu-npu_rms_norm.md) -----------------------
    def npu_rms_norm(self, self_, gamma, epsilon=1e-06):
        """-> (x / Rms(x) * gamma in x.dtype, rstd fp32 [x's leading dims]); Rms over the
        trailing ``gamma.dim()`` dims: sqrt(mean(x^2) + eps)."""
        self.calls["npu_rms_norm"] += 1
        x = self_
        _need(2 <= x.dim() <= 8, "npu_rms_norm: self must have 2-8 dims")
        _need(x.dtype in _FLOATS, "npu_rms_norm: self dtype")
        lead = x.dim() - gamma.dim()  # the dims not normed
        _need(lead > 0 and tuple(gamma.shape) == tuple(x.shape[lead:]),
              "npu_rms_norm: gamma_shape must be self_shape[n:]")
        _need(gamma.dtype in (x.dtype, torch.float32),  # (bf16|fp16, fp32) on A2/A3
              "npu_rms_norm: (self, gamma) dtypes must be one of the documented pairs")
        dims = tuple(range(lead, x.dim()))
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + epsilon)
        y = (xf * rstd * gamma.float()).to(x.dtype)
        return y, rstd.reshape(x.shape[:lead])

    # ---- torch_npu.npu_rotary_mul (torch_npu-npu_rotary_mul.md) --------------------------
    def npu_rotary_mul(self, input, r1, r2, rotary_mode="half", rotate=None):
        """``input * r1 + rotate(input) * r2``; interleave: rotate(x) pairs (x0, x1) to
        (-x1, x0); half: concat(-x2, x1) of the two halves. jit_compile=False layouts:
        TND input with T1D r1/r2 (the only one the mapping uses), and BSND with 1S1D."""
        self.calls["npu_rotary_mul"] += 1
        x = input
        _need(rotate is None, "npu_rotary_mul: the fake has no rotate matrix")
        _need(rotary_mode in ("half", "interleave"), "npu_rotary_mul: rotary_mode")
        _need(x.dim() in (3, 4) and r1.dim() == x.dim() and r2.shape == r1.shape,
              "npu_rotary_mul: input, r1, r2 must be 3-D or 4-D alike")
        _need(x.dtype in _FLOATS and r1.dtype == x.dtype and r2.dtype == x.dtype,
              "npu_rotary_mul: dtypes")
        d = x.shape[-1]
        _need(d % 2 == 0 and d < 896, "npu_rotary_mul: D must be even and < 896")
        if x.dim() == 3:  # TND: r1 T1D
            _need(tuple(r1.shape) == (x.shape[0], 1, d), "npu_rotary_mul: TND needs r1 T1D")
            _need(x.shape[1] < 1000, "npu_rotary_mul: N < 1000")
        else:  # BSND: r1 1S1D
            _need(tuple(r1.shape) == (1, x.shape[1], 1, d), "npu_rotary_mul: BSND needs r1 1S1D")
        _need(x.is_contiguous() and r1.is_contiguous() and r2.is_contiguous(),
              "npu_rotary_mul: contiguous tensors (the doc states no strided support)")
        xf = x.float()
        if rotary_mode == "interleave":
            x1, x2 = xf[..., ::2], xf[..., 1::2]
            turned = torch.stack((-x2, x1), dim=-1).flatten(-2)
        else:
            x1, x2 = xf.chunk(2, dim=-1)
            turned = torch.cat((-x2, x1), dim=-1)
        return (xf * r1.float() + turned * r2.float()).to(x.dtype)

    # ---- torch_npu.npu_clipped_swiglu (torch_npu-npu_clipped_swiglu.md) ------------------
    def npu_clipped_swiglu(self, x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0,
                           bias=1.0, interleaved=True):
        """Split ``x`` along ``dim`` into A, B (halves, or even/odd when interleaved);
        A.clamp(max=limit), B.clamp(-limit, limit); y = A * sigmoid(alpha*A) * (B + bias)."""
        self.calls["npu_clipped_swiglu"] += 1
        _need(x.dim() > 1 and x.shape[dim] % 2 == 0, "npu_clipped_swiglu: x shape")
        _need(x.dtype in _FLOATS and x.is_contiguous(), "npu_clipped_swiglu: x dtype/contiguous")
        _need(group_index is None, "npu_clipped_swiglu: the fake has no group_index")
        xf = x.float().movedim(dim, -1)
        if interleaved:
            a, b = xf[..., ::2], xf[..., 1::2]
        else:
            a, b = xf.chunk(2, dim=-1)
        a = a.clamp(max=limit)
        b = b.clamp(min=-limit, max=limit)
        y = a * torch.sigmoid(alpha * a) * (b + bias)
        return y.movedim(-1, dim).to(x.dtype)

    # ---- torch_npu.npu_moe_finalize_routing (torch_npu-npu_moe_finalize_routing.md) ------
    def npu_moe_finalize_routing(self, expanded_permuted_rows, skip1, skip2, bias, scales,
                                 expanded_src_to_dst_row, expert_for_source_row,
                                 drop_pad_mode=0):
        """out[i] = skip1[i] + skip2[i] + sum_k scales[i, k] * (rows[idx(i, k)] +
        bias[expert[i, k]]), idx(i, k) = src_to_dst[k*NUM_ROWS + i] (modes 0, 1: by column)
        or src_to_dst[i*K + k] (modes 2, 3: by row); the dropless modes 0, 2 here."""
        self.calls["npu_moe_finalize_routing"] += 1
        rows, idx = expanded_permuted_rows, expanded_src_to_dst_row
        _need(drop_pad_mode in (0, 2), "npu_moe_finalize_routing: the fake has the dropless "
                                       "modes 0 and 2 only")
        _need(rows.dim() == 2 and rows.dtype in _FLOATS, "npu_moe_finalize_routing: rows")
        _need(idx.dim() == 1 and idx.dtype == torch.int32, "npu_moe_finalize_routing: "
              "expanded_src_to_dst_row must be 1-D int32")
        nk = idx.numel()
        _need(scales is not None and scales.dtype == rows.dtype and scales.dim() == 2
              and scales.numel() == nk, "npu_moe_finalize_routing: scales [NUM_ROWS, K] of "
              "the rows' dtype")
        _need(skip1 is not None or skip2 is None, "npu_moe_finalize_routing: skip2 needs skip1")
        _need(bool(((idx >= 0) & (idx < nk)).all()), "npu_moe_finalize_routing: dropless "
              "indices must lie in [0, NUM_ROWS*K - 1]")
        n, k = scales.shape
        at = idx.long().view(k, n).t() if drop_pad_mode == 0 else idx.long().view(n, k)
        out = torch.zeros(n, rows.shape[1], dtype=torch.float32)
        for s in (skip1, skip2):
            if s is not None:
                out += s.float()
        for j in range(k):  # the doc's loop over k
            term = rows.float()[at[:, j]]
            if bias is not None:
                term = term + bias.float()[expert_for_source_row[:, j].long()]
            out += scales.float()[:, j:j + 1] * term
        return out.to(rows.dtype)

    # ---- torch_npu.npu_mhc_pre (torch_npu-npu_mhc_pre.md, test_npu_mhc_pre.py golden) -----
    def npu_mhc_pre(self, x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6,
                    out_flag=0, inner_precise=0):
        """x [T, n, D] bf16/fp16 -> (h_in [T, D] x.dtype, h_post [T, n], h_res [T, n, n]
        before Sinkhorn, inv_rms, h_mix, h_pre (the last three when out_flag=1)).
        x' = RmsNorm(x) (gamma optional), H = alpha * (x' phi) + b per part (pre, post,
        res in phi's row order), pre = sigmoid + hc_eps, post = 2 sigmoid, h_in = sum_i
        pre_i x_i."""
        self.calls["npu_mhc_pre"] += 1
        _need(x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16),
              "npu_mhc_pre: x [T, n, D] bf16/fp16")
        t, n, d = x.shape
        _need(n in (4, 6, 8) and d % 16 == 0 and 1 <= d <= 16384, "npu_mhc_pre: n, D")
        _need(phi.dtype == torch.float32 and tuple(phi.shape) == (n * n + 2 * n, n * d),
              "npu_mhc_pre: phi (n^2+2n, nD) fp32")
        _need(alpha.dtype == torch.float32 and tuple(alpha.shape) == (3,), "npu_mhc_pre: alpha")
        _need(bias.dtype == torch.float32 and tuple(bias.shape) == (n * n + 2 * n,),
              "npu_mhc_pre: bias")
        xf = x.reshape(t, n * d).float()
        inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)  # [T, 1]
        xg = xf if gamma is None else xf * gamma.reshape(n * d).float()
        h_mix = F.linear(xg, phi)  # [T, n^2+2n], as the op's CPU golden computes it
        w = h_mix * inv_rms
        h_pre = torch.sigmoid(w[:, :n] * alpha[0] + bias[:n]) + hc_eps
        h_post = 2 * torch.sigmoid(w[:, n:2 * n] * alpha[1] + bias[n:2 * n])
        h_res = (w[:, 2 * n:] * alpha[2] + bias[2 * n:]).view(t, n, n)
        h_in = (h_pre.unsqueeze(-1) * xf.view(t, n, d)).sum(dim=1).to(x.dtype)
        extra = (inv_rms[:, 0], h_mix, h_pre) if out_flag else (None, None, None)
        return (h_in, h_post, h_res) + extra

    # ---- torch_npu.npu_mhc_sinkhorn (torch_npu-npu_mhc_sinkhorn.md) ----------------------
    def npu_mhc_sinkhorn(self, x, eps=1e-6, num_iters=20, out_flag=0):
        """softmax(x) + eps, divided by its column sums + eps; then num_iters - 1 times
        rows then columns, each divided by its sums + eps. -> (y, norm_out, sum_out)."""
        self.calls["npu_mhc_sinkhorn"] += 1
        _need(x.dtype == torch.float32 and x.dim() in (3, 4) and x.shape[-1] == x.shape[-2]
              and x.shape[-1] in (4, 6, 8), "npu_mhc_sinkhorn: x [T, n, n] fp32, n 4/6/8")
        _need(1 <= num_iters <= 100 and out_flag == 0, "npu_mhc_sinkhorn: num_iters, out_flag")
        y = torch.softmax(x, dim=-1) + eps
        y = y / (y.sum(dim=-2, keepdim=True) + eps)
        for _ in range(num_iters - 1):
            y = y / (y.sum(dim=-1, keepdim=True) + eps)
            y = y / (y.sum(dim=-2, keepdim=True) + eps)
        return y, None, None

    # ---- torch_npu.npu_mhc_post (torch_npu-npu_mhc_post.md, test_npu_mhc_post.py golden) --
    def npu_mhc_post(self, x, h_res, h_out, h_post):
        """x [T, n, D], h_res [T, n, n] fp32, h_out [T, D], h_post [T, n] fp32 -> [T, n, D]
        x.dtype: y[j] = sum_i h_res[i, j] * x[i] + h_post[j] * h_out (the op's CPU golden
        sums h_res's dim -2 against x's streams; the doc writes it ``H_res x_l``)."""
        self.calls["npu_mhc_post"] += 1
        _need(x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16),
              "npu_mhc_post: x [T, n, D] bf16/fp16")
        t, n, d = x.shape
        _need(h_out.dtype == x.dtype and tuple(h_out.shape) == (t, d), "npu_mhc_post: h_out")
        _need(h_post.dtype == torch.float32 and tuple(h_post.shape) == (t, n),
              "npu_mhc_post: h_post")
        xf = x.float()
        y = h_post.unsqueeze(-1) * h_out.float().unsqueeze(-2)  # [T, n, D]
        if h_res is not None:
            _need(h_res.dtype == torch.float32 and tuple(h_res.shape) == (t, n, n),
                  "npu_mhc_post: h_res [T, n, n] fp32")
            y = y + (h_res.unsqueeze(-1) * xf.unsqueeze(-2)).sum(dim=-3)
        else:
            y = y + xf
        return y.to(x.dtype)

    # ---- torch_npu.npu_grouped_matmul (torch_npu-npu_grouped_matmul.md) -------------------
    def npu_grouped_matmul(self, x, weight, *, bias=None, scale=None, offset=None,
                           antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
                           group_list=None, activation_input=None, activation_quant_scale=None,
                           activation_quant_offset=None, split_item=0, group_type=None,
                           group_list_type=0, act_type=0, output_dtype=None,
                           tuning_config=None):
        """The non-quantized m-split "single x, single weight, single y" case (formula 1,
        no bias): x [[M, K]], weight [[g, K, N]] (a transposed [g, N, K] view allowed),
        group_list [g] int64 tensor, cumsum (type 0, non-decreasing, last == M) or sizes
        (type 1, sum == M), split_item 2/3 -> [y [M, N] in x.dtype], y_i = x_i @ weight_i."""
        self.calls["npu_grouped_matmul"] += 1
        quant = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                 activation_input, activation_quant_scale, activation_quant_offset)
        _need(all(a is None for a in quant) and act_type == 0 and tuning_config is None,
              "npu_grouped_matmul: the fake has the non-quantized case only, no bias")
        _need(len(x) == 1 and len(weight) == 1 and split_item in (2, 3) and group_type == 0,
              "npu_grouped_matmul: the fake has single x, weight, y (split_item 2/3, "
              "group_type 0) only")
        a, w = x[0], weight[0]
        _need(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1],
              "npu_grouped_matmul: x [M, K], weight [g, K, N]")
        _need(a.dtype in _FLOATS and w.dtype == a.dtype and output_dtype in (None, a.dtype),
              "npu_grouped_matmul: non-quantized x and weight of one float dtype (table 2)")
        _need(a.is_contiguous(), "npu_grouped_matmul: x does not support transposition")
        transposed = w.stride(1) == 1 and w.stride(2) == w.shape[1]  # [g, N, K] in memory
        _need(w.is_contiguous() or transposed, "npu_grouped_matmul: weight strides")
        inner = w.shape[1] if transposed else w.shape[2]  # K if transposed, else N
        _need(max(a.shape[1], inner) < 65536, "npu_grouped_matmul: InnerLimit 65536")
        gl = group_list
        _need(isinstance(gl, torch.Tensor) and gl.dtype == torch.int64 and gl.dim() == 1
              and gl.numel() == w.shape[0] <= 1024, "npu_grouped_matmul: group_list [g] "
              "int64, g <= 1024")
        _need(group_list_type in (0, 1), "npu_grouped_matmul: the fake has types 0 and 1")
        ends = gl if group_list_type == 0 else gl.cumsum(0)
        _need(bool((gl >= 0).all()) and bool((ends[1:] >= ends[:-1]).all())
              and int(ends[-1]) == a.shape[0], "npu_grouped_matmul: group_list must end at "
              "x's first dim (cumsum non-negative, non-decreasing)")
        y = torch.empty(a.shape[0], w.shape[2], dtype=torch.float32)
        start = 0
        for g, end in enumerate(ends.tolist()):  # the doc's y_i = x_i @ weight_i
            y[start:end] = a[start:end].float() @ w[g].float()
            start = end
        return [y.to(a.dtype)]


def fake_torch_npu(soc: int = A2) -> FakeTorchNpu:
    """A fake torch_npu on ``soc`` (default an Atlas A2, where most mapped ops exist)."""
    return FakeTorchNpu(soc)
