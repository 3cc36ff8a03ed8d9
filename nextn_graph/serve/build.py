"""The served engine built (load, build, capture), and what the server's front learns
of it.

``build_engine`` runs where the engine lives (its own process, or the engine thread;
on a tensor-parallel group, rank 0's). The engine's own ``RequestLimits`` (plain
fields) are sent across once it is ready: the front checks requests against exactly
what the engine accepts. The front adds the model's name, its tokenizer and chat
template itself (``describe``), from the checkpoint directory: it never builds the
engine or touches the device.
"""

from __future__ import annotations

from ..checkpoint.loader import resolve_checkpoint
from ..checkpoint.tokenizer import load_tokenizer
from ..config import RunConfig
from ..launch.ranks import load_on_ranks
from ..parallel.group import TPGroup
from ..runtime.engine import SpecEngine
from ..runtime.request_checks import RequestLimits
from .chat import load_chat_template
from .protocol import ModelInfo


def build_engine(cfg: RunConfig, plain: bool = False,
                 group: TPGroup | None = None) -> SpecEngine:
    """Load, build and capture. ``plain``: decode without the draft (``speculative``
    None), for comparisons. ``group``: this process is rank 0 of a tensor-parallel
    group (its followers load and build alongside, ``launch.follower``); None: one rank."""
    models, _ = load_on_ranks(cfg, group or TPGroup.single())
    return SpecEngine(models.target, models.draft, None if plain else cfg.speculative,
                      cfg.pool, cfg.graph, scheduler=cfg.scheduler)


def describe(cfg: RunConfig, name: str | None, limits: RequestLimits) -> ModelInfo:
    """The front's ``ModelInfo``: the engine's limits, the name served (default: the
    checkpoint directory's), the tokenizer and the chat template read from the files."""
    root = resolve_checkpoint(cfg.checkpoint)
    return ModelInfo(name or root.name, limits, load_tokenizer(root, limits.vocab_size),
                     load_chat_template(root))
