"""The bench's PNG plots (``PLOTS``), rendered in memory: round latency and
submissions per mode, speed-up vs acceptance, the round per graph mode, and the
per-round trace of the fused round with overlap off and on."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from .tables import EAGER_NOTE, MODES, TRACE_MODES  # noqa: E402

PLOTS = ("round_latency.png", "submissions.png", "speedup_vs_acceptance.png",
         "round_modes.png", "round_trace.png")
EVENT_COLORS = {"launch": "tab:blue", "read": "tab:orange"}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _note(axes, text: str):
    """Axes with nothing to draw: ``text`` in the middle of each."""
    for ax in axes:
        ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True)
        ax.set_axis_off()


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
    return dict(zip(PLOTS, (latency, submissions, _png(fig), _modes_plot(report),
                            _trace_plot(report))))


def _modes_plot(report: dict) -> bytes:
    """Round latency per graph mode (split, fused, fused + overlap) per bucket, and the
    host time per round outside replay calls of each mode."""
    buckets = [r["bucket"] for r in report["buckets"]]
    fig, (lat, host) = plt.subplots(1, 2, figsize=(10, 4))
    shown = [m for m in MODES if report["buckets"][0]["round_modes"][m] is not None]
    if not shown:  # the eager backend: no graph modes
        _note((lat, host), EAGER_NOTE)
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


def _trace_plot(report: dict) -> bytes:
    """The largest bucket's traced rounds as a host timeline, one row per traced mode:
    each round's launch and read (a read can be too short for its bar: its start is
    marked), labelled by round."""
    last = report["buckets"][-1]
    fig, ax = plt.subplots(figsize=(10, 2.8))
    shown = [(label, last["round_trace"][mode]) for mode, label in TRACE_MODES
             if last["round_trace"][mode] is not None]
    if not shown:
        _note((ax,), EAGER_NOTE if not report["settings"]["graphs"]
              else "graph.round split: no fused round to trace")
        return _png(fig)
    for y, (label, trace) in enumerate(shown):
        for e in trace["events"]:
            color, up = EVENT_COLORS[e["event"]], e["event"] == "launch"
            ax.broken_barh([(e["start_ms"], e["end_ms"] - e["start_ms"])], (y - 0.2, 0.4),
                           color=color)
            ax.plot([e["start_ms"]], [y], marker="|", markersize=18, color=color)
            ax.annotate(f"{e['event'][0].upper()}{e['round']}", (e["start_ms"], y),
                        textcoords="offset points", xytext=(2, 12 if up else -18),
                        fontsize=7, color=color)
    ax.set_yticks(range(len(shown)), [label for label, _ in shown])
    ax.set_ylim(-0.8, len(shown) - 0.2)
    ax.set_xlabel("host ms from the first traced event")
    handles = [plt.Line2D([], [], color=c, linewidth=6, label=k)
               for k, c in EVENT_COLORS.items()]
    ax.legend(handles=handles, loc="upper right", ncol=2, fontsize=8)
    ax.set_title(f"Per-round trace, B={last['bucket']} (L: launch, R: read, then the round)")
    return _png(fig)
