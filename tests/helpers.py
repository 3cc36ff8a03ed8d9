"""Helpers shared by several test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import torch

from nextn_graph.graph.updates import UpdateRegistry
from nextn_graph.checkpoint.corpus import corpus

SEQLEN_NS, SEQLEN_OP = "nextn_test", "seqlen_sum"


def corpus_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Prompts from the training corpus' generator (seed 0 = the training phrases)."""
    drawn = corpus(256, seed)
    return [drawn.sample(n) for n in lengths]


def random_prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (n,), generator=gen).tolist()


def define_op(name: str, schema: str, impl):
    """``torch.ops.nextn_test.<name>``, defined once per interpreter with a CPU kernel."""
    packet = getattr(torch.ops, SEQLEN_NS)
    if not hasattr(packet, name):
        torch.library.define(f"{SEQLEN_NS}::{name}", schema)
        torch.library.impl(f"{SEQLEN_NS}::{name}", "cpu", func=impl)
    return getattr(packet, name)


def seqlen_op():
    """A custom op taking host sequence lengths: x * sum(lens), static output shape."""
    return define_op(SEQLEN_OP, "(Tensor x, int[] lens) -> Tensor",
                    lambda x, lens: x * sum(lens))


def seqlen_registry() -> UpdateRegistry:
    """Updates for ``seqlen_op``: its host list is each replay's committed lengths."""
    reg = UpdateRegistry()
    reg.register(SEQLEN_OP, [("arg", 1, "lens")], lambda ctx: {"lens": list(ctx.lengths)})
    return reg



# -- the bf16 guarantee: nextn_graph/runtime/tolerance.py ----------------------------------
from nextn_graph.runtime.tolerance import (BF16_TOLERANCE, divergence_regret,  # noqa: E402,F401
                                           first_divergence, reference_logits, top2_margins,
                                           within_tolerance)


# -- CPU stand-ins for torch_npu's updatable kernels (tests/graph/test_fake_npu.py) -------------
# Each has the overload name and, up to its length argument, the schema of the real op,
# which is all torch_npu's graph op handler table looks at (it keys on ``func.__name__``,
# any namespace): a graph records them and applies updates as it would on an NPU.

IFA_OP, PA_OP = "npu_fused_infer_attention_score", "_npu_paged_attention"


def ifa_standin():
    """Fused infer attention v1, BSH with one head: row b attends to its first
    ``actual_seq_lengths_kv[b]`` keys (a kwarg-only host list, as in torch_npu)."""
    return define_op(IFA_OP, "(Tensor query, Tensor key, Tensor value, *, Tensor? pse_shift=None, "
                    "Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, "
                    "SymInt[]? actual_seq_lengths_kv=None, int num_heads=1, float scale=1.0, "
                    "str input_layout=\"BSH\") -> (Tensor, Tensor)", _ifa_cpu)


def _ifa_cpu(query, key, value, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
             actual_seq_lengths_kv=None, num_heads=1, scale=1.0, input_layout="BSH"):
    lens = actual_seq_lengths_kv or [key.shape[1]] * key.shape[0]
    scores = query @ key.transpose(1, 2) * scale  # [B, Sq, Skv]
    masked = torch.arange(key.shape[1]) >= torch.tensor(lens)[:, None, None]
    scores = scores.masked_fill(masked, float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)  # [B, Sq, 1]
    return (scores - lse).exp() @ value, lse


def pa_standin():
    """ATB paged attention: token t attends to the first ``context_lens[t]`` cached tokens
    of its block table; ``context_lens`` a host int32 tensor at positional slot 7."""
    return define_op(PA_OP, "(Tensor query, Tensor key_cache, Tensor value_cache, "
                    "int num_kv_heads, int num_heads, float scale_value, Tensor block_table, "
                    "Tensor context_lens, Tensor(a!) out, *, Tensor? workspace=None) -> ()",
                    _pa_cpu)


def _pa_cpu(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
            block_table, context_lens, out, workspace=None):
    block = key_cache.shape[1]
    keys, values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)  # [slots, H, D]
    for t, length in enumerate(context_lens.tolist()):
        slots = (block_table[t].long()[:, None] * block + torch.arange(block)).flatten()[:length]
        scores = torch.einsum("hd,lhd->hl", query[t], keys[slots]) * scale_value
        out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values[slots])


def npu_registry() -> UpdateRegistry:
    """Rules for both stand-ins in the forms torch_npu applies: IFA's kwarg by its own
    name, paged attention's positional slot 7 under its handler's key."""
    reg = UpdateRegistry()
    reg.register(IFA_OP, [("kwarg", "actual_seq_lengths_kv", "actual_seq_lengths_kv")],
                 lambda ctx: {"actual_seq_lengths_kv": list(ctx.lengths)})
    reg.register(PA_OP, [("arg", 7, "context_lens")],
                 lambda ctx: {"context_lens": torch.tensor(ctx.lengths, dtype=torch.int32)})
    return reg


def ifa_inputs(seed: int = 0) -> list[torch.Tensor]:
    """query [2, 1, 4], key and value [2, 6, 4] for ``ifa_standin``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 1, 4, generator=gen), torch.randn(2, 6, 4, generator=gen),
            torch.randn(2, 6, 4, generator=gen)]


def pa_inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    """For ``pa_standin``: two tokens, one head, blocks of 4 (token t reads blocks
    block_table[t]); query [2, 1, 8], caches [6, 4, 1, 8], table [2, 2], out [2, 1, 8]."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 1, 8, generator=gen)
    key_cache, value_cache = torch.randn(2, 6, 4, 1, 8, generator=gen).unbind(0)
    block_table = torch.tensor([[0, 2], [5, 1]], dtype=torch.int32)
    return query, key_cache, value_cache, block_table, torch.zeros(2, 1, 8)
