"""``nextn-graph bench``: build the engines, measure every bucket, write the report."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoint.loader import weight_bytes
from ..config import RunConfig, compile_peer
from ..runtime.chunks import plan_chunks
from ..launch.ranks import load_on_ranks
from ..machine import run_stamp
from ..parallel.group import TPGroup
from ..progress import progress_bar
from .e2e import bench_temperature, sampling_summary
from .engines import build_engines
from .measure import BenchSettings, bench_bucket, bench_prompts
from .report import check_outputs, write_outputs
from .work import bench_profile


def padding_waste(buckets: tuple[int, ...], max_requests: int) -> dict:
    """Padded rows per batch size 1..max_requests under the bucket policy."""
    rows = []
    for b in range(1, max_requests + 1):
        chunks = plan_chunks(b, buckets)
        padded = sum(bucket - (part.stop - part.start) for part, bucket in chunks)
        rows.append({"batch": b, "padded_rows": padded, "chunks": len(chunks)})
    real = sum(r["batch"] for r in rows)
    return {"per_batch_size": rows,
            "waste": sum(r["padded_rows"] for r in rows) / real}


def _capture(engine, **others) -> dict:
    """The engine's capture records and totals; ``others``: more engines' records, as
    ``NAME_records`` (plain, split, overlap), where they exist."""
    records = [asdict(r) for r in engine.runner.records]
    out = {"records": records, "total_s": sum(r["seconds"] for r in records),
           "total_mb": sum(r["nbytes"] for r in records) / 2**20}
    for name, other in others.items():
        if other is not None:
            out[f"{name}_records"] = [asdict(r) for r in other.runner.records]
    return out


def run_bench(cfg: RunConfig, where: str, st: BenchSettings, out_dir: Path,
              json_path: Path | None = None, progress: bool = True,
              group: TPGroup | None = None) -> dict:
    """On a tensor-parallel group this is rank 0's part; the others follow it."""
    check_outputs(out_dir, json_path)  # a bad path fails now, not after the measurement
    compile_peer(cfg, where)  # and so does a peer the device cannot run
    temperature = bench_temperature(cfg, where)  # and sampling on greedy-only engines
    start = time.perf_counter()
    group = group or TPGroup.single()
    models, per_rank = load_on_ranks(cfg, group, progress)
    engines = build_engines(models, cfg, progress)
    buckets = cfg.graph.buckets
    prompts = bench_prompts(models.cfg.vocab_size, buckets[-1], st.seed)
    # per bucket and repeat: one measurement per engine, then the end-to-end pair,
    # greedy and (bench.temperature > 0) sampling
    pairs = 2 if temperature > 0 else 1
    results, done, total = [], 0, len(buckets) * st.repeats * (len(engines.by_name()) + pairs)

    def tick() -> None:
        nonlocal done
        done += 1
        if progress:
            progress_bar(done, total, "measuring rounds")

    for b in buckets:
        results.append(bench_bucket(engines, prompts[:b], st, tick, temperature))
    speedups = [r["spec_vs_plain"]["speedup"] for r in results]
    report = {
        "settings": {
            "config": where, "run_config": asdict(cfg), "backend": cfg.graph.backend,
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.platform(), "processor": platform.machine(),
            **run_stamp(),
            "threads": torch.get_num_threads(), "bench": asdict(st),
            "graphs": engines.has_graphs,  # False for the eager backend: graph figures null
            # the config's graph round: fused (then split and overlap are measured too),
            # split (the only graph mode), or None without graphs
            "round": ("fused" if engines.fused else "split") if engines.has_graphs else None,
            "phase_rounds": st.phase_rounds,  # rounds timed phase by phase, per repeat
            "compile_peer": (engines.compile_spec.runner.backend.compiler.label
                             if engines.compile_spec else None),
        },
        "capture": (_capture(engines.graph_spec, plain=engines.graph_plain,
                             split=engines.split_spec, overlap=engines.overlap_spec)
                    if engines.has_graphs else None),
        # the compile peer's graphs: compile time (trace + compile + record) and memory
        "compile_capture": _capture(engines.compile_spec) if engines.compile_spec else None,
        # resident weight bytes by storage: FP8/FP4 bits and scales, float tensors
        "weights": weight_bytes(models),
        # tensor parallelism: ranks, and each rank's resident weight bytes, split (its
        # 1/tp of the sharded tensors) and replicated
        "parallel": {"tp": group.size, "weights_per_rank": per_rank},
        "kv_pool_mb": {  # the speculative engine's pools: what a deployment sizes
            "target": engines.spec.models.target_pool.nbytes() / 2**20,
            "draft": engines.spec.models.draft_pool.nbytes() / 2**20,
        },
        "buckets": results,
        "spec_vs_plain": {
            "speedup": statistics.geometric_mean(speedups),
            "acceptance_length": statistics.mean(
                r["spec_vs_plain"]["acceptance_length"] for r in results),
            "draft_acceptance_rate": statistics.mean(
                r["spec_vs_plain"]["draft_acceptance_rate"] for r in results),
            # end to end (B requests of max_new tokens): spec over plain request latency
            "e2e_latency_ratio": statistics.geometric_mean(
                r["e2e"]["latency_ratio"] for r in results),
            "per_bucket": {r["bucket"]: r["spec_vs_plain"] for r in results},
        },
        # end to end, greedy vs every request sampling at bench.temperature (None at 0)
        "sampling": sampling_summary(results, temperature),
        # eager runs each batch at its real size: nothing is padded
        "padding": padding_waste(buckets, cfg.pool.max_requests) if engines.has_graphs else None,
        # nextn-graph profile of this config at its largest bucket (meta device)
        "profile": bench_profile(cfg, models, where),
        "wall_s": time.perf_counter() - start,
    }
    write_outputs(report, out_dir, json_path)
    return report
