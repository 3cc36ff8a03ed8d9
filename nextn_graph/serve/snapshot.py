"""What the metrics read of the engine, taken on the engine's side after each turn of
the engine loop and sent with that turn's events: the engine's own counters (totals),
the chunks' phase runs since the last snapshot, the acceptance of each request round,
and the queue and pool. ``/metrics`` reads the latest one, so it exports the same
families whether the engine runs on a thread of the server or in its own process."""

from __future__ import annotations

from collections import Counter as Tally
from dataclasses import dataclass

from ..runtime.engine import SpecEngine
from ..runtime.request import StepOutput

# engine.stats fields exported as counters (the rest are derived or describe the run)
ENGINE_STATS = ("rounds", "request_rounds", "prefill_forwards", "verify_forwards",
                "proposed_drafts", "accepted_drafts", "emitted_tokens", "prompt_tokens",
                "cached_tokens", "preemptions", "recomputed_tokens", "faults",
                "failed_requests")
RUNNER_COUNTERS = ("graph_replays", "eager_fallbacks", "padded_rows", "bucket_splits",
                   "overlapped_rounds", "sampled_chunks")


@dataclass(frozen=True)
class EngineSnapshot:
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


class Snapshots:
    """Takes an engine's snapshots; each one's phase runs are those since the last."""

    def __init__(self, engine: SpecEngine):
        self.engine = engine
        self._mark = Tally(engine.chunks.phase_runs)

    def take(self, outs: list[StepOutput], pending: int, live: int) -> EngineSnapshot:
        e = self.engine
        now = Tally(e.chunks.phase_runs)
        runs, self._mark = now - self._mark, now
        return EngineSnapshot(
            {k: getattr(e.stats, k) for k in ENGINE_STATS},
            {k: getattr(e.chunks.counters, k) for k in RUNNER_COUNTERS}, dict(runs),
            tuple((o.accepted, len(o.draft_tokens)) for o in outs
                  if o.accepted is not None and o.draft_tokens),  # plain rounds draft none
            e.num_waiting, pending, live, e.models.target_pool.free_rows, e.has_work,
            None if e.prefix is None else (e.prefix.cache.stats.asked_tokens,
                                           e.prefix.cache.stats.hit_tokens,
                                           e.prefix.cache.cached_pages))
