"""The ``pool:`` section: the KV pool's request rows, positions per request and pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError


@dataclass(frozen=True)
class PoolConfig:
    max_requests: int = 8  # request rows in the KV pool (row 0 is padding, extra)
    max_context: int = 512  # positions per request: prompt + output + N
    page_size: int = 256  # positions of a page of compressed KV (a multiple of 128)
    num_pages: int = 0  # pages shared by the requests; 0: every row can reach max_context
    prefix_cache: bool = True  # reuse the cached pages of a prompt's prefix (memory/prefix.py)
    prefix_snapshots: int = 0  # page-boundary states the prefix cache keeps; 0: one per request row
    # reserve: a request's pages for prompt + max_new at admission (it never waits again);
    # grow: pages as it decodes, the newest request preempted (recomputed) when none are left
    allocation: str = "grow"

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"allocation": ("reserve", "grow")}


def check_pool(pool: PoolConfig, verify_width: int, where: str) -> None:
    if pool.max_requests < 1:
        raise ConfigError(f"{where}: key 'pool.max_requests' must be at least 1, "
                          f"got {pool.max_requests}")
    if pool.page_size < 1:
        raise ConfigError(f"{where}: key 'pool.page_size' must be at least 1, "
                          f"got {pool.page_size}")
    if pool.num_pages < 0:
        raise ConfigError(f"{where}: key 'pool.num_pages' must be at least 0 (0: enough "
                          f"for every row at max_context), got {pool.num_pages}")
    if pool.prefix_snapshots < 0:
        raise ConfigError(f"{where}: key 'pool.prefix_snapshots' must be at least 0 (0: "
                          f"one per request row), got {pool.prefix_snapshots}")
    if pool.max_context < verify_width + 1:
        raise ConfigError(f"{where}: key 'pool.max_context' {pool.max_context} is smaller "
                          f"than one verify window plus a prompt token")
