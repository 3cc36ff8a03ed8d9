"""Loading a checkpoint, streamed: tensor by tensor, each placed on its device as read.

The target and draft are built on the ``meta`` device (no memory), every check that
needs only names, dtypes and shapes runs on the file headers, and then the shards
are read one at a time, tensor by tensor (positioned reads into fresh buffers, see
``weights.Shards``): each tensor is checked (no NaN/Inf, expert ids in range,
positive scales), converted, and put in its module on the target device. Host
memory while loading grows by about one tensor over what the device keeps.

Quantized weights (an FP8 or packed FP4 ``.weight`` beside its ``.scale``, see
``model.quant``) become ``QuantLinear`` modules holding the stored bits
(``weights="quantized"``), or are expanded to ``dtype`` as they are read
(``"dequantized"``). Errors name the directory (or file) and the key.

Under tensor parallelism (``tp``) each rank builds its local shapes and reads only its
slices (``checkpoint/sharding.py``): a dim-0 slice is one positioned read of its bytes,
a dim-1 slice one read per row; other ranks' experts are never read. Header checks
compare the checkpoint's global shapes with the model's local ones through the table.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import WEIGHTS_MODES
from ..errors import CheckpointError, ConfigError
from ..kernels.select import select_kernels
from ..memory.shapes import physical_memory_bytes
from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN, ModelConfig
from ..model.config import check_model_fits, config_from_dict
from ..model.ops import use_kernels
from ..model.quant import (FP4_VALUES, QuantConfig, QuantLinear, as_bits, check_quant_values,
                           check_scale, dequantize, quant_config, quant_format)
from ..parallel.group import TPGroup
from ..progress import progress_bar
from ..textfile import parse_json, read_text
from .sharding import global_shape, is_foreign, part_for, quant_parts
from .weights import Shards, TensorInfo, scan

log = logging.getLogger(__name__)

# Float dtypes a plain weight may be stored in; each converts exactly to fp32.
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Copies of the shared embedding and head some exports carry in the MTP layer; SGLang
# and vLLM map them onto the shared tensors, and so does this loader (by not reading them).
ALIASES = {"mtp.0.emb.tok_emb.weight": "embed.weight", "mtp.0.head.weight": "head.weight"}
_MTP_KEY = re.compile(r"^mtp\.(\d+)\.")
BUILTIN = "builtin:"
DATA_DIR = Path(__file__).resolve().parents[1] / "data"  # nextn_graph/data


@dataclass
class LoadedModel:
    cfg: ModelConfig
    target: DeepseekV4ForCausalLM
    draft: DeepseekV4ForCausalLMNextN
    bytes_read: int = 0  # checkpoint tensor bytes this rank read to load it (0: not loaded)

    @property
    def tp(self) -> TPGroup:
        return self.target.tp


def build_models(cfg: ModelConfig, tp: TPGroup | None = None) -> LoadedModel:
    """Target and draft as built (this rank's shards under ``tp``): fp32 on the host, or
    nothing under a meta device."""
    if torch.empty(0).device.type != "meta":
        check_model_fits(cfg, "model config")
    target = DeepseekV4ForCausalLM(cfg, tp)
    return LoadedModel(cfg, target, DeepseekV4ForCausalLMNextN(cfg, target))


def expected_state(models: LoadedModel) -> dict[str, torch.Tensor]:
    """Every checkpoint key of the pair, target first, then ``mtp.0.*``."""
    return {**models.target.state_dict(), **models.draft.state_dict()}


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
                    device: torch.device | str = "cpu", weights: str = "quantized",
                    progress: bool = False, tp: TPGroup | None = None,
                    kernels: str = "auto") -> LoadedModel:
    """Load target and draft from a checkpoint directory; errors name file and key.

    ``weights``: ``quantized`` keeps FP8/FP4 weights as stored (a no-op for a bf16
    checkpoint), ``dequantized`` expands them to ``dtype``. ``progress``: a bar over
    the shards on stderr. ``tp``: load this rank's shards only. ``kernels``: ``auto`` |
    ``reference`` | ``triton``, the fused kernels both models run (``kernels/select.py``).
    """
    tp = tp if tp is not None else TPGroup.single()
    if weights not in WEIGHTS_MODES:
        raise CheckpointError(f"weights must be one of {WEIGHTS_MODES}, got {weights!r}")
    kernel_set = select_kernels(kernels, torch.device(device).type)  # before any read
    root = resolve_checkpoint(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    where = str(root / "config.json")
    raw = parse_json(read_text(root / "config.json", "config", ConfigError), where, ConfigError)
    cfg = config_from_dict(raw, where)
    qcfg = quant_config(raw, where) if isinstance(raw, dict) else None
    infos = scan(root)
    _check_mtp(root, infos)
    aliases = {k: infos.pop(k) for k in ALIASES if k in infos}
    with torch.device("meta"):
        models = build_models(cfg, tp)
        # other ranks' experts: neither built nor read here (their owner checks them)
        infos = {k: v for k, v in infos.items() if not is_foreign(k, cfg.n_routed_experts, tp)}
        plan, parts = _quant_plan(root, models, infos, qcfg)
        if weights == "quantized":
            for base, fmt in plan.items():
                _swap_linear(models, base, fmt, infos[base + ".scale"].dtype == torch.float32)
    expected = expected_state(models)
    _check_layout(root, infos, expected, plan, weights, tp)
    for key, info in aliases.items():
        shared = global_shape(ALIASES[key], tuple(expected[ALIASES[key]].shape), tp)
        if info.shape != shared:
            raise CheckpointError(f"{root}: tensor {key!r} (a copy of {ALIASES[key]!r}) has "
                                  f"shape {list(info.shape)}, expected {list(shared)}")
    _check_fits(root, models, expected, plan, weights, dtype, device)
    for key in expected:
        parts.setdefault(key, part_for(key, infos[key].shape, tp))
    models.bytes_read = _stream(root, models, infos, expected, plan, parts, weights, dtype,
                                device, progress)
    for module in (models.target, models.draft):
        module.to(device=device, dtype=dtype).eval().requires_grad_(False)
        use_kernels(module, kernel_set)
    return models


def _owner(models: LoadedModel, key: str) -> nn.Module:
    return models.draft if key.startswith("mtp.") else models.target


def _module(models: LoadedModel, path: str) -> nn.Module | None:
    try:
        return _owner(models, path).get_submodule(path)
    except AttributeError:
        return None


def _check_mtp(root: Path, infos: dict[str, TensorInfo]) -> None:
    dspark = sorted(k for k in infos if "dspark" in k.lower())
    if dspark:
        raise CheckpointError(
            f"{root}: MTP stages are a DSpark drafter ({dspark[0]!r}, ...); this runtime "
            f"drives the NextN draft only (EAGLE/NEXTN with mtp.0.*)")
    extra_mtp = sorted(k for k in infos if (m := _MTP_KEY.match(k)) and int(m.group(1)) >= 1)
    if extra_mtp:
        raise CheckpointError(
            f"{root}: {extra_mtp[0]!r} belongs to a second MTP layer; exactly one NextN "
            f"layer (mtp.0.*) is supported")


def _quant_plan(root: Path, models: LoadedModel, infos: dict[str, TensorInfo],
                qcfg: QuantConfig | None) -> tuple[dict[str, str], dict[str, tuple | None]]:
    """Linear layers stored quantized: module path -> 'fp8' | 'fp4', every pair checked
    against the linear's global [out, in]; and this rank's parts of their weights and
    scales (whole scale blocks, or a named error)."""
    plan: dict[str, str] = {}
    parts: dict[str, tuple | None] = {}
    tp = models.tp
    for key, info in infos.items():
        base, _, name = key.rpartition(".")
        if name == "scale":
            weight = infos.get(base + ".weight")
            if weight is None:
                raise CheckpointError(f"{root}: scale {key!r} has no weight {base + '.weight'!r}")
            fmt = quant_format(weight.dtype)
            if fmt is None:
                raise CheckpointError(f"{root}: {key!r} scales {base + '.weight'!r}, whose "
                                      f"dtype {weight.dtype} is neither FP8 nor packed FP4")
            module = _module(models, base)
            if not isinstance(module, nn.Linear):
                continue  # an unexpected key: the layout check names it
            out, inp = global_shape(base + ".weight", (module.out_features,
                                                       module.in_features), tp)
            check_scale(str(root), base, fmt, weight, info, out, inp)
            parts[base + ".weight"], parts[key] = quant_parts(str(root), base, fmt, out, inp, tp)
            plan[base] = fmt
        elif name == "weight" and quant_format(info.dtype) and base + ".scale" not in infos:
            raise CheckpointError(f"{root}: quantized weight {key!r} ({info.dtype}) has no "
                                  f"scale {base + '.scale'!r}")
    if plan and qcfg is None:
        raise CheckpointError(f"{root}: FP8/FP4 weights with scales (e.g. {next(iter(plan))!r}) "
                              f"but config.json has no quantization_config")
    fp4 = sorted(k for k, fmt in plan.items() if fmt == "fp4")
    if fp4 and not qcfg.expert_fp4:
        raise CheckpointError(f"{root}: {fp4[0]!r} is FP4 but config.json's expert_dtype is "
                              f"not 'fp4'")
    return plan, parts


def _swap_linear(models: LoadedModel, base: str, fmt: str, fp32_scale: bool) -> None:
    parent_path, _, name = base.rpartition(".")
    parent = _owner(models, base).get_submodule(parent_path)
    linear = getattr(parent, name)
    setattr(parent, name, QuantLinear(linear.in_features, linear.out_features, fmt, fp32_scale))


def _check_layout(root: Path, infos: dict[str, TensorInfo], expected: dict[str, torch.Tensor],
                  plan: dict[str, str], weights: str, tp: TPGroup) -> None:
    """Names, shapes and dtypes from the headers, before any data is read; a tensor this
    rank holds a slice of is checked at its global (checkpoint) shape."""
    consumed = {base + ".scale" for base in plan} if weights == "dequantized" else set()
    missing = sorted(set(expected) - set(infos))
    if missing:
        raise CheckpointError(f"{root}: missing tensor key(s) {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    unexpected = sorted(set(infos) - set(expected) - consumed)
    if unexpected:
        raise CheckpointError(f"{root}: unexpected tensor key(s) {unexpected[:8]}")
    for key, ref in expected.items():
        info = infos[key]
        if key.rpartition(".")[0] in plan:
            continue  # weight and scale: checked together by check_scale
        want = global_shape(key, tuple(ref.shape), tp)
        if info.shape != want:
            raise CheckpointError(f"{root}: tensor {key!r} has shape {list(info.shape)}, "
                                  f"expected {list(want)}")
        if key.endswith("tid2eid"):
            if info.dtype.is_floating_point or info.dtype == torch.bool:
                raise CheckpointError(f"{root}: tensor {key!r} has dtype {info.dtype}; expert "
                                      f"ids need an integer dtype")
        elif info.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{root}: tensor {key!r} has dtype {info.dtype}, expected "
                                  f"bf16, fp16 or fp32 (FP8/FP4 only for linear weights with "
                                  f"a .scale)")


def resident_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of a module (meta ones count as planned)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def weight_bytes(models: LoadedModel) -> dict:
    """Resident bytes of the pair's weights by how they are held: FP8 and packed FP4
    bits, their scales, and float or integer tensors (RoPE tables included)."""
    out = {"fp8": 0, "fp4": 0, "scales": 0, "other": 0}
    for owner in (models.target, models.draft):
        for module in owner.modules():
            for name, t in [*module.named_parameters(recurse=False),
                            *module.named_buffers(recurse=False)]:
                size = t.numel() * t.element_size()
                if isinstance(module, QuantLinear) and name != "fp4_values":
                    out["scales" if name == "scale" else module.fmt] += size
                else:
                    out["other"] += size
    out["total"] = sum(out.values())
    return out


def _check_fits(root: Path, models: LoadedModel, expected: dict[str, torch.Tensor],
                plan: dict[str, str], weights: str, dtype: torch.dtype,
                device: torch.device | str) -> None:
    """Refuse a model its device cannot hold, before reading any tensor."""
    need = 0
    for key, ref in expected.items():
        quantized = weights == "quantized" and key.rpartition(".")[0] in plan
        size = ref.element_size() if quantized or not ref.is_floating_point() else dtype.itemsize
        need += ref.numel() * size
    need += sum(b.numel() * dtype.itemsize for m in (models.target, models.draft)
                for b in m.buffers() if not b.is_meta)  # RoPE tables, the FP4 table
    dev = torch.device(device)
    capacity = physical_memory_bytes() if dev.type == "cpu" else (
        torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None)
    if capacity is not None and need > capacity:
        raise CheckpointError(f"{root}: the weights need {need / 2**30:.1f} GiB on {dev} "
                              f"({weights}, {dtype}), more than its {capacity / 2**30:.1f} GiB")


def _stream(root: Path, models: LoadedModel, infos: dict[str, TensorInfo],
            expected: dict[str, torch.Tensor], plan: dict[str, str],
            parts: dict[str, tuple | None], weights: str, dtype: torch.dtype,
            device: torch.device | str, progress: bool) -> int:
    """Read every tensor (this rank's part of it) into its module -> bytes read."""
    files = sorted({info.file for info in infos.values()})
    by_file: dict[str, list[str]] = {name: [] for name in files}
    for key in expected:
        by_file[infos[key].file].append(key)
    table = torch.tensor(FP4_VALUES)
    with Shards(root, infos) as shards:
        for done, name in enumerate(files, start=1):
            for key in by_file[name]:
                value = _read(str(root / name), key, shards, models, plan, parts, weights,
                              dtype, table)
                _assign(models, key, value.to(device))
            shards.close_file(name)
            if progress:
                progress_bar(done, len(files), "loading shards")
        return shards.bytes_read


def _get(shards: Shards, key: str, part: tuple | None) -> torch.Tensor:
    return shards.get(key) if part is None else shards.get_part(key, part)


def _read(where: str, key: str, shards: Shards, models: LoadedModel, plan: dict[str, str],
          parts: dict[str, tuple | None], weights: str, dtype: torch.dtype,
          table: torch.Tensor) -> torch.Tensor:
    """One tensor (this rank's part), checked and in the form its module holds."""
    t = _get(shards, key, parts[key])
    base, _, name = key.rpartition(".")
    fmt = plan.get(base)
    if fmt is not None:
        check_quant_values(where, key, t)
        if weights == "quantized":
            return as_bits(t)
        scale = _get(shards, base + ".scale", parts.get(base + ".scale"))
        check_quant_values(where, base + ".scale", scale)
        linear = _module(models, base)
        return dequantize(fmt, as_bits(t), as_bits(scale), linear.out_features,
                          linear.in_features, table, dtype)
    if name == "tid2eid":
        n = models.cfg.n_routed_experts
        if bool(((t < 0) | (t >= n)).any()):
            raise CheckpointError(f"{where}: tensor {key!r} must hold expert ids in [0, {n})")
        return t.to(torch.int64)
    if not _all_finite(t):  # NaN/Inf would silently decode token 0
        raise CheckpointError(f"{where}: tensor {key!r} holds NaN or Inf values")
    return t.to(dtype)


def _all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """``isfinite(t).all()`` in slices: on a whole 1 GiB embedding its temporaries
    (abs, two masks) would cost about twice the tensor again."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all())
               for i in range(0, flat.numel(), chunk))


def _assign(models: LoadedModel, key: str, value: torch.Tensor) -> None:
    path, _, name = key.rpartition(".")
    module = _owner(models, key).get_submodule(path)
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[name] = value
