"""Applying commands: state changes, the ledger, quarantine format and caps, snapshots,
ordering, actions and the host -> container writers. Real files, real SQLite."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sqlite3
import stat
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from ipc_helpers import FAMILY_JID, MAIN_JID, WORK_JID, Env, schedule_body
from mdclaw.agentfs import UnsafePath, generation
from mdclaw.ipc.actions import MEMORY_MAX_FILES
from mdclaw.ipc.apply import IpcEngine
from mdclaw.ipc.writers import write_close, write_follow_up, write_snapshots
from mdclaw.schedule import from_iso
from mdclaw.state import Database
from mdclaw.state.tasks import delete_task, insert_task
from schema_at import database_at


@pytest.fixture
def env(tmp_path: Path):  # noqa: ANN201
    e = Env(tmp_path)
    yield e
    e.close()


def apply_one(env: Env, group: str, body: dict, sub: str = "tasks") -> dict | None:
    """Write and drain one command; returns its quarantine record (None if applied)."""
    name = env.write(group, body, sub=sub)
    env.drain()
    assert not (env.ipc / group / sub / name).exists()
    return env.errors_for(group, name)


# --------------------------------------------------------------------------- tasks

def test_schedule_cron_in_configured_timezone(env: Env) -> None:
    assert apply_one(env, "family", schedule_body("t1", context_mode="isolated")) is None
    t = env.task("t1")
    assert (t["group_folder"], t["chat_jid"], t["status"], t["source"]) == (
        "family", FAMILY_JID, "active", "ipc")
    assert t["context_mode"] == "isolated" and t["timezone"] is None
    nxt = from_iso(t["next_run"]).astimezone(ZoneInfo("Europe/Berlin"))
    assert (nxt.hour, nxt.minute) == (8, 0)
    assert from_iso(t["next_run"]) > datetime.now(UTC)
    # the task's own timezone wins
    assert apply_one(env, "family", schedule_body("t2", timezone="America/New_York")) is None
    ny = from_iso(env.task("t2")["next_run"]).astimezone(ZoneInfo("America/New_York"))
    assert (ny.hour, env.task("t2")["timezone"]) == (8, "America/New_York")


def test_schedule_interval_and_once(env: Env) -> None:
    before = datetime.now(UTC)
    assert apply_one(env, "family", schedule_body("i1", schedule_type="interval",
                                                  schedule_value=3600000)) is None
    delta = from_iso(env.task("i1")["next_run"]) - before
    assert timedelta(minutes=59) < delta < timedelta(minutes=61)
    at = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    assert apply_one(env, "family", schedule_body("o1", schedule_type="once",
                                                  schedule_value=at.isoformat())) is None
    assert from_iso(env.task("o1")["next_run"]) == at


@pytest.mark.parametrize("body, reason", [
    (schedule_body("b1", schedule_value="61 * * * *"), "not valid"),
    (schedule_body("b2", schedule_value="* * *"), "five are needed"),
    (schedule_body("b3", schedule_type="interval", schedule_value="10"), "too short"),
    (schedule_body("b4", schedule_type="once", schedule_value="2001-01-01T00:00:00Z"), "past"),
    (schedule_body("b5", schedule_type="once", schedule_value="tomorrow"), "ISO-8601"),
    (schedule_body("b6", timezone="Mars/Olympus"), "unknown timezone"),
])
def test_bad_schedules_are_quarantined(env: Env, body: dict, reason: str) -> None:
    meta = apply_one(env, "family", body)
    assert meta is not None and reason in meta["error"]
    assert env.tasks() == []


def test_caller_chosen_task_id_duplicate_rejected(env: Env) -> None:
    assert apply_one(env, "family", schedule_body("dup")) is None
    meta = apply_one(env, "family", schedule_body("dup", prompt="other"))
    assert meta and "already exists" in meta["error"]
    assert env.task("dup")["prompt"] == "water the plants"


def test_task_lifecycle(env: Env) -> None:
    apply_one(env, "family", schedule_body("t", schedule_type="interval",
                                           schedule_value="60000"))
    assert apply_one(env, "family", {"type": "pause_task", "taskId": "t"}) is None
    assert env.task("t")["status"] == "paused"
    # resume after the next_run has passed computes a fresh one
    env.db.conn.execute("UPDATE scheduled_tasks SET next_run = '2001-01-01T00:00:00.000Z'")
    assert apply_one(env, "family", {"type": "resume_task", "taskId": "t"}) is None
    t = env.task("t")
    assert t["status"] == "active" and from_iso(t["next_run"]) > datetime.now(UTC)
    assert apply_one(env, "family", {"type": "update_task", "taskId": "t", "updates": {
        "schedule_type": "cron", "schedule_value": "30 6 * * *", "prompt": "new"}}) is None
    t = env.task("t")
    assert (t["schedule_type"], t["schedule_value"], t["prompt"]) == ("cron", "30 6 * * *",
                                                                      "new")
    assert from_iso(t["next_run"]).astimezone(ZoneInfo("Europe/Berlin")).hour == 6
    meta = apply_one(env, "family", {"type": "update_task", "taskId": "t",
                                     "updates": {"schedule_value": "bogus"}})
    assert meta and "cron expression" in meta["error"]
    assert env.task("t")["schedule_value"] == "30 6 * * *"  # rolled back alone
    assert apply_one(env, "family", {"type": "cancel_task", "taskId": "t"}) is None
    t = env.task("t")
    assert t["status"] == "completed" and t["next_run"] is None
    meta = apply_one(env, "family", {"type": "resume_task", "taskId": "t"})
    assert meta and "completed" in meta["error"]
    assert apply_one(env, "family", {"type": "delete_task", "taskId": "t"}) is None
    assert env.task("t") is None
    meta = apply_one(env, "family", {"type": "pause_task", "taskId": "t"})
    assert meta and "no task 't'" in meta["error"]


def test_agent_task_changes_follow_the_same_rule_as_the_cli(env: Env) -> None:
    """A one-shot task whose run is under way ('running') can be neither paused nor
    resumed, by an agent as by `mdclaw tasks`; cancelling a finished task changes nothing
    and is not an error; a finished task cannot be updated."""
    from mdclaw.state.tasks import change_refusal, get_task

    apply_one(env, "family", schedule_body("r"))
    env.db.conn.execute("UPDATE scheduled_tasks SET status = 'running' WHERE id = 'r'")
    row = get_task(env.db, "r")
    assert row is not None
    for kind, change in (("pause_task", "pause"), ("resume_task", "resume")):
        meta = apply_one(env, "family", {"type": kind, "taskId": "r"})
        why = change_refusal(row, change)
        assert why is not None and meta and why in meta["error"], (kind, meta)
        assert env.task("r")["status"] == "running"
    meta = apply_one(env, "family", {"type": "update_task", "taskId": "r",
                                     "updates": {"status": "paused"}})
    assert meta and "only an active task can be paused" in meta["error"]
    assert env.task("r")["status"] == "running"
    assert apply_one(env, "family", {"type": "cancel_task", "taskId": "r"}) is None
    assert env.task("r")["status"] == "completed"
    assert apply_one(env, "family", {"type": "cancel_task", "taskId": "r"}) is None
    meta = apply_one(env, "family", {"type": "update_task", "taskId": "r",
                                     "updates": {"prompt": "again"}})
    assert meta and "completed" in meta["error"]


def test_update_task_status_is_the_same_pause_and_resume(env: Env) -> None:
    """update_task's `status` pauses and resumes as pause_task and resume_task do: a resume
    after the next run has passed computes a fresh one instead of firing at once."""
    apply_one(env, "family", schedule_body("u", schedule_type="interval",
                                           schedule_value="60000"))
    assert apply_one(env, "family", {"type": "update_task", "taskId": "u",
                                     "updates": {"status": "paused"}}) is None
    assert env.task("u")["status"] == "paused"
    env.db.conn.execute("UPDATE scheduled_tasks SET next_run = '2001-01-01T00:00:00.000Z'")
    assert apply_one(env, "family", {"type": "update_task", "taskId": "u",
                                     "updates": {"status": "active", "prompt": "p2"}}) is None
    t = env.task("u")
    assert (t["status"], t["prompt"]) == ("active", "p2")
    assert from_iso(t["next_run"]) > datetime.now(UTC)


# --------------------------------------------------------------------------- outbound

def test_the_tasks_fingerprint_is_one_read_that_moves_with_every_change(env: Env) -> None:
    """The poll tick's look at whether the tasks changed (their snapshots are written again
    then) is a count the triggers keep (migration 20): it moves on an insert, on an update
    even when `updated_at` is left as it was, and on a delete, made by any connection; it
    stays put otherwise; and it reads one row however many tasks were ever made."""
    eng = env.engine
    other = Database(env.cfg.db_path)  # another process's connection (the CLI's)
    try:
        seen = [eng.state_fingerprint()[0]]

        def moved() -> bool:
            now = eng.state_fingerprint()[0]
            if now == seen[-1]:
                return False
            seen.append(now)
            return True

        assert not moved()
        with other.transaction() as c:
            insert_task(c, group_folder="main", chat_jid=MAIN_JID, prompt="p",
                        schedule_type="cron", schedule_value="0 9 * * *", timezone="UTC",
                        task_id="t1")
        assert moved()
        with other.transaction() as c:  # a change that leaves updated_at as it was
            c.execute("UPDATE scheduled_tasks SET prompt = 'q' WHERE id = 't1'")
        assert moved()
        with env.db.transaction() as c:
            delete_task(c, "t1")
        assert moved()
        assert not moved()
    finally:
        other.close()
    plan = [r[3] for r in env.db.conn.execute(
        "EXPLAIN QUERY PLAN SELECT n FROM change_counts WHERE name = 'scheduled_tasks'")]
    assert plan == ["SEARCH change_counts USING PRIMARY KEY (name=?)"]


def test_message_and_react_go_to_the_outbox(env: Env) -> None:
    apply_one(env, "family", {"type": "send_message", "chatJid": FAMILY_JID, "message": "hi",
                              "groupFolder": "family"}, sub="messages")
    apply_one(env, "family", {"type": "message", "text": "yo", "sender": "Bot",
                              "replyTo": "m7"}, sub="messages")
    apply_one(env, "main", {"type": "react", "chatJid": WORK_JID, "messageId": "m1",
                            "emoji": "👍"}, sub="messages")
    rows = env.outbox()
    assert [(r["chat_jid"], r["kind"], r["text"], r["source_group"], r["status"])
            for r in rows] == [(FAMILY_JID, "text", "hi", "family", "pending"),
                               (FAMILY_JID, "text", "yo", "family", "pending"),
                               (WORK_JID, "reaction", None, "main", "pending")]
    assert (rows[1]["sender"], rows[1]["reply_to"]) == ("Bot", "m7")
    assert (rows[2]["message_id"], rows[2]["emoji"]) == ("m1", "👍")


def test_send_file_is_copied_to_a_host_spool(env: Env, tmp_path: Path) -> None:
    out = env.data / "groups" / "family" / "out"
    out.mkdir()
    (out / "chart.png").write_bytes(b"PNG" * 1000)
    assert apply_one(env, "family", {"type": "send_file", "filePath": "/workspace/group/out/"
                                     "chart.png", "caption": "here"}, sub="messages") is None
    assert apply_one(env, "family", {"type": "send_file", "filePath": "out/chart.png",
                                     "fileName": "renamed.png"}, sub="messages") is None
    rows = env.outbox()
    assert [(r["kind"], r["file_name"], r["text"]) for r in rows] == [
        ("file", "chart.png", "here"), ("file", "renamed.png", None)]
    copy = Path(rows[0]["file_path"])
    assert copy.is_relative_to(env.data / "spool") and copy.read_bytes() == b"PNG" * 1000
    (out / "chart.png").write_bytes(b"changed")  # the agent changing it later changes nothing
    assert copy.read_bytes() == b"PNG" * 1000
    # refusals: escaping, symlinks, oversized, missing
    os.symlink(tmp_path / "config.yaml", out / "link.png")
    with open(out / "big.bin", "wb") as f:
        f.truncate(64 * 1024 * 1024 + 1)
    for path, why in [("/workspace/group/../main/x", "'..'"), ("out/link.png", "symlink"),
                      ("out/big.bin", "too large"), ("out/none.png", "does not exist"),
                      ("/workspace/ipc/tasks/x.json", "outside")]:
        meta = apply_one(env, "family", {"type": "send_file", "filePath": path},
                         sub="messages")
        assert meta and why in meta["error"], (path, meta)
    assert len(env.outbox()) == 2


def test_send_file_reads_only_the_mounts_the_container_really_has(tmp_path: Path) -> None:
    """One mount policy: send_file resolves /workspace/extra/... through the same decisions
    the runner mounts by, so a mount the policy refused is not readable through it."""
    photos = tmp_path / "roots" / "photos"
    photos.mkdir(parents=True)
    (photos / "cat.jpg").write_bytes(b"JPEG")
    keys = tmp_path / "roots" / "keys"
    keys.mkdir()
    (keys / "id_rsa").write_bytes(b"PRIVATE KEY")
    e = Env(tmp_path, extra=f"""
        mount_policy:
          allowed_roots: [{{path: "{tmp_path / 'roots'}"}}]
        """, family=f"""    mounts:
      - {{host: "{photos}", container: photos}}
      - {{host: "{keys}", container: keys}}
""")
    try:
        assert apply_one(e, "family", {"type": "send_file",
                                       "filePath": "/workspace/extra/photos/cat.jpg"}) is None
        meta = apply_one(e, "family", {"type": "send_file",
                                       "filePath": "/workspace/extra/keys/id_rsa"})
        assert meta and "not under a mount" in meta["error"]
        meta = apply_one(e, "work", {"type": "send_file",
                                     "filePath": "/workspace/extra/photos/cat.jpg"})
        assert meta and "not under a mount" in meta["error"]
        rows = e.outbox()
        assert len(rows) == 1 and rows[0]["source_path"] is None
        assert Path(rows[0]["file_path"]).read_bytes() == b"JPEG"
        assert b"PRIVATE KEY" not in b"".join(
            p.read_bytes() for p in (e.data / "spool" / "outbox").iterdir())
    finally:
        e.close()


# --------------------------------------------------------------------------- groups

def test_register_group_creates_it_and_its_folders(env: Env) -> None:
    assert apply_one(env, "main", {"type": "register_group", "jid": "tg:9", "name": "Garden",
                                   "folder": "garden", "groupFolder": "main"},
                     sub="groups") is None
    row = env.db.query_one("SELECT * FROM registered_groups WHERE folder = 'garden'")
    assert (row["jid"], row["name"], row["trigger"], row["is_main"], row["source"]) == (
        "tg:9", "Garden", "@Andy", 0, "ipc")
    for sub in ("messages", "tasks", "input", "actions", "action_results"):
        p = env.ipc / "garden" / sub
        assert p.is_dir() and stat.S_IMODE(p.stat().st_mode) == 0o2770
    assert (env.data / "groups" / "garden").is_dir()
    # the new group is served at once
    assert apply_one(env, "garden", {"type": "message", "text": "hello"}, sub="messages") is None
    assert env.outbox()[-1]["chat_jid"] == "tg:9"
    # and shows in main's snapshot
    snap = json.loads((env.ipc / "main" / "available_groups.json").read_text())
    assert {"jid": "tg:9", "name": "Garden", "folder": "garden", "lastActivity": None,
            "isRegistered": True, "session": "shared",
            "chats": [{"jid": "tg:9", "name": "tg:9", "lastActivity": None, "first": True}],
            } in snap["groups"]
    for body, why in [({"folder": "garden", "jid": "tg:10"}, "folder 'garden' is already"),
                      ({"folder": "other", "jid": FAMILY_JID}, "already registered")]:
        meta = apply_one(env, "main", {"type": "register_group", "name": "x", **body})
        assert meta and why in meta["error"]


def test_register_group_refuses_a_folder_that_differs_only_in_case(env: Env) -> None:
    """On a case-insensitive file system (macOS) `FAMILY` would share family's folders: a
    case variant of any registered group's folder (from the config or over IPC, also one
    registered earlier in the same batch) is refused, with the rule named."""
    assert apply_one(env, "main", {"type": "register_group", "jid": "tg:9", "name": "Garden",
                                   "folder": "garden"}) is None
    for n, (folder, holder) in enumerate([("FAMILY", "family"), ("Main", "main"),
                                          ("GarDen", "garden")]):
        meta = apply_one(env, "main", {"type": "register_group", "jid": f"tg:{20 + n}",
                                       "name": "x", "folder": folder})
        assert meta is not None, folder
        assert (f"folder {folder!r} is the folder of registered group {holder!r} but for "
                "case" in meta["error"]) and "casefold()" in meta["error"]
        assert not (env.ipc / folder).exists() and not (env.data / "groups" / folder).exists()
    # two in one batch: the first is registered, the second refused
    first = env.write("main", {"type": "register_group", "jid": "tg:31", "name": "Pets",
                               "folder": "pets"}, name="0001-a.json")
    second = env.write("main", {"type": "register_group", "jid": "tg:32", "name": "Pets",
                                "folder": "PETS"}, name="0002-b.json")
    env.drain()
    assert env.errors_for("main", first) is None
    meta = env.errors_for("main", second)
    assert meta and "registered group 'pets' but for case" in meta["error"]
    assert sorted(r["folder"] for r in env.db.query("SELECT folder FROM registered_groups")) \
        == sorted(["main", "family", "work", "garden", "pets"])


# --------------------------------------------------------------------------- ordering

def test_files_run_in_filename_order_across_folders(env: Env) -> None:
    env.write("family", {"type": "pause_task", "taskId": "o1"}, sub="messages",
              name="0002-b.json")
    env.write("family", schedule_body("o1"), sub="tasks", name="0001-a.json")
    env.write("family", {"type": "message", "text": "third"}, sub="tasks", name="0003-c.json")
    env.write("family", {"type": "message", "text": "fourth"}, sub="messages",
              name="0004-d.json")
    res = env.drain()
    assert (res.applied, res.rejected) == (4, 0)
    assert env.task("o1")["status"] == "paused"
    assert [r["text"] for r in env.outbox()] == ["third", "fourth"]


def test_fair_batches_do_not_starve_a_quiet_group(tmp_path: Path) -> None:
    e = Env(tmp_path)
    try:
        engine = IpcEngine(e.cfg, e.db, batch_per_group=8, batch_max=64)
        for i in range(200):
            e.write("family", {"type": "message", "text": f"flood {i}"}, sub="messages")
        e.write("work", {"type": "message", "text": "quiet"}, sub="messages")
        batch = engine.take_fair(engine.collect())
        assert len(batch["family"]) == 8 and len(batch["work"]) == 1
        engine.process(batch)
        texts = [r["text"] for r in e.outbox()]
        assert "quiet" in texts and len(texts) == 9
        assert engine.drain().applied == 192
        engine.close()
    finally:
        e.close()


# --------------------------------------------------------------------------- ledger

def test_ledger_hit_after_a_crash_only_removes_the_file(env: Env) -> None:
    """A crash after COMMIT and before unlink leaves the file and its ledger row: on restart
    it is removed, not applied again."""
    name = env.write("family", {"type": "message", "text": "once"}, sub="messages")
    path = env.ipc / "family" / "messages" / name
    data = path.read_bytes()
    key = f"{hashlib.sha256(data).hexdigest()}@{generation(os.stat(path))}"
    with env.db.transaction() as c:  # what the crashed run had committed
        c.execute("INSERT INTO ipc_ledger VALUES ('family', ?, ?, 'message', 'applied', NULL,"
                  " '2026-01-01T00:00:00.000Z')", (f"messages/{name}", key))
    res = env.drain()
    assert (res.applied, res.finished) == (0, 1)
    assert not path.exists() and env.outbox() == []


def test_ledger_hit_rejected_is_quarantined_with_the_stored_reason(env: Env) -> None:
    name = env.write("family", {"type": "message", "text": "x"}, sub="messages")
    path = env.ipc / "family" / "messages" / name
    key = f"{hashlib.sha256(path.read_bytes()).hexdigest()}@{generation(os.stat(path))}"
    with env.db.transaction() as c:
        c.execute("INSERT INTO ipc_ledger VALUES ('family', ?, ?, 'message', 'rejected', "
                  "'unauthorized: earlier', '2026-01-01T00:00:00.000Z')",
                  (f"messages/{name}", key))
    env.drain()
    assert env.errors_for("family", name)["error"] == "unauthorized: earlier"
    assert env.outbox() == []


def test_same_name_same_content_written_again_is_a_new_command(env: Env) -> None:
    for _ in range(2):
        env.write("family", {"type": "message", "text": "again"}, sub="messages",
                  name="fixed.json")
        env.drain()
    assert [r["text"] for r in env.outbox()] == ["again", "again"]
    assert env.db.query_one("SELECT count(*) FROM ipc_ledger")[0] == 2


def test_migration_22_keeps_the_ledger_in_one_b_tree_with_every_row(tmp_path: Path) -> None:
    """The ledger of a schema-21 database is rebuilt WITHOUT ROWID: the same rows, the key
    still unique, a batch's lookup a search of the key's B-tree, pruning by the time index."""
    path = tmp_path / "state.db"
    old = database_at(path, 21)
    rows = [("family", f"messages/{i}.json", f"h{i}@1", "message",
             "applied" if i % 3 else "rejected", None if i % 3 else "unauthorized: x",
             f"2026-01-0{1 + i % 5}T00:00:00.000Z") for i in range(50)]
    old.executemany("INSERT INTO ipc_ledger VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    old.close()
    db = Database(path)
    try:
        assert db.user_version >= 22
        assert sorted(tuple(r) for r in db.query("SELECT * FROM ipc_ledger")) == sorted(rows)
        sql = db.query_one("SELECT sql FROM sqlite_master WHERE name = 'ipc_ledger'")[0]
        assert "WITHOUT ROWID" in sql
        with pytest.raises(sqlite3.IntegrityError):
            with db.transaction() as c:
                c.execute("INSERT INTO ipc_ledger VALUES (?, ?, ?, ?, ?, ?, ?)", rows[0])
        plan = " ".join(r[3] for r in db.query(
            "EXPLAIN QUERY PLAN SELECT file_name, content_hash, outcome, detail FROM ipc_ledger"
            " WHERE group_folder = ? AND file_name IN (?, ?)", ("family", "a", "b")))
        assert "USING PRIMARY KEY" in plan and "SCAN" not in plan
        plan = " ".join(r[3] for r in db.query(
            "EXPLAIN QUERY PLAN DELETE FROM ipc_ledger WHERE processed_at < ?", ("x",)))
        assert "idx_ipc_ledger_processed_at" in plan
    finally:
        db.close()


# --------------------------------------------------------------------------- quarantine

def test_quarantine_is_capped_and_pruning_is_logged(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    e = Env(tmp_path, max_files=10, max_bytes=1024 * 1024)
    try:
        names = [e.write("family", {"type": "bogus", "n": i}) for i in range(15)]
        with caplog.at_level(logging.WARNING, logger="mdclaw.ipc"):
            assert e.drain().rejected == 15
        left = sorted(p.name for p in e.errors.iterdir() if p.name.endswith(".error.json"))
        assert left == sorted(f"family.tasks.{n}.error.json" for n in names[5:])
        assert "pruned the 1 oldest entry" in caplog.text
        assert "unknown command type 'bogus'" in caplog.text
        assert e.engine.quarantine.count == 10
    finally:
        e.close()
    # bytes cap: big (but keepable) payloads push old entries out
    (tmp_path / "b").mkdir()
    e2 = Env(tmp_path / "b", max_files=1000, max_bytes=100_000)
    try:
        for i in range(10):
            e2.write("family", None, raw=b"x" * 6000 + str(i).encode())
        e2.drain()
        assert e2.engine.quarantine.total_bytes <= 100_000
        assert sum(p.stat().st_size for p in e2.errors.iterdir()) <= 100_000
        # the cap survives a restart: a new engine counts what is there
        again = IpcEngine(e2.cfg, e2.db)
        assert again.quarantine.count == e2.engine.quarantine.count
        again.close()
    finally:
        e2.close()


def test_nothing_is_written_back_into_the_container_on_rejection(env: Env) -> None:
    before = sorted(str(p.relative_to(env.ipc / "family")) for p in
                    (env.ipc / "family").rglob("*"))
    apply_one(env, "family", {"type": "register_group", "jid": "j", "name": "n",
                              "folder": "f"})
    after = sorted(str(p.relative_to(env.ipc / "family")) for p in
                   (env.ipc / "family").rglob("*"))
    assert after == before


def test_just_written_unparsable_file_waits_then_is_quarantined(env: Env) -> None:
    engine = IpcEngine(env.cfg, env.db, settle_ns=10 ** 9)
    try:
        p = env.ipc / "family" / "tasks" / "partial.json"
        p.write_text('{"type": "mess')
        res = engine.drain(max_rounds=1)
        assert res.deferred == 1 and p.exists()
        old = time.time_ns() - 5 * 10 ** 9
        os.utime(p, ns=(old, old))
        res = engine.drain()
        assert res.rejected == 1 and not p.exists()
    finally:
        engine.close()


# --------------------------------------------------------------------------- snapshots

def test_snapshots_main_sees_all_others_their_own(env: Env) -> None:
    with env.db.transaction() as c:
        c.execute("INSERT INTO chats (jid, name, last_activity, channel, is_group) VALUES "
                  "('tg:77', 'Book club', '2026-02-23T12:00:00.000Z', 'telegram', 1), "
                  "(?, 'Family chat', '2026-02-24T12:00:00.000Z', 'telegram', 1)",
                  (FAMILY_JID,))
    env.engine.start()
    apply_one(env, "family", schedule_body("f"))
    apply_one(env, "work", schedule_body("w"))
    main_tasks = json.loads((env.ipc / "main" / "current_tasks.json").read_text())
    fam_tasks = json.loads((env.ipc / "family" / "current_tasks.json").read_text())
    assert sorted(t["id"] for t in main_tasks) == ["f", "w"]
    assert [t["id"] for t in fam_tasks] == ["f"]
    assert set(fam_tasks[0]) == {"id", "groupFolder", "chat_jid", "prompt", "schedule_type",
                                 "schedule_value", "context_mode", "status", "next_run",
                                 "last_run", "timezone"}
    apply_one(env, "family", {"type": "pause_task", "taskId": "f"})
    fam_tasks = json.loads((env.ipc / "family" / "current_tasks.json").read_text())
    assert fam_tasks[0]["status"] == "paused"  # refreshed after the change
    groups = json.loads((env.ipc / "main" / "available_groups.json").read_text())
    assert set(groups) == {"groups", "lastSync"}
    by_jid = {g["jid"]: g for g in groups["groups"]}
    assert by_jid["tg:77"] == {"jid": "tg:77", "name": "Book club", "folder": None,
                               "lastActivity": "2026-02-23T12:00:00.000Z",
                               "isRegistered": False}
    assert by_jid[FAMILY_JID]["isRegistered"] and by_jid[FAMILY_JID]["folder"] == "family"
    assert by_jid[FAMILY_JID]["lastActivity"] == "2026-02-24T12:00:00.000Z"
    assert {MAIN_JID, WORK_JID} <= set(by_jid)
    for g in ("family", "work"):
        assert json.loads((env.ipc / g / "available_groups.json").read_text())["groups"] == []
    # atomic writes leave no temp files behind
    assert not [p for p in (env.ipc / "main").iterdir() if p.name.endswith(".tmp")]
    mode = stat.S_IMODE((env.ipc / "main" / "current_tasks.json").stat().st_mode)
    assert mode == 0o640


def test_snapshot_target_swapped_for_symlink_is_replaced_not_followed(env: Env,
                                                                      tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    os.symlink(victim, env.ipc / "family" / "current_tasks.json")
    write_snapshots(env.db, env.engine.layout)
    assert victim.read_text() == "keep me"
    assert not (env.ipc / "family" / "current_tasks.json").is_symlink()


# --------------------------------------------------------------------------- writers

def test_follow_up_and_close_sentinel(env: Env, tmp_path: Path) -> None:
    layout = env.engine.layout
    name = write_follow_up(layout, "family", sender="tg:42", sender_name="Alice",
                           content="and another thing", timestamp="2026-01-01T00:00:00.000Z")
    body = json.loads((env.ipc / "family" / "input" / name).read_text())
    assert body == {"sender": "tg:42", "sender_name": "Alice", "content": "and another thing",
                    "timestamp": "2026-01-01T00:00:00.000Z"}
    write_close(layout, "family")
    close = env.ipc / "family" / "input" / "_close"
    assert close.exists() and close.read_bytes() == b""
    assert not [p for p in (env.ipc / "family" / "input").iterdir()
                if p.name.startswith(".")]
    # input/ swapped for a symlink: refused, nothing written where it points
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.rename(env.ipc / "work" / "input", tmp_path / "work-input")
    os.symlink(target, env.ipc / "work" / "input")
    with pytest.raises(UnsafePath):
        write_follow_up(layout, "work", sender="a", sender_name="b", content="c")
    with pytest.raises(UnsafePath):
        write_close(layout, "work")
    assert list(target.iterdir()) == []


def test_follow_ups_are_named_in_the_order_they_were_written(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent reads input/ in name order: follow-ups written within one millisecond (the
    orchestrator writes one per waiting message in a loop) keep their order, and so do
    follow-ups written while the clock steps back. The clock is the test's: 50 names a
    millisecond, and one step back by 2 ms (a loaded machine need not share a millisecond)."""
    base = time.time_ns() // 1_000_000 * 1_000_000
    calls = iter(range(10**6))

    def clock() -> int:
        k = next(calls)
        return base + (k // 50 - (2 if 100 <= k < 150 else 0)) * 1_000_000

    with monkeypatch.context() as m:
        m.setattr(time, "time_ns", clock)
        names = [write_follow_up(env.engine.layout, "family", sender="tg:42",
                                 sender_name="A", content=f"message {i}") for i in range(200)]
    assert sorted(names) == names
    assert len({n.split("-")[0] for n in names}) == 3  # 0-49, 50-149 (and back), 150-199
    listed = sorted(p.name for p in (env.ipc / "family" / "input").iterdir())
    assert [json.loads((env.ipc / "family" / "input" / n).read_text())["content"]
            for n in listed] == [f"message {i}" for i in range(200)]


# --------------------------------------------------------------------------- actions

def _result(env: Env, group: str, rid: str) -> dict:
    env.run_jobs()  # memory_search/memory_get run off the loop, on the action worker
    return json.loads((env.ipc / group / "action_results" / f"{rid}.json").read_text())


def test_memory_actions(env: Env, tmp_path: Path) -> None:
    g = env.data / "groups" / "family"
    (g / "MEMORY.md").write_text("# Memory\nTomatoes need water daily.\nCats: two.\n")
    (g / "memory").mkdir()
    (g / "memory" / "garden.md").write_text("tomatoes tomatoes in the greenhouse\n")
    (tmp_path / "secret.md").write_text("tomatoes secret")
    os.symlink(tmp_path / "secret.md", g / "memory" / "leak.md")
    apply_one(env, "family", {"type": "memory_action", "requestId": "s1",
                              "action": "memory_search",
                              "params": {"query": "Tomatoes", "topK": 5}}, sub="actions")
    res = _result(env, "family", "s1")
    assert res["status"] == "success" and res["requestId"] == "s1" and res["executedAt"]
    hits = res["result"]["hits"]
    assert [(h["path"], h["line"]) for h in hits] == [("memory/garden.md", 1), ("MEMORY.md", 2)]
    assert all("secret" not in h["snippet"] for h in hits)
    apply_one(env, "family", {"type": "memory_action", "requestId": "g1",
                              "action": "memory_get", "params": {"path": "memory/garden.md"}},
              sub="actions")
    assert _result(env, "family", "g1")["result"]["content"].startswith("tomatoes tomatoes")
    for rid, params, why in [("g2", {"path": "../main/MEMORY.md"}, "not allowed"),
                             ("g3", {"path": "memory/leak.md"}, "does not exist"),
                             ("g4", {"path": "/etc/passwd"}, "not allowed"),
                             ("g5", {"path": "memory/sub/x.md"}, "not allowed")]:
        apply_one(env, "family", {"type": "action", "request_id": rid, "action": "memory_get",
                                  "params": params}, sub="actions")
        r = _result(env, "family", rid)
        assert r["status"] == "error" and why in r["error"], r
    apply_one(env, "family", {"type": "farm_action", "requestId": "f1",
                              "action": "farm_no_such_thing", "params": {}}, sub="actions")
    r = _result(env, "family", "f1")
    assert r["status"] == "error" and "unknown action 'farm_no_such_thing'" in r["error"]


def test_memory_get_serves_the_named_file_only(env: Env, tmp_path: Path) -> None:
    g = env.data / "groups" / "family"
    (g / "MEMORY.md").write_text("top of mind\n")
    os.symlink(tmp_path, g / "memory")  # memory/ swapped for a symlink: MEMORY.md still served
    apply_one(env, "family", {"type": "action", "request_id": "m1", "action": "memory_get",
                              "params": {"path": "MEMORY.md"}}, sub="actions")
    assert _result(env, "family", "m1")["result"] == {"path": "MEMORY.md",
                                                      "content": "top of mind\n"}
    os.unlink(g / "memory")
    (g / "memory").mkdir()
    for i in range(MEMORY_MAX_FILES + 1):  # only the first MEMORY_MAX_FILES by name count
        (g / "memory" / f"n{i:04d}.md").write_text(f"note {i}\n")
    for rid, name, want in [("m2", "n0000.md", "note 0\n"),
                            ("m3", f"n{MEMORY_MAX_FILES - 1:04d}.md",
                             f"note {MEMORY_MAX_FILES - 1}\n"),
                            ("m4", f"n{MEMORY_MAX_FILES:04d}.md", None)]:
        apply_one(env, "family", {"type": "action", "request_id": rid, "action": "memory_get",
                                  "params": {"path": f"memory/{name}"}}, sub="actions")
        r = _result(env, "family", rid)
        if want is None:
            assert r["status"] == "error" and "does not exist" in r["error"], r
        else:
            assert r["result"] == {"path": f"memory/{name}", "content": want}, r


def test_action_results_swapped_for_symlink(env: Env, tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    os.rmdir(env.ipc / "family" / "action_results")
    os.symlink(target, env.ipc / "family" / "action_results")
    # An unknown action's error result is written on the loop, through the one door.
    meta = apply_one(env, "family", {"type": "action", "request_id": "r1",
                                     "action": "no_such_action", "params": {"query": "x"}},
                     sub="actions")
    assert meta and "symlink" in meta["error"]
    assert list(target.iterdir()) == []


def test_adding_an_action_handler(env: Env) -> None:
    from mdclaw.ipc.actions import ACTIONS, ActionFailed, action

    @action("test_echo")
    def echo(ctx, params):  # noqa: ANN001, ANN202
        if params.get("fail"):
            raise ActionFailed("asked to fail")
        ctx.conn.execute("INSERT INTO router_state (key, value) VALUES ('echo', ?)",
                         (ctx.caller.folder,))
        return {"echo": params.get("say"), "from": ctx.caller.folder}

    try:
        apply_one(env, "work", {"type": "action", "request_id": "e1", "action": "test_echo",
                                "params": {"say": "hi"}}, sub="actions")
        assert _result(env, "work", "e1")["result"] == {"echo": "hi", "from": "work"}
        assert env.db.query_one("SELECT value FROM router_state WHERE key='echo'")[0] == "work"
        apply_one(env, "work", {"type": "action", "request_id": "e2", "action": "test_echo",
                                "params": {"fail": True}}, sub="actions")
        assert _result(env, "work", "e2") | {"executedAt": None} == {
            "requestId": "e2", "status": "error", "error": "asked to fail", "executedAt": None}
    finally:
        ACTIONS.pop("test_echo", None)


def test_quarantine_names_of_two_groups_cannot_collide(tmp_path: Path) -> None:
    """Group `a-b`'s c.json and group `a`'s b-c.json were one entry, `a-b-c.json.error`,
    under the old naming: the second overwrote the first. So were messages/x.json and
    tasks/x.json of one group."""
    from mdclaw import agentfs
    from mdclaw.ipc.quarantine import Quarantine, list_errors

    errors = tmp_path / "errors"
    q = Quarantine(errors, 100, 1 << 20)
    for group, sub, name in (("a-b", "tasks", "c.json"), ("a", "tasks", "b-c.json"),
                             ("a", "messages", "b-c.json")):
        src = tmp_path / "ipc" / group / sub
        src.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(f"{group}/{sub}")
        fd = agentfs.open_root(src)
        try:
            q.put(group, fd, sub, name, f"bad {group}/{sub}")
        finally:
            os.close(fd)
    q.close()
    entries = list_errors(errors)
    assert len(entries) == 3
    assert sorted((e.source_group, e.original_file, e.error) for e in entries) == [
        ("a", "messages/b-c.json", "bad a/messages"), ("a", "tasks/b-c.json", "bad a/tasks"),
        ("a-b", "tasks/c.json", "bad a-b/tasks")]
    payloads = sorted(p.read_text() for p in errors.iterdir() if p.name.endswith(".error"))
    assert payloads == ["a-b/tasks", "a/messages", "a/tasks"]


def test_old_quarantine_names_are_renamed_at_start(tmp_path: Path) -> None:
    from mdclaw.ipc.quarantine import Quarantine, list_errors

    errors = tmp_path / "errors"
    errors.mkdir()
    (errors / "a-b-c.json.error").write_text("payload")
    (errors / "a-b-c.json.error.json").write_text(json.dumps(
        {"original_file": "tasks/c.json", "source_group": "a-b", "error": "old",
         "processed_at": "2026-01-01T00:00:00.000Z"}))
    (errors / "junk.error.json").write_text("not json")  # left alone
    q = Quarantine(errors, 100, 1 << 20)
    assert q.count == 2
    q.close()
    assert (errors / "a-b.tasks.c.json.error").read_text() == "payload"
    assert not (errors / "a-b-c.json.error").exists()
    assert [e.name for e in list_errors(errors)] == ["a-b.tasks.c.json.error"]
