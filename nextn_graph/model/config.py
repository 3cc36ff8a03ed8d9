"""DeepSeek-V4 model config, read from the HF-style ``config.json`` of a checkpoint.

Loaded strictly: a missing required key, a value of the wrong type or an
unsupported MTP layout is a ``ConfigError`` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, show_value
from ..memory.shapes import physical_memory_bytes
from ..textfile import parse_json, read_text

INT64_LIMIT = 2**63  # every integer key is a tensor size, index or count
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
    "expert_dtype",  # read with quantization_config by model.quant
}


def _is_int(value: Any) -> bool:
    """A JSON integer: ``true``/``false`` are not 1/0 (bool is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(where: str, key: str, value: Any, kind: type) -> Any:
    if kind is float and _is_int(value):
        try:
            return float(value)
        except OverflowError:  # an integer past the float range (1 followed by 400 zeros)
            raise ConfigError(f"{where}: key {key!r} is out of the float range, got "
                              f"{show_value(value)}") from None
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(f"{where}: key {key!r} must be {kind.__name__}, got {show_value(value)}")
    if kind is int and not -INT64_LIMIT < value < INT64_LIMIT:  # sizes become int64 shapes
        raise ConfigError(f"{where}: key {key!r} must fit in 64 bits, got {show_value(value)}")
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
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise ConfigError(f"{where}: key 'compress_ratios' must be a list of ints, "
                                  f"got {show_value(value)}")
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
    missing = {"factor", "original_max_position_embeddings"} - set(value)
    if missing:
        raise ConfigError(f"{where}: rope_scaling is missing key {sorted(missing)[0]!r}")
    kinds = {"factor": float, "original_max_position_embeddings": int,
             "beta_fast": float, "beta_slow": float}
    defaults = {"beta_fast": 32.0, "beta_slow": 1.0}
    return YarnScaling(**{key: _check_type(where, f"rope_scaling.{key}",
                                           value.get(key, defaults.get(key)), kind)
                          for key, kind in kinds.items()})


# Upper bounds of keys that are Python loop counts in every forward (the Sinkhorn
# iterations of each mHC mix, the decoder layers, the routed experts) or at build
# time: far above any released model (DeepSeek-V4: 20 iterations, 61 layers, 384
# experts), but a value like 1e9 would hang the first forward instead of failing.
_LOOP_BOUNDS = (("hc_sinkhorn_iters", 1000), ("num_hidden_layers", 1024),
                ("n_routed_experts", 4096))
# Integer keys that must be >= 1 (a width, a count, a rank) and keys that may be 0.
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
    "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts",
    "num_experts_per_tok", "sliding_window", "index_n_heads", "index_head_dim",
    "index_topk", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings")
_NON_NEGATIVE_INTS = ("n_shared_experts", "num_hash_layers", "bos_token_id", "eos_token_id")
# Float keys: (key, lowest value, whether the lowest is allowed). RoPE bases must
# exceed 1: YaRN divides by log(base), and a base <= 1 never rotates.
_FLOAT_RANGES = (
    ("routed_scaling_factor", 0.0, False), ("rms_norm_eps", 0.0, False),
    ("swiglu_limit", 0.0, True), ("hc_eps", 0.0, True),  # swiglu_limit 0: no clamp
    ("rope_theta", 1.0, False), ("compress_rope_theta", 1.0, False))
C4_RATIO = 4  # the ratio whose entries the lightning indexer picks top-k from


def _validate(cfg: ModelConfig, where: str) -> None:
    def bad(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: key {key!r} {why}")

    for key in _POSITIVE_INTS:
        if getattr(cfg, key) < 1:
            raise bad(key, f"must be at least 1, got {getattr(cfg, key)}")
    for key in _NON_NEGATIVE_INTS:
        if getattr(cfg, key) < 0:
            raise bad(key, f"must be at least 0, got {getattr(cfg, key)}")
    for key, high in _LOOP_BOUNDS:
        if getattr(cfg, key) > high:
            raise bad(key, f"must be at most {high}, got {show_value(getattr(cfg, key))}")
    for key, low, inclusive in _FLOAT_RANGES:
        value = getattr(cfg, key)
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise bad(key, f"must be finite and {'>=' if inclusive else '>'} {low}, got {value}")
    _validate_yarn(cfg.rope_scaling, where)
    if cfg.num_nextn_predict_layers != 1:
        raise bad("num_nextn_predict_layers",
                  f"is {cfg.num_nextn_predict_layers}; exactly one NextN layer is supported")
    n = cfg.num_hidden_layers
    if len(cfg.compress_ratios) not in (n, n + cfg.num_nextn_predict_layers):
        raise bad("compress_ratios", f"has {len(cfg.compress_ratios)} entries for {n} layers")
    for i, r in enumerate(cfg.compress_ratios):
        if r not in SUPPORTED_RATIOS:
            raise bad("compress_ratios", f"entry {i} is {show_value(r)}; supported ratios "
                      f"are {SUPPORTED_RATIOS}")
    if len(cfg.compress_ratios) > n and cfg.compress_ratios[n] != NEXTN_COMPRESS_RATIO:
        raise bad("compress_ratios", f"entry {n} (the NextN layer) is {cfg.compress_ratios[n]}; "
                  f"the NextN layer is sliding-window only, ratio {NEXTN_COMPRESS_RATIO}")
    # RoPE rotates interleaved pairs of the last qk_rope_head_dim dims of the attention
    # head and of the indexer head.
    if cfg.qk_rope_head_dim % 2 or not 2 <= cfg.qk_rope_head_dim <= cfg.head_dim:
        raise bad("qk_rope_head_dim", f"must be even, at least 2 and at most head_dim "
                  f"{cfg.head_dim}, got {cfg.qk_rope_head_dim}")
    if cfg.qk_rope_head_dim > cfg.index_head_dim:
        raise bad("index_head_dim", f"{cfg.index_head_dim} must be at least qk_rope_head_dim "
                  f"{cfg.qk_rope_head_dim}")
    if (cfg.num_attention_heads * cfg.head_dim) % cfg.o_groups:
        raise bad("o_groups", f"{cfg.o_groups} must divide num_attention_heads * head_dim "
                  f"= {cfg.num_attention_heads * cfg.head_dim}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise bad("num_experts_per_tok", f"{cfg.num_experts_per_tok} exceeds n_routed_experts "
                  f"{cfg.n_routed_experts}")
    if cfg.num_hash_layers > n:
        raise bad("num_hash_layers", f"{cfg.num_hash_layers} exceeds num_hidden_layers {n}")
    c4_entries = cfg.max_position_embeddings // C4_RATIO  # a full-length sequence's
    if C4_RATIO in cfg.compress_ratios[:n] and cfg.index_topk > c4_entries:
        raise bad("index_topk", f"{cfg.index_topk} exceeds the {c4_entries} C4 entries of a "
                  f"max_position_embeddings {cfg.max_position_embeddings} sequence, so the "
                  f"indexer would never select")
    if cfg.scoring_func != "sqrtsoftplus":
        raise bad("scoring_func", f"is {cfg.scoring_func!r}; only 'sqrtsoftplus' is supported")
    for key in ("bos_token_id", "eos_token_id"):
        if getattr(cfg, key) >= cfg.vocab_size:
            raise bad(key, f"{getattr(cfg, key)} is outside the vocabulary [0, {cfg.vocab_size})")


def _validate_yarn(y: YarnScaling, where: str) -> None:
    # YaRN takes log(original / (beta * 2 pi)): every figure must be positive.
    for key in ("factor", "beta_fast", "beta_slow"):
        value = getattr(y, key)
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{where}: rope_scaling.{key} must be finite and > 0, got {value}")
    if y.original_max_position_embeddings < 1:
        raise ConfigError(f"{where}: rope_scaling.original_max_position_embeddings must be at "
                          f"least 1, got {y.original_max_position_embeddings}")
    if y.beta_fast < y.beta_slow:
        raise ConfigError(f"{where}: rope_scaling.beta_fast {y.beta_fast} must be at least "
                          f"beta_slow {y.beta_slow}")


def check_model_fits(cfg: ModelConfig, where: str) -> None:
    """Refuse a model that cannot be built on the host in fp32 (random weights, training)
    before a tensor is allocated. A checkpoint load builds on meta and checks the bytes
    it will place on its device instead (``loader``)."""
    need, ram = model_bytes(cfg), physical_memory_bytes()
    if ram is not None and need > ram:
        raise ConfigError(
            f"{where}: the model needs {need / 2**30:.1f} GiB as built (fp32 target + NextN "
            f"draft, before any dtype cast), more than this machine's {ram / 2**30:.1f} GiB "
            f"of physical memory; check vocab_size {cfg.vocab_size}, hidden_size "
            f"{cfg.hidden_size}, num_hidden_layers {cfg.num_hidden_layers}, n_routed_experts "
            f"{cfg.n_routed_experts}, moe_intermediate_size {cfg.moe_intermediate_size}, "
            f"max_position_embeddings {cfg.max_position_embeddings}")


def model_bytes(cfg: ModelConfig) -> int:
    """Bytes of every parameter and buffer of the target and its NextN draft as built:
    fp32, but int64 hash-routing tables. Mirrors the module tree (a test checks it
    equals the built models exactly); Python ints, so no overflow however absurd."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    stream_head = _norm_floats(d) + hc * cfg.hc_dim + hc + 1  # norm, hc_head_fn, _base, _scale
    target = stream_head + 2 * cfg.vocab_size * d  # + embed, head
    # RoPE cos and sin: one table per kind (base; compressed if a layer is), in the target
    kinds = 1 + any(cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers))
    target += kinds * 2 * cfg.max_position_embeddings * (cfg.qk_rope_head_dim // 2)
    hashed_tables = 0
    for i in range(cfg.num_hidden_layers):
        hashed = i < cfg.num_hash_layers
        target += _block_floats(cfg, cfg.layer_ratio(i), hashed)
        hashed_tables += cfg.vocab_size * cfg.num_experts_per_tok if hashed else 0
    draft = (_block_floats(cfg, NEXTN_COMPRESS_RATIO, False) + stream_head + 2 * d * d
             + 2 * _norm_floats(d))  # e_proj, h_proj, enorm, hnorm
    return 4 * (target + draft) + 8 * hashed_tables


def _block_floats(cfg: ModelConfig, ratio: int, hashed: bool) -> int:
    """fp32 elements of one decoder layer (``Block``): attention, MoE, norms, mHC."""
    d, h, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    o = cfg.o_groups * cfg.o_lora_rank
    attn = (h + q * d + _norm_floats(q) + h * hd * q + hd * d + _norm_floats(hd)
            + o * (h * hd // cfg.o_groups) + d * o)
    if ratio:
        attn += _compressor_floats(cfg, ratio, hd)
    if ratio == C4_RATIO:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        attn += hi * di * q + hi * d + _compressor_floats(cfg, ratio, di)
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    moe = e * d + (0 if hashed else e) + 3 * d * inter * (e + cfg.n_shared_experts)
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    return attn + moe + 2 * _norm_floats(d) + 2 * (mix * cfg.hc_dim + mix + 3)


def _compressor_floats(cfg: ModelConfig, ratio: int, dim: int) -> int:
    width = (2 if ratio == C4_RATIO else 1) * dim  # C4 entries overlap the previous block
    return ratio * width + 2 * width * cfg.hidden_size + _norm_floats(dim)  # ape, wkv, wgate, norm


def _norm_floats(dim: int) -> int:
    """An ``RMSNorm``: its weight and its eps tensor."""
    return dim + 1


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    raw = parse_json(read_text(path, "config", ConfigError), str(path), ConfigError)
    return config_from_dict(raw, str(path))
