"""Bench outputs: the terminal table, JSON, a Markdown report and PNG plots.

Output paths are checked before the bench measures anything (``check_outputs``);
the files are rendered in memory and written as one set (``files.commit_files``).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from ..errors import InputError  # noqa: E402
from .files import commit_files, creatable_dir  # noqa: E402

PLOTS = ("round_latency.png", "submissions.png", "speedup_vs_acceptance.png")
HEADER = ("bucket", "NextN fwd", "eager subm", "graph subm", "replays", "subm ratio",
          "eager ms", "graph ms", "graph/eager", "acc len", "spec/plain")
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
    return (HEADER + (PEER_HEADER if report["settings"].get("compile_peer") else ())
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


def _summary_lines(report: dict) -> list[str]:
    sv, s = report["spec_vs_plain"], report["settings"]
    return [_capture_line(report), *_peer_line(report),
            f"speculative vs plain on {s['backend']}: {sv['speedup']:.2f}x at acceptance "
            f"length {sv['acceptance_length']:.2f} (strict draft acceptance "
            f"{sv['draft_acceptance_rate']:.2f})"]


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

{_capture_section(report)}

![round latency](round_latency.png) ![submissions](submissions.png)
![speed-up vs acceptance](speedup_vs_acceptance.png)
"""


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
    """The three PNG plots, by file name (``PLOTS``), rendered in memory."""
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
    return dict(zip(PLOTS, (latency, submissions, _png(fig))))


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
