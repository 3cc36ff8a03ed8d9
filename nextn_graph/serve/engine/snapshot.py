"""What the metrics read of the engine, taken on the engine's side after each turn of
the engine loop and sent with that turn's events (an ``EngineSnapshot``, ``messages.py``):
the engine's own counters (totals), the chunks' phase runs since the last snapshot, the
acceptance of each request round, and the queue and pool. ``/metrics`` reads the latest
one, so it exports the same families whether the engine runs on a thread of the server or
in its own process."""

from __future__ import annotations

from collections import Counter as Tally

from ...runtime.engine import SpecEngine
from ...runtime.request import StepOutput
from ..messages import ENGINE_STATS, RUNNER_COUNTERS, EngineSnapshot


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
