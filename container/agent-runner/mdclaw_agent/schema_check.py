"""A complete check of a value against the JSON Schema subset mdclaw's schemas use: the
tools' parameters, the IPC commands and the host<->container wire contract.

Keywords: `type` (string, integer, number, boolean, object, array, null, or a list of them),
`enum`, `const`, `properties`, `required`, `additionalProperties` (true, false or a schema),
`items`, `minItems`, `maxItems`, `uniqueItems`, `minLength`, `maxLength`, `pattern`,
`minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum`, `multipleOf`,
`minProperties`, `maxProperties`, `anyOf`, `allOf`, `oneOf`, `not`, and `$ref` to a schema of
the document's `$defs` or `definitions` (`#/$defs/Name`, resolved in `root`). `title`,
`description`, `default`, `format`, `examples`, `$schema`, `$id`, `$comment`, `readOnly`,
`writeOnly`, `deprecated` and `x-...` keys are notes. Any other keyword in a schema is a
programming error (`SchemaError`), so a schema can never promise more than is checked;
`strict=False` checks what it knows and leaves other keywords alone, for schemas that are not
mdclaw's own (an MCP server's tools: the host checks those arguments completely again).
Booleans are not integers or numbers; integers are numbers; a float with no fraction is an
integer, as JSON Schema says.
"""
from __future__ import annotations

import math
import re
from typing import Any

NOTES = frozenset({"description", "title", "default", "format", "examples", "$schema", "$id",
                   "$comment", "readOnly", "writeOnly", "deprecated", "$defs", "definitions"})
KNOWN = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties",
                   "items", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength",
                   "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                   "multipleOf", "minProperties", "maxProperties", "anyOf", "allOf", "oneOf",
                   "not", "$ref"}) | NOTES


class SchemaError(Exception):
    """The schema itself uses something this checker does not know."""


def _is(kind: str, v: Any) -> bool:
    if kind == "string":
        return isinstance(v, str)
    if kind == "boolean":
        return isinstance(v, bool)
    if kind == "null":
        return v is None
    if kind == "object":
        return isinstance(v, dict)
    if kind == "array":
        return isinstance(v, list)
    if isinstance(v, bool):
        return False
    if kind == "integer":
        return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v)
                                      and v.is_integer())
    if kind == "number":
        return isinstance(v, (int, float)) and not (isinstance(v, float)
                                                    and not math.isfinite(v))
    raise SchemaError(f"unknown type {kind!r}")


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but True != 1, and containers compared deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _where(path: str) -> str:
    return path or "the arguments"


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    for key in ("$defs", "definitions"):
        prefix = f"#/{key}/"
        if ref.startswith(prefix) and ref[len(prefix):] in root.get(key, {}):
            target: dict[str, Any] = root[key][ref[len(prefix):]]
            return target
    raise SchemaError(f"cannot resolve $ref {ref!r}")


def _multiple(value: float, of: float) -> bool:
    """Whether `value` is a multiple of `of`, as JSON Schema validators decide it."""
    if isinstance(value, int) and isinstance(of, int):
        return value % of == 0
    try:
        q = value / of
    except OverflowError:
        return False
    return math.isfinite(q) and q == int(q)


def errors(schema: dict[str, Any], value: Any, path: str = "", *,
           root: dict[str, Any] | None = None, strict: bool = True) -> list[str]:
    """Every way `value` breaks `schema`, as readable lines naming where; [] when it fits.
    `root` is the document a `$ref` points into (`schema` itself unless given). `strict`:
    a keyword this check does not know is a SchemaError (else it is left alone)."""
    if not isinstance(schema, dict):
        if isinstance(schema, bool):  # JSON Schema's true / false schemas
            return [] if schema else [f"{_where(path)} is not allowed"]
        raise SchemaError(f"a schema must be an object, not {type(schema).__name__}")
    if strict:
        unknown = {k for k in schema if not k.startswith("x-")} - KNOWN
        if unknown:
            raise SchemaError(f"schema keyword(s) not checked: {', '.join(sorted(unknown))}")
    root = schema if root is None else root

    def sub(s: Any, v: Any, p: str) -> list[str]:
        return errors(s, v, p, root=root, strict=strict)

    out: list[str] = []
    if "$ref" in schema:
        out += sub(_resolve(schema["$ref"], root), value, path)
    if "anyOf" in schema:
        if not schema["anyOf"]:
            raise SchemaError("anyOf needs at least one schema")
        found: list[list[str]] = [sub(alt, value, path) for alt in schema["anyOf"]]
        if all(found):  # none fits: say what the closest one misses
            closest: list[str] = min(found, key=len)
            out += closest
    if "allOf" in schema:
        for alt in schema["allOf"]:
            out += sub(alt, value, path)
    if "oneOf" in schema:
        if not schema["oneOf"]:
            raise SchemaError("oneOf needs at least one schema")
        found = [sub(alt, value, path) for alt in schema["oneOf"]]
        fits = sum(1 for f in found if not f)
        if fits == 0:
            nearest: list[str] = min(found, key=len)
            out += nearest
        elif fits > 1:
            out.append(f"{_where(path)} fits more than one of its alternatives (oneOf)")
    if "not" in schema and not sub(schema["not"], value, path):
        said = schema["not"].get("description") if isinstance(schema["not"], dict) else None
        out.append(f"{_where(path)}: {said}" if isinstance(said, str) and said
                   else f"{_where(path)} must not fit the schema under `not`")
    kinds = schema.get("type")
    if kinds is not None:
        wanted = [kinds] if isinstance(kinds, str) else list(kinds)
        if not any(_is(k, value) for k in wanted):
            return [*out, f"{_where(path)} must be {' or '.join(wanted)}"]
    if "enum" in schema and not any(_equal(value, e) for e in schema["enum"]):
        out.append(f"{_where(path)} must be one of "
                   f"{', '.join(str(e) for e in schema['enum'])}")
    if "const" in schema and not _equal(value, schema["const"]):
        out.append(f"{_where(path)} must be {schema['const']!r}")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            out.append(f"{_where(path)} must be at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{_where(path)} must be at most {schema['maxLength']} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{_where(path)} must match {schema['pattern']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{_where(path)} must be at least {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{_where(path)} must be at most {schema['maximum']}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            out.append(f"{_where(path)} must be more than {schema['exclusiveMinimum']}")
        if "exclusiveMaximum" in schema and value >= schema["exclusiveMaximum"]:
            out.append(f"{_where(path)} must be less than {schema['exclusiveMaximum']}")
        if "multipleOf" in schema and not _multiple(value, schema["multipleOf"]):
            out.append(f"{_where(path)} must be a multiple of {schema['multipleOf']}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            out.append(f"{_where(path)} must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{_where(path)} must have at most {schema['maxItems']} items")
        if schema.get("uniqueItems") is True and any(
                _equal(a, b) for i, a in enumerate(value) for b in value[i + 1:]):
            out.append(f"{_where(path)} must not hold the same item twice")
        if "items" in schema:
            for i, item in enumerate(value):
                out += sub(schema["items"], item, f"{path}[{i}]")
    if isinstance(value, dict):
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            out.append(f"{_where(path)} must have at least {schema['minProperties']} keys")
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            out.append(f"{_where(path)} must have at most {schema['maxProperties']} keys")
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                out.append(f"'{_join(path, key)}' is required")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                out += sub(props[key], item, _join(path, key))
            elif extra is False:
                out.append(f"unknown argument '{_join(path, key)}'"
                           + (f"; expected {', '.join(props)}" if props else ""))
            elif isinstance(extra, dict):
                out += sub(extra, item, _join(path, key))
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def is_valid(schema: dict[str, Any], value: Any, *, root: dict[str, Any] | None = None) -> bool:
    return not errors(schema, value, root=root)
