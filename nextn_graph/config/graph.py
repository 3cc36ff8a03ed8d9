"""The ``graph:`` section: which phases are captured, for which buckets, on which
backend, and how a round runs them (split or fused, overlapped or not)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError, show_value
from .pool import PoolConfig

GRAPH_BACKENDS = ("eager", "cpu", "cuda", "npu", "compile", "torchair")  # cpu: the emulator
# The round's phases, in round order. What one graph runs (a phase or the fused round,
# greedy or sampling) is graph/kinds.py.
PHASE_NAMES = ("rollout", "target_verify", "draft_extend")
# graph.round: the round as its phases' graphs (split, as SGLang), or as ONE graph
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
# Eager runs of each phase before its capture: a handful settles lazy init and
# allocator caches; the count is a loop over full forwards at start-up, so an absurd
# value (1e8) would hang start-up instead of failing.
MAX_WARMUP = 100
MAX_LOGPROBS = 1024  # top logprobs per token a round may compute


@dataclass(frozen=True)
class GraphConfig:
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "backend": GRAPH_BACKENDS, "compile_backend": COMPILE_BACKENDS,
        "round": ROUND_MODES, "overlap": OVERLAP_MODES}
    RENAMED: ClassVar[dict[str, str]] = {"kinds": "captured_phases"}

    backend: str = "cpu"
    buckets: tuple[int, ...] = ()  # request counts captured; sorted, unique; () = auto
    captured_phases: tuple[str, ...] = PHASE_NAMES  # the others run eagerly (counted)
    warmup: int = 1  # eager runs of each phase before its capture
    debug_check_addresses: bool = False  # assert static inputs never moved, every replay
    compile_backend: str = "auto"  # auto: inductor; on Ascend torchair picks at start-up
    round: str = "auto"  # see ROUND_MODES
    # Launch round k+1 before reading round k's tokens back (fused rounds only; stop and
    # length cuts land one round late). auto: on where it can work, off on Ascend.
    overlap: str = "auto"
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


def resolve_graph(graph: GraphConfig, pool: PoolConfig, where: str) -> GraphConfig:
    """Fill auto buckets (powers of two below the pool, and the pool itself), check."""
    if not graph.buckets:
        auto = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < pool.max_requests]
        graph = dataclasses.replace(graph, buckets=tuple(auto + [pool.max_requests]))
    _check_graph(graph, pool, where)
    every = set(graph.captured_phases) == set(PHASE_NAMES)
    if graph.round == "fused" and not every:
        raise ConfigError(f"{where}: key 'graph.round' fused captures the whole round as one "
                          f"graph, so 'graph.captured_phases' must list every phase "
                          f"{PHASE_NAMES}, got {show_value(list(graph.captured_phases))} "
                          f"(or set graph.round: split)")
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
    phases = graph.captured_phases
    if any(p not in PHASE_NAMES for p in phases) or len(set(phases)) != len(phases):
        raise ConfigError(f"{where}: key 'graph.captured_phases' must be distinct names "
                          f"from {PHASE_NAMES}, got {show_value(list(phases))}")
    if isinstance(graph.logprobs, bool) or not isinstance(graph.logprobs, int) or not (
            0 <= graph.logprobs <= MAX_LOGPROBS):
        raise ConfigError(f"{where}: key 'graph.logprobs' must be an integer in "
                          f"[0, {MAX_LOGPROBS}] (0 = none), got {show_value(graph.logprobs)}")
    if not 0 <= graph.warmup <= MAX_WARMUP:
        raise ConfigError(f"{where}: key 'graph.warmup' must be in [0, {MAX_WARMUP}], "
                          f"got {show_value(graph.warmup)}")


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
