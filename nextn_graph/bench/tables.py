"""The bench's terminal table, and the rows and summary lines the Markdown report
shares with it."""

from __future__ import annotations

import statistics

from .work import profile_lines

HEADER = ("bucket", "NextN fwd", "eager subm", "graph subm", "replays", "subm ratio",
          "eager ms", "graph ms", "graph/eager", "acc len", "spec/plain")
# the speculative round per graph mode (graph = the config's engine: fused where its round
# is): the split round's submissions and latency, fused over split, fused with overlap on,
# and the graph engine's host ms per round outside replay calls
MODES_HEADER = ("split subm", "split ms", "fused/split", "overlap ms", "host ms")
MODES = ("split", "fused", "overlap")
# with a compile peer (bench.compile_peer): its launches, latency, and latency over graphs
PEER_HEADER = ("compile subm", "compile ms", "compile/graph")
# with tensor parallelism (parallel.tp > 1): device collectives per steady round, eager
# and inside the graphs, and rank 0's control messages (1 per round)
TP_HEADER = ("eager coll", "graph coll", "control")
# the traced modes (``round_trace``), as the outputs name them
TRACE_MODES = (("fused", "fused"), ("overlap", "fused + overlap"))


NO_GRAPH = "-"  # a graph column of the eager backend, which has no graphs
EAGER_NOTE = "the eager backend has no graphs (nothing captured, no padding)"


def _tp(report: dict) -> bool:
    return report.get("parallel", {}).get("tp", 1) > 1


def header(report: dict) -> tuple[str, ...]:
    return (HEADER + MODES_HEADER
            + (PEER_HEADER if report["settings"].get("compile_peer") else ())
            + (TP_HEADER if _tp(report) else ()))


def _tp_cells(r: dict) -> tuple[str, ...]:
    e, g = r["eager"], r["graph"]
    return (str(e["collectives_per_round"]),
            str(g["collectives_per_round"]) if g else NO_GRAPH,
            str((g or e)["control_messages_per_round"]))


def _peer_cells(r: dict) -> tuple[str, ...]:
    p = r["compile"]
    subm = str(p["submissions_per_round"]) + ("" if p["counts_every_launch"] else "+")
    ratio = r["compile_vs_graph_latency"]
    return (subm, f"{p['round_ms_median']:.2f}", f"{ratio:.2f}" if ratio else NO_GRAPH)


def cell(value: float | None, digits: int = 2) -> str:
    """A number with ``digits`` decimals, or ``NO_GRAPH`` where there is none."""
    return NO_GRAPH if value is None else f"{value:.{digits}f}"


def _mode_cells(r: dict) -> tuple[str, ...]:
    m, g = r["round_modes"], r["graph"]
    split = m["split"]
    return (str(split["submissions_per_round"]) if split else NO_GRAPH,
            cell(split and split["round_ms_median"]), cell(r["fused_vs_split_latency"]),
            cell(m["overlap"] and m["overlap"]["round_ms_median"]),
            cell(g and g["host_ms_median"], 3))


def rows(report: dict) -> list[tuple[str, ...]]:
    out = []
    for r in report["buckets"]:
        sp, g = r["spec_vs_plain"], r["graph"]
        graph_cells = (
            (str(g["submissions_per_round"]), str(g["replays_per_round"]),
             f"{r['submission_ratio']:.0f}x") if g else (NO_GRAPH,) * 3)
        out.append((str(r["bucket"]), f"{r['nextn_forwards_per_round']:.0f}",
                    str(r["eager"]["submissions_per_round"]), *graph_cells,
                    f"{r['eager']['round_ms_median']:.2f}",
                    f"{g['round_ms_median']:.2f}" if g else NO_GRAPH,
                    f"{r['latency_ratio']:.2f}" if g else NO_GRAPH,
                    f"{sp['acceptance_length']:.2f}", f"{sp['speedup']:.2f}x",
                    *_mode_cells(r),
                    *(_peer_cells(r) if r.get("compile") else ()),
                    *(_tp_cells(r) if _tp(report) else ())))
    return out


def _capture_line(report: dict) -> str:
    cap, pad = report["capture"], report["padding"]
    if cap is None:
        return f"graph columns {NO_GRAPH}: {EAGER_NOTE}"
    return (f"capture: {len(cap['records'])} graphs in {cap['total_s']:.2f} s, "
            f"{cap['total_mb']:.1f} MiB; padding waste over batch sizes 1.."
            f"{len(pad['per_batch_size'])}: {100 * pad['waste']:.0f}% of real rows")


def _peer_line(report: dict) -> list[str]:
    peer = report["settings"].get("compile_peer")
    if not peer:
        return []
    cap, first = report["compile_capture"], report["buckets"][0]["compile"]
    bound = "" if first["counts_every_launch"] else (
        "; compile subm N+ = aten ops seen, a lower bound (generated kernels are not seen)")
    return [f"compile peer: torch.compile ({peer}), {len(cap['records'])} graphs compiled in "
            f"{cap['total_s']:.1f} s{bound}"]


def geo_mean(values) -> float | None:
    """Geometric mean over buckets of the values that exist (None: none does)."""
    vals = [v for v in values if v is not None]
    return statistics.geometric_mean(vals) if vals else None


def _named(summary: dict) -> str:
    """A graph round's submissions by name: '3 replays + 1 staging + 1 readback'."""
    sub = summary["submissions"]
    parts = [f"{sub['replays']} replay{'s' * (sub['replays'] != 1)}",
             f"{sub['staging_copies']} staging",
             f"{sub['readback_copies']} readback"]
    parts += [f"{sub[k]} {k.replace('_', ' ')}" for k in ("updates", "eager_fallback_ops")
              if sub[k]]
    return " + ".join(p for p in parts if not p.startswith("0 "))


def _modes_line(report: dict) -> list[str]:
    if not report["settings"]["graphs"]:
        return []
    bs = report["buckets"]
    split = bs[0]["round_modes"]["split"]
    fused_split = geo_mean(r["fused_vs_split_latency"] for r in bs)
    if fused_split is None:
        return [f"round: split ({_named(split)} per steady round); graph.round split, so "
                f"no fused or overlap mode"]
    fused = bs[0]["round_modes"]["fused"]
    overlap = geo_mean(r["overlap_vs_fused_latency"] for r in bs)
    return [f"round modes per steady round: fused {_named(fused)}, split {_named(split)}; "
            f"latency fused/split {fused_split:.2f}, overlap/fused {cell(overlap)} "
            f"(geometric means over buckets)"]


def trace_order(trace: dict) -> str:
    """A trace's event order, as 'L0 R-1 L1 R0 ...' (L: launch, R: read, then round)."""
    return " ".join(f"{e['event'][0].upper()}{e['round']}" for e in trace["events"])


def trace_verdict(trace: dict) -> str:
    """Which of a trace's orders held in every (read k, launch k+1) pair."""
    if trace["launch_before_prev_read"]:
        return "launch k+1 before read k"
    if trace["read_before_next_launch"]:
        return "read k before launch k+1"
    return "neither order in every round"


def _trace_line(report: dict) -> list[str]:
    """The per-round trace of the fused round, overlap off and on, over buckets."""
    parts, rounds = [], None
    for mode, label in reversed(TRACE_MODES):
        traces = [r["round_trace"][mode] for r in report["buckets"]
                  if r["round_trace"][mode] is not None]
        if not traces:
            continue
        rounds = traces[0]["rounds"]
        verdicts = {trace_verdict(t) for t in traces}
        verdict = verdicts.pop() if len(verdicts) == 1 else "mixed over buckets"
        parts.append(f"{label}: {verdict}, "
                     f"{statistics.mean(t['overlapped_per_round'] for t in traces):.2f} "
                     f"overlapped per round, read wait "
                     f"{statistics.median(t['read_wait_ms_median'] for t in traces):.3f} ms")
    if not parts:
        return []
    return [f"per-round trace ({rounds} steady rounds per bucket): "
            + "; ".join(parts) + " (read wait: median over buckets)"]


def _phase_source(r: dict) -> tuple[str, dict | None]:
    """The phase times a bucket shows first: the split graphs', else eager's."""
    split = r["round_modes"]["split"]
    if split and split["phase_times"]:
        return "split graphs", split["phase_times"]
    return "eager", r["eager"]["phase_times"]


def _cost_line(report: dict) -> list[str]:
    bs, sv = report["buckets"], report["spec_vs_plain"]
    name = _phase_source(bs[0])[0]
    dv = geo_mean(_phase_source(r)[1]["draft_vs_verify"] for r in bs)
    e2e = bs[0]["e2e"]
    return [f"end to end (B requests of {e2e['max_new_tokens']} tokens, equal batch): "
            f"latency spec/plain {sv['e2e_latency_ratio']:.2f}; draft/verify time "
            f"{cell(dv)} ({name}); geometric means over buckets"]


def _sampling_line(report: dict) -> list[str]:
    """End to end, greedy vs every request sampling at bench.temperature (none at 0)."""
    smp = report["sampling"]
    if smp is None:
        return []
    g, s = smp["greedy"], smp["sampled"]
    return [f"greedy vs sampling at temperature {smp['temperature']:g} (seed = request "
            f"index), end to end: acceptance length {g['acceptance_length']:.2f} vs "
            f"{s['acceptance_length']:.2f}, latency spec/plain {g['latency_ratio']:.2f} vs "
            f"{s['latency_ratio']:.2f}, throughput spec/plain {g['throughput_ratio']:.2f}x "
            f"vs {s['throughput_ratio']:.2f}x (means / geometric means over buckets)"]


def summary_lines(report: dict) -> list[str]:
    sv, s = report["spec_vs_plain"], report["settings"]
    return [_capture_line(report), *_peer_line(report),
            f"speculative vs plain on {s['backend']}: {sv['speedup']:.2f}x at acceptance "
            f"length {sv['acceptance_length']:.2f} (strict draft acceptance "
            f"{sv['draft_acceptance_rate']:.2f})", *_modes_line(report),
            *_trace_line(report), *_cost_line(report), *_sampling_line(report),
            *profile_lines(report)]


def table(report: dict) -> str:
    cells = [header(report), *rows(report)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    s = report["settings"]
    tp = report.get("parallel", {}).get("tp", 1)
    head = (f"{s['date']}, {s['cpu']} x{s['cores']}: backend {s['backend']}, "
            f"torch {s['torch']}, {s['threads']} thread(s)"
            f"{f', tp {tp} ranks' if tp > 1 else ''}; "
            f"per steady round, medians of {s['bench']['repeats']} repeats")
    return "\n".join([head, *lines, *summary_lines(report)])
