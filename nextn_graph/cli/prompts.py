"""Prompts as ``generate`` takes them: JSONL lines of token ids or text, or ``--prompt``.

Each line is ``{"input_ids": [int, ...]}`` or ``{"text": "..."}``, optionally with
that request's own sampling keys (``temperature``, ``top_p``, ``top_k``, ``seed``,
as ``SamplingParams`` spells them), which override the command's options for it:
``{"text": "hi", "temperature": 0.8, "seed": 7}``. Nothing else: other per-request
settings (``max_new_tokens``, ``stop_ids``) are command options. Text goes through
the checkpoint's tokenizer. Errors name the file, line and key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..checkpoint.tokenizer import TOKENIZER_FILE, CheckpointTokenizer
from ..errors import InputError, show_value
from ..sampling import KEYS as SAMPLING_KEYS, SamplingParams
from ..textfile import parse_json, read_text

PROMPT_KEYS = ("input_ids", "text")  # exactly one per line
PROMPT_FORMS = '{"input_ids": [int, ...]} or {"text": "..."}'


@dataclass(frozen=True)
class Prompt:
    """One request as given: token ids, or text for the checkpoint's tokenizer, and
    the sampling keys its line set (checked; the command's options fill the rest)."""

    where: str  # "FILE:LINE" or "--prompt #N", for error messages
    value: list[int] | str
    sampling: dict = field(default_factory=dict)  # a subset of SAMPLING_KEYS -> value


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


def _prompt_value(row: dict, where: str) -> list[int] | str:
    """The ids or text of one parsed line's prompt keys: exactly one of the two."""
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


def _line_sampling(row: dict, where: str) -> dict:
    """The sampling keys of one line, each checked as ``SamplingParams`` checks it (the
    error names FILE:LINE and the key); the keys not given are left to the command."""
    checked = SamplingParams(**row).checked(where)
    return {key: getattr(checked, key) for key in row}


def _parse_line(row: object, where: str) -> Prompt:
    """One parsed line -> its prompt: one prompt key, any sampling keys, nothing else."""
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected {PROMPT_FORMS}")
    unknown = [k for k in row if k not in PROMPT_KEYS + SAMPLING_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {show_value(unknown[0])} (a line holds "
                         f"{PROMPT_FORMS}, optionally with sampling keys "
                         f"{', '.join(SAMPLING_KEYS)}; other per-request settings such as "
                         f"max_new_tokens are command options)")
    value = _prompt_value({k: v for k, v in row.items() if k in PROMPT_KEYS}, where)
    sampling = _line_sampling({k: v for k, v in row.items() if k in SAMPLING_KEYS}, where)
    return Prompt(where, value, sampling)


def read_prompts(path: str | Path) -> list[Prompt]:
    """JSONL, one ``{"input_ids": [...]}`` or ``{"text": "..."}`` per line, optionally
    with sampling keys; blank lines are skipped. Any other key (``max_new_tokens``,
    ``stop_ids``) is refused rather than silently ignored."""
    path = Path(path)
    text = read_text(path, "prompts file", InputError)
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        row = parse_json(line, where, InputError, _unique_keys(where))
        prompts.append(_parse_line(row, where))
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
