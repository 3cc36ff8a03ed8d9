"""The ``scheduler:`` section: how prompt prefill shares a step with running rounds."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, show_value

MAX_PREFILL_TOKEN_BUDGET = 2 ** 31  # one forward's rows; larger is a typo, not a budget


@dataclass(frozen=True)
class SchedulerConfig:
    # Prompt tokens prefilled per step, over every request being prefilled (first come,
    # first served). A prompt longer than what is left of it is prefilled in chunks
    # over several steps, holding its pool row, while running requests get a round
    # every step: a long prompt no longer stalls them for its whole prefill. A step
    # costs about one round plus this many prompt tokens. 0 = unlimited: every
    # admitted prompt is prefilled whole in the step it is admitted.
    prefill_token_budget: int = 0


def check_scheduler(sched: SchedulerConfig, where: str) -> None:
    budget = sched.prefill_token_budget
    if not 0 <= budget <= MAX_PREFILL_TOKEN_BUDGET:
        raise ConfigError(f"{where}: key 'scheduler.prefill_token_budget' must lie in "
                          f"[0, {MAX_PREFILL_TOKEN_BUDGET}] prompt tokens per step "
                          f"(0 = unlimited), got {show_value(budget)}")
