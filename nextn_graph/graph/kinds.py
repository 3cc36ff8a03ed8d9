"""What one graph runs: a ``Phase`` of the round (or the whole fused round) at a bucket,
greedy or sampling: its ``GraphKey``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..config import PHASE_NAMES


class Phase(StrEnum):
    """A captured unit of a decode round."""

    ROLLOUT = "rollout"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    ROUND = "round"  # the fused round: every split phase in order, as one graph


SPLIT_PHASES = tuple(Phase(name) for name in PHASE_NAMES)  # in round order


@dataclass(frozen=True, order=True)
class GraphKey:
    """One graph of the cache. ``sampled``: the variant that draws each request's tokens
    with its sampling parameters (greedy rows in it still take the greedy tokens)."""

    phase: Phase
    bucket: int
    sampled: bool = False

    @property
    def name(self) -> str:
        """What records, counters, metrics and reports call the graph's unit:
        ``target_verify``, ``round+sampling``."""
        return f"{self.phase}+sampling" if self.sampled else str(self.phase)

    def __str__(self) -> str:
        return f"{self.name} B={self.bucket}"
