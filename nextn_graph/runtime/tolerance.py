"""The bf16 guarantee as a check (docs/guarantees_bf16.md)."""

from __future__ import annotations

import torch

# δ in fp32 logits: where a bf16 stream first leaves the reference, its token may trail
# the reference's choice by less (its regret). Measured (perf/sweep.py): no divergence
# at a margin above 2.17 or a regret above 1.64; δ is over twice that.
BF16_TOLERANCE = 5.0


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """Index of the first differing token; a strict prefix diverges at its end; None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


@torch.no_grad()
def reference_logits(target, prompt: list[int], ref: list[int]) -> torch.Tensor:
    """``target.reference`` teacher-forced over ``prompt + ref``: row i [V] fp32 holds the
    logits that picked ref[i]. [len(ref), V]"""
    device = target.embed.weight.device
    seq = torch.tensor(list(prompt) + list(ref[:-1]), device=device)
    return target.reference(seq).logits[len(prompt) - 1:len(prompt) - 1 + len(ref)].float()


def top2_margins(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit of every row: how near the reference was to a tie."""
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def divergence_regret(got: list[int], ref: list[int], ref_logits: torch.Tensor) -> float | None:
    """Reference logit of its token minus that of ``got``'s at the first divergence. None
    when equal; inf when one stream is a prefix of the other (same limits and stop ids,
    so that is bookkeeping, never rounding)."""
    i = first_divergence(got, ref)
    if i is None:
        return None
    if i >= min(len(got), len(ref)):
        return float("inf")
    return float(ref_logits[i, ref[i]] - ref_logits[i, got[i]])


def within_tolerance(got: list[int], ref: list[int], ref_logits: torch.Tensor,
                     delta: float = BF16_TOLERANCE) -> bool:
    """Equal to the fp32 reference, or first leaving it with a regret under ``delta``."""
    regret = divergence_regret(got, ref, ref_logits)
    return regret is None or regret < delta
