"""What the front knows of the served model: ``ModelInfo``, made once the engine is ready
(``describe``) of the engine's own ``RequestLimits`` and what the front reads itself from
the checkpoint directory: the name served, the tokenizer and the chat template."""

from __future__ import annotations

from dataclasses import dataclass

from ...checkpoint.loader import resolve_checkpoint
from ...checkpoint.tokenizer import CheckpointTokenizer, load_tokenizer
from ...config import RunConfig
from ...runtime.request_checks import RequestLimits
from .chat import ChatTemplate, load_chat_template


@dataclass(frozen=True)
class ModelInfo:
    """What the server knows of the served model once the engine is built: the engine's
    own limits, and what the front adds."""

    name: str  # the model id clients pass and /v1/models lists
    limits: RequestLimits  # the engine's: what its add_request accepts
    tokenizer: CheckpointTokenizer | None
    chat: ChatTemplate | None


def describe(cfg: RunConfig, name: str | None, limits: RequestLimits) -> ModelInfo:
    """The front's ``ModelInfo``: the engine's limits, the name served (default: the
    checkpoint directory's), the tokenizer and the chat template read from the files."""
    root = resolve_checkpoint(cfg.checkpoint)
    return ModelInfo(name or root.name, limits, load_tokenizer(root, limits.vocab_size),
                     load_chat_template(root))
