"""Counters of one speculative run; derived figures are computed, never stored."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..counters import Counters


@dataclass
class SpecStats(Counters):
    KEEP = ("verify_width",)

    rounds: int = 0  # decode rounds (each: rollout, verify, accept, draft extend)
    request_rounds: int = 0  # sum over rounds of the requests in it
    prefill_forwards: int = 0  # target forwards over prompts (one a step, all its chunks)
    verify_forwards: int = 0  # target forwards over B*N verify windows
    nextn_extend_forwards: int = 0  # draft extend, for prefill and for decode
    nextn_decode_forwards: int = 0  # rollout decode calls (S - 1 per round)
    proposed_drafts: int = 0  # candidates proposed, S per request per round
    accepted_drafts: int = 0  # candidates the target confirmed (accept_lens - 1)
    emitted_tokens: int = 0  # tokens returned to callers (after stop / length cuts)
    prompt_tokens: int = 0  # of the prompts whose prefill finished
    cached_tokens: int = 0  # of those, reused from the prefix cache (not prefilled)
    preemptions: int = 0  # running requests sent back to wait when pages ran out
    recomputed_tokens: int = 0  # positions preempted requests prefilled again
    prefill_chunks: int = 0  # request chunks prefilled (a prompt prefilled whole is one)
    faults: int = 0  # units of work (a prefill, a round chunk) that raised
    failed_requests: int = 0  # requests those faults failed
    verify_width: int = 0  # N of the runs counted here
    prefill_s: float = 0.0  # host wall time in prefill + draft extend for prefill
    round_s: float = 0.0  # host wall time in decode rounds (ends with the round's sync)

    @property
    def target_forwards(self) -> int:
        return self.prefill_forwards + self.verify_forwards

    @property
    def acceptance_length(self) -> float:
        """Tokens per request-round including the bonus: mean accept_lens."""
        return (self.accepted_drafts + self.request_rounds) / max(self.request_rounds, 1)

    @property
    def draft_acceptance_rate(self) -> float:
        """Strict: accepted drafts over proposed drafts, over the same rounds."""
        return self.accepted_drafts / max(self.proposed_drafts, 1)

    @property
    def round_ms(self) -> float:
        return 1000 * self.round_s / max(self.rounds, 1)

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(prefill_s=round(self.prefill_s, 4), round_s=round(self.round_s, 4),
                   round_ms=round(self.round_ms, 3), target_forwards=self.target_forwards,
                   acceptance_length=round(self.acceptance_length, 4),
                   draft_acceptance_rate=round(self.draft_acceptance_rate, 4))
        return out
