"""Sampling that a static graph can hold: per-request parameters, counter-based
uniforms, filtered distributions and inverse-CDF draws, all plain tensor ops.

No host RNG and no generator state: a uniform is a hash of (request seed, position,
draft step, stream), computed with 32-bit integer mixing on int64 tensors. So a
replay draws fresh numbers without re-capture (the positions moved on), the value
one request gets never depends on which other requests share its batch or
bucket, and the same seed gives the same numbers eagerly and on every graph
backend. The CPU emulator keeps refusing RNG ops at capture; nothing here uses one.

Shapes: B requests, W positions per request (a verify window, or 1), V vocab.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from .errors import InputError, show_value
from .labels import ACCEPT_SAMPLING
from .penalties import MAX_BAN_IDS, check_penalties

profile_label = ACCEPT_SAMPLING  # the work profile's label of this file's code (labels.py)

SEED_LIMIT = 2**63  # seeds are int64 tensors
MASK32 = 0xFFFFFFFF
# Streams keep the uses of one (seed, position, step) apart.
DRAFT, ACCEPT, RESIDUAL, TARGET = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingParams:
    """Per request. ``temperature`` 0 is greedy decoding (the default, token for token
    what the engine has always done); ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 switch
    those off. ``seed`` None draws a fresh one per request (``resolved``); the same seed
    gives the same tokens, whatever shares the batch, on every backend and across runs.

    The penalties (``penalties.py``; greedy requests too, on an engine built with
    graph.penalties): ``presence_penalty``, ``frequency_penalty`` (0: off),
    ``repetition_penalty`` (1: off), ``logit_bias`` ((token, bias) pairs or a mapping),
    ``min_tokens`` (the stop ids ``ban_ids`` are held back until that many tokens; the
    engine sets ``ban_ids`` to the request's stop ids)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ban_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes any logit (needs an engine with graph.penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1 or (self.min_tokens and self.ban_ids))

    def checked(self, where: str) -> "SamplingParams":
        """These values, or an ``InputError`` naming the bad one."""
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if not _real(t) or not (math.isfinite(t) and t >= 0):
            raise InputError(f"{where}: temperature must be a finite number >= 0 (0 = greedy), "
                             f"got {show_value(t)}", field="temperature")
        if not _real(p) or not 0 < p <= 1:
            raise InputError(f"{where}: top_p must lie in (0, 1], got {show_value(p)}",
                             field="top_p")
        if not _integer(k) or k < 0:
            raise InputError(f"{where}: top_k must be an integer >= 0 (0 = off), got "
                             f"{show_value(k)}", field="top_k")
        if s is not None and (not _integer(s) or not 0 <= s < SEED_LIMIT):
            raise InputError(f"{where}: seed must be an integer in [0, 2**63) or None, got "
                             f"{show_value(s)}", field="seed")
        m = self.min_p
        if not _real(m) or not 0 <= m <= 1:
            raise InputError(f"{where}: min_p must lie in [0, 1] (0 = off), got {show_value(m)}",
                             field="min_p")
        return dataclasses.replace(self, temperature=float(t), top_p=float(p), top_k=int(k),
                                   seed=None if s is None else int(s), min_p=float(m),
                                   **check_penalties(self, where))

    def resolved(self) -> "SamplingParams":
        """With a seed: a fresh random one where none was given (host entropy, not a
        global generator), so two unseeded requests sample independently."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(63))


def with_bans(params: SamplingParams, stop_ids: frozenset[int], where: str) -> SamplingParams:
    """The stop ids ``min_tokens`` holds back (``ban_ids``): the request's, or none."""
    if not params.min_tokens:
        return dataclasses.replace(params, ban_ids=())
    if len(stop_ids) > MAX_BAN_IDS:
        raise InputError(f"{where}: min_tokens holds back the stop ids, and this request has "
                         f"{len(stop_ids)} (at most {MAX_BAN_IDS} with min_tokens)",
                         field="min_tokens")
    return dataclasses.replace(params, ban_ids=tuple(sorted(stop_ids)))


def request_seed(run_seed: int, index: int) -> int:
    """Request ``index``'s seed under one run seed (a command's ``--seed``): distinct,
    uncorrelated seeds (SplitMix64 of the pair), so requests of one run never share the
    uniforms that one seed would give them all."""
    x = (run_seed * 0x9E3779B97F4A7C15 + index + 1) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % SEED_LIMIT


GREEDY = SamplingParams(seed=0)
KEYS = tuple(f.name for f in fields(SamplingParams) if f.name != "ban_ids")  # (the engine's)


def sampling_params(value: object, where: str) -> SamplingParams:
    """One request's sampling: None (greedy), a ``SamplingParams`` or a mapping of its
    fields -> checked and resolved (a seed drawn where none was given)."""
    if value is None:
        return GREEDY
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in KEYS]
        if unknown:
            raise InputError(f"{where}: unknown sampling key {show_value(unknown[0])} "
                             f"(known: {', '.join(KEYS)})", field="sampling")
        value = SamplingParams(**value)
    if not isinstance(value, SamplingParams):
        raise InputError(f"{where}: sampling must be a SamplingParams, a mapping of "
                         f"{', '.join(KEYS)}, or None, got {show_value(value)}",
                         field="sampling")
    return value.checked(where).resolved()


def sampling_per_prompt(value: object, n: int) -> list[SamplingParams]:
    """``generate``'s ``sampling``: one setting for every prompt, or a list of n (one per
    prompt, request i is prompt i) -> n checked and resolved parameters."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != n:
            raise InputError(f"sampling: a list needs one entry per prompt ({n}), got "
                             f"{len(value)}", field="sampling")
        return [sampling_params(v, f"request {i}") for i, v in enumerate(value)]
    return [sampling_params(value, f"request {i}") for i in range(n)]


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- counter-based uniforms ----------------------------------------------------------------

def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 tensors holding values in
    [0, 2**32): products wrap modulo 2**64, so their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, position: torch.Tensor, step: int | torch.Tensor,
            stream: int) -> torch.Tensor:
    """U[0, 1) float32, one per element of the broadcast of ``seed`` [B, 1] (int64),
    ``position`` [B, W] (int64) and ``step``: a function of (seed, position, step,
    stream) only (the top 24 bits of ``key_hash``)."""
    h = key_hash(seed, position, step, stream)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))  # 24 bits: exact in float32


def key_hash(seed: torch.Tensor, position: torch.Tensor, step: int | torch.Tensor,
             stream: int) -> torch.Tensor:
    """The 32-bit hash (int64 tensor) behind ``uniform``.

    The key packs into one 32-bit counter, ``position << 8 | step << 2 | stream``
    (position < 2**24, step < 64, stream < 4), and the value is two rounds of the mix
    over the counter XOR two words derived from the seed. Each round is a bijection of
    32-bit words, so for one seed distinct keys never share a value: no two draws of a
    request are ever tied together, whatever their positions.
    """
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    k1 = _mix32(lo ^ _mix32(hi ^ 0x3C6EF372))  # [B, 1] the seed's two words
    k2 = _mix32(k1 ^ 0x9E3779B9)
    # (an int step stays a kernel scalar: a host-made tensor would be a host->device
    # copy inside a CUDA capture)
    counter = ((position << 8) | (step << 2) | stream) & MASK32
    return _mix32(_mix32(counter ^ k1) ^ k2)


# -- distributions and draws ---------------------------------------------------------------

def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [..., V] fp32; temperature, top_k, top_p, min_p [...] per row ->
    probabilities [..., V] of the tempered distribution restricted to the tokens of at
    least min_p times the most likely one's probability and to the top-k, then to the
    smallest prefix (by probability) holding top_p of it, renormalised. Rows with
    temperature 0 get the one-hot argmax (greedy). Static shapes: a sort, no masks
    that change size."""
    v = logits.shape[-1]
    t = temperature.unsqueeze(-1)  # [..., 1]
    scaled = logits / torch.where(t > 0, t, torch.ones_like(t))
    order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = order.values.softmax(dim=-1)  # sorted, [..., V]
    rank = torch.arange(v, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).unsqueeze(-1)
    keep = rank < k
    if min_p is not None:  # (0: every token is kept, the float unchanged)
        keep = keep & (probs >= min_p.unsqueeze(-1) * probs[..., :1])
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
    keep = keep & (before < top_p.unsqueeze(-1))  # the first token is always kept
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(probs).scatter(-1, order.indices, probs)
    greedy = torch.zeros_like(out).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(t > 0, out, greedy)


@dataclass(frozen=True)
class RowParams:
    """The sampling parameters of a batch's B requests, as tensors (padding rows are
    greedy): what the phases need to draw their tokens inside a graph."""

    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_p: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64, 0 = off
    seed: torch.Tensor  # [B] int64
    min_p: torch.Tensor  # [B] fp32, 0 = off

    @staticmethod
    def of(params: Sequence[SamplingParams], device) -> "RowParams":
        """Host parameters (resolved) -> tensors on ``device``."""
        def col(name, dtype):
            return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)
        return RowParams(col("temperature", torch.float32), col("top_p", torch.float32),
                         col("top_k", torch.int64), col("seed", torch.int64),
                         col("min_p", torch.float32))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] or [B, W, V] -> each row's filtered distribution, same shape."""
        shape = logits.shape[:-1]

        def per_row(x):
            return x.view(-1, *([1] * (len(shape) - 1))).expand(shape)
        return filtered_probs(logits.float(), per_row(self.temperature), per_row(self.top_k),
                              per_row(self.top_p), per_row(self.min_p))

    def uniform(self, base: torch.Tensor, offsets: torch.Tensor | int,
                stream: int) -> torch.Tensor:
        """Uniforms keyed by (seed, round base ``base`` [B], offset, stream): [B] for an
        int offset, [B, W] for offsets [W]. A round at committed length L draws the
        token at position L + j with offset j, so no key ever repeats for a request."""
        if isinstance(offsets, int):
            return uniform(self.seed.unsqueeze(1), base.unsqueeze(1), offsets, stream)[:, 0]
        return uniform(self.seed.unsqueeze(1), base.unsqueeze(1), offsets.unsqueeze(0), stream)

    def next_token(self, p: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Plain sampling: p [B, V] of the token at position L + 1 (round base L [B])
        -> its draw [B]. The oracle, plain decoding and the prefill's first token."""
        return draw(p, self.uniform(base, 1, TARGET))


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """tokens [...] -> fp32 one-hot [..., V]: a greedy row's distribution."""
    return torch.zeros(*tokens.shape, vocab, device=tokens.device).scatter(
        -1, tokens.unsqueeze(-1), 1.0)


def accepted(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    """The rejection rule: accept a candidate with probability min(1, p(d) / q(d)), as
    u * q(d) < p(d) for u in [0, 1) (no division; q(d) > 0, d was drawn from q)."""
    return u * q_d < p_d


def speculative_accept(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       params: RowParams, base: torch.Tensor):
    """Speculative sampling of a topk-1 chain: draft_tokens [B, S] drawn from q [B, S, V];
    the target's p [B, N, V] over the window -> (accept_lens [B], tokens [B, N]).

    Candidate i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection the token is drawn from the normalised residual max(0, p_i - q_i); after a
    fully accepted chain the bonus is drawn from p_N. tokens[:a] are what the round
    commits: the accepted candidates, then the residual or bonus draw. Greedy rows
    (one-hot p and q) give exactly the greedy chain: the target's argmax predictions.
    """
    s = draft_tokens.shape[1]
    offsets = torch.arange(1, s + 1, device=draft_tokens.device)  # token positions L + j
    d = draft_tokens.unsqueeze(-1)  # [B, S, 1]
    ok = accepted(params.uniform(base, offsets, ACCEPT), p[:, :s].gather(-1, d).squeeze(-1),
                  q.gather(-1, d).squeeze(-1))  # [B, S]
    residual = (p[:, :s] - q).clamp(min=0)
    # (all zero only by rounding, where p = q and a rejection is impossible anyway)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, :s])
    fixed = draw(residual, params.uniform(base, offsets, RESIDUAL))  # [B, S]
    bonus = draw(p[:, s], params.uniform(base, s + 1, TARGET))  # [B]
    tokens = torch.cat((torch.where(ok, draft_tokens, fixed), bonus.unsqueeze(1)), dim=1)
    return 1 + ok.long().cumprod(dim=1).sum(dim=1), tokens


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [..., V] (need not be normalised), u [...] in [0, 1) -> ids
    [...] int64. Tokens of zero mass are never drawn."""
    cdf = probs.cumsum(dim=-1)
    target = u.unsqueeze(-1) * cdf[..., -1:]
    idx = (cdf <= target).sum(dim=-1)  # tokens whose cumulative mass is passed
    return idx.clamp(max=probs.shape[-1] - 1)
