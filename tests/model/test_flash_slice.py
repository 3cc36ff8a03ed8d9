"""The ``flash-slice`` preset: DeepSeek-V4-Flash's real widths, few layers and experts.

One end-to-end run on the CPU graph emulator: random weights at real widths through
the speculative runtime, against the reference oracle, with a prompt long enough that
the C128 layer emits its first entry and the C4 indexer reaches top-k candidates.
"""

from __future__ import annotations

import resource
import statistics
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nextn_graph.checkpoint.loader import LoadedModel, build_models, expected_state
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.model.config import model_bytes
from nextn_graph.checkpoint.presets import iter_random, preset_config
from nextn_graph.runtime.engine import SpecEngine

from helpers import divergence_regret, random_prompt, reference_logits, within_tolerance

PROMPT_LEN = 130  # crosses position 127, where the first 128-position C128 block finishes
MAX_NEW = 6
MAX_CONTEXT = 160  # prompt + output + lookahead, as in capture_configs/flash_slice_cpu.yaml


def test_flash_slice_preset_has_flash_widths():
    """The preset loads, keeps DeepSeek-V4-Flash's widths and covers SWA, C4 and C128."""
    cfg = preset_config("flash-slice")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (4096, 64, 512)
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (1024, 8, 1024)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (64, 128, 512)
    assert (cfg.vocab_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok) == (
        129280, 2048, 6)
    assert set(cfg.compress_ratios[:cfg.num_hidden_layers]) == {0, 4, 128}
    assert cfg.compress_ratios[-1] == 0  # the NextN layer


class _SkipDefaultInit(TorchFunctionMode):
    """Skips nn.Linear's default kaiming init while building (every weight is then
    overwritten): ~40 s of random numbers at these widths on two cores."""

    SKIPPED = (torch.nn.init.kaiming_uniform_, torch.nn.init.uniform_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:  # the tensor comes positionally or as tensor=
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def flash_slice_models(seed: int) -> LoadedModel:
    """``random_models`` filled one tensor at a time: the same values as
    ``nextn-graph make-checkpoint --preset flash-slice``, without a second copy."""
    cfg = preset_config("flash-slice")
    with _SkipDefaultInit():
        models = build_models(cfg)
    state = expected_state(models)
    with torch.no_grad():
        for key, value in iter_random(state, cfg, seed):
            state[key].copy_(value)
    for module in (models.target, models.draft):
        module.eval().requires_grad_(False)
    return models


def spec_run(models: LoadedModel, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Tokens of one request on cpu graphs (buckets 1, 2; S 3), and each step's seconds."""
    engine = SpecEngine(models.target, models.draft,
                        SpeculativeConfig(num_steps=3, num_draft_tokens=4),
                        PoolConfig(2, MAX_CONTEXT), GraphConfig(backend="cpu", buckets=(1, 2)))
    engine.add_request(prompt, MAX_NEW)
    tokens, times = [], []
    while engine.has_work:
        start = time.perf_counter()
        for out in engine.step():
            assert out.error is None, out.error
            tokens.extend(out.new_tokens)
        times.append(time.perf_counter() - start)
    return tokens, times


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


@pytest.mark.slow
def test_flash_slice_spec_equals_reference_on_cpu_graphs():
    """Slow (~3 min, ~12 GiB peak RSS): real-width matrices (2.8e9 parameters, 10.4 GiB in
    fp32) are filled with random values and run through a 130-token prompt several
    times on two cores.

    fp32: speculative decoding with every phase on the CPU graph emulator gives the
    tokens of ``reference_generate``. bf16 (the same weights cast): it stays within the
    bf16 guarantee of that fp32 reference (docs/guarantees_bf16.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        t0 = time.perf_counter()
        models = flash_slice_models(seed=0)
        assert model_bytes(models.cfg) >= 10 * 2**30  # real widths, not a shrunk copy
        built = time.perf_counter() - t0
        prompt = random_prompt(PROMPT_LEN, seed=3)  # ids < 256; bos 0 / eos 1 excluded
        ref = reference_generate(models.target, [prompt], MAX_NEW,
                                 max_context=MAX_CONTEXT).outputs[0]
        ref_logits = reference_logits(models.target, prompt, ref)
        got32, times32 = spec_run(models, prompt)
        assert got32 == ref

        for module in (models.target, models.draft):
            module.to(torch.bfloat16)
        got16, times16 = spec_run(models, prompt)
        regret = divergence_regret(got16, ref, ref_logits)
        assert within_tolerance(got16, ref, ref_logits), (got16, ref, regret)
        print(f"\nflash-slice: build+fill {built:.1f} s, total {time.perf_counter() - t0:.1f} s, "
              f"peak RSS {peak_gib():.2f} GiB\n"
              f"  fp32 steps (s): first {times32[0]:.2f} (prefill), later rounds median "
              f"{statistics.median(times32[1:] or [0.0]):.2f}\n"
              f"  bf16 steps (s): first {times16[0]:.2f} (prefill), later rounds median "
              f"{statistics.median(times16[1:] or [0.0]):.2f}; bf16 regret {regret}")
    finally:
        torch.set_num_threads(threads)
