"""Bench outputs: the terminal table, JSON, a Markdown report and PNG plots.

Output paths are checked before the bench measures anything (``check_outputs``);
the files are rendered in memory and written as one set (``files.commit_files``).
"""

from __future__ import annotations

import io
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from ..errors import InputError  # noqa: E402
from .files import commit_files, creatable_dir  # noqa: E402

PLOTS = ("round_latency.png", "submissions.png", "speedup_vs_acceptance.png",
         "round_modes.png")
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


NO_GRAPH = "-"  # a graph column of the eager backend, which has no graphs
EAGER_NOTE = "the eager backend has no graphs (nothing captured, no padding)"


def _tp(report: dict) -> bool:
    return report.get("parallel", {}).get("tp", 1) > 1


def _header(report: dict) -> tuple[str, ...]:
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


def _ms(value: float | None, digits: int = 2) -> str:
    return NO_GRAPH if value is None else f"{value:.{digits}f}"


def _mode_cells(r: dict) -> tuple[str, ...]:
    m, g = r["round_modes"], r["graph"]
    split = m["split"]
    return (str(split["submissions_per_round"]) if split else NO_GRAPH,
            _ms(split and split["round_ms_median"]), _ms(r["fused_vs_split_latency"]),
            _ms(m["overlap"] and m["overlap"]["round_ms_median"]),
            _ms(g and g["host_ms_median"], 3))


def _rows(report: dict) -> list[tuple[str, ...]]:
    rows = []
    for r in report["buckets"]:
        sp, g = r["spec_vs_plain"], r["graph"]
        graph_cells = (
            (str(g["submissions_per_round"]), str(g["replays_per_round"]),
             f"{r['submission_ratio']:.0f}x") if g else (NO_GRAPH,) * 3)
        rows.append((str(r["bucket"]), f"{r['nextn_forwards_per_round']:.0f}",
                     str(r["eager"]["submissions_per_round"]), *graph_cells,
                     f"{r['eager']['round_ms_median']:.2f}",
                     f"{g['round_ms_median']:.2f}" if g else NO_GRAPH,
                     f"{r['latency_ratio']:.2f}" if g else NO_GRAPH,
                     f"{sp['acceptance_length']:.2f}", f"{sp['speedup']:.2f}x",
                     *_mode_cells(r),
                     *(_peer_cells(r) if r.get("compile") else ()),
                     *(_tp_cells(r) if _tp(report) else ())))
    return rows


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


def _geo(values) -> float | None:
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
    fused_split = _geo(r["fused_vs_split_latency"] for r in bs)
    if fused_split is None:
        return [f"round: split ({_named(split)} per steady round); graph.round split, so "
                f"no fused or overlap mode"]
    fused = bs[0]["round_modes"]["fused"]
    overlap = _geo(r["overlap_vs_fused_latency"] for r in bs)
    return [f"round modes per steady round: fused {_named(fused)}, split {_named(split)}; "
            f"latency fused/split {fused_split:.2f}, overlap/fused {_ms(overlap)} "
            f"(geometric means over buckets)"]


def _phase_source(r: dict) -> tuple[str, dict | None]:
    """The phase times a bucket shows first: the split graphs', else eager's."""
    split = r["round_modes"]["split"]
    if split and split["phase_times"]:
        return "split graphs", split["phase_times"]
    return "eager", r["eager"]["phase_times"]


def _cost_line(report: dict) -> list[str]:
    bs, sv = report["buckets"], report["spec_vs_plain"]
    name = _phase_source(bs[0])[0]
    dv = _geo(_phase_source(r)[1]["draft_vs_verify"] for r in bs)
    e2e = bs[0]["e2e"]
    return [f"end to end (B requests of {e2e['max_new_tokens']} tokens, equal batch): "
            f"latency spec/plain {sv['e2e_latency_ratio']:.2f}; draft/verify time "
            f"{_ms(dv)} ({name}); geometric means over buckets"]


def _summary_lines(report: dict) -> list[str]:
    sv, s = report["spec_vs_plain"], report["settings"]
    return [_capture_line(report), *_peer_line(report),
            f"speculative vs plain on {s['backend']}: {sv['speedup']:.2f}x at acceptance "
            f"length {sv['acceptance_length']:.2f} (strict draft acceptance "
            f"{sv['draft_acceptance_rate']:.2f})", *_modes_line(report), *_cost_line(report)]


def table(report: dict) -> str:
    header = _header(report)
    rows = [header, *_rows(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    s = report["settings"]
    tp = report.get("parallel", {}).get("tp", 1)
    head = (f"backend {s['backend']}, torch {s['torch']}, {s['threads']} thread(s)"
            f"{f', tp {tp} ranks' if tp > 1 else ''}; "
            f"per steady round, medians of {s['bench']['repeats']} repeats")
    return "\n".join([head, *lines, *_summary_lines(report)])


def markdown(report: dict) -> str:
    header = _header(report)
    rows = [header, ("---",) * len(header), *_rows(report)]
    body = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    noise = ", ".join(f"B={r['bucket']}: eager {100 * r['eager']['noise']:.0f}%"
                      + (f" / graph {100 * r['graph']['noise']:.0f}%" if r["graph"] else "")
                      for r in report["buckets"])
    s = report["settings"]
    return f"""# nextn_graph replay benchmark

Config `{s['config']}`, backend `{s['backend']}`, torch {s['torch']}, {s['machine']},
{s['threads']} thread(s). Per steady round (every request running, none admitted);
submissions are {_counted_as(report)}.

{body}

{chr(10).join(_summary_lines(report))}

Spread of the repeat medians (max - min over median): {noise}.

{_modes_section(report)}

{_cost_section(report)}

{_capture_section(report)}

![round latency](round_latency.png) ![submissions](submissions.png)
![speed-up vs acceptance](speedup_vs_acceptance.png) ![round modes](round_modes.png)

{JSON_KEYS}
"""


# What the JSON's per-bucket keys of the round modes and the cost model hold.
JSON_KEYS = """## JSON keys (per bucket, `buckets[i]`)

- `round_modes.{split,fused,overlap}`: the speculative round per graph mode (null where
  not measured: fused and overlap exist only where the config's round is fused, overlap
  only where it can work, not on NPU graphs; `fused` is then the `graph` engine, overlap
  off). Each: `submissions` (replays, staging_copies,
  readback_copies, updates, eager_fallback_ops) of one steady round, `replays_per_round`,
  `round_ms_median`, `host_ms_median`, `tpot_ms`, `phase_times` (split only).
- `fused_vs_split_latency`, `overlap_vs_fused_latency`: round latency ratios.
- `host_ms_median` (every graph summary and the compile peer): round wall time minus
  the time inside graph replay calls (`runner.replay_s`), median per steady round. On
  the CPU emulator a replay runs its kernels, so this is host overhead; on a device a
  replay call is a launch, and the readback's wait for the device lands here.
- `phase_times` (eager spec and split graphs): mean ms per round of each phase
  (`phase_ms`: rollout, target_verify, draft_extend), `outside_phases_ms` (staging,
  readback, bookkeeping), `round_ms_mean`, `draft_ms` (rollout + draft extend, which
  includes acceptance), `verify_ms`, `draft_vs_verify`, over `rounds` rounds timed
  apart from the timed ones; `synchronized`: a device sync around each phase (not CPU).
- `tpot_ms` (every summary): median round latency over the tokens a request gets per
  round (acceptance length speculative, 1 plain).
- `spec_vs_plain.tpot_ms.{spec,plain}`, `spec_vs_plain.break_even_acceptance_length`:
  speculative round over plain round latency, the acceptance length above which
  speculation pays off.
- `e2e`: `requests` (= bucket) requests of `max_new_tokens` each (no stop token) added at
  once and run to completion, speculative and plain on the config's backend:
  `spec`/`plain` `latency_ms_median` and `latency_ms_max` (add_request to last token,
  prefill included), `output_tokens_per_s`; `latency_ratio` and `throughput_ratio`
  (spec over plain)."""


def _modes_section(report: dict) -> str:
    if not report["settings"]["graphs"]:
        return f"## Round modes\n\nNone: {EAGER_NOTE}."
    rows = []
    for r in report["buckets"]:
        m = r["round_modes"]
        vs = {"fused": r["fused_vs_split_latency"], "overlap": r["overlap_vs_fused_latency"]}
        for mode in MODES:
            g = m[mode]
            if g is None:
                continue
            sub = g["submissions"]
            rows.append(f"| {r['bucket']} | {mode} | {sub['replays']} | "
                        f"{sub['staging_copies']} | {sub['readback_copies']} | "
                        f"{sub['updates']} | {g['submissions_per_round']} | "
                        f"{g['round_ms_median']:.2f} | {g['host_ms_median']:.3f} | "
                        f"{g['tpot_ms']:.2f} | {_ms(vs.get(mode))} |")
    return f"""## Round modes

The speculative round per graph mode, one steady round: split (rollout, verify and
draft extend as three graphs, as SGLang), fused (one graph that flips the staged slots
itself: the `graph` engine), fused with overlap on (round k+1 launched before round k's
readback). host ms: round wall time outside graph replay calls. vs: fused over split,
overlap over fused (latency).

| bucket | mode | replays | staging | readbacks | updates | submissions | round ms | host ms | TPOT ms | vs |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}"""


def _cost_section(report: dict) -> str:
    phase_rows, e2e_rows = [], []
    for r in report["buckets"]:
        sources = [("eager", r["eager"]["phase_times"])]
        if r["round_modes"]["split"]:
            sources.append(("split graphs", r["round_modes"]["split"]["phase_times"]))
        for name, t in sources:
            ms = t["phase_ms"]
            phase_rows.append(
                f"| {r['bucket']} | {name} | {_ms(ms.get('rollout'))} | "
                f"{_ms(ms.get('target_verify'))} | {_ms(ms.get('draft_extend'))} | "
                f"{t['outside_phases_ms']:.2f} | {t['round_ms_mean']:.2f} | "
                f"{_ms(t['draft_vs_verify'])} |")
        sp, e = r["spec_vs_plain"], r["e2e"]
        e2e_rows.append(
            f"| {r['bucket']} | {sp['tpot_ms']['spec']:.2f} | {sp['tpot_ms']['plain']:.2f} | "
            f"{sp['break_even_acceptance_length']:.2f} | {sp['acceptance_length']:.2f} | "
            f"{e['spec']['latency_ms_median']:.1f} | {e['plain']['latency_ms_median']:.1f} | "
            f"{e['latency_ratio']:.2f} | {e['spec']['output_tokens_per_s']:.0f} | "
            f"{e['plain']['output_tokens_per_s']:.0f} |")
    first = report["buckets"][0]
    sync = ("each phase between device syncs" if first["eager"]["phase_times"]["synchronized"]
            else "on CPU every kernel has run when a phase returns")
    return f"""## Cost model

A speculative round costs rollout + verify + draft extend (acceptance included) +
bookkeeping, against one plain decode step per token. Mean ms per round over
{report['settings']['phase_rounds']} phase-timed rounds per repeat ({sync}):

| bucket | engine | rollout ms | verify ms | draft extend ms | outside phases ms | round ms | draft/verify |
|---|---|---|---|---|---|---|---|
{chr(10).join(phase_rows)}

Time per output token (round latency over tokens per request-round), the break-even
acceptance length (speculative round over plain round), and end to end at equal batch:
B requests of {first['e2e']['max_new_tokens']} tokens added at once and run to completion
(latency from add_request to the last token, median over requests and repeats; output
throughput of the batch), on the config's backend:

| bucket | TPOT spec ms | TPOT plain ms | break-even acc len | acc len | e2e spec ms | e2e plain ms | e2e spec/plain | spec tok/s | plain tok/s |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(e2e_rows)}"""


def _counted_as(report: dict) -> str:
    """What a submission is, per mode, as the measurement named it."""
    first = report["buckets"][0]
    text = f"{first['eager']['counted_as']} in eager mode"
    if first["graph"]:
        text += f"; {first['graph']['counted_as']} in graph mode"
    if first.get("compile"):
        text += f"; {first['compile']['counted_as']} for the compile peer"
    return text


def _capture_section(report: dict) -> str:
    cap = report["capture"]
    if cap is None:
        return f"## Capture\n\nNone: {EAGER_NOTE}."
    caps = "\n".join(
        f"| {c['kind']} | {c['bucket']} | {c['seconds'] * 1000:.1f} | "
        f"{c['nbytes'] / 2**20:.2f} | {c['ops']} |" for c in cap["records"])
    pad = report["padding"]
    return f"""## Capture

| kind | bucket | ms | MiB | ops |
|---|---|---|---|---|
{caps}

Total {cap['total_s']:.2f} s. Padding waste over batch sizes 1..{len(pad['per_batch_size'])}:
{100 * pad['waste']:.0f}% of real rows."""


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def plots(report: dict) -> dict[str, bytes]:
    """The PNG plots, by file name (``PLOTS``), rendered in memory."""
    buckets = [r["bucket"] for r in report["buckets"]]
    x = range(len(buckets))
    graphs = report["settings"]["graphs"]
    modes = ("eager", "graph") if graphs else ("eager",)  # eager: no graph bars to show
    versus = "eager vs graph" if graphs else "eager (no graphs)"
    peer = report["settings"].get("compile_peer")
    first = report["buckets"][0].get("compile")
    # the peer's launches are drawn only where every launch was counted
    peer_counted = bool(first and first["counts_every_launch"])

    def bars(key: str, ylabel: str, title: str, log: bool, with_peer: bool) -> bytes:
        fig, ax = plt.subplots(figsize=(6, 4))
        shown = modes + (("compile",) if with_peer else ())
        w, top = 0.8 / len(shown), 0.0
        for i, mode in enumerate(shown):
            vals = [r[mode][key] for r in report["buckets"]]
            offset = (i - (len(shown) - 1) / 2) * w
            ax.bar([v + offset for v in x], vals, w,
                   label=f"compile ({peer})" if mode == "compile" else mode)
            top = max(top, *vals)
        ax.set_xticks(list(x), [str(b) for b in buckets])
        ax.set_xlabel("bucket (requests per round)")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.set_ylim(top=top * (10 if log else 1.3))  # room for the legend above the bars
        ax.set_title(title)
        ax.legend(loc="upper center", ncol=len(shown))
        return _png(fig)

    latency = bars("round_ms_median", "host round latency, median (ms)",
                   f"Round latency: {versus}" + (" vs compile" if peer else ""),
                   log=False, with_peer=bool(peer))
    submissions = bars("submissions_per_round", "submissions per round (log)",
                       f"Device submissions per round: {versus}"
                       + (" vs compile" if peer_counted else ""), log=True,
                       with_peer=peer_counted)
    fig, ax = plt.subplots(figsize=(6, 4))
    acc = [r["spec_vs_plain"]["acceptance_length"] for r in report["buckets"]]
    sp = [r["spec_vs_plain"]["speedup"] for r in report["buckets"]]
    ax.scatter(acc, sp)
    for a, s, b in zip(acc, sp, buckets):
        ax.annotate(f"B={b}", (a, s), textcoords="offset points", xytext=(4, 4))
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("acceptance length (tokens per request-round)")
    ax.set_ylabel("speed-up, speculative / plain (tokens/s)")
    ax.set_title(f"Speculative vs plain decoding ({report['settings']['backend']})")
    return dict(zip(PLOTS, (latency, submissions, _png(fig), _modes_plot(report))))


def _modes_plot(report: dict) -> bytes:
    """Round latency per graph mode (split, fused, fused + overlap) per bucket, and the
    host time per round outside replay calls of each mode."""
    buckets = [r["bucket"] for r in report["buckets"]]
    fig, (lat, host) = plt.subplots(1, 2, figsize=(10, 4))
    shown = [m for m in MODES if report["buckets"][0]["round_modes"][m] is not None]
    if not shown:  # the eager backend: no graph modes
        for ax in (lat, host):
            ax.text(0.5, 0.5, EAGER_NOTE, ha="center", va="center", wrap=True)
            ax.set_axis_off()
        return _png(fig)
    w = 0.8 / len(shown)
    for ax, key, ylabel in ((lat, "round_ms_median", "round latency, median (ms)"),
                            (host, "host_ms_median", "host ms per round outside replays")):
        top = 0.0
        for i, mode in enumerate(shown):
            vals = [r["round_modes"][mode][key] for r in report["buckets"]]
            offset = (i - (len(shown) - 1) / 2) * w
            ax.bar([j + offset for j in range(len(buckets))], vals, w,
                   label=mode if mode != "overlap" else "fused + overlap")
            top = max(top, *vals)
        ax.set_xticks(list(range(len(buckets))), [str(b) for b in buckets])
        ax.set_xlabel("bucket (requests per round)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(top=top * 1.3)  # room for the legend above the bars
        ax.legend(loc="upper center", ncol=len(shown))
    lat.set_title(f"Round latency per graph mode ({report['settings']['backend']})")
    host.set_title("Host time outside graph replays")
    return _png(fig)


def output_paths(out_dir: Path, json_path: Path | None) -> list[Path]:
    """Every file the bench writes: the plots, the Markdown report, then the JSON."""
    return [*(out_dir / name for name in PLOTS), out_dir / "bench.md",
            json_path or out_dir / "bench.json"]


def check_outputs(out_dir: Path, json_path: Path | None) -> None:
    """Refuse output paths that could not be written, before any measurement."""
    creatable_dir(out_dir, "output directory")
    if json_path is not None:
        label = f"JSON path {json_path}"
        if json_path.is_dir():
            raise InputError(f"{label}: is a directory, expected a file")
        if json_path.absolute() in {p.absolute() for p in output_paths(out_dir, None)[:-1]}:
            raise InputError(f"{label}: would overwrite another bench output")
        creatable_dir(json_path.parent, label)
    for path in output_paths(out_dir, json_path):
        if path.is_dir():
            raise InputError(f"bench output {path}: is a directory")


def write_outputs(report: dict, out_dir: Path, json_path: Path | None) -> None:
    """JSON, Markdown and the plots, committed as one set (``commit_files``)."""
    *plot_paths, md_path, json_path = output_paths(out_dir, json_path)
    report["outputs"] = {"plots": [str(p) for p in plot_paths], "markdown": str(md_path),
                         "json": str(json_path)}
    pngs = plots(report)
    files = {p: pngs[p.name] for p in plot_paths}
    files[md_path] = markdown(report).encode()
    files[json_path] = json.dumps(report, indent=2, default=str).encode()
    commit_files(files)
