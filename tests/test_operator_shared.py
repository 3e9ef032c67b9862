"""The CLI's side of what the operator page changes (one definition each): `outbox retry`,
`outbox drop`, `ipc delete-error`, `usage --by-day`; the quarantine's payload reader; the QR
code a channel waiting to be linked shows."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from mdclaw.config import load_config
from mdclaw.ipc.quarantine import QuarantineError, delete_error, read_error_payload
from mdclaw.operator.views import channel_info
from mdclaw.paths import Layout
from mdclaw.reconcile import reconcile
from mdclaw.state import Database
from mdclaw.state.outbox import enqueue
from mdclaw.usage import record_usage


@pytest.fixture
def env(write_config):
    path = write_config()
    cfg = load_config(path)
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    yield str(path), cfg, db
    db.close()


def test_outbox_retry_and_drop_only_failed_rows(env, cli) -> None:
    path, _cfg, db = env
    with db.transaction() as c:
        failed = enqueue(c, chat_jid="tg:1", kind="text", text="hi", source_group="main")
        c.execute("UPDATE outbox SET status='failed', attempts=5, last_error='x' WHERE id=?",
                  (failed,))
        pending = enqueue(c, chat_jid="tg:1", kind="text", text="later", source_group="main")
    r = cli("outbox", "retry", str(pending), "--config", path)
    assert r.returncode == 1 and "not failed" in r.stderr
    r = cli("outbox", "retry", str(failed), "--json", "--config", path)
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["status"] == "pending" and row["attempts"] == 0
    r = cli("outbox", "drop", str(failed), "--config", path)
    assert r.returncode == 1 and "not failed" in r.stderr
    with db.transaction() as c:
        c.execute("UPDATE outbox SET status='failed' WHERE id=?", (failed,))
    r = cli("outbox", "drop", str(failed), "--config", path)
    assert r.returncode == 0 and "dropped" in r.stdout
    assert db.query_one("SELECT id FROM outbox WHERE id=?", (failed,)) is None
    assert cli("outbox", "drop", "999", "--config", path).returncode == 1


def quarantine(cfg, name: str, payload: bytes) -> Path:
    errors = Layout(cfg.data_dir).errors_dir
    errors.mkdir(parents=True, exist_ok=True)
    (errors / f"{name}.error").write_bytes(payload)
    (errors / f"{name}.error.json").write_text(json.dumps({
        "original_file": "messages/x.json", "source_group": "family", "error": "bad JSON",
        "processed_at": "2026-01-01T00:00:00.000Z"}))
    return errors


def test_delete_error_and_read_payload(env, cli, tmp_path: Path) -> None:
    path, cfg, _db = env
    errors = quarantine(cfg, "family.messages.x.json", b"<b>hi</b>" + b"x" * 100)
    assert read_error_payload(errors, "family.messages.x.json.error", 9) == ("<b>hi</b>", True)
    assert read_error_payload(errors, "family.messages.x.json.error")[1] is False
    # a payload swapped for a link to a host file is not read through
    secret = tmp_path / "host-secret"
    secret.write_text("host secret")
    os.unlink(errors / "family.messages.x.json.error")
    os.symlink(secret, errors / "family.messages.x.json.error")
    assert read_error_payload(errors, "family.messages.x.json.error") == ("", False)
    for bad in ("../x.error", "x.error.json", "x", "a/b.error"):
        with pytest.raises(QuarantineError):
            delete_error(errors, bad)
    r = cli("ipc", "delete-error", "../../state.db.error", "--config", path)
    assert r.returncode == 1
    r = cli("ipc", "delete-error", "family.messages.x.json.error", "--config", path)
    assert r.returncode == 0, r.stderr
    assert secret.read_text() == "host secret" and os.listdir(errors) == []
    assert cli("ipc", "delete-error", "family.messages.x.json.error",
               "--config", path).returncode == 1


def test_usage_by_day(env, cli) -> None:
    path, _cfg, db = env
    record_usage(db, "family", "m1", ok=True, input_tokens=10, output_tokens=5,
                 when="2026-01-01T10:00:00.000Z")
    record_usage(db, "family", "m2", ok=False, input_tokens=1, output_tokens=0,
                 when="2026-01-01T11:00:00.000Z")
    record_usage(db, "family", "m1", ok=True, input_tokens=7, output_tokens=3,
                 when="2026-01-02T10:00:00.000Z")
    r = cli("usage", "--by-day", "--json", "--config", path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [
        {"group_folder": "family", "day": "2026-01-01", "requests": 2, "errors": 1,
         "input_tokens": 11, "output_tokens": 5},
        {"group_folder": "family", "day": "2026-01-02", "requests": 1, "errors": 0,
         "input_tokens": 7, "output_tokens": 3}]


class _Unlinked:
    name = "whatsapp"

    def status_info(self) -> dict:
        return {"connected": False, "link_state": "unlinked", "qr": "2@abc,def,ghi"}

    def redact(self, text: str) -> str:
        return text


def test_a_channel_waiting_to_be_linked_shows_its_qr_as_svg() -> None:
    info = channel_info(_Unlinked())
    assert info["link_state"] == "unlinked" and info["name"] == "whatsapp"
    head = "data:image/svg+xml;base64,"
    assert info["qr_svg"].startswith(head)
    svg = base64.b64decode(info["qr_svg"][len(head):]).decode()
    assert svg.startswith("<svg") and "<script" not in svg


@pytest.mark.parametrize(("kind", "value", "status", "run_under_way"), [
    ("cron", "0 9 * * *", "active", False), ("cron", "0 9 * * *", "active", True),
    ("cron", "0 9 * * *", "paused", False), ("cron", "0 9 * * *", "completed", False),
    ("interval", "3600000", "paused", False), ("interval", "3600000", "active", True),
    ("once", "2099-01-01T09:00:00", "active", False),
    ("once", "2099-01-01T09:00:00", "running", True),
    ("once", "2099-01-01T09:00:00", "completed", False),
])
def test_one_rule_decides_which_task_changes_are_offered_and_made(
        env, kind, value, status, run_under_way) -> None:
    """`mdclaw.state.tasks.change_refusal` is the one rule: the operator page's buttons
    (`changes_allowed`) are exactly the changes `mdclaw tasks <action>` makes; each one it
    leaves out is refused with the rule's own reason, or does nothing."""
    from mdclaw.operator.views import tasks as task_rows
    from mdclaw.ops.tasks import TASK_ACTIONS, change_task
    from mdclaw.schedule import utc_now
    from mdclaw.state.tasks import (
        TASK_CHANGES,
        TaskError,
        change_refusal,
        changes_allowed,
        get_task,
        insert_run,
        insert_task,
        running_run_id,
        update_task_fields,
    )

    assert tuple(TASK_ACTIONS) == TASK_CHANGES  # the CLI's actions are the state's changes
    _path, cfg, db = env
    for n, action in enumerate(TASK_CHANGES):
        tid = f"t{n}"
        with db.transaction() as c:
            insert_task(c, group_folder="main", chat_jid="tg:1", prompt="p",
                        schedule_type=kind, schedule_value=value, timezone="UTC",
                        task_id=tid)
            update_task_fields(c, tid, status=status)
            if run_under_way:
                insert_run(c, tid, utc_now())
        t = get_task(db, tid)
        assert t is not None
        running = running_run_id(db, tid) is not None
        assert running == run_under_way
        offered = changes_allowed(t, run_in_progress=running)
        why = change_refusal(t, action, run_in_progress=running)
        page = next(r for r in task_rows(SimpleNamespace(db=db, cfg=cfg))
                    if r["id"] == tid)
        assert page["actions"] == offered  # the page asks the same rule
        try:
            before, after = change_task(cfg, db, tid, action)
            changed = (before.status, before.next_run) != (after.status, after.next_run)
            assert why is None, (action, status, kind)
        except TaskError as e:
            assert str(e) == why, (action, status, kind)
            changed = False
        assert (action in offered) == changed, (action, status, kind, run_under_way)
