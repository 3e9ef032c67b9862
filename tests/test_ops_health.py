"""mdclaw.ops.health, the one list of problems `mdclaw status`, `mdclaw doctor` and the
operator page show, against a real SQLite database and quarantine folder; the bulk changes
the page makes through ops (outbox, tasks, quarantine); the words people read."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

from mdclaw.config import load_config
from mdclaw.ipc.quarantine import META_SUFFIX, PAYLOAD_SUFFIX, count_errors
from mdclaw.ops.health import (
    channel_state,
    channel_states,
    delivery_failures,
    failed_turn_groups,
    find_problems,
    for_people,
    over_budget_today,
    task_problems,
    verdict,
)
from mdclaw.ops.outbox import change_outbox_rows
from mdclaw.ops.quarantine import delete_many
from mdclaw.ops.tasks import change_tasks, schedule_text
from mdclaw.paths import Layout
from mdclaw.schedule import to_iso, utc_now
from mdclaw.state import Database
from mdclaw.state.failed_turns import record_failed_turn
from mdclaw.state.outbox import enqueue, outbox_counts, recent_outbox_counts
from mdclaw.state.tasks import finish_run, insert_run, list_tasks
from mdclaw.usage import daily_usage, record_usage

CONFIG = """\
data_dir: {data_dir}
models:
  sonnet: {backend: claude, model: claude-sonnet-4-5, api_key_file: /nonexistent/key}
groups:
  main: {name: A, jid: "hl:main", main: true}
  family: {name: F, jid: "tg:42", tokens_per_day: 1000}
tasks:
  - {id: broken, group: main, prompt: p, cron: "0 8 * * *"}
  - {id: fine, group: main, prompt: p, interval: 1h}
  - {id: resting, group: family, prompt: p, interval: 30m}
channels: {http: {enabled: false}}
"""


@pytest.fixture
def setup(write_config):
    cfg = load_config(write_config(CONFIG))
    db = Database(cfg.db_path)
    from mdclaw.reconcile import reconcile

    reconcile(cfg, db)
    yield cfg, db
    db.close()


def row(db: Database, jid: str, status: str, *, minutes_ago: float, error: str | None = None,
        attempts: int = 5) -> int:
    """An outbox row to `jid` in `status`, last changed `minutes_ago`."""
    stamp = to_iso(utc_now() - timedelta(minutes=minutes_ago))
    with db.transaction() as c:
        rid = enqueue(c, chat_jid=jid, kind="text", text="hi", source_group="main")
        c.execute("UPDATE outbox SET status = ?, last_error = ?, attempts = ?, updated_at = ?, "
                  "sent_at = ? WHERE id = ?", (status, error, attempts, stamp,
                                               stamp if status == "sent" else None, rid))
    return rid


def quarantine_file(cfg, name: str) -> None:
    errors = Layout(cfg.data_dir).errors_dir
    errors.mkdir(parents=True, exist_ok=True)
    (errors / f"{name}{META_SUFFIX}").write_text(json.dumps({
        "original_file": "messages/x.json", "source_group": "main", "error": "not allowed",
        "processed_at": to_iso(utc_now())}))
    (errors / f"{name}{PAYLOAD_SUFFIX}").write_text("{}")


@pytest.mark.parametrize(("text", "shown"), [
    ("RunFailed: the container exited 1", "the container exited 1"),
    ("error: RunFailed: the container exited 1", "error: the container exited 1"),
    ("IMAP 127.0.0.1:993: ConnectionRefusedError: [Errno 111] Connection refused",
     "IMAP 127.0.0.1:993: [Errno 111] Connection refused"),
    ("mdclaw.launch.RunFailed: no model", "no model"),
    ("ConnectionResetError", "connection reset"),
    ("chat not found (HTTP 400)", "chat not found (HTTP 400)"),
    ("Failed: to deliver", "Failed: to deliver"),
    ("a KeyError happened in the agent", "a KeyError happened in the agent"),
    (None, None), ("", ""),
])
def test_for_people_takes_exception_names_out(text, shown) -> None:
    assert for_people(text) == shown


def test_a_channel_whose_deliveries_fail_is_not_connected(setup) -> None:
    cfg, db = setup
    assert delivery_failures(db) == {}
    old = row(db, "tg:42", "failed", minutes_ago=120, error="too old to count")
    assert delivery_failures(db) == {}  # outside the hour
    row(db, "tg:42", "sent", minutes_ago=30)  # sent before the failure: clears nothing
    row(db, "tg:42", "failed", minutes_ago=10, error="ChannelError: chat not found")
    row(db, "hl:main", "sent", minutes_ago=5)  # another channel's success changes nothing
    got = delivery_failures(db)
    assert set(got) == {"telegram"}
    assert got["telegram"]["failed"] == 1 and got["telegram"]["last_error"] == "chat not found"
    states = channel_states(db, {"telegram": True, "http": True},
                            {"telegram": "tg:", "http": "hl:"})
    assert states["telegram"]["state"] == "deliveries failing"
    assert states["http"]["state"] == "connected"
    # a row being tried again after an error fails too
    row(db, "tg:42", "pending", minutes_ago=2, error="timed out", attempts=2)
    got = delivery_failures(db)["telegram"]
    assert got["failed"] == 2 and got["last_error"] == "timed out"  # the newest error
    assert got["since"] == db.scalar("SELECT updated_at FROM outbox WHERE last_error = "
                                     "'ChannelError: chat not found'")  # from the oldest
    # a delivery sent after them: the channel works again
    row(db, "tg:42", "sent", minutes_ago=1)
    assert delivery_failures(db) == {}
    assert old  # the old failed row is still counted by the outbox's own problem
    assert [p.key for p in find_problems(cfg, db, disk=None)] == ["outbox"]


def test_the_daemons_counts_are_of_open_and_failed_rows_and_a_days_sends(setup) -> None:
    """What the daemon publishes every 5 s counts the rows sent in the last day, not every
    row ever sent (a walk of them all at each look); `outbox_counts` still counts all."""
    _cfg, db = setup
    row(db, "tg:42", "pending", minutes_ago=1)
    row(db, "tg:42", "sending", minutes_ago=1)
    row(db, "tg:42", "failed", minutes_ago=60 * 24 * 30)  # failed a month ago: still failed
    row(db, "tg:42", "sent", minutes_ago=5)
    row(db, "tg:42", "sent", minutes_ago=60 * 23)
    row(db, "tg:42", "sent", minutes_ago=60 * 25)  # before the day
    assert recent_outbox_counts(db) == {"pending": 1, "sending": 1, "failed": 1, "sent_24h": 2}
    assert outbox_counts(db) == {"pending": 1, "sending": 1, "failed": 1, "sent": 3}
    later = utc_now() + timedelta(hours=2)
    assert recent_outbox_counts(db, now=later)["sent_24h"] == 1


def test_channel_state_rule() -> None:
    assert channel_state(True, None) == "connected"
    assert channel_state(True, {"failed": 1}) == "deliveries failing"
    assert channel_state(True, None, "check the server") == "needs attention"
    assert channel_state(False, {"failed": 1}, "x") == "not connected"


def test_find_problems_names_each_with_its_view(setup) -> None:
    cfg, db = setup
    assert find_problems(cfg, db, disk=None) == [] and verdict([]) == "healthy"
    row(db, "tg:42", "failed", minutes_ago=3, error="blocked")
    now = utc_now()
    with db.transaction() as c:
        run = insert_run(c, "broken", now - timedelta(minutes=2))
        finish_run(c, run, "error", now, error="RunFailed: boom")
        run = insert_run(c, "fine", now - timedelta(minutes=2))
        finish_run(c, run, "success", now, result="ok")
        # the operator paused one (not a problem); mdclaw paused another (a problem)
        c.execute("UPDATE scheduled_tasks SET status = 'paused' WHERE id = 'resting'")
        for cause in ("oom_killed",) * 3:
            record_failed_turn(c, group_folder="family", chat_jid="tg:42", cause=cause,
                               policy="transient", outcome="retry", detail="x")
    record_usage(db, "family", "m", ok=True, input_tokens=900, output_tokens=200)
    quarantine_file(cfg, "main-messages-x-1")
    problems = find_problems(cfg, db, disk={"free": 10, "total": 100, "floor": 50,
                                            "host_ok": False, "groups": {}},
                             channels={"telegram": True}, engine="ok (Podman 5)",
                             backup={"level": "ok"})
    got = {p.key: (p.level, p.view, p.count) for p in problems}
    assert got == {
        "disk": ("fail", "overview", 1),
        "channel:telegram": ("fail", "outbox", 1),
        "outbox": ("warn", "outbox", 1),
        "failed_turns": ("warn", "groups", 3),
        "tasks_failing": ("warn", "tasks", 1),
        "quarantine": ("warn", "quarantine", 1),
        "budget": ("warn", "usage", 1),
    }
    assert [p.level for p in problems][:2] == ["fail", "fail"]  # worst first
    assert verdict(problems) == "7 problems"
    texts = " | ".join(p.text for p in problems)
    assert "broken" in texts and "family (1100 of 1000)" in texts and "RunFailed" not in texts
    assert failed_turn_groups(db) == {"family": 3}
    assert over_budget_today(cfg, db) == {"family": (1100, 1000)}
    tasks = task_problems(db)
    assert [t["id"] for t in tasks["paused"]] == ["resting"] and not tasks["paused_by_mdclaw"]
    with db.transaction() as c:
        c.execute("UPDATE scheduled_tasks SET last_result = 'paused: bad schedule: x' "
                  "WHERE id = 'resting'")
    assert "tasks_paused" in {p.key for p in find_problems(cfg, db, disk=None)}
    # the running daemon's word: a channel down, the engine, a refused reload
    more = {p.key for p in find_problems(cfg, db, disk=None, channels={"telegram": False},
                                         engine="container engine unreachable",
                                         reload_error="bad key")}
    assert {"channel:telegram", "engine", "reload"} <= more


def test_bulk_changes_go_through_ops_one_by_one(setup) -> None:
    cfg, db = setup
    failed = [row(db, "tg:42", "failed", minutes_ago=1, error="x") for _ in range(2)]
    pending = row(db, "tg:42", "pending", minutes_ago=1)
    got = change_outbox_rows(db, [*failed, pending, 999, failed[0]], "retry")
    assert got["done"] == failed
    assert set(got["refused"]) == {pending, 999}
    assert "not failed" in got["refused"][pending]
    assert {r[0] for r in db.query("SELECT status FROM outbox")} == {"pending"}
    row_id = row(db, "tg:42", "failed", minutes_ago=1)
    assert change_outbox_rows(db, [row_id], "drop") == {"done": [row_id], "refused": {}}
    assert db.scalar("SELECT COUNT(*) FROM outbox WHERE id = ?", (row_id,)) == 0

    got = change_tasks(cfg, db, ["broken", "fine", "nope"], "pause")
    assert got["done"] == ["broken", "fine"] and "nope" in got["refused"]
    assert {t.id: t.status for t in list_tasks(db)}["fine"] == "paused"

    quarantine_file(cfg, "main-messages-a-1")
    quarantine_file(cfg, "main-messages-b-2")
    errors = Layout(cfg.data_dir).errors_dir
    assert count_errors(errors) == 2
    got = delete_many(cfg, ["main-messages-a-1.error", "main-messages-b-2.error",
                            "main-messages-c-3.error", "../escape"])
    assert got["deleted"] == ["main-messages-a-1.error", "main-messages-b-2.error"]
    assert got["refused"]["main-messages-c-3.error"] == "not found"
    assert "../escape" in got["refused"]
    assert count_errors(errors) == 0 and count_errors(Path("/nonexistent")) == 0


def test_schedules_and_usage_for_people(setup) -> None:
    _cfg, db = setup
    assert schedule_text("interval", "3600000") == "every 1 h"
    assert schedule_text("interval", "1800000") == "every 30 min"
    assert schedule_text("interval", "86400000") == "every 1 d"
    assert schedule_text("interval", "90000") == "every 90 s"
    assert schedule_text("cron", "0 8 * * *") == "cron 0 8 * * *"
    record_usage(db, "main", "a", ok=True, input_tokens=10, output_tokens=1)
    record_usage(db, "main", "b", ok=True, input_tokens=20, output_tokens=2)
    assert [(r["model"], r["input_tokens"]) for r in daily_usage(db, by_model=True)] == [
        ("a", 10), ("b", 20)]
    assert [r["input_tokens"] for r in daily_usage(db)] == [30]


def test_status_and_doctor_say_the_same(setup, cli, write_config, monkeypatch) -> None:
    cfg, db = setup
    row(db, "tg:42", "failed", minutes_ago=3, error="ChannelError: blocked")
    quarantine_file(cfg, "main-messages-x-1")
    path = str(write_config(CONFIG))
    s = json.loads(cli("status", "--json", "--config", path).stdout)
    keys = {p["key"] for p in s["problems"]}
    assert keys == {"channel:telegram", "outbox", "quarantine"}, s["problems"]
    human = cli("status", "--config", path).stdout
    assert "health: 3 problems" in human and "(operator page: #quarantine)" in human
    assert "ChannelError" not in human

    from test_status_doctor import _doctor

    c = _doctor(write_config, monkeypatch, CONFIG)
    assert c["deliveries"]["level"] == "warn" and "deliveries to telegram fail" in \
        c["deliveries"]["detail"]
    assert c["outbox"]["level"] == "warn" and c["quarantine"]["level"] == "warn"
    assert c["tasks"]["level"] == "ok" and c["budget today"]["level"] == "ok"


def test_the_outbox_view_keeps_old_failed_rows_beside_many_newer_ones(setup) -> None:
    """The page filters what it was sent: every failed row is in it even when 600 newer
    deliveries were sent since."""
    from types import SimpleNamespace

    from mdclaw.operator.views import outbox

    cfg, db = setup
    old = row(db, "tg:42", "failed", minutes_ago=600, error="RunFailed: long ago")
    for _ in range(600):
        row(db, "tg:42", "sent", minutes_ago=1)
    got = outbox(SimpleNamespace(db=db, channels=[], cfg=cfg))  # type: ignore[arg-type]
    failed = [r for r in got["rows"] if r["status"] == "failed"]
    assert [r["id"] for r in failed] == [old] and failed[0]["last_error"] == "long ago"
    assert len(got["rows"]) == 501 and got["counts"]["sent_24h"] == 600


def test_groups_without_a_model_are_a_problem(write_config) -> None:
    """An install where no model resolves for a group is not "healthy": the group answers
    every message with the setup message. The problem names the groups and links to the
    groups view; doctor's models check fails for the same groups."""
    cfg = load_config(write_config(
        "data_dir: {data_dir}\n"
        "models:\n"
        "  a: {backend: openai, base_url: 'http://127.0.0.1:9/v1', model: m}\n"
        "  b: {backend: openai, base_url: 'http://127.0.0.1:9/v1', model: m}\n"
        "groups:\n"
        "  main: {name: A, jid: 'hl:main', main: true}\n"
        "  family: {name: F, jid: 'tg:42', model: b}\n"
        "channels: {http: {enabled: false}}\n"))
    db = Database(cfg.db_path)
    try:
        problems = find_problems(cfg, db, disk=None)
        assert [(p.key, p.level, p.view, p.count) for p in problems] == [
            ("models", "fail", "groups", 1)]
        assert "(main)" in problems[0].text and "family" not in problems[0].text
        assert verdict(problems) == "1 problem"
    finally:
        db.close()
