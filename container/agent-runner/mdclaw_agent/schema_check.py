"""A complete check of a value against the JSON Schema subset mdclaw's schemas use: the
tools' parameters, the IPC commands and the host<->container wire contract.

Keywords: `type` (string, integer, number, boolean, object, array, null, or a list of them),
`enum`, `const`, `properties`, `required`, `additionalProperties` (true, false or a schema),
`items`, `minItems`, `maxItems`, `minLength`, `maxLength`, `minimum`, `maximum`, `anyOf`, and
`$ref` to a schema of the document's `$defs` (`#/$defs/Name`, resolved in `root`). `title`,
`description`, `default` and `x-...` keys are notes. Any other keyword in a schema is a
programming error (`SchemaError`), so a schema can never promise more than is checked.
Booleans are not integers or numbers; integers are numbers; a float with no fraction is an
integer, as JSON Schema says.
"""
from __future__ import annotations

import math
from typing import Any

KNOWN = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties",
                   "items", "minItems", "maxItems", "minLength", "maxLength", "minimum",
                   "maximum", "anyOf", "$ref", "$defs", "description", "title", "default"})


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
    prefix = "#/$defs/"
    if not ref.startswith(prefix) or ref[len(prefix):] not in root.get("$defs", {}):
        raise SchemaError(f"cannot resolve $ref {ref!r}")
    target: dict[str, Any] = root["$defs"][ref[len(prefix):]]
    return target


def errors(schema: dict[str, Any], value: Any, path: str = "", *,
           root: dict[str, Any] | None = None) -> list[str]:
    """Every way `value` breaks `schema`, as readable lines naming where; [] when it fits.
    `root` is the document a `$ref` points into (`schema` itself unless given)."""
    unknown = {k for k in schema if not k.startswith("x-")} - KNOWN
    if unknown:
        raise SchemaError(f"schema keyword(s) not checked: {', '.join(sorted(unknown))}")
    root = schema if root is None else root
    out: list[str] = []
    if "$ref" in schema:
        out += errors(_resolve(schema["$ref"], root), value, path, root=root)
    if "anyOf" in schema:
        if not schema["anyOf"]:
            raise SchemaError("anyOf needs at least one schema")
        found: list[list[str]] = [errors(alt, value, path, root=root)
                                  for alt in schema["anyOf"]]
        if all(found):  # none fits: say what the closest one misses
            closest: list[str] = min(found, key=len)
            out += closest
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
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{_where(path)} must be at least {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{_where(path)} must be at most {schema['maximum']}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            out.append(f"{_where(path)} must have at least {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{_where(path)} must have at most {schema['maxItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                out += errors(schema["items"], item, f"{path}[{i}]", root=root)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                out.append(f"'{_join(path, key)}' is required")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                out += errors(props[key], item, _join(path, key), root=root)
            elif extra is False:
                out.append(f"unknown argument '{_join(path, key)}'"
                           + (f"; expected {', '.join(props)}" if props else ""))
            elif isinstance(extra, dict):
                out += errors(extra, item, _join(path, key), root=root)
    return out


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def is_valid(schema: dict[str, Any], value: Any, *, root: dict[str, Any] | None = None) -> bool:
    return not errors(schema, value, root=root)
