"""The ``bench:`` section: what ``nextn-graph bench`` measures beside the config's
own graphs. Read by the bench alone, so its checks never stop ``generate``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import ConfigError, show_value
from .graph import COMPILE_BACKENDS, GraphConfig, resolve_compile

if TYPE_CHECKING:  # run.py builds RunConfig from this section
    from .run import RunConfig


@dataclass(frozen=True)
class BenchConfig:
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "compile_peer": ("none",) + COMPILE_BACKENDS}

    # Also bench backend compile with this compile_backend, beside the config's graphs:
    # the peer a user would pick instead of hand-captured graphs.
    compile_peer: str = "none"
    # End to end, spec vs plain, also with every request sampling at this temperature
    # (seed = request index), next to greedy. 0: greedy only (no sampled runs).
    temperature: float = 0.8


def resolve_bench(bench: BenchConfig, where: str) -> BenchConfig:
    """A finite temperature >= 0, as a float. graph.sampling is checked by the bench."""
    t = bench.temperature
    if not (math.isfinite(t) and t >= 0):
        raise ConfigError(f"{where}: key 'bench.temperature' must be a finite number >= 0 "
                          f"(0 = greedy only), got {show_value(t)}")
    return dataclasses.replace(bench, temperature=float(t))


def compile_peer(cfg: RunConfig, where: str = "config") -> GraphConfig | None:
    """The graph config of the bench's compile peer (``bench.compile_peer``): the config's
    graphs (buckets, captured phases, warm-up) on backend ``compile`` (``torchair`` on
    Ascend); None when there is none. A peer must differ from the backend it is compared
    with. Checked by the bench before any work, not at load: a bench-only key must not
    stop ``generate`` on a config moved to another device."""
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
