"""Starting the ranks of a tensor-parallel group.

Three ways in, one process group at the end (``TPGroup``):

- ``torchrun --nproc-per-node N -m nextn_graph ...``: torchrun sets ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``group_from_env`` joins.
- ``spawn(fn, tp)``: this machine starts ``tp`` processes itself (``--tp N`` on the
  command line, and the tests), each calling ``fn(group, *args)``; rank 0's return
  value comes back.
- ``Followers(fn, tp)``: this process is rank 0 and starts ranks 1..tp-1 (``serve --tp
  N``: the engine process), which exit when it is gone.

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
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..checkpoint.loader import load_checkpoint
from ..checkpoint.sharding import sharded_bytes
from ..errors import ConfigError, ParallelError
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


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """How a rank started on this machine joins its group (picklable): over TCP on
    loopback, ``port`` held by rank 0's store."""

    size: int
    port: int
    device: str
    timeout_s: float
    threads: int = 1  # torch intra-op threads of a spawned rank

    def join(self, rank: int) -> TPGroup:
        return init_group(rank, self.size, self.device, self.timeout_s,
                          init_method=f"tcp://127.0.0.1:{self.port}")


def check_world_size(group: TPGroup, tp: int) -> None:
    """Under torchrun the world size is the tensor-parallel size: refuse a mismatch."""
    if group.size != tp:
        raise ConfigError(f"torchrun started {group.size} processes but the config asks "
                          f"for parallel.tp = {tp} (set parallel.tp or --tp to {group.size})")


def exit_rank(status: int) -> None:
    """End a rank now that its group is closed. A normal interpreter exit after a gloo
    group (torch 2.13) sometimes aborts in a C++ destructor ("terminate called without
    an active exception", SIGABRT) after all work is done, which torchrun then reports
    as a failed run; leaving with ``os._exit`` skips those destructors."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _watch(lifeline) -> None:
    """Exit the moment the process holding the other end of ``lifeline`` is gone (it
    exited, or was killed: the pipe's end closes either way)."""
    def wait() -> None:
        try:
            lifeline.recv()
        except (EOFError, OSError):
            pass
        print("nextn-graph: rank 0's process is gone: exiting", file=sys.stderr)
        exit_rank(1)
    threading.Thread(target=wait, name="nextn-lifeline", daemon=True).start()


def _child(rank: int, spec: RankSpec, fn: Callable, args: tuple, results,
           lifeline=None) -> None:
    """One spawned rank: join, run ``fn(group, *args)``, leave. Its result goes to
    ``results`` (``spawn``); without a queue an error is printed and the exit status is 1
    (``Followers``)."""
    torch.set_num_threads(spec.threads)
    if lifeline is not None:
        _watch(lifeline)
    group, status = None, 0
    try:
        group = spec.join(rank)
        value = fn(group, *args)
        close_group(group)
        if results is not None:
            results.put((rank, "ok", value))
    except BaseException as exc:  # reported to the parent, which raises
        text = f"{type(exc).__name__}: {exc}"
        if results is not None:
            results.put((rank, "error", f"{text}\n{traceback.format_exc()}"))
        else:
            print(f"nextn-graph: error (rank {rank}): {text}", file=sys.stderr)
            status = 1
        if group is not None:
            close_group(group, orderly=False)
    exit_rank(status)  # the result is already sent (see exit_rank)


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
    spec = RankSpec(tp, free_port(), device, timeout_s)
    procs = [ctx.Process(target=_child, args=(r, spec, fn, args, results), daemon=False)
             for r in range(tp)]
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


class Followers:
    """Ranks 1..tp-1 of a group whose rank 0 is this process, started here (``serve --tp
    N``: the engine process leads them), each running ``fn(group, *args)``.

    They never outlive this process: they are daemonic, and each watches a lifeline pipe
    whose other end only this process holds, so they exit when it is gone however it
    ended (an exit, SIGKILL). ``end`` closes that pipe and kills what is left; call it
    before this process exits (a follower may ignore the SIGTERM that multiprocessing
    sends its daemonic children at exit)."""

    def __init__(self, fn: Callable[..., Any], tp: int, args: tuple = (), device: str = "cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 1):
        ctx = mp.get_context("spawn")
        self.spec = RankSpec(tp, free_port(), device, timeout_s, threads)
        watched, self._lifeline = ctx.Pipe(duplex=False)
        self.procs = [ctx.Process(target=_child, name=f"nextn-rank{r}", daemon=True,
                                  args=(r, self.spec, fn, args, None, watched))
                      for r in range(1, tp)]
        for p in self.procs:
            p.start()
        watched.close()  # the followers' end: closed here, held by them alone

    def join(self) -> TPGroup:
        """This process joins as rank 0 (bounded by the group's timeout)."""
        return self.spec.join(0)

    def dead(self) -> str | None:
        """Why the first follower that is gone is gone, or None while all run."""
        for rank, p in enumerate(self.procs, 1):
            if not p.is_alive():
                return (f"tensor parallelism: rank {rank} of {self.spec.size} exited "
                        f"(exit code {p.exitcode})")
        return None

    def end(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for the followers to exit (after ``shutdown``), then kill
        the ones left; the lifeline closes, so any that lost rank 0 exits too."""
        deadline = time.monotonic() + wait_s
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        self._lifeline.close()
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(wait_s)


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
