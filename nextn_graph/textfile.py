"""Reading the project's text inputs (prompts, config.json, indexes, YAML) as named errors.

A missing file, a directory, an unreadable file, bytes that are not UTF-8 and
JSON that is malformed, absurdly nested or holds an unparsable integer each
raise the caller's error class with the path (and line) in the message, never a
raw ``OSError`` / ``UnicodeDecodeError`` / ``RecursionError``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from .errors import NextnGraphError


def read_text(path: Path, what: str, error: type[NextnGraphError]) -> str:
    """A UTF-8 text file; ``what`` names it in messages ("prompts file", "config")."""
    if path.is_dir():
        raise error(f"{path}: is a directory, not a {what}")
    if not path.exists():
        raise error(f"{path}: {what} not found")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at "
                    f"byte offset {exc.start})") from None


def parse_json(text: str, where: str, error: type[NextnGraphError],
               object_pairs_hook: Callable[[list], Any] | None = None) -> Any:
    """JSON text -> value; ``where`` (file or file:line) prefixes every message."""
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: malformed JSON ({exc.msg})") from None
    except ValueError as exc:  # an integer literal too long to convert, or the hook's
        raise error(f"{where}: malformed JSON ({str(exc)[:120]})") from None
    except RecursionError:
        raise error(f"{where}: malformed JSON (nested too deeply)") from None
