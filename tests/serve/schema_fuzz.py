"""Hypothesis strategies for request bodies, drawn from a JSON schema (the subset the
server's /openapi.json uses: ``type``, ``enum``, ``anyOf``, a ``oneOf`` of ``required``
lists, ``properties``, ``required``, ``additionalProperties``, ``propertyNames``,
``items``, and the bounds), and mutations of them that break the schema.

Valid bodies stay cheap to serve (an unbounded array gets at most ``SHORT`` items, an
unbounded integer is mostly small); their strings may hold lone surrogates, which JSON
escapes (``\\ud800``) and a JSON schema calls strings. The mutations: a field set to any
JSON value (or an integer past int64), an unknown field (its name perhaps a lone
surrogate), at the top or in ``stream_options``, a required field dropped, and a body
that is no object at all."""

from __future__ import annotations

from hypothesis import strategies as st

SHORT = 3  # the most items an unbounded array or map gets
EXTREME_INTS = (-(2**64), -(2**63) - 1, -(2**63), -1, 0, 1, 2**31, 2**32, 2**63 - 1, 2**63,
                2**64, 10**30, 10**400)
ODD_CHARS = ("\ud800", "\udfff", "\x00", "\x01", "/", "\\", "\"", "é", "\u2028", "\ufffd")
CHARS = st.characters() | st.sampled_from(ODD_CHARS)


def text(min_size: int = 0, max_size: int = 12) -> st.SearchStrategy[str]:
    return st.text(CHARS, min_size=min_size, max_size=max(min_size, max_size))


def json_values() -> st.SearchStrategy:
    """Any JSON value (NaN too: Python's parser takes it), nested a little."""
    leaves = (st.none() | st.booleans() | st.integers() | st.sampled_from(EXTREME_INTS)
              | st.floats() | text())
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=SHORT)
                        | st.dictionaries(text(max_size=6), inner, max_size=SHORT),
                        max_leaves=8)


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values ``schema`` takes."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of(*[from_schema(s) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return _integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return _numbers(schema)
    if kind == "string":
        return text(schema.get("minLength", 0), min(schema.get("maxLength", 12), 12))
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {})), min_size=low,
                        max_size=max(low, min(schema.get("maxItems", SHORT), SHORT)))
    if kind == "object":
        return _objects(schema)
    return json_values()  # (no type: anything)


def _integers(low: int | None, high: int | None) -> st.SearchStrategy[int]:
    edges = [v for v in (*EXTREME_INTS, low, high) if v is not None
             and (low is None or v >= low) and (high is None or v <= high)]
    small = st.integers(low if low is not None else -4, (low if low is not None else 0) + 4)
    return st.one_of(small.filter(lambda v: high is None or v <= high),
                     st.integers(low, high), st.sampled_from(edges))


def _numbers(schema: dict) -> st.SearchStrategy[float]:
    above = schema.get("exclusiveMinimum")
    low = schema.get("minimum", above)
    high = schema.get("maximum")
    floats = st.floats(low, high, exclude_min=above is not None, allow_nan=False,
                       allow_infinity=False)
    ints = st.integers(None if low is None else int(low) + (above is not None),
                       None if high is None else int(high))
    return floats | ints


def _objects(schema: dict) -> st.SearchStrategy[dict]:
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    if not props:  # a map: logit_bias (its keys by pattern), or any object
        keys = (st.from_regex(schema["propertyNames"]["pattern"], fullmatch=True)
                if "propertyNames" in schema else text(max_size=6))
        values = from_schema(extra) if isinstance(extra, dict) else json_values()
        return st.dictionaries(keys, values, max_size=SHORT)
    required = set(schema.get("required", []))
    branches = [set(b["required"]) for b in schema.get("oneOf", [])] or [set()]
    others = set().union(*branches)

    def body(branch: set) -> st.SearchStrategy[dict]:
        need = required | branch
        return st.fixed_dictionaries(
            {k: from_schema(props[k]) for k in sorted(need)},
            optional={k: from_schema(v) for k, v in props.items()
                      if k not in need and k not in others})
    return st.sampled_from(branches).flatmap(body)


def mutated(schema: dict) -> st.SearchStrategy:
    """Bodies that break ``schema`` (an object schema) one way or another."""
    valid = from_schema(schema)
    names = sorted(schema["properties"])
    required = set(schema.get("required", []))
    wrong = json_values() | st.sampled_from(EXTREME_INTS) | st.sampled_from(ODD_CHARS)
    ways = [
        st.tuples(valid, st.sampled_from(names), wrong).map(lambda t: {**t[0], t[1]: t[2]}),
        st.tuples(valid, text(1, 6), json_values()).map(lambda t: {**t[0], t[1]: t[2]}),
        valid.map(lambda b: {k: v for k, v in b.items() if k not in required}),
        json_values(),
    ]
    if "stream_options" in schema["properties"]:
        ways.append(st.tuples(valid, text(1, 6) | st.sampled_from(["include_usage"]), wrong)
                    .map(lambda t: {**t[0], "stream_options": {t[1]: t[2]}}))
    return st.one_of(ways)
