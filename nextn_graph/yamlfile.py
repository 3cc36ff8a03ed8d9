"""Reading a YAML config file strictly: one document, plain mappings, no surprises.

Anchors, aliases and merge keys are refused (an alias bomb is never expanded), and
so are duplicate keys (YAML would keep the last) and keys that YAML reads as
something other than a string (``yes:``, ``on:``, ``null:``, ``1:``). Errors name
the file and the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, show_value
from .textfile import read_text

_MERGE_TAG = "tag:yaml.org,2002:merge"
_KEY_HINT = " (YAML reads yes/no/on/off, null and bare numbers as values: quote the key)"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors, aliases, merge keys and duplicate keys.

    Anchors are refused while composing, at the first ``&``/``*`` event, so an
    alias bomb is never expanded; duplicate keys would otherwise silently keep
    the last value.
    """

    def __init__(self, text: str, where: str):
        super().__init__(text)
        self.where = self.name = where  # name: what PyYAML's own marks print as the file

    def _refuse(self, mark: yaml.Mark, what: str) -> ConfigError:
        return ConfigError(f"{self.where}:{mark.line + 1}: {what}")

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.NodeEvent) and event.anchor is not None:
            kind = "alias" if isinstance(event, yaml.AliasEvent) else "anchor"
            raise self._refuse(event.start_mark, f"YAML {kind} {show_value(event.anchor)} is not "
                                                 f"allowed in a config file")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                raise self._refuse(key_node.start_mark, "YAML merge key '<<' is not allowed")
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:  # an unhashable key: the base constructor refuses it below
                continue
            if not isinstance(key, str):  # `yes:`, `on:`, `null:`, `1:` read as bool/None/int
                text = show_value(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                raise self._refuse(key_node.start_mark, f"key {text} reads as "
                                   f"{show_value(key)}, not a string{_KEY_HINT}")
            if key in seen:
                raise self._refuse(key_node.start_mark, f"duplicate key {show_value(key)}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> Any:
    text = read_text(path, "config file", ConfigError)
    loader = _StrictLoader(text, str(path))
    try:
        return loader.get_single_data()
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: e.g. an int too long to parse
        raise ConfigError(f"{path}: invalid YAML ({str(exc)[:300]})") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML (nested too deeply)") from None
    finally:
        loader.dispose()
