"""The checkpoint's chat template: ``chat_template`` in its ``tokenizer_config.json``
(Hugging Face's convention), a Jinja template rendered in a sandbox with ``messages``
and ``add_generation_prompt=True``. A checkpoint without one serves no chat."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ...errors import CheckpointError, show_value
from .errors import APIError

CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class ChatTemplate:
    path: Path
    template: jinja2.Template

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True)
        except jinja2.TemplateError as exc:
            raise APIError(400, f"messages: the chat template refused them "
                                f"({show_value(str(exc), 200)})", param="messages") from None


def load_chat_template(root: Path) -> ChatTemplate | None:
    """``root/tokenizer_config.json``'s ``chat_template``; None when there is none."""
    path = Path(root) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        source = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a JSON object ({show_value(str(exc), 120)})") from None
    if source is None:
        return None
    if not isinstance(source, str):
        raise CheckpointError(f"{path}: chat_template must be a string (one template)")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return ChatTemplate(path, env.from_string(source))
    except jinja2.TemplateError as exc:
        raise CheckpointError(f"{path}: chat_template does not parse "
                              f"({show_value(str(exc), 120)})") from None
