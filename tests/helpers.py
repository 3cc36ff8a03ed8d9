"""Helpers shared by several test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

from nextn_graph.graph.updates import UpdateRegistry
from nextn_graph.train import Corpus, TrainSettings

SEQLEN_NS, SEQLEN_OP = "nextn_test", "seqlen_sum"


def corpus_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Prompts from the training corpus' generator (seed 0 = the training phrases)."""
    corpus = Corpus(256, TrainSettings().phrases, torch.Generator().manual_seed(seed))
    return [corpus.sample(n) for n in lengths]


def random_prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (n,), generator=gen).tolist()


def seqlen_op():
    """A custom op taking host sequence lengths: x * sum(lens), static output shape."""
    packet = getattr(torch.ops, SEQLEN_NS)
    if not hasattr(packet, SEQLEN_OP):  # defined once per interpreter
        torch.library.define(f"{SEQLEN_NS}::{SEQLEN_OP}", "(Tensor x, int[] lens) -> Tensor")
        torch.library.impl(f"{SEQLEN_NS}::{SEQLEN_OP}", "cpu",
                           func=lambda x, lens: x * sum(lens))
    return getattr(packet, SEQLEN_OP)


def seqlen_registry() -> UpdateRegistry:
    """Updates for ``seqlen_op``: its host list is each replay's committed lengths."""
    reg = UpdateRegistry()
    reg.register(SEQLEN_OP, [("arg", 1, "lens")], lambda ctx: {"lens": list(ctx.lengths)})
    return reg
