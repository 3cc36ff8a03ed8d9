"""Decoding without speculation: the oracle (full recompute) and plain cached.

``reference_generate`` recomputes the whole sequence for every token with no
cache at all; it is the ground truth every other mode must equal token for
token. ``plain_generate`` batches all requests against the KV pool: one prefill
forward, then one forward per step with one row per active request.

Both decode greedily, or sample (``sampling``) with the same keyed uniforms as
the engine's plain rounds: the token at position x is drawn from the filtered
target distribution with the uniform of (seed, x - 1, 1, TARGET), so a seeded
request gives the same tokens here and in a plain engine, eager or in graphs.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InputError, show_value
from ..memory.batch import Chunk, ForwardBatch
from ..memory.pool import PoolLayout
from ..model import DeepseekV4ForCausalLM, ModelConfig
from ..penalties import penalize
from ..sampling import RowParams, SamplingParams, sampling_per_prompt, with_bans


@dataclass
class GenerateResult:
    outputs: list[list[int]]
    stats: dict = field(default_factory=dict)


def _show(value: object) -> str:
    """``value`` for an error message: its type and a repr cut short."""
    return f"{type(value).__name__} {show_value(value, 60)}"


def _is_integer_dtype(dtype: torch.dtype | np.dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return np.issubdtype(dtype, np.integer)


def _as_int(value: object) -> int | None:
    """An integer scalar (int, numpy integer, 0-d integer tensor) as an int; None for
    anything else, bools included (``True`` is not token 1)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and _is_integer_dtype(value.dtype):
        return int(value)
    return None


def _elements(prompt: object, where: str) -> list:
    """The prompt's elements: a list, tuple or other sequence, or a 1-D integer tensor
    or numpy array (converted to ints here)."""
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(prompt, torch.Tensor) else "array"
        if prompt.ndim != 1 or not _is_integer_dtype(prompt.dtype):
            raise InputError(f"{where}: a prompt {kind} must be 1-D with an integer dtype, "
                             f"got {prompt.ndim}-D {prompt.dtype}")
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise InputError(f"{where}: prompt must be a sequence of token ids (list, tuple, or "
                         f"1-D integer tensor or array), got {_show(prompt)}")
    return list(prompt)


def _token_ids(values, cfg: ModelConfig, where: str, what: str) -> list[int]:
    """Each value as an int id in [0, vocab); the error names the first bad one."""
    ids = []
    for value in values:
        tok = _as_int(value)
        if tok is None:
            raise InputError(f"{where}: {what} {_show(value)} is not an integer")
        if not 0 <= tok < cfg.vocab_size:
            raise InputError(f"{where}: {what} {tok} is outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
        ids.append(tok)
    return ids


def validate_max_new_tokens(max_new_tokens: object, where: str) -> int:
    """An int >= 1; numpy integers and 0-d integer tensors are converted (like token
    ids), bools and floats are refused."""
    value = _as_int(max_new_tokens)
    if value is None:
        raise InputError(f"{where}: max_new_tokens must be an int of at least 1, got "
                         f"{_show(max_new_tokens)}")
    if value < 1:
        raise InputError(f"{where}: max_new_tokens must be at least 1, got {value}")
    return value


def validate_prompt(prompt: Sequence[int], cfg: ModelConfig, max_context: int,
                    max_new_tokens: int, where: str, lookahead: int = 0) -> list[int]:
    """Check one request up front; the error names it (``where``) and the bad value.

    ``prompt``: a sequence of int ids, numpy integers or 0-d integer tensors, or a
    1-D integer tensor / array; returned as a list of int. ``lookahead``: positions
    written past the output (speculative verify windows). The context is at most
    ``max_context`` and never past the model's ``max_position_embeddings``.
    """
    max_new_tokens = validate_max_new_tokens(max_new_tokens, where)
    values = _elements(prompt, where)
    if not values:
        raise InputError(f"{where}: empty prompt")
    ids = _token_ids(values, cfg, where, "token id")
    limit = min(max_context, cfg.max_position_embeddings)
    if len(ids) + max_new_tokens + lookahead > limit:
        extra = f" + {lookahead} positions of verify lookahead" if lookahead else ""
        bound = (f"the maximum context {max_context}" if max_context <= cfg.max_position_embeddings
                 else f"the model's max_position_embeddings {cfg.max_position_embeddings}")
        raise InputError(f"{where}: prompt of {len(ids)} tokens + max_new_tokens "
                         f"{max_new_tokens}{extra} exceeds {bound}")
    return ids


def validate_prompts(prompts: Sequence[Sequence[int]], cfg: ModelConfig, max_context: int,
                     max_new_tokens: int, lookahead: int = 0) -> list[list[int]]:
    """Check every prompt before any work starts; request i is the i-th prompt."""
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(
            prompts, (Sequence, torch.Tensor, np.ndarray)):
        raise InputError(f"prompts must be a list of prompts, got {_show(prompts)}")
    return [validate_prompt(p, cfg, max_context, max_new_tokens, f"request {i}", lookahead)
            for i, p in enumerate(prompts)]


def validate_stop_ids(stop_ids: Collection[int] | None, cfg: ModelConfig,
                      where: str) -> frozenset[int]:
    """A request's stop token ids: None stops at EOS; otherwise a list, tuple, set or
    frozenset of ids in the vocabulary (numpy integers and 0-d integer tensors are
    converted to int). The error names the request (``where``) and the bad element."""
    if stop_ids is None:
        return frozenset({cfg.eos_token_id})
    if not isinstance(stop_ids, (list, tuple, set, frozenset)):
        raise InputError(f"{where}: stop_ids must be a list, tuple, set or frozenset of "
                         f"token ids, got {_show(stop_ids)}")
    return frozenset(_token_ids(stop_ids, cfg, where, "stop token id"))


def validate_logprobs(value: object, limit: int, where: str, name: str) -> int | None:
    """A request's ``logprobs`` or ``prompt_logprobs``: None (off) or k, the top logprobs
    per token, in [0, limit] (the engine's graph.logprobs)."""
    if value is None:
        return None
    if limit == 0:
        raise InputError(f"{where}: {name} {_show(value)}: this engine computes no logprobs "
                         f"(build it with graph.logprobs > 0)")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise InputError(f"{where}: {name} must be None or an integer in [0, {limit}] (the "
                         f"top logprobs per token; graph.logprobs is {limit}), got "
                         f"{_show(value)}")
    return value


def _finished(out: list[int], stop_ids: frozenset[int], max_new_tokens: int) -> bool:
    return len(out) >= max_new_tokens or (bool(out) and out[-1] in stop_ids)


def _sampler(logits: torch.Tensor, params: list[SamplingParams], base: list[int],
             prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
    """logits [B, V] of the next token of B requests at committed lengths ``base``, after
    ``prompts[i] + outputs[i]`` -> each request's token: its argmax (greedy) or its keyed
    draw, after its penalties."""
    logits = penalize(logits, params, prompts, outputs)
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()
    rows = RowParams.of(params, logits.device)
    return rows.next_token(rows.probs(logits), torch.tensor(base, device=logits.device)).tolist()


def _prepare(target: DeepseekV4ForCausalLM, prompts, max_new_tokens: int,
             stop_ids: Collection[int] | None, max_context: int | None, mode: str):
    """Defaults resolved once: context from the model, stop at EOS unless told."""
    cfg = target.cfg
    if max_context is None:
        max_context = cfg.max_position_embeddings
    elif not isinstance(max_context, int) or isinstance(max_context, bool) or max_context < 1:
        raise InputError(f"{mode}: max_context must be an int of at least 1, got "
                         f"{_show(max_context)}")
    prompts = validate_prompts(prompts, cfg, max_context, max_new_tokens)
    max_new_tokens = validate_max_new_tokens(max_new_tokens, mode)
    return prompts, validate_stop_ids(stop_ids, cfg, mode), max_context, max_new_tokens


def _params(sampling: object, n: int, stop_ids: frozenset[int]) -> list[SamplingParams]:
    """One setting per prompt, with the stop ids min_tokens holds back (as the engine)."""
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
    """``sampling`` as ``reference_generate``'s."""
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
