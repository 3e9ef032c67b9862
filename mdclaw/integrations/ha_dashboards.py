"""Home Assistant dashboards (Lovelace YAML) and canvas specs in the operator's dashboards_dir.

`integrations.home_assistant.dashboards_dir` is a host folder the operator configures; no
container ever mounts it, so it is host-only: names are plain file names (never a path, never
a dot-file), YAML is read with the safe loader only, every write goes to a temp file that is
fsynced and renamed into place, and a file is replaced only after its previous version was
copied to `backups/<name>.<UTC time>.<ext>` (ha_apply_dashboard).

The patch operations are pure functions over the parsed document, so a dry run is the same
code as the real one without the write.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from mdclaw import agentfs
from mdclaw.errors import IpcError

MAX_FILE_BYTES = 2 * 1024 * 1024
STAGING_FILE = "ui-lovelace-staging.yaml"
TARGET_FILE = "ui-lovelace.yaml"
CANVAS_FILE = "canvas-spec.json"
BACKUP_DIR = "backups"
# Agents coming from other hosts name files by their old container path; the name is kept.
_LEGACY_PREFIX = "/workspace/dashboard/"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
# Home Assistant's own form of an entity id (its `valid_entity_id`): `domain.object_id`, each
# part lowercase letters, digits and single underscores, neither starting nor ending with _.
ENTITY_ID = re.compile(r"^(?!.+__)(?!_)[\da-z_]+(?<!_)\.(?!_)[\da-z_]+(?<!_)\Z")
_ENTITY_KEYS = ("entity", "entity_id", "entities", "camera_image")


class DashboardError(IpcError, ValueError):
    """A bad file name, unreadable YAML, or an operation that cannot apply; str(e) says
    which and why."""


# --------------------------------------------------------------------------- names and files


def file_name(value: Any, default: str, kinds: tuple[str, ...], field: str) -> str:
    """The plain file name `value` names (default `default`), ending in one of `kinds`."""
    if value is None:
        return default
    if not isinstance(value, str):
        raise DashboardError(f"{field} must be a string")
    name = value[len(_LEGACY_PREFIX):] if value.startswith(_LEGACY_PREFIX) else value
    if not _NAME.match(name) or ".." in name or not name.endswith(kinds):
        raise DashboardError(f"{field} {value!r} must be a plain file name in dashboards_dir "
                             f"(letters, digits, _ . -) ending in {' or '.join(kinds)}")
    return name


def read_bytes(folder: Path, name: str) -> bytes | None:
    """The bytes of folder/name, or None if it does not exist. Blocking."""
    path = folder / name
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise DashboardError(f"{name} is a folder, not a file") from None
    if len(data) > MAX_FILE_BYTES:
        raise DashboardError(f"{name} is larger than {MAX_FILE_BYTES} bytes")
    return data


def atomic_write(folder: Path, name: str, data: bytes) -> None:
    """Write folder/name atomically (temp file, fsync, rename), making the folder if needed.
    The writing itself is mdclaw's one atomic write (agentfs), here on a host-owned folder."""
    if len(data) > MAX_FILE_BYTES:
        raise DashboardError(f"{name} would be larger than {MAX_FILE_BYTES} bytes")
    if not folder.is_dir():
        agentfs.make_dirs(folder, 0o755)
    dfd = agentfs.open_root(folder)
    try:
        agentfs.atomic_write(dfd, name, data, 0o644)
    finally:
        os.close(dfd)


def backup(folder: Path, name: str, now: datetime | None = None) -> str | None:
    """Copy folder/name to backups/<stem>.<UTC time><ext>; returns the backup's path
    relative to `folder`, or None if there was nothing to back up."""
    data = read_bytes(folder, name)
    if data is None:
        return None
    when = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S%fZ")
    stem, dot, ext = name.rpartition(".")
    backup_name = f"{stem}.{when}.{ext}" if dot else f"{name}.{when}"
    atomic_write(folder / BACKUP_DIR, backup_name, data)
    return f"{BACKUP_DIR}/{backup_name}"


# --------------------------------------------------------------------------- YAML


def parse_yaml(text: str | bytes, what: str) -> Any:
    """The document in `text`, read with the safe loader; DashboardError naming the line."""
    try:
        return yaml.safe_load(text)
    except yaml.constructor.ConstructorError as e:
        mark = f" (line {e.problem_mark.line + 1})" if e.problem_mark is not None else ""
        raise DashboardError(f"{what}: {e.problem}{mark}; only plain YAML is supported "
                             "(no !include, !secret or other tags)") from None
    except yaml.YAMLError as e:
        pos = getattr(e, "problem_mark", None)
        where = f" at line {pos.line + 1}, column {pos.column + 1}" if pos else ""
        problem = getattr(e, "problem", None) or str(e)
        raise DashboardError(f"{what} is not valid YAML{where}: {problem}") from None


def dump_yaml(doc: Any) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True,
                          default_flow_style=False).encode()


def structure_errors(doc: Any) -> list[str]:
    """What makes `doc` not a Lovelace dashboard: a mapping whose `views` is a list of
    mappings, each with a list of mapping `cards` (if any)."""
    if not isinstance(doc, dict):
        return ["the dashboard must be a YAML mapping with a 'views' list"]
    views = doc.get("views")
    if not isinstance(views, list):
        return ["the dashboard has no 'views' list"]
    errors = []
    for i, v in enumerate(views):
        if not isinstance(v, dict):
            errors.append(f"views[{i}] is not a mapping")
            continue
        cards = v.get("cards", [])
        if not isinstance(cards, list):
            errors.append(f"views[{i}].cards is not a list")
            continue
        errors += [f"views[{i}].cards[{j}] is not a mapping" for j, c in enumerate(cards)
                   if not isinstance(c, dict)]
    return errors


def referenced_entities(doc: Any) -> list[str]:
    """Every entity id the document names (in `entity`, `entity_id`, `entities`,
    `camera_image` keys at any depth), in order of first appearance."""
    found: dict[str, None] = {}

    def add(v: Any) -> None:
        if isinstance(v, str):
            found.setdefault(v.strip(), None)
        elif isinstance(v, list):
            for item in v:
                if isinstance(item, dict):
                    add(item.get("entity"))
                    walk(item)
                else:
                    add(item)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in _ENTITY_KEYS:
                    add(v)
                if isinstance(v, dict | list):
                    walk(v)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc)
    return [e for e in found if e]


def entity_format_errors(entities: list[str]) -> list[str]:
    return [f"{e!r} is not an entity id (domain.object_id)" for e in entities
            if not ENTITY_ID.match(e)]


# --------------------------------------------------------------------------- patches


def _view_index(doc: dict[str, Any], sel: Any, where: str) -> int:
    views = doc["views"]
    if isinstance(sel, int) and not isinstance(sel, bool):
        if not 0 <= sel < len(views):
            raise DashboardError(f"{where}: view {sel} does not exist ({len(views)} views)")
        return sel
    if isinstance(sel, str):
        for i, v in enumerate(views):
            if v.get("path") == sel:
                return i
        for i, v in enumerate(views):
            if v.get("title") == sel:
                return i
        known = [str(v.get("path") or v.get("title") or i) for i, v in enumerate(views)]
        raise DashboardError(f"{where}: no view with path or title {sel!r}; views: "
                             f"{', '.join(known) or 'none'}")
    raise DashboardError(f"{where}: 'view' must be a view's path, title or index")


def _index(value: Any, size: int, where: str, field: str, *, insert: bool = False) -> int:
    if value is None and insert:
        return size
    if not isinstance(value, int) or isinstance(value, bool):
        raise DashboardError(f"{where}: '{field}' must be a whole number")
    top = size if insert else size - 1
    if not 0 <= value <= top:
        raise DashboardError(f"{where}: '{field}' {value} is out of range 0..{top}")
    return value


def _mapping(op: dict[str, Any], field: str, where: str) -> dict[str, Any]:
    value = op.get(field)
    if not isinstance(value, dict):
        raise DashboardError(f"{where}: '{field}' must be a mapping")
    return copy.deepcopy(value)


def _merge(target: dict[str, Any], changes: dict[str, Any]) -> None:
    """Set each key of `changes` on `target`; a null value removes the key."""
    for k, v in changes.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = copy.deepcopy(v)


DASHBOARD_OPS = ("add_view", "update_view", "remove_view", "move_view", "add_card",
                 "update_card", "remove_card", "move_card", "set_theme")



def _operations(ops: Any, allowed: Sequence[str]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, kind, op) for each operation of a patch, each checked to be a mapping with a
    known `op` (or `type`); `where` names it in errors ("operations[2] (add_card)")."""
    if not isinstance(ops, list) or not ops:
        raise DashboardError("operations must be a non-empty list")
    for n, op in enumerate(ops):
        where = f"operations[{n}]"
        if not isinstance(op, dict):
            raise DashboardError(f"{where} must be a mapping")
        kind = op.get("op", op.get("type"))
        if kind not in allowed:
            raise DashboardError(f"{where}: op must be one of {', '.join(allowed)}, "
                                 f"not {kind!r}")
        yield f"{where} ({kind})", str(kind), op

def apply_dashboard_ops(doc: Any, ops: Any) -> tuple[dict[str, Any], list[str]]:
    """A copy of dashboard `doc` with `ops` applied in order, and one line per op saying
    what it did. Each op is {op: <name>, ...}:

    add_view {view: {...}, index?}; update_view {view: sel, changes: {...}};
    remove_view {view: sel}; move_view {view: sel, index};
    add_card {view: sel, card: {...}, index?}; update_card {view: sel, card: i, changes};
    remove_card {view: sel, card: i}; move_card {view: sel, card: i, index, toView?};
    set_theme {theme, view?} (every view when no view is given; null removes it).
    A view is chosen by its path, its title or its index. DashboardError on the first op
    that cannot apply (nothing is applied then)."""
    if doc is None:
        doc = {"views": []}
    problems = structure_errors(doc)
    if problems:
        raise DashboardError("; ".join(problems))
    out: dict[str, Any] = copy.deepcopy(doc)
    views: list[dict[str, Any]] = out["views"]
    notes = []
    for where, kind, op in _operations(ops, DASHBOARD_OPS):
        if kind == "add_view":
            view = _mapping(op, "view", where)
            view.setdefault("cards", [])
            i = _index(op.get("index"), len(views), where, "index", insert=True)
            views.insert(i, view)
            notes.append(f"added view {view.get('title') or view.get('path') or i} at {i}")
            continue
        if kind == "set_theme":
            theme = op.get("theme")
            if theme is not None and not isinstance(theme, str):
                raise DashboardError(f"{where}: 'theme' must be a string or null")
            chosen = ([_view_index(out, op["view"], where)] if op.get("view") is not None
                      else range(len(views)))
            for i in chosen:
                _merge(views[i], {"theme": theme})
            notes.append(f"theme {theme!r} on {len(chosen)} view(s)")
            continue
        vi = _view_index(out, op.get("view"), where)
        view = views[vi]
        cards = view.setdefault("cards", [])
        if kind == "update_view":
            _merge(view, _mapping(op, "changes", where))
            notes.append(f"updated view {vi}")
        elif kind == "remove_view":
            views.pop(vi)
            notes.append(f"removed view {vi}")
        elif kind == "move_view":
            to = _index(op.get("index"), len(views), where, "index")
            views.insert(to, views.pop(vi))
            notes.append(f"moved view {vi} to {to}")
        elif kind == "add_card":
            card = _mapping(op, "card", where)
            i = _index(op.get("index"), len(cards), where, "index", insert=True)
            cards.insert(i, card)
            notes.append(f"added a {card.get('type', 'card')} card to view {vi} at {i}")
        else:
            ci = _index(op.get("card"), len(cards), where, "card")
            if kind == "update_card":
                _merge(cards[ci], _mapping(op, "changes", where))
                notes.append(f"updated card {ci} of view {vi}")
            elif kind == "remove_card":
                cards.pop(ci)
                notes.append(f"removed card {ci} of view {vi}")
            else:  # move_card
                card = cards.pop(ci)
                tv = vi if op.get("toView") is None else _view_index(out, op["toView"], where)
                dest = views[tv].setdefault("cards", [])
                to = _index(op.get("index"), len(dest), where, "index", insert=True)
                dest.insert(to, card)
                notes.append(f"moved card {ci} of view {vi} to view {tv} at {to}")
    return out, notes


CANVAS_OPS = ("add_card", "update_card", "remove_card", "move_card", "set_layout",
              "set_title")


def parse_canvas(data: bytes, name: str) -> dict[str, Any]:
    try:
        spec = json.loads(data)
    except ValueError as e:
        raise DashboardError(f"{name} is not valid JSON: {e}") from None
    check_canvas(spec)
    assert isinstance(spec, dict)
    return spec


def check_canvas(spec: Any) -> None:
    """A canvas spec is a mapping; its `cards`, if any, a list of mappings with unique
    string ids."""
    if not isinstance(spec, dict):
        raise DashboardError("spec must be a JSON object")
    cards = spec.get("cards", [])
    if not isinstance(cards, list):
        raise DashboardError("spec.cards must be a list")
    seen = set()
    for i, c in enumerate(cards):
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not c["id"]:
            raise DashboardError(f"spec.cards[{i}] must be an object with a string 'id'")
        if c["id"] in seen:
            raise DashboardError(f"spec.cards[{i}]: id {c['id']!r} is used twice")
        seen.add(c["id"])


def apply_canvas_ops(spec: dict[str, Any], ops: Any) -> tuple[dict[str, Any], list[str]]:
    """A copy of canvas `spec` with `ops` applied: add_card {card: {id, ...}, index?},
    update_card {id, changes}, remove_card {id}, move_card {id, index},
    set_layout {layout: {...}}, set_title {title}."""
    out = copy.deepcopy(spec)
    cards: list[dict[str, Any]] = out.setdefault("cards", [])
    notes = []
    for where, kind, op in _operations(ops, CANVAS_OPS):
        if kind == "set_title":
            if not isinstance(op.get("title"), str):
                raise DashboardError(f"{where}: 'title' must be a string")
            out["title"] = op["title"]
            notes.append(f"title set to {op['title']!r}")
            continue
        if kind == "set_layout":
            out["layout"] = _mapping(op, "layout", where)
            notes.append("layout set")
            continue
        if kind == "add_card":
            card = _mapping(op, "card", where)
            i = _index(op.get("index"), len(cards), where, "index", insert=True)
            cards.insert(i, card)
            notes.append(f"added card {card.get('id')!r} at {i}")
        else:
            ids = [c.get("id") for c in cards]
            if op.get("id") not in ids:
                raise DashboardError(f"{where}: no card with id {op.get('id')!r}; cards: "
                                     f"{', '.join(map(str, ids)) or 'none'}")
            ci = ids.index(op["id"])
            if kind == "update_card":
                changes = _mapping(op, "changes", where)
                if "id" in changes:
                    raise DashboardError(f"{where}: a card's id cannot be changed")
                _merge(cards[ci], changes)
                notes.append(f"updated card {op['id']!r}")
            elif kind == "remove_card":
                cards.pop(ci)
                notes.append(f"removed card {op['id']!r}")
            else:
                to = _index(op.get("index"), len(cards), where, "index")
                cards.insert(to, cards.pop(ci))
                notes.append(f"moved card {op['id']!r} to {to}")
        check_canvas(out)
    return out, notes
