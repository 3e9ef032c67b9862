"""The agent tools' argument check agrees with a reference JSON Schema validator.

Random schemas from the subset the tools use (types, enums, arrays, nested objects, required,
additionalProperties, bounds) and random JSON values: `schema_check` must say valid exactly
when the `jsonschema` library does. Then the tools themselves: every tool refuses wrong types
in each of its parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "container" / "agent-runner"))

from mdclaw_agent.schema_check import SchemaError, errors, is_valid  # noqa: E402
from mdclaw_agent.tools import TOOLS, ToolContext, ToolError  # noqa: E402

KEYS = st.sampled_from(["a", "b", "c", "path", "n"])
TYPES = ["string", "integer", "number", "boolean", "object", "array", "null"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from([0.0, 1.0, 2.5, -1.5])
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8)


def _leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(lambda t: {"type": t}, st.sampled_from(TYPES)),
        st.builds(lambda ts: {"type": ts}, st.lists(st.sampled_from(TYPES), min_size=1,
                                                    max_size=3, unique=True)),
        st.builds(lambda e: {"enum": e}, st.lists(st.none() | st.booleans()
                                                  | st.integers(-2, 2) | st.text(max_size=2),
                                                  min_size=1, max_size=3)),
        st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": hi},
                  st.integers(0, 2), st.integers(1, 4)),
        st.builds(lambda lo, hi: {"type": "number", "minimum": lo, "maximum": hi},
                  st.integers(-3, 0), st.integers(0, 3)),
        st.builds(lambda p: {"type": "string", "pattern": p},
                  st.sampled_from(["^a", "b$", "[0-9]", "^$"])),
        st.builds(lambda lo, hi: {"type": "number", "exclusiveMinimum": lo,
                                  "exclusiveMaximum": hi},
                  st.integers(-3, 0), st.integers(0, 3)),
        st.builds(lambda m: {"multipleOf": m}, st.sampled_from([1, 2, 0.5, 1.5])),
        st.builds(lambda lo, hi: {"type": "object", "minProperties": lo, "maxProperties": hi},
                  st.integers(0, 2), st.integers(1, 3)),
        st.builds(lambda f: {"type": "string", "format": f, "examples": ["x"]},
                  st.sampled_from(["date-time", "uri"])),
        st.just({}),
    )


schemas = st.recursive(
    _leaf(),
    lambda inner: st.one_of(
        st.builds(lambda it, lo: {"type": "array", "items": it, "minItems": lo}, inner,
                  st.integers(0, 2)),
        st.builds(lambda props, req, extra: {
            "type": "object", "properties": props,
            "required": [k for k in req if k in props], "additionalProperties": extra},
            st.dictionaries(KEYS, inner, max_size=3), st.lists(KEYS, max_size=2),
            st.booleans() | inner),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda alts: {"allOf": alts}, st.lists(inner, min_size=1, max_size=2)),
        st.builds(lambda alts: {"oneOf": alts}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda s: {"not": s}, inner),
        st.builds(lambda it: {"type": "array", "items": it, "uniqueItems": True}, inner),
    ),
    max_leaves=6)


@settings(max_examples=1500, deadline=None)
@given(schemas, json_values)
def test_the_check_agrees_with_a_reference_validator(schema: dict, value: object) -> None:
    reference = jsonschema.Draft202012Validator(schema).is_valid(value)
    assert is_valid(schema, value) == reference, (schema, value, errors(schema, value))


@settings(max_examples=500, deadline=None)
@given(schemas, schemas, json_values)
def test_refs_into_defs_agree_with_a_reference_validator(target: dict, other: dict,
                                                         value: object) -> None:
    """`$ref: #/$defs/...` at the root and below it (what a pydantic schema uses)."""
    defs = {"T": target, "O": other}
    at_root = {"$defs": defs, "$ref": "#/$defs/T"}
    below = {"$defs": defs, "type": "object",
             "properties": {"a": {"$ref": "#/$defs/T"},
                            "b": {"anyOf": [{"$ref": "#/$defs/O"}, {"type": "null"}]}},
             "additionalProperties": {"$ref": "#/$defs/O"}}
    for schema, v in ((at_root, value), (below, {"a": value, "b": value, "c": value}),
                      (below, {"b": None})):
        reference = jsonschema.Draft202012Validator(schema).is_valid(v)
        assert is_valid(schema, v) == reference, (schema, v, errors(schema, v))


def test_a_ref_resolves_in_the_root_it_is_given() -> None:
    root = {"$defs": {"N": {"type": "object", "required": ["cause"],
                            "properties": {"cause": {"enum": ["a", "b"]}}}}}
    field = {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]}
    assert errors(field, None, "notice", root=root) == []
    assert errors(field, {"cause": "c"}, "notice", root=root) == [
        "notice.cause must be one of a, b"]
    assert errors(field, 3, "notice", root=root) == ["notice must be object"]
    with pytest.raises(SchemaError, match="cannot resolve"):
        errors(field, {}, root={})
    with pytest.raises(SchemaError, match="cannot resolve"):
        errors({"$ref": "https://example.com/s.json"}, 1)


def test_messages_say_where_and_what() -> None:
    schema = {"type": "object", "required": ["tags"], "additionalProperties": False,
              "properties": {"tags": {"type": "array", "items": {"type": "string"}},
                             "opts": {"type": "object", "properties": {
                                 "n": {"type": "integer", "minimum": 1}}}}}
    assert errors(schema, {"tags": ["a", 3], "opts": {"n": 0}, "x": 1}) == [
        "tags[1] must be string", "opts.n must be at least 1",
        "unknown argument 'x'; expected tags, opts"]
    assert errors(schema, {}) == ["'tags' is required"]
    assert errors({"type": "integer"}, True) == ["the arguments must be integer"]
    assert errors({"type": "string", "pattern": "^a"}, "b") == ["the arguments must match '^a'"]
    with pytest.raises(SchemaError, match="patternProperties"):
        errors({"type": "object", "patternProperties": {"^a": {"type": "string"}}}, {"a": 1})
    # Not mdclaw's own schema (an MCP server's): what is known is checked, the rest left.
    lenient = {"type": "object", "patternProperties": {"^a": {}},
               "properties": {"n": {"type": "integer"}}}
    assert errors(lenient, {"n": "x"}, strict=False) == ["n must be integer"]
    assert errors({"definitions": {"N": {"type": "integer"}}, "$ref": "#/definitions/N"},
                  "x") == ["the arguments must be integer"]


CTX = ToolContext(ipc_dir=Path("/nonexistent"), group_folder="family", chat_jid="tg:2",
                  is_main=True)
WRONG = {"string": 12, "integer": "12", "boolean": "yes", "number": "1", "object": [],
         "array": {}}
_IS = {"string": lambda v: isinstance(v, str),
       "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
       "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
       "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
       "array": lambda v: isinstance(v, list)}


def _wrong_for(types: str | list[str]) -> object:
    """A value of none of `types` (a JSON Schema type or a list of them)."""
    if isinstance(types, str):
        return WRONG[types]
    return next(v for v in ([], {}, "x", 12, 1.5, True)
                if not any(_IS[t](v) for t in types))


@pytest.mark.parametrize("tool", TOOLS, ids=[t.name for t in TOOLS])
def test_every_tool_refuses_a_wrong_type_in_every_parameter(tool) -> None:  # noqa: ANN001
    errors({"type": "object"}, {})  # every tool schema uses only checked keywords:
    errors(tool.parameters, {})
    for key, prop in tool.parameters["properties"].items():
        args = {k: "x" for k in tool.parameters.get("required", [])}
        args[key] = _wrong_for(prop["type"])
        with pytest.raises(ToolError, match=key):
            tool.call(CTX, args)
    with pytest.raises(ToolError, match="unknown argument 'bogus'"):
        tool.call(CTX, {**{k: "x" for k in tool.parameters.get("required", [])}, "bogus": 1})
