"""The whole run config (``RunConfig``): the top-level keys, every section, and
``load_run_config``, which reads a YAML file (or the defaults), applies overrides and
resolves every "auto" and alias value once, into a new frozen object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..errors import ConfigError
from ..yamlfile import read_yaml
from .bench import BenchConfig, resolve_bench
from .graph import GraphConfig, resolve_compile, resolve_graph
from .parallel import ParallelConfig, check_parallel
from .pool import PoolConfig, check_pool
from .scheduler import SchedulerConfig, check_scheduler
from .schema import build_section
from .speculative import SpeculativeConfig, resolve_speculative

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# How FP8/FP4 checkpoint weights are held: as stored (GEMMs read the stored bits), or
# expanded to `dtype` at load (small models, debugging). Plain checkpoints: no effect.
WEIGHTS_MODES = ("quantized", "dequantized")
KERNEL_MODES = ("auto", "reference", "triton")  # which fused kernels: kernels/select.py
DEVICES = ("cpu", "cuda", "npu")
# The device each device-bound graph backend runs on (eager and compile run on any).
_BACKEND_DEVICE = {"cuda": "cuda", "npu": "npu", "torchair": "npu", "cpu": "cpu"}


@dataclass(frozen=True)
class RunConfig:
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "dtype": tuple(TORCH_DTYPES), "device": DEVICES, "weights": WEIGHTS_MODES,
        "kernels": KERNEL_MODES}

    checkpoint: str = "builtin:tiny-trained"  # a directory, or builtin:NAME
    dtype: str = "fp32"
    device: str = "cpu"
    weights: str = "quantized"  # FP8/FP4 checkpoints only: see WEIGHTS_MODES
    kernels: str = "auto"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


def resolve(cfg: RunConfig, where: str = "config") -> RunConfig:
    pool = cfg.pool
    spec = resolve_speculative(cfg.speculative, where)
    check_pool(pool, spec.verify_width, where)
    graph = resolve_graph(cfg.graph, pool, where)
    needs = _BACKEND_DEVICE.get(graph.backend)
    if needs is not None and cfg.device != needs:
        raise ConfigError(f"{where}: key 'graph.backend' {graph.backend!r} needs device "
                          f"{needs!r}, but key 'device' is {cfg.device!r}")
    graph = resolve_compile(graph, cfg.device, where)
    check_parallel(cfg.parallel, where)
    check_scheduler(cfg.scheduler, where)
    return dataclasses.replace(cfg, speculative=spec, graph=graph,
                               bench=resolve_bench(cfg.bench, where))


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
    return resolve(build_section(RunConfig, merged, where, ""), where)
