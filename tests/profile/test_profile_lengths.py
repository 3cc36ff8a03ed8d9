"""The sparse kernels' bytes follow the requests' length (``profile/lengths.py``): at a
fixed ``context_len`` they do not change with the pool's ``max_context``, they grow with
the length, and without one every index list counts full."""

from __future__ import annotations

import dataclasses

import pytest

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.errors import InputError
from nextn_graph.profile import ProfileSettings, profile_round

TINY = preset_config("tiny")
SPARSE = ("nextn_graph.sparse_attn", "nextn_graph.index_scores", "nextn_graph.index_topk")


def _sparse_bytes(st: ProfileSettings) -> dict[str, int]:
    ops = profile_round(TINY, st, "tiny", top=1000)["top_ops"]
    out: dict[str, int] = {}
    for row in ops:
        if row["op"] in SPARSE:
            out[row["op"]] = out.get(row["op"], 0) + row["bytes_per_round"]
    return out


def test_sparse_bytes_follow_the_length_not_the_pool():
    st = ProfileSettings(bucket=2, max_requests=2, max_context=128, context_len=40)
    short_pool = _sparse_bytes(st)
    long_pool = _sparse_bytes(dataclasses.replace(st, max_context=512))
    assert set(short_pool) == set(SPARSE) and short_pool == long_pool
    longer = _sparse_bytes(dataclasses.replace(st, max_context=512, context_len=400))
    assert all(longer[op] > short_pool[op] for op in SPARSE)
    full = _sparse_bytes(dataclasses.replace(st, max_context=512, context_len=None))
    assert all(full[op] >= longer[op] for op in SPARSE)


def test_whole_round_bytes_barely_move_with_the_pool_at_a_fixed_length():
    st = ProfileSettings(bucket=1, max_requests=2, max_context=128, context_len=64)
    small = profile_round(TINY, st, "tiny")
    large = profile_round(TINY, dataclasses.replace(st, max_context=512), "tiny")
    assert small["config"]["context_len"] == 64
    assert large["bytes_per_round"] <= 1.1 * small["bytes_per_round"]
    ref = dataclasses.replace(st, kernels="reference")
    grows = profile_round(TINY, dataclasses.replace(ref, max_context=512), "tiny")
    assert grows["bytes_per_round"] > profile_round(TINY, ref, "tiny")["bytes_per_round"]


@pytest.mark.parametrize("length", [0, 125, 10_000])
def test_context_len_outside_the_pool_is_refused_by_name(length):
    st = ProfileSettings(max_context=128, context_len=length)
    with pytest.raises(InputError, match="context_len"):
        profile_round(TINY, st, "tiny")
