"""The ``parallel:`` section: tensor-parallel ranks and the bound on every message."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

MAX_TP = 1024
MAX_TIMEOUT_S = 7 * 24 * 3600


@dataclass(frozen=True)
class ParallelConfig:
    # Tensor-parallel ranks (heads, vocab and experts split, see checkpoint/sharding.py).
    # Under torchrun it must equal the world size; otherwise `--tp N`/this key spawns them.
    tp: int = 1
    # Bound on every collective and control message: a dead or hung rank ends the
    # others with an error after this long. Rank 0 must step at least this often.
    timeout_s: int = 300


def check_parallel(par: ParallelConfig, where: str) -> None:
    if not 1 <= par.tp <= MAX_TP:
        raise ConfigError(f"{where}: key 'parallel.tp' must lie in [1, {MAX_TP}], "
                          f"got {par.tp}")
    if not 1 <= par.timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"{where}: key 'parallel.timeout_s' must lie in "
                          f"[1, {MAX_TIMEOUT_S}] seconds, got {par.timeout_s}")
