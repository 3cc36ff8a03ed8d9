"""Logit processing before a token is picked, the same for greedy and sampled requests:
``logit_bias``, ``min_tokens`` (the request's stop ids held back), and the repetition,
frequency and presence penalties, as vLLM defines them.

``apply_penalties`` is the one implementation: the rounds (``runtime/penalty_tables.py``,
from device tables, at every verify row with the window's drafts counted), the prefill's
first token and the oracles (``penalize``, from host lists) all call it. Neutral values
leave a logit bitwise as it was (x + 0, x * 1, x - 0), so an engine built with penalties
gives requests without them exactly the tokens it gave before.

Order (vLLM's): the bias, then the stop ban, then the repetition penalty (a token seen in
the prompt or the output: a positive logit divided by it, a negative one multiplied),
then ``frequency * count`` and ``presence * (count > 0)`` subtracted, over the output's
tokens (the first generated token included).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .errors import InputError, show_value

MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's bound)
MAX_BAN_IDS = 64  # stop ids a request with min_tokens may hold back
PENALTY_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                "min_tokens")


def check_penalties(p, where: str) -> dict:
    """The penalty fields of a ``SamplingParams`` -> their normalised values, or an
    ``InputError`` naming the bad one. ``logit_bias``: a mapping or pairs of (token id,
    bias in [-100, 100]); ids are checked against the vocabulary by the engine."""
    out = {}
    for key in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, key)
        if not _real(v) or not -2 <= v <= 2:
            raise InputError(f"{where}: {key} must be a number in [-2, 2], got {show_value(v)}",
                             field=key)
        out[key] = float(v)
    r = p.repetition_penalty
    if not _real(r) or not 0 < r <= 100:
        raise InputError(f"{where}: repetition_penalty must be a number in (0, 100] (1 = off), "
                         f"got {show_value(r)}", field="repetition_penalty")
    out["repetition_penalty"] = float(r)
    m = p.min_tokens
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise InputError(f"{where}: min_tokens must be an integer >= 0, got {show_value(m)}",
                         field="min_tokens")
    out["min_tokens"] = m
    out["logit_bias"] = _bias(p.logit_bias, where)
    return out


def _bias(value: object, where: str) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise InputError(f"{where}: logit_bias must map token ids to biases, got "
                         f"{show_value(value)}", field="logit_bias") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InputError(f"{where}: logit_bias has {len(pairs)} entries, at most "
                         f"{MAX_LOGIT_BIAS} are taken", field="logit_bias")
    out = {}
    for k, v in pairs:
        tok = _token_id(k)
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise InputError(f"{where}: logit_bias key {show_value(k)} is not a token id",
                             field="logit_bias")
        if not _real(v) or not -100 <= v <= 100:
            raise InputError(f"{where}: logit_bias[{tok}] must be a number in [-100, 100], "
                             f"got {show_value(v)}", field="logit_bias")
        out[tok] = float(v)
    return tuple(sorted(out.items()))


def _token_id(key: object) -> object:
    """A logit_bias key: a token id, or its decimal text (a JSON object's keys are
    strings); anything else is returned as it is (and refused)."""
    if not isinstance(key, str) or not key.strip().lstrip("-").isdecimal():
        return key  # (isdecimal: "²" is a digit, not a decimal one int() reads)
    try:
        return int(key)
    except ValueError:  # past Python's 4300-digit limit for int(str)
        return key


def _real(x: object) -> bool:
    """A finite number (an int of any size is one: never converted to a float here)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                    bias_ids: torch.Tensor, bias: torch.Tensor, ban_ids: torch.Tensor,
                    ban: torch.Tensor) -> torch.Tensor:
    """logits [B, W, V] fp32 of W positions per request; counts [B, W, V] fp32: each
    output token's count before the row's position; seen [B, V] bool: the prompt's
    tokens; presence, frequency, repetition [B]; bias_ids [B, M] with bias [B, M] (padding:
    bias 0); ban_ids [B, Mb] with ban [B, W, Mb] (whether the row holds that id back)
    -> the processed logits [B, W, V]. Static shapes, no host sync."""
    b, w, _ = logits.shape
    logits = logits.scatter_add(-1, bias_ids.unsqueeze(1).expand(b, w, -1),
                                bias.unsqueeze(1).expand(b, w, -1))
    held = torch.where(ban, float("-inf"), 0.0)  # [B, W, Mb]
    logits = logits.scatter_add(-1, ban_ids.unsqueeze(1).expand(b, w, -1), held)
    present = counts > 0  # [B, W, V]
    rep = repetition.view(b, 1, 1)
    repeated = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen.unsqueeze(1) | present, repeated, logits)
    return logits - frequency.view(b, 1, 1) * counts - presence.view(b, 1, 1) * present


def penalize(logits: torch.Tensor, params: Sequence, prompts: Sequence[Sequence[int]],
             outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """The oracles' form, from host lists: logits [B, V] of each request's next token
    (after ``prompts[i] + outputs[i]``) -> processed [B, V]. ``params``: ``SamplingParams``
    (with the engine's ``ban_ids``)."""
    if not any(p.penalized for p in params):
        return logits
    b, v = logits.shape
    dev = logits.device
    counts = torch.zeros(b, v, device=dev)
    seen = torch.zeros(b, v, dtype=torch.bool, device=dev)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if out:
            counts[i].index_add_(0, torch.tensor(list(out), device=dev), torch.ones(len(out), device=dev))
        seen[i, list(prompt)] = True
    m = max(max(len(p.logit_bias) for p in params), 1)
    mb = max(max(len(p.ban_ids) for p in params), 1)
    bias_ids = torch.zeros(b, m, dtype=torch.long, device=dev)
    bias = torch.zeros(b, m, device=dev)
    ban_ids = torch.zeros(b, mb, dtype=torch.long, device=dev)
    ban = torch.zeros(b, 1, mb, dtype=torch.bool, device=dev)
    for i, p in enumerate(params):
        for j, (tok, val) in enumerate(p.logit_bias):
            bias_ids[i, j], bias[i, j] = tok, val
        for j, tok in enumerate(p.ban_ids):
            ban_ids[i, j] = tok
            ban[i, 0, j] = len(outputs[i]) < p.min_tokens
    col = [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params]
    pres, freq, rep = torch.tensor(col, device=dev).unbind(1)
    return apply_penalties(logits.float().unsqueeze(1), counts.unsqueeze(1), seen, pres, freq,
                           rep, bias_ids, bias, ban_ids, ban).squeeze(1)
