"""What an engine is built from: its config sections, each checked as strictly as the YAML
loader checks them and resolved once (``EngineSetup.resolve``), and what start-up reads
off them (the pool's layout, the verify lookahead). Sections the loader resolved come
through unchanged: every resolution here is idempotent."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import (GraphConfig, PoolConfig, SchedulerConfig, SpeculativeConfig, check_pool,
                      check_scheduler, check_section, resolve_graph, resolve_speculative)
from ..errors import InputError
from ..memory.pool import PoolLayout
from ..model import ModelConfig

WHERE = "SpecEngine"  # what a refusal of a section built in code names

# pool.prefix_snapshots 0: one boundary state per request row. A state is the SWA
# window and C4's raw block of every layer (V4-Flash: ~6 MB, 3x a page's entries, half a
# row's rings), so one per page would quadruple a long-context pool; more is a setting
# (perf/paged_capacity.py --snapshots-per-row prices it).
DEFAULT_SNAPSHOTS_PER_ROW = 1


@dataclass(frozen=True)
class EngineSetup:
    spec: SpeculativeConfig | None  # None: plain decoding (no draft)
    pool: PoolConfig
    graph: GraphConfig  # buckets, round and overlap resolved
    scheduler: SchedulerConfig
    layout: PoolLayout  # both pools': rows, pages, the prefix cache's snapshots

    @classmethod
    def resolve(cls, model: ModelConfig, spec: SpeculativeConfig | None, pool: PoolConfig,
                graph: GraphConfig | None,
                scheduler: SchedulerConfig | None) -> "EngineSetup":
        """``graph`` None runs eagerly; ``scheduler`` None: the defaults. Nothing is built
        here: a refusal leaves the models and a tensor-parallel group untouched."""
        sched = check_section(scheduler or SchedulerConfig(), WHERE, "scheduler.")
        check_scheduler(sched, WHERE)
        if spec is not None:
            spec = resolve_speculative(check_section(spec, WHERE, "speculative."), WHERE)
        width = spec.verify_width if spec is not None else 1
        pool = check_section(pool, WHERE, "pool.")
        check_pool(pool, width, WHERE)
        graph = resolve_graph(check_section(graph or GraphConfig(backend="eager"), WHERE,
                                            "graph."), pool, WHERE)
        if graph.logprobs > model.vocab_size:
            raise InputError(f"{WHERE}: graph.logprobs {graph.logprobs} exceeds the "
                             f"vocabulary ({model.vocab_size} tokens)")
        return cls(spec, pool, graph, sched, _layout(pool, width))

    @property
    def num_steps(self) -> int:
        return self.spec.num_steps if self.spec is not None else 0

    @property
    def verify_width(self) -> int:
        return self.spec.verify_width if self.spec is not None else 1

    @property
    def overlap(self) -> bool:
        return self.graph.overlap == "on"

    @property
    def lookahead(self) -> int:
        """Positions a verify window writes past a request's last output: S - 1, and N
        more with overlap (the round launched before the request's end was read)."""
        return max(self.num_steps - 1, 0) + (self.verify_width if self.overlap else 0)


def _layout(pool: PoolConfig, verify_width: int) -> PoolLayout:
    snapshots = 0 if not pool.prefix_cache else (  # the page-boundary states kept
        pool.prefix_snapshots or DEFAULT_SNAPSHOTS_PER_ROW * pool.max_requests)
    return PoolLayout(pool.max_requests, pool.max_context, verify_width, pool.page_size,
                      pool.num_pages, snapshots)
