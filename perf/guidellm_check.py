"""guidellm against `nextn-graph serve`: a sweep (synchronous, throughput, then constant
rates between them) of synthetic completions, and the errors it counted.

guidellm is not a dependency of the project; install it beside, in a venv of its own:

    python3 -m venv /tmp/glenv && /tmp/glenv/bin/pip install guidellm==0.8.1
    .venv/bin/python perf/guidellm_check.py --guidellm /tmp/glenv/bin/guidellm

It serves builtin:tiny-trained (a copy whose tokenizer transformers' AutoTokenizer can
load, for guidellm's token counts) on a loopback port, speculative, on the CPU
emulator's graphs, and prints one JSON line per benchmark of the sweep (its strategy,
requests completed and errored, output tokens/s, TTFT and ITL medians) and a summary;
exit status 1 if guidellm failed or any request errored.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lm_eval_check import checkpoint  # noqa: E402  (the same servable copy)
from nextn_graph.config import load_run_config  # noqa: E402
from nextn_graph.serve.front.limits import ServeSettings  # noqa: E402
from nextn_graph.serve.thread import ServerThread  # noqa: E402


def _median(stats: dict, key: str):
    m = stats.get(key, {}) if isinstance(stats, dict) else {}
    m = m.get("successful", m) if isinstance(m, dict) else {}
    return m.get("median") if isinstance(m, dict) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--guidellm", required=True, help="the guidellm command of its venv")
    ap.add_argument("--seconds", type=float, default=8.0, help="per benchmark of the sweep")
    ap.add_argument("--sweep-size", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--max-requests", type=int, default=8, help="pool rows")
    ap.add_argument("--max-waiting", type=int, default=1024,
                    help="serve --max-waiting: at least guidellm's 512 streams of its throughput "
                         "stage, whose requests a smaller queue answers 429 (errors to guidellm)")
    ap.add_argument("--keep", help="also write guidellm's JSON report here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root, out = checkpoint(tmp), tmp / "benchmarks.json"
        cfg = load_run_config(None, checkpoint=str(root),
                              pool={"max_requests": args.max_requests, "max_context": 512})
        with ServerThread(cfg, ServeSettings(port=0, max_waiting=args.max_waiting)) as srv:
            cmd = [args.guidellm, "run",
                   "--backend", f"kind=openai_http,target={srv.url},model=tiny-trained,"
                   f"request_format=/v1/completions",
                   "--tokenizer", f"kind=huggingface_auto,model={root}",
                   "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                   f"output_tokens={args.output_tokens}",
                   "--profile", f"kind=sweep,sweep_size={args.sweep_size}",
                   "--constraint", f"kind=max_duration,seconds={args.seconds}",
                   "--output", f"kind=json,path={out}",
                   "--disable-console-interactive"]
            run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not out.exists():
            print(run.stdout[-4000:], run.stderr[-6000:], sep="\n")
            return 1
        report = json.loads(out.read_text())
        if args.keep:
            Path(args.keep).write_text(out.read_text())
    benches = report.get("benchmarks", [])
    errored = 0
    for b in benches:
        totals = b.get("metrics", {}).get("request_totals", {}) or b.get("request_totals", {})
        metrics = b.get("metrics", {})
        errored += int(totals.get("errored", 0) or 0)
        strategy = b.get("config", {}).get("strategy", {}) or b.get("scheduler", {}).get("strategy", {})
        print(json.dumps({
            "strategy": strategy.get("type_", strategy.get("kind")),
            "rate": strategy.get("rate") or strategy.get("streams"),
            "completed": totals.get("successful"), "errored": totals.get("errored"),
            "output_tok_s": _median(metrics, "output_tokens_per_second"),
            "ttft_ms_p50": _median(metrics, "time_to_first_token_ms"),
            "itl_ms_p50": _median(metrics, "inter_token_latency_ms")}))
    print(json.dumps({"benchmarks": len(benches), "errored": errored}))
    return 0 if benches and errored == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
