"""What crosses between the server's two sides, the HTTP front (``front/``: asyncio,
parsing, responses) and the engine's side (``engine/``: the engine loop, in a process of
its own or on a thread), and the one interface it crosses by (``Host``). Every message is
a frozen dataclass the engine process's pipes carry as it is, dispatched by ``match``
where it arrives.

Down (``ToEngine``, the front -> the loop): ``Add`` a request's choices (one ``Ticket``
each, admitted together), ``Abort`` one, ``Drain`` (SIGTERM), ``Stop``.
Up (``FromEngine``, the host -> the front): ``Ready`` with the engine's
``RequestLimits`` or ``BuildFailed``; then one ``Report`` per turn of the loop (its
``JobEvent``s, and an ``EngineSnapshot`` for the metrics); ``Ended`` when the engine ends
on its own. The engine's data in them is the runtime's plain data (``StepOutput``,
``RequestLimits``): neither side needs the other's modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from ..runtime.request import StepOutput
from ..runtime.request_checks import RequestLimits
from ..sampling import SamplingParams

# -- down: the front -> the engine loop ----------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """One engine request to add (one choice of an HTTP request), by its job key."""

    key: int
    prompt: tuple[int, ...]
    max_tokens: int
    stop_ids: frozenset[int]
    sampling: SamplingParams
    logprobs: int | None  # k per output token; None: off
    prompt_logprobs: int | None  # k per prompt token; None: off


@dataclass(frozen=True)
class Add:
    """A request's choices, admitted together: all, or none (one refused fails them)."""

    tickets: tuple[Ticket, ...]


@dataclass(frozen=True)
class Abort:
    """The client went away (or a stop string matched): free the job's row."""

    key: int


@dataclass(frozen=True)
class Drain:
    """Refuse new requests (503); fail those still running ``grace_s`` from now."""

    grace_s: float


@dataclass(frozen=True)
class Stop:
    """End the loop; the requests left fail (503)."""


ToEngine = Add | Abort | Drain | Stop

# -- up: the engine's host -> the front ----------------------------------------------

# The engine's names of request fields (``InputError.field``) that the API spells
# otherwise; every other field has the same name in both.
_API_NAMES = {"max_new_tokens": "max_tokens", "stop_ids": "stop_token_ids"}


def api_param(field: str | None) -> str | None:
    """The API parameter of an engine refusal's field (None: no single field)."""
    return _API_NAMES.get(field, field) if field else None


@dataclass(frozen=True)
class Failure:
    """The end of a request that did not complete: an HTTP status and why."""

    status: int
    message: str
    param: str | None = None  # the request field at fault, in the API's spelling


Event = StepOutput | Failure


@dataclass(frozen=True)
class JobEvent:
    """What the engine did for one job: new tokens (a ``StepOutput``) or its end."""

    key: int
    event: Event


# engine.stats fields exported as counters (the rest are derived or describe the run)
ENGINE_STATS = ("rounds", "request_rounds", "prefill_forwards", "verify_forwards",
                "proposed_drafts", "accepted_drafts", "emitted_tokens", "prompt_tokens",
                "cached_tokens", "preemptions", "recomputed_tokens", "faults",
                "failed_requests")
RUNNER_COUNTERS = ("graph_replays", "eager_fallbacks", "padded_rows", "bucket_splits",
                   "overlapped_rounds", "sampled_chunks")


@dataclass(frozen=True)
class EngineSnapshot:
    """What the metrics read of the engine, taken after a turn (``engine/snapshot.py``)."""

    stats: dict[str, int]  # ENGINE_STATS of engine.stats: totals since start
    counters: dict[str, int]  # RUNNER_COUNTERS of engine.chunks.counters: totals
    phase_runs: dict[tuple[str, int, str], int]  # (phase, bucket, mode) -> chunks, this turn
    # per request round of this turn: (drafts accepted, drafts proposed), as
    # ``StepOutput.accepted`` and ``len(draft_tokens)`` (before stop and length cuts)
    acceptance: tuple[tuple[int, int], ...]
    num_waiting: int  # in the engine's queue
    pending: int  # commands not yet taken by the loop (on their way to the engine)
    live: int  # engine requests the loop added and has not ended
    free_rows: int  # of the target pool
    has_work: bool  # the engine has requests waiting, running or in flight
    # the prefix cache: (prompt tokens looked up, of those found cached, pages it holds),
    # None where it is off
    prefix: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class Report:
    """What one turn of the loop produced."""

    events: tuple[JobEvent, ...]  # in the order they happened
    snapshot: EngineSnapshot


@dataclass(frozen=True)
class Ready:
    """The engine is built and captured; the front checks requests against ``limits``."""

    limits: RequestLimits


@dataclass(frozen=True)
class BuildFailed:
    """The engine could not be built (or a follower rank died meanwhile)."""

    reason: str


@dataclass(frozen=True)
class Ended:
    """The engine ended on its own (the loop raised, the process died)."""

    reason: str


FromEngine = Ready | BuildFailed | Report | Ended

# What a host hands each ``FromEngine`` to, on its own thread -> False when the front
# refuses a ready engine (it cannot serve it: the host stops the engine then).
Deliver = Callable[[FromEngine], bool]


class Host(Protocol):
    """Where the engine loop runs (``engine.hosts``: ``ProcessHost``, ``ThreadHost``);
    the front's one handle on the engine's side."""

    def start(self, deliver: Deliver) -> None: ...

    def send(self, command: ToEngine) -> None: ...

    def stop(self, timeout_s: float) -> None: ...
