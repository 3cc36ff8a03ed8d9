"""RoPE tables as DeepSeek-V4 computes them: YaRN on compressed (C4/C128) layers whenever
the config has an original context (``original_max_position_embeddings > 0``), base
theta without YaRN on sliding-window layers and the NextN layer.

The regression: YaRN used to be skipped when ``max_position_embeddings`` did not exceed
the original context (DeepSeek-V3's rule), so such a checkpoint got other logits than
V4's reference code. The oracle below follows the reference's ``precompute_freqs_cis``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from nextn_graph.model.ops import RopeTable
from nextn_graph.checkpoint.presets import preset_config


def _reference_angles(dim: int, seqlen: int, original: int, base: float, factor: float,
                      beta_fast: float, beta_slow: float) -> torch.Tensor:
    """[seqlen, dim/2] rotation angles, YaRN when ``original > 0`` (fp64)."""
    freqs = [1.0 / base ** (i / dim) for i in range(0, dim, 2)]
    if original > 0:
        def corr(rot):
            return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), dim - 1)
        high = high + 0.001 if low == high else high
        out = []
        for i, f in enumerate(freqs):
            smooth = 1 - min(max((i - low) / (high - low), 0.0), 1.0)
            out.append(f / factor * (1 - smooth) + f * smooth)
        freqs = out
    return torch.outer(torch.arange(seqlen, dtype=torch.float64), torch.tensor(freqs, dtype=torch.float64))


def test_yarn_applies_even_when_the_context_fits_the_original_window():
    """max_position_embeddings 512 <= original 4096: compressed layers still use YaRN."""
    cfg = preset_config("tiny")
    y = dataclasses.replace(cfg.rope_scaling, original_max_position_embeddings=4096)
    cfg = dataclasses.replace(cfg, rope_scaling=y)
    assert cfg.max_position_embeddings <= y.original_max_position_embeddings
    want = _reference_angles(cfg.qk_rope_head_dim, cfg.max_position_embeddings, 4096,
                             cfg.compress_rope_theta, y.factor, y.beta_fast, y.beta_slow)
    table = RopeTable(cfg, compressed=True)
    torch.testing.assert_close(table.cos, want.cos().float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin, want.sin().float(), rtol=0, atol=1e-6)
    no_yarn = _reference_angles(cfg.qk_rope_head_dim, cfg.max_position_embeddings, 0,
                                cfg.compress_rope_theta, 1, 1, 1)
    assert (table.cos - no_yarn.cos().float()).abs().max() > 1e-2  # the fix matters here


def test_sliding_window_layers_use_base_theta_without_yarn():
    cfg = preset_config("tiny")
    want = _reference_angles(cfg.qk_rope_head_dim, cfg.max_position_embeddings, 0,
                             cfg.rope_theta, 1, 1, 1)
    table = RopeTable(cfg, compressed=False)
    torch.testing.assert_close(table.cos, want.cos().float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin, want.sin().float(), rtol=0, atol=1e-6)


def test_tiny_preset_tables_are_unchanged_by_the_fix():
    """The tiny preset (512 > original 128) always had YaRN: the shipped trained
    checkpoint's logits do not move."""
    cfg = preset_config("tiny")
    y = cfg.rope_scaling
    want = _reference_angles(cfg.qk_rope_head_dim, cfg.max_position_embeddings,
                             y.original_max_position_embeddings, cfg.compress_rope_theta,
                             y.factor, y.beta_fast, y.beta_slow)
    torch.testing.assert_close(RopeTable(cfg, compressed=True).cos, want.cos().float(),
                               rtol=0, atol=1e-6)
