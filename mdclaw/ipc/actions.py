"""Action requests (`actions/*.json` with a requestId) and their handlers.

Adding an action is one function:

    @action("weather_get")
    def weather_get(ctx: ActionContext, params: dict) -> dict:
        ...
        return {"temperature": 21}

Return the `result` object; raise ActionFailed("reason") for an error result. The handler
runs inside the command's transaction (`ctx.conn`), so database changes commit with the
ledger row; anything it does outside the database must be safe to repeat, because a crash
before the commit runs it again.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from mdclaw import agentfs
from mdclaw.agentfs import UnsafePath
from mdclaw.config import validate_folder
from mdclaw.ipc.auth import Caller, check_group_target
from mdclaw.paths import Layout
from mdclaw.state import transcripts


class ActionFailed(Exception):
    """The handler could not do what was asked; str(e) goes into the error result."""


@dataclass(frozen=True)
class ActionContext:
    caller: Caller
    layout: Layout
    conn: sqlite3.Connection


Handler = Callable[[ActionContext, dict[str, Any]], dict[str, Any]]
HANDLERS: dict[str, Handler] = {}


def action(name: str) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of action `name`."""
    def deco(fn: Handler) -> Handler:
        HANDLERS[name] = fn
        return fn
    return deco


def run_action(ctx: ActionContext, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run handler `name`; returns its result. Raises ActionFailed (unknown action, handler
    failure) or Unauthorized (the caller may not do it: the request is quarantined)."""
    handler = HANDLERS.get(name)
    if handler is None:
        raise ActionFailed(f"unknown action {name!r}; known: {', '.join(sorted(HANDLERS))}")
    return handler(ctx, params)


# --------------------------------------------------------------------------- memory

MEMORY_FILE_MAX = 1024 * 1024
MEMORY_MAX_FILES = 200
_MEMORY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.md$")


def _target_folder(ctx: ActionContext, params: dict[str, Any], what: str) -> str:
    folder = params.get("groupFolder", ctx.caller.folder)
    if not isinstance(folder, str):
        raise ActionFailed("groupFolder must be a string")
    try:
        validate_folder(folder)
    except ValueError as e:
        raise ActionFailed(str(e)) from None
    check_group_target(ctx.caller, folder, what)
    return folder


def _memory_files(layout: Layout, folder: str) -> list[tuple[str, str]]:
    """(relative path, text) of MEMORY.md and memory/*.md of `folder`, never via symlinks."""
    try:
        gfd = agentfs.open_root(layout.groups_dir)
    except (FileNotFoundError, UnsafePath):
        return []
    out = []
    try:
        with agentfs.opened(gfd, folder) as fd:
            text = agentfs.read_text(fd, "MEMORY.md", MEMORY_FILE_MAX)
            if text is not None:
                out.append(("MEMORY.md", text))
            with agentfs.opened(fd, "memory") as mfd:
                for name in sorted(n for n in agentfs.listdir(mfd) if _MEMORY_NAME.match(n))[
                        :MEMORY_MAX_FILES]:
                    text = agentfs.read_text(mfd, name, MEMORY_FILE_MAX)
                    if text is not None:
                        out.append((f"memory/{name}", text))
    except (FileNotFoundError, UnsafePath):
        pass
    finally:
        os.close(gfd)
    return out


@action("memory_search")
def memory_search(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """Lines of the group's memory files that contain the query's words, best first
    (`sources: memory`); ranked matches in its past conversations (`sessions`, see
    mdclaw.state.transcripts); or both, interleaved (`all`)."""
    query = params.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ActionFailed("memory_search needs a non-empty string 'query'")
    top_k = params.get("topK", params.get("top_k", 5))
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 50:
        raise ActionFailed("topK must be a whole number from 1 to 50")
    sources = params.get("sources", "memory")
    if sources not in ("memory", "sessions", "all"):
        raise ActionFailed("sources must be 'memory', 'sessions' or 'all'")
    folder = _target_folder(ctx, params, "memory_search")
    terms = [t for t in re.findall(r"\w+", query.lower()) if t]
    hits: list[dict[str, Any]] = []
    if sources in ("memory", "all"):
        for path, text in _memory_files(ctx.layout, folder):
            for lineno, line in enumerate(text.splitlines(), 1):
                low = line.lower()
                score = sum(low.count(t) for t in terms)
                if score:
                    hits.append({"source": "memory", "path": path, "line": lineno,
                                 "snippet": line.strip()[:300], "score": score})
    hits.sort(key=lambda h: (-h["score"], h["path"], h["line"]))
    if sources == "memory":
        return {"hits": hits[:top_k]}
    said = [{"source": "sessions", **h.as_dict()}
            for h in transcripts.search(ctx.conn, folder, query, top_k)]
    if sources == "sessions":
        return {"hits": said}
    # The two rankings' scores do not compare: take the best of each in turn.
    merged = [h for pair in zip_longest(hits[:top_k], said) for h in pair if h is not None]
    return {"hits": merged[:top_k]}


@action("memory_get")
def memory_get(ctx: ActionContext, params: dict[str, Any]) -> dict[str, Any]:
    """The text of MEMORY.md or memory/<name>.md of the group (nothing else)."""
    path = params.get("path")
    if not isinstance(path, str):
        raise ActionFailed("memory_get needs a string 'path'")
    if path != "MEMORY.md":
        prefix, _, name = path.partition("/")
        if prefix != "memory" or not _MEMORY_NAME.match(name):
            raise ActionFailed(f"path {path!r} is not allowed: use MEMORY.md or memory/<name>.md")
    folder = _target_folder(ctx, params, "memory_get")
    for p, text in _memory_files(ctx.layout, folder):
        if p == path:
            return {"path": path, "content": text}
    raise ActionFailed(f"{path} does not exist")

