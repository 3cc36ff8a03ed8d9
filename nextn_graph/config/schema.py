"""The strict builder every section is read through: a YAML mapping (or a section
built in code) into its frozen dataclass, or a ``ConfigError`` naming the file and
the dotted key.

A section declares what the builder checks beyond types on the class itself:
``CHOICES`` (field -> allowed values) and ``RENAMED`` (old key -> new key, so a file
written for an older release is told what its key became, not just that it is unknown).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from ..errors import ConfigError, show_value

_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # a whole number (temperature: 1) reads as an int
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_keys(cls: type, raw: dict, where: str, prefix: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    not_str = [k for k in raw if not isinstance(k, str)]  # overrides bypass the YAML loader
    if not_str:
        where_key = f"under {prefix.rstrip('.')!r}" if prefix else "at top level"
        raise ConfigError(f"{where}: key {show_value(not_str[0])} {where_key} is not a string")
    unknown = sorted(set(raw) - names)
    renamed = getattr(cls, "RENAMED", {})
    for key in unknown:
        if key in renamed:
            raise ConfigError(f"{where}: key {prefix + key!r} was renamed to "
                              f"{prefix + renamed[key]!r}")
    if unknown:
        raise ConfigError(f"{where}: unknown key {show_value(prefix + unknown[0])} "
                          f"(known: {', '.join(sorted(names))})")


def build_section(cls: type, raw: Any, where: str, prefix: str) -> Any:
    """Strictly build dataclass ``cls`` from a YAML mapping; nested sections recurse."""
    if not isinstance(raw, dict):
        what = f"key {prefix.rstrip('.')!r}" if prefix else "top level"
        raise ConfigError(f"{where}: {what} must be a mapping, got {show_value(raw)}")
    _check_keys(cls, raw, where, prefix)
    hints = typing.get_type_hints(cls)
    choices = getattr(cls, "CHOICES", {})
    values = {}
    for name, value in raw.items():
        key, kind = prefix + name, hints[name]
        if dataclasses.is_dataclass(kind):
            values[name] = build_section(kind, value, where, key + ".")
            continue
        if typing.get_origin(kind) is tuple:  # a YAML list of one item type
            item = typing.get_args(kind)[0]
            if not isinstance(value, list) or not all(_is(v, item) for v in value):
                raise ConfigError(f"{where}: key {key!r} must be a list of "
                                  f"{item.__name__}, got {show_value(value)}")
            value = tuple(value)
        elif not _is(value, kind):
            raise ConfigError(f"{where}: key {key!r} must be {_NAMES[kind]}, "
                              f"got {show_value(value)}")
        if name in choices and value not in choices[name]:
            raise ConfigError(f"{where}: key {key!r} must be one of {choices[name]}, "
                              f"got {show_value(value)}")
        values[name] = value
    return cls(**values)


def check_section(obj: Any, where: str, prefix: str) -> Any:
    """A config dataclass built in code, checked as strictly as one read from YAML."""
    raw = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raw = {k: list(v) if isinstance(v, tuple) else v for k, v in raw.items()}
    return build_section(type(obj), raw, where, prefix)
