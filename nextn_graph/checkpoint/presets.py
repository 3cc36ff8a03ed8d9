"""Built-in model presets and deterministic random initialisation."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from ..errors import ConfigError
from ..model.config import ModelConfig, config_from_dict

# Tiny but complete: layers cover ratios 0, 4 and 128; index_topk 4 makes the
# indexer select a strict subset once a sequence has more than 16 positions; the
# window of 16 and the 128-position C128 blocks are crossed by short tests.
TINY = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 16,
    "q_lora_rank": 48, "o_lora_rank": 32, "o_groups": 2,
    "moe_intermediate_size": 64, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
    "sliding_window": 16, "compress_ratios": [0, 4, 128, 4, 0],
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 2, "index_head_dim": 32, "index_topk": 4,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 512,
    "bos_token_id": 0, "eos_token_id": 1,
}

# DeepSeek-V4-Flash at its real widths, cut to a few layers and few routed experts so
# that it builds and runs on a CPU host. Widths are those of the released
# DeepSeek-V4-Flash config.json (HF deepseek-ai/DeepSeek-V4-Flash: hidden 4096, 43
# layers, 256 routed experts 2048 wide, 3 hash layers, max_position_embeddings
# 1048576, YaRN factor 16 over 65536) and of the reference
# inference/model.py ModelArgs (Nicooo-Wang/DeepSeek-V4-Pro-code: head_dim 512, rope
# 64, q_lora 1024, o_groups 8, o_lora 1024, window 128, indexer 64 x 128 top-512,
# hc_mult 4, 20 Sinkhorn iterations). Sliced: 4 layers (SWA, C4, C128, SWA, then the
# NextN layer's SWA), 8 routed experts + 1 shared (top-k still 6), 1 hash layer (so
# hash and score routing both run) and max_position_embeddings 4096: the RoPE tables
# are built per layer at that length, and 4096 is the least power of two whose 1024 C4
# entries leave index_topk 512 a strict subset.
FLASH_SLICE = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 4,
    "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "moe_intermediate_size": 2048, "n_routed_experts": 8, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "num_hash_layers": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
    "sliding_window": 128, "compress_ratios": [0, 4, 128, 0, 0],
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1, "max_position_embeddings": 4096,
    "bos_token_id": 0, "eos_token_id": 1,
}

# DeepSeek-V4-Flash at the released config (HF deepseek-ai/DeepSeek-V4-Flash config.json):
# FLASH_SLICE's widths with all 43 layers, 256 routed experts, 3 hash layers and
# max_position_embeddings 1048576. compress_ratios as the release lists them (44 entries):
# layers 0 and 1 SWA, then C4 on the even layers 2..42 (21) and C128 on the odd layers
# 3..41 (20), then 0 for the NextN layer. About 284 B parameters: never built with memory
# (``check_model_fits`` refuses it on any ordinary host); ``nextn-graph profile`` builds it
# on the meta device, with max_position_embeddings cut to the pool's max_context (the RoPE
# tables are built on the host per layer at that length; their rows do not depend on it).
V4_FLASH = {
    **FLASH_SLICE,
    "num_hidden_layers": 43, "n_routed_experts": 256, "num_hash_layers": 3,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "max_position_embeddings": 1048576,
}

PRESETS = {"tiny": TINY, "flash-slice": FLASH_SLICE, "v4-flash": V4_FLASH}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return config_from_dict(dict(PRESETS[name]), f"preset {name!r}")


def init_random(state: dict[str, torch.Tensor], cfg: ModelConfig, seed: int) -> dict:
    """Deterministic random values for every tensor of a (target + draft) state dict.

    Values of matrices are bf16, the dtype they are stored in, so a saved and
    reloaded checkpoint reproduces the in-memory model exactly.
    """
    return dict(iter_random(state, cfg, seed))


def iter_random(state: dict[str, torch.Tensor], cfg: ModelConfig,
                seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``init_random`` one tensor at a time, in the same order and with the same values:
    a real-width model can be filled in place without a second copy of its weights."""
    gen = torch.Generator().manual_seed(seed)
    for key in sorted(state):
        ref = state[key]
        name = key.rsplit(".", 1)[-1]
        if name == "tid2eid":  # distinct experts per token, fixed by token id
            perm = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)
                                for _ in range(ref.shape[0])])
            yield key, perm[:, : ref.shape[1]].to(ref.dtype)
            continue
        if key.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(ref.shape, generator=gen)
        elif name == "attn_sink" or name.endswith("_base") or name == "bias":
            value = 0.5 * torch.randn(ref.shape, generator=gen)
        elif name.endswith("_scale"):
            value = 0.5 + torch.rand(ref.shape, generator=gen)
        elif name == "ape":
            value = 0.3 * torch.randn(ref.shape, generator=gen)
        elif key == "embed.weight":
            value = torch.randn(ref.shape, generator=gen)
        else:  # projection matrices [out, in]
            value = torch.randn(ref.shape, generator=gen) / math.sqrt(ref.shape[-1])
        # Yielded in the storage dtype (bf16 matrices at half the bytes); a
        # load_state_dict or copy_ into the built fp32 model converts exactly.
        yield key, value.to(storage_dtype(key))


def storage_dtype(key: str) -> torch.dtype:
    """Checkpoint dtype of a key: mHC params, sinks, ape and router bias are fp32 by design."""
    name = key.rsplit(".", 1)[-1]
    if name == "tid2eid":
        return torch.int32
    if name.startswith("hc_") or name in ("attn_sink", "ape", "bias"):
        return torch.float32
    return torch.bfloat16
