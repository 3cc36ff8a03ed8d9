"""The ideal: the weight bytes a round must read at least, from the modules' persistent
tensors (their state dict: parameters and buffers as the checkpoint holds them, a
``QuantLinear``'s ``weight`` and ``scale`` bits; never non-persistent tables such as
RoPE's cos/sin or the FP4 value table), not from the op trace.

Per forward of T rows, every weight is read once, except:
- the embedding (``embed.weight``) and the hash-routing tables (``ffn.gate.tid2eid``):
  only the T rows looked up (at most the table);
- the routed experts (``ffn.experts.*``): per MoE layer only min(E, T*k) of its E
  experts, the most that T rows routed to k experts each can reach.
The NextN draft's forward reads its own layer (``mtp.0.*``) plus the shared embedding
rows and the shared LM head. KV-cache reads are not included: the ideal is weights only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import Tensor

from ..checkpoint.loader import LoadedModel
from .build import ProfileSettings

ROUTED = re.compile(r"^(.*\.ffn)\.experts\.")  # group: the MoE layer
BY_ROW = re.compile(r"(^|\.)(embed\.weight|ffn\.gate\.tid2eid)$")


@dataclass(frozen=True)
class ForwardWeights:
    """The persistent tensors one forward reads, by how it reads them."""

    whole: int  # bytes read whole by every forward
    by_row: tuple[tuple[int, int], ...]  # (bytes, rows) of tables read by row
    routed: tuple[int, ...]  # per MoE layer: bytes of all its routed experts
    experts: int  # E: routed experts per MoE layer
    topk: int  # k

    def bytes_for(self, rows: int) -> int:
        """Least weight bytes of one forward over ``rows`` rows."""
        total = self.whole + sum(b * min(rows, n) // n for b, n in self.by_row)
        active = min(self.experts, rows * self.topk)
        return total + sum(b * active // self.experts for b in self.routed)


def forward_weights(state: dict[str, Tensor], experts: int, topk: int) -> ForwardWeights:
    whole, by_row, routed = 0, [], {}
    for key, t in state.items():
        size = t.numel() * t.element_size()
        layer = ROUTED.match(key)
        if layer:
            routed[layer.group(1)] = routed.get(layer.group(1), 0) + size
        elif BY_ROW.search(key):
            by_row.append((size, max(t.shape[0], 1)))
        else:
            whole += size
    return ForwardWeights(whole, tuple(by_row), tuple(routed.values()), experts, topk)


def ideal_bytes(models: LoadedModel, st: ProfileSettings) -> dict[str, int]:
    """Least weight bytes per phase of one round (the phases ``DecodeRound`` runs)."""
    cfg = models.cfg
    target_state = models.target.state_dict()
    shared = {k: target_state[k] for k in ("embed.weight", "head.weight")}
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    target = forward_weights(target_state, experts, k)
    draft = forward_weights({**models.draft.state_dict(), **shared}, experts, k)
    b, n, s = st.bucket, st.verify_width, st.num_steps
    out = {}
    if s > 1:
        out["rollout"] = (s - 1) * draft.bytes_for(b)
    out["target_verify"] = target.bytes_for(b * n)
    if s > 0:
        out["draft_extend"] = draft.bytes_for(b * n)
    return out


def phase_forwards(st: ProfileSettings) -> dict[str, dict]:
    """Model forwards of each phase: which model, how many, rows each."""
    b, n, s = st.bucket, st.verify_width, st.num_steps
    out = {}
    if s > 1:
        out["rollout"] = {"model": "draft", "forwards": s - 1, "rows": b}
    out["target_verify"] = {"model": "target", "forwards": 1, "rows": b * n}
    if s > 0:
        out["draft_extend"] = {"model": "draft", "forwards": 1, "rows": b * n}
    return out
