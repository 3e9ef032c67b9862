"""Declarative tasks: `tasks:` in the config reconciled like groups."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from mdclaw import schedule
from mdclaw.config import load_config
from mdclaw.reconcile import ReconcileError, plan, reconcile
from mdclaw.state import Database
from mdclaw.state.tasks import get_task, insert_task, list_tasks, update_task_fields

HEAD = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: Europe/Berlin}
groups:
  main: {name: Admin, jid: "tg:1", main: true}
  family: {name: Family, jid: "tg:2"}
"""

TASKS = HEAD + """\
tasks:
  - id: weather
    group: family
    prompt: Send the weather
    cron: "0 8 * * *"
  - id: backup
    group: main
    prompt: Check the backups
    interval: 1h
    context_mode: group
    timezone: America/New_York
    catch_up: false
"""


def task_kinds(p) -> list[tuple[str, str]]:
    return sorted((a.kind, a.target) for a in p.actions if a.kind.endswith("_task"))


@pytest.fixture
def setup(write_config):
    dbs: list[Database] = []

    def _setup(text: str):
        cfg = load_config(write_config(text))
        if not dbs:
            dbs.append(Database(cfg.db_path))
        return cfg, dbs[0]

    yield _setup
    for d in dbs:
        d.close()


def test_tasks_are_added_then_nothing_planned(setup) -> None:
    cfg, db = setup(TASKS)
    p = reconcile(cfg, db)
    assert task_kinds(p) == [("add_task", "backup"), ("add_task", "weather")]
    w = get_task(db, "weather")
    assert (w.source, w.group_folder, w.chat_jid, w.schedule_type, w.schedule_value) == \
        ("config", "family", "tg:2", "cron", "0 8 * * *")
    assert w.timezone == "Europe/Berlin"  # the assistant's zone, stored
    assert w.context_mode == "isolated" and w.catch_up and w.status == "active"
    nxt = schedule.from_iso(w.next_run)
    assert nxt == schedule.next_cron("0 8 * * *", "Europe/Berlin", schedule.utc_now())
    b = get_task(db, "backup")
    assert (b.schedule_type, b.schedule_value, b.timezone, b.catch_up, b.context_mode) == \
        ("interval", "3600000", "America/New_York", False, "group")
    again = plan(cfg, db)
    assert again.empty, again.actions


def test_runtime_tasks_are_left_alone_and_removed_config_tasks_go(setup) -> None:
    cfg, db = setup(TASKS)
    reconcile(cfg, db)
    with db.transaction() as c:
        insert_task(c, group_folder="family", chat_jid="tg:2", prompt="from the agent",
                    schedule_type="interval", schedule_value="60000", timezone="UTC",
                    task_id="ipc-1")
    cfg2, _ = setup(HEAD)
    p = reconcile(cfg2, db)
    assert task_kinds(p) == [("remove_task", "backup"), ("remove_task", "weather")]
    assert [t.id for t in list_tasks(db)] == ["ipc-1"]
    assert plan(cfg2, db).empty


def test_schedule_change_gets_new_next_run_prompt_change_does_not(setup) -> None:
    cfg, db = setup(TASKS)
    reconcile(cfg, db)
    before = get_task(db, "weather")
    cfg2, _ = setup(TASKS.replace("Send the weather", "Send the forecast"))
    (a,) = plan(cfg2, db).actions
    assert (a.kind, a.target, a.detail["reschedule"]) == ("update_task", "weather", False)
    reconcile(cfg2, db)
    mid = get_task(db, "weather")
    assert mid.prompt == "Send the forecast" and mid.next_run == before.next_run

    cfg3, _ = setup(TASKS.replace("Send the weather", "Send the forecast")
                    .replace('"0 8 * * *"', '"30 6 * * 1-5"'))
    (a,) = plan(cfg3, db).actions
    assert a.detail["reschedule"] is True
    assert a.detail["changes"]["schedule_value"] == {"from": "0 8 * * *", "to": "30 6 * * 1-5"}
    assert "new next_run" in a.describe()
    reconcile(cfg3, db)
    after = get_task(db, "weather")
    assert after.schedule_value == "30 6 * * 1-5"
    assert schedule.from_iso(after.next_run) == schedule.next_cron(
        "30 6 * * 1-5", "Europe/Berlin", schedule.utc_now())
    assert plan(cfg3, db).empty


def test_assistant_timezone_change_reschedules_tasks_that_follow_it(setup) -> None:
    cfg, db = setup(TASKS)
    reconcile(cfg, db)
    cfg2, _ = setup(TASKS.replace("timezone: Europe/Berlin", "timezone: Asia/Tokyo"))
    p = plan(cfg2, db)
    (a,) = p.actions  # backup has its own zone and is not touched
    assert a.target == "weather" and a.detail["changes"]["timezone"]["to"] == "Asia/Tokyo"
    reconcile(cfg2, db)
    w = get_task(db, "weather")
    assert schedule.from_iso(w.next_run) == schedule.next_cron("0 8 * * *", "Asia/Tokyo",
                                                               schedule.utc_now())


def test_paused_config_task_stays_paused(setup) -> None:
    cfg, db = setup(TASKS)
    reconcile(cfg, db)
    with db.transaction() as c:
        update_task_fields(c, "weather", status="paused")
    assert plan(cfg, db).empty
    reconcile(cfg, db)
    assert get_task(db, "weather").status == "paused"


def test_finished_one_shot_with_new_time_is_active_again(setup) -> None:
    at = (schedule.utc_now() + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    later = (schedule.utc_now() + timedelta(days=2)).strftime("%Y-%m-%dT%H:%M:%S")
    text = HEAD + f"""\
tasks:
  - id: remind
    group: main
    prompt: Call the plumber
    once: "{at}"
"""
    cfg, db = setup(text)
    reconcile(cfg, db)
    r = get_task(db, "remind")
    assert r.next_run == schedule.to_iso(schedule.parse_once(at, "Europe/Berlin"))
    with db.transaction() as c:
        update_task_fields(c, "remind", status="completed", next_run=None)
    assert plan(cfg, db).empty  # a finished one-shot is not re-armed by an unchanged config
    cfg2, _ = setup(text.replace(at, later))
    reconcile(cfg2, db)
    r = get_task(db, "remind")
    assert r.status == "active"
    assert r.next_run == schedule.to_iso(schedule.parse_once(later, "Europe/Berlin"))


def test_config_id_taken_by_runtime_task_is_a_conflict(setup) -> None:
    cfg, db = setup(HEAD)
    reconcile(cfg, db)
    with db.transaction() as c:
        insert_task(c, group_folder="family", chat_jid="tg:2", prompt="x",
                    schedule_type="interval", schedule_value="60000", timezone="UTC",
                    task_id="weather")
    cfg2, _ = setup(TASKS)
    p = plan(cfg2, db)
    assert any("task 'weather'" in c and "runtime" in c for c in p.conflicts)
    with pytest.raises(ReconcileError):
        reconcile(cfg2, db)
    assert get_task(db, "weather").source == "ipc"
    assert get_task(db, "backup") is None  # nothing applied


def test_reconcile_cli_plan_lists_task_actions(write_config, cli) -> None:
    path = write_config(TASKS)
    r = cli("reconcile", "--dry-run", "--json", "--config", str(path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    kinds = sorted((a["kind"], a["target"]) for a in out["actions"] if "task" in a["kind"])
    assert kinds == [("add_task", "backup"), ("add_task", "weather")]
    r = cli("reconcile", "--config", str(path))
    assert r.returncode == 0 and "add task weather" in r.stdout
    r = cli("reconcile", "--config", str(path))
    assert "nothing to do" in r.stdout


def test_unquoted_once_time_in_yaml_is_read_in_task_timezone(setup) -> None:
    year = schedule.utc_now().year + 1
    cfg, db = setup(HEAD + f"""\
tasks:
  - id: remind
    group: main
    prompt: Call the plumber
    once: {year}-07-01T17:00:00
    timezone: America/New_York
  - id: remind-utc
    group: main
    prompt: Call the plumber
    once: {year}-07-01T17:00:00Z
""")
    reconcile(cfg, db)
    assert get_task(db, "remind").next_run == f"{year}-07-01T21:00:00.000Z"
    assert get_task(db, "remind-utc").next_run == f"{year}-07-01T17:00:00.000Z"
    assert plan(cfg, db).empty


def test_one_shot_that_ran_keeps_the_config_valid_but_a_new_past_one_is_refused(setup) -> None:
    soon = (schedule.utc_now() + timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    text = HEAD + f"tasks:\n  - {{id: remind, group: main, prompt: hi, once: '{soon}'}}\n"
    cfg, db = setup(text)
    reconcile(cfg, db)
    assert get_task(db, "remind").status == "active"
    with db.transaction() as c:  # the scheduler ran it
        update_task_fields(c, "remind", status="completed", next_run=None)
    import time
    time.sleep(2.1)
    cfg, db = setup(text)  # the time is past now: the config still loads
    assert plan(cfg, db).empty
    past = HEAD + "tasks:\n  - {id: late, group: main, prompt: hi, once: '2020-01-01T08:00:00'}\n"
    cfg, db = setup(past)
    p = plan(cfg, db)
    assert any("task 'late'" in c and "in the past" in c and "remove it" in c
               for c in p.conflicts), p.conflicts
    with pytest.raises(ReconcileError):
        reconcile(cfg, db)
    assert get_task(db, "late") is None
