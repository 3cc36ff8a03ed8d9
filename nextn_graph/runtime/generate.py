"""Decoding without speculation: the oracle (full recompute, no cache: the ground truth
every mode must equal token for token) and plain cached. Both sample with the engine's
plain-round keys (the token at position x: uniform of (seed, x - 1, 1, TARGET)), so a
seeded request gives the same tokens here and in a plain engine."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..memory.batch import Chunk, ForwardBatch
from ..memory.pool import PoolLayout
from ..model import DeepseekV4ForCausalLM
from ..penalties import penalize
from ..sampling import RowParams, SamplingParams, sampling_per_prompt, with_bans
from .request_checks import (RequestLimits, show_typed, validate_max_new_tokens,
                             validate_prompts, validate_stop_ids)


@dataclass
class GenerateResult:
    outputs: list[list[int]]
    stats: dict = field(default_factory=dict)


def _finished(out: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> bool:
    return len(out) >= max_new_tokens or (bool(out) and out[-1] in stop_ids)


def _sampler(logits: torch.Tensor, params: list[SamplingParams], base: list[int],
             prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
    """logits [B, V] of the next token at committed lengths ``base`` -> each request's
    token after its penalties: argmax (greedy) or keyed draw."""
    logits = penalize(logits, params, prompts, outputs)
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()
    rows = RowParams.of(params, logits.device)
    return rows.next_token(rows.probs(logits), torch.tensor(base, device=logits.device)).tolist()


def _prepare(target: DeepseekV4ForCausalLM, prompts, max_new_tokens: int,
             stop_ids: Collection[int] | None, max_context: int | None, mode: str):
    cfg = target.cfg
    if max_context is None:
        max_context = cfg.max_position_embeddings
    elif not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 1:
        raise InputError(f"{mode}: max_context must be an int of at least 1, got "
                         f"{show_typed(max_context)}", field="max_context")
    limits = RequestLimits.of(cfg, max_context)
    prompts = validate_prompts(prompts, limits, max_new_tokens)
    max_new_tokens = validate_max_new_tokens(max_new_tokens, mode)
    return prompts, validate_stop_ids(stop_ids, limits, mode), max_context, max_new_tokens


def _params(sampling: object, n: int, stop_ids: frozenset[int]) -> list[SamplingParams]:
    return [with_bans(p, stop_ids, f"request {i}")
            for i, p in enumerate(sampling_per_prompt(sampling, n))]


@torch.no_grad()
def reference_generate(target: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, stop_ids: Collection[int] | None = None,
                       max_context: int | None = None, sampling: object = None) -> GenerateResult:
    """``sampling``: None (greedy), one setting for all prompts, or one per prompt; a
    seed left None is drawn here (give seeds to mirror this on tensor-parallel ranks)."""
    prompts, stop_ids, max_context, max_new_tokens = _prepare(
        target, prompts, max_new_tokens, stop_ids, max_context, "reference_generate")
    params = _params(sampling, len(prompts), stop_ids)
    device = target.embed.weight.device
    start, forwards, outputs = time.perf_counter(), 0, []
    for prompt, param in zip(prompts, params):
        seq, out = list(prompt), []
        while not _finished(out, stop_ids, max_new_tokens):
            logits = target.reference(torch.tensor(seq, device=device)).logits  # [S, V]
            forwards += 1
            out.extend(_sampler(logits[-1:], [param], [len(seq) - 1], [prompt], [out]))
            seq.append(out[-1])
        outputs.append(out)
    return GenerateResult(outputs, _stats("reference", prompts, outputs, forwards, start))


@torch.no_grad()
def plain_generate(target: DeepseekV4ForCausalLM, prompts: Sequence[Sequence[int]],
                   max_new_tokens: int, stop_ids: Collection[int] | None = None,
                   max_context: int | None = None, sampling: object = None) -> GenerateResult:
    prompts, stop_ids, max_context, max_new_tokens = _prepare(
        target, prompts, max_new_tokens, stop_ids, max_context, "plain_generate")
    params = _params(sampling, len(prompts), stop_ids)
    if not prompts:  # nothing to decode: no pool of zero requests
        return GenerateResult([], _stats("plain", [], [], 0, time.perf_counter()))
    device = target.embed.weight.device
    pool = target.new_pool(PoolLayout(len(prompts), max_context, verify_width=1))
    rows = [pool.alloc() for _ in prompts]
    start = time.perf_counter()
    batch = ForwardBatch.from_chunks(
        [Chunk(r, 0, p) for r, p in zip(rows, prompts)], device=device)
    logits = target(batch, pool).logits  # [sum(prompt lens), V]
    last = torch.tensor([len(p) for p in prompts], device=device).cumsum(0) - 1
    nxt = _sampler(logits[last], params, [len(p) - 1 for p in prompts], prompts,
                   [[] for _ in prompts])
    outputs: list[list[int]] = [[t] for t in nxt]
    forwards, steps, decode_start = 1, 0, time.perf_counter()
    while True:
        active = [i for i, o in enumerate(outputs) if not _finished(o, stop_ids, max_new_tokens)]
        if not active:
            break
        batch = ForwardBatch.from_chunks(
            [Chunk(rows[i], len(prompts[i]) + len(outputs[i]) - 1, [outputs[i][-1]])
             for i in active], device=device)
        logits = target(batch, pool).logits  # [active, V]: one row per active request
        nxt = _sampler(logits, [params[i] for i in active],
                       [len(prompts[i]) + len(outputs[i]) - 1 for i in active],
                       [prompts[i] for i in active], [outputs[i] for i in active])
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
