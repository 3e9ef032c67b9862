"""A tool's result as the agent gets it. Pure but for `save` (a callback that writes a file
into the group's folder through the one door).

The server's `CallToolResult` (`content` blocks, `structuredContent`, `isError`) becomes

    {"server", "tool", "isError", "content": [...], "truncated"}

with each block one of
- `{"type": "text", "text"}`;
- `{"type": "image" | "audio", "mimeType", "path"}`: the bytes saved in the group's folder
  (`/workspace/group/mcp/<day>/...`), since a tool result is text;
- `{"type": "resource", "uri", "mimeType"?, "text"}` or `{..., "path"}` for a blob;
- `{"type": "resource_link", "uri", "name"?, "description"?}`.
`structuredContent` is shown as JSON text when the server sent no text with it. Text is cut at
`max_chars` in all (`truncated`), and every string has the server's secrets taken out
(`redact`).
"""

from __future__ import annotations

import base64
import binascii
import json
import mimetypes
from collections.abc import Callable
from typing import Any

from mdclaw.redact import MIN_SECRET, all_forms

Save = Callable[[bytes, str, str], str]  # (data, mime type, file stem) -> container path
MAX_BLOCKS = 100


def _ext(mime: str) -> str:
    return mimetypes.guess_extension(mime.split(";")[0].strip()) or ".bin"


def convert(server: str, tool: str, result: dict[str, Any], *, max_chars: int,
            save: Save | None, redact: Callable[[str], str]) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = []
    left = max_chars
    truncated = False

    def text(value: str) -> str:
        nonlocal left, truncated
        value = redact(value)
        if len(value) > left:
            value, truncated = value[:max(left, 0)], True
        left -= len(value)
        return value

    def binary(data_b64: Any, mime: str, n: int) -> dict[str, Any]:
        if not isinstance(data_b64, str):
            return {"error": "no data"}
        try:
            data = base64.b64decode(data_b64, validate=True)
        except (binascii.Error, ValueError):
            return {"error": "its data is not base64"}
        if save is None:
            return {"bytes": len(data)}
        try:
            return {"path": save(data, mime, f"{server}-{tool}-{n}{_ext(mime)}"),
                    "bytes": len(data)}
        except OSError as e:
            return {"error": f"not saved: {e.strerror or e}"}

    content = result.get("content")
    items = content if isinstance(content, list) else []
    if len(items) > MAX_BLOCKS:
        items, truncated = items[:MAX_BLOCKS], True
    for n, block in enumerate(items, 1):
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            blocks.append({"type": "text", "text": text(block["text"])})
        elif kind in ("image", "audio"):
            mime = str(block.get("mimeType") or "application/octet-stream")[:100]
            blocks.append({"type": kind, "mimeType": mime,
                           **binary(block.get("data"), mime, n)})
        elif kind == "resource" and isinstance(block.get("resource"), dict):
            res = block["resource"]
            mime = str(res.get("mimeType") or "")[:100]
            out: dict[str, Any] = {"type": "resource", "uri": text(str(res.get("uri", "")))}
            if mime:
                out["mimeType"] = mime
            if isinstance(res.get("text"), str):
                out["text"] = text(res["text"])
            elif "blob" in res:
                out.update(binary(res.get("blob"), mime or "application/octet-stream", n))
            blocks.append(out)
        elif kind == "resource_link":
            out = {"type": "resource_link", "uri": text(str(block.get("uri", "")))}
            for key in ("name", "description", "mimeType"):
                if isinstance(block.get(key), str):
                    out[key] = text(block[key])
            blocks.append(out)
        else:
            blocks.append({"type": "text", "text": text(f"[a {str(kind)[:40]!r} block the "
                                                        "host does not show]")})
    structured = result.get("structuredContent")
    if structured is not None and not any(b["type"] == "text" for b in blocks):
        blocks.append({"type": "text", "text": text(json.dumps(structured,
                                                               ensure_ascii=False))})
    return {"server": server, "tool": tool, "isError": result.get("isError") is True,
            "content": blocks, "truncated": truncated}


def redactor(secrets: list[str]) -> Callable[[str], str]:
    """A function that replaces each secret value by `[secret]`, in every form
    mdclaw.redact looks for (as it is, JSON-escaped, percent-encoded, inside base64 text at
    each alignment); a value of 4 to 7 characters (below redact.MIN_SECRET) as it is and
    JSON-escaped only. Values shorter than 4 characters are left alone (they would match
    everywhere)."""
    forms = {f.decode("utf-8", "surrogateescape") for f in all_forms(secrets)}
    forms |= {f for s in secrets if 4 <= len(s) and len(s.encode()) < MIN_SECRET
              for f in (s, json.dumps(s)[1:-1])}
    ordered = sorted(forms, key=len, reverse=True)
    if not ordered:
        return lambda s: s

    def redact(value: str) -> str:
        for f in ordered:
            if f in value:
                value = value.replace(f, "[secret]")
        return value
    return redact
