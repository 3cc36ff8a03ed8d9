"""The bench's work profile: ``nextn_graph.profile`` of the bench's own config (its
model, pool and num_steps, at its largest bucket, in its dtype), with the eager round's
measured kernel count beside the profile's, phase by phase."""

from __future__ import annotations

from ..checkpoint.loader import LoadedModel
from ..config import RunConfig
from ..model.quant import QuantLinear
from ..profile import ProfileSettings, profile_round

# the device a config's projection is for: its own kind's reference part
SPEC_FOR_DEVICE = {"npu": "910b"}
DEFAULT_SPEC = "h200"


def bench_profile(cfg: RunConfig, models: LoadedModel, where: str) -> dict:
    """The profile's JSON for the bench config (``report["profile"]``)."""
    quantized = any(isinstance(m, QuantLinear) for m in models.target.modules())
    st = ProfileSettings(bucket=cfg.graph.buckets[-1], num_steps=cfg.speculative.num_steps,
                         max_requests=cfg.pool.max_requests, max_context=cfg.pool.max_context,
                         weights="quantized" if quantized else "dequantized",
                         dtype=cfg.torch_dtype,
                         device_spec=SPEC_FOR_DEVICE.get(cfg.device, DEFAULT_SPEC))
    return profile_round(models.cfg, st, f"bench config {where}", top=5,
                         origin={"config": where, "checkpoint": cfg.checkpoint})


def _eager_phases(report: dict) -> dict | None:
    """The eager round's measured kernels per phase at the profiled bucket, if measured."""
    bucket = report["profile"]["config"]["bucket"]
    for r in report["buckets"]:
        if r["bucket"] == bucket:
            return {k: v for k, v in r["eager"]["submissions"].items()
                    if k in report["profile"]["phases"]}
    return None


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def profile_lines(report: dict) -> list[str]:
    """A line for the terminal summary (none without a profile)."""
    p = report.get("profile")
    if p is None:
        return []
    c, eager = p["config"], _eager_phases(report)
    measured = (f" (eager, measured: {sum(eager.values())})" if eager else "")
    return [f"work profile (meta device, bucket {c['bucket']}, {c['dtype']}; PROJECTION for "
            f"{c['device_spec']}): {p['kernels_per_round']} kernels per round{measured}, "
            f"{_mb(p['bytes_per_round'])} touched vs {_mb(p['ideal_bytes_per_round'])} of "
            f"weights ideally ({p['bytes_vs_ideal']:.1f}x); projected {p['projected_ms']:.2f} "
            f"ms vs ideal {p['ideal_ms']:.3f} ms"]


def profile_section(report: dict) -> str:
    """The Markdown section."""
    p = report.get("profile")
    if p is None:
        return "## Work profile\n\nNone."
    c, eager = p["config"], _eager_phases(report) or {}
    eager_round = sum(eager.values()) if eager else "-"
    rows = [f"| {name} | {d['kernels_per_round']} | {eager.get(name, eager_round)} | "
            f"{d['bytes_per_round'] / 1e6:.2f} | {d['ideal_bytes_per_round'] / 1e6:.2f} | "
            f"{d['flops_per_round'] / 1e6:.1f} | {d['projected_ms']:.3f} | {d['ideal_ms']:.4f} |"
            for name, d in [*p["phases"].items(), ("round", p)]]
    kinds = ", ".join(f"{k} {d['kernels_per_round']}" for k, d in p["modules"].items())
    return f"""## Work profile

`nextn-graph profile` of this config at bucket {c['bucket']} (the same JSON is
`profile` in bench.json): one steady split round, num_steps {c['num_steps']}, pool
{c['pool']['max_requests']} x {c['pool']['max_context']}, {c['dtype']}, weights {c['weights']};
every kernel-launching aten op counted on the meta device, beside the eager round's
kernels measured at that bucket. Ideal: weights read once per forward, active experts
only (KV reads excluded). Projected ms is a roofline PROJECTION for
{p['device_spec']['label']}.

| phase | kernels | eager, measured | MB touched | ideal MB | MFLOPs | projected ms | ideal ms |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Kernels by module kind: {kinds}."""
