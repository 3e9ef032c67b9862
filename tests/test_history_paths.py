"""No statement a command, a turn or a delivery runs walks a history table or sorts it
(issue 35: the cost of a command is independent of the install's age).

Unlike tests/test_query_plans.py (which names the queries it checks), this test does not
list them: it records every statement the real code runs while the real parts of the daemon
(the orchestrator over the fake engine's conversations, the IPC watcher and its action
worker, the scheduler, the outbox worker) handle a turn, an unknown sender's admission card,
IPC commands of every kind a group sends in a conversation, an off-loop action, a task run
and the deliveries of all their answers, and the daemon's status look (every 5 s), over a
database with a history in every table that grows with the install's age. Each statement,
as the code prepared it (its parameters unbound, as SQLite planned it), and each statement
of every trigger, is then explained: a `SCAN` of a history table, or a `TEMP B-TREE` over
one, fails the test. A query added later on any of those paths is checked without being
named here.

Plans are read without statistics (a fresh install) and after `ANALYZE` (what `PRAGMA
optimize` may write into sqlite_stat1 on a long-lived install).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fake_engine import FakeEngine, chat_agent
from mdclaw.channels.base import Channel, InboundMessage
from mdclaw.config import load_config
from mdclaw.decisions import Decider
from mdclaw.ipc.actions import ACTIONS, OffloopContext, action
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.ipc.worker import LEFT_BY_A_STOP, UNFINISHED_COUNT, ActionWorker
from mdclaw.ops.health import channel_states
from mdclaw.orchestrator import Orchestrator
from mdclaw.outbox import OutboxWorker, failed_since
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerRunner
from mdclaw.schedule import utc_now
from mdclaw.scheduler import Scheduler
from mdclaw.state import Database
from mdclaw.state.db import now_iso
from mdclaw.state.outbox import recent_outbox_counts
from schema_at import database_at
from waiting import wait_until_async

# Tables whose rows accumulate with the install's age (one or more rows per message, reply,
# command, task run, action or approval, never pruned on those paths).
HISTORY = ("messages", "outbox", "transcript", "ipc_ledger", "task_run_logs", "action_jobs",
           "approvals", "approval_codes", "approval_cards", "failed_turns", "http_messages",
           "admitted_senders", "model_usage")
ACCESS = re.compile(r"^(SCAN|SEARCH) (\w+)(?: AS \w+)?(?: USING (?:COVERING )?INDEX (\w+)"
                    r"| USING (INTEGER PRIMARY KEY))?")
TEST = "/* test */ "  # the test's own looks at the database, not checked

CONFIG = """\
data_dir: {data}
assistant: {{name: Andy, timezone: UTC}}
limits: {{run_attempts: 1, idle_timeout: 1h, container_timeout: 2h, ipc_poll_interval: 200ms}}
people:
  alex: {{name: Alex, role: owner, identities: {{bn: [alex]}}}}
  bob: {{name: Bob, role: member, identities: {{bn: [bob]}}}}
groups:
  main: {{name: Main, jid: 'bn:main', main: true, requires_trigger: false}}
  fam: {{name: Family, jid: 'bn:fam', requires_trigger: false, members: [alex, bob],
         unknown_senders: ask_owner}}
  g2: {{name: G2, jid: 'bn:g2', requires_trigger: false}}
"""
CHATS = ("bn:main", "bn:fam", "bn:g2")


class Recorder(Channel):
    """A channel that keeps what it is asked to send."""

    name = "bench"
    jid_prefix = "bn:"

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str]] = []
        self.cards: list[tuple[str, Any]] = []

    async def connect(self) -> None: ...
    async def disconnect(self) -> None: ...

    def is_connected(self) -> bool:
        return True

    async def send_message(self, jid: str, text: str, *, reply_to=None, sender=None) -> None:  # noqa: ANN001
        self.sent.append((jid, text))

    async def send_card(self, jid: str, card: Any) -> str | None:
        self.cards.append((jid, card))
        return f"card-{len(self.cards)}"

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,  # noqa: ANN003
                        **kw) -> None:
        self.sent.append((jid, f"file {file_name or path.name}"))

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        self.sent.append((jid, f"react {emoji}"))

    async def set_typing(self, *a, **kw) -> None: ...  # noqa: ANN002, ANN003

    def texts(self) -> list[str]:
        return [t for _, t in self.sent]


class Statements:
    """Every statement run by any connection made while recording: (SQL, parameters), how
    many times it ran and the virtual machine steps it took (in hundreds, counted by a
    progress handler and charged to the statement its connection ran last)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}
        self.calls: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.lock = threading.Lock()
        self.on = False  # set while the paths under test run (not the set-up, not the checks)

    def add(self, sql: str, params: Any) -> bool:
        if not self.on or sql.startswith(TEST):
            return False
        with self.lock:
            self.seen.setdefault(sql, params)
            self.calls[sql] = self.calls.get(sql, 0) + 1
        return True

    def tick(self, sql: str | None) -> int:
        if sql is not None:
            with self.lock:
                self.steps[sql] = self.steps.get(sql, 0) + 1
        return 0

    def work(self, sql: str) -> float:
        """Steps (hundreds) per run of `sql`."""
        return self.steps.get(sql, 0) / self.calls[sql]


def recording_factory(statements: Statements) -> type[sqlite3.Connection]:
    class Recording(sqlite3.Connection):
        current: str | None = None  # the statement whose steps the handler counts

        def execute(self, sql: str, params: Any = (), /) -> sqlite3.Cursor:  # type: ignore[override]
            self.current = sql if statements.add(sql, params) else None
            return super().execute(sql, params)

        def executemany(self, sql: str, seq: Any, /) -> sqlite3.Cursor:  # type: ignore[override]
            rows = list(seq)
            self.current = sql if rows and statements.add(sql, rows[0]) else None
            return super().executemany(sql, rows)

    return Recording


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Statements:
    """Connections opened from here on record what they run."""
    statements = Statements()
    factory = recording_factory(statements)
    connect = sqlite3.connect

    def connecting(*a: Any, **kw: Any) -> sqlite3.Connection:
        kw.setdefault("factory", factory)
        conn = connect(*a, **kw)
        if isinstance(conn, factory):
            conn.set_progress_handler(lambda: statements.tick(conn.current), 100)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connecting)
    return statements


def second(k: int) -> str:
    return f"2024-{1 + k // 2_592_000 % 12:02d}-{1 + k // 86400 % 28:02d}T" \
           f"{k // 3600 % 24:02d}:{k // 60 % 60:02d}:{k % 60:02d}.000Z"


def fill(db: Database, per_chat: int) -> None:
    """A long-lived install's history: messages and their replies (sent outbox rows, their
    transcript rows through the triggers), the IPC ledger, task runs, action jobs,
    approvals and their cards, failed turns."""
    with db.transaction() as c:
        for jid in CHATS:
            folder = jid.split(":")[1]
            c.execute("INSERT OR IGNORE INTO chats (jid, last_activity, channel) "
                      "VALUES (?, '2024-01-01T00:00:00.000Z', 'bench')", (jid,))
            c.executemany(
                "INSERT INTO messages (id, chat_jid, sender, sender_name, content, timestamp)"
                " VALUES (?, ?, 'alex', 'Alex', ?, ?)",
                [(f"{jid}:h{n}", jid, f"old news {n}", second(n)) for n in range(per_chat)])
            c.executemany(  # a hundredth failed for good
                "INSERT INTO outbox (chat_jid, kind, text, status, attempts, source_group, "
                "created_at, updated_at, sent_at) VALUES (?, 'text', ?, ?, 1, ?, ?, ?, ?)",
                [(jid, f"old answer {n}", "failed" if n % 100 == 7 else "sent", folder,
                  second(n), second(n), second(n)) for n in range(per_chat)])
            # The group's agent was last told of failed deliveries after all of them (its
            # first run ever is told of every failure the history holds: a read that grows).
            c.execute("INSERT INTO router_state (key, value) VALUES (?, ?)",
                      (f"failures_told:{folder}", second(per_chat)))
            c.executemany(  # the ledger keeps a week: rows of this week
                "INSERT INTO ipc_ledger (group_folder, file_name, content_hash, command_type, "
                "outcome, processed_at) VALUES (?, ?, 'h', 'message', 'applied', ?)",
                [(folder, f"{n}.json", now_iso()) for n in range(per_chat)])
            c.executemany(
                "INSERT INTO action_jobs (group_folder, request_id, action, params, status, "
                "attempts, result, created_at, finished_at, written_at) "
                "VALUES (?, ?, 'web_fetch', '{}', 'done', 1, '{}', ?, ?, ?)",
                [(folder, f"old-{n}", second(n), second(n), second(n))
                 for n in range(per_chat // 10)])
            c.executemany(
                "INSERT INTO failed_turns (group_folder, chat_jid, cause, policy, outcome, "
                "created_at) VALUES (?, ?, 'model_error', 'retry', 'retry', ?)",
                [(folder, jid, second(n)) for n in range(per_chat // 10)])
            c.executemany(
                "INSERT INTO approvals (kind, group_folder, subject, summary, request, approver,"
                " approvers, status, created_at, expires_at, decided_at, settled_at) VALUES "
                "('command', ?, ?, 's', '{}', 'owner', '[]', 'approved', ?, ?, ?, ?)",
                [(folder, f"old-{n}", second(n), second(n), second(n), second(n))
                 for n in range(per_chat // 10)])
            c.execute("INSERT INTO scheduled_tasks (id, group_folder, chat_jid, prompt, "
                      "schedule_type, schedule_value, next_run, status, created_at) VALUES "
                      "(?, ?, ?, 'old', 'cron', '0 9 * * *', '2099-01-01T09:00:00.000Z', "
                      "'active', '2024-01-01T00:00:00.000Z')", (f"old-{folder}", folder, jid))
            c.executemany(
                "INSERT INTO task_run_logs (task_id, run_at, duration_ms, status, result, "
                "finished_at) VALUES (?, ?, 5, 'success', 'done', ?)",
                [(f"old-{folder}", second(n), second(n)) for n in range(per_chat // 10)])


def write_command(data: Path, folder: str, sub: str, body: dict[str, Any], n: int) -> None:
    d = data / "ipc" / folder / sub
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".c{n}.tmp"
    tmp.write_text(json.dumps(body))
    os.rename(tmp, d / f"{time.time_ns()}-c{n}.json")


def inbound(chat: str, n: int, sender: str, text: str) -> InboundMessage:
    return InboundMessage(id=f"{chat}:new{n}", chat_jid=chat, sender=sender,
                          sender_name=sender.title(), content=text,
                          timestamp=second(10_000_000 + n), channel="bn")


@pytest.fixture
def probe_action() -> Iterator[list[str]]:
    calls: list[str] = []

    @action("t_probe", offloop=True)
    async def probe(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
        calls.append(ctx.request_id)
        return {"ok": True}

    try:
        yield calls
    finally:
        ACTIONS.pop("t_probe", None)


async def drive(tmp_path: Path, per_chat: int, statements: Statements,
                analyzed: bool = False) -> tuple[Database, Recorder]:
    """A turn, an admission, IPC commands, an action, a task run and their deliveries, on the
    real parts over a database with `per_chat` rows of history in each chat."""
    (tmp_path / "config.yaml").write_text(CONFIG.format(data=tmp_path / "data"))
    cfg = load_config(tmp_path / "config.yaml")
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    fill(db, per_chat)
    if analyzed:  # statistics of a long-lived install (ANALYZE, or PRAGMA optimize)
        db.conn.execute("ANALYZE")
    ch = Recorder()
    outbox = OutboxWorker(db, [ch])
    engine = FakeEngine(default=chat_agent(lambda text: "answer " + " ".join(
        re.findall(r"q-\w+", text))))
    runner = ContainerRunner(cfg, engine)
    orch = Orchestrator(cfg, db, runner=runner, channels=[ch], wake_outbox=outbox.wake)
    orch.engine_ready.set()
    watcher = IpcWatcher(cfg, db)
    watcher.engine.on_commit = lambda items: outbox.wake()
    loop = asyncio.get_running_loop()
    watcher.on_files_ready = lambda: loop.call_soon_threadsafe(outbox.wake)  # as the daemon
    orch.decider = Decider(cfg, db, decided=outbox.wake)
    scheduler = Scheduler(db, orch.execute_task)
    stop = asyncio.Event()
    await outbox.start()
    watching = asyncio.create_task(watcher.run(stop))
    data = cfg.data_dir
    try:
        # Start-up (recovery, the ledger's prune, first snapshots, the full-text index of
        # the history written above) is done once a first command went through and nothing
        # waits for the index; from here on every statement is recorded.
        write_command(data, "g2", "messages",
                      {"type": "message", "chat_jid": "bn:g2", "text": "c-start"}, 0)
        await wait_until_async(lambda: "c-start" in ch.texts(), timeout=60)
        await wait_until_async(lambda: db.scalar(
            TEST + "SELECT COUNT(*) FROM transcript_unindexed") == 0, timeout=120)
        statements.on = True
        # A turn of a member of the family group (people and admission lookups), then a
        # follow-up fed into the open conversation.
        await orch.on_inbound(inbound("bn:fam", 1, "bob", "q-first"))
        await wait_until_async(lambda: "answer q-first" in ch.texts(), timeout=60)
        await orch.on_inbound(inbound("bn:fam", 2, "alex", "q-second"))
        await wait_until_async(lambda: "answer q-second" in ch.texts(), timeout=60)
        # An unknown sender in the family group: an admission waits for the owner.
        await orch.on_inbound(inbound("bn:fam", 3, "stranger", "hello?"))
        await wait_until_async(lambda: db.scalar(
            TEST + "SELECT COUNT(*) FROM approvals WHERE status = 'pending'") == 1, timeout=60)
        # What a group's agent writes during a turn.
        (data / "groups" / "g2" / "out").mkdir(parents=True, exist_ok=True)
        (data / "groups" / "g2" / "out" / "a.txt").write_text("a file")
        n = 0
        due = (utc_now() + timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
        for folder, sub, body in [
            ("g2", "messages", {"type": "message", "chat_jid": "bn:g2", "text": "c-msg"}),
            ("main", "messages", {"type": "message", "chat_jid": "bn:fam", "text": "c-main"}),
            ("g2", "messages", {"type": "send_file", "file_path": "/workspace/group/out/a.txt",
                                "file_name": "a.txt"}),
            ("g2", "messages", {"type": "react", "chat_jid": "bn:g2",
                                "message_id": "bn:g2:h5", "emoji": "👍"}),
            ("g2", "tasks", {"type": "schedule_task", "prompt": "q-task",
                             "schedule_type": "once",
                             "schedule_value": due, "task_id": "t-once"}),
            ("g2", "tasks", {"type": "schedule_task", "prompt": "q-daily",
                             "schedule_type": "cron", "schedule_value": "0 9 * * *",
                             "task_id": "t-daily"}),
            ("g2", "tasks", {"type": "pause_task", "task_id": "t-daily"}),
            ("g2", "tasks", {"type": "resume_task", "task_id": "t-daily"}),
            ("g2", "tasks", {"type": "update_task", "task_id": "t-daily",
                             "prompt": "q-daily2"}),
            ("g2", "tasks", {"type": "cancel_task", "task_id": "t-daily"}),
            ("g2", "actions", {"type": "action", "requestId": "r-1", "action": "t_probe",
                               "params": {}}),
        ]:
            n += 1
            write_command(data, folder, sub, body, n)
        await wait_until_async(lambda: {"c-msg", "file a.txt", "react 👍"} <= set(ch.texts()),
                               timeout=60)
        await wait_until_async(lambda: db.scalar(  # the main group's message to another chat
            TEST + "SELECT COUNT(*) FROM approvals WHERE status = 'pending'") == 2, timeout=60)
        await wait_until_async(
            lambda: (data / "ipc" / "g2" / "action_results" / "r-1.json").exists(), timeout=60)
        await wait_until_async(lambda: db.scalar(
            TEST + "SELECT COUNT(*) FROM scheduled_tasks WHERE id = 't-daily' "
            "AND status = 'completed'") == 1, timeout=60)
        # The scheduler's look for due tasks, the claim, the run and its result.
        await wait_until_async(lambda: utc_now().strftime("%Y-%m-%dT%H:%M:%SZ") > due,
                               timeout=10)
        await scheduler.tick_async()
        await wait_until_async(lambda: "answer q-task" in ch.texts(), timeout=60)
        await scheduler.drain(timeout=60)
        await wait_until_async(lambda: db.scalar(
            TEST + "SELECT COUNT(*) FROM outbox WHERE status IN ('pending', 'sending')") == 0,
            timeout=60)
        # The daemon's status look, every 5 s on its event loop (Daemon.status): the
        # outbox's counts and whether the channel's deliveries fail.
        counts = recent_outbox_counts(db)
        assert counts["sent_24h"] >= 6 and counts["pending"] == counts["sending"] == 0
        assert channel_states(db, {"bench": True}, {"bench": "bn:"})["bench"]["state"] == \
            "connected"
    finally:
        orch.accepting = False
        orch.close_conversations()
        await orch.queue.shutdown(grace=10)
        await runner.aclose()
        stop.set()
        await watching
        watcher.close()
        await outbox.stop()
        engine.shutdown()
        statements.on = False
    return db, ch


def explain(conn: sqlite3.Connection, sql: str, params: Any) -> list[str]:
    """The plan of `sql` as prepared with `params` bound (NULLs when none are known)."""
    try:
        return [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
    except sqlite3.ProgrammingError as e:
        m = re.search(r"uses (\d+)", str(e))
        if m is None:
            raise
        nulls = (None,) * int(m.group(1))
        return [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, nulls)]


def trigger_statements(conn: sqlite3.Connection) -> dict[str, str]:
    """Each statement of every trigger, with NEW.x and OLD.x as parameters."""
    out = {}
    for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"):
        body = sql[sql.upper().index("BEGIN") + 5:sql.upper().rindex("END")]
        body = re.sub(r"\b(NEW|OLD)\.\w+", "?", body)
        pending = ""
        for piece in body.split(";"):
            pending += piece + ";"
            if sqlite3.complete_statement(pending):
                if pending.strip(" \n;"):
                    out[f"{name}: {pending.strip()[:60]}"] = pending.strip().rstrip(";")
                pending = ""
    return out


def partial_indexes(conn: sqlite3.Connection) -> frozenset[str]:
    """Indexes of some rows only (`WHERE ...`): the open, pending, unsettled ones, whose
    number does not grow with the history."""
    return frozenset(name for name, sql in conn.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
        if " WHERE " in sql.upper())


def walks(lines: list[str], partial: frozenset[str]) -> list[str]:
    """The plan lines that walk a history table: a `SCAN` of one (but through an index of
    some rows only), and a temporary B-tree in a statement that reads one by anything but
    such an index or its rowid (a sort of what a seek found among the history is a sort of
    the history)."""
    bad, reads_history = [], []
    for line in lines:
        m = ACCESS.match(line)
        if m is None or m.group(2) not in HISTORY:
            continue
        bounded = m.group(3) in partial or (m.group(1) == "SEARCH" and m.group(4))
        if m.group(1) == "SCAN" and not bounded:
            bad.append(line)
        elif not bounded:
            reads_history.append(line)
    if reads_history and any("TEMP B-TREE" in line for line in lines):
        bad += [line for line in lines if "TEMP B-TREE" in line] + reads_history
    return bad


@pytest.mark.parametrize("analyzed", [False, True], ids=["no-stats", "analyzed"])
def test_no_statement_of_a_command_a_turn_or_a_delivery_walks_a_history(
        tmp_path: Path, recorded: Statements, probe_action: list[str], analyzed: bool) -> None:
    db, ch = asyncio.run(drive(tmp_path, 3000, recorded, analyzed))
    assert probe_action == ["r-1"]
    partial = partial_indexes(db.conn)
    found = {sql: walks(explain(db.conn, sql, params), partial)
             for sql, params in recorded.seen.items()
             if re.match(r"\s*(WITH|SELECT|UPDATE|DELETE|INSERT|REPLACE)", sql, re.I)}
    found.update({name: walks(explain(db.conn, sql, ()), partial)
                  for name, sql in trigger_statements(db.conn).items()})
    assert len(found) > 50
    bad = {q: lines for q, lines in found.items() if lines}
    db.close()
    assert not bad, "statements that walk a history table or sort it:\n" + "\n".join(
        f"{' '.join(q.split())}\n    {lines}" for q, lines in bad.items())


def test_no_statement_does_more_work_with_ten_times_the_history(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probe_action: list[str]) -> None:
    """The plans above cannot tell a seek of the few rows a statement wants from a seek of a
    chat's whole history that then filters it (`SEARCH outbox USING INDEX idx_outbox_chat
    (chat_jid=?)` walked every sent row of the chat). So the same paths run over 300 and
    over 3,000 rows of history a chat, and each statement's work is counted: a walk of the
    history takes ten times the steps with ten times the rows; a seek the same."""
    runs = []
    for per_chat in (300, 3000):
        statements = Statements()
        factory = recording_factory(statements)
        connect = sqlite3.connect

        def connecting(*a: Any, _f: Any = factory, _s: Statements = statements,
                       _c: Any = connect, **kw: Any) -> sqlite3.Connection:
            kw.setdefault("factory", _f)
            conn = _c(*a, **kw)
            if isinstance(conn, _f):
                conn.set_progress_handler(lambda: _s.tick(conn.current), 100)
            return conn

        monkeypatch.setattr(sqlite3, "connect", connecting)
        here = tmp_path / str(per_chat)
        here.mkdir()
        db, _ch = asyncio.run(drive(here, per_chat, statements))
        db.close()
        monkeypatch.setattr(sqlite3, "connect", connect)
        runs.append(statements)
    small, large = runs
    both = set(small.calls) & set(large.calls)
    assert len(both) > 50
    # A walk of 3,000 rows is thousands of steps (tens of hundreds) over the 300-row run's.
    grew = {" ".join(sql.split()): (round(small.work(sql), 1), round(large.work(sql), 1))
            for sql in both if large.work(sql) > 2 * small.work(sql) + 10}
    assert not grew, "statements whose work grew with the history (hundreds of steps a " \
        "run, 300 rows a chat -> 3,000):\n" + "\n".join(f"{q}\n    {w}" for q, w in grew.items())


def test_migration_15_adds_the_indexes_to_a_database_with_rows(tmp_path: Path) -> None:
    """A database of schema 14 with rows of every kind the new indexes hold (and of kinds
    they leave out) is upgraded: every row is kept, the indexes hold exactly their rows, and
    the queries that use them give what they gave before."""
    from mdclaw.state.db import _split_sql
    from mdclaw.state.migrations import LATEST_VERSION, MIGRATIONS

    path = tmp_path / "state.db"
    conn = sqlite3.connect(path, isolation_level=None)
    for v, _desc, script in MIGRATIONS:
        if v > 14:
            break
        for statement in _split_sql(script):
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version={v}")
    conn.executescript("""
        INSERT INTO outbox (chat_jid, kind, text, status, source_group, created_at,
            updated_at, source_path) VALUES
          ('tg:1', 'text', 'sent', 'sent', 'fam', 'x', '2026-01-01T00:00:00.000Z', NULL),
          ('tg:1', 'text', 'failed old', 'failed', 'fam', 'x', '2026-01-01T00:00:00.000Z', NULL),
          ('tg:1', 'text', 'failed new', 'failed', 'fam', 'x', '2026-03-01T00:00:00.000Z', NULL),
          ('tg:2', 'text', 'failed other', 'failed', 'work', 'x', '2026-03-01T00:00:00.000Z',
           NULL),
          ('tg:1', 'file', NULL, 'pending', 'fam', 'x', 'x', '/workspace/group/a.png'),
          ('tg:1', 'text', 'open', 'pending', 'fam', 'x', 'x', NULL);
        INSERT INTO action_jobs (group_folder, request_id, action, params, status, created_at,
            written_at) VALUES
          ('fam', 'r1', 'web_fetch', '{}', 'done', 'x', '2026-01-01T00:00:00.000Z'),
          ('fam', 'r2', 'web_fetch', '{}', 'done', 'x', NULL),
          ('fam', 'r3', 'web_fetch', '{}', 'running', 'x', NULL);
    """)
    before = {t: conn.execute(f"SELECT * FROM {t} ORDER BY id").fetchall()  # noqa: S608
              for t in ("outbox", "action_jobs")}
    conn.close()

    db = Database(path)
    assert db.user_version == LATEST_VERSION >= 15
    for t, rows in before.items():
        assert [tuple(r) for r in db.query(f"SELECT * FROM {t} ORDER BY id")] == rows  # noqa: S608

    def ids(index: str, where: str) -> list[int]:
        """The outbox rows read through `index` alone (its rows, and no other)."""
        return [r[0] for r in db.query(
            f"SELECT id FROM outbox INDEXED BY {index} WHERE {where} ORDER BY id")]  # noqa: S608

    assert ids("idx_outbox_waiting_copy", "source_path IS NOT NULL") == [5]
    assert ids("idx_outbox_failed", "status = 'failed'") == [2, 3, 4]
    assert [r[0] for r in db.query("SELECT id FROM action_jobs INDEXED BY "
                                   "idx_action_jobs_written WHERE written_at IS NOT NULL")] == [1]
    assert [r[0] for r in db.query("SELECT id FROM action_jobs INDEXED BY "
                                   "idx_action_jobs_unwritten WHERE written_at IS NULL "
                                   "ORDER BY id")] == [2, 3]
    assert [r.text for r in failed_since(db, "fam", "2026-02-01T00:00:00.000Z")] == ["failed new"]
    assert [r.text for r in failed_since(db, "fam")] == ["failed old", "failed new"]
    db.close()


def test_migration_18_indexes_the_outbox_by_state_and_time(tmp_path: Path) -> None:
    """A database of schema 17 with rows of every state is upgraded: the rows are kept, the
    index of (status, next_attempt_at) is gone, the new one holds every row, and the
    daemon's status look reads ranges of it (its counts as before for the rows of the
    day)."""
    path = tmp_path / "state.db"
    conn = database_at(path, 17)
    recent = now_iso()
    conn.executescript(f"""
        INSERT INTO outbox (chat_jid, kind, text, status, source_group, created_at,
            updated_at, sent_at) VALUES
          ('tg:1', 'text', 'old', 'sent', 'fam', 'x', '2024-01-01T00:00:00.000Z',
           '2024-01-01T00:00:00.000Z'),
          ('tg:1', 'text', 'new', 'sent', 'fam', 'x', '{recent}', '{recent}'),
          ('tg:1', 'text', 'failed', 'failed', 'fam', 'x', '2024-01-01T00:00:00.000Z', NULL),
          ('tg:1', 'text', 'open', 'pending', 'fam', 'x', '{recent}', NULL),
          ('tg:2', 'text', 'going', 'sending', 'work', 'x', '{recent}', NULL);
    """)
    before = conn.execute("SELECT * FROM outbox ORDER BY id").fetchall()
    conn.close()

    db = Database(path)
    assert db.user_version >= 18
    assert [tuple(r) for r in db.query("SELECT * FROM outbox ORDER BY id")] == before
    names = {r[0] for r in db.query("SELECT name FROM sqlite_master WHERE type = 'index' "
                                    "AND tbl_name = 'outbox'")}
    assert "idx_outbox_status_time" in names and "idx_outbox_status_next" not in names
    assert [r[0] for r in db.query(
        "SELECT id FROM outbox INDEXED BY idx_outbox_status_time WHERE status IN "
        "('sent', 'failed', 'pending', 'sending') ORDER BY id")] == [1, 2, 3, 4, 5]
    assert recent_outbox_counts(db) == {"pending": 1, "sending": 1, "failed": 1, "sent_24h": 1}
    plan = explain(db.conn, "SELECT COUNT(*) FROM outbox WHERE status = 'sent' AND "
                   "updated_at >= ?", ("2026-01-01",))
    assert plan == ["SEARCH outbox USING COVERING INDEX idx_outbox_status_time "
                    "(status=? AND updated_at>?)"]
    db.close()


@pytest.mark.parametrize("analyzed", [False, True], ids=["no-stats", "analyzed"])
def test_a_start_seeks_the_action_jobs_left_open_not_the_finished_ones(
        tmp_path: Path, recorded: Statements, analyzed: bool) -> None:
    """The action worker's start-up (recover) and its run-until-idle count look for jobs
    left running or finished without their result written; a week of written jobs is not
    walked for them, and the rows found are exactly those."""
    (tmp_path / "config.yaml").write_text(CONFIG.format(data=tmp_path / "data"))
    cfg = load_config(tmp_path / "config.yaml")
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    fill(db, 3000)  # 300 written jobs a group
    with db.transaction() as c:
        c.executemany(
            "INSERT INTO action_jobs (group_folder, request_id, action, params, status, "
            "attempts, max_attempts, result, created_at, written_at) "
            "VALUES ('g2', ?, 'web_fetch', '{}', ?, 1, ?, ?, ?, NULL)",
            [("left-running", "running", 1, None, now_iso()),
             ("left-done", "done", 1, '{"requestId": "left-done", "status": "ok"}', now_iso()),
             ("left-queued", "queued", 1, None, now_iso())])
    if analyzed:
        db.conn.execute("ANALYZE")
    assert [r[2] for r in db.query(LEFT_BY_A_STOP)] == ["left-running", "left-done"]
    assert db.query(UNFINISHED_COUNT)[0][0] == 3
    worker = ActionWorker(cfg)
    recorded.on = True
    try:
        assert worker.recover() == 2
    finally:
        recorded.on = False
        worker.db.close()
    partial = partial_indexes(db.conn)
    plans = {sql: explain(db.conn, sql, params) for sql, params in recorded.seen.items()
             if "action_jobs" in sql and sql.lstrip().upper().startswith("SELECT")}
    plans[UNFINISHED_COUNT] = explain(db.conn, UNFINISHED_COUNT, ())
    assert LEFT_BY_A_STOP in plans
    bad = {q: walks(lines, partial) for q, lines in plans.items() if walks(lines, partial)}
    # What the start left is settled (the running job had no try left: failed, its result
    # written, as the done one's): the queued job is all that is open.
    assert db.query(UNFINISHED_COUNT)[0][0] == 1
    db.close()
    assert not bad, bad
