"""The served engine built (load, build, capture), and what the server's front learns
of it.

``build_engine`` runs where the engine lives (its own process, or the engine thread;
on a tensor-parallel group, rank 0's).
It returns the engine and its ``EngineFacts``: the plain fields of ``ModelInfo``, sent
across once the engine is ready. The front adds the model's name, its tokenizer and
chat template itself (``describe``), from the checkpoint directory: it never builds the
engine or touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.loader import resolve_checkpoint
from ..checkpoint.tokenizer import load_tokenizer
from ..config import RunConfig
from ..launch.ranks import load_on_ranks
from ..parallel.group import TPGroup
from ..runtime.engine import SpecEngine
from .chat import load_chat_template
from .protocol import ModelInfo


@dataclass(frozen=True)
class EngineFacts:
    """What the engine knows that the server checks requests against (picklable)."""

    vocab_size: int
    eos_token_id: int
    max_context: int  # min(pool.max_context, max_position_embeddings)
    lookahead: int  # positions a request's verify windows write past its output
    samples: bool  # graph.sampling
    max_logprobs: int  # graph.logprobs
    penalties: bool  # graph.penalties


def build_engine(cfg: RunConfig, plain: bool = False,
                 group: TPGroup | None = None) -> tuple[SpecEngine, EngineFacts]:
    """Load, build and capture. ``plain``: decode without the draft (``speculative``
    None), for comparisons. ``group``: this process is rank 0 of a tensor-parallel
    group (its followers load and build alongside, ``launch.follower``); None: one rank."""
    models, _ = load_on_ranks(cfg, group or TPGroup.single())
    engine = SpecEngine(models.target, models.draft, None if plain else cfg.speculative,
                        cfg.pool, cfg.graph, scheduler=cfg.scheduler)
    mc = engine.cfg
    return engine, EngineFacts(mc.vocab_size, mc.eos_token_id,
                               min(cfg.pool.max_context, mc.max_position_embeddings),
                               engine.lookahead, engine.samples, engine.max_logprobs,
                               engine.penalizes)


def describe(cfg: RunConfig, name: str | None, facts: EngineFacts) -> ModelInfo:
    """The front's ``ModelInfo``: the engine's facts, the name served (default: the
    checkpoint directory's), the tokenizer and the chat template read from the files."""
    root = resolve_checkpoint(cfg.checkpoint)
    return ModelInfo(name or root.name, facts.vocab_size, facts.eos_token_id,
                     facts.max_context, facts.lookahead, facts.samples,
                     load_tokenizer(root, facts.vocab_size), load_chat_template(root),
                     facts.max_logprobs, facts.penalties)
