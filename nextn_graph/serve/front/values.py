"""One scalar field of a JSON request body, read and checked: an integer in a range, a
flag, a finite number. Each refusal is a 400 naming the field. Every integer the engine
hands to torch is bounded here or by the request's own limits (the context, the
vocabulary, ``--max-logprobs``), so no value the JSON parser takes (Python's integers
have no bound) reaches an int64 tensor out of range."""

from __future__ import annotations

import math

from ...errors import show_value
from .errors import bad_value


def integer(body: dict, key: str, default, low: int, high: int | None = None):
    """``body[key]``: an integer in [low, high) (high None: no bound here: a later check
    bounds it); ``default`` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise bad_value(f"{key} must be an integer {bound}, got {show_value(value)}", key)
    return value


def flag(body: dict, key: str, where: str = "") -> bool:
    """``body[key]``: true or false (absent or null: false); ``where`` prefixes its name
    (``stream_options.``)."""
    value = body.get(key, False)
    if not isinstance(value, bool) and value is not None:
        raise bad_value(f"{where}{key} must be true or false, got {show_value(value)}",
                        where + key)
    return value is True


def number(body: dict, key: str, default: float) -> float:
    """``body[key]`` as a float: any JSON number a float holds (an integer past a
    double's range is refused, as NaN and the infinities are by each field's check)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_value(f"{key} must be a number, got {show_value(value)}", key)
    try:
        out = float(value)
    except OverflowError:  # (an integer of some 309 digits or more)
        out = math.inf
    if not math.isfinite(out):
        raise bad_value(f"{key} must be a finite number, got {show_value(value, 40)}", key)
    return out
