"""The per-round trace of the fused round, overlap off and on (issue 12: with overlap
the host's read of round k is off round k+1's critical path).

``record_trace`` observes a few steady rounds only (``ChunkRunner.observer``): it
reports one event per chunk half, ``launch`` (staging, replays, starting the readback copy)
and ``read`` (waiting for that copy and decoding it), in perf_counter seconds.
``round_trace`` names each event's round and derives the check: with overlap, round
k+1's launch starts before round k's read starts; in step, round k's read ends before
round k+1's launch starts.
"""

from __future__ import annotations

import statistics
from typing import Callable

from ..runtime.chunks import ChunkRunner, RoundObserver

# Steady rounds traced per run: three or more launch/read pairs, and a short JSON.
TRACE_ROUNDS = 4


class EventLog(RoundObserver):
    """An observer that keeps each chunk half as {"event", "start", "end"}, and sums the
    seconds the reads waited for their copies."""

    def __init__(self):
        self.events: list[dict] = []
        self.read_wait_s = 0.0

    def event(self, name: str, start: float, end: float) -> None:
        if name == "read_wait":
            self.read_wait_s += end - start
        elif name in ("launch", "read"):
            self.events.append({"event": name, "start": start, "end": end})


def record_trace(chunks: ChunkRunner, step: Callable[[], object], rounds: int) -> list[dict]:
    """Run ``step`` (one steady round) ``rounds`` times under an ``EventLog`` observer,
    removed after: per round, its events, the seconds its reads waited
    and its overlapped rounds (1 where it was launched with an earlier round unread)."""
    steps: list[dict] = []
    log = chunks.observer = EventLog()
    events = log.events
    try:
        for _ in range(rounds):
            first, wait = len(events), log.read_wait_s
            overlapped = chunks.counters.overlapped_rounds
            step()
            steps.append({"events": events[first:], "read_wait_s": log.read_wait_s - wait,
                          "overlapped_rounds": chunks.counters.overlapped_rounds - overlapped})
    finally:
        chunks.observer = None
    return steps


def _spans(events: list[dict], kind: str) -> dict[int, tuple[float, float]]:
    """Round -> (first start, last end) of its events of ``kind`` (a round split in
    chunks has one launch and one read per chunk)."""
    spans: dict[int, tuple[float, float]] = {}
    for e in events:
        if e["event"] == kind:
            start, end = spans.get(e["round"], (e["start"], e["end"]))
            spans[e["round"]] = (min(start, e["start"]), max(end, e["end"]))
    return spans


def round_trace(steps: list[dict]) -> dict:
    """One run's trace (``record_trace``): the events named by round (the i-th traced
    round is round i) with ms from the first event, read wait ms and overlapped rounds
    per round, and the check over every round k read and k+1 launched in the window."""
    named = []
    for i, s in enumerate(steps):
        for e in s["events"]:
            # a round launched with an earlier one unread reads that one (steady: one)
            k = i - s["overlapped_rounds"] if e["event"] == "read" else i
            named.append({**e, "round": k})
    origin = named[0]["start"] if named else 0.0
    launches, reads = _spans(named, "launch"), _spans(named, "read")
    pairs = sorted(k for k in reads if k + 1 in launches)
    return {
        "rounds": len(steps),
        "events": [{"event": e["event"], "round": e["round"],
                    "start_ms": round(1000 * (e["start"] - origin), 4),
                    "end_ms": round(1000 * (e["end"] - origin), 4)} for e in named],
        "read_wait_ms": [round(1000 * s["read_wait_s"], 4) for s in steps],
        "overlapped_rounds": [s["overlapped_rounds"] for s in steps],
        "pairs": len(pairs),  # (read k, launch k+1) pairs the check looked at
        "launch_before_prev_read": bool(pairs) and all(
            launches[k + 1][0] < reads[k][0] for k in pairs),
        "read_before_next_launch": bool(pairs) and all(
            reads[k][1] <= launches[k + 1][0] for k in pairs),
    }


def trace_summary(runs: list[dict]) -> dict | None:
    """The last repeat's trace, with its read wait median, overlapped rounds per round
    and checks over every repeat's rounds. None where the mode was not traced."""
    traces = [r["trace"] for r in runs if r.get("trace") is not None]
    if not traces:
        return None
    rounds = sum(t["rounds"] for t in traces)
    return {
        **traces[-1], "repeats": len(traces),
        "read_wait_ms_median": statistics.median(w for t in traces for w in t["read_wait_ms"]),
        "overlapped_per_round": sum(sum(t["overlapped_rounds"]) for t in traces) / rounds,
        "launch_before_prev_read": all(t["launch_before_prev_read"] for t in traces),
        "read_before_next_launch": all(t["read_before_next_launch"] for t in traces),
    }
