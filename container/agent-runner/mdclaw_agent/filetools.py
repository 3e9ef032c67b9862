"""Workspace file tools: read_file, write_file, edit_file, list_dir, glob, grep.

Every path goes through mdclaw_agent.workspace (roots, symlinks, read-only mounts). Every
output is capped, and a capped output says so and where ("truncated at N bytes; use
offset/limit").
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mdclaw_agent.toolbase import Tool, ToolContext, ToolError, schema, string
from mdclaw_agent.workspace import (
    PathRefused,
    Root,
    Target,
    atomic_write,
    glob_regex,
    make_roots,
    resolve,
    walk_files,
)

OUTPUT_CAP = 50_000           # bytes of text one tool result carries
READ_DEFAULT_LINES = 2000     # read_file without a limit
LINE_CAP = 2000               # characters of one line shown by read_file
WRITE_CAP = 5 * 1024 * 1024   # bytes write_file / edit_file may produce
EDIT_FILE_CAP = 5 * 1024 * 1024
LIST_CAP = 1000               # entries list_dir / glob show
WALK_CAP = 100_000            # files glob / grep look at
GREP_MATCH_CAP = 200          # matching lines grep shows
GREP_LINE_CAP = 500           # characters of one matching line grep shows
GREP_FILE_CAP = 10 * 1024 * 1024  # files larger than this are skipped by grep
BINARY_PROBE = 8192


def roots(ctx: ToolContext) -> list[Root]:
    return make_roots(ctx.group_dir, ctx.extra_dir, ctx.global_dir, is_main=ctx.is_main)


def _resolve(ctx: ToolContext, tool: str, path: str, *, write: bool = False) -> Target:
    try:
        return resolve(path, roots(ctx), write=write)
    except PathRefused as e:
        raise ToolError(f"{tool}: {e}") from None


def _os_error(tool: str, target: Target, e: OSError) -> ToolError:
    return ToolError(f"{tool}: {target.shown}: {e.strerror or e}")


class _Capped:
    """Text collected up to `cap` bytes (UTF-8), whole lines only."""

    def __init__(self, cap: int = OUTPUT_CAP) -> None:
        self.cap = cap
        self.parts: list[str] = []
        self.size = 0
        self.full = False

    def add(self, line: str) -> bool:
        """Add one line (with its newline); False once the cap is reached."""
        n = len(line.encode("utf-8"))
        if self.size + n > self.cap:
            self.full = True
            return False
        self.parts.append(line)
        self.size += n
        return True

    def text(self) -> str:
        return "".join(self.parts)


def _is_binary(head: bytes) -> bool:
    return b"\0" in head


# --------------------------------------------------------------------------- read_file


def _read_file(ctx: ToolContext, a: dict[str, Any]) -> str:
    t = _resolve(ctx, "read_file", a["path"])
    offset = a.get("offset", 1)
    limit = a.get("limit", READ_DEFAULT_LINES)
    if t.real.is_dir():
        raise ToolError(f"read_file: {t.shown} is a folder; use list_dir")
    try:
        with open(t.real, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise ToolError(f"read_file: {t.shown} is a folder; use list_dir")
            if not stat.S_ISREG(st.st_mode):
                raise ToolError(f"read_file: {t.shown} is not a regular file")
            if _is_binary(f.read(BINARY_PROBE)):
                return f"{t.shown} is a binary file of {st.st_size} bytes; not shown."
            f.seek(0)
            out = _Capped()
            n = 0
            last = offset - 1
            long_lines = 0
            for raw in f:
                n += 1
                if n < offset or n >= offset + limit or out.full:
                    continue
                line = raw.decode("utf-8", errors="replace")
                if len(line) > LINE_CAP:
                    line = line[:LINE_CAP] + f" [line cut at {LINE_CAP} characters]\n"
                    long_lines += 1
                if out.add(line):
                    last = n
    except OSError as e:
        raise _os_error("read_file", t, e) from None
    if n == 0:
        return f"{t.shown} is empty."
    if offset > n:
        return f"{t.shown} has {n} lines; offset {offset} is past the end."
    head = f"{t.shown}: lines {offset}-{last} of {n}"
    notes = []
    if out.full:
        notes.append(f"truncated at {OUTPUT_CAP} bytes; use offset/limit "
                     f"(next: offset {last + 1})")
    elif last < n:
        notes.append(f"more lines follow; next: offset {last + 1}")
    if long_lines:
        notes.append(f"{long_lines} line(s) longer than {LINE_CAP} characters were cut")
    body = out.text()
    if notes:
        body += ("" if body.endswith("\n") else "\n") + f"[{'; '.join(notes)}]"
    return f"{head}\n{body}"


# --------------------------------------------------------------------------- write/edit


def _save(tool: str, t: Target, data: bytes, what: str) -> None:
    """Write `data` to `t` atomically, at most WRITE_CAP bytes (`what` names the data in the
    refusal: "the content is", "the result would be")."""
    if len(data) > WRITE_CAP:
        raise ToolError(f"{tool}: {what} {len(data)} bytes; the limit is {WRITE_CAP} bytes")
    try:
        atomic_write(t, data)
    except PathRefused as e:
        raise ToolError(f"{tool}: {e}") from None
    except OSError as e:
        raise _os_error(tool, t, e) from None


def _write_file(ctx: ToolContext, a: dict[str, Any]) -> str:
    t = _resolve(ctx, "write_file", a["path"], write=True)
    data = a.get("content", "").encode("utf-8")
    _save("write_file", t, data, "the content is")
    return f"Wrote {len(data)} bytes to {t.shown}."


def _edit_file(ctx: ToolContext, a: dict[str, Any]) -> str:
    t = _resolve(ctx, "edit_file", a["path"], write=True)
    old, new = a["old_string"], a.get("new_string", "")
    if old == new:
        raise ToolError("edit_file: old_string and new_string are the same")
    try:
        with open(t.real, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ToolError(f"edit_file: {t.shown} is not a regular file")
            data = f.read(EDIT_FILE_CAP + 1)
    except FileNotFoundError:
        raise ToolError(f"edit_file: {t.shown} does not exist; use write_file to make "
                        "it") from None
    except OSError as e:
        raise _os_error("edit_file", t, e) from None
    if len(data) > EDIT_FILE_CAP:
        raise ToolError(f"edit_file: {t.shown} is larger than {EDIT_FILE_CAP} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"edit_file: {t.shown} is not UTF-8 text") from None
    count = text.count(old)
    if count == 0:
        raise ToolError(f"edit_file: old_string was not found in {t.shown} (it must match "
                        "exactly, whitespace included); read_file shows the text")
    if count > 1 and not a.get("replace_all"):
        raise ToolError(f"edit_file: old_string occurs {count} times in {t.shown}; give "
                        "more surrounding text so it is unique, or set replace_all")
    out = text.replace(old, new) if a.get("replace_all") else text.replace(old, new, 1)
    _save("edit_file", t, out.encode("utf-8"), "the result would be")
    n = count if a.get("replace_all") else 1
    return f"Replaced {n} occurrence(s) in {t.shown}."


# --------------------------------------------------------------------------- listing


def _list_dir(ctx: ToolContext, a: dict[str, Any]) -> str:
    t = _resolve(ctx, "list_dir", a.get("path", "."))
    try:
        entries = sorted(os.scandir(t.real), key=lambda e: e.name)
    except NotADirectoryError:
        raise ToolError(f"list_dir: {t.shown} is not a folder") from None
    except OSError as e:
        raise _os_error("list_dir", t, e) from None
    if not entries:
        return f"{t.shown} is empty."
    out = _Capped()
    shown = 0
    for ent in entries:
        try:
            st = ent.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            try:
                dest = os.readlink(ent.path)
            except OSError:
                dest = "?"
            line = f"{ent.name} -> {dest} (symlink)\n"
        elif stat.S_ISDIR(st.st_mode):
            line = f"{ent.name}/\n"
        else:
            line = f"{ent.name} ({st.st_size} bytes)\n"
        if shown >= LIST_CAP or not out.add(line):
            break
        shown += 1
    head = f"{t.shown}: {len(entries)} entries"
    tail = ""
    if shown < len(entries):
        tail = (f"\n[truncated at {shown} entries ({LIST_CAP} entries or {OUTPUT_CAP} bytes "
                "at most); use glob to narrow]")
    return f"{head}\n{out.text()}{tail}"


def _glob(ctx: ToolContext, a: dict[str, Any]) -> str:
    t = _resolve(ctx, "glob", a.get("path", "."))
    if not t.real.is_dir():
        raise ToolError(f"glob: {t.shown} is not a folder")
    try:
        rx = glob_regex(a["pattern"])
    except re.error as e:
        raise ToolError(f"glob: the pattern is not valid: {e}") from None
    out = _Capped()
    n = 0
    for _p, rel in walk_files(t.real, limit=WALK_CAP):
        if rx.match(rel):
            n += 1
            if n <= LIST_CAP:
                out.add(rel + "\n")
    if n == 0:
        return f"No files under {t.shown} match {a['pattern']!r}."
    shown = len(out.parts)
    tail = ""
    if shown < n:
        tail = (f"\n[truncated at {shown} of {n} paths ({LIST_CAP} paths or {OUTPUT_CAP} "
                "bytes at most); use a narrower pattern]")
    return f"{n} file(s) under {t.shown} match {a['pattern']!r}:\n{out.text()}{tail}"


def _grep(ctx: ToolContext, a: dict[str, Any]) -> str:
    t = _resolve(ctx, "grep", a.get("path", "."))
    flags = re.IGNORECASE if a.get("ignore_case") else 0
    try:
        rx = re.compile(a["pattern"], flags)
    except re.error as e:
        raise ToolError(f"grep: the pattern is not a valid regular expression: {e}") from None
    only = None
    if a.get("glob"):
        try:
            only = glob_regex(a["glob"])
        except re.error as e:
            raise ToolError(f"grep: the glob is not valid: {e}") from None
    if t.real.is_dir():
        files: Iterator[tuple[Path, str]] = (
            (p, rel) for p, rel in walk_files(t.real, limit=WALK_CAP)
            if only is None or only.match(rel) or only.match(p.name))
        base = t.real
    else:
        files = iter([(t.real, t.real.name)])
        base = t.real.parent
    out = _Capped()
    matches = 0
    skipped = 0
    roots_ = roots(ctx)
    for p, _rel in files:
        if matches >= GREP_MATCH_CAP or out.full:
            matches += 1  # there is at least one more; counted only to say "truncated"
            break
        try:
            resolve(str(p), roots_)  # a symlink inside the folder must not lead out
        except PathRefused:
            skipped += 1
            continue
        try:
            with open(p, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > GREP_FILE_CAP:
                    skipped += 1
                    continue
                if _is_binary(f.read(BINARY_PROBE)):
                    continue
                f.seek(0)
                shown_name = os.path.relpath(p, base)
                for i, raw in enumerate(f, 1):
                    line = raw.decode("utf-8", errors="replace").rstrip("\n")
                    if rx.search(line):
                        matches += 1
                        if matches > GREP_MATCH_CAP:
                            break
                        if len(line) > GREP_LINE_CAP:
                            line = line[:GREP_LINE_CAP] + " [...]"
                        if not out.add(f"{shown_name}:{i}: {line}\n"):
                            break
        except OSError:
            skipped += 1
    if not out.parts:
        return f"No matches for {a['pattern']!r} under {t.shown}."
    notes = []
    if matches > len(out.parts):
        notes.append(f"truncated at {len(out.parts)} matching lines ({GREP_MATCH_CAP} lines "
                     f"or {OUTPUT_CAP} bytes at most); narrow the pattern, path or glob")
    if skipped:
        notes.append(f"{skipped} file(s) skipped (unreadable, over {GREP_FILE_CAP} bytes, or "
                     "a symlink out of the workspace)")
    tail = f"\n[{'; '.join(notes)}]" if notes else ""
    return f"Matches under {t.shown} (file:line: text):\n{out.text()}{tail}"


# --------------------------------------------------------------------------- registry

_PATH = ("Path relative to the group folder /workspace/group, or absolute under "
         "/workspace/group, /workspace/extra/<name> or /workspace/global.")
_INT = "integer"


def _int(description: str, minimum: int, maximum: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": _INT, "description": description, "minimum": minimum}
    if maximum is not None:
        out["maximum"] = maximum
    return out


FILE_TOOLS: tuple[Tool, ...] = (
    Tool("read_file", "Read a text file (lines offset..offset+limit-1, numbered from 1; "
         f"default the first {READ_DEFAULT_LINES} lines; at most {OUTPUT_CAP} bytes per call).",
         schema(["path"], path=string(_PATH),
                offset=_int("First line to show, from 1 (default 1).", 1),
                limit=_int(f"How many lines (default {READ_DEFAULT_LINES}).", 1)),
         _read_file, tags=("workspace",)),
    Tool("write_file", "Create or replace a file with the given text (written atomically; "
         f"missing folders are made; at most {WRITE_CAP} bytes).",
         schema(["path"], path=string(_PATH),
                content=string("The whole new content of the file (default: empty).")),
         _write_file, tags=("workspace",)),
    Tool("edit_file", "Replace an exact piece of text in a file. old_string must occur "
         "exactly once (give enough surrounding text), unless replace_all is true.",
         schema(["path", "old_string"], path=string(_PATH),
                old_string=string("The exact text to replace, whitespace included."),
                new_string=string("The text to put there (default: nothing)."),
                replace_all={"type": "boolean",
                             "description": "Replace every occurrence (default false)."}),
         _edit_file, tags=("workspace",)),
    Tool("list_dir", f"List a folder (names, sizes; at most {LIST_CAP} entries).",
         schema([], path=string(_PATH + " Default: the group folder.")),
         _list_dir, tags=("workspace",)),
    Tool("glob", "Find files by name pattern under a folder, e.g. '**/*.md' or 'notes/*.txt' "
         f"(* and ? within one folder level, ** across levels; at most {LIST_CAP} paths).",
         schema(["pattern"], pattern=string("The glob pattern, relative to path."),
                path=string("Folder to search. " + _PATH + " Default: the group folder.")),
         _glob, tags=("workspace",)),
    Tool("grep", "Search file contents with a regular expression (Python syntax); prints "
         f"file:line: text, at most {GREP_MATCH_CAP} lines.",
         schema(["pattern"], pattern=string("The regular expression."),
                path=string("File or folder to search. " + _PATH + " Default: the group "
                            "folder."),
                glob=string("Only files whose path (relative to the folder) or name "
                            "matches this glob, e.g. '*.py'."),
                ignore_case={"type": "boolean", "description": "Ignore case (default "
                             "false)."}),
         _grep, tags=("workspace",)),
)

