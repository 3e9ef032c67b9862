"""Is the assistant healthy? One list of problems, each with the view of the operator page that
fixes it, for `mdclaw status`, `mdclaw doctor` and the operator page's verdict ("2 problems").

Each rule is defined here once:

- a channel's deliveries fail (`delivery_failures`): a message to one of its chats failed, or
  is being tried again after an error, within the last hour, and nothing to its chats was sent
  after that. Such a channel is shown "deliveries failing", never "connected" (`channel_state`);
- a group's failed turns are a problem from `FAILED_TURNS_THRESHOLD` in 24 hours;
- a task fails when its last run ended in an error (or was interrupted), or when mdclaw paused
  it itself (a schedule that no longer computes); a task the operator paused is counted, not a
  problem;
- the outbox holds failed deliveries; files are quarantined; a group used more model tokens
  today than its budget; the disk is below its floor or a group over its limits; the backup is
  overdue; the container engine is not reachable; the last reload was refused.

`for_people` takes internal exception names ("RunFailed: ") out of text a person reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sized
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from mdclaw.budget import over_budget
from mdclaw.config import Config
from mdclaw.diskguard import OK
from mdclaw.ipc.quarantine import count_errors
from mdclaw.models import model_for_group
from mdclaw.paths import Layout
from mdclaw.schedule import to_iso, utc_now
from mdclaw.state import Database
from mdclaw.state.failed_turns import failures_per_group
from mdclaw.usage import tokens_on_day

FAILED_TURNS_WINDOW = timedelta(days=1)
FAILED_TURNS_THRESHOLD = 3
DELIVERY_WINDOW = timedelta(hours=1)

#: What each channel's chat ids start with (each channel's `jid_prefix`).
CHANNEL_PREFIXES = {"http": "hl:", "telegram": "tg:", "whatsapp": "wa:", "email": "mail:",
                    "matrix": "mx:", "discord": "dc:", "slack": "slack:"}

_EXCEPTION_NAME = re.compile(
    r"(?<![\w.])(?:[a-z_][\w]*\.)*[A-Z]\w*(?:Error|Failed|Refused|Exception|Timeout|Unavailable"
    r"|Denied|Invalid|Closed|Reset|Aborted)(?::\s*|\b(?=\s*$))")


def for_people(text: str | None) -> str | None:
    """`text` without the internal exception class names in it ("RunFailed: the engine is
    not reachable" -> "the engine is not reachable"); a bare name becomes a sentence."""
    if not text:
        return text
    out = _EXCEPTION_NAME.sub("", text).strip()
    if not out:  # nothing but a name ("ConnectionRefusedError")
        name = text.strip().rstrip(":").rsplit(".", 1)[-1]
        words = re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower().replace(" error", "")
        return words.strip() or text
    return out


@dataclass(frozen=True)
class Problem:
    """One thing wrong: `key` (stable, for tests and scripts), `level` (warn or fail), `text`
    for people, `view` (the operator page's view that fixes it) and how many things it counts."""

    key: str
    level: str
    text: str
    view: str
    count: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def delivery_failures(db: Database, prefixes: Mapping[str, str] | None = None, *,
                      now: datetime | None = None,
                      window: timedelta = DELIVERY_WINDOW) -> dict[str, dict[str, Any]]:
    """The channels whose deliveries fail now (see the module's rule): {channel: {"failed":
    rows, "last_error", "since"}}. `prefixes`: {channel: jid prefix} (default: every channel)."""
    since = to_iso((now or utc_now()) - window)
    out: dict[str, dict[str, Any]] = {}
    for name, prefix in (prefixes if prefixes is not None else CHANNEL_PREFIXES).items():
        if not prefix:
            continue
        mine = "substr(chat_jid, 1, ?) = ?"
        # Only a row sent within the window can come after a failure in it: both reads are
        # ranges of idx_outbox_status_time (a sent row's updated_at is when it was sent), so
        # they cost the window's rows, not every row ever sent.
        last_sent = db.scalar(f"SELECT MAX(updated_at) FROM outbox WHERE status = 'sent' "  # noqa: S608
                              f"AND updated_at >= ? AND {mine}", (since, len(prefix), prefix))
        rows = db.query(
            "SELECT updated_at, last_error FROM outbox WHERE status IN ('failed', 'pending', "  # noqa: S608
            f"'sending') AND updated_at >= ? AND updated_at > ? AND {mine} "
            "AND (status = 'failed' OR last_error IS NOT NULL)",
            (since, last_sent or "", len(prefix), prefix))
        rows.sort(key=lambda r: r[0], reverse=True)  # the newest first (one range a state)
        if rows:
            out[name] = {"failed": len(rows), "last_error": for_people(rows[0][1]),
                         "since": rows[-1][0]}
    return out


def channel_state(connected: bool, failing: Mapping[str, Any] | None,
                  trouble: str | None = None) -> str:
    """What a channel is shown as: "connected" only while it is, its deliveries do not fail
    and it reports nothing to fix (`trouble`: its status_info's `fix`, e.g. the mail server
    refuses the connection while the channel keeps trying); else "not connected",
    "deliveries failing" or "needs attention"."""
    if not connected:
        return "not connected"
    if failing:
        return "deliveries failing"
    return "needs attention" if trouble else "connected"


def channel_states(db: Database, connected: Mapping[str, bool],
                   prefixes: Mapping[str, str] | None = None,
                   troubles: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """{channel: {"state", "connected", "failing" (or None), "trouble"}} for the channels in
    `connected` ({name: is connected}; `troubles`: {name: what to fix}), by the one rule."""
    table = prefixes if prefixes is not None else CHANNEL_PREFIXES
    failing = delivery_failures(db, {n: table.get(n, "") for n in connected})
    troubles = troubles or {}
    return {n: {"state": channel_state(c, failing.get(n), troubles.get(n)), "connected": c,
                "failing": failing.get(n), "trouble": troubles.get(n)}
            for n, c in connected.items()}


def failed_turn_groups(db: Database, *, now: datetime | None = None) -> dict[str, int]:
    """Groups with `FAILED_TURNS_THRESHOLD` or more failed turns in the last 24 hours."""
    counts = failures_per_group(db, to_iso((now or utc_now()) - FAILED_TURNS_WINDOW))
    return {g: n for g, n in sorted(counts.items()) if n >= FAILED_TURNS_THRESHOLD}


def task_problems(db: Database) -> dict[str, list[dict[str, Any]]]:
    """{"failing": [...], "paused_by_mdclaw": [...], "paused": [...]}: tasks whose last run
    failed, tasks mdclaw paused itself, and every paused task ({id, group_folder, why})."""
    out: dict[str, list[dict[str, Any]]] = {"failing": [], "paused_by_mdclaw": [],
                                            "paused": []}
    rows = db.query(
        "SELECT t.id, t.group_folder, t.status, t.last_result, "
        "(SELECT r.status FROM task_run_logs r WHERE r.task_id = t.id AND r.status != "
        "'running' ORDER BY r.id DESC LIMIT 1) AS last_status "
        "FROM scheduled_tasks t WHERE t.status IN ('active', 'paused') ORDER BY t.id")
    for r in rows:
        item = {"id": r[0], "group_folder": r[1], "why": for_people(r[3]) or ""}
        if r[2] == "paused":
            out["paused"].append(item)
            if (r[3] or "").startswith("paused:"):
                out["paused_by_mdclaw"].append(item)
        elif r[4] in ("error", "interrupted"):
            out["failing"].append(item)
    return out


def over_budget_today(cfg: Config, db: Database, *, now: datetime | None = None
                      ) -> dict[str, tuple[int, int]]:
    """{group: (tokens today, budget)} for groups at or over their daily token budget."""
    day = (now or utc_now()).strftime("%Y-%m-%d")
    out = {}
    for folder in sorted(cfg.groups):
        budget = cfg.token_budget(folder)
        if budget is None:
            continue
        used = tokens_on_day(db, folder, day)
        if over_budget(used, budget):
            out[folder] = (used, budget)
    return out


def quarantined(cfg: Config) -> int:
    """How many command files are quarantined (blocking: reads a folder)."""
    return count_errors(Layout(cfg.data_dir).errors_dir)


def no_model_groups(cfg: Config) -> list[str]:
    """The groups of the config no model resolves for (doctor's models check, the groups
    view's "none: answers with the setup message")."""
    return [folder for folder in cfg.groups if model_for_group(cfg, folder)[1] is None]


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def find_problems(cfg: Config, db: Database, *, disk: Mapping[str, Any] | None,
                  channels: Mapping[str, bool] | None = None,
                  troubles: Mapping[str, str] | None = None, engine: str | None = None,
                  backup: Mapping[str, Any] | None = None, reload_error: str | None = None,
                  now: datetime | None = None) -> list[Problem]:
    """Every problem of this install, worst first. `channels` ({name: connected}),
    `troubles` ({name: its fix}), `engine` and `reload_error` are the running daemon's
    (None: not known, not checked; deliveries are judged from the database either way);
    `disk` is mdclaw.diskguard's status and `backup` ops.status.backup_summary (None: not
    checked). Blocking."""
    out: list[Problem] = []
    if engine is not None and not engine.startswith(("ok", "checking")):
        out.append(Problem("engine", "fail", for_people(engine) or engine, "overview"))
    if reload_error:
        out.append(Problem("reload", "fail", "the last config reload was refused: "
                           + (for_people(reload_error) or reload_error), "config"))
    if disk is not None:
        # check_all's shape (status, doctor) or the running daemon's (groups refused now)
        free, floor = disk.get("free"), disk.get("floor") or 0
        if not disk.get("host_ok", free is None or free >= floor):
            out.append(Problem("disk", "fail", "the disk is below its floor: no container runs",
                               "overview"))
        bad = [f for f, v in (disk.get("groups", disk.get("blocked")) or {}).items()
               if v.get("state") not in (OK, "host_full")]
        if bad:
            too_big = (f"1 group is over its disk limit ({bad[0]})" if len(bad) == 1 else
                       f"{len(bad)} groups are over their disk limits ({', '.join(bad)})")
            out.append(Problem("disk_groups", "fail", too_big, "groups", len(bad)))
    unmodelled = no_model_groups(cfg)
    if unmodelled:
        out.append(Problem("models", "fail",
                           f"no model for {_n(len(unmodelled), 'group', 'groups')}"
                           f" ({', '.join(unmodelled)}): they answer with the setup message "
                           "instead of a reply", "groups", len(unmodelled)))
    # Without the daemon's word on connections (doctor), deliveries are still judged.
    states: dict[str, dict[str, Any]]
    if channels is not None:
        states = channel_states(db, channels, troubles=troubles)
    else:
        states = {n: {"state": channel_state(True, f), "failing": f}
                  for n, f in delivery_failures(db).items()}
    for name, st in states.items():
        if st["state"] == "not connected":
            out.append(Problem(f"channel:{name}", "fail", f"{name} is not connected",
                               "overview"))
        elif st["failing"]:
            f = st["failing"]
            out.append(Problem(f"channel:{name}", "fail",
                               f"deliveries to {name} fail: "
                               f"{_n(f['failed'], 'message', 'messages')} in the last hour"
                               + (f" ({f['last_error']})" if f["last_error"] else ""),
                               "outbox", f["failed"]))
        elif st["state"] == "needs attention":
            out.append(Problem(f"channel:{name}", "fail", f"{name}: {st['trouble']}",
                               "overview"))
    failed = int(db.scalar("SELECT COUNT(*) FROM outbox WHERE status = 'failed'") or 0)
    if failed:
        out.append(Problem("outbox", "warn", _n(failed, "failed delivery", "failed deliveries"),
                           "outbox", failed))
    turns = failed_turn_groups(db, now=now)
    if turns:
        out.append(Problem("failed_turns", "warn", "repeated failed turns in 24 h: " + ", ".join(
            f"{g} ({n})" for g, n in turns.items()), "groups", sum(turns.values())))
    tasks = task_problems(db)
    if tasks["failing"]:
        n = len(tasks["failing"])
        out.append(Problem("tasks_failing", "warn", f"{_n(n, 'task', 'tasks')} failed on "
                           f"the last run ({', '.join(t['id'] for t in tasks['failing'])})",
                           "tasks", n))
    if tasks["paused_by_mdclaw"]:
        n = len(tasks["paused_by_mdclaw"])
        out.append(Problem("tasks_paused", "warn", f"{_n(n, 'task was', 'tasks were')} paused "
                           "by mdclaw (" + "; ".join(f"{t['id']}: {t['why']}"
                                                     for t in tasks["paused_by_mdclaw"]) + ")",
                           "tasks", n))
    q = quarantined(cfg)
    if q:
        out.append(Problem("quarantine", "warn", _n(q, "command file is", "command files are")
                           + " quarantined", "quarantine", q))
    over = over_budget_today(cfg, db, now=now)
    if over:
        out.append(Problem("budget", "warn", "over the token budget today: " + ", ".join(
            f"{g} ({u} of {b})" for g, (u, b) in over.items()), "usage", len(over)))
    if backup is not None and backup.get("level") not in (None, "ok"):
        out.append(Problem("backup", "warn", str(backup.get("detail")), "overview"))
    out.sort(key=lambda p: p.level != "fail")
    return out


def verdict(problems: Sized) -> str:
    """"healthy", "1 problem", "2 problems"."""
    return "healthy" if not problems else _n(len(problems), "problem", "problems")
