"""Tensor and expert parallelism of the model and the loader (gloo ranks on CPU).

A model on tp ranks is the tp = 1 model split (``checkpoint/sharding.py``): its cached
forward, its ``reference`` and its draft give tp = 1's logits up to the fp32 order of
the reductions, on every rank alike. A rank loads its own slices of a tp = 1
checkpoint and reads nothing else. Each spawn costs seconds, so one spawn per group
size runs every check and returns what the tests assert (numpy arrays: a tensor would
be shared through a file descriptor of a rank that has exited).
"""

from __future__ import annotations

import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint, random_models, save_checkpoint
from nextn_graph.errors import CheckpointError, ConfigError
from nextn_graph.checkpoint.loader import build_models
from nextn_graph.memory.batch import Chunk, ForwardBatch
from nextn_graph.memory.pool import PoolLayout
from nextn_graph.model.config import config_from_dict
from nextn_graph.parallel.group import TPGroup
from nextn_graph.launch.ranks import spawn
from nextn_graph.checkpoint.sharding import SHARDING_TABLE, expert_of, sharded_bytes
from nextn_graph.checkpoint.presets import TINY
from nextn_graph.checkpoint.weights import scan

TIMEOUT_S = 120.0
PROMPT, DECODE = 140, 3  # the prompt crosses the window, C4 top-k and a C128 block
# tiny widths that divide by 4: heads 8, o_groups 4, index heads 4, experts 8
TP4 = {**TINY, "num_attention_heads": 8, "o_groups": 4, "index_n_heads": 4,
       "n_routed_experts": 8}
# widths whose split dims are whole 128-blocks at tp = 2 (wq_b 4x64, wo_a/wo_b 2x128,
# the indexer's wq_b 2x128), so an FP8 checkpoint splits at tp = 2
WIDE = {**TINY, "head_dim": 64, "o_lora_rank": 128, "index_head_dim": 128}


def _cfg(raw: dict):
    return config_from_dict(dict(raw), "test")


def _outputs(models) -> dict:
    """Target: a prefill through a pool then single-row decodes, and ``reference``;
    draft: one cached forward and ``reference`` on the target's hidden. Logits [T, V]."""
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(2, models.cfg.vocab_size, (PROMPT + DECODE,), generator=gen)
    target, draft = models.target, models.draft
    with torch.no_grad():
        ref = target.reference(seq)
        pool = target.new_pool(PoolLayout(2, PROMPT + DECODE, 4))
        row = pool.alloc()
        cached = [target(ForwardBatch.from_chunks([Chunk(row, 0, seq[:PROMPT].tolist())]),
                         pool).logits]
        for p in range(PROMPT, PROMPT + DECODE):
            cached.append(target(ForwardBatch.from_chunks([Chunk(row, p, [int(seq[p])])]),
                                 pool).logits)
        dpool = draft.new_pool(PoolLayout(2, PROMPT + DECODE, 4))
        batch = ForwardBatch.from_chunks([Chunk(dpool.alloc(), 0, seq.tolist())])
        out = {"target_ref": ref.logits, "target_cached": torch.cat(cached),
               "draft_ref": draft.reference(seq, ref.hidden).logits,
               "draft_cached": draft(batch, ref.hidden, pool=dpool).logits}
    return {k: v.numpy() for k, v in out.items()}


def _rank(group: TPGroup, raw: dict, ckpt=None, fp8=None) -> dict:
    """Every check of one rank: random_models' outputs and bytes; with ``ckpt`` the same
    model loaded from a tp = 1 checkpoint; with ``fp8`` a quantized load's outputs."""
    torch.set_num_threads(1)
    models = random_models(_cfg(raw), 0, tp=group)
    out = {"random": _outputs(models), "bytes": sharded_bytes(models),
           "experts": sorted({expert_of(k) for k in models.target.state_dict()} - {None})}
    if ckpt is not None:
        loaded = load_checkpoint(ckpt, tp=group)
        out["loaded"], out["bytes_read"] = _outputs(loaded), loaded.bytes_read
        infos = scan(ckpt)  # what this rank's slices weigh in the checkpoint's dtypes
        out["own_bytes"] = sum(t.numel() * infos[k].dtype.itemsize for owner in
                               (loaded.target, loaded.draft)
                               for k, t in owner.state_dict().items())
    if fp8 is not None:
        out["fp8"] = _outputs(load_checkpoint(fp8, tp=group))
        out["fp8_dequantized"] = _outputs(load_checkpoint(fp8, weights="dequantized", tp=group))
    return out


def _assert_like_tp1(got: dict, want: dict, what: str) -> None:
    for name, w in want.items():
        g, w = torch.from_numpy(got[name]), torch.from_numpy(w)
        assert g.shape == w.shape, (what, name)
        scale = max(1.0, float(w.abs().max()))
        torch.testing.assert_close(g, w, atol=1e-4 * scale, rtol=0,
                                   msg=lambda m: f"{what} {name}: {m}")
        assert torch.equal(g.argmax(-1), w.argmax(-1)), (what, name)


def _assert_ranks_agree(results: list[dict], key: str) -> None:
    for r, res in enumerate(results[1:], start=1):
        for name, value in results[0][key].items():
            assert (res[key][name] == value).all(), f"rank {r} {key} {name} differs"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """tp = 1 references, and the tp = 2 ranks' results on tiny, loaded and quantized."""
    root = tmp_path_factory.mktemp("tp")
    tiny = random_models(_cfg(TINY), 0)
    ckpt = save_checkpoint(tiny, root / "tiny", max_shard_bytes=200_000)
    fp8 = save_checkpoint(random_models(_cfg(WIDE), 0), root / "wide-fp8", quantize="fp8")
    results = spawn(_rank, 2, (TINY, ckpt, fp8), timeout_s=TIMEOUT_S)
    return {"tp1": _outputs(tiny), "tp1_bytes": sharded_bytes(tiny), "ckpt": ckpt,
            "fp8_tp1": _outputs(load_checkpoint(fp8)), "ranks": results}


@pytest.mark.process
def test_tp2_logits_equal_tp1(tp2):
    """Cached forward, reference and draft at tp = 2 equal tp = 1 (fp32 reduction order),
    argmax identical, and every rank holds the same logits."""
    for r, res in enumerate(tp2["ranks"]):
        _assert_like_tp1(res["random"], tp2["tp1"], f"tp=2 rank {r}")
    _assert_ranks_agree(tp2["ranks"], "random")


@pytest.mark.process
def test_tp4_logits_equal_tp1():
    want = _outputs(random_models(_cfg(TP4), 0))
    results = spawn(_rank, 4, (TP4,), timeout_s=TIMEOUT_S)
    for r, res in enumerate(results):
        _assert_like_tp1(res["random"], want, f"tp=4 rank {r}")
        assert res["experts"] == [2 * r, 2 * r + 1]  # 8 experts, two a rank
    _assert_ranks_agree(results, "random")


@pytest.mark.process
def test_loaded_tp2_equals_random_tp2_and_reads_only_its_slices(tp2):
    """A tp = 1 checkpoint loaded at tp = 2 gives random_models(tp = 2)'s logits exactly;
    a rank reads exactly the bytes of its own slices (no other rank's experts), less
    than the checkpoint holds."""
    total = sum(p.stat().st_size for p in tp2["ckpt"].glob("*.safetensors"))
    for r, res in enumerate(tp2["ranks"]):
        for name, value in res["random"].items():
            assert (res["loaded"][name] == value).all(), f"rank {r} {name}"
        assert res["experts"] == [2 * r, 2 * r + 1]
        assert res["bytes_read"] == res["own_bytes"] < 0.75 * total


@pytest.mark.process
def test_split_bytes_halve_at_tp2(tp2):
    one = tp2["tp1_bytes"]
    for res in tp2["ranks"]:
        assert 2 * res["bytes"]["split"] == one["split"] > 0
        assert res["bytes"]["replicated"] == one["replicated"] > 0
        assert res["bytes"]["total"] == res["bytes"]["split"] + res["bytes"]["replicated"]


@pytest.mark.process
def test_fp8_checkpoint_loads_at_tp2(tp2):
    """FP8 linears split at whole 128-blocks (FP4 experts whole): the tp = 2 load, kept
    quantized or dequantized as read, equals the tp = 1 quantized load."""
    for r, res in enumerate(tp2["ranks"]):
        _assert_like_tp1(res["fp8"], tp2["fp8_tp1"], f"fp8 tp=2 rank {r}")
        _assert_like_tp1(res["fp8_dequantized"], tp2["fp8_tp1"], f"dequantized tp=2 rank {r}")


def _stand_in(rank: int, size: int) -> TPGroup:
    """A rank of a group whose collectives these checks never reach (build, headers)."""
    return TPGroup(rank, size, group=object())


def test_split_off_a_scale_block_is_refused(tmp_path):
    """tiny's wq_b has 4 heads x 32 = 128 rows: 64 a rank at tp = 2 cuts its FP8 block
    (as do its wo_a, wo_b and indexer wq_b)."""
    ckpt = save_checkpoint(random_models(_cfg(TINY), 0), tmp_path / "fp8", quantize="fp8")
    with pytest.raises(CheckpointError, match=r"splits FP8 tensor \S+\.weight \[\d+, \d+\] "
                                              r"along dim [01] into tp = 2 parts of (64|32), "
                                              r"not a multiple of its scale block of 128"):
        load_checkpoint(ckpt, tp=_stand_in(0, 2))


@pytest.mark.parametrize("raw, size, dim", [
    ({**TINY, "vocab_size": 255}, 3, "num_attention_heads = 4"), ({**TINY, "num_attention_heads": 8}, 4, "o_groups = 2"),
    ({**TP4, "index_n_heads": 2}, 4, "index_n_heads = 2"),
    ({**TP4, "n_routed_experts": 6}, 4, "n_routed_experts = 6"),
    ({**TINY, "vocab_size": 250}, 4, "vocab_size = 250")])
def test_uneven_split_is_a_named_config_error(raw, size, dim):
    with torch.device("meta"), pytest.raises(ConfigError, match=f"{dim} does not divide "
                                                                f"into tp = {size}"):
        build_models(_cfg(raw), _stand_in(0, size))


def test_sharded_model_is_not_saved(tmp_path):
    with torch.device("meta"):
        models = build_models(_cfg(TINY), _stand_in(1, 2))
    with pytest.raises(CheckpointError, match="cannot save a model sharded over tp = 2"):
        save_checkpoint(models, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_sharding_table_names_every_split():
    for key in ("embed.weight", "head.weight", "attn.wq_b", "attn.wo_b", "indexer.wq_b",
                "weights_proj", "ffn.experts.E", "replicated"):
        assert key in SHARDING_TABLE, key
