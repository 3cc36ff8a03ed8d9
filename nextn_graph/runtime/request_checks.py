"""A new request's checks against an engine's ``RequestLimits``. Every refusal is an
``InputError`` naming the request (``where``) and the bad value, whose ``field`` names
the argument at fault, so a caller (the server) maps it without reading the message.
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
    return f"{type(value).__name__} {show_value(value, 60)}"


def _is_integer_dtype(dtype: torch.dtype | np.dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return np.issubdtype(dtype, np.integer)


def _as_int(value: object) -> int | None:
    """int, numpy integer or 0-d integer tensor -> int; else None (``True`` is not token 1)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and _is_integer_dtype(value.dtype):
        return int(value)
    return None


def _elements(prompt: object, where: str) -> list:
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


def _token_ids(values, vocab_size: int, where: str, what: str, field: str) -> list[int]:
    ids = []
    for value in values:
        tok = _as_int(value)
        if tok is None:
            raise InputError(f"{where}: {what} {show_typed(value)} is not an integer",
                             field=field)
        if not 0 <= tok < vocab_size:
            raise InputError(f"{where}: {what} {tok} is outside the vocabulary "
                             f"[0, {vocab_size})", field=field)
        ids.append(tok)
    return ids


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: made once by the engine (``of``), the same
    object the server's front checks requests with (plain fields: it crosses the engine
    process's pipe)."""

    vocab_size: int
    eos_token_id: int  # the default stop
    # positions per request: pool.max_context, capped by the model's
    # max_position_embeddings and by what the pool's pages hold
    max_context: int
    bound: str  # what sets max_context, as a refusal names it
    lookahead: int = 0  # positions verify windows write past the last output
    max_logprobs: int = 0  # top logprobs a request may ask per token (graph.logprobs)
    samples: bool = False  # temperature > 0 is taken (graph.sampling)
    penalizes: bool = False  # penalties, logit_bias and min_tokens are taken (graph.penalties)

    @classmethod
    def of(cls, cfg: ModelConfig, max_context: int, *, pages: int = 0, page_size: int = 0,
           lookahead: int = 0, max_logprobs: int = 0, samples: bool = False,
           penalizes: bool = False) -> "RequestLimits":
        """``max_context`` capped by the model's ``max_position_embeddings`` and by what
        ``pages`` pages of ``page_size`` positions hold (0 pages: no such cap); the
        bound that binds is named (a tie: the first, the maximum context)."""
        mpe = cfg.max_position_embeddings
        bounds = [(max_context, f"the maximum context {max_context}"),
                  (mpe, f"the model's max_position_embeddings {mpe}")]
        if pages:
            held = pages * page_size
            bounds.append((held, f"the maximum context {held} (the pool's pages: "
                                 f"pool.num_pages {pages} x page_size {page_size})"))
        limit, bound = min(bounds, key=lambda b: b[0])
        return cls(cfg.vocab_size, cfg.eos_token_id, limit, bound, lookahead, max_logprobs,
                   samples, penalizes)


def output_room(prompt_len: int, max_context: int, lookahead: int) -> int:
    """The one context rule (the server's check uses it too): verify windows write
    ``lookahead`` positions past the last output."""
    return max_context - lookahead - prompt_len


def validate_max_new_tokens(max_new_tokens: object, where: str) -> int:
    """Integers as ``_as_int`` takes them; bools and floats are refused."""
    value = _as_int(max_new_tokens)
    if value is None:
        raise InputError(f"{where}: max_new_tokens must be an int of at least 1, got "
                         f"{show_typed(max_new_tokens)}", field="max_new_tokens")
    if value < 1:
        raise InputError(f"{where}: max_new_tokens must be at least 1, got {value}",
                         field="max_new_tokens")
    return value


def validate_prompt(prompt: Sequence[int], limits: RequestLimits, max_new_tokens: int,
                    where: str) -> list[int]:
    """-> the prompt as a list of int. Too long for ``limits.max_context`` is the
    ``prompt``'s fault when it leaves no room for any output, else ``max_new_tokens``'s."""
    max_new_tokens = validate_max_new_tokens(max_new_tokens, where)
    values = _elements(prompt, where)
    if not values:
        raise InputError(f"{where}: empty prompt", field="prompt")
    ids = _token_ids(values, limits.vocab_size, where, "token id", "prompt")
    room = output_room(len(ids), limits.max_context, limits.lookahead)
    if max_new_tokens > room:
        la = limits.lookahead
        extra = f" + {la} positions of verify lookahead" if la else ""
        raise InputError(f"{where}: prompt of {len(ids)} tokens + max_new_tokens "
                         f"{max_new_tokens}{extra} exceeds {limits.bound}",
                         field="prompt" if room < 1 else "max_new_tokens")
    return ids


def validate_prompts(prompts: Sequence[Sequence[int]], limits: RequestLimits,
                     max_new_tokens: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(
            prompts, (Sequence, torch.Tensor, np.ndarray)):
        raise InputError(f"prompts must be a list of prompts, got {show_typed(prompts)}",
                         field="prompts")
    return [validate_prompt(p, limits, max_new_tokens, f"request {i}")
            for i, p in enumerate(prompts)]


def validate_stop_ids(stop_ids: Collection[int] | None, limits: RequestLimits,
                      where: str) -> frozenset[int]:
    """None stops at EOS."""
    if stop_ids is None:
        return frozenset({limits.eos_token_id})
    if not isinstance(stop_ids, (list, tuple, set, frozenset)):
        raise InputError(f"{where}: stop_ids must be a list, tuple, set or frozenset of "
                         f"token ids, got {show_typed(stop_ids)}", field="stop_ids")
    return frozenset(_token_ids(stop_ids, limits.vocab_size, where, "stop token id",
                                "stop_ids"))


def validate_logprobs(value: object, limit: int, where: str, name: str) -> int | None:
    """None (off) or k in [0, limit] (graph.logprobs)."""
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
    return next((k for k in PENALTY_KEYS if getattr(params, k) != getattr(NEUTRAL, k)), None)


def checked_sampling(sampling: object, stops: frozenset[int], limits: RequestLimits,
                     where: str) -> SamplingParams:
    """Resolved, with the stop ids min_tokens holds back (``ban_ids``)."""
    params = with_bans(sampling_params(sampling, where), stops, where)
    if not params.greedy and not limits.samples:
        raise InputError(f"{where}: temperature {params.temperature} samples, but this "
                         f"engine was built greedy-only (graph.sampling: false)",
                         field="temperature")
    if params.penalized and not limits.penalizes:
        raise InputError(f"{where}: penalties, logit_bias or min_tokens need an engine "
                         f"built with graph.penalties: true", field=penalty_field(params))
    bad = [t for t, _ in params.logit_bias if t >= limits.vocab_size]
    if bad:
        raise InputError(f"{where}: logit_bias token id {bad[0]} is outside the "
                         f"vocabulary [0, {limits.vocab_size})", field="logit_bias")
    return params


@dataclass(frozen=True)
class NewRequest:
    prompt: object
    max_new_tokens: object
    stop_ids: object = None
    sampling: object = None
    logprobs: object = None
    prompt_logprobs: object = None

    def checked(self, limits: RequestLimits, where: str) -> "NewRequest":
        max_new_tokens = validate_max_new_tokens(self.max_new_tokens, where)
        prompt = validate_prompt(self.prompt, limits, max_new_tokens, where)
        stops = validate_stop_ids(self.stop_ids, limits, where)
        return NewRequest(
            prompt, max_new_tokens, stops, checked_sampling(self.sampling, stops, limits, where),
            validate_logprobs(self.logprobs, limits.max_logprobs, where, "logprobs"),
            validate_logprobs(self.prompt_logprobs, limits.max_logprobs, where,
                              "prompt_logprobs"))


def checked_batch(prompts: Sequence[Sequence[int]], max_new_tokens: object,
                  stop_ids: object, sampling: object,
                  limits: RequestLimits) -> list[NewRequest]:
    """Every request checked before any is queued; seeds resolved here, once."""
    validate_prompts(prompts, limits, max_new_tokens)
    validate_stop_ids(stop_ids, limits, "generate")
    return [NewRequest(p, max_new_tokens, stop_ids, s).checked(limits, f"request {i}")
            for i, (p, s) in enumerate(zip(prompts, sampling_per_prompt(sampling,
                                                                        len(prompts))))]
