"""Ascend's ModelSlim W8A8 layout (``DeepSeek-V4-Flash-w8a8-mtp``): names, recipes, modules.

A ModelSlim checkpoint is ``quant_model_weights[-0000N-of-000NN].safetensors`` (with
``quant_model_weights.safetensors.index.json`` when sharded) and
``quant_model_description.json``: a flat JSON object, every tensor name -> its quant type
(``FLOAT``, ``W8A8_DYNAMIC``, ``W8A8``, ``W4A8_DYNAMIC``, ...) plus ``version``,
``model_quant_type``, ``group_size``, ``metadata`` and ``optional``. ``config.json`` has
no ``quantization_config``. Tensor names are DeepSeek's own (``layers.L.attn.wq_a.weight``,
``mtp.0.*``); a bare ``hc_head_fn`` in the description marks DeepSeek-V4.

Which linears are quantized is the description's, never a fixed list: recipes differ. The
two here (``RECIPES``) are what ``make-checkpoint --quantize w8a8`` writes:

- ``flash``: the released Flash recipe: ``attn.wq_a``, ``wq_b``, ``wkv``,
  ``indexer.wq_b``, the routed and shared experts (the NextN layer's too) W8A8_DYNAMIC;
  ``wo_a``, ``wo_b``, compressors, ``weights_proj``, the router, norms, mHC, embeddings
  and heads float.
- ``alt``: another recipe seen in the wild: ``wq_b``, ``wo_b``, ``indexer.wq_b``, the
  experts and the draft's ``e_proj`` / ``h_proj`` quantized; ``wq_a`` and ``wkv`` float.
"""

from __future__ import annotations

import re
from pathlib import Path

from torch import nn

from ..model.w8a8 import FLOAT, W4A8_DYNAMIC, W8A8_DYNAMIC, W8A8_STATIC, W8A8Linear, W8A8StaticLinear

DESCRIPTION_FILE = "quant_model_description.json"
WEIGHTS_FILE = "quant_model_weights.safetensors"
WEIGHTS_INDEX = "quant_model_weights.safetensors.index.json"
SHARD_NAME = "quant_model_weights-{i:05d}-of-{n:05d}.safetensors"
# description keys that are not tensor names
META_KEYS = ("version", "model_quant_type", "group_size", "metadata", "optional")
KNOWN_TYPES = (FLOAT, W8A8_DYNAMIC, W8A8_STATIC, W4A8_DYNAMIC)
# the tensors each quant type stores beside ``weight``
SUFFIXES = {
    W8A8_DYNAMIC: ("weight_scale", "weight_offset"),
    W8A8_STATIC: ("deq_scale", "quant_bias", "input_scale", "input_offset"),
    W4A8_DYNAMIC: ("weight_scale", "weight_offset"),
}
_EXPERTS = r"ffn\.(experts\.\d+|shared_experts)\.w[123]"
RECIPES = {
    "flash": re.compile(rf"(^|\.)(attn\.(wq_a|wq_b|wkv|indexer\.wq_b)|{_EXPERTS})$"),
    "alt": re.compile(rf"(^|\.)(attn\.(wq_b|wo_b|indexer\.wq_b)|{_EXPERTS}|e_proj|h_proj)$"),
}


def is_modelslim(root: Path) -> bool:
    """A ModelSlim export: its description file beside the weights."""
    return (root / DESCRIPTION_FILE).is_file()


def recipe_plan(linears: dict[str, nn.Module], recipe: str) -> dict[str, str]:
    """Module path -> quant type for every linear ``recipe`` quantizes (``linears``: path ->
    module, the checkpoint's names)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown W8A8 recipe {recipe!r} (known: {sorted(RECIPES)})")
    pattern = RECIPES[recipe]
    return {path: W8A8_DYNAMIC for path, m in linears.items()
            if isinstance(m, nn.Linear) and pattern.search(path)}


def w8a8_module(qtype: str, linear: nn.Linear) -> nn.Module:
    """The module holding ``linear``'s weights as ``qtype`` stores them (W4A8_DYNAMIC is
    held unpacked, as int8 values in [-8, 7], by a W8A8Linear)."""
    if qtype in (W8A8_DYNAMIC, W4A8_DYNAMIC):
        return W8A8Linear(linear.in_features, linear.out_features)
    if qtype == W8A8_STATIC:
        return W8A8StaticLinear(linear.in_features, linear.out_features)
    raise ValueError(f"no W8A8 module for quant type {qtype!r}")


def swap_linears(owner: nn.Module, plan: dict[str, str]) -> None:
    """Replace each planned ``nn.Linear`` of ``owner`` (path -> quant type) by its W8A8
    module (built on the current default device: ``meta`` while loading)."""
    for path, qtype in plan.items():
        parent_path, _, name = path.rpartition(".")
        parent = owner.get_submodule(parent_path)
        setattr(parent, name, w8a8_module(qtype, getattr(parent, name)))
