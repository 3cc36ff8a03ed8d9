"""``nextn-graph profile``: its options and its body (``cli.py`` only wires them in)."""

from __future__ import annotations

import argparse
import json
from typing import Callable

from ..checkpoint.loader import resolve_checkpoint
from ..checkpoint.presets import PRESETS, preset_config
from ..config import KERNEL_MODES, WEIGHTS_MODES, load_run_config
from ..errors import InputError
from ..model.config import load_config
from .build import ProfileSettings
from .report import text
from .run import profile_round
from .specs import DEVICE_SPECS

DEFAULT_MAX_CONTEXT = 8192  # positions per request row, capped at the model's own
DEFAULT_MAX_REQUESTS = 8


def add_profile_options(parser: argparse.ArgumentParser, positive: Callable,
                        non_negative: Callable) -> None:
    """``positive`` / ``non_negative``: the CLI's argparse integer types."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model preset")
    source.add_argument("--checkpoint", help="a checkpoint dir or builtin:NAME (its "
                                             "config.json only; no weight is read)")
    source.add_argument("--config", help="a YAML run config: its checkpoint's config.json, "
                                         "pool and speculative.num_steps")
    parser.add_argument("--bucket", type=positive, default=None,
                        help="requests in the round, pool rows 1..B (default 1)")
    parser.add_argument("--num-steps", type=non_negative, default=None,
                        help="S (default 3, or the config's; 0: plain decoding)")
    parser.add_argument("--max-context", type=positive, default=None,
                        help=f"positions per pool row (default {DEFAULT_MAX_CONTEXT} or the "
                             f"model's max_position_embeddings if smaller, or the config's)")
    parser.add_argument("--context-len", type=positive, default=None,
                        help="positions each request has cached, for the kernels whose work "
                             "follows it (sparse attention, the indexer); default: every "
                             "index list full (the pool's worst case)")
    parser.add_argument("--max-requests", type=positive, default=None,
                        help=f"pool rows (default {DEFAULT_MAX_REQUESTS}, or the config's)")
    parser.add_argument("--weights", choices=WEIGHTS_MODES, default="dequantized",
                        help="dequantized: every linear bf16 (default); quantized: the "
                             "release's FP8 linears and FP4 routed experts")
    parser.add_argument("--device-spec", choices=sorted(DEVICE_SPECS), default="h200",
                        help="the device the roofline projection is for")
    parser.add_argument("--kernels", choices=KERNEL_MODES, default="auto",
                        help="the kernel set counted: auto (what the spec's device runs: the "
                             "fused Triton kernels on h200, the reference on 910b), reference "
                             "(the exact aten code), triton")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--top", type=non_negative, default=10,
                        help="ops listed by projected time (default 10)")


def _source(args: argparse.Namespace):
    """-> (model config, what it is, where it came from, the pool and num_steps the
    source sets)."""
    if args.preset is not None:
        return (preset_config(args.preset), f"preset {args.preset}", {"preset": args.preset},
                {})
    if args.checkpoint is not None:
        return (load_config(resolve_checkpoint(args.checkpoint)),
                f"checkpoint {args.checkpoint}", {"checkpoint": args.checkpoint}, {})
    run = load_run_config(args.config)
    given = {"num_steps": run.speculative.num_steps, "max_requests": run.pool.max_requests,
             "max_context": run.pool.max_context}
    return (load_config(resolve_checkpoint(run.checkpoint)),
            f"config {args.config} (checkpoint {run.checkpoint})",
            {"config": args.config, "checkpoint": run.checkpoint}, given)


def profile_settings(args: argparse.Namespace, max_position_embeddings: int,
                     given: dict) -> ProfileSettings:
    """The command line over the source's values over the defaults."""
    def pick(name: str, default: int) -> int:
        value = getattr(args, name)
        return value if value is not None else given.get(name, default)

    st = ProfileSettings(
        bucket=pick("bucket", 1), num_steps=pick("num_steps", 3),
        max_requests=pick("max_requests", DEFAULT_MAX_REQUESTS),
        max_context=pick("max_context", min(DEFAULT_MAX_CONTEXT, max_position_embeddings)),
        weights=args.weights, device_spec=args.device_spec, kernels=args.kernels,
        context_len=args.context_len)
    if st.bucket > st.max_requests:
        raise InputError(f"profile: --bucket {st.bucket} exceeds max_requests "
                         f"{st.max_requests} (the pool's request rows; see --max-requests)")
    return st


def run_profile(args: argparse.Namespace) -> int:
    cfg, source, origin, given = _source(args)
    result = profile_round(cfg, profile_settings(args, cfg.max_position_embeddings, given),
                           source, top=args.top, origin=origin)
    print(json.dumps(result, indent=2) if args.json else text(result))
    return 0
