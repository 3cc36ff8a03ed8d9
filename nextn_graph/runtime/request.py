"""A request's host-side record, the source of truth, and what a step returns for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..memory.prefix import PrefixMatch
from ..sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    """A token with its logprob under the target's raw fp32 log-softmax at its position
    (before temperature, top-p and top-k: what vLLM reports by default)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the k most likely (token, logprob), most likely first


def token_logprobs(tokens: Sequence[int], values: torch.Tensor, ids: torch.Tensor,
                   k: int) -> tuple[TokenLogprob, ...]:
    """Host rows of a round or a prefill -> one ``TokenLogprob`` per token, with its k top:
    tokens [n]; values [n, 1+K] fp32 (the token's logprob, then the top K's); ids [n, K]."""
    values, ids = values[:, :1 + k].tolist(), ids[:, :k].tolist()
    return tuple(TokenLogprob(t, v[0], tuple(zip(i, v[1:])))
                 for t, v, i in zip(tokens, values, ids))


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    sampling: SamplingParams = GREEDY  # checked and resolved (a seed chosen)
    output: list[int] = field(default_factory=list)
    row: int = 0  # pool request row once admitted (0 = not yet)
    prefilled: int = 0  # prompt positions in the pools (moves once a chunk's forward succeeded)
    copy: int = 0  # which of the row's two state copies holds the committed state
    finished: bool = False
    logprobs: int | None = None  # k: each output token's logprob and its k top (None: off)
    prompt_logprobs: int | None = None  # k: the same for the prompt's tokens (None: off)
    # the prompt's logprobs of the chunks prefilled so far (tokens 1..prefilled - 1)
    prompt_lps: list[TokenLogprob] = field(default_factory=list)
    cached: int = 0  # prompt positions a prefix-cache hit reused (whole pages)
    match: PrefixMatch | None = None  # a prefix hit, locked while the prompt is prefilled
    snaps: dict[int, int] = field(default_factory=dict)  # page boundary -> snapshot

    @property
    def samples(self) -> bool:
        """Its rounds run the sampling variants (temperature > 0)."""
        return not self.sampling.greedy

    @property
    def fill(self) -> list[int]:
        """The tokens a prefill puts in the pools: the prompt, and for a request preempted
        while decoding (recomputed), its output but the bonus too."""
        return self.prompt + self.output[:-1] if self.output else self.prompt

    @property
    def fill_len(self) -> int:
        """``len(self.fill)``, without building it."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def committed(self) -> int:
        """Committed length L: all output but the bonus has target KV."""
        return len(self.prompt) + len(self.output) - 1

    def emit(self, tokens: Iterable[int]) -> list[int]:
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
    accepted: int | None = None  # accept_len - 1, before cuts; None at prefill or failure
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per new token, if asked
    # first output only, if asked: one per prompt token, None for the first
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    cached_tokens: int | None = None  # first output only: prompt tokens from the prefix cache
