"""Checkpoint writes are atomic and whole; loading refuses what it would have to guess.

A rebuilt checkpoint must never mix with (or be shadowed by) the files of an earlier
one, an interrupted write must leave the previous checkpoint loadable, and a
directory with two layouts, stray shards, a malformed index or NaN/Inf weights is
a ``CheckpointError`` naming the file or tensor, not silently wrong tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nextn_graph.checkpoint.save as checkpoint
from nextn_graph.checkpoint.loader import expected_state, load_checkpoint
from nextn_graph.checkpoint.save import save_checkpoint
from nextn_graph.checkpoint.weights import INDEX_FILE, SINGLE_FILE
from nextn_graph.cli.commands import make_checkpoint
from nextn_graph.errors import CheckpointError

SHARD = 200_000  # bytes: the tiny preset (~1.3 MB) becomes several shards


@pytest.fixture(scope="module")
def seed0_sharded(tmp_path_factory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("s0") / "ckpt", seed=0,
                           max_shard_bytes=SHARD)


@pytest.fixture(scope="module")
def seed5(tmp_path_factory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("s5") / "ckpt", seed=5)


def _weights(root: Path) -> dict[str, torch.Tensor]:
    return expected_state(load_checkpoint(root))


def _assert_same_weights(got: Path, want: Path) -> None:
    a, b = _weights(got), _weights(want)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _listed_files(root: Path) -> set[str]:
    if (root / INDEX_FILE).is_file():
        shards = json.loads((root / INDEX_FILE).read_text())["weight_map"].values()
        return {"config.json", INDEX_FILE, *shards}
    return {"config.json", SINGLE_FILE}


# ---------------------------------------------------------------- writing


def test_rebuilt_checkpoint_never_loads_stale_shards(seed0_sharded, seed5, tmp_path):
    """Sharded seed 0, then single-file seed 5 into the same dir: it loads seed 5's weights
    and holds nothing of the old write (the issue's repro)."""
    out = shutil.copytree(seed0_sharded, tmp_path / "ckpt")
    make_checkpoint("tiny", out, seed=5)
    assert {p.name for p in out.iterdir()} == {"config.json", SINGLE_FILE}
    _assert_same_weights(out, seed5)
    old, new = _weights(seed0_sharded), _weights(out)
    assert not torch.equal(old["embed.weight"], new["embed.weight"])


def test_resharding_into_fewer_shards_leaves_no_stale_shard(seed0_sharded, tmp_path):
    """Re-sharding with bigger shards leaves exactly the new index's shards on disk."""
    out = shutil.copytree(seed0_sharded, tmp_path / "ckpt")
    before = len(list(out.glob("*.safetensors")))
    make_checkpoint("tiny", out, seed=0, max_shard_bytes=4 * SHARD)
    after = {p.name for p in out.iterdir()}
    assert after == _listed_files(out)
    assert 1 < len(after) - 2 < before
    _assert_same_weights(out, seed0_sharded)


def test_interrupted_write_leaves_previous_checkpoint(seed0_sharded, tmp_path, monkeypatch):
    """A save that fails after one shard leaves the old checkpoint loading and no temp dir."""
    out = shutil.copytree(seed0_sharded, tmp_path / "ckpt")
    real_save, calls = checkpoint.save_file, []

    def save_then_fail(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > 1:
            raise OSError("disk full (simulated)")
        real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_file", save_then_fail)
    with pytest.raises(OSError, match="simulated"):
        make_checkpoint("tiny", out, seed=5, max_shard_bytes=SHARD)
    assert len(calls) == 2, "the first shard should have been written before the failure"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert {p.name for p in out.iterdir()} == _listed_files(out)
    _assert_same_weights(out, seed0_sharded)


@pytest.mark.parametrize("files", [["notes.txt"], ["config.json", "notes.txt"],
                                   ["model.safetensors"]])
def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(seed5, tmp_path, files):
    """A non-empty dir that is not a checkpoint is refused and every file survives."""
    out = tmp_path / "mine"
    out.mkdir()
    for name in files:
        (out / name).write_text(f"user data {name}")
    with pytest.raises(CheckpointError, match="not a checkpoint directory") as info:
        save_checkpoint(load_checkpoint(seed5), out)
    assert str(out) in str(info.value)
    if "notes.txt" in files:
        assert "notes.txt" in str(info.value)
    assert {p.name: p.read_text() for p in out.iterdir()} == {n: f"user data {n}" for n in files}
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_overwrite_refuses_a_file_and_keeps_symlinks(seed0_sharded, seed5, tmp_path):
    """A plain file at the path is refused; a symlinked checkpoint dir is replaced behind
    the link, which stays a link."""
    plain = tmp_path / "plain"
    plain.write_text("keep me")
    with pytest.raises(CheckpointError, match="not a directory"):
        make_checkpoint("tiny", plain, seed=5)
    assert plain.read_text() == "keep me"
    real = shutil.copytree(seed0_sharded, tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    assert make_checkpoint("tiny", link, seed=5) == link
    assert link.is_symlink() and link.resolve() == real.resolve()
    _assert_same_weights(real, seed5)


# ---------------------------------------------------------------- loading


def _single_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    state = load_file(str(dst / SINGLE_FILE))
    edit(state)
    save_file(state, str(dst / SINGLE_FILE), metadata={"format": "pt"})
    return dst


def test_index_and_single_file_together_refused(seed0_sharded, seed5, tmp_path):
    """Both layouts in one dir are ambiguous: refused, naming both files."""
    root = shutil.copytree(seed0_sharded, tmp_path / "c")
    shutil.copy(seed5 / SINGLE_FILE, root / SINGLE_FILE)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root)
    assert INDEX_FILE in str(info.value) and SINGLE_FILE in str(info.value)


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_unlisted_shard_refused(seed0_sharded, seed5, tmp_path, layout):
    """A *.safetensors file the layout does not name (a stale shard) is refused by name."""
    root = shutil.copytree(seed0_sharded if layout == "sharded" else seed5, tmp_path / "c")
    stray = "model-00009-of-00009.safetensors"
    save_file({"x": torch.zeros(1)}, str(root / stray))
    with pytest.raises(CheckpointError, match="stale") as info:
        load_checkpoint(root)
    assert stray in str(info.value)


@pytest.mark.parametrize("body", [
    "{not json", "[]", "{}", '{"weight_map": []}', '{"weight_map": {"embed.weight": 3}}',
    '{"weight_map": {"embed.weight": "../elsewhere.safetensors"}}', "[" * 100_000,
])
def test_index_weight_map_must_map_strings(seed0_sharded, tmp_path, body):
    """A malformed index is a CheckpointError naming the index file, not a traceback."""
    root = shutil.copytree(seed0_sharded, tmp_path / "c")
    (root / INDEX_FILE).write_text(body)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root)
    assert str(root / INDEX_FILE) in str(info.value)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_weights_refused(seed5, tmp_path, bad):
    """A non-finite weight is refused, naming the first offending tensor (target before draft)."""
    def poison(state):
        for key in ("mtp.0.e_proj.weight", "layers.1.attn.compressor.ape"):
            state[key] = state[key].clone()
            state[key].view(-1)[3] = bad

    root = _single_copy(seed5, tmp_path / "c", poison)
    with pytest.raises(CheckpointError, match="NaN or Inf") as info:
        load_checkpoint(root)
    assert "'layers.1.attn.compressor.ape'" in str(info.value)
    assert "mtp.0" not in str(info.value)


@pytest.mark.parametrize("dtype, quantized", [
    (torch.float8_e4m3fn, True), (torch.float8_e5m2, False), (torch.float64, False),
    (torch.int8, True), (torch.int64, False),
])
def test_unsupported_weight_dtype_refused(seed5, tmp_path, dtype, quantized):
    """A weight stored FP8 e4m3 or packed FP4 (int8) without its ``.scale`` is refused
    naming the missing scale; other non-bf16/fp16/fp32 dtypes are refused naming the key
    and dtype, before any tensor data is read."""
    key = "layers.0.attn.wq_a.weight"

    def cast(state):
        state[key] = state[key].to(dtype)

    root = _single_copy(seed5, tmp_path / "c", cast)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root)
    message = str(info.value)
    if quantized:
        assert message == (f"{root}: quantized weight {key!r} ({dtype}) has no scale "
                           f"'layers.0.attn.wq_a.scale'")
    else:
        assert message.startswith(f"{root}: tensor {key!r} has dtype {dtype}, expected bf16, "
                                  f"fp16 or fp32")


def test_fp16_weights_load(seed5, tmp_path):
    """fp16 is one of the accepted storage dtypes (converted on load)."""
    key = "layers.0.attn.wq_a.weight"

    def cast(state):
        state[key] = state[key].to(torch.float16)

    root = _single_copy(seed5, tmp_path / "c", cast)
    got = _weights(root)[key]
    assert torch.equal(got, _weights(seed5)[key].half().float())


@pytest.mark.parametrize("dtype, error", [
    (torch.bool, "has dtype torch.bool; expert ids need an integer dtype"),
    (torch.float32, "has dtype torch.float32; expert ids need an integer dtype"),
    (torch.uint8, None), (torch.int64, None),
])
def test_tid2eid_needs_integer_dtype(seed5, tmp_path, dtype, error):
    """Hash-routing tables hold expert ids: a bool table (True read as expert 1) or a
    float one is refused, naming the key; any integer dtype loads to the same ids."""
    key = "layers.0.ffn.gate.tid2eid"

    def cast(state):
        state[key] = state[key].to(dtype)

    root = _single_copy(seed5, tmp_path / "c", cast)
    if error is None:
        assert torch.equal(_weights(root)[key], _weights(seed5)[key])
        return
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root)
    assert str(info.value) == f"{root}: tensor {key!r} {error}"


def test_checkpoint_under_a_file_is_a_checkpoint_error(tmp_path):
    """--out FILE/sub, where FILE is a regular file: a CheckpointError naming both paths,
    not a FileExistsError from mkdir; the file is untouched and nothing is left behind."""
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for out in (afile / "sub", afile / "sub" / "deeper"):
        with pytest.raises(CheckpointError) as info:
            make_checkpoint("tiny", out, seed=0)
        assert str(info.value) == f"{out}: cannot create it, {afile} is not a directory"
    assert afile.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]
