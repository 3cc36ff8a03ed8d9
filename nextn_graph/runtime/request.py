"""A request's host-side record, and what a step returns for it.

The host's record is the source of truth: ``output`` holds every committed token,
so the committed length and the bonus token follow from it; the device state of
the request lives in its pool row's committed copy (``copy``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from ..sampling import GREEDY, SamplingParams


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    sampling: SamplingParams = GREEDY  # checked and resolved (a seed chosen)
    output: list[int] = field(default_factory=list)
    row: int = 0  # pool request row once admitted (0 = not yet)
    # prompt positions whose KV the pools hold: grows chunk by chunk while the request
    # is prefilled (only after a chunk's forward succeeded), the prompt's length after
    prefilled: int = 0
    copy: int = 0  # which of the row's two state copies holds the committed state
    finished: bool = False

    @property
    def committed(self) -> int:
        """Committed length L: all output but the bonus has target KV."""
        return len(self.prompt) + len(self.output) - 1

    def emit(self, tokens: Iterable[int]) -> list[int]:
        """Append tokens up to a stop token or max_new_tokens; return what was kept."""
        kept = []
        for tok in tokens:
            kept.append(tok)
            if tok in self.stop_ids or len(self.output) + len(kept) >= self.max_new_tokens:
                self.finished = True
                break
        self.output.extend(kept)
        return kept


@dataclass(frozen=True)
class StepOutput:
    rid: int
    new_tokens: list[int]  # committed this step, after stop / length cuts
    finished: bool
    draft_tokens: list[int]  # the candidates proposed this round (empty at prefill)
    error: str | None = None  # set when a fault failed the request (finished too)
    # drafts the target confirmed in this round (accept_len - 1, before stop and length
    # cuts); None for a prefill's output or a failure
    accepted: int | None = None
