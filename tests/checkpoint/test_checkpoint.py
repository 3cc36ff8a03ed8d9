"""Checkpoint I/O in the released DeepSeek-V4 layout: round trip, layout, bad input.

One tiny checkpoint (seed 0) is written per module; every bad-input test edits a
copy of it under its own ``tmp_path`` so nothing leaks between tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nextn_graph.checkpoint.loader import load_checkpoint
from nextn_graph.checkpoint.save import save_checkpoint
from nextn_graph.checkpoint.weights import INDEX_FILE, SINGLE_FILE
from nextn_graph.cli.commands import make_checkpoint
from nextn_graph.errors import CheckpointError, ConfigError, NextnGraphError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt_seed0"), seed=0)


@pytest.fixture(scope="module")
def tensors(ckpt) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / SINGLE_FILE))


def _ids(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(2, 256, (n,), generator=gen)


def _logits(root: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    models = load_checkpoint(root)
    out = models.target.reference(ids)
    return out.logits, models.draft.reference(ids, out.hidden).logits


def _copy(src: Path, dst: Path, edit_tensors=None, edit_config=None) -> Path:
    """Copy a checkpoint dir, optionally rewriting its tensors and/or config.json."""
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        state = load_file(str(dst / SINGLE_FILE))
        edit_tensors(state)
        save_file(state, str(dst / SINGLE_FILE), metadata={"format": "pt"})
    if edit_config is not None:
        raw = json.loads((dst / "config.json").read_text())
        edit_config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


# ---------------------------------------------------------------- round trip


def test_save_load_round_trip_is_bitwise(ckpt, tmp_path):
    """load -> save (single file and sharded) -> load reproduces target and draft logits bitwise."""
    ids = _ids(40)
    models = load_checkpoint(ckpt)
    target0 = models.target.reference(ids)
    draft0 = models.draft.reference(ids, target0.hidden).logits

    single = save_checkpoint(models, tmp_path / "single")
    assert (single / SINGLE_FILE).is_file() and not (single / INDEX_FILE).exists()

    sharded = save_checkpoint(models, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    index = json.loads((sharded / INDEX_FILE).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1, "max_shard_bytes should have forced several shards"
    assert all((sharded / f).is_file() for f in shard_files)
    assert not (sharded / SINGLE_FILE).exists()
    assert set(index["weight_map"]) == set(load_file(str(ckpt / SINGLE_FILE)))

    for root in (single, sharded):
        target1, draft1 = _logits(root, ids)
        assert torch.equal(target1, target0.logits), root.name
        assert torch.equal(draft1, draft0), root.name


def test_saved_config_reloads_equal(ckpt, tmp_path):
    """config.json written by save_checkpoint parses back to the same ModelConfig."""
    models = load_checkpoint(ckpt)
    again = load_checkpoint(save_checkpoint(models, tmp_path / "again"))
    assert again.cfg == models.cfg


# ---------------------------------------------------------------- make-checkpoint


def test_make_checkpoint_is_deterministic_per_seed(ckpt, tensors, tmp_path):
    """Same seed gives identical tensors and config; another seed changes every tensor."""
    same = load_file(str(make_checkpoint("tiny", tmp_path / "s0", seed=0) / SINGLE_FILE))
    other = load_file(str(make_checkpoint("tiny", tmp_path / "s1", seed=1) / SINGLE_FILE))
    assert set(same) == set(tensors) == set(other)
    for key, value in tensors.items():
        assert same[key].dtype == value.dtype and torch.equal(same[key], value), key
    assert (tmp_path / "s0" / "config.json").read_text() == (ckpt / "config.json").read_text()
    unchanged = [k for k in tensors if torch.equal(other[k], tensors[k])]
    assert unchanged == []


def test_tiny_covers_all_ratios_and_indexer_selects(ckpt):
    """Tiny layers use ratios 0, 4 and 128, and index_topk < C4 blocks of a 64-token prompt."""
    raw = json.loads((ckpt / "config.json").read_text())
    n_layers = raw["num_hidden_layers"]
    ratios = raw["compress_ratios"][:n_layers]
    assert set(ratios) == {0, 4, 128}
    models = load_checkpoint(ckpt)
    assert models.target.layer_ratios() == ratios
    c4_blocks_of_64 = 64 // 4
    assert 0 < raw["index_topk"] < c4_blocks_of_64
    for layer, ratio in zip(models.target.layers, ratios):
        assert hasattr(layer.attn, "indexer") == (ratio == 4)
        if ratio == 4:
            assert layer.attn.indexer.topk == raw["index_topk"]


# ---------------------------------------------------------------- key layout


REQUIRED_KEYS = [
    "embed.weight", "head.weight", "norm.weight", "hc_head_fn",
    "layers.0.attn.wq_a.weight", "layers.1.attn.compressor.ape",
    "layers.1.attn.indexer.weights_proj.weight", "layers.1.attn.indexer.compressor.wkv.weight",
    "layers.0.ffn.gate.tid2eid", "layers.1.ffn.gate.bias", "layers.1.ffn.experts.0.w1.weight",
    "layers.1.ffn.shared_experts.w2.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight",
    "mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight",
]


def test_released_key_layout(tensors):
    """The safetensors file holds the released DeepSeek-V4 keys and no draft copy of embed/head."""
    missing = [k for k in REQUIRED_KEYS if k not in tensors]
    assert missing == []
    assert not [k for k in tensors if k.startswith(("mtp.0.embed", "mtp.0.head"))]
    assert not [k for k in tensors if not k.startswith(
        ("layers.", "mtp.0.", "embed.", "head.", "norm.", "hc_head_"))]
    # layer 0 is hash-routed (tid2eid, no bias); layer 1 is score-routed (bias, no tid2eid)
    assert "layers.0.ffn.gate.bias" not in tensors
    assert "layers.1.ffn.gate.tid2eid" not in tensors
    # the ratio-0 layer has neither compressor nor indexer; the C128 layer has no indexer
    assert not [k for k in tensors if k.startswith(("layers.0.attn.compressor",
                                                    "layers.0.attn.indexer",
                                                    "layers.2.attn.indexer"))]
    assert "layers.2.attn.compressor.ape" in tensors


def test_stored_dtypes(tensors):
    """Matrices are bf16; hc_*, attn_sink, ape and gate.bias fp32; tid2eid int32."""
    for key, value in tensors.items():
        name = key.rsplit(".", 1)[-1]
        if name == "tid2eid":
            want = torch.int32
        elif name.startswith("hc_") or name in ("attn_sink", "ape", "bias"):
            want = torch.float32
        else:
            want = torch.bfloat16
        assert value.dtype == want, (key, value.dtype)
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert tensors["layers.1.ffn.experts.0.w1.weight"].dtype == torch.bfloat16
    assert tensors["hc_head_fn"].dtype == torch.float32
    assert tensors["mtp.0.hc_head_fn"].dtype == torch.float32
    assert tensors["layers.0.attn.attn_sink"].dtype == torch.float32
    assert tensors["layers.1.attn.compressor.ape"].dtype == torch.float32
    assert tensors["layers.1.ffn.gate.bias"].dtype == torch.float32
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int32


# ---------------------------------------------------------------- bad input


def _raises(root: Path, kind: type[NextnGraphError], *needles: str) -> str:
    with pytest.raises(kind) as info:
        load_checkpoint(root)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert isinstance(info.value, NextnGraphError)
    return msg


def test_missing_tensor_key(ckpt, tmp_path):
    """A tensor absent from the file is a CheckpointError naming the dir and the key."""
    key = "layers.1.attn.compressor.ape"
    root = _copy(ckpt, tmp_path / "c", edit_tensors=lambda s: s.pop(key))
    _raises(root, CheckpointError, str(root), "missing", key)


def test_unexpected_tensor_key(ckpt, tmp_path):
    """An extra tensor is a CheckpointError naming the key."""
    key = "layers.0.attn.extra_proj.weight"
    root = _copy(ckpt, tmp_path / "c",
                 edit_tensors=lambda s: s.__setitem__(key, torch.zeros(2, 2, dtype=torch.bfloat16)))
    _raises(root, CheckpointError, str(root), "unexpected", key)


def test_scale_beside_a_float_weight_is_refused(ckpt, tmp_path):
    """A ``.scale`` tensor beside a bf16 weight names both: only FP8/FP4 weights have one."""
    key = "layers.0.attn.wq_a.scale"
    root = _copy(ckpt, tmp_path / "c",
                 edit_tensors=lambda s: s.__setitem__(key, torch.ones(1, dtype=torch.float32)))
    _raises(root, CheckpointError, key, "'layers.0.attn.wq_a.weight'", "neither FP8 nor packed FP4")


def test_wrong_shape(ckpt, tmp_path):
    """A tensor of the wrong shape names the key, the found and the expected shape."""
    key = "layers.0.attn.wq_a.weight"  # [q_lora_rank 48, hidden 64]

    def edit(state):
        state[key] = torch.zeros(48, 32, dtype=torch.bfloat16)

    root = _copy(ckpt, tmp_path / "c", edit_tensors=edit)
    _raises(root, CheckpointError, key, "[48, 32]", "[48, 64]")


def test_tid2eid_out_of_range(ckpt, tmp_path):
    """A hash-routing table naming a non-existent expert is a CheckpointError."""
    key = "layers.0.ffn.gate.tid2eid"

    def edit(state):
        state[key] = state[key].clone()
        state[key][3, 0] = 4  # tiny has experts 0..3

    root = _copy(ckpt, tmp_path / "c", edit_tensors=edit)
    _raises(root, CheckpointError, key, "[0, 4)")


def test_config_missing_required_key(ckpt, tmp_path):
    """config.json without hidden_size is a ConfigError naming the file and the key."""
    root = _copy(ckpt, tmp_path / "c", edit_config=lambda raw: raw.pop("hidden_size"))
    _raises(root, ConfigError, str(root / "config.json"), "'hidden_size'", "missing")


def test_missing_config_file(ckpt, tmp_path):
    """A checkpoint dir without config.json is a ConfigError naming the file."""
    root = _copy(ckpt, tmp_path / "c")
    (root / "config.json").unlink()
    _raises(root, ConfigError, str(root / "config.json"), "not found")


def test_config_two_nextn_layers(ckpt, tmp_path):
    """num_nextn_predict_layers = 2 is a ConfigError naming the key and the value."""
    root = _copy(ckpt, tmp_path / "c",
                 edit_config=lambda raw: raw.__setitem__("num_nextn_predict_layers", 2))
    _raises(root, ConfigError, "num_nextn_predict_layers", "is 2", "config.json")


def test_second_mtp_layer_tensors(ckpt, tmp_path):
    """mtp.1.* tensors (a second MTP layer) are a CheckpointError naming an mtp.1 key."""
    def edit(state):
        for key in [k for k in state if k.startswith("mtp.0.")]:
            state["mtp.1." + key[len("mtp.0."):]] = state[key].clone()

    root = _copy(ckpt, tmp_path / "c", edit_tensors=edit)
    msg = _raises(root, CheckpointError, "'mtp.1.", "second MTP layer")
    assert "mtp.0.*" in msg


def test_dspark_tensor_key(ckpt, tmp_path):
    """A dspark_* tensor is rejected as a DSpark drafter, naming the key."""
    key = "mtp.0.dspark_proj.weight"
    root = _copy(ckpt, tmp_path / "c",
                 edit_tensors=lambda s: s.__setitem__(key, torch.zeros(64, 64, dtype=torch.bfloat16)))
    _raises(root, CheckpointError, key, "DSpark")


def test_dspark_config_key(ckpt, tmp_path):
    """A dspark_* key in config.json is a ConfigError naming the key."""
    root = _copy(ckpt, tmp_path / "c",
                 edit_config=lambda raw: raw.__setitem__("dspark_num_layers", 2))
    _raises(root, ConfigError, "'dspark_num_layers'", "DSpark", "config.json")


def test_missing_checkpoint_dir(tmp_path):
    """A checkpoint path that does not exist is a CheckpointError naming the path."""
    root = tmp_path / "nowhere"
    _raises(root, CheckpointError, str(root), "not found")


def test_no_weights_file(ckpt, tmp_path):
    """A dir with config.json but no safetensors names both accepted file names."""
    root = _copy(ckpt, tmp_path / "c")
    (root / SINGLE_FILE).unlink()
    _raises(root, CheckpointError, str(root), SINGLE_FILE, INDEX_FILE)


def test_missing_shard_listed_in_index(ckpt, tmp_path):
    """A shard listed in the index but absent on disk is a CheckpointError naming the shard."""
    root = save_checkpoint(load_checkpoint(ckpt), tmp_path / "sharded", max_shard_bytes=64 * 1024)
    shard = sorted(json.loads((root / INDEX_FILE).read_text())["weight_map"].values())[-1]
    (root / shard).unlink()
    _raises(root, CheckpointError, INDEX_FILE, shard, "missing")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(ckpt, tmp_path, damage):
    """An unreadable safetensors file is a CheckpointError naming the file."""
    root = _copy(ckpt, tmp_path / "c")
    path = root / SINGLE_FILE
    data = path.read_bytes()
    path.write_bytes(b"not a safetensors file" if damage == "garbage" else data[: len(data) // 2])
    _raises(root, CheckpointError, str(path), "cannot read safetensors")
