"""The canonical IPC commands as the host defines them, read from commands_schema.json.

The host's pydantic models (mdclaw/ipc/protocol.py) are the one definition of what a command
body may hold. This package cannot import mdclaw (the image has no host code), so the host
writes their JSON Schema into commands_schema.json beside this module
(`python -m mdclaw command-schema > container/agent-runner/mdclaw_agent/commands_schema.json`;
a host test fails while the committed file is stale). The tools take command types, field
names, enums, defaults and limits from here instead of writing them a second time, and check
every body against it before it is written.

The host checks a few things this side does not: regular-expression `pattern`s (task ids,
request ids, action names), a valid folder name, a plain file_name, and the cross-field rules
(exactly one of jid/folder, an update that changes something), which the tools say themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mdclaw_agent.schema_check import KNOWN, SchemaError, errors

SCHEMA_FILE = Path(__file__).with_name("commands_schema.json")
SCHEMA: dict[str, Any] = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))

# Keywords of the host's schema that are left to the host: the tools' check skips them.
HOST_CHECKED = frozenset({"pattern"})
# Annotations dropped from an argument schema (pydantic's titles; defaults are applied by the
# host, and a tool's description says them in words). `x-` keywords are mdclaw's own notes
# (x-max-file-bytes), read by name.
_ANNOTATIONS = frozenset({"title", "default", "description"})

_MAPPING: dict[str, str] = SCHEMA["discriminator"]["mapping"]
COMMAND_TYPES: tuple[str, ...] = tuple(_MAPPING)


def command(ctype: str) -> dict[str, Any]:
    """The host's JSON Schema of command `ctype` (an object schema)."""
    try:
        ref = _MAPPING[ctype]
    except KeyError:
        raise SchemaError(f"the host has no command type {ctype!r}") from None
    return SCHEMA["$defs"][ref.rsplit("/", 1)[-1]]


def fields(ctype: str) -> tuple[str, ...]:
    """The fields of command `ctype` besides `type`, in the host's order."""
    return tuple(k for k in command(ctype)["properties"] if k != "type")


def required(ctype: str) -> tuple[str, ...]:
    return tuple(command(ctype).get("required", ()))


def _prop(ctype: str, name: str) -> dict[str, Any]:
    props = command(ctype)["properties"]
    if name == "type" or name not in props:
        raise SchemaError(f"the host's {ctype} command has no field {name!r}")
    return props[name]


def default(ctype: str, name: str) -> Any:
    """The value the host takes when field `name` is left out (None if it has none)."""
    return _prop(ctype, name).get("default")


def _checkable(node: dict[str, Any]) -> dict[str, Any]:
    """`node` in the keywords schema_check knows: an optional field (`anyOf` of a schema and
    null) becomes that schema, since a tool leaves a field out rather than sending null."""
    alts = node.get("anyOf")
    if alts is not None:
        rest = [a for a in alts if a != {"type": "null"}]
        if len(rest) != 1 or set(node) - {"anyOf"} - _ANNOTATIONS:
            raise SchemaError(f"cannot check {node!r}")
        node = rest[0]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in HOST_CHECKED or key in _ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in KNOWN:
            # A new kind of limit on the host: make the runner check it (schema_check) or
            # name it in HOST_CHECKED, rather than promise less than the host enforces.
            raise SchemaError(f"the host's schema uses {key!r}, which the runner does not "
                              "check")
        if key == "items" or (key == "additionalProperties" and isinstance(value, dict)):
            value = _checkable(value)
        elif key == "properties":
            value = {k: _checkable(v) for k, v in value.items()}
        out[key] = value
    return out


def field(ctype: str, name: str) -> dict[str, Any]:
    """The checkable schema of field `name` of command `ctype` (type, enum, length bounds)."""
    return _checkable(_prop(ctype, name))


def enum(ctype: str, name: str) -> tuple[Any, ...]:
    return tuple(field(ctype, name)["enum"])


def param(ctype: str, name: str, description: str) -> dict[str, Any]:
    """A tool argument that becomes field `name` of command `ctype`, as the host limits it."""
    return {**field(ctype, name), "description": description}


def body_schema(ctype: str) -> dict[str, Any]:
    """The whole body of command `ctype` as schema_check checks it."""
    schema = _checkable(command(ctype))
    schema["properties"]["type"] = {"type": "string", "const": ctype}
    schema["required"] = ["type", *schema.get("required", ())]
    return schema


def problems(body: dict[str, Any]) -> list[str]:
    """Why the host would refuse `body` by its schema ([] when it fits, patterns aside)."""
    ctype = body.get("type")
    if not isinstance(ctype, str) or ctype not in _MAPPING:
        return [f"unknown command type {ctype!r}"]
    return errors(body_schema(ctype), body)


# The largest file send_file may name.
MAX_FILE_BYTES: int = command("send_file")["x-max-file-bytes"]
