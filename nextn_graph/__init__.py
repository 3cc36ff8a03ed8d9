"""DeepSeek-V4 MTP/NextN speculative decoding as static device graphs.

The public API for embedding the engine in a server::

    from nextn_graph import SpecEngine, load_run_config
    engine = SpecEngine.from_config(load_run_config("capture_configs/cpu_default.yaml"))
    rid = engine.add_request(prompt_ids, max_new_tokens=64)  # greedy
    rid = engine.add_request(prompt_ids, 64, sampling=SamplingParams(temperature=0.8, seed=7))
    while engine.has_work:
        for out in engine.step():  # StepOutput(rid, new_tokens, finished, draft_tokens, error)
            ...
"""

from .checkpoint import load_checkpoint, save_checkpoint
from .config import (GraphConfig, PoolConfig, RunConfig, SchedulerConfig, SpeculativeConfig,
                     load_run_config)
from .errors import (CapacityError, CaptureError, CheckpointError, ConfigError, InputError,
                     NextnGraphError, ParallelError, RequestFailed)
from .runtime.engine import SpecEngine, StepOutput
from .sampling import SamplingParams

__all__ = [
    "SpecEngine", "StepOutput", "SamplingParams", "RunConfig", "SpeculativeConfig", "PoolConfig", "GraphConfig",
    "SchedulerConfig",
    "load_run_config", "load_checkpoint", "save_checkpoint", "NextnGraphError", "ConfigError",
    "CheckpointError", "InputError", "CapacityError", "CaptureError", "RequestFailed",
    "ParallelError",
]
