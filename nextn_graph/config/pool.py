"""The ``pool:`` section: the KV pool's request rows and positions per request."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class PoolConfig:
    max_requests: int = 8  # request rows in the KV pool (row 0 is padding, extra)
    max_context: int = 512  # positions per request: prompt + output + N


def check_pool(pool: PoolConfig, verify_width: int, where: str) -> None:
    if pool.max_requests < 1:
        raise ConfigError(f"{where}: key 'pool.max_requests' must be at least 1, "
                          f"got {pool.max_requests}")
    if pool.max_context < verify_width + 1:
        raise ConfigError(f"{where}: key 'pool.max_context' {pool.max_context} is smaller "
                          f"than one verify window plus a prompt token")
