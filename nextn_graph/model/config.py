"""DeepSeek-V4 model config, read from the HF-style ``config.json`` of a checkpoint.

Loaded strictly: a missing required key, a value of the wrong type or an
unsupported MTP layout is a ``ConfigError`` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Compress ratios a layer may use: 0 = sliding window only, 4 = C4 (overlapped,
# lightning-indexer top-k), 128 = C128 (all finished blocks).
SUPPORTED_RATIOS = (0, 4, 128)
# The NextN layer is always sliding-window only (COMPRESS_RATIO_NEXTN_LAYER).
NEXTN_COMPRESS_RATIO = 0


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per layer, then the MTP layer's 0
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: YarnScaling
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_nextn_predict_layers: int
    max_position_embeddings: int
    bos_token_id: int
    eos_token_id: int
    scoring_func: str = "sqrtsoftplus"
    architectures: tuple[str, ...] = ("DeepseekV4ForCausalLM",)

    def layer_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    @property
    def hc_dim(self) -> int:
        """Width of one row of ``pre_hc_head``: all mHC streams flattened."""
        return self.hc_mult * self.hidden_size

    def to_hf_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["compress_ratios"] = list(self.compress_ratios)
        out["architectures"] = list(self.architectures)
        out["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        out["num_key_value_heads"] = 1
        out["model_type"] = "deepseek_v4"
        return out


_OPTIONAL = {"scoring_func", "architectures"}
_IGNORED = {  # HF keys that carry no structure for this library
    "num_key_value_heads", "model_type", "torch_dtype", "transformers_version",
    "tie_word_embeddings", "topk_method", "use_cache", "quantization_config",
    "initializer_range", "hidden_act", "attention_bias", "attention_dropout",
    "norm_topk_prob", "rope_interleave", "auto_map", "first_k_dense_replace",
    "intermediate_size", "moe_layer_freq", "n_group", "topk_group", "ep_size",
    "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "pretraining_tp",
    "max_window_layers", "dtype",
}


def _check_type(where: str, key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{where}: key {key!r} must be {kind.__name__}, got {value!r}")
    return value


def config_from_dict(raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Build and validate a ``ModelConfig`` from HF keys; ``where`` names the source."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object at top level")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    values: dict[str, Any] = {}
    for name, field in fields.items():
        if name not in raw:
            if name in _OPTIONAL:
                continue
            raise ConfigError(f"{where}: required key {name!r} is missing")
        value = raw[name]
        if name == "compress_ratios":
            if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                raise ConfigError(f"{where}: key 'compress_ratios' must be a list of ints")
            value = tuple(value)
        elif name == "architectures":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}: key 'architectures' must be a list of strings")
            value = tuple(value)
        elif name == "rope_scaling":
            value = _yarn(where, value)
        else:
            kind = {"int": int, "float": float, "str": str}[str(field.type)]
            value = _check_type(where, name, value, kind)
        values[name] = value
    dspark = sorted(k for k in raw if k.lower().startswith("dspark")) + [
        a for a in raw.get("architectures", []) if "DSpark" in str(a)]
    if dspark:
        raise ConfigError(f"{where}: {dspark[0]!r} describes a DSpark drafter; this runtime "
                          f"drives the NextN draft only (num_nextn_predict_layers = 1)")
    unknown = sorted(set(raw) - set(fields) - _IGNORED)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}")
    cfg = ModelConfig(**values)
    _validate(cfg, where)
    return cfg


def _yarn(where: str, value: Any) -> YarnScaling:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: key 'rope_scaling' must be an object")
    kind = value.get("type", value.get("rope_type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"{where}: rope_scaling.type must be 'yarn', got {kind!r}")
    try:
        return YarnScaling(
            factor=float(value["factor"]),
            original_max_position_embeddings=int(value["original_max_position_embeddings"]),
            beta_fast=float(value.get("beta_fast", 32)),
            beta_slow=float(value.get("beta_slow", 1)),
        )
    except KeyError as exc:
        raise ConfigError(f"{where}: rope_scaling is missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: rope_scaling has a non-numeric value ({exc})") from None


def _validate(cfg: ModelConfig, where: str) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: key {key!r} {why}")

    if cfg.num_nextn_predict_layers != 1:
        raise bad("num_nextn_predict_layers",
                  f"is {cfg.num_nextn_predict_layers}; exactly one NextN layer is supported")
    n = cfg.num_hidden_layers
    if len(cfg.compress_ratios) not in (n, n + cfg.num_nextn_predict_layers):
        raise bad("compress_ratios", f"has {len(cfg.compress_ratios)} entries for {n} layers")
    for i, r in enumerate(cfg.compress_ratios):
        if r not in SUPPORTED_RATIOS:
            raise bad("compress_ratios", f"entry {i} is {r}; supported ratios are {SUPPORTED_RATIOS}")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "head_dim", "sliding_window", "hc_mult", "max_position_embeddings",
                "index_topk", "num_experts_per_tok", "n_routed_experts", "o_groups"):
        if getattr(cfg, key) <= 0:
            raise bad(key, f"must be positive, got {getattr(cfg, key)}")
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        raise bad("qk_rope_head_dim", "must be even and at most head_dim")
    if cfg.qk_rope_head_dim > cfg.index_head_dim:
        raise bad("index_head_dim", "must be at least qk_rope_head_dim")
    if (cfg.num_attention_heads * cfg.head_dim) % cfg.o_groups:
        raise bad("o_groups", "must divide num_attention_heads * head_dim")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise bad("num_experts_per_tok", "exceeds n_routed_experts")
    if cfg.scoring_func != "sqrtsoftplus":
        raise bad("scoring_func", f"is {cfg.scoring_func!r}; only 'sqrtsoftplus' is supported")
    if not 0 <= cfg.eos_token_id < cfg.vocab_size:
        raise bad("eos_token_id", f"{cfg.eos_token_id} is outside the vocabulary")


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc})") from None
    return config_from_dict(raw, str(path))
