"""Which part of the model an op belongs to: its module kind, from the Python stack.

The innermost frame of the op's stack that lies in ``nextn_graph/model``,
``nextn_graph/memory``, ``nextn_graph/runtime`` or ``nextn_graph/sampling.py`` decides, keyed on its file, and in a
few files on its function (``co_qualname``) as well:

- model/attention.py: attention
- model/compressor.py: indexer (class ``Indexer``), compressor (the rest)
- kernels/mhc.py (the mHC references), model/block.py: mhc (hc_pre / hc_post / hc_head, the
  layer's glue); the fused mHC ops are attributed to their callers: block.py (mhc) and
  deepseek_v4.py's ``hc_collapse`` (mhc: the stream head's ``hc_head``)
- kernels/ (the other references): defer
- model/deepseek_v4.py: embed (``ParallelEmbedding``, ``_streams``), head (the rest)
- model/nextn.py: nextn_fuse (e_proj / h_proj of the NextN input)
- model/ops.py: norm (``RMSNorm``); its other helpers (RoPE, rms_norm, attention math)
  defer
- model/moe.py: moe_gate, moe_shared or moe_routed when the function's name says gate,
  shared or routed; otherwise the module the frame runs on (its ``self``) decides:
  ``*.ffn.gate`` moe_gate, ``*.ffn.shared_experts`` moe_shared, ``*.ffn.experts.E`` and
  the MoE itself moe_routed; a frame with no such ``self`` (a helper) defers
- model/experts.py: moe_routed (the stacked experts' grouped GEMMs)
- model/quant.py: defer (a quantized linear belongs to its user)
- memory/pool.py, memory/batch.py, memory/lists.py: kv_cache
- runtime/eagle.py: bookkeeping (``window_batch``), accept/sampling (the rest: argmax,
  acceptance, select_index)
- sampling.py: accept/sampling
- runtime/round.py, runtime/buffers.py: bookkeeping (state gather and store, buffer
  copies)

"Defer" means the frame's caller decides; so does any other file in those folders (a
helper added later is attributed to whatever calls it). Frames outside them (torch,
``parallel``) are skipped. A stack with no deciding frame is ``other``.

Cheap: each code object is resolved once and cached; only ``model/moe.py`` frames
that their function name does not decide read their ``self`` per op.
"""

from __future__ import annotations

import os
import re
from types import CodeType, FrameType
from typing import Callable, Iterable

from torch import nn

OTHER = "other"
_FOLDERS = ("model", "kernels", "memory", "runtime", "sampling.py")  # (sampling: one module)
# A module's path in the model -> the kind of the MoE part it is (model/moe.py frames).
_MOE_PATHS = ((re.compile(r"(^|\.)ffn\.gate$"), "moe_gate"),
              (re.compile(r"(^|\.)ffn\.shared_experts$"), "moe_shared"),
              (re.compile(r"(^|\.)ffn(\.experts\.\d+)?$"), "moe_routed"))

Rule = str | Callable[[FrameType], "str | None"] | None  # a kind, per-frame, or defer


def _static_kind(rel: str, qualname: str) -> str | None:
    """The kind of a frame of file ``rel`` (relative to the package) and function
    ``qualname`` when it does not depend on the frame; None defers to the caller."""
    name = qualname.lower()
    if rel == "model/attention.py":
        return "attention"
    if rel == "model/compressor.py":
        return "indexer" if qualname.startswith("Indexer") else "compressor"
    if rel in ("kernels/mhc.py", "model/block.py"):
        return "mhc"
    if rel == "model/deepseek_v4.py":
        if "hc_collapse" in name:  # the stream head's hc_head, reference or fused
            return "mhc"
        return "embed" if "embed" in name or "_streams" in name else "head"
    if rel == "model/nextn.py":
        return "nextn_fuse"
    if rel == "model/ops.py":
        return "norm" if qualname.startswith("RMSNorm") else None
    if rel == "model/experts.py":
        return "moe_routed"
    if rel in ("memory/pool.py", "memory/batch.py", "memory/lists.py"):
        return "kv_cache"
    if rel == "runtime/eagle.py":
        return "bookkeeping" if "window_batch" in name else "accept/sampling"
    if rel == "sampling.py":
        return "accept/sampling"
    if rel in ("runtime/round.py", "runtime/buffers.py"):
        return "bookkeeping"
    return None


class KindResolver:
    """Frame -> module kind, cached per code object. ``models``: the profiled modules
    (target and draft), whose MoE parts are told apart by path."""

    def __init__(self, models: Iterable[nn.Module]):
        self._root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._rules: dict[CodeType, Rule] = {}
        self._moe: dict[int, str] = {}  # id(module) -> MoE kind
        for model in models:
            for path, module in model.named_modules():
                for pattern, kind in _MOE_PATHS:
                    if pattern.search(path):
                        self._moe[id(module)] = kind
                        break

    def of_frame(self, frame: FrameType | None) -> str:
        """The kind of an op called from ``frame`` (the innermost Python frame)."""
        rules = self._rules
        while frame is not None:
            code = frame.f_code
            rule = rules.get(code, rules)  # the dict itself: not seen yet
            if rule is rules:
                rule = rules[code] = self._learn(code)
            if rule is not None:
                kind = rule if type(rule) is str else rule(frame)
                if kind is not None:
                    return kind
            frame = frame.f_back
        return OTHER

    def _learn(self, code: CodeType) -> Rule:
        path = os.path.abspath(code.co_filename)
        if not path.startswith(self._root + os.sep):
            return None
        rel = os.path.relpath(path, self._root).replace(os.sep, "/")
        if rel.split("/")[0] not in _FOLDERS:
            return None
        qualname = getattr(code, "co_qualname", code.co_name)
        if rel == "model/moe.py":
            return self._moe_rule(qualname)
        return _static_kind(rel, qualname)

    def _moe_rule(self, qualname: str) -> Rule:
        name = qualname.lower()
        for word, kind in (("gate", "moe_gate"), ("shared", "moe_shared"),
                           ("routed", "moe_routed")):
            if word in name:
                return kind
        moe = self._moe
        return lambda frame: moe.get(id(frame.f_locals.get("self")))
