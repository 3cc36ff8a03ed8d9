"""Command line: ``nextn-graph {demo,make-checkpoint,generate}``.

Every library error becomes one line on stderr naming what was wrong, and exit
status 2; no traceback from inside torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from .checkpoint import build_models, load_checkpoint, save_checkpoint
from .errors import InputError, NextnGraphError
from .generate import plain_generate, reference_generate
from .presets import PRESETS, init_random, preset_config

MODES = {"reference": reference_generate, "plain": plain_generate}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The embedded default of the demo: prompts that cross the SWA window (16),
# C4 blocks and, for the longest, the first C128 block.
DEMO_PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [(7 * i) % 250 + 2 for i in range(140)]]


def make_checkpoint(preset: str, out: str | Path, seed: int = 0,
                    max_shard_bytes: int | None = None) -> Path:
    """Write a deterministic random checkpoint of a preset in the released layout."""
    cfg = preset_config(preset)
    models = build_models(cfg)
    state = init_random({**models.target.state_dict(), **models.draft.state_dict()}, cfg, seed)
    models.target.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")})
    models.draft.load_state_dict({k: v for k, v in state.items() if k.startswith("mtp.")})
    return save_checkpoint(models, out, max_shard_bytes)


def read_prompts(path: str | Path) -> list[list[int]]:
    """JSONL, one ``{"input_ids": [...]}`` per line; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: prompts file not found")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: malformed JSON ({exc.msg})") from None
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InputError(f"{path}:{number}: expected {{\"input_ids\": [int, ...]}}")
        prompts.append(ids)
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


def _check_device(device: str) -> None:
    kind = torch.device(device).type if device else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: no CUDA device is available")
    if kind not in ("cpu", "cuda"):
        raise InputError(f"--device {device}: generate runs on cpu or cuda")


def _generate(args: argparse.Namespace) -> int:
    _check_device(args.device)
    models = load_checkpoint(args.checkpoint, DTYPES[args.dtype], args.device)
    prompts = read_prompts(args.prompts)
    result = MODES[args.mode](models.target, prompts, args.max_new_tokens,
                              max_context=args.max_context)
    if args.json:
        reqs = [{"input_ids": p, "output_ids": o} for p, o in zip(prompts, result.outputs)]
        print(json.dumps({"requests": reqs, "stats": result.stats}))
    else:
        for i, out in enumerate(result.outputs):
            print(f"request {i}: {out}")
        print(json.dumps(result.stats))
    return 0


def _demo(args: argparse.Namespace) -> int:
    """The embedded default: tiny checkpoint, plain vs reference decoding, same tokens."""
    root = Path(args.checkpoint or Path(tempfile.gettempdir()) / "nextn_graph_tiny_seed0")
    if not (root / "config.json").is_file():
        make_checkpoint("tiny", root, seed=0)
    models = load_checkpoint(root)
    results = {m: fn(models.target, DEMO_PROMPTS, args.max_new_tokens, stop_ids=set())
               for m, fn in MODES.items()}
    same = results["plain"].outputs == results["reference"].outputs
    print(f"checkpoint: {root}")
    print(f"{'mode':<10} {'forwards':>8} {'tokens':>7} {'wall s':>8} {'tok/s':>8}")
    for mode, res in results.items():
        s = res.stats
        print(f"{mode:<10} {s['target_forwards']:>8} {s['generated_tokens']:>7} "
              f"{s['wall_s']:>8.3f} {s['tokens_per_s']:>8.1f}")
    print(f"plain == reference token for token: {same}")
    return 0 if same else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextn-graph", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="run the embedded default (the command's default)")
    demo.add_argument("--checkpoint", help="checkpoint dir (default: a cached tiny one)")
    demo.add_argument("--max-new-tokens", type=int, default=24)
    make = sub.add_parser("make-checkpoint", help="write a deterministic random checkpoint")
    make.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    make.add_argument("--out", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--shard-bytes", type=int, default=None,
                      help="split into shards of at most this many bytes, with an index")
    gen = sub.add_parser("generate", help="greedy generation from a JSONL prompts file")
    gen.add_argument("--checkpoint", required=True)
    gen.add_argument("--prompts", required=True)
    gen.add_argument("--max-new-tokens", type=int, required=True)
    gen.add_argument("--mode", choices=sorted(MODES), default="plain")
    gen.add_argument("--max-context", type=int, default=None,
                     help="positions per request (default: max_position_embeddings)")
    gen.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "make-checkpoint":
            print(make_checkpoint(args.preset, args.out, args.seed, args.shard_bytes))
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command is None:
            args = build_parser().parse_args(["demo"])
        return _demo(args)
    except NextnGraphError as exc:
        print(f"nextn-graph: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
