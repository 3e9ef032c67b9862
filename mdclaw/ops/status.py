"""How things are: the daemon's last published status merged with what the database and the
disk say now (`mdclaw status`, doctor's port check, `mdclaw whatsapp link`), whether the
daemon runs or not. The running daemon publishes its status to `status_path(cfg)`."""

from __future__ import annotations

import json
import os
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

from mdclaw.backup import last_backup
from mdclaw.config import Config, format_duration
from mdclaw.diskguard import check_all
from mdclaw.ops.database import READ_TIMEOUT, database_fields, recheck
from mdclaw.ops.email import email_status
from mdclaw.ops.health import Problem, find_problems
from mdclaw.ops.matrix import matrix_status
from mdclaw.ops.whatsapp import whatsapp_status
from mdclaw.schedule import from_iso, to_iso, utc_now
from mdclaw.state import Database, inspect_database
from mdclaw.state.failed_turns import list_failed_turns
from mdclaw.state.outbox import outbox_counts

STATUS_FILE = "daemon-status.json"
STALE_AFTER = 30.0  # seconds without a status update: the daemon is not running

DB_KEYS = ("groups", "outbox", "tasks_active", "next_task", "failed_messages", "failed_turns",
           "problems")


def status_path(cfg: Config) -> Path:
    """Where the running daemon publishes its status (every few seconds, and at once on a
    change of the engine or a reload)."""
    return cfg.data_dir / STATUS_FILE


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gather_status(cfg: Config) -> dict[str, Any]:
    """The daemon's last published status merged with what the database says now.

    `database` is the database's state (see mdclaw/commands/common.py); when it is not
    `ready` the keys read from it (DB_KEYS) are null and `database_detail` says why."""
    out: dict[str, Any] = {"daemon": "stopped", "config_data_dir": str(cfg.data_dir)}
    try:
        live = json.loads(status_path(cfg).read_text())
        age = (utc_now() - from_iso(live["updated_at"])).total_seconds()
        if _pid_alive(int(live["pid"])) and age < STALE_AFTER:
            out["daemon"] = "running"
            out.update({k: live[k] for k in ("pid", "started_at", "engine", "containers",
                                             "queue", "channels", "channel_states",
                                             "channel_details",
                                             "reload_error", "mcp")
                        if k in live})
    except (OSError, ValueError, KeyError):
        pass
    out["disk"] = disk_status(cfg)
    out["backup"] = backup_summary(cfg)
    wa = whatsapp_status(cfg)
    if wa is not None:
        out["whatsapp"] = wa
    mail = email_status(cfg)
    if mail is not None:
        out["email"] = mail
    mx = matrix_status(cfg)
    if mx is not None:
        out["matrix"] = mx
    info = inspect_database(cfg.db_path)
    if info.state == "ready":
        try:
            out.update(_db_status(cfg))
            out["problems"] = [p.as_dict() for p in _problems(cfg, out)]
        except sqlite3.Error as e:  # locked or migrated between the look and the queries
            info = recheck(cfg, e)
    out.update(database_fields(info, cfg.db_path))
    if info.state != "ready":
        out.update(dict.fromkeys(DB_KEYS))
    return out


def daemon_running(cfg: Config) -> bool:
    """Whether this install's daemon runs now (it published its status lately)."""
    return gather_status(cfg).get("daemon") == "running"


def _db_status(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with Database(cfg.db_path, readonly=True, timeout=READ_TIMEOUT) as db:
        out["groups"] = db.scalar("SELECT COUNT(*) FROM registered_groups")
        out["outbox"] = outbox_counts(db)
        out["tasks_active"] = db.scalar(
            "SELECT COUNT(*) FROM scheduled_tasks WHERE status = 'active'")
        r = db.query_one("SELECT id, next_run FROM scheduled_tasks WHERE status = 'active' "
                         "AND next_run IS NOT NULL ORDER BY next_run LIMIT 1")
        out["next_task"] = {"id": r[0], "next_run": r[1]} if r else None
        out["failed_messages"] = [
            {"id": x["id"], "chat_jid": x["chat_jid"], "error": x["last_error"]}
            for x in db.query("SELECT id, chat_jid, last_error FROM outbox WHERE "
                              "status = 'failed' ORDER BY id DESC LIMIT 5")]
        out["failed_turns"] = _recent_failed_turns(db)
    return out


def _problems(cfg: Config, out: dict[str, Any]) -> list[Problem]:
    """ops.health's problems, with what the running daemon published (when it runs)."""
    running = out["daemon"] == "running"
    with Database(cfg.db_path, readonly=True, timeout=READ_TIMEOUT) as db:
        return find_problems(cfg, db, disk=out.get("disk"),
                             channels=out.get("channels") if running else None,
                             troubles={n: d["fix"] for n, d in
                                       (out.get("channel_details") or {}).items()
                                       if d.get("fix")} if running else None,
                             engine=out.get("engine") if running else None,
                             backup=out.get("backup"),
                             reload_error=out.get("reload_error") if running else None)


def _recent_failed_turns(db: Database, days: float = 1.0,
                         limit: int = 5) -> list[dict[str, Any]]:
    """The latest failed agent turns (the database is ready: the table is there)."""
    rows = list_failed_turns(db, since=to_iso(utc_now() - timedelta(days=days)), limit=limit)
    return [{k: r[k] for k in ("created_at", "group_folder", "cause", "outcome", "attempts",
                               "detail")} for r in rows]


def disk_status(cfg: Config) -> dict[str, Any]:
    """Free space and each group's files, measured now with the daemon's own rule."""
    return check_all(cfg)


def backup_summary(cfg: Config) -> dict[str, Any]:
    """The last backup as doctor, `status`, the operator page and /metrics show it:
    data_dir/backup-status.json (mdclaw.backup) with `level` (ok, or warn once two scheduled
    backups were missed) and a `detail` line."""
    last = last_backup(cfg.data_dir)
    if last is None:
        return {"last_success": None, "level": "ok", "overdue": False,
                "detail": "no backup recorded yet (mdclaw backup; docs/backup.md)"}
    out = last.as_json()
    if last.at is None or last.age is None:
        out.update(level="warn", detail="backup-status.json is unreadable")
        return out
    age = _age_text(last.age)
    detail = f"last backup {age} ago ({to_iso(last.at)}): {last.archive}"
    if last.overdue and last.every:
        every = format_duration(timedelta(seconds=last.every))
        out.update(level="warn", detail=f"{detail}; {last.missed} scheduled backups (every "
                                        f"{every}) missed")
    else:
        out.update(level="ok", detail=detail)
    return out


def _age_text(seconds: float) -> str:
    """A rough age for people: 2d 3h, 5h 12m, 7m, 30s."""
    s = max(0, int(seconds))
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    return f"{m}m" if m else f"{s}s"
