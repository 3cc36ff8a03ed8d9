"""One tensor-parallel group: this rank's place in it, and the collectives the model calls.

The model's collectives are ``torch.distributed``'s functional collectives
(``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` followed by
``wait_tensor``): ops on tensors that a CUDA graph, an NPU graph, Dynamo and the CPU
emulator can all hold. Host-side messages of the scheduler (rank 0 -> the others)
go over ``control``, a process group on the host (gloo): the device group when it
is gloo itself, a second gloo group over the same ranks otherwise.

A group of one (``TPGroup.single()``) issues no collective at all: tp = 1 runs the
exact code it ran before parallelism existed. Nothing here is global: the group is
handed to every module that shards.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..counters import Counters
from ..errors import ConfigError, ParallelError
from .control import Channel

_functional = torch.ops._c10d_functional


@dataclass
class CollectiveCounts(Counters):
    """Collectives this rank issued from Python: eagerly, or once while capturing a graph
    (a replay re-issues a graph's collectives without Python: the runner adds those)."""

    all_reduce: int = 0
    all_gather: int = 0
    control: int = 0  # host broadcasts of the scheduler (rank 0 -> the others)

    def total(self) -> int:
        return self.all_reduce + self.all_gather + self.control

    def as_dict(self) -> dict:
        return asdict(self)


class TPGroup:
    """``size`` ranks sharing one model; ``rank`` is this process's place."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, control=None,
                 timeout_s: float | None = None):
        if size > 1 and group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a "
                             "process group")
        self.rank, self.size = rank, size
        self.group = group  # the device collectives' process group (None when size 1)
        self.control = control if control is not None else group  # host messages (gloo)
        self.timeout_s = timeout_s
        self.counts = CollectiveCounts()
        # rank 0's decisions to the others (None for a group of one)
        self.channel = Channel(self.control, self.counts) if size > 1 else None

    @classmethod
    def single(cls) -> "TPGroup":
        return cls()

    @property
    def parallel(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler, reads the tokens back and talks to the user."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"

    # -- how a dimension splits ---------------------------------------------------
    def part(self, total: int, what: str) -> tuple[int, int]:
        """This rank's ``(start, length)`` of ``total`` split evenly; an uneven split is
        a ``ConfigError`` naming the dimension (``what``)."""
        if total % self.size:
            raise ConfigError(f"tensor parallelism: {what} = {total} does not divide "
                              f"into tp = {self.size} equal parts")
        n = total // self.size
        return self.rank * n, n

    # -- device collectives (capturable) -------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks; identity for a group of one. x: any shape -> same."""
        if not self.parallel:
            return x
        self.counts.all_reduce += 1
        out = _functional.all_reduce(x.contiguous(), "sum", self.group.group_name)
        return _functional.wait_tensor(out)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' shards along the last dim: [..., F] -> [..., size*F]."""
        if not self.parallel:
            return x
        self.counts.all_gather += 1
        lead, f = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, f).contiguous()  # [R, F]
        out = _functional.all_gather_into_tensor(flat, self.size, self.group.group_name)
        out = _functional.wait_tensor(out)  # [size*R, F], rank-major
        return out.view(self.size, -1, f).permute(1, 0, 2).reshape(*lead, self.size * f)

    # -- host agreement (start-up) -------------------------------------------------------
    def agree(self, fingerprint: str, info: object = None) -> list:
        """Every rank must have loaded the same thing: ``fingerprint`` (a digest of the
        run config and the model) is compared across ranks; a mismatch is a
        ``ParallelError`` naming the ranks. -> every rank's ``info``, by rank."""
        if not self.parallel:
            return [info]
        got: list = [None] * self.size
        self.counts.control += 1
        dist.all_gather_object(got, (fingerprint, info), group=self.control)
        odd = [r for r, (fp, _) in enumerate(got) if fp != got[0][0]]
        if odd:
            raise ParallelError(f"tensor parallelism: rank(s) {odd} loaded a different "
                                f"config or checkpoint than rank 0 (every rank must run the "
                                f"same command and files)")
        return [i for _, i in got]
