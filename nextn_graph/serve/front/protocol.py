"""OpenAI request parsing: a JSON body -> one checked ``GenRequest``, or an ``APIError``
(400) naming the field, checked against what the served model can hold.

``fields.check_fields`` runs first: an unknown field is refused by name, and so is one
not implemented unless it holds its default (every field's policy: ``fields.py``). Read
here: ``prompt`` (``prompts.py``: one, or a batch) or ``messages``, ``n``, ``max_tokens``
(chat: or ``max_completion_tokens``; 0 with completions' ``echo``: the prompt alone, as
vLLM's), ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, the logprobs fields (completions' ``logprobs`` and
``echo``, chat's ``logprobs`` and ``top_logprobs``), the penalties
(``presence_penalty``, ``frequency_penalty``, ``logit_bias``), and vLLM's ``min_p``,
``repetition_penalty``, ``min_tokens``, ``prompt_logprobs``, ``stop_token_ids``,
``ignore_eos``, ``return_token_ids``.

A request is one engine request per choice: ``n`` choices per prompt, ordered
prompt-major (choice index = prompt index * n + j, as OpenAI and vLLM number them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...errors import InputError, show_value
from ...penalties import PENALTY_KEYS
from ...runtime.request_checks import output_room, penalty_field
from ...sampling import SEED_LIMIT, SamplingParams, request_seed, with_bans
from .errors import APIError
from .errors import bad_value as _bad
from .fields import check_fields
from .model_info import ModelInfo
from .prompts import chat_prompt, checked_ids, completion_prompts
from .values import flag as _flag
from .values import integer as _int
from .values import number as _number

MAX_STOP_STRINGS = 4  # OpenAI's bound
MAX_STOP_CHARS = 256  # one stop string; the stream holds back this much text at most
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_N = 16  # choices per prompt (each is an engine request; more queue)
# the sampling checks' InputError.field values: each is the OpenAI parameter's name
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_p", *PENALTY_KEYS)
WHERE = "sampling"  # the prefix of the sampling checks' messages, cut off here


@dataclass(frozen=True)
class LogprobAsk:
    """What a request asks of logprobs. Each k: how many most likely alternatives come
    with each token (0: the chosen token's logprob alone); None: not asked."""

    output: int | None = None  # completions' logprobs; chat's top_logprobs (logprobs true)
    prompt: int | None = None  # vLLM's prompt_logprobs
    echo: bool = False  # completions: the prompt's text first, and its tokens' logprobs

    @property
    def engine_prompt(self) -> int | None:
        """The engine's prompt_logprobs: echo with logprobs needs them too."""
        asked = [k for k in (self.prompt, self.output if self.echo else None) if k is not None]
        return max(asked, default=None)


@dataclass(frozen=True)
class Choice:
    """One choice of a request: one engine request."""

    index: int  # in the response: prompt * n + j
    prompt: int  # which of the request's prompts
    sampling: SamplingParams


@dataclass(frozen=True)
class GenRequest:
    """One checked request, ready for the engine."""

    prompts: tuple[tuple[int, ...], ...]  # token ids of each prompt (chat: one)
    n: int  # choices per prompt
    max_tokens: int  # 0: echo_only
    sampling: SamplingParams
    stop: tuple[str, ...]  # stop strings, matched on the decoded output
    stop_ids: frozenset[int]  # stop token ids (EOS unless ignore_eos, and stop_token_ids)
    stream: bool
    include_usage: bool
    continuous_usage: bool  # every chunk carries the usage so far (with include_usage)
    return_token_ids: bool
    chat: bool
    logprobs: LogprobAsk = LogprobAsk()

    @property
    def echo_only(self) -> bool:
        """max_tokens 0 (with echo, as vLLM): each choice is its prompt's echo alone."""
        return self.max_tokens == 0

    @property
    def engine_max_tokens(self) -> int:
        """The engine makes at least one token: echo_only's one is made so the prefill
        (the prompt's logprobs) runs, and nothing of it reaches the response
        (``session._Run.take`` drops it)."""
        return max(self.max_tokens, 1)

    def choices(self) -> list[Choice]:
        """Prompt-major. With a seed and n > 1 choice j samples with
        ``request_seed(seed, j)`` (distinct streams; prompt i's choice j equals the
        single-prompt request's); greedy choices of a prompt are alike."""
        def sampling(j: int) -> SamplingParams:
            if self.n == 1 or self.sampling.seed is None:  # (None: the engine draws one each)
                return self.sampling
            return dataclasses.replace(self.sampling, seed=request_seed(self.sampling.seed, j))
        return [Choice(p * self.n + j, p, sampling(j))
                for p in range(len(self.prompts)) for j in range(self.n)]


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise _bad(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty "
                   f"strings of at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _refusal(exc: InputError) -> APIError:
    """A sampling check's refusal: a 400 naming its field, its message without ``WHERE``."""
    param = exc.field if exc.field in SAMPLING_FIELDS else None
    return _bad(str(exc).removeprefix(f"{WHERE}: "), param)


def _top_k(body: dict, info: ModelInfo) -> int:
    """vLLM's -1 and 0 are off; so is any k that keeps the whole vocabulary (k >=
    vocab_size filters nothing), so a k of any size is taken and none reaches the
    engine's int64 tensors out of range."""
    k = _int(body, "top_k", 0, -1)
    return 0 if k < 0 or k >= info.limits.vocab_size else k


def _sampling(body: dict, info: ModelInfo, max_tokens: int,
              stop_ids: frozenset[int]) -> SamplingParams:
    # OpenAI's default temperature is 1; an engine built greedy-only decodes greedily
    limits = info.limits
    default_t = 1.0 if limits.samples else 0.0
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise _bad(f"logit_bias must map token ids to biases, got {show_value(bias)}",
                   "logit_bias")
    params = SamplingParams(
        _number(body, "temperature", default_t), _number(body, "top_p", 1.0),
        _top_k(body, info), _int(body, "seed", None, 0, SEED_LIMIT),
        min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0), logit_bias=bias,
        min_tokens=_int(body, "min_tokens", 0, 0))
    try:
        params = params.checked(WHERE)
    except InputError as exc:
        raise _refusal(exc) from None
    if not params.greedy and not limits.samples:
        raise _bad("temperature > 0 samples, but this server's engine is greedy-only "
                   "(graph.sampling: false)", "temperature")
    try:  # (the stop ids min_tokens holds back, as the engine sets them)
        banned = with_bans(params, stop_ids, WHERE)
    except InputError as exc:
        raise _refusal(exc) from None
    if banned.penalized and not limits.penalizes:
        name = penalty_field(banned)
        raise _bad(f"{name}: this server applies no penalties (start it without "
                   f"--no-penalties)", name)
    far = [t for t, _ in params.logit_bias if t >= limits.vocab_size]
    if far:
        raise _bad(f"logit_bias: token id {far[0]} is outside the vocabulary "
                   f"[0, {limits.vocab_size})", "logit_bias")
    if params.min_tokens > max_tokens:
        raise _bad(f"min_tokens {params.min_tokens} exceeds max_tokens {max_tokens}",
                   "min_tokens")
    return params


def _no_logprobs(key: str) -> APIError:
    return _bad(f"{key}: this server computes no logprobs (start it with --max-logprobs "
                f"> 0)", key)


def _k(body: dict, key: str, info: ModelInfo) -> int | None:
    """A logprobs count: an integer in [0, max_logprobs], or None (the engine computes
    none when it is 0)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"{key} must be an integer >= 0, got {show_value(value)}", key)
    limit = info.limits.max_logprobs
    if limit == 0:
        raise _no_logprobs(key)
    if value > limit:
        raise _bad(f"{key} {value} is more than this server returns: at most "
                   f"{limit} (nextn-graph serve --max-logprobs)", key)
    return value


def _logprobs(body: dict, info: ModelInfo, chat: bool) -> LogprobAsk:
    prompt = _k(body, "prompt_logprobs", info)
    if not chat:
        return LogprobAsk(_k(body, "logprobs", info), prompt, _flag(body, "echo"))
    if not _flag(body, "logprobs"):
        top = body.get("top_logprobs")  # (0 is what a client sends meaning none, as vLLM)
        if top is not None and not (type(top) is int and top == 0):
            raise _bad(f"top_logprobs {show_value(top)} needs logprobs: true",
                       "top_logprobs")
        return LogprobAsk(None, prompt)
    if info.limits.max_logprobs == 0:
        raise _no_logprobs("logprobs")
    return LogprobAsk(_k(body, "top_logprobs", info) or 0, prompt)


def _prompts(body: dict, info: ModelInfo, chat: bool) -> tuple[list[list[int]], int]:
    """The prompts, and the room each leaves for output (the least of them)."""
    limits = info.limits
    prompts = [chat_prompt(body, info)] if chat else completion_prompts(body, info)
    rooms = [output_room(len(p), limits.max_context, limits.lookahead) for p in prompts]
    for i, (prompt, room) in enumerate(zip(prompts, rooms)):
        if room < 1:
            name = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise _bad(f"{name}: the prompt has {len(prompt)} tokens; with "
                       f"{limits.lookahead} positions of verify lookahead, {limits.bound} "
                       f"leaves no room for output", "messages" if chat else "prompt")
    return prompts, min(rooms)


def _max_tokens(body: dict, info: ModelInfo, chat: bool, longest: int, room: int) -> int:
    """0 only with completions' echo (vLLM's prompt-only scoring). Its engine request
    still takes one token (``GenRequest.engine_max_tokens``), so the prompt's room rule
    (``_prompts``: room for at least one token) is the same for it."""
    key = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    default = room if chat else DEFAULT_MAX_TOKENS
    echo_only = not chat and _flag(body, "echo")
    value = body.get(key)
    if not echo_only and type(value) is int and value == 0:
        need = ("completions' echo: true, and chat has no echo" if chat else "echo: true")
        raise _bad(f"{key} must be an integer >= 1, got 0 (0, the prompt alone scored, "
                   f"needs {need})", key)
    max_tokens = _int(body, key, min(default, room), 0 if echo_only else 1)
    if max_tokens > room:
        raise _bad(f"{key} {max_tokens} + the prompt's {longest} tokens + "
                   f"{info.limits.lookahead} positions of verify lookahead exceed "
                   f"{info.limits.bound}: at most {room} here", key)
    return max_tokens


def parse_request(body: object, info: ModelInfo, chat: bool) -> GenRequest:
    """A JSON body of /v1/completions (``chat`` False) or /v1/chat/completions."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    check_fields(body, chat)  # (and the metadata fields' types: model, user, ...)
    prompts, room = _prompts(body, info, chat)
    max_tokens = _max_tokens(body, info, chat, max(len(p) for p in prompts), room)
    extra = body.get("stop_token_ids") or []
    if not isinstance(extra, list):
        raise _bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    eos = [] if _flag(body, "ignore_eos") else [info.limits.eos_token_id]
    stop_ids = frozenset([*eos, *checked_ids(extra, info, "stop_token_ids")])
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    usage = _flag(options, "include_usage", "stream_options.")
    return GenRequest(tuple(tuple(p) for p in prompts), _int(body, "n", 1, 1, MAX_N + 1),
                      max_tokens, _sampling(body, info, max_tokens, stop_ids), _stop(body), stop_ids,
                      _flag(body, "stream"), usage, usage and _flag(
                          options, "continuous_usage_stats", "stream_options."),
                      _flag(body, "return_token_ids"), chat, _logprobs(body, info, chat))
