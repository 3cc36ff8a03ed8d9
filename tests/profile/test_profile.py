"""``nextn-graph profile``: the work of one speculative round counted on the meta device.

The count is the real one (the same ops, phase by phase, as the round run for real on
CPU tensors of the same shapes), the byte and FLOP rules hold on hand-made ops, the
ideal follows its definition, and the command's JSON and errors are as documented.
"""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import torch

from nextn_graph.bench.work import bench_profile, profile_lines, profile_section
from nextn_graph.cli import main
from nextn_graph.config import load_run_config
from nextn_graph.graph.kinds import GraphKey
from nextn_graph.profile.counting import OpCounter
from nextn_graph.model import config as model_config
from nextn_graph.model.config import config_from_dict
from nextn_graph.model.quant import QuantLinear
from nextn_graph.checkpoint.presets import TINY, preset_config
from nextn_graph.profile import ProfileSettings, profile_round
from nextn_graph.profile.build import (build_config, count_round, profile_models,
                                       quantized_plan, decode_round)
from nextn_graph.profile.counter import WorkCounter
from nextn_graph.profile.flops import FORMULAS
from nextn_graph.profile.ideal import forward_weights
from nextn_graph.profile.kinds import KindResolver
from nextn_graph.profile.specs import DEVICE_SPECS

KEYS = ("kernels_per_round", "bytes_per_round", "flops_per_round", "ideal_bytes_per_round",
        "projected_ms", "ideal_ms")
SMALL = ProfileSettings(bucket=2, max_requests=4, max_context=64)
# the tiny model with 16 routed experts: top-2 of T = 8 verify rows leaves some idle
MORE_EXPERTS = config_from_dict({**TINY, "n_routed_experts": 16}, "16 experts")


def _work(cfg, st: ProfileSettings, device: str = "meta", memo: bool = True):
    models = profile_models(build_config(cfg, st.max_context), st.weights, st.dtype, device)
    counter = WorkCounter(KindResolver(), memo=memo)
    count_round(decode_round(models, st), st.bucket, counter)
    return counter


def test_v4_flash_preset_is_the_release():
    """43 layers, 256 experts, 3 hash layers, 1M positions; compress ratios as the
    release lists them: layers 0-1 SWA, C4 on even layers 2..42, C128 on odd 3..41."""
    cfg = preset_config("v4-flash")
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_hash_layers) == (43, 256, 3)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok) == (4096, 2048, 6)
    assert cfg.max_position_embeddings == 1048576
    yarn = cfg.rope_scaling
    assert (yarn.factor, yarn.original_max_position_embeddings) == (16, 65536)
    ratios = cfg.compress_ratios
    assert len(ratios) == 44 and ratios[43] == 0
    assert [i for i, r in enumerate(ratios) if r == 0] == [0, 1, 43]
    assert [i for i, r in enumerate(ratios) if r == 4] == list(range(2, 43, 2))
    assert [i for i, r in enumerate(ratios) if r == 128] == list(range(3, 42, 2))


def test_v4_flash_is_never_built_with_memory(monkeypatch, capsys):
    """Building it for real (random weights) is refused before any tensor, on a host
    with less than the ~1.1 TB it needs as built."""
    monkeypatch.setattr(model_config, "physical_memory_bytes", lambda: 64 * 2**30)
    assert main(["make-checkpoint", "--preset", "v4-flash", "--out", "/nonexistent/x"]) == 2
    assert "GiB" in capsys.readouterr().err


def test_profile_is_deterministic_and_adds_up():
    first = profile_round(preset_config("tiny"), SMALL, "tiny")
    second = profile_round(preset_config("tiny"), SMALL, "tiny")
    for key in KEYS[:4]:
        assert first[key] == second[key]
        assert first[key] == sum(p[key] for p in first["phases"].values())
    assert list(first["phases"]) == ["rollout", "target_verify", "draft_extend"]
    for key in ("kernels_per_round", "bytes_per_round", "flops_per_round"):
        assert first[key] == sum(m[key] for m in first["modules"].values())
    assert first["projected_ms"] == pytest.approx(
        sum(p["projected_ms"] for p in first["phases"].values()))


@pytest.mark.parametrize("cfg,weights", [(preset_config("tiny"), "dequantized"),
                                         (preset_config("tiny"), "quantized"),
                                         (MORE_EXPERTS, "dequantized")],
                         ids=["tiny", "tiny-quantized", "16-experts"])
def test_meta_count_is_the_real_count(cfg, weights):
    """The meta round's kernels per phase equal OpCounter's count of the same round run
    for real on CPU tensors of the same shapes (uninitialised weights: values do not
    change which ops a capture-safe round runs)."""
    st = ProfileSettings(bucket=2, max_requests=4, max_context=64, weights=weights)
    meta = _work(cfg, st).per_phase()
    models = profile_models(build_config(cfg, st.max_context), weights, st.dtype, "cpu")
    rnd = decode_round(models, st)
    with torch.no_grad(), OpCounter() as real:
        for phase in rnd.phases:
            with real.phase(str(phase)):
                rnd.run(GraphKey(phase, st.bucket))
    assert meta == dict(real.per_phase)


def test_memo_changes_nothing():
    """Rebuilding repeated meta outputs from metadata records exactly the same work."""
    assert _work(MORE_EXPERTS, SMALL, memo=True).work == _work(MORE_EXPERTS, SMALL,
                                                                memo=False).work


def _one_op(fn, *tensors) -> tuple[str, int, int, int]:
    """(op, bytes read, bytes written, FLOPs) of the single kernel ``fn`` launches."""
    counter = WorkCounter(KindResolver())
    with counter:
        fn(*tensors)
    assert counter.kernels == 1, counter.work
    (_, _, op, read, written, flops), = counter.work
    return op, read, written, flops


def test_gather_reads_only_the_rows_it_outputs():
    table, idx = torch.zeros(1000, 64), torch.tensor([3, 1, 4])
    row = 64 * 4
    expect = 3 * row + 3 * 8, 3 * row
    assert _one_op(lambda t, i: t.index_select(0, i), table, idx)[1:3] == expect
    assert _one_op(lambda t, i: t[i], table, idx)[1:3] == expect
    assert _one_op(torch.nn.functional.embedding, idx, table)[1:3] == expect


def test_expanded_tensor_counts_once():
    row = torch.zeros(1, 64).expand(100, 64)  # stride 0 over the 100 rows
    op, read, written, _ = _one_op(lambda x: x + 1.0, row)
    assert (op, read, written) == ("aten.add", 64 * 4, 100 * 64 * 4)


def test_in_place_ops_count_their_destination_once_and_scatters_the_values():
    dest, src = torch.zeros(1000, 64), torch.ones(1000, 64)
    assert _one_op(lambda d, s: d.add_(s), dest, src)[1:3] == (1000 * 64 * 4, 1000 * 64 * 4)
    idx, vals = torch.tensor([5, 7, 9]), torch.ones(3, 64)
    op, read, written, _ = _one_op(lambda d, i, v: d.index_put_((i,), v), dest, idx, vals)
    assert (read, written) == (3 * 64 * 4 + 3 * 8, 3 * 64 * 4)
    op, read, written, _ = _one_op(lambda d, i, v: d.index_copy_(0, i, v), dest, idx, vals)
    assert (op, read, written) == ("aten.index_copy_", 3 * 64 * 4 + 3 * 8, 3 * 64 * 4)


def test_grouped_mm_reads_only_the_groups_with_rows():
    """2 rows over 8 expert groups: 2 groups' weights are read, not 8."""
    x = torch.empty(2, 128, dtype=torch.bfloat16, device="meta")
    w = torch.empty(8, 256, 128, dtype=torch.bfloat16, device="meta")  # [G, out, in]
    offs = torch.empty(8, dtype=torch.int32, device="meta")
    op, read, written, flops = _one_op(
        lambda a, b, o: torch._grouped_mm(a, b.transpose(-2, -1), offs=o), x, w, offs)
    assert op == "aten._grouped_mm"
    assert read == 2 * 128 * 2 + 2 * (256 * 128 * 2) + 8 * 4
    assert (written, flops) == (2 * 256 * 2, 2 * 2 * 128 * 256)


def test_matmul_flops():
    a, b = torch.zeros(4, 8), torch.zeros(8, 16)
    assert _one_op(torch.mm, a, b)[3] == 2 * 4 * 8 * 16
    x, out = torch.zeros(5, 64), torch.zeros(5, 32)  # FP4 weight [32, 32] holds in/2
    formula = FORMULAS["nextn_graph.quant_linear"]
    assert formula((x, torch.zeros(32, 32)), {}, out) == 2 * 5 * 32 * 64
    assert _one_op(torch.exp, a)[3] == 0  # elementwise FLOPs are not counted


def test_ideal_bytes_follow_their_definition():
    """Whole weights once; embedding and hash table by row; min(E, T*k) of E experts."""
    state = {"embed.weight": torch.zeros(100, 8, dtype=torch.bfloat16),  # 1600 B, 100 rows
             "layers.0.ffn.gate.tid2eid": torch.zeros(100, 2, dtype=torch.int64),  # 1600 B
             "norm.weight": torch.zeros(8, dtype=torch.bfloat16),  # 16 B
             **{f"layers.0.ffn.experts.{e}.w1.weight": torch.zeros(4, 8, dtype=torch.bfloat16)
                for e in range(8)}}  # 64 B each
    fw = forward_weights(state, experts=8, topk=2)
    assert fw.bytes_for(1) == 16 + 16 + 16 + 2 * 64
    assert fw.bytes_for(3) == 16 + 48 + 48 + 6 * 64
    assert fw.bytes_for(1000) == 16 + 1600 + 1600 + 8 * 64


def test_quantized_weights_are_quantlinears_and_need_fewer_bytes():
    models = profile_models(build_config(preset_config("tiny"), 64), "quantized", torch.bfloat16)
    quant = {name for m in (models.target, models.draft) for name, mod in m.named_modules()
             if isinstance(mod, QuantLinear)}
    plan = quantized_plan(models)
    assert len(quant) == len(plan) > 0
    assert {f for f in plan.values()} == {"fp8", "fp4"}
    st = dict(bucket=2, max_requests=4, max_context=64)
    plain = profile_round(preset_config("tiny"), ProfileSettings(**st), "tiny")
    quantized = profile_round(preset_config("tiny"),
                              ProfileSettings(**st, weights="quantized"), "tiny")
    assert quantized["ideal_bytes_per_round"] < plain["ideal_bytes_per_round"]


def test_every_op_has_a_module_kind():
    """No op of the round falls to 'other'; the MoE splits into gate, routed, shared."""
    result = profile_round(MORE_EXPERTS, SMALL, "16 experts")
    assert "other" not in result["modules"]
    assert {"moe_gate", "moe_routed", "moe_shared", "attention", "mhc", "kv_cache", "head",
            "embed", "norm", "accept/sampling"} <= set(result["modules"])


def test_json_has_the_documented_keys(capsys):
    assert main(["profile", "--preset", "tiny", "--bucket", "2", "--max-context", "64",
                 "--device-spec", "910b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in KEYS:
        assert isinstance(out[key], (int, float)), key
        for phase in out["phases"].values():
            assert key in phase
    assert set(out["modules"]) and all("projected_ms" in m for m in out["modules"].values())
    c = out["config"]
    assert (c["preset"], c["bucket"], c["num_steps"], c["weights"], c["device_spec"]) == (
        "tiny", 2, 3, "dequantized", "910b")
    assert c["pool"] == {"max_requests": 8, "max_context": 64} and c["context_len"] is None
    assert out["device_spec"]["bandwidth"] == DEVICE_SPECS["910b"].bandwidth


def test_text_report_labels_the_projection(capsys):
    assert main(["profile", "--preset", "tiny", "--max-context", "64", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "PROJECTION" in out and "round" in out and "top 3 ops" in out


@pytest.mark.parametrize("argv,needle", [
    (["--preset", "nope"], "'nope'"),
    (["--preset", "tiny", "--device-spec", "a100"], "'a100'"),
    (["--preset", "tiny", "--bucket", "0"], "'0'"),
    (["--preset", "tiny", "--context-len", "0"], "'0'"),
])
def test_bad_options_exit_2_naming_the_value(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["profile", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,needles", [
    (["--preset", "tiny", "--bucket", "9"], ("bucket 9", "max_requests 8")),
    (["--preset", "tiny", "--max-context", "4096"], ("max_context 4096", "512")),
    (["--checkpoint", "/no/such/dir"], ("/no/such/dir",)),
    (["--preset", "tiny", "--max-context", "64", "--context-len", "64"],
     ("context_len 64", "max_context 64")),
])
def test_bad_values_are_one_line_errors(capsys, argv, needles):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nextn-graph: error: "), err
    assert all(n in lines[0] for n in needles), err


def test_config_source_takes_its_pool_and_steps(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("pool: {max_requests: 3, max_context: 96}\nspeculative: {num_steps: 2}\n")
    assert main(["profile", "--config", str(path), "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["config"]
    assert (c["num_steps"], c["pool"], c["checkpoint"]) == (
        2, {"max_requests": 3, "max_context": 96}, "builtin:tiny-trained")


def test_bench_section_sets_profile_beside_the_eager_count(trained):
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 64},
                          graph={"buckets": [1, 2]})
    start = time.perf_counter()
    profile = bench_profile(cfg, trained, "test")
    assert time.perf_counter() - start < 5  # the bench's own config: well under a second
    assert profile["config"]["bucket"] == 2 and profile["config"]["dtype"] == "fp32"
    eager = {k: v["kernels_per_round"] for k, v in profile["phases"].items()}
    report = {"profile": profile, "buckets": [{"bucket": 2, "eager": {"submissions": {
        **eager, "outside_phases": 7}}}]}
    line, = profile_lines(report)
    assert f"{profile['kernels_per_round']} kernels per round (eager, measured: " \
           f"{profile['kernels_per_round']})" in line and "PROJECTION" in line
    section = profile_section(report)
    assert "## Work profile" in section and "| round |" in section


def test_v4_flash_round_on_meta(capsys):
    """The full released config builds and counts on meta (no memory): every phase
    runs, the RoPE tables are built at the pool's length, and the ideal follows the
    experts a bucket can reach (about 8 s on two cores: not marked slow)."""
    assert main(["profile", "--preset", "v4-flash", "--bucket", "1", "--json",
                 "--top", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["max_position_embeddings"] == {"config": 1048576, "built": 8192}
    assert out["kernels_per_round"] == sum(p["kernels_per_round"]
                                           for p in out["phases"].values())
    # verify at B1: T = 4 rows x top-6 = 24 of 256 experts per layer, 3 x 4096 x 2048
    # bf16 each, over 43 layers
    routed = 43 * 24 * 3 * 4096 * 2048 * 2
    assert routed < out["phases"]["target_verify"]["ideal_bytes_per_round"] < routed + 20e9
    assert out["bytes_per_round"] >= out["ideal_bytes_per_round"]
    assert math.isfinite(out["projected_ms"]) and out["projected_ms"] > out["ideal_ms"]
    print(out["wall_s"], file=sys.stderr)
