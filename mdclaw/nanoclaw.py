"""Moving in from NanoClaw v1: read its install, say what would be imported, import it.

A NanoClaw v1 install keeps its state in `store/messages.db` (SQLite: registered_groups,
chats, messages, scheduled_tasks, task_run_logs, sessions, router_state) and each group's
files, memory included (`CLAUDE.md`), in `groups/<folder>/` (`groups/global/` for all).

`read_install(dir)` opens the store read-only (never writes to it) and builds a `Plan`:
every registered group with its chat mapped to mdclaw's form, the tasks, messages and files
that would come along, and every row that cannot (unknown chat forms, broken schedules,
rows with missing fields) as a problem, never an exception. `config_snippet(plan)` is the
`groups:` part of a config.yaml for them.

`apply(plan, cfg, db, layout)` imports, for the groups the config has (matched by chat):

- chats and message history (ids `nanoclaw:<chat>:<id>`; memory search finds them through
  the transcript triggers); each group's cursor is moved past them, so history is never
  answered as new;
- scheduled tasks with their ids, schedules kept and next runs computed by mdclaw's rules
  now (a paused one stays paused; completed ones and run logs are history, left out);
- the group folders' files (`logs/` left out), through mdclaw.agentfs: a file that is
  there with other content is kept, NanoClaw's copy written beside it as `<name>.nanoclaw`.

Everything is idempotent: a second run finds every row and file there and changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mdclaw import agentfs
from mdclaw.config import Config
from mdclaw.config.types import folder_key
from mdclaw.errors import StateError
from mdclaw.paths import GLOBAL_DIR_MODE, GROUP_DIR_MODE, Layout
from mdclaw.schedule import ScheduleError, to_iso, utc_now
from mdclaw.state import Database
from mdclaw.state.conversations import get_cursor, set_cursor, upsert_chat
from mdclaw.state.tasks import TaskError, get_task, insert_task, pause_task

STORE = Path("store") / "messages.db"
MESSAGE_PREFIX = "nanoclaw:"
SKIPPED_DIRS = ("logs",)  # NanoClaw's container logs
MAX_FILE = 64 << 20  # a group file larger than this is reported, not copied
_WA = re.compile(r"^([0-9A-Za-z._-]{1,64})@(s\.whatsapp\.net|g\.us|lid)\Z")
_TG = re.compile(r"^tg:(-?\d{1,20})\Z")
_DC = re.compile(r"^dc:\d{1,20}\Z")  # the same form as mdclaw's Discord channel
_SLACK = re.compile(r"^slack:[A-Z0-9]{2,32}\Z")  # ... and Slack channel
_FOLDER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")


class NanoClawError(StateError):
    """The NanoClaw install cannot be read at all (no store, not a database...)."""


def map_jid(jid: str) -> tuple[str | None, str]:
    """NanoClaw's chat id in mdclaw's form, with the channel; (None, why) when mdclaw has no
    channel for it. WhatsApp `<id>@g.us` / `@s.whatsapp.net` / `@lid` -> `wa:<id>@...`;
    Telegram `tg:<id>`, Discord `dc:<channel>` and Slack `slack:<channel>` stay."""
    if _WA.match(jid):
        return f"wa:{jid}", "whatsapp"
    if _TG.match(jid):
        return jid, "telegram"
    if _DC.match(jid):
        return jid, "discord"
    if _SLACK.match(jid):
        return jid, "slack"
    kind = jid.split(":", 1)[0] if ":" in jid else "unknown"
    names = {"gmail": "Gmail", "sig": "Signal"}
    return None, f"mdclaw has no {names.get(kind, kind)} channel ({jid})"


@dataclass
class NcGroup:
    jid: str  # NanoClaw's
    name: str
    folder: str
    trigger: str
    requires_trigger: bool
    is_main: bool
    mdclaw_jid: str | None
    channel: str  # whatsapp | telegram, or why not
    messages: int = 0
    tasks: int = 0
    files: list[tuple[str, ...]] = field(default_factory=list)


@dataclass
class Plan:
    root: Path
    groups: list[NcGroup]
    tasks: list[dict[str, Any]]
    messages: int
    problems: list[str]
    sessions: int
    task_runs: int
    has_global: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "groups": [{"jid": g.jid, "name": g.name, "folder": g.folder,
                        "mdclaw_jid": g.mdclaw_jid, "channel": g.channel, "main": g.is_main,
                        "requires_trigger": g.requires_trigger, "trigger": g.trigger,
                        "messages": g.messages, "tasks": g.tasks, "files": len(g.files)}
                       for g in self.groups],
            "messages": self.messages, "tasks": len(self.tasks), "problems": self.problems,
            "sessions_not_imported": self.sessions, "task_runs_not_imported": self.task_runs,
        }


def _open_store(root: Path) -> sqlite3.Connection:
    path = root / STORE
    if not path.is_file():
        raise NanoClawError(f"{root} is not a NanoClaw v1 install: no {STORE}")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
        conn.row_factory = sqlite3.Row
        conn.execute("SELECT COUNT(*) FROM registered_groups").fetchone()
    except sqlite3.Error as e:
        raise NanoClawError(f"{path}: not a NanoClaw store ({e})") from None
    return conn


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}


def read_install(root: Path) -> Plan:
    """What `root` (a NanoClaw v1 install) holds and what of it can come along."""
    root = Path(root)
    conn = _open_store(root)
    problems: list[str] = []
    try:
        groups: list[NcGroup] = []
        has_main = "is_main" in _columns(conn, "registered_groups")
        seen_keys: set[str] = set()
        for r in conn.execute("SELECT * FROM registered_groups ORDER BY added_at, jid"):
            folder = r["folder"] or ""
            if not _FOLDER.match(folder) or folder in ("global", "errors"):
                problems.append(f"group {r['jid']}: folder {folder!r} is not a valid folder "
                                f"name: skipped")
                continue
            if folder_key(folder) in seen_keys:
                problems.append(f"group {r['jid']}: folder {folder!r} is used twice: skipped")
                continue
            seen_keys.add(folder_key(folder))
            mapped, channel = map_jid(r["jid"] or "")
            if mapped is None:
                problems.append(f"group {folder}: {channel}: skipped")
            groups.append(NcGroup(
                r["jid"], r["name"] or folder, folder, r["trigger_pattern"] or "",
                r["requires_trigger"] != 0, bool(has_main and r["is_main"]) or
                (not has_main and folder == "main"), mapped, channel))
        by_jid = {g.jid: g for g in groups if g.mdclaw_jid}
        by_folder = {g.folder: g for g in groups if g.mdclaw_jid}
        messages = 0
        for r in conn.execute("SELECT chat_jid, COUNT(*) FROM messages GROUP BY chat_jid"):
            g = by_jid.get(r[0])
            if g is None:
                problems.append(f"{r[1]} message(s) of chat {r[0]}, which is not a "
                                f"registered group mdclaw can serve: skipped")
            else:
                g.messages += r[1]
                messages += r[1]
        tasks: list[dict[str, Any]] = []
        for r in conn.execute("SELECT * FROM scheduled_tasks ORDER BY created_at, id"):
            t = dict(r)
            g = by_folder.get(t.get("group_folder") or "")
            if g is None:
                problems.append(f"task {t.get('id')}: group {t.get('group_folder')!r} is not "
                                f"imported: skipped")
                continue
            if t.get("status") == "completed":
                problems.append(f"task {t['id']} ({g.folder}): completed: history, not "
                                f"imported")
                continue
            g.tasks += 1
            tasks.append(t)
        sessions = conn.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
        task_runs = conn.execute("SELECT COUNT(*) FROM task_run_logs").fetchone()[0]
    except sqlite3.Error as e:
        raise NanoClawError(f"{root / STORE}: cannot read it ({e})") from None
    finally:
        conn.close()
    has_global = False
    try:
        groups_fd = agentfs.open_root(root / "groups")
    except (FileNotFoundError, agentfs.UnsafePath):
        groups_fd = -1
        problems.append(f"{root / 'groups'} is missing: no group files to import")
    if groups_fd >= 0:
        try:
            for g in groups:
                g.files = _files_of(groups_fd, g.folder, problems)
            has_global = bool(_files_of(groups_fd, "global", problems))
        finally:
            os.close(groups_fd)
    return Plan(root, groups, tasks, messages, problems, sessions, task_runs, has_global)


def _files_of(groups_fd: int, folder: str, problems: list[str]) -> list[tuple[str, ...]]:
    try:
        fd = agentfs.walk(groups_fd, [folder])
    except (FileNotFoundError, agentfs.UnsafePath):
        return []
    out = []
    try:
        for e in agentfs.iter_tree(fd):
            if e.parts[0] in SKIPPED_DIRS:
                continue
            if e.kind == "a regular file":
                out.append(e.parts)
            elif e.kind != "a directory":
                problems.append(f"groups/{folder}/{'/'.join(e.parts)}: {e.kind}: skipped")
    finally:
        os.close(fd)
    return out


# --------------------------------------------------------------------------- config


def _yaml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_snippet(plan: Plan, assistant_name: str | None = None) -> str:
    """The `groups:` (and `channels:`) part of a config.yaml for the groups mdclaw can serve."""
    lines = ["groups:"]
    channels = set()
    for g in plan.groups:
        if g.mdclaw_jid is None:
            continue
        channels.add(g.channel)
        lines.append(f"  {g.folder}:")
        lines.append(f"    name: {_yaml_str(g.name)}")
        lines.append(f"    jid: {_yaml_str(g.mdclaw_jid)}")
        if g.is_main:
            lines.append("    main: true")
        if not g.requires_trigger:
            lines.append("    requires_trigger: false")
        default = f"@{assistant_name}" if assistant_name else None
        if g.trigger and g.trigger != default:
            lines.append(f"    trigger: {_yaml_str(g.trigger)}")
    if len(lines) == 1:
        return ""
    if channels:
        lines.append("channels:")
        if "whatsapp" in channels:
            lines.append("  whatsapp: {enabled: true}   # then: mdclaw whatsapp link")
        if "telegram" in channels:
            lines.append("  telegram: {token_file: /path/to/bot-token}   # the bot NanoClaw used")
        if "discord" in channels:
            lines.append("  discord: {token_file: /path/to/bot-token}    # the bot NanoClaw used")
        if "slack" in channels:
            lines.append("  slack: {bot_token_file: /path/to/xoxb, app_token_file: "
                         "/path/to/xapp}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- apply


@dataclass
class Applied:
    groups: list[str] = field(default_factory=list)  # mdclaw folders imported into
    not_configured: list[str] = field(default_factory=list)  # NanoClaw folders
    messages: int = 0
    tasks: int = 0
    files: int = 0
    files_beside: int = 0  # written as <name>.nanoclaw next to a different file
    problems: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.messages or self.tasks or self.files or self.files_beside)

    def as_json(self) -> dict[str, Any]:
        return {"groups": self.groups, "not_configured": self.not_configured,
                "messages": self.messages, "tasks": self.tasks, "files": self.files,
                "files_beside": self.files_beside, "problems": self.problems,
                "changed": self.changed}


def apply(plan: Plan, cfg: Config, db: Database) -> Applied:
    """Import `plan` into the install of `cfg` (its groups must be in the config and
    reconciled). See the module's doc."""
    out = Applied(problems=list(plan.problems))
    configured = {g.jid: folder for folder, g in cfg.groups.items()}
    targets: dict[str, tuple[NcGroup, str]] = {}  # NanoClaw folder -> (group, mdclaw folder)
    for g in plan.groups:
        if g.mdclaw_jid is None:
            continue
        folder = configured.get(g.mdclaw_jid)
        if folder is None:
            out.not_configured.append(g.folder)
            continue
        targets[g.folder] = (g, folder)
        out.groups.append(folder)
    if not targets:
        return out
    conn = _open_store(plan.root)
    try:
        _import_messages(conn, db, targets, out)
    finally:
        conn.close()
    _import_tasks(plan, cfg, db, targets, out)
    _import_files(plan, cfg, targets, out)
    return out


def _import_messages(conn: sqlite3.Connection, db: Database,
                     targets: dict[str, tuple[NcGroup, str]], out: Applied) -> None:
    cols = _columns(conn, "messages")
    chat_cols = _columns(conn, "chats")
    for g, folder in targets.values():
        assert g.mdclaw_jid is not None
        chat = conn.execute("SELECT * FROM chats WHERE jid = ?", (g.jid,)).fetchone()
        last = None
        if chat is not None:
            last = chat["last_message_time"] if "last_message_time" in chat_cols else None
        rows = conn.execute("SELECT * FROM messages WHERE chat_jid = ? ORDER BY timestamp, id",
                            (g.jid,)).fetchall()
        with db.transaction() as c:
            upsert_chat(c, g.mdclaw_jid, chat["name"] if chat is not None else g.name,
                        g.channel, not g.mdclaw_jid.endswith("@s.whatsapp.net"),
                        last or to_iso(utc_now()))
            for r in rows:
                if not r["id"] or r["timestamp"] is None or r["content"] is None:
                    out.problems.append(f"message {r['id']!r} of {g.jid}: id, time or text "
                                        f"missing: skipped")
                    continue
                bot = bool(r["is_bot_message"]) if "is_bot_message" in cols else False
                mid = f"{MESSAGE_PREFIX}{g.jid}:{r['id']}"
                # Looked up first: an ignored INSERT would still use up a seq.
                if c.execute("SELECT 1 FROM messages WHERE id = ?", (mid,)).fetchone():
                    continue
                cur = c.execute(
                    """INSERT OR IGNORE INTO messages (id, chat_jid, sender, sender_name,
                           content, timestamp, is_from_me, is_bot_message)
                       VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                    (mid, g.mdclaw_jid, r["sender"] or "",
                     r["sender_name"] or r["sender"] or "", r["content"], r["timestamp"],
                     int(bool(r["is_from_me"])), int(bot)))
                out.messages += cur.rowcount
            top = c.execute("SELECT MAX(seq) FROM messages WHERE chat_jid = ? AND id >= ? "
                            "AND id < ?", (g.mdclaw_jid, MESSAGE_PREFIX,
                                           MESSAGE_PREFIX[:-1] + ";")).fetchone()[0]
        # History is not new: the group's cursor goes past it (never back).
        cursor = get_cursor(db, folder)
        if top is not None and (cursor is None or cursor < top):
            set_cursor(db, folder, int(top))


def _import_tasks(plan: Plan, cfg: Config, db: Database,
                  targets: dict[str, tuple[NcGroup, str]], out: Applied) -> None:
    tz = cfg.assistant.timezone
    for t in plan.tasks:
        target = targets.get(t["group_folder"])
        if target is None:
            continue
        g, folder = target
        assert g.mdclaw_jid is not None
        tid = str(t["id"])
        if get_task(db.conn, tid) is not None:
            continue
        mode = str(t.get("context_mode") or "isolated")
        mode = mode if mode in ("group", "isolated") else "isolated"
        try:
            with db.transaction() as c:
                insert_task(c, group_folder=folder, chat_jid=g.mdclaw_jid,
                            prompt=str(t["prompt"]), schedule_type=str(t["schedule_type"]),
                            schedule_value=str(t["schedule_value"]), timezone=tz,
                            context_mode=mode, task_id=tid)
                if t.get("status") == "paused":
                    pause_task(c, tid)
        except (ScheduleError, TaskError, ValueError, KeyError, sqlite3.Error) as e:
            out.problems.append(f"task {tid} ({g.folder}, {t.get('schedule_type')} "
                                f"{t.get('schedule_value')!r}): {e}: skipped")
            continue
        if t.get("script"):
            out.problems.append(f"task {tid}: its pre-run script is not imported (mdclaw "
                                f"tasks have none)")
        out.tasks += 1


def _import_files(plan: Plan, cfg: Config, targets: dict[str, tuple[NcGroup, str]],
                  out: Applied) -> None:
    layout = Layout(cfg.data_dir)
    pairs = [(g.folder, folder, GROUP_DIR_MODE, g.files) for g, folder in targets.values()]
    if plan.has_global:
        pairs.append(("global", "global", GLOBAL_DIR_MODE, []))
    src_root = agentfs.open_root(plan.root / "groups")
    dst_root = agentfs.open_root(layout.groups_dir)
    try:
        for src_folder, dst_folder, mode, files in pairs:
            if not files:
                files = _files_of(src_root, src_folder, [])
            src = agentfs.walk(src_root, [src_folder])
            dst = agentfs.walk(dst_root, [dst_folder], create=mode)
            try:
                for parts in files:
                    _copy_one(src, dst, parts, f"groups/{src_folder}", out)
            finally:
                os.close(src)
                os.close(dst)
    finally:
        os.close(src_root)
        os.close(dst_root)


def _read(root: int, parts: tuple[str, ...]) -> bytes | None:
    try:
        fd, st = agentfs.open_tree_file(root, parts)
    except (FileNotFoundError, agentfs.Vanished):
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_FILE + 1)


def _copy_one(src: int, dst: int, parts: tuple[str, ...], where: str, out: Applied) -> None:
    name = f"{where}/{'/'.join(parts)}"
    try:
        data = _read(src, parts)
    except (agentfs.Rejected, agentfs.UnsafePath, OSError) as e:
        out.problems.append(f"{name}: {e}: skipped")
        return
    if data is None:
        return
    if len(data) > MAX_FILE:
        out.problems.append(f"{name}: larger than {MAX_FILE >> 20} MiB: skipped")
        return
    try:
        there = _read(dst, parts)
    except (agentfs.Rejected, agentfs.UnsafePath, OSError) as e:
        out.problems.append(f"{name}: the file in mdclaw's folder is unusable ({e}): skipped")
        return
    if there is not None and hashlib.sha256(there).digest() == hashlib.sha256(data).digest():
        return
    beside = parts
    if there is not None:
        beside = (*parts[:-1], parts[-1] + ".nanoclaw")
        try:
            if _read(dst, beside) == data:
                return
        except (agentfs.Rejected, agentfs.UnsafePath, OSError):
            pass
    try:
        if there is not None:
            dfd = agentfs.walk(dst, beside[:-1], create=GROUP_DIR_MODE)
            try:
                agentfs.atomic_write(dfd, beside[-1], data, 0o660)
            finally:
                os.close(dfd)
            out.files_beside += 1
            out.problems.append(f"{name}: mdclaw's folder has another {parts[-1]}: kept it; "
                                f"NanoClaw's is beside it as {beside[-1]}")
        else:
            agentfs.write_tree_file(dst, parts, [data], 0o660, dir_mode=GROUP_DIR_MODE)
            out.files += 1
    except (agentfs.UnsafePath, OSError) as e:
        out.problems.append(f"{name}: {e}: skipped")
