"""`mdclaw status` and `mdclaw doctor`: how things are, and what to fix."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from datetime import datetime
from typing import Any

from mdclaw.commands.common import load_or_exit
from mdclaw.commands.output import print_json
from mdclaw.config import Config, ConfigError, iter_secret_files, load_config, read_secret
from mdclaw.schedule import from_iso, get_zone, to_iso, utc_now

STALE_AFTER = 30.0  # seconds without a status update: the daemon is not running


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common],
                       help="what the daemon is doing (works whether it runs or not)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("failures", parents=[common],
                       help="failed agent turns: when, which group, the cause, what happened")
    p.add_argument("--group", "-g", metavar="FOLDER", help="only this group")
    p.add_argument("--days", type=float, default=7.0, help="this many days back (default 7)")
    p.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_failures)
    p = sub.add_parser("doctor", parents=[common],
                       help="check config, data dir, engine, image, channels, clock")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def gather_status(cfg: Config) -> dict[str, Any]:
    """The daemon's last published status merged with what the database says now."""
    from mdclaw.daemon import status_path
    from mdclaw.outbox import outbox_counts
    from mdclaw.state import Database

    out: dict[str, Any] = {"daemon": "stopped", "config_data_dir": str(cfg.data_dir)}
    try:
        live = json.loads(status_path(cfg).read_text())
        age = (utc_now() - from_iso(live["updated_at"])).total_seconds()
        if _pid_alive(int(live["pid"])) and age < STALE_AFTER:
            out["daemon"] = "running"
            out.update({k: live[k] for k in ("pid", "started_at", "engine", "containers",
                                             "queue", "channels", "reload_error")
                        if k in live})
    except (OSError, ValueError, KeyError):
        pass
    if not cfg.db_path.exists():
        out.update(groups=0, outbox={}, next_task=None, tasks_active=0)
        return out
    with Database(cfg.db_path, migrate=False) as db:
        out["groups"] = db.query_one("SELECT COUNT(*) FROM registered_groups")[0]
        out["outbox"] = outbox_counts(db)
        out["tasks_active"] = db.query_one(
            "SELECT COUNT(*) FROM scheduled_tasks WHERE status = 'active'")[0]
        r = db.query_one("SELECT id, next_run FROM scheduled_tasks WHERE status = 'active' "
                         "AND next_run IS NOT NULL ORDER BY next_run LIMIT 1")
        out["next_task"] = {"id": r[0], "next_run": r[1]} if r else None
        out["failed_messages"] = [
            {"id": x["id"], "chat_jid": x["chat_jid"], "error": x["last_error"]}
            for x in db.query("SELECT id, chat_jid, last_error FROM outbox WHERE "
                              "status = 'failed' ORDER BY id DESC LIMIT 5")]
    return out


def cmd_status(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    s = gather_status(cfg)
    if args.json:
        print_json(s)
        return 0
    if s["daemon"] == "running":
        print(f"daemon: running (pid {s.get('pid')}, since {s.get('started_at')})")
        print(f"engine: {s.get('engine')}")
        print(f"containers running: {', '.join(s.get('containers') or []) or 'none'}")
        q = s.get("queue") or {}
        print(f"queue: {q.get('pending', 0)} pending, retrying: "
              f"{', '.join(q.get('retrying') or []) or 'none'}")
        ch = s.get("channels") or {}
        print("channels: " + (", ".join(f"{k} {'up' if v else 'DOWN'}" for k, v in ch.items())
                              or "none"))
        if s.get("reload_error"):
            print(f"last reload failed: {s['reload_error']}")
    else:
        print("daemon: not running")
    print(f"groups: {s['groups']}")
    ob = s.get("outbox") or {}
    print(f"outbox: {ob.get('pending', 0)} pending, {ob.get('sent', 0)} sent, "
          f"{ob.get('failed', 0)} failed")
    for f in s.get("failed_messages") or []:
        print(f"  failed #{f['id']} to {f['chat_jid']}: {f['error']}")
    nt = s.get("next_task")
    print(f"next task: {nt['id']} at {nt['next_run']}" if nt else "next task: none")
    return 0


FAILURE_FIELDS = ("created_at", "group_folder", "cause", "outcome", "attempts", "messages",
                  "detail")


def cmd_failures(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from mdclaw.commands.common import open_db_or_exit
    from mdclaw.commands.output import print_rows
    from mdclaw.state.failed_turns import list_failed_turns

    cfg = load_or_exit(args)
    since = to_iso(utc_now() - timedelta(days=args.days))
    db = open_db_or_exit(cfg)
    try:
        rows = list_failed_turns(db, group=args.group, since=since, limit=args.limit)
    finally:
        db.close()
    print_rows(rows, FAILURE_FIELDS, as_json=args.json,
               empty=f"no failed turns in the last {args.days:g} day(s)")
    return 0


# --------------------------------------------------------------------------- doctor


def _check(results: list[dict[str, str]], name: str, level: str, detail: str,
           fix: str = "") -> None:
    results.append({"check": name, "level": level, "detail": detail, "fix": fix})


def run_checks(config_path: str | None) -> list[dict[str, str]]:
    """Every doctor check as {check, level: ok|warn|fail, detail, fix}."""
    results: list[dict[str, str]] = []
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        _check(results, "config", "fail", str(e).splitlines()[0],
               "run `mdclaw check-config` for every error and fix the file")
        return results
    _check(results, "config", "ok", f"{len(cfg.groups)} group(s), main: {cfg.main_folder}")
    # data dir (checked, never created here)
    target = cfg.data_dir
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".mdclaw-doctor-"):
            pass
        detail = (f"{cfg.data_dir} is writable" if target == cfg.data_dir
                  else f"{cfg.data_dir} does not exist yet; {target} lets this user create it")
        _check(results, "data_dir", "ok", detail)
    except OSError as e:
        _check(results, "data_dir", "fail", f"{target}: {e.strerror or e}",
               f"create {cfg.data_dir} and give this user write access to it")
    # engine and image
    try:
        from mdclaw.runtime import create_runtime

        rt = create_runtime(cfg.runtime)
        desc = rt.ping()
        _check(results, "engine", "ok", desc)
        try:
            if rt.image_info(cfg.runtime.image) is not None:
                _check(results, "image", "ok", f"{cfg.runtime.image} is present")
            else:
                _check(results, "image", "fail", f"{cfg.runtime.image} is not present",
                       "run `mdclaw image build` (or `mdclaw image load` with the flake's "
                       "container-image)")
        except Exception as e:
            _check(results, "image", "fail", f"{cfg.runtime.image}: {e}",
                   "run `mdclaw image build`")
    except Exception as e:
        _check(results, "engine", "fail", f"container engine not reachable: {e}",
               "start Docker or `podman system service`, or set runtime.socket / DOCKER_HOST")
        _check(results, "image", "warn", "not checked: no engine")
    # channel credentials
    for key, path in iter_secret_files(cfg):
        try:
            if read_secret(path):
                _check(results, key, "ok", f"{path} is readable")
            else:
                _check(results, key, "fail", f"{path} is empty", f"write the secret into {path}")
        except OSError as e:
            _check(results, key, "fail", f"{path}: {e.strerror or e}",
                   f"make {path} readable by this user (and by no one else)")
    # clock and timezone
    now = utc_now()
    if now.year < 2024:
        _check(results, "clock", "fail", f"system clock says {to_iso(now)}",
               "enable time sync (systemd-timesyncd or chrony)")
    else:
        local = datetime.now(get_zone(cfg.assistant.timezone))
        _check(results, "clock", "ok", f"{to_iso(now)}; {cfg.assistant.timezone} is "
               f"{local.strftime('%Y-%m-%d %H:%M %Z')}")
    return results


def cmd_doctor(args: argparse.Namespace) -> int:
    results = run_checks(args.config)
    if args.json:
        print_json(results)
    else:
        for r in results:
            line = f"{r['level'].upper():4}  {r['check']}: {r['detail']}"
            if r["fix"] and r["level"] != "ok":
                line += f"\n      fix: {r['fix']}"
            print(line)
    return 1 if any(r["level"] == "fail" for r in results) else 0
