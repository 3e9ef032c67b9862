"""What each view of the operator page shows, as JSON, from what the running daemon knows.

Every read and every change goes through the functions the CLI uses (mdclaw.ops.*,
mdclaw.state.*, mdclaw.ipc.quarantine, mdclaw.usage...): no rule is defined twice. `d` is
the running daemon as mdclaw.ops.view.DaemonView shows it: its config, database, channels,
queue and status.
"""

from __future__ import annotations

import base64
import io
import logging
import time
from typing import Any

import segno

from mdclaw import __version__
from mdclaw.budget import over_budget
from mdclaw.channels.base import Channel
from mdclaw.config import (
    config_for_display,
    config_text_for_display,
    find_config_path,
    iter_secret_files,
    secret_state,
)
from mdclaw.ipc.quarantine import list_errors, read_error_payload
from mdclaw.models import container_model_fields, model_for_group
from mdclaw.ops.approvals import approval_detail, approval_rows, decide, rules_for_groups
from mdclaw.ops.budgets import budget_rows, since_day
from mdclaw.ops.groups import group_listing
from mdclaw.ops.health import (
    FAILED_TURNS_WINDOW,
    channel_states,
    find_problems,
    for_people,
    over_budget_today,
    quarantined,
    task_problems,
    verdict,
)
from mdclaw.ops.outbox import change_outbox_row, change_outbox_rows
from mdclaw.ops.quarantine import delete_many, delete_quarantined
from mdclaw.ops.status import backup_summary
from mdclaw.ops.tasks import (
    CONFIG_CANCEL_NOTE,
    TASK_ACTIONS,
    change_summary,
    change_task,
    change_tasks,
    local_time,
    log_row,
    schedule_text,
    task_json,
    zone_for,
)
from mdclaw.ops.view import DaemonView
from mdclaw.paths import Layout
from mdclaw.schedule import to_iso, utc_now
from mdclaw.state.chats import list_chats
from mdclaw.state.failed_turns import failures_per_group
from mdclaw.state.groups import Refusals, list_groups, refusals
from mdclaw.state.outbox import list_outbox, recent_outbox_counts
from mdclaw.state.tasks import changes_allowed, get_task, list_runs, list_tasks, running_run_id
from mdclaw.usage import daily_usage

log = logging.getLogger("mdclaw.operator")

OUTBOX_FIELDS = ("id", "chat_jid", "kind", "text", "file_name", "emoji", "status",
                 "source_group", "attempts", "next_attempt_at", "last_error", "created_at",
                 "updated_at")


def qr_svg(text: str) -> str:
    """`text` as a QR code: an SVG data URL (for an <img>, where no script runs)."""
    buf = io.BytesIO()
    segno.make(text, error="m").save(buf, kind="svg", scale=6, border=2, xmldecl=False)
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode()


def channel_info(ch: Channel) -> dict[str, Any]:
    """A channel's status_info for the page, with its QR drawn while it waits to be linked."""
    try:
        info = dict(ch.status_info())
    except Exception as e:  # noqa: BLE001 - one channel's report must not take the page down
        info = {"connected": False, "error": ch.redact(f"{type(e).__name__}: {e}")}
    info["name"] = ch.name
    qr = info.get("qr")
    if isinstance(qr, str) and qr:
        info["qr_svg"] = qr_svg(qr)
    return info


def containers(d: DaemonView) -> list[dict[str, Any]]:
    """Running containers: the group, the job it runs and for how long."""
    q = d.queue
    if q is None:
        return []
    now = time.perf_counter()
    out = []
    for group in q.running_groups():
        job = q.running_job(group)
        out.append({"group": group, "job": f"{job.kind}:{job.id}" if job else None,
                    "age_s": round(now - job.picked_at, 1) if job and job.picked_at else None})
    return out


def overview(d: DaemonView) -> dict[str, Any]:
    """What the overview shows (on the event loop: the daemon's own status and channels);
    `health` adds what takes reading the database and folders."""
    status = d.status()
    channels = [channel_info(ch) for ch in d.channels]
    return {
        "daemon": {"pid": status["pid"], "version": __version__,
                   "started_at": status["started_at"], "updated_at": status["updated_at"],
                   "groups": status["groups"], "next_task": status["next_task"],
                   "status_line": d.status_line()},
        "engine": status["engine"],
        "channels": channels,
        "containers": containers(d),
        "queue": status["queue"],
        "outbox": status["outbox"],
        "disk": status["disk"],
        "backup": backup_summary(d.cfg),
        "reload": reload_for_people(d.last_reload), "reload_error": d.reload_error,
    }


def reload_for_people(last: dict[str, Any] | None) -> dict[str, Any] | None:
    """The last reload, its error without exception names."""
    if last is None or not last.get("error"):
        return last
    return {**last, "error": for_people(last["error"])}


def health(d: DaemonView, o: dict[str, Any]) -> dict[str, Any]:
    """Add to overview `o` the verdict and its problems (mdclaw.ops.health, as `mdclaw
    status` and `doctor` judge them), each channel's state by the one rule, and the counts
    the overview links to. Blocking: run it off the event loop."""
    connected = {c["name"]: bool(c.get("connected")) for c in o["channels"]}
    prefixes = {ch.name: ch.jid_prefix for ch in d.channels}
    troubles = {c["name"]: c["fix"] for c in o["channels"] if c.get("fix")}
    states = channel_states(d.db, connected, prefixes, troubles)
    for c in o["channels"]:
        st = states[c["name"]]
        c["state"] = st["state"]
        c["failing"] = st["failing"]
        for k in ("error", "detail"):
            if isinstance(c.get(k), str):
                c[k] = for_people(c[k])
    problems = find_problems(d.cfg, d.db, disk=o["disk"], channels=connected,
                             troubles=troubles,
                             engine=o["engine"], backup=o["backup"],
                             reload_error=d.reload_error)
    tasks = task_problems(d.db)
    turns = failures_per_group(d.db, to_iso(utc_now() - FAILED_TURNS_WINDOW))
    o["health"] = {"verdict": verdict(problems), "problems": [p.as_dict() for p in problems]}
    o["counts"] = {
        "failed_turns": sum(turns.values()), "quarantine": quarantined(d.cfg),
        "tasks_paused": len(tasks["paused"]), "tasks_failing": len(tasks["failing"]),
        "over_budget": len(over_budget_today(d.cfg, d.db)),
    }
    o["budget_today"] = budget_rows(d.cfg, d.db)
    o["engine_text"] = for_people(o["engine"])
    return o


def groups(d: DaemonView) -> list[dict[str, Any]]:
    counts = refusals(d.db)
    turns = failures_per_group(d.db, to_iso(utc_now() - FAILED_TURNS_WINDOW))
    activity = {c["jid"]: c["last_activity"] for c in list_chats(d.db)}
    q = d.queue
    running = set(q.running_groups()) if q is not None else set()
    queued = {j.group for j in q.pending()} if q is not None else set()
    out = []
    for g in list_groups(d.db):
        row = group_listing(g, counts.get(g.folder, Refusals()))
        blocked = d.disk_blocked(g.folder)
        row["container"] = ("running" if g.folder in running else "refused (disk)" if blocked
                            else "queued" if g.folder in queued else "idle")
        row["model"] = model_text(d, g.folder)
        row["failed_turns"] = turns.get(g.folder, 0)
        seen = [activity[c] for c in g.all_chats if activity.get(c)]
        row["last_activity"] = max(seen) if seen else None
        web = next((c for c in g.all_chats if any(
            ch.name == "http" and ch.owns_jid(c) for ch in d.channels)), None)
        row["chat_url"] = f"/?jid={web}" if web else None
        out.append(row)
    return out


NO_MODEL = "none: answers with the setup message"


def model_text(d: DaemonView, folder: str) -> str:
    """The model a group's agent uses, or NO_MODEL when none resolves (the group then gets
    the configuration answer instead of a reply, as doctor's models check says)."""
    if folder not in d.cfg.groups:
        return "none: the group is not in the config"
    key, spec = model_for_group(d.cfg, folder)
    if key is None or spec is None:
        return NO_MODEL
    return str(container_model_fields(d.cfg, folder)["model"] or key)


def tasks(d: DaemonView) -> list[dict[str, Any]]:
    out = []
    for t in list_tasks(d.db):
        row = task_json(t)
        tz = zone_for(t, d.cfg)
        row["zone"] = tz
        row["next_run_local"] = local_time(t.next_run, tz)
        row["last_run_local"] = local_time(t.last_run, tz)
        row["schedule"] = schedule_text(t.schedule_type, t.schedule_value)
        row["last_result"] = for_people(t.last_result)
        row["actions"] = changes_allowed(
            t, run_in_progress=running_run_id(d.db, t.id) is not None)
        out.append(row)
    return out


def task_runs(d: DaemonView, task_id: str, limit: int = 20) -> dict[str, Any] | None:
    t = get_task(d.db, task_id)
    if t is None:
        return None
    tz = zone_for(t, d.cfg)
    runs = []
    for r in list_runs(d.db, t.id, limit=limit):
        row = log_row(r, tz)
        row["outcome"] = for_people(row["outcome"])
        row["due_at"] = r.due_at or r.run_at  # UTC, shown in the viewer's zone
        runs.append(row)
    return {"task": task_json(t), "zone": tz, "runs": runs}


def change(d: DaemonView, task_id: str, action: str) -> dict[str, Any]:
    """Pause/resume/cancel/run-now, as `mdclaw tasks <action>`. Raises KeyError for an unknown
    action, TaskError/ScheduleError as the CLI."""
    if action not in TASK_ACTIONS:
        raise KeyError(action)
    before, after = change_task(d.cfg, d.db, task_id, action)
    d.wake_scheduler()
    note = CONFIG_CANCEL_NOTE if after.source == "config" and action == "cancel" else None
    return {"task": task_json(after), "message": change_summary(before, after, action, d.cfg),
            "note": note}


def outbox(d: DaemonView) -> dict[str, Any]:
    """The counts (recent_outbox_counts: the sent ones of the last day), every failed row (at
    most 500) and the latest 500 rows of any status (the page filters them by group and
    state): each with its channel and the error for people."""
    rows = []
    seen = {r.id: r for r in list_outbox(d.db, status="failed", limit=500)}
    for r in list_outbox(d.db, limit=500):
        seen.setdefault(r.id, r)
    for r in sorted(seen.values(), key=lambda r: r.id, reverse=True):
        row = {k: getattr(r, k) for k in OUTBOX_FIELDS}
        row["last_error"] = for_people(r.last_error)
        row["channel"] = next((ch.name for ch in d.channels if ch.owns_jid(r.chat_jid)), None)
        rows.append(row)
    return {"counts": recent_outbox_counts(d.db), "rows": rows,
            "failed": [r for r in rows if r["status"] == "failed"]}


def outbox_bulk(d: DaemonView, row_ids: list[int], action: str) -> dict[str, Any]:
    """Retry or drop each of `row_ids`, as ops.outbox.change_outbox_rows."""
    got = change_outbox_rows(d.db, row_ids, action)
    if action == "retry" and got["done"]:
        d.wake_outbox()
    return got


def tasks_bulk(d: DaemonView, task_ids: list[str], action: str) -> dict[str, Any]:
    """`action` on each of `task_ids`, as ops.tasks.change_tasks. Raises KeyError for an
    unknown action."""
    if action not in TASK_ACTIONS:
        raise KeyError(action)
    got = change_tasks(d.cfg, d.db, task_ids, action)
    d.wake_scheduler()
    return got


def outbox_change(d: DaemonView, row_id: int, action: str) -> dict[str, Any]:
    """Retry or drop a failed row, as `mdclaw outbox retry|drop`. Raises OutboxError."""
    row = change_outbox_row(d.db, row_id, action)
    if action == "retry":
        d.wake_outbox()
    return {"id": row.id, "status": "pending" if action == "retry" else "dropped"}


def approvals(d: DaemonView) -> dict[str, Any]:
    """What waits for a person (each with its request as a card shows it) and the audit of
    the latest decisions, as `mdclaw approvals list` has them."""
    pending = [approval_detail(d.db, r["id"]) for r in approval_rows(d.db, status="pending")]
    return {"pending": [p for p in pending if p is not None],
            "recent": [r for r in approval_rows(d.db, limit=100) if r["status"] != "pending"],
            "rules": rules_for_groups(d.cfg), "people": bool(d.cfg.people)}


def approval_change(d: DaemonView, approval_id: int, action: str,
                    option: int | None = None) -> dict[str, Any]:
    """Approve (or answer) or deny a pending approval as the operator, as `mdclaw approvals
    approve|deny`; the daemon carries it out at once. Raises ApprovalError."""
    a = decide(d.db, d.cfg, approval_id, action, via="page", option=option)
    d.wake_approvals()
    return a.as_dict()


def quarantine(d: DaemonView) -> list[dict[str, Any]]:
    """Quarantined command files with reasons and (as text) their content. Blocking: run it
    off the event loop."""
    errors_dir = Layout(d.cfg.data_dir).errors_dir
    out = []
    for e in reversed(list_errors(errors_dir)):  # newest first
        row = e.as_dict()
        try:
            row["payload"], row["payload_cut"] = read_error_payload(errors_dir, e.name, 16384)
        except ValueError:  # QuarantineError: it went away meanwhile
            row["payload"], row["payload_cut"] = "", False
        out.append(row)
    return out


def quarantine_delete(d: DaemonView, name: str) -> bool:
    """As `mdclaw ipc delete-error`. Raises QuarantineError. Blocking."""
    return delete_quarantined(d.cfg, name)


def quarantine_delete_many(d: DaemonView, names: list[str]) -> dict[str, Any]:
    """Each of `names`, as ops.quarantine.delete_many. Blocking."""
    return delete_many(d.cfg, names)


def usage(d: DaemonView, days: int = 14) -> dict[str, Any]:
    since = since_day(days)
    today = budget_rows(d.cfg, d.db)
    budgets = {b["group_folder"]: b["tokens_per_day"] for b in today}
    rows = daily_usage(d.db, since_day=since)
    for r in rows:
        r["tokens"] = r["input_tokens"] + r["output_tokens"]
        r["over"] = over_budget(r["tokens"], budgets.get(r["group_folder"]))
    models = daily_usage(d.db, since_day=since, by_model=True)
    return {"since": since, "days": days, "today_day": utc_now().strftime("%Y-%m-%d"),
            "rows": rows, "by_model": models, "budgets": budgets, "today": today}


def mcp(d: DaemonView) -> dict[str, Any]:
    """The MCP servers: state, tools (and whether each needs approval), restarts, the tail of
    stderr (secrets taken out), who may use them, and the last calls."""
    hub = d.mcp
    if hub is None:
        return {"servers": [], "recent": []}
    cfg = d.cfg
    servers = hub.status()
    for s in servers:
        s["tools"] = [{"name": t, "needs_approval": hub.needs_approval(s["server"], t)}
                      for t in s["tools"]]
        s["groups"] = {f: list(g.mcp[s["server"]]) for f, g in cfg.groups.items()
                       if g.mcp and s["server"] in g.mcp}
    return {"servers": servers, "recent": list(hub.recent)}


def config(d: DaemonView) -> dict[str, Any]:
    path: str | None
    try:
        path = str(find_config_path(d.config_path))
    except Exception:  # noqa: BLE001 - only shown; the daemon runs on whatever it loaded
        path = d.config_path
    secrets = [{"key": k, "path": str(p), "state": secret_state(p)}
               for k, p in iter_secret_files(d.cfg)]
    return {"file": path, "secrets": secrets,
            "yaml": config_text_for_display(d.cfg, path) if path else None,
            "config": config_for_display(d.cfg),
            "last_reload": reload_for_people(d.last_reload), "reload_error": d.reload_error}
