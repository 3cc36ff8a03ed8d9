"""Plain cached decoding equals the no-cache oracle token for token; prompt validation.

The tiny preset has a sliding window of 16, C4 blocks of 4 positions and C128
blocks of 128, so the prompt lengths below put prefill and decode on both sides
of each boundary.
"""

from __future__ import annotations

import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.cli.commands import make_checkpoint
from nextn_graph.errors import CapacityError, InputError
from nextn_graph.runtime.generate import plain_generate, reference_generate
from nextn_graph.runtime.request_checks import RequestLimits, validate_prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = make_checkpoint("tiny", tmp_path_factory.mktemp("gen_ckpt"), seed=0)
    return load_checkpoint(root).target


def _prompt(n: int, seed: int) -> list[int]:
    """n random ids avoiding bos (0) and eos (1)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (n,), generator=gen).tolist()


def _both(target, prompts, max_new, **kw):
    ref = reference_generate(target, prompts, max_new, **kw)
    plain = plain_generate(target, prompts, max_new, **kw)
    return ref, plain


def test_single_request_matches_reference(target):
    """One request: plain decoding emits exactly the oracle's tokens."""
    ref, plain = _both(target, [_prompt(7, 0)], 10, stop_ids=set())
    assert len(ref.outputs[0]) == 10
    assert plain.outputs == ref.outputs
    assert ref.stats["target_forwards"] == 10  # one full recompute per token
    assert plain.stats["target_forwards"] == 10  # one prefill + 9 decode steps
    assert plain.stats["generated_tokens"] == 10 and plain.stats["mode"] == "plain"


def test_batch_of_mixed_lengths_matches_reference(target):
    """Batched requests of different lengths crossing window 16 and C4 boundaries match."""
    # 3 -> decode crosses C4 at 4 and 8; 14 -> decode crosses the window at 16;
    # 17 and 30 -> prefill already past the window and several C4 blocks.
    prompts = [_prompt(n, seed) for seed, n in enumerate([3, 14, 17, 30])]
    ref, plain = _both(target, prompts, 8, stop_ids=set())
    assert [len(o) for o in ref.outputs] == [8] * 4
    assert plain.outputs == ref.outputs
    assert plain.stats["requests"] == 4
    assert plain.stats["prompt_tokens"] == 3 + 14 + 17 + 30
    assert plain.stats["target_forwards"] == 8  # all requests share each step


def test_decode_crosses_first_c128_block(target):
    """A 125-token prompt decoded past position 128 (first C128 block finishes) matches."""
    prompts = [_prompt(125, 7)]
    ref, plain = _both(target, prompts, 6, stop_ids=set())
    assert len(prompts[0]) + len(ref.outputs[0]) > 128
    assert plain.outputs == ref.outputs


STOP_PROMPTS = [(5, 25), (19, 39), (33, 53)]  # (length, seed)


def _cut(out: list[int], stops: set[int]) -> list[int]:
    """The output a request should have: everything up to and including its first stop id."""
    hit = next((i for i, t in enumerate(out) if t in stops), None)
    return out if hit is None else out[: hit + 1]


def test_stop_token_ends_request_right_after_it(target):
    """A stop id ends a request right after emitting it; other requests run on, in both modes."""
    prompts = [_prompt(n, seed) for n, seed in STOP_PROMPTS]
    free = reference_generate(target, prompts, 10, stop_ids=set()).outputs
    # t = a token request 0 emits for the first time at a middle step k
    k = next(i for i in range(2, 8) if free[0][i] not in free[0][:i])
    t = free[0][k]
    want = [_cut(o, {t}) for o in free]
    assert want[0] == free[0][: k + 1] and len(want[0]) < 10
    assert any(len(w) == 10 for w in want), "some request must run on past the stop"
    ref, plain = _both(target, prompts, 10, stop_ids={t})
    assert ref.outputs == want
    assert plain.outputs == want
    assert plain.stats["generated_tokens"] == sum(len(w) for w in want)


def test_default_stop_is_eos(target):
    """With stop_ids=None both modes stop a request right after it emits eos."""
    eos = target.cfg.eos_token_id
    prompts = [_prompt(n, seed) for n, seed in STOP_PROMPTS]
    free = reference_generate(target, prompts, 10, stop_ids=set()).outputs
    want = [_cut(o, {eos}) for o in free]
    assert any(len(w) < 10 for w in want), f"no request emits eos {eos} in 10 steps: {free}"
    ref, plain = _both(target, prompts, 10)
    assert ref.outputs == want
    assert plain.outputs == want


@pytest.mark.parametrize("prompts, max_new, needle", [
    ([[5, 6], []], 4, "request 1: empty prompt"),
    ([[5, 256, 7]], 4, "token id 256"),
    ([[5, -1]], 4, "token id -1"),
    ([[5, 6]], 0, "max_new_tokens must be at least 1"),
    ([list(range(2, 30))], 5, "exceeds the maximum context 32"),
])
def test_validate_prompts_errors(target, prompts, max_new, needle):
    """Bad prompts raise InputError naming the request and the bad value, in every entry point."""
    with pytest.raises(InputError) as info:
        validate_prompts(prompts, RequestLimits.of(target.cfg, 32), max_new)
    assert needle in str(info.value)
    for fn in (reference_generate, plain_generate):
        with pytest.raises(InputError) as info:
            fn(target, prompts, max_new, max_context=32)
        assert needle in str(info.value)


def test_validate_prompts_accepts_exact_fit(target):
    """A prompt that fills the context exactly with its new tokens is accepted unchanged."""
    prompt = list(range(2, 30))  # 28 tokens + 4 new = 32
    assert validate_prompts([tuple(prompt)], RequestLimits.of(target.cfg, 32), 4) == [prompt]


def test_reference_past_max_position_is_named_error(target):
    """--mode reference with a max_context past max_position_embeddings once ran into an
    IndexError in the RoPE table: the model's limit is checked up front, with figures;
    an exact fit is accepted. Plain mode refuses the oversized context by name too."""
    limit = target.cfg.max_position_embeddings
    with pytest.raises(InputError) as info:
        reference_generate(target, [[5, 6], [7] * (limit - 4)], 5,
                           max_context=2 * limit)
    assert str(info.value) == (f"request 1: prompt of {limit - 4} tokens + max_new_tokens 5 "
                               f"exceeds the model's max_position_embeddings {limit}")
    limits = RequestLimits.of(target.cfg, 2 * limit)
    assert validate_prompts([[7] * (limit - 5)], limits, 5) == [[7] * (limit - 5)]
    with pytest.raises(CapacityError, match=f"max_context {2 * limit} exceeds the model's "
                                            f"max_position_embeddings {limit}"):
        plain_generate(target, [[5, 6]], 2, max_context=2 * limit)


def test_plain_generate_of_no_prompts_is_empty(target):
    """No prompts: nothing to decode and no pool of zero requests (once a torch error)."""
    assert plain_generate(target, [], 4).outputs == []
    assert reference_generate(target, [], 4).outputs == []
