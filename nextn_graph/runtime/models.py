"""The models a speculative engine runs: the target, the NextN draft and their KV pools."""

from __future__ import annotations

from dataclasses import dataclass

from ..memory.pool import KVPool
from ..model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN


@dataclass
class SpecModels:
    """The pools share the request-row numbering."""

    target: DeepseekV4ForCausalLM
    draft: DeepseekV4ForCausalLMNextN
    target_pool: KVPool
    draft_pool: KVPool
