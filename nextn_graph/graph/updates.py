"""Host-argument updates of captured kernels (NPU graph ``update(cpu_update_input)``).
A graph bakes a kernel's host sequence lengths at capture, so every replay hands in one
dict per recorded updatable op, derived by its registered rule. torch_npu silently
ignores any key its handler table does not apply, so every rule is checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import show_value
from ..errors import CaptureError


@dataclass(frozen=True)
class UpdateContext:
    bucket: int  # B, the graph's request count
    width: int  # rows per request in the graph (N for verify / extend, 1 per rollout step)
    rows: tuple[int, ...]  # pool rows, padded with 0 to the bucket
    lengths: tuple[int, ...]  # committed length per row, 0 for padding


@dataclass(frozen=True)
class OpHandler:
    """One entry of torch_npu's graph op handler table. ``NPUGraph.update`` applies a key
    only if it names a kwarg of the recorded call, or as an ``(index, key)`` below when
    the call has that many positional args; any other key is ignored, silently."""

    args: tuple[tuple[int, str], ...]  # (positional index, update key)
    layout_at: int | None = None  # FA v3: an input_layout "BNSD" (kwarg or args[i]) bypasses

    def records(self, args, kwargs: dict) -> bool:
        """Whether torch_npu records this call (FA v3 lets BNSD calls through)."""
        if self.layout_at is None:
            return True
        layout = kwargs.get("input_layout") or (
            args[self.layout_at] if len(args) > self.layout_at else None)
        return layout != "BNSD"


def _overloads(packet: str, overloads: tuple[str, ...], handler: OpHandler) -> dict:
    return {name: handler for name in (packet, *(f"{packet}.{o}" for o in overloads))}


# torch_npu's table, keyed by ``func.__name__`` (no namespace: any library's op alike).
# Transcribed from github.com/Ascend/pytorch:
#   torch_npu/npu/_npugraph_handlers/ifa_handler.py @ 2e2ffc1dacf6ab6c353d6de49618d1c370e680e8
#   torch_npu/npu/_npugraph_handlers/simple_handler.py @ 792a02729df12ecb9d0ce2a546a00ca3b7027991
#     (its later UPDATE_SPECS form @ 6d0117ffd91b388e90da2f5979ae9c770b182c7f holds the same data)
#   torch_npu/npu/_npugraph_handlers/_fa3_graph_handler.py
#     @ 698247022bc610517b2354235af785b51c8da68c
#     (BNSD bypasses; the package __init__ @ 681d2d0bb623 may not register FA v3)
#   the kwarg rule: _GraphDispatchMode.update_capture_record in torch_npu/npu/graphs.py
#     @ 0dc3742d22df70b5d5323a6c88ffbbf79cf78568
# IFA v1/v2 and FA v3 record their ``.default`` calls as ``.out`` (the handler swaps the
# overload), with the default call's args and kwargs plus ``workspace`` and ``out``.
TORCH_NPU_HANDLERS: dict[str, OpHandler] = {
    **_overloads("npu_fused_infer_attention_score", ("default", "out"),
                 OpHandler(((6, "actual_seq_lengths_kv"),))),
    **_overloads("npu_fused_infer_attention_score_v2", ("default", "out"),
                 OpHandler(((8, "actual_seq_kvlen"),))),
    "_npu_paged_attention.default": OpHandler(((7, "context_lens"),)),
    "npu_multi_head_latent_attention.out": OpHandler(((5, "context_lens"),)),
    **_overloads("npu_fusion_attention_v3", ("default", "out"),
                 OpHandler(((14, "actual_seq_qlen"), (15, "actual_seq_kvlen")), layout_at=4)),
    **_overloads("npu_fusion_attention_grad_v3", ("default", "out"),
                 OpHandler(((21, "actual_seq_qlen"), (22, "actual_seq_kvlen")), layout_at=5)),
}


@dataclass(frozen=True)
class Updatable:
    # ("kwarg", name, key) or ("arg", index, key), as torch_npu's handlers declare
    spec: tuple[tuple[str, Any, str], ...]
    rule: Callable[[UpdateContext], dict]  # the dict for this replay

    @property
    def keys(self) -> set[str]:
        return {key for _, _, key in self.spec}


@dataclass
class UpdateRegistry:
    ops: dict[str, Updatable] = field(default_factory=dict)

    def register(self, op_name: str, spec, rule: Callable[[UpdateContext], dict]) -> None:
        self.ops[op_name] = Updatable(tuple(spec), rule)

    def find(self, func) -> Updatable | None:
        return self.ops.get(func.__name__) or self.ops.get(func.overloadpacket.__name__)

    def _entry(self, name: str) -> Updatable:
        entry = self.ops.get(name) or self.ops.get(name.split(".")[0])
        if entry is None:
            raise CaptureError(f"graph recorded updatable op {name!r} but no update rule "
                               f"is registered for it")
        return entry

    def derive(self, op_names: list[str], ctx: UpdateContext) -> list[dict]:
        dicts = []
        for name in op_names:
            entry = self._entry(name)
            update = entry.rule(ctx)
            if not set(update) <= entry.keys:  # an undeclared key would be dropped
                raise CaptureError(f"update rule for {name!r} returned key(s) "
                                   f"{sorted(set(update) - entry.keys)} its spec does not "
                                   f"declare (declared: {sorted(entry.keys)})")
            dicts.append(update)
        return dicts

    def check_torch_npu_rules(self, handlers: dict[str, OpHandler] = TORCH_NPU_HANDLERS) -> None:
        """Refuse every rule torch_npu would not apply: its op is not in the table, a
        kwarg is fed from a key of another name, or an arg slot is not the table's."""
        for op_name, entry in self.ops.items():
            names = [n for n in handlers if op_name in (n, n.split(".")[0])]
            if not names:
                raise CaptureError(
                    f"update rule for {op_name!r}: torch_npu's graph op handlers never record "
                    f"this op, so on an NPU its host arguments would stay as captured; "
                    f"updatable ops: {sorted({n.split('.')[0] for n in handlers})}")
            packet = op_name.split(".")[0]
            if op_name == f"{packet}.default" and f"{packet}.out" in handlers:
                raise CaptureError(
                    f"update rule for {op_name!r}: torch_npu records {op_name} calls as "
                    f"{packet}.out, so register the rule under {packet!r}")
            for kind, where, key in entry.spec:
                if kind == "kwarg" and where != key:
                    raise CaptureError(
                        f"update rule for {op_name!r}, key {key!r}: torch_npu replaces a "
                        f"kwarg only from the update key of its own name, so kwarg "
                        f"{where!r} needs key {where!r}; key {key!r} would be ignored")
                if kind == "arg":
                    for name in names:
                        if (where, key) not in handlers[name].args:
                            raise CaptureError(
                                f"update rule for {op_name!r}, key {key!r}: torch_npu applies "
                                f"positional updates of {name} only as {handlers[name].args} "
                                f"(index, key); ('arg', {where}, {key!r}) would be ignored")
                if kind not in ("kwarg", "arg"):
                    raise CaptureError(f"update rule for {op_name!r}: spec kind {kind!r} is "
                                       f"neither 'kwarg' nor 'arg'")

    def check_torch_npu_records(self, records: list,
                                handlers: dict[str, OpHandler] = TORCH_NPU_HANDLERS) -> None:
        """Each recorded op (torch_npu's ``graph_dispatch_records``) has a rule, and every
        key of it lands: a kwarg the recorded call holds, an arg slot the call reaches."""
        for rec in records:
            name = rec.op_cache_entry.__name__
            entry = self._entry(name)
            if name not in handlers:
                raise CaptureError(f"graph recorded {name!r}, which torch_npu's handler table "
                                   f"as transcribed here does not hold; its updates are unknown")
            for kind, where, key in entry.spec:
                if kind == "kwarg" and key not in rec.kwargs:
                    raise CaptureError(
                        f"update rule for {name!r}, key {key!r}: the recorded call holds no "
                        f"kwarg {key!r} (it holds {show_value(sorted(rec.kwargs))}), so "
                        f"torch_npu would ignore the key; pass {key!r} at capture")
                if kind == "arg" and len(rec.args) <= where:
                    raise CaptureError(
                        f"update rule for {name!r}, key {key!r}: it targets args[{where}] but "
                        f"the recorded call has {len(rec.args)} positional arg(s), so torch_npu "
                        f"would ignore the key")
