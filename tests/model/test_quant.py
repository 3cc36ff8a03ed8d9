"""The released checkpoint's formats: FP8 e4m3 linears with e8m0 128 x 128 block scales,
packed FP4 routed experts with e8m0 scales per 32 inputs, kept quantized in memory.

The oracle is an independent dequantization written here in numpy from the format's
definition (e4m3 bits decoded by hand, the FP4 nibble table, 2^(b - 127) scales): a
checkpoint dequantized by it and stored fp32 must give the quantized model's logits.
Then generation on the quantized model (plain, speculative eager, speculative on
``cpu`` graphs) must equal the no-cache reference, and every malformed quantized
tensor must be a named error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nextn_graph.checkpoint.loader as loader
from nextn_graph.checkpoint import load_checkpoint, save_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import CheckpointError
from nextn_graph.runtime.generate import plain_generate, reference_generate
from nextn_graph.checkpoint.loader import resident_bytes
from nextn_graph.model.quant import QuantLinear
from nextn_graph.runtime.engine import SpecEngine

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [40, 41, 42]]
NIBBLES = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]  # the table


@pytest.fixture(scope="module")
def qdir(tmp_path_factory, trained) -> Path:
    """The tiny trained checkpoint written in the release's dtypes."""
    root = tmp_path_factory.mktemp("q") / "fp8"
    save_checkpoint(trained, root, max_shard_bytes=200_000, quantize="fp8")
    return root


@pytest.fixture(scope="module")
def quantized(qdir):
    return load_checkpoint(qdir)


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _e4m3(bits: np.ndarray) -> np.ndarray:
    """e4m3fn by hand: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + man / 8.0) * np.exp2(exp - 7.0)
    return sign * np.where(exp == 0, man / 8.0 * 2.0 ** -6, normal)


def _independent_dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = np.exp2(scale.view(torch.uint8).numpy().astype(np.float64) - 127)
    if w.dtype == torch.float8_e4m3fn:
        v = _e4m3(w.view(torch.uint8).numpy())
        rows = np.arange(v.shape[0]) // 128
        cols = np.arange(v.shape[1]) // 128
        return torch.from_numpy(v * s[rows][:, cols]).float()
    packed = w.view(torch.uint8).numpy().astype(np.int64)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    v = np.array(NIBBLES)[codes]
    return torch.from_numpy(v * np.repeat(s, 32, axis=1)).float()


@pytest.fixture(scope="module")
def dequant_dir(qdir, tmp_path_factory) -> Path:
    """The same checkpoint dequantized by the independent formula, stored fp32."""
    root = tmp_path_factory.mktemp("dq")
    tensors = _tensors(qdir)
    out = {}
    for key, t in tensors.items():
        if key.endswith(".scale"):
            continue
        scale = tensors.get(key[: -len("weight")] + "scale")
        out[key] = _independent_dequant(t, scale) if scale is not None else t
    save_file(out, str(root / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    del config["quantization_config"], config["expert_dtype"]
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_written_in_the_release_dtypes(qdir):
    """FP8 linears, FP4 (int8, two per byte) routed experts, e8m0 scales, the config."""
    config = json.loads((qdir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert config["expert_dtype"] == "fp4"
    t = _tensors(qdir)
    for key in ("layers.0.attn.wq_a", "layers.1.attn.indexer.wq_b", "layers.2.attn.wo_a",
                "layers.0.ffn.shared_experts.w2", "mtp.0.e_proj", "mtp.0.h_proj"):
        assert t[key + ".weight"].dtype == torch.float8_e4m3fn, key
        assert t[key + ".scale"].dtype == torch.float8_e8m0fnu, key
    w1, s1 = t["layers.1.ffn.experts.2.w1.weight"], t["layers.1.ffn.experts.2.w1.scale"]
    assert w1.dtype == torch.int8 and list(w1.shape) == [64, 32] and list(s1.shape) == [64, 2]
    for key in ("embed.weight", "head.weight", "layers.1.attn.compressor.wkv.weight",
                "layers.1.attn.indexer.weights_proj.weight", "layers.1.ffn.gate.weight"):
        assert t[key].dtype == torch.bfloat16, key
    assert t["layers.0.ffn.gate.tid2eid"].dtype == torch.int32


def test_quantized_stays_quantized(quantized, trained):
    """Every FP8/FP4 linear is a QuantLinear holding the stored bytes: about 1 byte per
    FP8 weight and half a byte per FP4 weight, plus scales."""
    q = quantized.target.layers[1]
    assert isinstance(q.attn.wq_a, QuantLinear) and q.attn.wq_a.fmt == "fp8"
    assert isinstance(q.ffn.experts[0].w3, QuantLinear) and q.ffn.experts[0].w3.fmt == "fp4"
    assert isinstance(quantized.draft.layer.e_proj, QuantLinear)
    assert type(quantized.target.head) is torch.nn.Linear
    fp8, fp4 = q.attn.wq_b, q.ffn.experts[0].w1
    assert fp8.weight.numel() * fp8.weight.element_size() == fp8.in_features * fp8.out_features
    assert fp4.weight.numel() * fp4.weight.element_size() * 2 == fp4.in_features * fp4.out_features
    assert resident_bytes(quantized.target) < 0.5 * resident_bytes(trained.target)


def test_logits_equal_the_independent_dequantization(quantized, dequant_dir):
    """Target and draft logits of the quantized model equal those of the checkpoint
    dequantized by the independent formula (fp32; the dequantization is exact)."""
    ref = load_checkpoint(dequant_dir)
    ids = torch.tensor(list(range(3, 140)))  # crosses the window and a C128 block
    out, want = quantized.target.reference(ids), ref.target.reference(ids)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-5, atol=1e-5)
    d_out = quantized.draft.reference(ids, out.hidden)
    d_want = ref.draft.reference(ids, want.hidden)
    torch.testing.assert_close(d_out.logits, d_want.logits, rtol=1e-5, atol=1e-5)


def test_dequantized_mode_expands_at_load(qdir, dequant_dir):
    """weights: dequantized holds plain linears equal to the independent dequantization."""
    dq, ref = load_checkpoint(qdir, weights="dequantized"), load_checkpoint(dequant_dir)
    assert not any(isinstance(m, QuantLinear) for m in dq.target.modules())
    for (k, a), (_, b) in zip(dq.target.state_dict().items(), ref.target.state_dict().items()):
        assert torch.equal(a, b), k


def test_bf16_quantized_equals_bf16_dequantized(qdir):
    """In bf16 the dequantized weight is still exact: both modes give the same logits."""
    a = load_checkpoint(qdir, torch.bfloat16)
    b = load_checkpoint(qdir, torch.bfloat16, weights="dequantized")
    ids = torch.tensor(list(range(3, 40)))
    assert torch.equal(a.target.reference(ids).logits, b.target.reference(ids).logits)


@pytest.mark.parametrize("backend", ["eager", "cpu"])
def test_generation_on_the_quantized_model_equals_reference(quantized, backend):
    """Plain and speculative decoding (eager and on cpu graphs) equal the reference."""
    ref = reference_generate(quantized.target, PROMPTS, 12, stop_ids=set(), max_context=128)
    plain = plain_generate(quantized.target, PROMPTS, 12, stop_ids=set(), max_context=128)
    engine = SpecEngine(quantized.target, quantized.draft, SpeculativeConfig(), PoolConfig(4, 128),
                        GraphConfig(backend=backend, buckets=(4,)))
    spec = engine.generate(PROMPTS, 12, stop_ids=set())
    assert plain.outputs == ref.outputs == spec.outputs
    assert spec.stats["accepted_drafts"] > 0 and spec.stats["eager_fallbacks"] == 0


def test_alias_keys_map_onto_the_shared_tensors(qdir, quantized, tmp_path):
    """mtp.0.emb.tok_emb.weight and mtp.0.head.weight (copies some exports carry) load;
    the draft keeps using the shared embedding and head. A wrong-shaped copy is named."""
    root = _copy(qdir, tmp_path / "alias")
    extra = {"mtp.0.emb.tok_emb.weight": quantized.target.embed.weight.to(torch.bfloat16),
             "mtp.0.head.weight": quantized.target.head.weight.to(torch.bfloat16)}
    _add_file(root, extra)
    ids = torch.tensor([3, 4, 5, 6])
    m = load_checkpoint(root)
    out = m.target.reference(ids)
    assert torch.equal(m.draft.reference(ids, out.hidden).logits,
                       quantized.draft.reference(ids, out.hidden).logits)
    extra["mtp.0.head.weight"] = extra["mtp.0.head.weight"][:10]
    _add_file(root, extra)
    with pytest.raises(CheckpointError, match=r"'mtp.0.head.weight' \(a copy of 'head.weight'\)"):
        load_checkpoint(root)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _add_file(root: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Put ``tensors`` in an extra shard listed by the index."""
    index = json.loads((root / "model.safetensors.index.json").read_text())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "extra.safetensors"))
    index["weight_map"].update({k: "extra.safetensors" for k in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps(index))


def _edit(qdir: Path, dst: Path, edit=None, config=None) -> Path:
    """A single-file copy of the quantized checkpoint with its tensors or config edited."""
    dst.mkdir()
    tensors = _tensors(qdir)
    if edit:
        edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((qdir / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


FP8 = "layers.0.attn.wq_a"
FP4 = "layers.1.ffn.experts.0.w2"


def _set(key, value):
    return lambda t: t.__setitem__(key, value)


def _nan_scale(t):
    t[FP8 + ".scale"] = torch.full_like(t[FP8 + ".scale"].view(torch.uint8), 0xFF).view(
        torch.float8_e8m0fnu)


def _nan_fp8(t):
    bits = t[FP8 + ".weight"].view(torch.uint8).clone()
    bits[0, 0] = 0x7F
    t[FP8 + ".weight"] = bits.view(torch.float8_e4m3fn)


def _mangle_fp4(t):
    t[FP4 + ".weight"] = t[FP4 + ".weight"][:, :16].contiguous()


BAD = {
    "fp8 weight without its scale": (lambda t: t.pop(FP8 + ".scale"), None,
                                     f"quantized weight '{FP8}.weight'"),
    "fp4 weight without its scale": (lambda t: t.pop(FP4 + ".scale"), None,
                                     f"'{FP4}.weight' (torch.int8) has no scale"),
    "scale without a weight": (lambda t: t.pop(FP8 + ".weight"), None,
                               f"scale '{FP8}.scale' has no weight"),
    "scale of the wrong shape": (_set(FP8 + ".scale", torch.ones(2, 2).to(torch.float8_e8m0fnu)),
                                 None, f"{FP8}.scale has shape [2, 2], expected [1, 1]"),
    "scale of the wrong dtype": (_set(FP8 + ".scale", torch.ones(1, 1, dtype=torch.bfloat16)),
                                 None, f"{FP8}.scale has dtype torch.bfloat16"),
    "fp4 shape against its scale": (_mangle_fp4, None,
                                    f"FP4 tensor {FP4}.weight has shape [64, 16], expected [64, 32]"),
    "NaN e8m0 scale": (_nan_scale, None, f"'{FP8}.scale' holds NaN"),
    "NaN fp8 weight": (_nan_fp8, None, f"'{FP8}.weight' holds NaN"),
    "unknown quant_method": (None, lambda c: c["quantization_config"].update(quant_method="awq"),
                             "quantization_config.quant_method 'awq' is not supported"),
    "unknown fmt": (None, lambda c: c["quantization_config"].update(fmt="e5m2"),
                    "quantization_config.fmt 'e5m2' is not supported"),
    "unknown block size": (None, lambda c: c["quantization_config"].update(
        weight_block_size=[64, 64]), "weight_block_size [64, 64] is not supported"),
    "no quantization_config": (None, lambda c: (c.pop("quantization_config"),
                                                c.pop("expert_dtype")),
                               "but config.json has no quantization_config"),
    "fp4 without expert_dtype fp4": (None, lambda c: c.update(expert_dtype="bf16"),
                                     "is FP4 but config.json's expert_dtype is not 'fp4'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_quantized_tensor_is_a_named_error(qdir, tmp_path, case):
    edit, config, needle = BAD[case]
    root = _edit(qdir, tmp_path / "c", edit, config)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root)
    assert needle in str(info.value), str(info.value)


def test_loading_streams_shard_by_shard_with_progress(qdir, quantized, capsys, monkeypatch):
    """Each shard is mapped, read and released before the next (at most one open at a
    time), every tensor read once, and a progress bar counts the shards."""
    opened, reads, most = set(), [], [0]
    real_get, real_close = loader.Shards.get, loader.Shards.close_file

    def get(self, key):
        opened.add(self.infos[key].file)
        reads.append(key)
        value = real_get(self, key)
        most[0] = max(most[0], len(self._files))
        return value

    def close(self, name):
        opened.discard(name)
        return real_close(self, name)

    monkeypatch.setattr(loader.Shards, "get", get)
    monkeypatch.setattr(loader.Shards, "close_file", close)
    m = load_checkpoint(qdir, progress=True)
    shards = sorted(qdir.glob("*.safetensors"))
    assert len(shards) > 3 and most[0] == 1 and not opened
    assert len(reads) == len(set(reads)) == sum(1 for _ in _tensors(qdir))
    assert f"] {len(shards)}/{len(shards)} loading shards" in capsys.readouterr().err
    ids = torch.tensor([7, 8, 9])
    assert torch.equal(m.target.reference(ids).logits, quantized.target.reference(ids).logits)


def test_a_model_too_big_for_its_device_is_refused_before_reading(qdir, monkeypatch):
    monkeypatch.setattr(loader, "physical_memory_bytes", lambda: 1000)
    monkeypatch.setattr(loader.Shards, "get", lambda *a: pytest.fail("read a tensor"))
    with pytest.raises(CheckpointError, match=r"the weights need 0.0 GiB on cpu \(quantized"):
        load_checkpoint(qdir)


def test_a_loaded_quantized_model_saves_as_stored(quantized, qdir, tmp_path):
    """Saving a quantized model writes its stored bits back, byte for byte."""
    save_checkpoint(quantized, tmp_path / "again")
    a, b = _tensors(qdir), _tensors(tmp_path / "again")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8),
                                                        b[k].view(torch.uint8)), k
    with safe_open(str(sorted((tmp_path / "again").glob("*.safetensors"))[0]), "pt") as f:
        assert f.keys()


def test_cli_make_quantized_checkpoint_then_generate(tmp_path, capsys):
    """`make-checkpoint --quantize fp8` then `generate`: speculative on cpu graphs equals the
    reference, and --weights dequantized gives the same tokens."""
    from nextn_graph.cli import main

    out = tmp_path / "tiny-fp8"
    assert main(["make-checkpoint", "--preset", "tiny", "--quantize", "fp8", "--out",
                 str(out)]) == 0
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7, 8]}\n{"input_ids": [9, 10]}\n')
    capsys.readouterr()
    runs = {}
    for name, extra in {"spec": ["--backend", "cpu"], "reference": ["--mode", "reference"],
                        "dequantized": ["--weights", "dequantized"]}.items():
        assert main(["generate", "--checkpoint", str(out), "--prompts", str(prompts),
                     "--max-new-tokens", "6", "--max-context", "64", "--json", *extra]) == 0
        runs[name] = [r["output_ids"] for r in json.loads(capsys.readouterr().out)["requests"]]
    assert runs["spec"] == runs["reference"] == runs["dequantized"]
