"""What one graph runs: a phase of the round or the whole fused round, greedy or
sampling (``GraphKind``), and the round's phases in order."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import GRAPH_KINDS


@dataclass(frozen=True)
class GraphKind:
    """What one graph runs: ``unit``, a phase of the round (``GRAPH_KINDS``) or the whole
    fused round (``round``), greedy or, ``sampled``, drawing each request's tokens with
    its sampling parameters. ``name`` is what records, counters, metrics and reports
    call it: ``target_verify``, ``round+sampling``."""

    unit: str
    sampled: bool = False

    @property
    def name(self) -> str:
        return f"{self.unit}+sampling" if self.sampled else self.unit

    def variant(self, sampled: bool) -> "GraphKind":
        return GraphKind(self.unit, sampled)

    def __str__(self) -> str:
        return self.name


PHASES = tuple(GraphKind(k) for k in GRAPH_KINDS)  # a round's phases, in order
FUSED_ROUND = GraphKind("round")  # the fused round: every phase as one graph
