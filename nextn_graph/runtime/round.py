"""One decode round over the static buffers: its phases as functions of a bucket size,
which the graph cache captures and replays as ``run(key)``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..graph.kinds import SPLIT_PHASES, GraphKey, Phase
from . import eagle
from .buffers import RequestState, RoundBuffers, SamplingTables
from .models import SpecModels
from .penalty_tables import PenaltyTables
from ..sampling import RowParams, one_hot, speculative_accept
from ..labels import BOOKKEEPING

profile_label = BOOKKEEPING  # the work profile's label of this file's code (labels.py)


@dataclass(frozen=True)
class DecodeRound:
    """``num_steps`` 0 is plain decoding: the window is the bonus alone, no draft.
    ``fused``: one unit, ``Phase.ROUND``, so a steady batch is one graph and needs no
    staging. ``sampling``: each unit also has a sampling variant (``GraphKey.sampled``)."""

    m: SpecModels
    state: RequestState
    bufs: RoundBuffers
    num_steps: int
    fused: bool = False
    sampling: SamplingTables | None = None
    penalties: PenaltyTables | None = None  # graph.penalties: applied at every verify row

    def __post_init__(self) -> None:
        self.phases, self.units  # noqa: B018  (computed here, not inside a traced round)

    @property
    def verify_width(self) -> int:
        return self.bufs.preds.shape[1]

    @cached_property
    def phases(self) -> tuple[Phase, ...]:
        """The split phases of a round, in order (no rollout below 2 steps, no draft at 0)."""
        return tuple(p for p in SPLIT_PHASES if p != Phase.ROLLOUT or self.num_steps > 1
                     if p != Phase.DRAFT_EXTEND or self.num_steps > 0)

    @cached_property
    def units(self) -> tuple[Phase, ...]:
        return (Phase.ROUND,) if self.fused else self.phases

    def run(self, key: GraphKey) -> None:
        self._unit(key.phase)(key.bucket, key.sampled)

    def _unit(self, phase: Phase):
        return {Phase.ROLLOUT: self.rollout, Phase.TARGET_VERIFY: self.verify,
                Phase.DRAFT_EXTEND: self.draft_extend, Phase.ROUND: self.round}[phase]

    def round(self, b: int, sampled: bool = False) -> None:
        """Every phase, then the staged slots flip to the copies it wrote."""
        for phase in self.phases:
            self._unit(phase)(b, sampled)
        slots = self.bufs.slots[:b]
        slots.copy_(self.state.map.other(slots))

    def static_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"bufs.{k}": v for k, v in vars(self.bufs).items()}
        out.update({f"state.{k}": v for k, v in self.state.tensors().items()})
        for name in ("sampling", "penalties"):
            tables = getattr(self, name)
            if tables is not None:
                out.update({f"{name}.{k}": v for k, v in vars(tables).items()})
        return out

    def _staged(self, b: int):
        slots = self.bufs.slots[:b]
        return slots, self.state.map.rows_of(slots)

    def _params(self, rows: torch.Tensor, sampled: bool) -> RowParams | None:
        return self.sampling.gather(rows) if sampled else None

    def rollout(self, b: int, sampled: bool = False) -> None:
        """-> bufs.draft_tokens[:B] (and, sampling, q of candidates 2..S)."""
        slots, rows = self._staged(b)
        lengths, _, cand1, seed = self.state.gather(slots)
        tokens, q = eagle.rollout(self.m, rows, lengths, cand1, seed, self.num_steps,
                                   self._params(rows, sampled))
        self.bufs.draft_tokens[:b].copy_(tokens)
        if q is not None:
            self.sampling.q[:b, 1:].copy_(q)

    def verify(self, b: int, sampled: bool = False) -> None:
        """-> bufs.accept_lens, bufs.preds (the round commits ``preds[:a]``),
        bufs.hidden[:B*N]; plain decoding (no draft) writes the next state here."""
        slots, rows = self._staged(b)
        lengths, bonus, cand1, _ = self.state.gather(slots)
        if self.num_steps == 1:  # no rollout: the window is [bonus, candidate 1]
            self.bufs.draft_tokens[:b].copy_(cand1.unsqueeze(1))
        params = self._params(rows, sampled)
        drafts = self.bufs.draft_tokens[:b]
        pen, process = self.penalties, None
        if pen is not None:  # the last round's tokens counted first
            pen.catch_up(rows, slots, lengths)
            process = lambda x: pen.logits(x, rows, lengths, drafts[:, :x.shape[1] - 1])  # noqa: E731
        out, hidden, logits = eagle.verify(self.m, rows, lengths, bonus, drafts, params,
                                           process)
        if self.num_steps == 0:  # plain decoding: the next state is the one new token
            token = out[:, 0] if params is None else params.next_token(out[:, 0], lengths)
            self.bufs.accept_lens[:b].fill_(1)
            self.bufs.preds[:b, 0].copy_(token)
            self._logprobs(b, logits, token.unsqueeze(1))
            nxt = self.state.map.other(slots)
            if pen is not None:
                pen.stage(nxt, token.unsqueeze(1), self.bufs.accept_lens[:b])
            self.state.lengths.index_put_((nxt,), lengths + 1)
            self.state.bonus.index_put_((nxt,), token)
            return
        if params is None:  # greedy: the target's predictions, a leading-match chain
            tokens, accept_lens = out, eagle.accept(drafts, out)
        else:  # rejection sampling against the q each candidate was drawn from
            q = self.sampling.q[:b]
            # greedy rows never stored q of candidate 1: it is the one-hot of it
            q[:, 0].copy_(torch.where((params.temperature > 0).unsqueeze(1),
                                      self.sampling.q1[slots], one_hot(cand1, q.shape[-1])))
            accept_lens, tokens = speculative_accept(drafts, q, out, params, lengths)
        self.bufs.preds[:b].copy_(tokens)
        self.bufs.accept_lens[:b].copy_(accept_lens)
        self._logprobs(b, logits, tokens)
        if pen is not None:
            pen.stage(self.state.map.other(slots), tokens, accept_lens)
        self.bufs.hidden[: b * self.verify_width].copy_(hidden)  # for the draft extend

    def _logprobs(self, b: int, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """logits [B, N, V], tokens [B, N] -> the readout's logprob columns (rows past the
        accepted length are dropped by the host)."""
        k = self.bufs.top_logprobs
        if k:
            values, ids = eagle.token_logprobs(logits, tokens, k)
            self.bufs.logprobs[:b].copy_(values)
            self.bufs.top_ids[:b].copy_(ids)

    def draft_extend(self, b: int, sampled: bool = False) -> None:
        """The next state goes to the other copy (``runtime/slots.py``)."""
        slots, rows = self._staged(b)
        n = self.verify_width
        lengths = self.state.gather(slots)[0]
        preds, accept_lens = self.bufs.preds[:b], self.bufs.accept_lens[:b]
        bonus = preds.gather(1, (accept_lens - 1).unsqueeze(1)).squeeze(1)  # [B]
        cand1, seed, q1 = eagle.draft_extend(self.m, rows, lengths, preds,
                                              self.bufs.hidden[: b * n], accept_lens,
                                              self._params(rows, sampled))
        # commit by length
        nxt = self.state.map.other(slots)
        self.state.store(nxt, lengths + accept_lens, bonus, cand1, seed)
        if q1 is not None:
            self.sampling.q1.index_put_((nxt,), q1)
