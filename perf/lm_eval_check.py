"""lm-evaluation-harness against `nextn-graph serve`: a loglikelihood (multiple choice)
task and a generate_until task from local task files (no hub access), through its
`local-completions` model, and every item's loglikelihood checked against the project's
own no-cache oracle (full recompute of the target, no cache, no server).

lm-eval is not a dependency of the project; install it beside, in a venv of its own:

    python3 -m venv /tmp/lmenv
    /tmp/lmenv/bin/pip install torch==2.13.0 "lm_eval[api]==0.4.9" "transformers<5" "datasets<4"
    .venv/bin/python perf/lm_eval_check.py --lm-eval-python /tmp/lmenv/bin/python

It serves builtin:tiny-trained (a copy, with a tokenizer_config.json that lets
transformers' AutoTokenizer load its tokenizer.json) on a loopback port, speculative,
on the CPU emulator's graphs, and prints one JSON line of figures; exit status 1 if any
item's loglikelihood differs from the oracle's by more than --tol or lm-eval failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nextn_graph.checkpoint import load_checkpoint  # noqa: E402
from nextn_graph.checkpoint.loader import resolve_checkpoint  # noqa: E402
from nextn_graph.checkpoint.tokenizer import load_tokenizer  # noqa: E402
from nextn_graph.config import load_run_config  # noqa: E402
from nextn_graph.serve.front.limits import ServeSettings  # noqa: E402
from nextn_graph.serve.thread import ServerThread  # noqa: E402

MAX_CONTEXT = 256
# (the tiny model was trained on counting text: contexts it knows, continuations it may)
MC = [{"context": f"{a}, {a + 1}, {a + 2},", "choices": [f" {a + 3}", f" {a + 7}", " x"],
       "label": 0} for a in range(10, 40, 3)]
GEN = [{"context": f"{a}, {a + 1}, {a + 2},", "target": f" {a + 3}"} for a in range(50, 70, 4)]


def task_files(where: Path) -> Path:
    data = where / "data"
    data.mkdir(parents=True)
    for name, rows in (("mc", MC), ("gen", GEN)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (where / "nextn_mc.yaml").write_text(f"""task: nextn_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (where / "nextn_gen.yaml").write_text(f"""task: nextn_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: [","]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return where


def checkpoint(where: Path) -> Path:
    """builtin:tiny-trained with a tokenizer_config.json AutoTokenizer can read."""
    root = where / "tiny-trained"
    shutil.copytree(resolve_checkpoint("builtin:tiny-trained"), root)
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}))
    return root


@torch.no_grad()
def oracle_loglikelihood(target, tokenizer, context: str, continuation: str) -> float:
    """Sum of the continuation tokens' log-softmax under the target's full recompute."""
    ctx = tokenizer.encode(context, "context")
    whole = tokenizer.encode(context + continuation, "continuation")
    cont = whole[len(ctx):]
    logits = target.reference(torch.tensor(whole)).logits.float()  # [T, V]
    lp = logits.log_softmax(-1)
    return float(sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def samples(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"lm-eval wrote no samples for {task} under {out}")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lm-eval-python", required=True,
                    help="a python with lm_eval installed (see the module docstring)")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=4,
                    help="lm-eval's batch: prompts per request (list prompts)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root, tasks, out = checkpoint(tmp), task_files(tmp / "tasks"), tmp / "out"
        cfg = load_run_config(None, checkpoint=str(root),
                              pool={"max_requests": 4, "max_context": MAX_CONTEXT},
                              graph={"logprobs": 5})
        with ServerThread(cfg, ServeSettings(port=0)) as srv:
            start = time.perf_counter()
            cmd = [args.lm_eval_python, "-m", "lm_eval", "--model", "local-completions",
                   "--model_args", f"model=tiny-trained,base_url={srv.url}/v1/completions,"
                   f"tokenizer={root},tokenized_requests=True,max_length={MAX_CONTEXT},"
                   f"num_concurrent=1,max_retries=1",
                   "--batch_size", str(args.batch_size), "--tasks", "nextn_mc,nextn_gen",
                   "--include_path", str(tasks), "--log_samples", "--output_path", str(out)]
            env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "TOKENIZERS_PARALLELISM": "false"}
            run = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - start
            errors = srv.state.metrics.rejected.collect()
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-6000:], sep="\n")
            return 1
        models = load_checkpoint(root)
        tok = load_tokenizer(root, models.cfg.vocab_size)
        worst, items = 0.0, 0
        for s in samples(out, "nextn_mc"):
            args_ = s["arguments"]  # {"gen_args_i": {"arg_0": context, "arg_1": ...}}
            args_ = list(args_.values()) if isinstance(args_, dict) else args_
            for arg, resp in zip(args_, s["resps"]):
                context, continuation = (arg["arg_0"], arg["arg_1"]) if isinstance(
                    arg, dict) else arg
                got = float(resp[0][0])  # (lm-eval logs the pair as strings, full repr)
                want = oracle_loglikelihood(models.target, tok, context, continuation)
                worst, items = max(worst, abs(got - want)), items + 1
        gen = samples(out, "nextn_gen")
        rejected = sum(s.value for m in errors for s in m.samples if s.name.endswith("_total"))
        report = {"loglikelihood_items": items, "max_abs_diff_vs_oracle": worst,
                  "tol": args.tol, "generate_until_items": len(gen),
                  "generated": [g["resps"][0][0] for g in gen][:3],
                  "server_rejections": rejected, "lm_eval_wall_s": round(wall, 1),
                  "batch_size": args.batch_size}
        print(json.dumps(report))
        return 0 if items and worst <= args.tol and gen and not rejected else 1


if __name__ == "__main__":
    sys.exit(main())
