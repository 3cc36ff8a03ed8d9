"""Command line: ``nextn-graph {bench,demo,make-checkpoint,generate,profile,serve,bench-serve}``.

Every library error becomes one line on stderr naming what was wrong, and exit
status 2; Ctrl-C becomes ``nextn-graph: interrupted`` and exit status 130. No
traceback from inside torch either way. Bad option values (``--rounds 0``) are
refused by argparse, also with status 2, before any work.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

from ..bench import BenchSettings, run_bench
from ..bench.report import table
from ..checkpoint.corpus import corpus
from ..checkpoint.loader import load_checkpoint
from ..checkpoint.presets import PRESETS, preset_config
from ..checkpoint.save import QUANTIZE, random_models, save_checkpoint
from ..checkpoint.tokenizer import byte_level_tokenizer, write_tokenizer
from ..checkpoint.train import TRAINED_PRESET, make_trained
from ..config import (COMPILE_BACKENDS, GRAPH_BACKENDS, TORCH_DTYPES, WEIGHTS_MODES, RunConfig,
                      load_run_config)
from ..errors import InputError, NextnGraphError, show_value
from ..launch.follower import load_and_follow, shutdown
from ..launch.ranks import check_world_size, close_group, exit_rank, group_from_env, spawn
from ..parallel.group import TPGroup
from ..profile import add_profile_options, run_profile
from ..runtime.engine import SpecEngine
from .generate import MODES, add_sampling_options, run_generate
from .serve_options import (add_kernels_option, add_serve_commands, add_tp_option,
                            run_serve_command)

SEED_LIMIT = 2**63  # torch generators take a 64-bit seed


def make_checkpoint(preset: str, out: str | Path, seed: int = 0,
                    max_shard_bytes: int | None = None, quantize: str = "none") -> Path:
    """Write a deterministic checkpoint of a preset in the released layout: random
    weights, or for ``tiny-trained`` the trained target and distilled draft with its
    byte-level ``tokenizer.json``. ``quantize="fp8"``: in the release's dtypes (FP8
    linears, FP4 routed experts, e8m0 scales).

    ``out`` is written atomically: an earlier checkpoint there is replaced whole
    (never mixed with the new shards); a non-empty non-checkpoint dir is refused."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise InputError(f"make-checkpoint: seed must be an integer in [0, 2**63), got "
                         f"{show_value(seed)}")
    if preset == TRAINED_PRESET:
        root = save_checkpoint(make_trained(seed), out, max_shard_bytes, quantize)
        write_tokenizer(byte_level_tokenizer(), root)  # the one shipped with the preset
        return root
    return save_checkpoint(random_models(preset_config(preset), seed), out, max_shard_bytes,
                           quantize)


def _check_device(device: str) -> None:
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r}: no CUDA device is available")
    if kind == "npu":
        try:
            importlib.import_module("torch_npu")  # lazy: only ever on an Ascend machine
        except ImportError:
            raise InputError(f"device {device!r}: torch_npu is not installed (it needs the "
                             f"CANN toolkit)") from None


def _pin_threads(threads: int, device: str) -> None:
    """torch intra-op threads for work on the host, set before any: the tiny default
    model's ops are too small to split, so extra threads only add OpenMP barrier
    waits (and on a shared machine, contention). Every subcommand uses this."""
    if device.split(":")[0] == "cpu":
        torch.set_num_threads(threads)


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The YAML config (or defaults) with the command line's explicit overrides."""
    if args.config is None and args.checkpoint is None:
        raise InputError("give --checkpoint DIR or --config YAML")
    cfg = load_run_config(args.config, checkpoint=args.checkpoint, dtype=args.dtype,
                          device=args.device, weights=args.weights, kernels=args.kernels,
                          pool={"max_context": args.max_context},
                          graph={"backend": args.backend}, parallel={"tp": args.tp})
    _check_device(cfg.device)
    return cfg


def _bench_config(args: argparse.Namespace) -> RunConfig:
    cfg = load_run_config(args.config, checkpoint=args.checkpoint, kernels=args.kernels,
                          graph={"backend": args.backend},
                          bench={"compile_peer": args.compile_peer}, parallel={"tp": args.tp})
    _check_device(cfg.device)
    return cfg


def _demo(args: argparse.Namespace) -> int:
    """The embedded default: speculative, plain and reference decoding of the same
    prompts on the tiny trained checkpoint; all three must agree token for token."""
    cfg = load_run_config(None, checkpoint=args.checkpoint)  # the embedded default
    _pin_threads(args.threads, cfg.device)
    models = load_checkpoint(cfg.checkpoint)
    drawn = corpus(models.cfg.vocab_size, 7)
    prompts = [drawn.sample(n) for n in (12, 20, 28, 40)]
    engine = SpecEngine(models.target, models.draft, cfg.speculative, cfg.pool, cfg.graph)
    results = {"spec": engine.generate(prompts, args.max_new_tokens, stop_ids=[])}
    results.update({m: fn(models.target, prompts, args.max_new_tokens, stop_ids=set())
                    for m, fn in MODES.items()})
    same = all(r.outputs == results["reference"].outputs for r in results.values())
    spec = results["spec"].stats
    print(f"checkpoint: {cfg.checkpoint}   num_steps: {cfg.speculative.num_steps}")
    print(f"{'mode':<10} {'target fwd':>10} {'tokens':>7} {'wall s':>8} {'tok/s':>8}")
    for mode, res in results.items():
        st = res.stats
        tokens = st.get("generated_tokens", st.get("emitted_tokens"))
        print(f"{mode:<10} {st['target_forwards']:>10} {tokens:>7} "
              f"{st['wall_s']:>8.3f} {st['tokens_per_s']:>8.1f}")
    print(f"acceptance length {spec['acceptance_length']:.2f}, strict draft acceptance "
          f"{spec['draft_acceptance_rate']:.2f}, NextN forwards: {spec['nextn_extend_forwards']} "
          f"extend + {spec['nextn_decode_forwards']} rollout decode")
    print(f"graph backend {cfg.graph.backend}: {spec['graph_replays']} replays over "
          f"{spec['rounds']} rounds, {spec['padded_rows']} padded rows, "
          f"{spec['eager_fallbacks']} eager fallbacks")
    print(f"spec == plain == reference token for token: {same}")
    return 0 if same else 1


def _bench(args: argparse.Namespace, cfg: RunConfig, group: TPGroup) -> int:
    """The main job: the replay benchmark on the config (default: the embedded CPU one)."""
    st = BenchSettings(warmup_rounds=args.warmup_rounds, timed_rounds=args.rounds,
                       repeats=args.repeats)
    report = run_bench(cfg, args.config or "embedded default", st, Path(args.out),
                       Path(args.json) if args.json else None, progress=not args.quiet,
                       group=group)
    print(table(report))
    print(f"wrote {report['outputs']['json']}, {report['outputs']['markdown']} and "
          f"{len(report['outputs']['plots'])} plots in {args.out} "
          f"({report['wall_s']:.0f} s in all)")
    return 0


def _count(low: int):
    """An argparse type: an integer >= ``low``, refused before any work otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            kind = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
        return value
    return parse


POSITIVE, NON_NEGATIVE = _count(1), _count(0)


def _seed(text: str) -> int:
    """An argparse type: a seed in [0, 2**63), what a torch generator takes."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**63), got "
                                         f"{show_value(text, 40)}")
    return value


def _add_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=POSITIVE, default=1,
                        help="torch intra-op threads on CPU (default 1: tiny widths)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextn-graph", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    bench = sub.add_parser("bench", help="replay benchmark: eager vs graph, spec vs plain "
                                         "(the command's default)")
    bench.add_argument("--config", help="YAML run config (default: the embedded CPU one)")
    bench.add_argument("--checkpoint", help="override the config's checkpoint")
    add_kernels_option(bench)
    bench.add_argument("--backend", choices=GRAPH_BACKENDS, default=None,
                       help="graph backend to compare against eager")
    bench.add_argument("--compile-peer", choices=("none",) + COMPILE_BACKENDS, default=None,
                       help="also bench torch.compile'd graphs with this compile backend "
                            "beside the config's graphs (YAML bench.compile_peer)")
    bench.add_argument("--rounds", type=POSITIVE, default=24, help="timed steady rounds per run")
    bench.add_argument("--warmup-rounds", type=NON_NEGATIVE, default=3)
    bench.add_argument("--repeats", type=POSITIVE, default=3, help="runs per mode, for a median")
    bench.add_argument("--out", default="bench_out", help="directory for JSON, Markdown, PNGs")
    bench.add_argument("--json", default=None, help="JSON path (default: OUT/bench.json)")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_threads(bench)
    add_tp_option(bench, POSITIVE)
    demo = sub.add_parser("demo", help="spec, plain and reference decoding side by side")
    demo.add_argument("--checkpoint", help="checkpoint dir (default: builtin:tiny-trained)")
    demo.add_argument("--max-new-tokens", type=POSITIVE, default=32)
    _add_threads(demo)
    make = sub.add_parser("make-checkpoint", help="write a deterministic random checkpoint")
    make.add_argument("--preset", choices=[*sorted(PRESETS), TRAINED_PRESET], default="tiny")
    make.add_argument("--out", required=True)
    make.add_argument("--seed", type=_seed, default=0, help="in [0, 2**63)")
    make.add_argument("--quantize", choices=QUANTIZE, default="none",
                      help="fp8: the release's dtypes (FP8 linears with e8m0 block scales, "
                           "FP4 routed experts)")
    make.add_argument("--shard-bytes", type=POSITIVE, default=None,
                      help="split into shards of at most this many bytes, with an index")
    gen = sub.add_parser("generate", help="generation (greedy, or sampled: --temperature) "
                                          "from a JSONL prompts file or --prompt TEXT")
    gen.add_argument("--checkpoint", help="checkpoint dir or builtin:NAME (overrides --config)")
    gen.add_argument("--config", help="YAML run config (checkpoint, pool, speculative settings)")
    given = gen.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompts", metavar="FILE", help='JSONL, one {"input_ids": [...]} '
                       'or {"text": "..."} per line, optionally with that request\'s own '
                       'sampling keys: {"text": "...", "temperature": 0.8, "seed": 7}')
    given.add_argument("--prompt", action="append", metavar="TEXT",
                       help="a text prompt (repeat for more requests); the checkpoint needs "
                            "a tokenizer.json")
    gen.add_argument("--max-new-tokens", type=POSITIVE, required=True)
    gen.add_argument("--mode", choices=["spec", *sorted(MODES)], default="spec")
    gen.add_argument("--max-context", type=POSITIVE, default=None,
                     help="positions per request (default: the config's pool.max_context)")
    gen.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default=None)
    gen.add_argument("--weights", choices=WEIGHTS_MODES, default=None,
                     help="quantized: FP8/FP4 weights stay as stored (the default); "
                          "dequantized: expanded to --dtype at load")
    gen.add_argument("--device", default=None)
    add_kernels_option(gen)
    gen.add_argument("--backend", choices=GRAPH_BACKENDS, default=None,
                     help="graph backend for --mode spec (overrides the config's graph.backend)")
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout "
                     "(a sampled request shows the parameters it used, its seed included)")
    add_sampling_options(gen)
    _add_threads(gen)
    add_tp_option(gen, POSITIVE)
    prof = sub.add_parser("profile", help="work profile of one speculative round on the meta "
                                          "device: kernels, bytes, FLOPs, roofline projection")
    add_profile_options(prof, POSITIVE, NON_NEGATIVE)
    _add_threads(prof)
    add_serve_commands(sub, POSITIVE, _add_threads)  # serve, bench-serve
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(build_parser().parse_args(argv), argv)
    except NextnGraphError as exc:
        print(f"nextn-graph: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's 128 + SIGINT, no traceback
        lead = "\n" if sys.stderr.isatty() else ""  # off the ^C echo or a progress bar
        print(f"{lead}nextn-graph: interrupted", file=sys.stderr)
        return 130


def _command(name: str):
    """The (config, body) of a command that runs on tensor-parallel ranks."""
    return {"generate": (_run_config, run_generate), "bench": (_bench_config, _bench)}[name]


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    if args.command == "make-checkpoint":
        print(make_checkpoint(args.preset, args.out, args.seed, args.shard_bytes, args.quantize))
        return 0
    if args.command == "demo":
        return _demo(args)
    if args.command in ("serve", "bench-serve"):  # (they import the web libraries then)
        return run_serve_command(args, _pin_threads)
    if args.command == "profile":
        _pin_threads(args.threads, "cpu")  # meta tensors: the work is the host's
        return run_profile(args)
    if args.command is None:
        argv = ["bench"]
        args = build_parser().parse_args(argv)
    cfg = _command(args.command)[0](args)
    group = group_from_env(cfg.device, cfg.parallel.timeout_s)  # launched by torchrun
    if group is not None:
        try:
            check_world_size(group, cfg.parallel.tp)
            status = _ranked(args, cfg, group)
        except BaseException:
            close_group(group, orderly=False)
            raise
        close_group(group)
        exit_rank(status)
    if cfg.parallel.tp > 1:  # start the ranks on this machine; rank 0's status is ours
        return spawn(_rank_entry, cfg.parallel.tp, (argv,), cfg.device,
                     cfg.parallel.timeout_s, lead_decides=True)[0]
    return _ranked(args, cfg, TPGroup.single())


def _rank_entry(group: TPGroup, argv: list[str]) -> int:
    """One spawned rank (``--tp N``): the same command, on its rank of the group."""
    args = build_parser().parse_args(argv)
    try:
        return _ranked(args, _command(args.command)[0](args), group)
    except NextnGraphError as exc:
        print(f"nextn-graph: error (rank {group.rank}): {exc}", file=sys.stderr)
        return 2


def _ranked(args: argparse.Namespace, cfg: RunConfig, group: TPGroup) -> int:
    """Rank 0 runs the command and drives the others; every other rank loads its slices
    of the model and follows rank 0 (``launch.follower``) until it shuts down."""
    _pin_threads(args.threads, cfg.device)
    if not group.is_driver:
        load_and_follow(group, cfg)
        return 0
    status = _command(args.command)[1](args, cfg, group)
    shutdown(group)  # not on an error: the followers then see rank 0 go and exit
    return status


if __name__ == "__main__":
    sys.exit(main())
