"""One decode round over the static buffers: its phases as closures of a bucket size.

What a round is belongs here, with the state and buffers it reads and writes; the
graph layer (``graph.runner``) only captures and replays what ``kinds`` and ``run``
give it, one graph per kind and bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FUSED_KIND, GRAPH_KINDS
from . import phases
from .buffers import RequestState, RoundBuffers
from .phases import SpecModels


@dataclass(frozen=True)
class RoundPhases:
    """The decode phases of one bucket B, as closures over static tensors.

    ``num_steps`` 0 is plain decoding: the verify window is the bonus alone and
    the verify phase commits it; there is no draft. ``fused``: the round is one
    phase, ``round`` (every phase in order, then the staged slots flip to the copies
    the round wrote), so it is one graph and a steady batch needs no staging.
    """

    m: SpecModels
    state: RequestState
    bufs: RoundBuffers
    num_steps: int
    fused: bool = False

    @property
    def verify_width(self) -> int:
        """N, the verify window: the buffers' (allocated for ``num_steps``)."""
        return self.bufs.preds.shape[1]

    @property
    def phase_kinds(self) -> tuple[str, ...]:
        """The phases of a round, in order (no rollout below 2 steps, no draft at 0)."""
        return tuple(k for k in GRAPH_KINDS if k != "rollout" or self.num_steps > 1
                     if k != "draft_extend" or self.num_steps > 0)

    @property
    def kinds(self) -> tuple[str, ...]:
        """What the runner runs (and captures) per round: the phases, or the one round."""
        return (FUSED_KIND,) if self.fused else self.phase_kinds

    def run(self, kind: str, b: int) -> None:
        {"rollout": self.rollout, "target_verify": self.verify,
         "draft_extend": self.draft_extend, FUSED_KIND: self.round}[kind](b)

    def round(self, b: int) -> None:
        """The whole round, then the staged slots flip to the copies it wrote: the next
        round of the same requests reads them without a staging copy."""
        for kind in self.phase_kinds:
            self.run(kind, b)
        slots = self.bufs.slots[:b]
        slots.copy_(self.state.other(slots))

    def static_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"bufs.{k}": v for k, v in vars(self.bufs).items()}
        out.update({f"state.{k}": v for k, v in vars(self.state).items()})
        return out

    def _staged(self, b: int):
        """(slots [B], pool rows [B]) of the bucket's requests."""
        slots = self.bufs.slots[:b]
        return slots, self.state.row_of(slots)

    def rollout(self, b: int) -> None:
        """-> bufs.draft_tokens[:B]: candidate 1 and S - 1 NextN decode calls."""
        slots, rows = self._staged(b)
        lengths, _, cand1, seed = self.state.gather(slots)
        self.bufs.draft_tokens[:b].copy_(
            phases.rollout(self.m, rows, lengths, cand1, seed, self.num_steps))

    def verify(self, b: int) -> None:
        """-> bufs.preds[:B], bufs.hidden[:B*N]: one target forward over [bonus, d1..dS]."""
        slots, rows = self._staged(b)
        lengths, bonus, cand1, _ = self.state.gather(slots)
        if self.num_steps == 1:  # no rollout: the window is [bonus, candidate 1]
            self.bufs.draft_tokens[:b].copy_(cand1.unsqueeze(1))
        preds, hidden = phases.verify(self.m, rows, lengths, bonus, self.bufs.draft_tokens[:b])
        self.bufs.preds[:b].copy_(preds)
        if self.num_steps == 0:  # plain decoding: the next state is the one new token
            self.bufs.accept_lens[:b].fill_(1)
            nxt = self.state.other(slots)
            self.state.lengths.index_put_((nxt,), lengths + 1)
            self.state.bonus.index_put_((nxt,), preds[:, 0])
        else:  # the draft extend pairs each window row with its hidden
            self.bufs.hidden[: b * self.verify_width].copy_(hidden)

    def draft_extend(self, b: int) -> None:
        """Accept, draft extend with ``select_index``; the next state goes to the other copy."""
        slots, rows = self._staged(b)
        n = self.verify_width
        lengths = self.state.gather(slots)[0]
        preds = self.bufs.preds[:b]
        accept_lens, bonus = phases.accept(self.bufs.draft_tokens[:b], preds)
        cand1, seed = phases.draft_extend(self.m, rows, lengths, preds,
                                          self.bufs.hidden[: b * n], accept_lens)
        self.bufs.accept_lens[:b].copy_(accept_lens)
        # Commit by length, into the copy the host flips to once the readback succeeded.
        self.state.store(self.state.other(slots), lengths + accept_lens, bonus, cand1, seed)
