"""How DeepSeek-V4 shards over a tensor-parallel group: one table, keyed by checkpoint name.

The split is the one of DeepSeek's reference ``inference/model.py``, so the released
checkpoint maps onto the ranks without conversion: the model builds its local shapes
with ``TPGroup.part``, the loader reads each rank's slice straight from the shards
(``part_for``, ``quant_parts``), and ``random_models`` keeps each rank's slice of the
tp = 1 values (``slice_for``). A key no rule names is replicated.

Every split dim divides evenly or the model refuses to build (a ``ConfigError`` naming
the dimension); a quantized weight splits only at whole scale blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..model.quant import FP4_BLOCK, FP8_BLOCK
from ..parallel.group import TPGroup

SPLIT, EXPERT = "split", "expert"


@dataclass(frozen=True)
class Rule:
    pattern: str  # a regex searched in the checkpoint key (so mtp.0.* matches too)
    kind: str  # SPLIT (one dim) or EXPERT (whole experts per rank)
    dim: int | None  # the split dim of the stored tensor (and of its .scale)
    what: str  # the config key that splits (named by errors)
    how: str  # the forward's side of it, for the README's table


RULES = (
    Rule(r"^embed\.weight$", SPLIT, 0, "vocab_size",
         "vocab-parallel: ids outside the rank's rows give zero rows; all-reduce"),
    Rule(r"^head\.weight$", SPLIT, 0, "vocab_size",
         "local logits in fp32; all-gather to the full [T, V]"),
    Rule(r"(^|\.)attn\.wq_b\.(weight|scale)$", SPLIT, 0, "num_attention_heads",
         "column-parallel: the rank's query heads"),
    Rule(r"(^|\.)attn\.attn_sink$", SPLIT, 0, "num_attention_heads",
         "the rank's heads' sinks"),
    Rule(r"(^|\.)attn\.wo_a\.(weight|scale)$", SPLIT, 0, "o_groups",
         "the rank's output groups"),
    Rule(r"(^|\.)attn\.wo_b\.(weight|scale)$", SPLIT, 1, "o_groups",
         "row-parallel; all-reduce in fp32"),
    Rule(r"(^|\.)attn\.indexer\.wq_b\.(weight|scale)$", SPLIT, 0, "index_n_heads",
         "the rank's indexer heads"),
    Rule(r"(^|\.)attn\.indexer\.weights_proj\.weight$", SPLIT, 0, "index_n_heads",
         "partial scores (local heads) all-reduced before the top-k"),
    Rule(r"(^|\.)ffn\.experts\.(?P<expert>\d+)\.", EXPERT, None, "n_routed_experts",
         "expert-parallel: rank r owns experts [r*E/tp, (r+1)*E/tp); one fp32 all-reduce "
         "of the routed sum, then the replicated shared expert"),
)
_COMPILED = tuple((re.compile(rule.pattern), rule) for rule in RULES)
REPLICATED_NOTE = ("wq_a, wkv, q_norm, kv_norm, compressors (the indexer's too), gate "
                   "(weight, bias, tid2eid), shared experts, norms, mHC, hc_head, NextN "
                   "e_proj / h_proj / enorm / hnorm")


def _table() -> str:
    rows = ["| checkpoint key | split | by | forward |", "|---|---|---|---|"]
    for rule in RULES:
        key = rule.pattern.replace("(^|\\.)", "*.").replace("\\.", ".").strip("^$")
        key = re.sub(r"\(\?P<expert>\\d\+\)", "E", key).replace("(weight|scale)", "weight/scale")
        key += "*" if key.endswith(".") else ""
        split = f"dim {rule.dim}" if rule.kind == SPLIT else "experts"
        rows.append(f"| `{key}` | {split} | {rule.what} | {rule.how} |")
    rows.append(f"| everything else | replicated | - | {REPLICATED_NOTE} |")
    return "\n".join(rows)


SHARDING_TABLE = _table()  # markdown rows for the README


def rule_for(key: str) -> Rule | None:
    """The rule that shards ``key``, or None: replicated."""
    for pattern, rule in _COMPILED:
        if pattern.search(key):
            return rule
    return None


def split_dim(key: str) -> int | None:
    """The dim ``key`` splits along; None when replicated or expert-parallel."""
    rule = rule_for(key)
    return rule.dim if rule is not None and rule.kind == SPLIT else None


def expert_of(key: str) -> int | None:
    """The global expert index of a routed expert's key, else None."""
    for pattern, rule in _COMPILED:
        if rule.kind == EXPERT and (m := pattern.search(key)):
            return int(m.group("expert"))
    return None


def expert_owner(expert: int, n_experts: int, tp: TPGroup) -> int | None:
    """The rank that holds expert ``expert`` (None when it is not an expert of the model)."""
    _, per_rank = tp.part(n_experts, "n_routed_experts")
    return expert // per_rank if 0 <= expert < n_experts else None


def is_foreign(key: str, n_experts: int, tp: TPGroup) -> bool:
    """Another rank's expert: this rank neither builds nor reads it."""
    expert = expert_of(key)
    if expert is None:
        return False
    owner = expert_owner(expert, n_experts, tp)
    return owner is not None and owner != tp.rank


def part_for(key: str, global_shape: tuple[int, ...], tp: TPGroup) -> tuple | None:
    """This rank's ``(dim, start, length)`` of a tensor of ``global_shape``; None: all of it."""
    dim = split_dim(key)
    if dim is None or not tp.parallel:
        return None
    start, length = tp.part(global_shape[dim], rule_for(key).what)
    return dim, start, length


def local_shape(key: str, global_shape: tuple[int, ...], tp: TPGroup) -> tuple[int, ...]:
    part = part_for(key, global_shape, tp)
    if part is None:
        return tuple(global_shape)
    dim, _, length = part
    return (*global_shape[:dim], length, *global_shape[dim + 1:])


def global_shape(key: str, shape: tuple[int, ...], tp: TPGroup) -> tuple[int, ...]:
    """The checkpoint's shape of a tensor this rank holds at ``shape``."""
    dim = split_dim(key)
    if dim is None:
        return tuple(shape)
    return (*shape[:dim], shape[dim] * tp.size, *shape[dim + 1:])


def slice_for(key: str, tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of a whole (tp = 1) tensor: a view."""
    part = part_for(key, tuple(tensor.shape), tp)
    return tensor if part is None else tensor.narrow(*part)


def quant_parts(where: str, base: str, fmt: str, out: int, inp: int,
                tp: TPGroup) -> tuple[tuple | None, tuple | None]:
    """This rank's parts of a quantized linear's stored ``.weight`` and ``.scale``, for a
    [out, in] linear (global): whole scale blocks only, else a ``CheckpointError``."""
    dim = split_dim(base + ".weight")
    if dim is None or not tp.parallel:
        return None, None
    start, n = tp.part((out, inp)[dim], rule_for(base + ".weight").what)
    # FP8: 128 x 128 blocks; packed FP4: one scale per 32 inputs, two inputs per byte
    block = FP8_BLOCK if fmt == "fp8" else (1, FP4_BLOCK)[dim]
    if n % block:
        raise CheckpointError(
            f"{where}: tensor parallelism splits {fmt.upper()} tensor {base}.weight "
            f"[{out}, {inp}] along dim {dim} into tp = {tp.size} parts of {n}, not a "
            f"multiple of its scale block of {block}")
    pack = 2 if fmt == "fp4" and dim == 1 else 1
    return (dim, start // pack, n // pack), (dim, start // block, n // block)


def sharded_bytes(models) -> dict:
    """This rank's weight bytes (the state dicts of ``models.target`` and ``.draft``) by
    kind: ``split`` (split dims and routed experts) and ``replicated``. A QuantLinear's
    bits and scales count under its weight's kind."""
    out = {"split": 0, "replicated": 0}
    for owner in (models.target, models.draft):
        for key, t in owner.state_dict().items():
            out["replicated" if rule_for(key) is None else "split"] += t.numel() * t.element_size()
    out["total"] = out["split"] + out["replicated"]
    return out
