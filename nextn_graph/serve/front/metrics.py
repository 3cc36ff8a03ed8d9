"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (no global state:
two servers in one process keep their own counts).

Two sources: the request handlers (what each client saw: latencies, tokens, outcomes),
and the engine loop's snapshot of each turn (``messages.EngineSnapshot``: draft
acceptance per position, rounds per graph kind and bucket, queue depth, free rows, and
the engine's own counters, ``engine.stats`` and ``engine.chunks.counters``, the latest
exported at scrape time). The snapshot is the one way in, whether the engine runs on a
thread of the server or in its own process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..messages import ENGINE_STATS, RUNNER_COUNTERS, EngineSnapshot

P = "nextn_serve_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _EngineCollector(Collector):
    """The engine's counters as of the latest snapshot, at scrape time."""

    def __init__(self) -> None:
        self.snapshot: EngineSnapshot | None = None
        self.ended = False  # the engine is gone: its cache holds no page any more

    def collect(self):
        snap = self.snapshot
        if snap is None:
            return
        for name in ENGINE_STATS:
            yield CounterMetricFamily(f"nextn_engine_{name}", f"engine.stats.{name}",
                                      value=snap.stats[name])
        for name in RUNNER_COUNTERS:
            yield CounterMetricFamily(f"nextn_engine_{name}", f"chunks.counters.{name}",
                                      value=snap.counters[name])
        if snap.prefix is not None:  # as inference-perf reads a prefix cache
            asked, hit, pages = snap.prefix
            yield CounterMetricFamily("nextn_prefix_cache_queried_tokens", "prompt tokens "
                                      "looked up in the prefix cache", value=asked)
            yield CounterMetricFamily("nextn_prefix_cache_hit_tokens", "of those, served "
                                      "from cached pages", value=hit)
            yield GaugeMetricFamily("nextn_prefix_cache_hit_rate", "hit tokens / queried "
                                    "tokens since start", value=hit / asked if asked else 0.0)
            yield GaugeMetricFamily("nextn_prefix_cache_pages", "KV pages the prefix cache "
                                    "holds", value=0 if self.ended else pages)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ready = Gauge(P + "ready", "1 while the engine serves: its graphs captured, "
                           "and it has not ended", registry=r)
        self.requests = Counter(P + "requests", "engine requests (choices) ended, by "
                                "finish reason (stop, length, error, cancelled)", ["reason"], registry=r)
        self.rejected = Counter(P + "rejected", "requests refused before the engine, by "
                                "HTTP status", ["status"], registry=r)
        self.internal_errors = Counter(P + "internal_errors", "requests answered 500 by an "
                                       "unexpected error of the server (a bug: the log has "
                                       "its traceback)", registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens of requests ended "
                                     "(each prompt once)",
                                     registry=r)
        self.completion_tokens = Counter(P + "completion_tokens", "completion tokens of "
                                         "requests ended (as in each response's usage), "
                                         "by finish reason", ["reason"], registry=r)
        self.ttft = Histogram(P + "ttft_seconds", "arrival to a choice's first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "itl_seconds", "gap between successive token deliveries "
                             "of a choice (a round may deliver several)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "request_seconds", "arrival to the end of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.accept_len = Histogram(P + "acceptance_length", "tokens committed per request "
                                    "round, bonus included", buckets=tuple(range(1, 34)),
                                    registry=r)
        self.proposed = Counter(P + "draft_proposed", "draft tokens proposed, by position",
                                ["position"], registry=r)
        self.accepted = Counter(P + "draft_accepted", "draft tokens accepted, by position",
                                ["position"], registry=r)
        self.accept_rate = Gauge(P + "draft_acceptance_rate", "accepted / proposed draft "
                                 "tokens, by position, since start", ["position"], registry=r)
        self.phase_runs = Counter(P + "phase_runs", "phases run by the round chunks, by "
                                  "phase (GraphKey.name), bucket and whether a graph "
                                  "replayed it or it ran eagerly",
                                  ["phase", "bucket", "mode"], registry=r)
        self.queue_depth = Gauge(P + "queue_depth", "requests waiting: in the engine's "
                                 "queue or on their way to it", registry=r)
        self.running = Gauge(P + "running_requests", "requests holding a pool row",
                             registry=r)
        self.in_flight = Gauge(P + "in_flight_requests", "engine requests (choices) admitted "
                               "by the server and not yet answered", registry=r)
        self.free_rows = Gauge(P + "free_rows", "pool rows free (after the engine's latest "
                               "turn)", registry=r)
        self._per_position: dict[int, list[int]] = {}  # the rate gauges' counts
        self._engine = _EngineCollector()
        r.register(self._engine)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- the engine loop's turns (on the thread their reports arrive on) ----------------
    def observe(self, snap: EngineSnapshot) -> None:
        self._engine.snapshot = snap
        for (phase, bucket, mode), n in snap.phase_runs.items():
            self.phase_runs.labels(phase, str(bucket), mode).inc(n)
        for accepted, drafted in snap.acceptance:
            self._count_acceptance(accepted, drafted)
        self.queue_depth.set(snap.num_waiting + snap.pending)
        self.running.set(max(snap.live - snap.num_waiting, 0))
        self.free_rows.set(snap.free_rows)

    def engine_ended(self) -> None:
        """The engine ended on its own (its process died): it runs nothing, queues nothing
        and has no row to give, whatever its last turn said; its counters keep their
        totals."""
        self._engine.ended = True
        self.ready.set(0)
        self.running.set(0)
        self.queue_depth.set(0)
        self.free_rows.set(0)

    def _count_acceptance(self, accepted: int, drafted: int) -> None:
        """A round's accept length as the engine read it back (before stop and length
        cuts): draft position i (1-based) of ``drafted`` was accepted when i <= ``accepted``."""
        self.accept_len.observe(accepted + 1)
        for pos in range(drafted):
            label = str(pos + 1)
            self.proposed.labels(label).inc()
            if pos < accepted:
                self.accepted.labels(label).inc()
            counts = self._per_position.setdefault(pos, [0, 0])  # [proposed, accepted]
            counts[0] += 1
            counts[1] += int(pos < accepted)
            self.accept_rate.labels(label).set(counts[1] / counts[0])

