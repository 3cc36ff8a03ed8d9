"""The ``speculative:`` section: the NextN draft chain's depth and verify width."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..errors import ConfigError, show_value

log = logging.getLogger(__name__)

ALGORITHM_ALIASES = {"EAGLE": "EAGLE", "NEXTN": "EAGLE"}  # NEXTN names the same runtime
MAX_NUM_STEPS = 32  # each step is a NextN forward in the rollout graph; acceptance
# decays geometrically with depth, so deeper chains only cost


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str = "EAGLE"  # EAGLE, or its alias NEXTN
    num_steps: int = 3  # S: candidates per round; S - 1 rollout decode calls
    eagle_topk: int = 1  # only the linear chain (topk 1) is supported
    num_draft_tokens: int = 4  # verify width N; with topk 1 it must be S + 1

    @property
    def verify_width(self) -> int:
        return self.num_steps + 1


def resolve_speculative(spec: SpeculativeConfig, where: str) -> SpeculativeConfig:
    """Validate, resolve the NEXTN alias and correct ``num_draft_tokens`` for topk 1."""
    algo = str(spec.algorithm).upper()
    if algo not in ALGORITHM_ALIASES:
        raise ConfigError(
            f"{where}: key 'speculative.algorithm' is {show_value(spec.algorithm)}; this "
            f"runtime drives the NextN draft only (EAGLE, or its alias NEXTN)")
    if spec.eagle_topk != 1:
        raise ConfigError(f"{where}: key 'speculative.eagle_topk' is {spec.eagle_topk}; only "
                          f"topk 1 (a linear draft chain) is supported")
    if not 1 <= spec.num_steps <= MAX_NUM_STEPS:
        raise ConfigError(f"{where}: key 'speculative.num_steps' must lie in "
                          f"[1, {MAX_NUM_STEPS}], got {spec.num_steps}")
    width = spec.num_steps + 1
    if spec.num_draft_tokens != width:
        log.warning("%s: speculative.num_draft_tokens %d is inconsistent with topk 1 and "
                    "num_steps %d; using num_steps + 1 = %d", where, spec.num_draft_tokens,
                    spec.num_steps, width)
    return SpeculativeConfig(ALGORITHM_ALIASES[algo], spec.num_steps, 1, width)
