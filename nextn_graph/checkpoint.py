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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .errors import CheckpointError
from .model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN, ModelConfig, load_config
from .presets import init_random, storage_dtype
from .textfile import parse_json, read_text

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MTP_KEY = re.compile(r"^mtp\.(\d+)\.")


@dataclass
class LoadedModel:
    cfg: ModelConfig
    target: DeepseekV4ForCausalLM
    draft: DeepseekV4ForCausalLMNextN


def build_models(cfg: ModelConfig) -> LoadedModel:
    target = DeepseekV4ForCausalLM(cfg)
    return LoadedModel(cfg, target, DeepseekV4ForCausalLMNextN(cfg, target))


def random_models(cfg: ModelConfig, seed: int) -> LoadedModel:
    """Target and draft with deterministic random weights (see ``init_random``)."""
    models = build_models(cfg)
    state = init_random(expected_state(models), cfg, seed)
    models.target.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")})
    models.draft.load_state_dict({k: v for k, v in state.items() if k.startswith("mtp.")})
    return models


def expected_state(models: LoadedModel) -> dict[str, torch.Tensor]:
    """Every checkpoint key of the pair, target first, then ``mtp.0.*``."""
    return {**models.target.state_dict(), **models.draft.state_dict()}


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of an index: tensor name -> shard file name in the same dir."""
    raw = parse_json(read_text(index, "index", CheckpointError), str(index), CheckpointError)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: not a safetensors index ('weight_map' must map "
                              f"tensor names to shard file names)")
    for name in set(weight_map.values()):
        # a shard is a plain file of this directory: no paths that escape it
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{index}: shard name {name[:80]!r} is not a "
                                  f"*.safetensors file name in this directory")
    return weight_map


def _weight_files(root: Path) -> tuple[dict[str, str] | None, list[str]]:
    """The index's weight map (None for a single file) and the files to read.

    A directory holds exactly one checkpoint: both layouts at once, a listed shard
    that is missing, or a ``*.safetensors`` the layout does not name (a stale shard
    of an earlier write) are refused rather than guessed at.
    """
    index, single = root / INDEX_FILE, root / SINGLE_FILE
    if index.is_file() and single.is_file():
        raise CheckpointError(f"{root}: both {INDEX_FILE} and {SINGLE_FILE} are present; "
                              f"a checkpoint directory must hold one layout, not both")
    if index.is_file():
        weight_map = _read_index(index)
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        raise CheckpointError(f"{index}: shard {missing[0]} is listed but missing")
    stray = sorted(p.name for p in root.glob("*.safetensors") if p.name not in files)
    if stray:
        named_by = INDEX_FILE if weight_map is not None else SINGLE_FILE
        raise CheckpointError(f"{root}: {stray[:5]} not part of the checkpoint named by "
                              f"{named_by} (stale shards of an earlier write?)")
    return weight_map, files


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    weight_map, files = _weight_files(root)
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        path = root / name
        try:
            shard = load_file(str(path))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from None
        for key, value in shard.items():
            if weight_map is not None and weight_map.get(key) != name:
                raise CheckpointError(f"{path}: tensor {key!r} is not listed for this shard in {INDEX_FILE}")
            tensors[key] = value
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CheckpointError(f"{root / INDEX_FILE}: listed tensors missing from their "
                                  f"shards: {absent[:5]}")
    return tensors


def _check_layout(root: Path, tensors: dict[str, torch.Tensor],
                  expected: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    dspark = sorted(k for k in tensors if "dspark" in k.lower())
    if dspark:
        raise CheckpointError(
            f"{root}: MTP stages are a DSpark drafter ({dspark[0]!r}, ...); this runtime "
            f"drives the NextN draft only (EAGLE/NEXTN with mtp.0.*)")
    extra_mtp = sorted(k for k in tensors if (m := _MTP_KEY.match(k)) and int(m.group(1)) >= 1)
    if extra_mtp:
        raise CheckpointError(
            f"{root}: {extra_mtp[0]!r} belongs to a second MTP layer; exactly one NextN "
            f"layer (mtp.0.*) is supported")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{root}: missing tensor key(s) {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        hint = " (quantization scales are not supported: dequantize to bf16)" if any(
            k.endswith(".scale") for k in unexpected) else ""
        raise CheckpointError(f"{root}: unexpected tensor key(s) {unexpected[:8]}{hint}")
    for key, ref in expected.items():
        got = tensors[key]
        if tuple(got.shape) != tuple(ref.shape):
            raise CheckpointError(f"{root}: tensor {key!r} has shape {list(got.shape)}, "
                                  f"expected {list(ref.shape)}")
        if key.endswith("tid2eid"):
            _check_expert_ids(root, key, got, cfg.n_routed_experts)
            continue
        _check_weight_dtype(root, key, got.dtype)
        if not bool(torch.isfinite(got).all()):  # NaN/Inf would silently decode token 0
            raise CheckpointError(f"{root}: tensor {key!r} holds NaN or Inf values")


# Float dtypes a weight may be stored in; each converts exactly to the fp32 it is built in.
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_weight_dtype(root: Path, key: str, dtype: torch.dtype) -> None:
    if dtype in WEIGHT_DTYPES:
        return
    # The released DeepSeek-V4 ships FP8 (1 byte) and packed FP4 weights with scales;
    # loading them needs dequantization this project does not do yet.
    low_bit = dtype.itemsize <= 1 and dtype != torch.bool
    hint = "; FP8/FP4 weights are not supported yet: dequantize to bf16" if low_bit else ""
    raise CheckpointError(f"{root}: tensor {key!r} has dtype {dtype}, expected bf16, fp16 "
                          f"or fp32{hint}")


def _check_expert_ids(root: Path, key: str, got: torch.Tensor, n_experts: int) -> None:
    """``tid2eid``: integer expert ids in [0, n_experts) (a bool or float is not an id)."""
    dtype = got.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise CheckpointError(f"{root}: tensor {key!r} has dtype {dtype}; expert ids need an "
                              f"integer dtype")
    if bool(((got < 0) | (got >= n_experts)).any()):
        raise CheckpointError(f"{root}: tensor {key!r} must hold expert ids in [0, {n_experts})")


BUILTIN = "builtin:"
DATA_DIR = Path(__file__).parent / "data"


def resolve_checkpoint(spec: str | Path) -> Path:
    """A directory, or ``builtin:NAME`` for a checkpoint shipped in the package."""
    text = str(spec)
    if not text.startswith(BUILTIN):
        return Path(text)
    root = DATA_DIR / text[len(BUILTIN):]
    if not (root / "config.json").is_file():
        known = sorted(p.name for p in DATA_DIR.iterdir()) if DATA_DIR.is_dir() else []
        raise CheckpointError(f"{text}: no such built-in checkpoint (built-in: {known})")
    return root


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> LoadedModel:
    """Load target and draft from a checkpoint directory; errors name file and key."""
    root = resolve_checkpoint(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    cfg = load_config(root)
    models = build_models(cfg)
    expected = expected_state(models)
    tensors = _read_tensors(root)
    _check_layout(root, tensors, expected, cfg)
    state = {k: v.to(expected[k].dtype) for k, v in tensors.items()}
    models.target.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")})
    models.draft.load_state_dict({k: v for k, v in state.items() if k.startswith("mtp.")})
    for module in (models.target, models.draft):
        module.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return models


def save_checkpoint(models: LoadedModel, path: str | Path,
                    max_shard_bytes: int | None = None) -> Path:
    """Write ``config.json`` and the tensors in the released layout (sharded if asked).

    The files are written into a fresh sibling directory and renamed into place, so
    ``path`` holds either the previous checkpoint or the complete new one, never a
    mix. An existing checkpoint at ``path`` is replaced wholesale (renamed aside,
    then removed); a non-empty directory that is not a checkpoint is refused.
    """
    root = Path(path)
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
        _write_files(models, staging, max_shard_bytes)
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return root


def _is_checkpoint_file(path: Path) -> bool:
    return path.is_file() and (path.name in ("config.json", INDEX_FILE)
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


def _write_files(models: LoadedModel, root: Path, max_shard_bytes: int | None) -> None:
    (root / "config.json").write_text(json.dumps(models.cfg.to_hf_dict(), indent=2) + "\n")
    state = {k: v.detach().to("cpu", storage_dtype(k)).contiguous()
             for k, v in expected_state(models).items()}
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
