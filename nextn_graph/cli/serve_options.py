"""The ``serve`` and ``bench-serve`` subcommands' options. Kept apart from the server so
that building the command line's parser loads no web library."""

from __future__ import annotations

import argparse

from ..config import KERNEL_MODES
from ..serve.front.limits import API_KEY_ENV, ENGINE_HOSTS, ServeSettings

DEFAULT_MAX_LOGPROBS = 20  # vLLM's max_logprobs default
KERNELS_HELP = ("fused kernels (YAML kernels): auto = the device's, reference = the exact aten "
                "code, triton = the Triton kernels (on a CPU under TRITON_INTERPRET=1)")


def add_kernels_option(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    parser.add_argument("--kernels", choices=KERNEL_MODES, default=default, help=KERNELS_HELP)


def add_tp_option(parser: argparse.ArgumentParser, positive) -> None:
    """``--tp`` of generate, bench and serve."""
    parser.add_argument("--tp", type=positive, default=None,
                        help="tensor-parallel ranks (YAML parallel.tp); without torchrun, "
                             "this machine starts them itself")


def add_serve_options(parser: argparse.ArgumentParser, positive) -> None:
    parser.add_argument("--config", help="YAML run config (default: the embedded CPU one)")
    parser.add_argument("--checkpoint", help="override the config's checkpoint")
    add_kernels_option(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=_port, default=8000, help="port (0: any free one)")
    parser.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer "
                        f"KEY' on /v1 (default: ${API_KEY_ENV}, else none)")
    parser.add_argument("--max-requests", type=positive, default=None,
                        help="pool rows: requests decoded at once (YAML pool.max_requests)")
    parser.add_argument("--max-context", type=positive, default=None,
                        help="positions per request (YAML pool.max_context)")
    parser.add_argument("--prefill-token-budget", type=int, default=None,
                        help="prompt tokens prefilled per step, longer prompts in chunks so "
                             "running streams keep a round every step; 0 = unlimited "
                             "(YAML scheduler.prefill_token_budget)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse the KV pages of a prompt's cached prefix (whole pages, "
                             "usage.prompt_tokens_details.cached_tokens); --no-prefix-cache "
                             "prefills every prompt whole (YAML pool.prefix_cache)")
    parser.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                        help="most alternatives per token a request may ask (logprobs, "
                             "top_logprobs, prompt_logprobs); overrides YAML graph.logprobs "
                             f"(default {DEFAULT_MAX_LOGPROBS}, as vLLM's max_logprobs)")
    parser.add_argument("--penalties", action=argparse.BooleanOptionalAction, default=True,
                        help="take presence / frequency / repetition penalties, logit_bias "
                             "and min_tokens (per-row tables and [rows, vocab] token counts); "
                             "--no-penalties refuses them (YAML graph.penalties)")
    parser.add_argument("--max-waiting", type=int, default=ServeSettings.max_waiting,
                        help="requests queued beyond the pool's rows; more get 429")
    parser.add_argument("--max-body-bytes", type=positive, default=ServeSettings.max_body_bytes)
    parser.add_argument("--shutdown-grace", type=float, default=ServeSettings.shutdown_grace_s,
                        help="seconds requests in flight get to finish after SIGTERM")
    parser.add_argument("--request-timeout", type=float, default=0.0,
                        help="seconds a request may run; past that it fails (504, or an "
                             "error event in its stream) and its rows are freed (0: no limit)")
    parser.add_argument("--body-timeout", type=_seconds, default=ServeSettings.body_timeout_s,
                        help="seconds a request's head may take to arrive, and then its "
                             "body; past that it is a 408 and the connection closes "
                             f"(default {ServeSettings.body_timeout_s:g})")
    parser.add_argument("--model-name", default=None,
                        help="the model id served (default: the checkpoint's name)")
    parser.add_argument("--engine-thread", action="store_true",
                        help="run the engine on a thread of the server's process (sharing "
                             "its interpreter lock with HTTP, JSON and tokenizing) instead "
                             "of in its own process; refused with --tp N > 1 (under "
                             "torchrun the engine runs on a thread of rank 0's process "
                             "either way)")
    add_tp_option(parser, positive)
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"))


def _port(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _levels(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def _tokens(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0, got {text!r}")
    return value


def _rates(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",")) if text else ()
    except ValueError:
        values = (-1.0,)
    if any(not 0 < v < 1e6 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive request rates like 5,20, "
                                         f"got {text!r}")
    return values


def add_serve_commands(sub, positive, add_threads) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, "
                                         "streaming, metrics) on 127.0.0.1 by default")
    add_serve_options(serve, positive)
    add_threads(serve)
    bench = sub.add_parser("bench-serve", help="serving benchmark on loopback: TTFT, TPOT, "
                                               "ITL, throughput, spec vs plain")
    bench.add_argument("--config", help="YAML run config (default: the embedded CPU one)")
    bench.add_argument("--checkpoint", help="override the config's checkpoint")
    bench.add_argument("--concurrency", type=_levels, default=(1, 8, 32),
                       help="fixed-concurrency levels, comma-separated (default 1,8,32)")
    bench.add_argument("--rates", type=_rates, default=(),
                       help="Poisson arrival rates in requests/s, comma-separated "
                            "(default: none)")
    bench.add_argument("--requests", type=positive, default=32,
                       help="requests per load level (bounded: at most 1000)")
    bench.add_argument("--time-limit", type=float, default=120.0,
                       help="seconds per load level; requests not started by then are skipped")
    bench.add_argument("--max-requests", type=positive, default=None,
                       help="pool rows (default: the largest concurrency level, at most 32)")
    bench.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    bench.add_argument("--shared-prefix", type=_tokens, default=0, metavar="TOKENS",
                       help="each group of --prefix-group prompts starts with the same "
                            "TOKENS tokens (default 0: no shared prefix)")
    bench.add_argument("--prefix-group", type=positive, default=4,
                       help="prompts per shared prefix (default 4)")
    bench.add_argument("--engine", choices=(*ENGINE_HOSTS, "both"),
                       default=ServeSettings.engine,
                       help="where each server's engine runs: its own process, a thread of "
                            "the server's, or both (each mode served both ways: the split "
                            "server's throughput against the in-thread one's)")
    bench.add_argument("--repeats", type=positive, default=1,
                       help="runs of each load level per server, in turn; the median "
                            "throughput's run is reported")
    bench.add_argument("--out", default="bench_serve_out", help="directory for JSON, "
                                                                "Markdown and PNG")
    add_threads(bench)


def run_serve_command(args: argparse.Namespace, pin_threads) -> int:
    pin_threads(args.threads, "cpu")  # (the engine's device may differ; cpu: tiny widths)
    if args.command == "serve":
        from ..serve.command import run_serve
        return run_serve(args)
    from ..serve.bench.command import run_bench_serve_command
    return run_bench_serve_command(args)
