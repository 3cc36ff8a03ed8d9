"""The run config: one YAML file with the checkpoint, the speculative settings, pool
sizes, graph capture, the bench's extras, tensor parallelism and the scheduler.

Loaded strictly into frozen dataclasses (``schema``): an unknown key, a value of the
wrong type or out of range is a ``ConfigError`` naming the file and the dotted key.
"auto" and alias values are resolved once at load (``run.resolve``), never patched
later. One module per YAML section; this package re-exports what other layers use.
"""

from .bench import BenchConfig, compile_peer, resolve_bench
from .graph import (COMPILE_BACKENDS, GRAPH_BACKENDS, PHASE_NAMES, GraphConfig,
                    resolve_compile, resolve_graph)
from .parallel import ParallelConfig, check_parallel
from .pool import PoolConfig, check_pool
from .run import KERNEL_MODES, TORCH_DTYPES, WEIGHTS_MODES, RunConfig, load_run_config, resolve
from .scheduler import SchedulerConfig, check_scheduler
from .schema import check_section
from .speculative import MAX_NUM_STEPS, SpeculativeConfig, resolve_speculative


__all__ = [
    "RunConfig", "SpeculativeConfig", "PoolConfig", "GraphConfig", "BenchConfig",
    "ParallelConfig", "SchedulerConfig", "load_run_config", "resolve", "check_section",
    "resolve_speculative", "check_pool", "resolve_graph", "resolve_compile", "resolve_bench",
    "compile_peer", "check_parallel", "check_scheduler", "TORCH_DTYPES", "WEIGHTS_MODES",
    "KERNEL_MODES", "GRAPH_BACKENDS", "COMPILE_BACKENDS", "PHASE_NAMES", "MAX_NUM_STEPS",
]
