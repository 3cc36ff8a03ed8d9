"""What one graph runs: its ``GraphKey``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..config import PHASE_NAMES


class Phase(StrEnum):
    ROLLOUT = "rollout"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    ROUND = "round"  # the fused round: every split phase in order, as one graph


SPLIT_PHASES = tuple(Phase(name) for name in PHASE_NAMES)  # in round order


@dataclass(frozen=True, order=True)
class GraphKey:
    """``sampled``: the sampling variant (greedy rows in it take the greedy tokens)."""

    phase: Phase
    bucket: int
    sampled: bool = False

    @property
    def name(self) -> str:
        """What records, metrics and reports show: ``target_verify``, ``round+sampling``."""
        return f"{self.phase}+sampling" if self.sampled else str(self.phase)

    def __str__(self) -> str:  # what logs and compiled graphs' labels say: round_B4
        return f"{self.name}_B{self.bucket}"
