"""Request bodies from a JSON schema (the subset the server's /openapi.json uses:
``type``, ``enum``, ``anyOf``, a ``oneOf`` of ``required`` lists, ``properties``,
``required``, ``additionalProperties``, ``propertyNames``, ``items``, and the bounds).

- ``edge_cases``: each field (and each field of an object field) at each of its
  ``edge_values``: at and just past its bounds and int64's, a string empty, a lone
  surrogate or a path, an array empty or holding such values, a value of another JSON
  type. A fixed list, sent on a body that is fine otherwise, so every value reaches as
  far into the server as it can.
- ``from_schema``: Hypothesis strategies for valid bodies, cheap to serve (an unbounded
  array gets at most ``SHORT`` items, an unbounded integer is mostly small); their
  strings may hold lone surrogates, which JSON escapes (``\\ud800``) and a JSON schema
  calls strings.
- ``mutated``: bodies that break the schema: one field at an edge value on a body of the
  required fields alone, a field set to any JSON value, an unknown field (its name
  perhaps a lone surrogate) at the top or in ``stream_options``, a required field
  dropped, a body that is no object at all.
"""

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


def from_schema(schema: dict, sparse: bool = False) -> st.SearchStrategy:
    """Values ``schema`` takes; ``sparse``: an object holds its required fields alone."""
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
        return _objects(schema, sparse)
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


def _objects(schema: dict, sparse: bool) -> st.SearchStrategy[dict]:
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
            optional={} if sparse else {k: from_schema(v) for k, v in props.items()
                                        if k not in need and k not in others})
    return st.sampled_from(branches).flatmap(body)


WRONG_TYPES = (True, "1", 1.5, [], {})  # a value of another JSON type


def edge_values(schema: dict) -> list:
    """Values at and just past ``schema``'s edges (a field's), of its own JSON type
    (an integer past its bounds or int64, a string empty or a lone surrogate, an array
    empty or holding such values), and of other types."""
    kinds = [s for s in schema.get("anyOf", [schema]) if s.get("type") not in (None, "null")]
    kind = kinds[0] if kinds else {"type": None}
    low, high = kind.get("minimum", kind.get("exclusiveMinimum")), kind.get("maximum")
    own: list = []
    if kind["type"] in ("integer", "number"):
        bounds = [v for v in (low, high) if v is not None]
        own = [*bounds, *(v - 1 for v in bounds), *(v + 1 for v in bounds), -(2**63) - 1,
               2**63, 2**64, 10**400, -(10**400), 1e308]
    elif kind["type"] == "string":
        own = ["", "\ud800", "a\udfffb", "\x00\x01", "x" * 300, "/etc/passwd"]
    elif kind["type"] == "array":
        own = [[], [2**63], [-1], ["\ud800"], [""], [[]], [None]]
    elif kind["type"] == "object":
        own = [{"\ud800": 1}, {"1": 2**63}, {"\u00b2": 1}]
    return list({_key(v): v for v in (*own, *WRONG_TYPES)}.values())


def _key(value: object) -> str:
    return repr((type(value), value))  # (True and 1, 1 and 1.0 apart; lists hashable)


def edge_cases(schema: dict) -> list[tuple[str, dict]]:
    """(field, {field: value}) for each field of an object schema and each of its
    ``edge_values``; an object field's own fields too (``stream_options.include_usage``)."""
    cases = []
    for name, prop in schema["properties"].items():
        cases += [(name, {name: v}) for v in edge_values(prop)]
        inner = [s for s in prop.get("anyOf", [prop]) if "properties" in s]
        for sub, sub_prop in (inner[0]["properties"].items() if inner else ()):
            cases += [(f"{name}.{sub}", {name: {sub: v}}) for v in edge_values(sub_prop)]
    return cases


def mutated(schema: dict) -> st.SearchStrategy:
    """Bodies that break ``schema`` (an object schema) one way or another."""
    valid, sparse = from_schema(schema), from_schema(schema, sparse=True)
    props = schema["properties"]
    names = sorted(props)
    required = set(schema.get("required", []))
    wrong = json_values() | st.sampled_from(EXTREME_INTS) | st.sampled_from(ODD_CHARS)
    one_past = st.sampled_from(names).flatmap(
        lambda n: st.tuples(st.just(n), st.sampled_from(edge_values(props[n]))))
    ways = [
        st.tuples(sparse, one_past).map(lambda t: {**t[0], t[1][0]: t[1][1]}),
        st.tuples(valid, st.sampled_from(names), wrong).map(lambda t: {**t[0], t[1]: t[2]}),
        st.tuples(valid, text(1, 6), json_values()).map(lambda t: {**t[0], t[1]: t[2]}),
        valid.map(lambda b: {k: v for k, v in b.items() if k not in required}),
        json_values(),
    ]
    if "stream_options" in schema["properties"]:
        ways.append(st.tuples(valid, text(1, 6) | st.sampled_from(["include_usage"]), wrong)
                    .map(lambda t: {**t[0], "stream_options": {t[1]: t[2]}}))
    return st.one_of(ways)
