"""Shared fixtures: the tiny DeepSeek-V4 target and its NextN draft, random weights.

``tiny`` is built once per session (fp32, eval mode, seed 0). Pools are never
shared between tests: each test makes its own with ``tiny.target_pool`` or
``tiny.draft_pool`` so cached state cannot leak from one test into another.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

import pytest
import torch

# Without a GPU the Triton kernels (``kernels: triton``) run on CPU tensors under Triton's
# interpreter, chosen when a kernel is decorated: before any kernel module is imported.
# With one they run compiled (the CUDA-marked tests); TRITON_INTERPRET=1 in the
# environment runs the interpreter tests there too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nextn_graph.checkpoint import load_checkpoint, random_models
from nextn_graph.model import DeepseekV4ForCausalLM, DeepseekV4ForCausalLMNextN, ModelConfig
from nextn_graph.memory.pool import KVPool, PoolLayout
from nextn_graph.checkpoint.presets import preset_config


@dataclass(frozen=True)
class Tiny:
    cfg: ModelConfig
    target: DeepseekV4ForCausalLM
    draft: DeepseekV4ForCausalLMNextN

    def target_pool(self, max_requests: int, max_context: int, verify_width: int) -> KVPool:
        return self.target.new_pool(PoolLayout(max_requests, max_context, verify_width))

    def draft_pool(self, max_requests: int, max_context: int, verify_width: int) -> KVPool:
        return self.draft.new_pool(PoolLayout(max_requests, max_context, verify_width))

    def tokens(self, n: int, seed: int) -> torch.Tensor:
        """n random ids [n] int64, avoiding bos/eos so nothing special is exercised."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(2, self.cfg.vocab_size, (n,), generator=gen)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny widths gain nothing from intra-op threads, and on a shared 2-core box
    OpenMP spinning under contention made the suite 20x slower at times."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def trained():
    """The shipped trained checkpoint (its draft really predicts the target)."""
    return load_checkpoint("builtin:tiny-trained")


@pytest.fixture(scope="session")
def tiny() -> Tiny:
    models = random_models(preset_config("tiny"), seed=0)
    return Tiny(models.cfg, models.target.eval(), models.draft.eval())


@pytest.fixture(autouse=True)
def _no_grad():
    """Every test runs inference only: no autograd graph, no grad-mode surprises."""
    with torch.no_grad():
        yield


# -- the tiers: a test that starts a process is marked ``process`` ---------------------------
# The default (fast) tier leaves out what starts other processes; a test of that tier that
# starts one would slow it silently, so it fails (a compile tier's ptxas is fine). Audit events see subprocess and fork;
# multiprocessing's spawn starts its child in C unaudited (those tests are marked by hand).
_STARTED: list[str] = []
_PROCESS_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty"})


def _audit(event: str, args) -> None:
    if event in _PROCESS_EVENTS:
        _STARTED.append(event)


platform.processor()  # cached for the process: its one `uname -p` (the openai client asks)
sys.addaudithook(_audit)


_OUT_OF_FAST = ("process", "compile", "heavy", "slow")  # tiers the default run leaves out


def _check_started(item) -> None:
    started, _STARTED[:] = list(_STARTED), []
    if started and not any(item.get_closest_marker(m) for m in _OUT_OF_FAST):
        pytest.fail(f"{item.nodeid} started a process ({started[0]}) but is in the fast tier: "
                    f"mark it @pytest.mark.process (the fast tier starts none)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _STARTED.clear()
    result = yield
    _check_started(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    _check_started(item)
    return result
