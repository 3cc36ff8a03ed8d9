"""The run config: one YAML file with the checkpoint, pool sizes and the
speculative settings (graph capture settings join it with the graph backends).

Loaded strictly into frozen dataclasses: an unknown key, a value of the wrong
type or out of range is a ``ConfigError`` naming the file and the dotted key.
"auto" and alias values are resolved once here, never patched later.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, show_value
from .yamlfile import read_yaml

log = logging.getLogger(__name__)

ALGORITHM_ALIASES = {"EAGLE": "EAGLE", "NEXTN": "EAGLE"}  # NEXTN names the same runtime


@dataclass(frozen=True)
class SpeculativeConfig:
    algorithm: str = "EAGLE"  # EAGLE, or its alias NEXTN
    num_steps: int = 3  # S: candidates per round; S - 1 rollout decode calls
    eagle_topk: int = 1  # only the linear chain (topk 1) is supported
    num_draft_tokens: int = 4  # verify width N; with topk 1 it must be S + 1

    @property
    def verify_width(self) -> int:
        return self.num_steps + 1


@dataclass(frozen=True)
class PoolConfig:
    max_requests: int = 8  # request rows in the KV pool (row 0 is padding, extra)
    max_context: int = 512  # positions per request: prompt + output + N


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# How FP8/FP4 checkpoint weights are held: as stored (GEMMs read the stored bits), or
# expanded to `dtype` at load (small models, debugging). Plain checkpoints: no effect.
WEIGHTS_MODES = ("quantized", "dequantized")
KERNEL_MODES = ("auto", "reference", "triton")  # which fused kernels: kernels/select.py
GRAPH_BACKENDS = ("eager", "cpu", "cuda", "npu", "compile", "torchair")
GRAPH_KINDS = ("rollout", "target_verify", "draft_extend")  # the phases, in round order
# (what one graph runs, a phase or the fused round, greedy or sampling: graph/kinds.py)
# graph.round: the round as those phases' graphs (split, as SGLang), or as ONE graph
# (fused: the phases, acceptance and the commit of the next state; a steady batch also
# needs no staging). auto: fused where every phase is captured, else split.
ROUND_MODES = ("auto", "split", "fused")
OVERLAP_MODES = ("auto", "on", "off")
# What torch.compile hands each graph to, for graph backends compile and torchair (others
# ignore it). compile: inductor | aot_eager anywhere, reduce-overhead (inductor in CUDA graphs)
# on CUDA; torchair (compile on Ascend): npugraph_ex | reduce-overhead.
COMPILE_BACKENDS = ("auto", "inductor", "aot_eager", "reduce-overhead", "npugraph_ex")
_COMPILE_ON = {"cpu": ("inductor", "aot_eager"),
               "cuda": ("inductor", "aot_eager", "reduce-overhead"),
               "npu": ("auto", "npugraph_ex", "reduce-overhead")}


@dataclass(frozen=True)
class GraphConfig:
    backend: str = "cpu"  # eager | cpu (emulator) | cuda | npu | compile | torchair
    buckets: tuple[int, ...] = ()  # request counts captured; sorted, unique; () = auto
    kinds: tuple[str, ...] = GRAPH_KINDS  # which phases become graphs; others run eagerly
    warmup: int = 1  # eager runs of each phase before its capture
    debug_check_addresses: bool = False  # assert static inputs never moved, every replay
    compile_backend: str = "auto"  # see COMPILE_BACKENDS; auto: inductor, Ascend: torchair's
    round: str = "auto"  # split | fused | auto (fused where kinds holds every phase)
    # Launch round k+1 before reading round k's tokens back (fused rounds only; stop and
    # length cuts land one round late). auto: on where it can work, off on Ascend.
    overlap: str = "auto"  # auto | on | off
    # Requests may sample (temperature > 0): the engine keeps sampling tables and captures
    # each kind's sampling variant too. false: greedy only (half the graphs and no q
    # tables), and a sampling request is refused at add_request.
    sampling: bool = True
    # Top logprobs each round computes per committed token (the target's raw log-softmax,
    # read back with the round's tokens); a request may ask 0..logprobs of them.
    # 0: none (the round computes and reads back tokens only).
    logprobs: int = 0
    # Requests may carry penalties (presence / frequency / repetition, logit_bias,
    # min_tokens): per-row tables and token counts ([rows, vocab]) applied at every
    # verify row. false: none (a request with one is refused at add_request).
    penalties: bool = False


@dataclass(frozen=True)
class BenchConfig:
    # Also bench backend compile with this compile_backend, beside the config's graphs:
    # the peer a user would pick instead of hand-captured graphs. none | COMPILE_BACKENDS
    compile_peer: str = "none"
    # End to end, spec vs plain, also with every request sampling at this temperature
    # (seed = request index), next to greedy. 0: greedy only (no sampled runs).
    temperature: float = 0.8


@dataclass(frozen=True)
class ParallelConfig:
    # Tensor-parallel ranks (heads, vocab and experts split, see checkpoint/sharding.py).
    # Under torchrun it must equal the world size; otherwise `--tp N`/this key spawns them.
    tp: int = 1
    # Bound on every collective and control message: a dead or hung rank ends the
    # others with an error after this long. Rank 0 must step at least this often.
    timeout_s: int = 300


MAX_TP = 1024
MAX_TIMEOUT_S = 7 * 24 * 3600


@dataclass(frozen=True)
class SchedulerConfig:
    # Prompt tokens prefilled per step, over every request being prefilled (first come,
    # first served). A prompt longer than what is left of it is prefilled in chunks
    # over several steps, holding its pool row, while running requests get a round
    # every step: a long prompt no longer stalls them for its whole prefill. A step
    # costs about one round plus this many prompt tokens. 0 = unlimited: every
    # admitted prompt is prefilled whole in the step it is admitted.
    prefill_token_budget: int = 0


MAX_PREFILL_TOKEN_BUDGET = 2 ** 31  # one forward's rows; larger is a typo, not a budget


@dataclass(frozen=True)
class RunConfig:
    checkpoint: str = "builtin:tiny-trained"  # a directory, or builtin:NAME
    dtype: str = "fp32"  # fp32 | bf16
    device: str = "cpu"  # cpu | cuda | npu
    weights: str = "quantized"  # quantized | dequantized (FP8/FP4 checkpoints)
    kernels: str = "auto"  # auto | reference | triton: which fused kernels the model runs
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


_CHOICES = {"dtype": tuple(TORCH_DTYPES), "device": ("cpu", "cuda", "npu"),
            "weights": WEIGHTS_MODES, "kernels": KERNEL_MODES,
            "backend": GRAPH_BACKENDS, "compile_backend": COMPILE_BACKENDS,
            "compile_peer": ("none",) + COMPILE_BACKENDS, "round": ROUND_MODES,
            "overlap": OVERLAP_MODES}


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
# Eager runs of each phase before its capture: a handful settles lazy init and
# allocator caches; the count is a loop over full forwards at start-up, so an absurd
# value (1e8) would hang start-up instead of failing.
MAX_WARMUP = 100
MAX_LOGPROBS = 1024  # top logprobs per token a round may compute


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # a whole number (temperature: 1) reads as an int
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _build(cls: type, raw: Any, where: str, prefix: str) -> Any:
    """Strictly build dataclass ``cls`` from a YAML mapping."""
    if not isinstance(raw, dict):
        what = f"key {prefix.rstrip('.')!r}" if prefix else "top level"
        raise ConfigError(f"{where}: {what} must be a mapping, got {show_value(raw)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    not_str = [k for k in raw if not isinstance(k, str)]  # overrides bypass the YAML loader
    if not_str:
        where_key = f"under {prefix.rstrip('.')!r}" if prefix else "at top level"
        raise ConfigError(f"{where}: key {show_value(not_str[0])} {where_key} is not a string")
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key {show_value(prefix + unknown[0])} "
                          f"(known: {', '.join(sorted(names))})")
    values = {}
    for name, value in raw.items():
        key, kind = prefix + name, hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = _build(kind, value, where, key + ".")
            continue
        if typing.get_origin(kind) is tuple:  # a YAML list of one item type
            item = typing.get_args(kind)[0]
            if not isinstance(value, list) or not all(_is(v, item) for v in value):
                raise ConfigError(f"{where}: key {key!r} must be a list of "
                                  f"{item.__name__}, got {show_value(value)}")
            value = tuple(value)
        elif not _is(value, kind):
            raise ConfigError(f"{where}: key {key!r} must be {_NAMES[kind]}, "
                              f"got {show_value(value)}")
        if name in _CHOICES and value not in _CHOICES[name]:
            raise ConfigError(f"{where}: key {key!r} must be one of {_CHOICES[name]}, "
                              f"got {show_value(value)}")
        values[name] = value
    return cls(**values)


def check_section(obj: Any, where: str, prefix: str) -> Any:
    """A config dataclass built in code, checked as strictly as one read from YAML."""
    raw = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raw = {k: list(v) if isinstance(v, tuple) else v for k, v in raw.items()}
    return _build(type(obj), raw, where, prefix)


MAX_NUM_STEPS = 32  # each step is a NextN forward in the rollout graph; acceptance
# decays geometrically with depth, so deeper chains only cost


def resolve_speculative(spec: SpeculativeConfig, where: str) -> SpeculativeConfig:
    """Validate, resolve the NEXTN alias and correct ``num_draft_tokens`` for topk 1."""
    algo = str(spec.algorithm).upper()
    if algo not in ALGORITHM_ALIASES:
        raise ConfigError(
            f"{where}: key 'speculative.algorithm' is {show_value(spec.algorithm)}; this "
            f"runtime drives the NextN draft only (EAGLE, or its alias NEXTN)")
    if spec.eagle_topk != 1:
        raise ConfigError(f"{where}: key 'speculative.eagle_topk' is {spec.eagle_topk}; only "
                          f"topk 1 (a linear draft chain) is supported")
    if not 1 <= spec.num_steps <= MAX_NUM_STEPS:
        raise ConfigError(f"{where}: key 'speculative.num_steps' must lie in "
                          f"[1, {MAX_NUM_STEPS}], got {spec.num_steps}")
    width = spec.num_steps + 1
    if spec.num_draft_tokens != width:
        log.warning("%s: speculative.num_draft_tokens %d is inconsistent with topk 1 and "
                    "num_steps %d; using num_steps + 1 = %d", where, spec.num_draft_tokens,
                    spec.num_steps, width)
    return SpeculativeConfig(ALGORITHM_ALIASES[algo], spec.num_steps, 1, width)


def check_pool(pool: PoolConfig, verify_width: int, where: str) -> None:
    if pool.max_requests < 1:
        raise ConfigError(f"{where}: key 'pool.max_requests' must be at least 1, "
                          f"got {pool.max_requests}")
    if pool.max_context < verify_width + 1:
        raise ConfigError(f"{where}: key 'pool.max_context' {pool.max_context} is smaller "
                          f"than one verify window plus a prompt token")


def resolve(cfg: RunConfig, where: str = "config") -> RunConfig:
    pool = cfg.pool
    spec = resolve_speculative(cfg.speculative, where)
    check_pool(pool, spec.verify_width, where)
    graph = resolve_graph(cfg.graph, pool, where)
    needs = {"cuda": "cuda", "npu": "npu", "torchair": "npu", "cpu": "cpu"}.get(graph.backend)
    if needs is not None and cfg.device != needs:
        raise ConfigError(f"{where}: key 'graph.backend' {graph.backend!r} needs device "
                          f"{needs!r}, but key 'device' is {cfg.device!r}")
    graph = resolve_compile(graph, cfg.device, where)
    check_parallel(cfg.parallel, where)
    check_scheduler(cfg.scheduler, where)
    return dataclasses.replace(cfg, speculative=spec, graph=graph,
                               bench=resolve_bench(cfg.bench, where))


def resolve_bench(bench: BenchConfig, where: str) -> BenchConfig:
    """A finite temperature >= 0, as a float. graph.sampling is checked by the bench."""
    t = bench.temperature
    if not (math.isfinite(t) and t >= 0):
        raise ConfigError(f"{where}: key 'bench.temperature' must be a finite number >= 0 "
                          f"(0 = greedy only), got {show_value(t)}")
    return dataclasses.replace(bench, temperature=float(t))


def check_parallel(par: ParallelConfig, where: str) -> None:
    if not 1 <= par.tp <= MAX_TP:
        raise ConfigError(f"{where}: key 'parallel.tp' must lie in [1, {MAX_TP}], "
                          f"got {par.tp}")
    if not 1 <= par.timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"{where}: key 'parallel.timeout_s' must lie in "
                          f"[1, {MAX_TIMEOUT_S}] seconds, got {par.timeout_s}")


def check_scheduler(sched: SchedulerConfig, where: str) -> None:
    budget = sched.prefill_token_budget
    if not 0 <= budget <= MAX_PREFILL_TOKEN_BUDGET:
        raise ConfigError(f"{where}: key 'scheduler.prefill_token_budget' must lie in "
                          f"[0, {MAX_PREFILL_TOKEN_BUDGET}] prompt tokens per step "
                          f"(0 = unlimited), got {show_value(budget)}")


def resolve_compile(graph: GraphConfig, device: str, where: str,
                    key: str = "graph.compile_backend") -> GraphConfig:
    """``compile`` on Ascend is ``torchair``; ``auto`` is inductor on CPU and CUDA (on
    Ascend torchair picks at start-up: npugraph_ex where torch_npu offers it, else its
    reduce-overhead mode); a compile_backend the device cannot run is refused."""
    if graph.backend not in ("compile", "torchair"):
        return graph  # compile_backend is not read
    backend = "torchair" if device == "npu" else graph.backend
    choice = graph.compile_backend
    if choice == "auto" and device != "npu":
        choice = "inductor"
    if choice not in _COMPILE_ON[device]:
        raise ConfigError(f"{where}: key {key!r} {graph.compile_backend!r} cannot run on "
                          f"device {device!r} (graph backend {backend!r}); choose from "
                          f"{_COMPILE_ON[device]}")
    return dataclasses.replace(graph, backend=backend, compile_backend=choice)


def compile_peer(cfg: RunConfig, where: str = "config") -> GraphConfig | None:
    """The graph config of the bench's compile peer (``bench.compile_peer``): the config's
    graphs (buckets, kinds, warm-up) on backend ``compile`` (``torchair`` on Ascend); None
    when there is none. A peer must differ from the backend it is compared with.
    Checked by the bench before any work, not at load: a bench-only key must not stop
    ``generate`` on a config moved to another device."""
    peer = cfg.bench.compile_peer
    if peer == "none":
        return None
    if cfg.graph.backend in ("compile", "torchair"):
        raise ConfigError(f"{where}: key 'bench.compile_peer' {peer!r}: the graph backend is "
                          f"already {cfg.graph.backend!r}, so there is nothing to compare "
                          f"(set bench.compile_peer to none, or graph.backend to a "
                          f"hand-captured backend)")
    # split rounds: the peer is compiled phase by phase (its launches are counted per
    # phase), and its overlap would only blur the latency compared
    graph = dataclasses.replace(cfg.graph, backend="compile", compile_backend=peer,
                                round="split", overlap="off")
    return resolve_compile(graph, cfg.device, where, key="bench.compile_peer")


def resolve_graph(graph: GraphConfig, pool: PoolConfig, where: str) -> GraphConfig:
    """Fill auto buckets (powers of two below the pool, and the pool itself), check."""
    if not graph.buckets:
        auto = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < pool.max_requests]
        graph = dataclasses.replace(graph, buckets=tuple(auto + [pool.max_requests]))
    _check_graph(graph, pool, where)
    every = set(graph.kinds) == set(GRAPH_KINDS)
    if graph.round == "fused" and not every:
        raise ConfigError(f"{where}: key 'graph.round' fused captures the whole round as one "
                          f"graph, so 'graph.kinds' must list every phase {GRAPH_KINDS}, got "
                          f"{show_value(list(graph.kinds))} (or set graph.round: split)")
    if graph.round == "auto":  # eager keeps its phases apart: the bench times each
        fused = every and graph.backend != "eager"
        graph = dataclasses.replace(graph, round="fused" if fused else "split")
    return _resolve_overlap(graph, where)


def _resolve_overlap(graph: GraphConfig, where: str) -> GraphConfig:
    """Overlap launches round k+1 from the device-side state of round k, before the host
    has read k's accepted lengths: it needs the fused round (which moves the state
    itself) and graphs that take no host lengths (NPU graph updates do)."""
    why = None
    if graph.round != "fused":
        why = "it needs graph.round fused (the round that moves its state on the device)"
    elif graph.backend == "npu":
        why = ("NPU graphs take host sequence lengths through update(), and the lengths "
               "after round k's acceptance are not known on the host when k+1 launches")
    if graph.overlap == "on" and why:
        raise ConfigError(f"{where}: key 'graph.overlap' on cannot work here: {why}")
    if graph.overlap == "auto":
        graph = dataclasses.replace(graph, overlap="off" if why else "on")
    return graph


def _check_graph(graph: GraphConfig, pool: PoolConfig, where: str) -> None:
    buckets = graph.buckets
    if any(b < 1 for b in buckets):
        raise ConfigError(f"{where}: key 'graph.buckets' must list positive request "
                          f"counts, got {show_value(list(buckets))}")
    if list(buckets) != sorted(set(buckets)):
        raise ConfigError(f"{where}: key 'graph.buckets' must be sorted ascending without "
                          f"duplicates, got {show_value(list(buckets))}")
    if buckets[-1] > pool.max_requests:
        raise ConfigError(f"{where}: key 'graph.buckets' has bucket {buckets[-1]} above the "
                          f"request pool (pool.max_requests = {pool.max_requests})")
    unknown = [k for k in graph.kinds if k not in GRAPH_KINDS]
    if unknown or len(set(graph.kinds)) != len(graph.kinds):
        raise ConfigError(f"{where}: key 'graph.kinds' must be distinct names from "
                          f"{GRAPH_KINDS}, got {show_value(list(graph.kinds))}")
    if isinstance(graph.logprobs, bool) or not isinstance(graph.logprobs, int) or not (
            0 <= graph.logprobs <= MAX_LOGPROBS):
        raise ConfigError(f"{where}: key 'graph.logprobs' must be an integer in "
                          f"[0, {MAX_LOGPROBS}] (0 = none), got {show_value(graph.logprobs)}")
    if not 0 <= graph.warmup <= MAX_WARMUP:
        raise ConfigError(f"{where}: key 'graph.warmup' must be in [0, {MAX_WARMUP}], "
                          f"got {show_value(graph.warmup)}")


def load_run_config(path: str | Path | None = None, **overrides: Any) -> RunConfig:
    """Read a YAML run config (or the defaults), apply overrides, resolve once.

    ``overrides``: top-level values (``dtype="bf16"``) or per-section dicts
    (``graph={"backend": "eager"}``); ``None`` values are ignored.
    """
    raw: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        raw = read_yaml(path)
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping of keys, "
                              f"got {type(raw).__name__}")
    merged, named = dict(raw), []
    for key, value in overrides.items():
        if isinstance(value, dict):
            section = {k: v for k, v in value.items() if v is not None}
            if section:
                base = merged.get(key, {})
                merged[key] = {**base, **section} if isinstance(base, dict) else section
                named += [f"{key}.{k}" for k in section]
        elif value is not None:
            merged[key] = value
            named.append(key)
    if named:
        where = f"{where} with overrides {', '.join(named)}"
    return resolve(_build(RunConfig, merged, where, ""), where)
