"""The bench's Markdown report (``bench.md``): the table, the round modes, the
per-round trace, the cost model, greedy vs sampling, the capture, the work profile, and
what the JSON's keys hold."""

from __future__ import annotations

from .tables import (EAGER_NOTE, MODES, TRACE_MODES, cell, header, rows, summary_lines,
                     trace_order, trace_verdict)
from .work import profile_section


def markdown(report: dict) -> str:
    head = header(report)
    lines = [head, ("---",) * len(head), *rows(report)]
    body = "\n".join("| " + " | ".join(r) + " |" for r in lines)
    noise = ", ".join(f"B={r['bucket']}: eager {100 * r['eager']['noise']:.0f}%"
                      + (f" / graph {100 * r['graph']['noise']:.0f}%" if r["graph"] else "")
                      for r in report["buckets"])
    s = report["settings"]
    return f"""# nextn_graph replay benchmark

Run {s['date']} on {s['cpu']} ({s['cores']} cores, {s['machine']}).
Config `{s['config']}`, backend `{s['backend']}`, torch {s['torch']}, {s['threads']} thread(s). Per steady round (every request running, none admitted);
submissions are {_counted_as(report)}.

{body}

{chr(10).join(summary_lines(report))}

Spread of the repeat medians (max - min over median): {noise}.

{_modes_section(report)}

{_trace_section(report)}

{_cost_section(report)}

{_sampling_section(report)}

{_capture_section(report)}

{profile_section(report)}

![round latency](round_latency.png) ![submissions](submissions.png)
![speed-up vs acceptance](speedup_vs_acceptance.png) ![round modes](round_modes.png)
![round trace](round_trace.png)

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
- `round_trace.{fused,overlap}`: the fused round, overlap off and on, over `rounds`
  steady rounds under the chunks' trace (null where that mode is not measured).
  `events`: the last repeat's `launch` (staging, replays, starting the readback copy)
  and `read` (waiting for the copy, decoding it) per round, as `event`, `round` (the
  i-th traced round is round i; -1: launched before the trace), `start_ms` and `end_ms`
  from the first event; `read_wait_ms` and `overlapped_rounds` per round of the last
  repeat (the `read_wait` events, `counters.overlapped_rounds` deltas: 1 where the round
  was launched with an earlier one unread); `read_wait_ms_median` and
  `overlapped_per_round` over every repeat's rounds; `pairs`: the (read k, launch k+1)
  pairs of the last repeat; `launch_before_prev_read` (round k+1's launch starts before
  round k's read: the read is off the launch's critical path) and
  `read_before_next_launch` (round k's read ends before round k+1's launch), each true
  when it held for every pair of every repeat; `repeats`.
- `host_ms_median` (every graph summary and the compile peer): round wall time minus
  the time inside graph replay calls (the `replay` events), median per steady round. On
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
  (spec over plain); `acceptance_length` (accepted drafts + bonus per request-round of
  the speculative runs, as `spec_vs_plain.acceptance_length` over steady rounds) and
  `draft_acceptance_rate`; `temperature` (0: greedy); `sampled_chunks.{spec,plain}`
  (chunks run in the sampling graph variants, `chunks.counters.sampled_chunks`).
- `e2e_sampled`: the same, with every request sampling at `bench.temperature` (top_p
  1, top_k 0, seed = request index, so every run draws the same tokens; speculative
  rounds accept by rejection sampling); null with `bench.temperature` 0.
- Top level, `sampling`: `temperature`, `top_p`, `top_k`, `seed`, and `greedy` /
  `sampled` (`e2e` / `e2e_sampled` over buckets): `acceptance_length` (mean),
  `latency_ratio` and `throughput_ratio` (geometric means); null with
  `bench.temperature` 0.
- Top level, `profile`: the JSON of `nextn-graph profile` for this config at its largest
  bucket (see `docs/profile.md`): `kernels_per_round`, `bytes_per_round`,
  `flops_per_round`, `ideal_bytes_per_round`, `projected_ms`, `ideal_ms` (a roofline
  projection), `phases`, `modules`, `top_ops`, `config`."""


def _modes_section(report: dict) -> str:
    if not report["settings"]["graphs"]:
        return f"## Round modes\n\nNone: {EAGER_NOTE}."
    lines = []
    for r in report["buckets"]:
        m = r["round_modes"]
        vs = {"fused": r["fused_vs_split_latency"], "overlap": r["overlap_vs_fused_latency"]}
        for mode in MODES:
            g = m[mode]
            if g is None:
                continue
            sub = g["submissions"]
            lines.append(f"| {r['bucket']} | {mode} | {sub['replays']} | "
                         f"{sub['staging_copies']} | {sub['readback_copies']} | "
                         f"{sub['updates']} | {g['submissions_per_round']} | "
                         f"{g['round_ms_median']:.2f} | {g['host_ms_median']:.3f} | "
                         f"{g['tpot_ms']:.2f} | {cell(vs.get(mode))} |")
    return f"""## Round modes

The speculative round per graph mode, one steady round: split (rollout, verify and
draft extend as three graphs, as SGLang), fused (one graph that flips the staged slots
itself: the `graph` engine), fused with overlap on (round k+1 launched before round k's
readback). host ms: round wall time outside graph replay calls. vs: fused over split,
overlap over fused (latency).

| bucket | mode | replays | staging | readbacks | updates | submissions | round ms | host ms | TPOT ms | vs |
|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(lines)}"""


def _trace_section(report: dict) -> str:
    if not report["settings"]["graphs"]:
        return f"## Per-round trace\n\nNone: {EAGER_NOTE}."
    lines, verdicts = [], {}
    for r in report["buckets"]:
        for mode, label in TRACE_MODES:
            t = r["round_trace"][mode]
            if t is None:
                continue
            verdicts.setdefault(label, set()).add(trace_verdict(t))
            lines.append(f"| {r['bucket']} | {label} | `{trace_order(t)}` | "
                         f"{t['overlapped_per_round']:.2f} | {t['read_wait_ms_median']:.3f} | "
                         f"{'yes' if t['launch_before_prev_read'] else 'no'} | "
                         f"{'yes' if t['read_before_next_launch'] else 'no'} |")
    if not lines:
        return ("## Per-round trace\n\nNone: graph.round split, so no fused round to "
                "trace.")
    found = "; ".join(f"{label}: {' / '.join(sorted(v))} in every bucket" if len(v) == 1
                      else f"{label}: mixed over buckets" for label, v in verdicts.items())
    return f"""## Per-round trace

The fused round, overlap off and on, over a few steady rounds per bucket under the
chunks' trace: each round's launch (staging, replay, starting the readback copy) and
read (waiting for that copy, decoding it), in host time. order: L launch, R read, then
the round (R-1: the round launched before the trace); events of the last repeat, the
rest over every repeat. With overlap a step launches round k+1 before it reads round k,
so the host's read of round k is off round k+1's critical path; without, round k's read
ends before round k+1's launch. Found: {found}.

| bucket | mode | order | overlapped / round | read wait ms | launch k+1 before read k | read k before launch k+1 |
|---|---|---|---|---|---|---|
{chr(10).join(lines)}"""


def _cost_section(report: dict) -> str:
    phase_rows, e2e_rows = [], []
    for r in report["buckets"]:
        sources = [("eager", r["eager"]["phase_times"])]
        if r["round_modes"]["split"]:
            sources.append(("split graphs", r["round_modes"]["split"]["phase_times"]))
        for name, t in sources:
            ms = t["phase_ms"]
            phase_rows.append(
                f"| {r['bucket']} | {name} | {cell(ms.get('rollout'))} | "
                f"{cell(ms.get('target_verify'))} | {cell(ms.get('draft_extend'))} | "
                f"{t['outside_phases_ms']:.2f} | {t['round_ms_mean']:.2f} | "
                f"{cell(t['draft_vs_verify'])} |")
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


def _sampling_section(report: dict) -> str:
    smp = report["sampling"]
    if smp is None:
        return "## Greedy vs sampling\n\nNone: bench.temperature is 0 (greedy only)."
    rows = []
    for r in report["buckets"]:
        g, s = r["e2e"], r["e2e_sampled"]
        rows.append(f"| {r['bucket']} | {g['acceptance_length']:.2f} | "
                    f"{s['acceptance_length']:.2f} | {g['latency_ratio']:.2f} | "
                    f"{s['latency_ratio']:.2f} | {g['throughput_ratio']:.2f} | "
                    f"{s['throughput_ratio']:.2f} | {s['spec']['latency_ms_median']:.1f} | "
                    f"{s['plain']['latency_ms_median']:.1f} |")
    over = "; ".join(f"{name} {smp['greedy'][key]:.2f} greedy vs {smp['sampled'][key]:.2f} "
                     f"sampled" for name, key in (("acceptance length", "acceptance_length"),
                                                  ("latency spec/plain", "latency_ratio"),
                                                  ("throughput spec/plain", "throughput_ratio")))
    return f"""## Greedy vs sampling

End to end as in the cost model, greedy and with every request sampling at temperature
{smp['temperature']:g} (top_p 1, top_k 0, seed = request index: every run draws the same
tokens). A sampling round drafts from the draft's distribution and accepts each
candidate with min(1, p/q) (lossless rejection sampling: the output follows the
target's distribution). acc len: accepted drafts + bonus per request-round of the
speculative runs; spec/plain: latency (median over requests) and output throughput.

Over buckets (means, geometric means for the ratios): {over}.

| bucket | acc len greedy | acc len sampled | latency spec/plain greedy | latency spec/plain sampled | throughput spec/plain greedy | throughput spec/plain sampled | sampled spec ms | sampled plain ms |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}"""


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
        f"| {c['name']} | {c['bucket']} | {c['seconds'] * 1000:.1f} | "
        f"{c['nbytes'] / 2**20:.2f} | {c['ops']} |" for c in cap["records"])
    pad = report["padding"]
    return f"""## Capture

| graph | bucket | ms | MiB | ops |
|---|---|---|---|---|
{caps}

Total {cap['total_s']:.2f} s. Padding waste over batch sizes 1..{len(pad['per_batch_size'])}:
{100 * pad['waste']:.0f}% of real rows."""
