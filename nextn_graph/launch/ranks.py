"""Starting the ranks of a tensor-parallel group.

Two ways in, one process group at the end (``TPGroup``):

- ``torchrun --nproc-per-node N -m nextn_graph ...``: torchrun sets ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``group_from_env`` joins.
- ``spawn(fn, tp)``: this machine starts ``tp`` processes itself (``--tp N`` on the
  command line, and the tests), each calling ``fn(group, *args)``; rank 0's return
  value comes back.

Every process group gets a bounded ``timeout``: a rank that dies, hangs or loads a
different model ends the others with an error instead of a hang.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..checkpoint.loader import load_checkpoint
from ..checkpoint.sharding import sharded_bytes
from ..errors import ParallelError
from ..parallel.group import TPGroup

DEFAULT_TIMEOUT_S = 300.0
DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, device: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               init_method: str | None = None) -> TPGroup:
    """Join (or create) the default process group and wrap it; ``device`` picks the
    backend (gloo on cpu, nccl on cuda, hccl on npu). The scheduler's host messages get
    a gloo group of their own where the device backend is not gloo."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = DEVICE_BACKENDS[device]
    if device == "npu":
        import torch_npu  # noqa: F401  (registers hccl; only ever imported on Ascend)
    if device != "cpu":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.get_device_module(device).set_device(local)
    dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout,
                            init_method=init_method or "env://")
    group = dist.group.WORLD
    control = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    if device != "cpu":  # NCCL/HCCL set up their communicator lazily, on the first
        # collective: that must not happen inside a graph capture
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    return TPGroup(rank, size, group, control, timeout_s)


def group_from_env(device: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup | None:
    """The group torchrun set up for this process, or None when not launched by it."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return init_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device,
                      timeout_s)


def close_group(group: TPGroup, orderly: bool = True) -> None:
    """Leave the group. ``orderly``: every rank got here (the end of a run): wait for the
    others first, so no rank tears its connections down under a peer's last message."""
    if group.parallel and dist.is_initialized():
        if orderly:
            dist.barrier(group=group.control)
        dist.destroy_process_group()


def _child(rank: int, size: int, port: int, device: str, timeout_s: float, fn: Callable,
           args: tuple, results) -> None:
    torch.set_num_threads(1)
    group = None
    try:
        group = init_group(rank, size, device, timeout_s,
                           init_method=f"tcp://127.0.0.1:{port}")
        value = fn(group, *args)
        close_group(group)
        results.put((rank, "ok", value))
    except BaseException as exc:  # reported to the parent, which raises
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        if group is not None:
            close_group(group, orderly=False)
    # A normal exit after a gloo group sometimes aborts in a C++ destructor (torch 2.13,
    # "terminate called without an active exception"); the result is already sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], tp: int, args: tuple = (), device: str = "cpu",
          timeout_s: float = DEFAULT_TIMEOUT_S, lead_decides: bool = False) -> list[Any]:
    """Run ``fn(group, *args)`` on ``tp`` fresh processes of this machine -> every rank's
    result, by rank. Any rank's error (or death) raises ``ParallelError`` naming it,
    after every process has ended. ``lead_decides``: when rank 0 returned, its result
    stands and the others' errors (they lose rank 0 when it ends early) are None.
    ``fn`` and ``args`` must be picklable, and so must the results, without tensors: a
    tensor is shared through its rank's file descriptors, gone once the rank exits."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, tp, port, device, timeout_s, fn, args,
                                             results), daemon=False) for r in range(tp)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    # Read while the ranks run: a result larger than the pipe's buffer blocks its sender
    # until read, so joining first could wait forever.
    while len(got) < tp:
        if not results.empty():
            rank, status, value = results.get()
            got[rank] = (status, value)
        elif not any(p.is_alive() for p in procs) and results.empty():
            break
        else:
            time.sleep(0.02)
    for p in procs:
        p.join()
    if lead_decides and got.get(0, ("error",))[0] == "ok":
        return [v if s == "ok" else None for _, (s, v) in sorted(got.items())]
    errors = [(r, v) for r, (s, v) in sorted(got.items()) if s == "error"]
    dead = [r for r, p in enumerate(procs) if r not in got]
    if errors:
        rank, text = errors[0]
        raise ParallelError(f"tensor parallelism: rank {rank} of {tp} failed: {text}")
    if dead:
        codes = {r: procs[r].exitcode for r in dead}
        raise ParallelError(f"tensor parallelism: rank(s) {dead} of {tp} died "
                            f"(exit codes {codes})")
    return [got[r][1] for r in range(tp)]


def fingerprint(run_config: Any, model_config: Any) -> str:
    """A digest of what a rank loaded: ranks must agree on it (``TPGroup.agree``)."""
    text = json.dumps([dataclasses.asdict(run_config), dataclasses.asdict(model_config)],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def load_on_ranks(cfg: Any, group: TPGroup, progress: bool = False):
    """Every rank loads its slices of the config's checkpoint, then the ranks check they
    loaded the same thing -> (models, each rank's resident weight bytes by kind)."""
    models = load_checkpoint(cfg.checkpoint, cfg.torch_dtype, cfg.device, cfg.weights,
                             progress=progress and group.is_driver, tp=group,
                             kernels=cfg.kernels)
    per_rank = group.agree(fingerprint(cfg, models.cfg), sharded_bytes(models))
    return models, per_rank
