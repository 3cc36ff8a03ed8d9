"""Checkpoints in the released DeepSeek-V4 layout: ``config.json`` + safetensors.

Keys are the released ones (``embed.weight``, ``layers.L.attn.wq_a.weight``, ...,
``mtp.0.*`` for the one NextN layer); the module tree is named so that a state
dict *is* that layout. Files are one ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Matrices are stored bf16; mHC params, sinks,
``ape`` and router biases fp32, ``tid2eid`` int32.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..model import ModelConfig
from ..model.quant import QuantLinear
from ..model.quant import quantize as quantize_weight
from ..parallel.group import TPGroup
from .loader import LoadedModel, build_models, expected_state
from .presets import init_random, iter_random, storage_dtype
from .sharding import slice_for
from .weights import INDEX_FILE, SINGLE_FILE

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # beside the weights
QUANTIZE = ("none", "fp8")  # make-checkpoint --quantize
# Linear weights the release stores FP8 (block scales) and FP4 (routed experts).
_FP8_KEY = re.compile(r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|"
                      r"ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$")
_FP4_KEY = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                       "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def random_models(cfg: ModelConfig, seed: int, tp: TPGroup | None = None) -> LoadedModel:
    """Target and draft with deterministic random weights (see ``init_random``). With
    ``tp``, this rank's slices of the very values of tp = 1: every rank draws the whole
    model's values, one tensor at a time, and keeps its part."""
    models = build_models(cfg, tp)
    if not models.tp.parallel:
        state = init_random(expected_state(models), cfg, seed)
        models.target.load_state_dict({k: v for k, v in state.items()
                                       if not k.startswith("mtp.")})
        models.draft.load_state_dict({k: v for k, v in state.items() if k.startswith("mtp.")})
        return models
    with torch.device("meta"):  # the global shapes, in the order tp = 1 draws them
        whole = expected_state(build_models(cfg))
    local = expected_state(models)
    with torch.no_grad():
        for key, value in iter_random(whole, cfg, seed):
            if key in local:  # not another rank's expert
                local[key].copy_(slice_for(key, value, models.tp))
    return models


def save_checkpoint(models: LoadedModel, path: str | Path,
                    max_shard_bytes: int | None = None, quantize: str = "none") -> Path:
    """Write ``config.json`` and the tensors in the released layout (sharded if asked).

    ``quantize="fp8"`` writes the release's dtypes: FP8 e4m3 linears with e8m0 block
    scales, packed FP4 routed experts with e8m0 scales per 32 inputs, and the
    ``quantization_config``. Quantized modules of a loaded model are written as stored.

    The files are written into a fresh sibling directory and renamed into place, so
    ``path`` holds either the previous checkpoint or the complete new one, never a
    mix. An existing checkpoint at ``path`` is replaced wholesale (renamed aside,
    then removed); a non-empty directory that is not a checkpoint is refused.
    """
    root = Path(path)
    if models.tp.parallel:
        raise CheckpointError(f"{root}: cannot save a model sharded over tp = "
                              f"{models.tp.size} ranks (rank {models.tp.rank} holds a part of "
                              f"it); save the tp = 1 model, every rank loads its part of that")
    target = root.resolve()  # a symlinked dir: replace what it points at, keep the link
    _check_replaceable(target)
    staging = _fresh_sibling(target, "partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:  # a parent that is a file, no permission, a read-only disk
        raise CheckpointError(f"{root}: cannot create the checkpoint directory "
                              f"({exc.strerror or exc})") from None
    try:
        _write_files(models, staging, max_shard_bytes, quantize)
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root


def _is_checkpoint_file(path: Path) -> bool:
    return path.is_file() and (path.name in ("config.json", INDEX_FILE, *TOKENIZER_FILES)
                               or path.name.endswith(".safetensors"))


def _check_replaceable(root: Path) -> None:
    """Only a missing path, an empty dir or a checkpoint dir may be written over."""
    if not root.exists():
        parent = root.parent
        while not parent.exists():  # the nearest ancestor that exists decides
            parent = parent.parent
        if not parent.is_dir():
            raise CheckpointError(f"{root}: cannot create it, {parent} is not a directory")
        return
    if not root.is_dir():
        raise CheckpointError(f"{root}: exists and is not a directory")
    entries = sorted(root.iterdir())
    unrelated = [p.name for p in entries if not _is_checkpoint_file(p)]
    if entries and (unrelated or not (root / "config.json").is_file()):
        what = f"holds {unrelated[:5]}" if unrelated else "has no config.json"
        raise CheckpointError(f"{root}: not empty and not a checkpoint directory ({what}); "
                              f"refusing to replace it: choose a new or empty directory")


def _fresh_sibling(root: Path, tag: str) -> Path:
    # hidden and random, next to root so the final rename stays on one filesystem
    return root.parent / f".{root.name}.{tag}-{secrets.token_hex(4)}"


def _swap_in(staging: Path, root: Path) -> None:
    if not root.exists():
        staging.rename(root)
        return
    aside = _fresh_sibling(root, "old")
    root.rename(aside)
    try:
        staging.rename(root)
    except BaseException:
        aside.rename(root)
        raise
    shutil.rmtree(aside)


def stored_state(models: LoadedModel, quantize: str = "none") -> dict[str, torch.Tensor]:
    """Every tensor as the checkpoint stores it (on the host), ``.scale`` beside each
    quantized weight."""
    if quantize not in QUANTIZE:
        raise CheckpointError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    held = {name: m for owner in (models.target, models.draft)
            for name, m in owner.named_modules() if isinstance(m, QuantLinear)}
    state: dict[str, torch.Tensor] = {}
    for key, value in expected_state(models).items():
        base, _, name = key.rpartition(".")
        value = value.detach().to("cpu")
        if base in held:  # stored bits back in the checkpoint dtype
            state[key] = value.view(held[base].stored_dtypes()[name]).contiguous()
        elif quantize == "fp8" and (_FP8_KEY.search(key) or _FP4_KEY.search(key)):
            fmt = "fp4" if _FP4_KEY.search(key) else "fp8"
            state[key], state[base + ".scale"] = quantize_weight(value, fmt)
        else:
            state[key] = value.to(storage_dtype(key)).contiguous()
        state[key] = _own(state[key])
    return state


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a storage of its own: a routed expert's tensor is a slice of its
    projection's stack (``model/experts.py``), and safetensors refuses shared memory."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def _write_files(models: LoadedModel, root: Path, max_shard_bytes: int | None,
                 quantize: str = "none") -> None:
    state = stored_state(models, quantize)
    config = models.cfg.to_hf_dict()
    if any(k.endswith(".scale") for k in state):
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
        fp4 = any(v.dtype == torch.int8 for v in state.values())
        config["expert_dtype"] = "fp4" if fp4 else "bf16"
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if max_shard_bytes is None:
        save_file(state, str(root / SINGLE_FILE), metadata={"format": "pt"})
    else:
        _write_shards(state, root, max_shard_bytes)
    for path in root.iterdir():  # on disk before the rename publishes them
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _write_shards(state: dict[str, torch.Tensor], root: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, value in state.items():
        if shards[-1] and size + value.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())},
             "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
