"""The served engine built (load, build, capture), where it lives: its own process, or
the engine thread; on a tensor-parallel group, rank 0's. Its own ``RequestLimits``
(plain fields) go to the front once it is ready (``messages.Ready``): the front checks
requests against exactly what the engine accepts, and never builds the engine or touches
the device itself.
"""

from __future__ import annotations

from ...config import RunConfig
from ...launch.ranks import load_on_ranks
from ...parallel.group import TPGroup
from ...runtime.engine import SpecEngine


def build_engine(cfg: RunConfig, plain: bool = False,
                 group: TPGroup | None = None) -> SpecEngine:
    """Load, build and capture. ``plain``: decode without the draft (``speculative``
    None), for comparisons. ``group``: this process is rank 0 of a tensor-parallel
    group (its followers load and build alongside, ``launch.follower``); None: one rank."""
    models, _ = load_on_ranks(cfg, group or TPGroup.single())
    return SpecEngine(models.target, models.draft, None if plain else cfg.speculative,
                      cfg.pool, cfg.graph, scheduler=cfg.scheduler)
