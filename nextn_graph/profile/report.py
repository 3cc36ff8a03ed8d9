"""The profile's result: the counted work aggregated per round, phase, module kind and
op, projected on a device spec; and its text rendering."""

from __future__ import annotations

from dataclasses import dataclass

from .specs import DeviceSpec

TOP_WIDTH = 36  # "module kind op" of the top-ops table


@dataclass
class Totals:
    """One slice of the round (a phase, a module kind, an op): sums over its kernels."""

    kernels: int = 0
    nbytes: int = 0
    flops: int = 0
    seconds: float = 0.0  # projected

    def add(self, kernels: int, nbytes: int, flops: int, seconds: float) -> None:
        self.kernels += kernels
        self.nbytes += nbytes
        self.flops += flops
        self.seconds += seconds

    def as_dict(self, spec: DeviceSpec, ideal: int | None = None) -> dict:
        out = {"kernels_per_round": self.kernels, "bytes_per_round": self.nbytes,
               "flops_per_round": self.flops, "projected_ms": 1e3 * self.seconds}
        if ideal is not None:
            out["ideal_bytes_per_round"] = ideal
            out["ideal_ms"] = 1e3 * spec.ideal_seconds(ideal, self.flops)
            out["bytes_vs_ideal"] = self.nbytes / ideal if ideal else None
            out["projected_vs_ideal"] = (self.seconds / spec.ideal_seconds(ideal, self.flops)
                                         if ideal else None)
        return out


def summarize(work: dict[tuple, int], spec: DeviceSpec, ideal: dict[str, int],
              phase_order: tuple[str, ...], top: int,
              launches: dict[str, int] | None = None) -> dict:
    """``work``: (phase, kind, op, read, written, flops) -> calls (``WorkCounter``);
    ``launches``: kernels per call of the ops that launch more than one (each extra
    kernel is charged the floor; the bytes are the op's inputs and outputs)."""
    launches = launches or {}
    total = Totals()
    phases = {p: Totals() for p in phase_order}
    kinds: dict[str, Totals] = {}
    ops: dict[tuple[str, str], Totals] = {}
    for (phase, kind, op, read, written, flops), n in work.items():
        nbytes, k = read + written, launches.get(op, 1)
        seconds = spec.op_seconds(nbytes, flops) + (k - 1) * spec.floor_s
        figures = (n * k, n * nbytes, n * flops, n * seconds)
        for acc in (total, phases.setdefault(phase, Totals()), kinds.setdefault(kind, Totals()),
                    ops.setdefault((kind, op), Totals())):
            acc.add(*figures)
    out = total.as_dict(spec, sum(ideal.values()))
    out["phases"] = {p: t.as_dict(spec, ideal.get(p, 0)) for p, t in phases.items()}
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1].seconds)
    out["modules"] = {k: t.as_dict(spec) for k, t in ranked}
    best = sorted(ops.items(), key=lambda kv: -kv[1].seconds)[:top]
    out["top_ops"] = [{"op": op, "kind": kind, **t.as_dict(spec)} for (kind, op), t in best]
    return out


@dataclass(frozen=True)
class Units:
    """Display units for one report: GB and GFLOPs, or MB and MFLOPs for small models."""

    byte_name: str
    byte_scale: float
    flop_name: str
    flop_scale: float

    @staticmethod
    def for_round(result: dict) -> "Units":
        big = result["bytes_per_round"] >= 1e9
        return Units("GB", 1e9, "GFLOPs", 1e9) if big else Units("MB", 1e6, "MFLOPs", 1e6)

    def head(self, first: str, ideal: bool, width: int = 16) -> str:
        line = (f"{first:<{width}} {'kernels':>9} {self.byte_name + ' touched':>11} "
                f"{self.flop_name:>10} {'projected ms':>13}")
        return line + (f" {'ideal ' + self.byte_name:>9} {'ideal ms':>9}" if ideal else "")

    def row(self, name: str, d: dict, ideal: bool, width: int = 16) -> str:
        line = (f"{name:<{width}} {d['kernels_per_round']:>9,} "
                f"{d['bytes_per_round'] / self.byte_scale:>11.2f} "
                f"{d['flops_per_round'] / self.flop_scale:>10.1f} {d['projected_ms']:>13.3f}")
        if ideal:
            line += (f" {d['ideal_bytes_per_round'] / self.byte_scale:>9.2f} "
                     f"{d['ideal_ms']:>9.4f}")
        return line


def text(result: dict) -> str:
    """The report for a terminal: config, per phase, per module kind, top ops."""
    c, spec, u = result["config"], result["device_spec"], Units.for_round(result)
    mpe = c["max_position_embeddings"]
    lines = [
        "work profile of one steady speculative round (split phases, greedy), every "
        "kernel-launching aten op counted on the meta device",
        f"model   {c['source']}: {c['model']}; {c['dtype']}, weights {c['weights']}",
    ]
    if mpe["built"] != mpe["config"]:
        lines.append(f"        built with max_position_embeddings {mpe['built']} (the pool's "
                     f"max_context; the config's {mpe['config']} gives the same RoPE rows)")
    lines += [
        f"round   bucket {c['bucket']}, num_steps {c['num_steps']} (verify width "
        f"{c['verify_width']}); pool {c['pool']['max_requests']} x {c['pool']['max_context']}; "
        + "; ".join(f"{p} {f['forwards']} x {f['model']} over {f['rows']} rows"
                    for p, f in result["forwards"].items()),
        f"device  PROJECTION for {spec['label']}",
        "",
        u.head("phase", True),
        *(u.row(name, d, True) for name, d in result["phases"].items()),
        u.row("round", result, True),
        f"bytes touched / ideal bytes {_ratio(result['bytes_vs_ideal'])}; projected / ideal "
        f"time {_ratio(result['projected_vs_ideal'])} (projection)",
        "",
        u.head("module kind", False),
        *(u.row(k, d, False) for k, d in result["modules"].items()),
    ]
    if result["top_ops"]:
        lines += ["", f"top {len(result['top_ops'])} ops by projected time (module kind, op)",
                  u.head("", False, TOP_WIDTH)]
        lines += [u.row(f"{t['kind']} {t['op'].removeprefix('aten.')}", t, False, TOP_WIDTH)
                  for t in result["top_ops"]]
    lines += ["", *result["notes"],
              f"profiled in {result['wall_s']['total']:.1f} s (build "
              f"{result['wall_s']['build']:.1f} s, count {result['wall_s']['count']:.1f} s)"]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"
