"""Prompts as ``generate`` takes them: JSONL lines of token ids or text, or ``--prompt``.

Each line is ``{"input_ids": [int, ...]}`` or ``{"text": "..."}``, nothing else;
text goes through the checkpoint's tokenizer. Errors name the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import InputError, show_value
from .textfile import parse_json, read_text
from .tokenizer import TOKENIZER_FILE, CheckpointTokenizer

PROMPT_KEYS = ("input_ids", "text")  # per-request settings are command options, not keys
PROMPT_FORMS = '{"input_ids": [int, ...]} or {"text": "..."}'


@dataclass(frozen=True)
class Prompt:
    """One request as given: token ids, or text for the checkpoint's tokenizer."""

    where: str  # "FILE:LINE" or "--prompt #N", for error messages
    value: list[int] | str


def _unique_keys(where: str) -> Callable[[list], dict]:
    """A JSON object hook: the pairs as a dict; a repeated key would silently keep the last."""
    def hook(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                raise InputError(f"{where}: duplicate key {show_value(key)}")
            out[key] = value
        return out

    return hook


def _prompt_value(row: object, where: str) -> list[int] | str:
    """The ids or text of one parsed line: exactly one of the two keys, nothing else."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected {PROMPT_FORMS}")
    unknown = [k for k in row if k not in PROMPT_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {show_value(unknown[0])} (each line is "
                         f"{PROMPT_FORMS} only; per-request settings such as "
                         f"max_new_tokens are command options)")
    if len(row) != 1:
        raise InputError(f"{where}: expected {PROMPT_FORMS}"
                         + (", not both" if row else ""))
    if "text" in row:
        if not isinstance(row["text"], str):
            raise InputError(f"{where}: \"text\" must be a string, got "
                             f"{show_value(row['text'], 40)}")
        return row["text"]
    ids = row["input_ids"]
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputError(f"{where}: expected {{\"input_ids\": [int, ...]}}")
    return ids


def read_prompts(path: str | Path) -> list[Prompt]:
    """JSONL, one ``{"input_ids": [...]}`` or ``{"text": "..."}`` per line; blank lines
    are skipped. Any other key (``max_new_tokens``, ``stop_ids``) is refused rather than
    silently ignored."""
    path = Path(path)
    text = read_text(path, "prompts file", InputError)
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        row = parse_json(line, where, InputError, _unique_keys(where))
        prompts.append(Prompt(where, _prompt_value(row, where)))
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


def prompt_ids(prompts: list[Prompt], tokenizer: CheckpointTokenizer | None,
                root: Path) -> list[list[int]]:
    """Each prompt's token ids: text goes through the checkpoint's tokenizer."""
    ids = []
    for prompt in prompts:
        if isinstance(prompt.value, list):
            ids.append(prompt.value)
        elif tokenizer is None:
            raise InputError(f"{prompt.where}: a text prompt, but the checkpoint {root} has "
                             f"no {TOKENIZER_FILE} (give token ids instead: "
                             f"{{\"input_ids\": [...]}} lines in --prompts)")
        else:
            ids.append(tokenizer.encode(prompt.value, prompt.where))
    return ids
