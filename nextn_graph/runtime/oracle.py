"""The draft's oracle: the candidates a round should propose, by full recompute (no
cache; past the bonus each candidate pairs with the draft's own hidden of the row before)."""

from __future__ import annotations

from typing import Sequence

import torch

from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN


@torch.no_grad()
def reference_candidates(target: DeepseekV4ForCausalLM, draft: DeepseekV4ForCausalLMNextN,
                         committed: Sequence[int], bonus: int, num_steps: int) -> list[int]:
    """committed: positions 0..L-1; bonus at L -> S candidates."""
    device = target.embed.weight.device
    hidden = target.reference(torch.tensor(list(committed), device=device)).hidden  # [L, hc*H]
    tokens = list(committed[1:]) + [bonus]  # row p: token p+1
    candidates: list[int] = []
    for _ in range(num_steps):
        out = draft.reference(torch.tensor(tokens, device=device), hidden)
        candidates.append(int(out.logits[-1].argmax()))
        tokens.append(candidates[-1])
        hidden = torch.cat((hidden, out.hidden[-1:]), dim=0)
    return candidates
