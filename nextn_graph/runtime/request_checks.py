"""A new request's checks: ``NewRequest`` (what ``SpecEngine.add_request`` is given)
-> its validated values, against the ``RequestLimits`` of an engine.

Every refusal is an ``InputError`` whose message names the request (``where``) and the
bad value, and whose ``field`` names the argument at fault (``prompt``,
``max_new_tokens``, ``stop_ids``, ``logprobs``, ``prompt_logprobs``, or a sampling field
such as ``top_p``), so a caller maps it without reading the message (the server: to
the OpenAI parameter). ``output_room`` is the one context rule: the engine's prompt
check and the server's both use it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError, show_value
from ..model import ModelConfig
from ..penalties import PENALTY_KEYS
from ..sampling import SamplingParams, sampling_params, sampling_per_prompt, with_bans

NEUTRAL = SamplingParams()  # every penalty off


def show_typed(value: object) -> str:
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
                             f"got {prompt.ndim}-D {prompt.dtype}", field="prompt")
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, (str, bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise InputError(f"{where}: prompt must be a sequence of token ids (list, tuple, or "
                         f"1-D integer tensor or array), got {show_typed(prompt)}",
                         field="prompt")
    return list(prompt)


def _token_ids(values, cfg: ModelConfig, where: str, what: str, field: str) -> list[int]:
    """Each value as an int id in [0, vocab); the error names the first bad one."""
    ids = []
    for value in values:
        tok = _as_int(value)
        if tok is None:
            raise InputError(f"{where}: {what} {show_typed(value)} is not an integer",
                             field=field)
        if not 0 <= tok < cfg.vocab_size:
            raise InputError(f"{where}: {what} {tok} is outside the vocabulary "
                             f"[0, {cfg.vocab_size})", field=field)
        ids.append(tok)
    return ids


def output_room(prompt_len: int, max_context: int, lookahead: int) -> int:
    """Tokens a prompt of ``prompt_len`` leaves for output in a context of ``max_context``
    positions, when verify windows write ``lookahead`` positions past the last output.
    A request needs at least 1 (its max_new_tokens at most this)."""
    return max_context - lookahead - prompt_len


def validate_max_new_tokens(max_new_tokens: object, where: str) -> int:
    """An int >= 1; numpy integers and 0-d integer tensors are converted (like token
    ids), bools and floats are refused."""
    value = _as_int(max_new_tokens)
    if value is None:
        raise InputError(f"{where}: max_new_tokens must be an int of at least 1, got "
                         f"{show_typed(max_new_tokens)}", field="max_new_tokens")
    if value < 1:
        raise InputError(f"{where}: max_new_tokens must be at least 1, got {value}",
                         field="max_new_tokens")
    return value


def validate_prompt(prompt: Sequence[int], cfg: ModelConfig, max_context: int,
                    max_new_tokens: int, where: str, lookahead: int = 0) -> list[int]:
    """Check one request up front; the error names it (``where``) and the bad value.

    ``prompt``: a sequence of int ids, numpy integers or 0-d integer tensors, or a
    1-D integer tensor / array; returned as a list of int. ``lookahead``: positions
    written past the output (speculative verify windows). The context is at most
    ``max_context`` and never past the model's ``max_position_embeddings``. Too long for
    the context: the ``prompt``'s fault when it leaves no room for any output, else
    ``max_new_tokens``'s.
    """
    max_new_tokens = validate_max_new_tokens(max_new_tokens, where)
    values = _elements(prompt, where)
    if not values:
        raise InputError(f"{where}: empty prompt", field="prompt")
    ids = _token_ids(values, cfg, where, "token id", "prompt")
    room = output_room(len(ids), min(max_context, cfg.max_position_embeddings), lookahead)
    if max_new_tokens > room:
        extra = f" + {lookahead} positions of verify lookahead" if lookahead else ""
        bound = (f"the maximum context {max_context}" if max_context <= cfg.max_position_embeddings
                 else f"the model's max_position_embeddings {cfg.max_position_embeddings}")
        raise InputError(f"{where}: prompt of {len(ids)} tokens + max_new_tokens "
                         f"{max_new_tokens}{extra} exceeds {bound}",
                         field="prompt" if room < 1 else "max_new_tokens")
    return ids


def validate_prompts(prompts: Sequence[Sequence[int]], cfg: ModelConfig, max_context: int,
                     max_new_tokens: int, lookahead: int = 0) -> list[list[int]]:
    """Check every prompt before any work starts; request i is the i-th prompt."""
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(
            prompts, (Sequence, torch.Tensor, np.ndarray)):
        raise InputError(f"prompts must be a list of prompts, got {show_typed(prompts)}",
                         field="prompts")
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
                         f"token ids, got {show_typed(stop_ids)}", field="stop_ids")
    return frozenset(_token_ids(stop_ids, cfg, where, "stop token id", "stop_ids"))


def validate_logprobs(value: object, limit: int, where: str, name: str) -> int | None:
    """A request's ``logprobs`` or ``prompt_logprobs`` (``name``, its field): None (off)
    or k, the top logprobs per token, in [0, limit] (the engine's graph.logprobs)."""
    if value is None:
        return None
    if limit == 0:
        raise InputError(f"{where}: {name} {show_typed(value)}: this engine computes no "
                         f"logprobs (build it with graph.logprobs > 0)", field=name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise InputError(f"{where}: {name} must be None or an integer in [0, {limit}] (the "
                         f"top logprobs per token; graph.logprobs is {limit}), got "
                         f"{show_typed(value)}", field=name)
    return value


def penalty_field(params: SamplingParams) -> str | None:
    """The first penalty field ``params`` sets (off its neutral value); None: none."""
    return next((k for k in PENALTY_KEYS if getattr(params, k) != getattr(NEUTRAL, k)), None)


@dataclass(frozen=True)
class RequestLimits:
    """What an engine takes of a request."""

    cfg: ModelConfig  # vocab_size, eos_token_id (the default stop), max_position_embeddings
    max_context: int  # positions per request (pool.max_context)
    lookahead: int = 0  # positions verify windows write past the last output
    max_logprobs: int = 0  # top logprobs a request may ask per token (graph.logprobs)
    samples: bool = False  # temperature > 0 is taken (graph.sampling)
    penalizes: bool = False  # penalties, logit_bias and min_tokens are taken (graph.penalties)


def checked_sampling(sampling: object, stops: frozenset[int], limits: RequestLimits,
                     where: str) -> SamplingParams:
    """Checked and resolved, with the stop ids min_tokens holds back (``ban_ids``)."""
    params = with_bans(sampling_params(sampling, where), stops, where)
    if not params.greedy and not limits.samples:
        raise InputError(f"{where}: temperature {params.temperature} samples, but this "
                         f"engine was built greedy-only (graph.sampling: false)",
                         field="temperature")
    if params.penalized and not limits.penalizes:
        raise InputError(f"{where}: penalties, logit_bias or min_tokens need an engine "
                         f"built with graph.penalties: true", field=penalty_field(params))
    bad = [t for t, _ in params.logit_bias if t >= limits.cfg.vocab_size]
    if bad:
        raise InputError(f"{where}: logit_bias token id {bad[0]} is outside the "
                         f"vocabulary [0, {limits.cfg.vocab_size})", field="logit_bias")
    return params


@dataclass(frozen=True)
class NewRequest:
    """One request as ``SpecEngine.add_request`` takes it; ``checked`` gives the same
    request validated: prompt a list of int ids, max_new_tokens an int, stop_ids a
    frozenset (EOS when None), sampling a resolved ``SamplingParams`` with its bans,
    each logprobs k an int or None."""

    prompt: object
    max_new_tokens: object
    stop_ids: object = None
    sampling: object = None
    logprobs: object = None
    prompt_logprobs: object = None

    def checked(self, limits: RequestLimits, where: str) -> "NewRequest":
        """Validated against ``limits``, or an ``InputError`` naming ``where`` and the
        field at fault."""
        max_new_tokens = validate_max_new_tokens(self.max_new_tokens, where)
        prompt = validate_prompt(self.prompt, limits.cfg, limits.max_context, max_new_tokens,
                                 where, limits.lookahead)
        stops = validate_stop_ids(self.stop_ids, limits.cfg, where)
        return NewRequest(
            prompt, max_new_tokens, stops, checked_sampling(self.sampling, stops, limits, where),
            validate_logprobs(self.logprobs, limits.max_logprobs, where, "logprobs"),
            validate_logprobs(self.prompt_logprobs, limits.max_logprobs, where,
                              "prompt_logprobs"))


def checked_batch(prompts: Sequence[Sequence[int]], max_new_tokens: object,
                  stop_ids: object, sampling: object,
                  limits: RequestLimits) -> list[NewRequest]:
    """``generate``'s batch, every request checked before any is queued; request i is
    prompt i. ``sampling``: one setting for all, or a list of one per prompt (seeds
    resolved here, once). The prompts are checked first, then the stop ids (named
    ``generate``: they are the batch's), then each request's sampling."""
    validate_prompts(prompts, limits.cfg, limits.max_context, max_new_tokens, limits.lookahead)
    validate_stop_ids(stop_ids, limits.cfg, "generate")
    return [NewRequest(p, max_new_tokens, stop_ids, s).checked(limits, f"request {i}")
            for i, (p, s) in enumerate(zip(prompts, sampling_per_prompt(sampling,
                                                                        len(prompts))))]
