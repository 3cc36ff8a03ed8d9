"""Greedy decoding without speculation: the oracle (full recompute) and plain cached.

``reference_generate`` recomputes the whole sequence for every token with no
cache at all; it is the ground truth every other mode must equal token for
token. ``plain_generate`` batches all requests against the KV pool: one prefill
forward, then one forward per step with one row per active request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .errors import InputError
from .memory.batch import Chunk, ForwardBatch
from .memory.pool import PoolLayout
from .model import DeepseekV4ForCausalLM, ModelConfig


@dataclass
class GenerateResult:
    outputs: list[list[int]]
    stats: dict = field(default_factory=dict)


def validate_prompt(prompt: Sequence[int], cfg: ModelConfig, max_context: int,
                    max_new_tokens: int, where: str, lookahead: int = 0) -> list[int]:
    """Check one request up front; the error names it (``where``) and the bad value.

    ``lookahead``: positions written past the output (speculative verify windows).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"{where}: max_new_tokens must be at least 1, got {max_new_tokens!r}")
    ids = list(prompt)
    if not ids:
        raise InputError(f"{where}: empty prompt")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
           or not 0 <= t < cfg.vocab_size]
    if bad:
        raise InputError(f"{where}: token id {bad[0]!r} is outside the vocabulary "
                         f"[0, {cfg.vocab_size})")
    if len(ids) + max_new_tokens + lookahead > max_context:
        extra = f" + {lookahead} positions of verify lookahead" if lookahead else ""
        raise InputError(f"{where}: prompt of {len(ids)} tokens + max_new_tokens "
                         f"{max_new_tokens}{extra} exceeds the maximum context {max_context}")
    return ids


def validate_prompts(prompts: Sequence[Sequence[int]], cfg: ModelConfig, max_context: int,
                     max_new_tokens: int, lookahead: int = 0) -> list[list[int]]:
    """Check every prompt before any work starts; request i is the i-th prompt."""
    return [validate_prompt(p, cfg, max_context, max_new_tokens, f"request {i}", lookahead)
            for i, p in enumerate(prompts)]


def _finished(out: list[int], stop_ids: set[int], max_new_tokens: int) -> bool:
    return len(out) >= max_new_tokens or (bool(out) and out[-1] in stop_ids)


def _prepare(target: DeepseekV4ForCausalLM, prompts, max_new_tokens: int,
             stop_ids: set[int] | None, max_context: int | None):
    """Defaults resolved once: context from the model, stop at EOS unless told."""
    cfg = target.cfg
    max_context = max_context or cfg.max_position_embeddings
    prompts = validate_prompts(prompts, cfg, max_context, max_new_tokens)
    return prompts, ({cfg.eos_token_id} if stop_ids is None else stop_ids), max_context


@torch.no_grad()
def reference_generate(target: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, stop_ids: set[int] | None = None,
                       max_context: int | None = None) -> GenerateResult:
    prompts, stop_ids, max_context = _prepare(target, prompts, max_new_tokens, stop_ids,
                                              max_context)
    device = target.embed.weight.device
    start, forwards, outputs = time.perf_counter(), 0, []
    for prompt in prompts:
        seq, out = list(prompt), []
        while not _finished(out, stop_ids, max_new_tokens):
            logits = target.reference(torch.tensor(seq, device=device)).logits  # [S, V]
            forwards += 1
            out.append(int(logits[-1].argmax()))
            seq.append(out[-1])
        outputs.append(out)
    return GenerateResult(outputs, _stats("reference", prompts, outputs, forwards, start))


@torch.no_grad()
def plain_generate(target: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, stop_ids: set[int] | None = None,
                   max_context: int | None = None) -> GenerateResult:
    prompts, stop_ids, max_context = _prepare(target, prompts, max_new_tokens, stop_ids,
                                              max_context)
    device = target.embed.weight.device
    pool = target.new_pool(PoolLayout(len(prompts), max_context, verify_width=1))
    rows = [pool.alloc() for _ in prompts]
    start = time.perf_counter()
    batch = ForwardBatch.from_chunks(
        [Chunk(r, 0, p) for r, p in zip(rows, prompts)], device=device)
    logits = target(batch, pool).logits  # [sum(prompt lens), V]
    last = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1
    nxt = logits[last].argmax(-1).tolist()
    outputs: list[list[int]] = [[t] for t in nxt]
    forwards, steps, decode_start = 1, 0, time.perf_counter()
    while True:
        active = [i for i, o in enumerate(outputs) if not _finished(o, stop_ids, max_new_tokens)]
        if not active:
            break
        batch = ForwardBatch.from_chunks(
            [Chunk(rows[i], len(prompts[i]) + len(outputs[i]) - 1, [outputs[i][-1]])
             for i in active], device=device)
        nxt = target(batch, pool).logits.argmax(-1).tolist()  # one row per active request
        forwards, steps = forwards + 1, steps + 1
        for i, tok in zip(active, nxt):
            outputs[i].append(tok)
    decode_s = time.perf_counter() - decode_start
    stats = _stats("plain", prompts, outputs, forwards, start)
    stats.update(decode_steps=steps, decode_s=round(decode_s, 4),
                 step_ms=round(1000 * decode_s / max(steps, 1), 3))
    return GenerateResult(outputs, stats)


def _stats(mode: str, prompts, outputs, forwards: int, start: float) -> dict:
    wall = time.perf_counter() - start
    generated = sum(len(o) for o in outputs)
    return {"mode": mode, "requests": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": generated,
            "target_forwards": forwards, "wall_s": round(wall, 4),
            "tokens_per_s": round(generated / wall, 2) if wall > 0 else None}
