"""Read-only commands on a database that is not ready: one line (or JSON naming the state),
the documented exit status, never a traceback.

Each state is a real SQLite file: missing, creating (a file without schema), migrating
(user_version set, a table missing), older (a complete earlier schema), newer
(user_version = LATEST + 1), locked (another process holds an exclusive lock). The real CLI
runs in a subprocess. The last test races `mdclaw status --json` against another process
creating and migrating a fresh database.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO
from mdclaw.state.db import Database, database_state, inspect_database
from mdclaw.state.migrations import LATEST_VERSION
from schema_at import database_at

# The documented exit status of each state (README, "Exit status").
EXIT = {"missing": 3, "creating": 3, "migrating": 3, "older": 3, "newer": 4, "locked": 5}

READ_ONLY = [
    ("status",), ("doctor",), ("failures",), ("groups", "list"), ("tasks", "list"),
    ("tasks", "show", "t1"), ("tasks", "logs", "t1"), ("outbox", "list"), ("usage",),
]
# Read-only commands that need no database: whatever its state, they do their job.
NO_DATABASE = [("ipc", "errors"), ("containers", "list")]

CONFIG = """\
data_dir: {data_dir}
groups:
  main: {{name: A, jid: "hl:main", main: true}}
runtime: {{socket: "unix://{sock}"}}
"""


def migrate_to(path: Path, version: int) -> None:
    """A database with the schema of `version` (0: a file without schema)."""
    database_at(path, version, wal=True).close()


LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA locking_mode=EXCLUSIVE")
conn.execute("BEGIN EXCLUSIVE")
conn.execute("UPDATE registered_groups SET name = name")
print("locked", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def make_state(tmp_path: Path) -> Iterator:
    """make_state(state) -> config path, with the database in that state (a locked one is
    held by a subprocess until the test ends)."""
    lockers: list[subprocess.Popen[str]] = []

    def make(state: str) -> str:
        data = tmp_path / "data"
        data.mkdir(exist_ok=True)
        db = data / "state.db"
        if state == "creating":
            db.touch()
        elif state == "migrating":
            migrate_to(db, LATEST_VERSION)
            conn = sqlite3.connect(db, isolation_level=None)
            conn.execute("DROP TABLE outbox_progress")
            conn.execute("DROP TABLE outbox")
            conn.execute(f"PRAGMA user_version={LATEST_VERSION - 1}")
            conn.close()
        elif state == "older":
            migrate_to(db, 3)
        elif state == "newer":
            migrate_to(db, LATEST_VERSION)
            conn = sqlite3.connect(db, isolation_level=None)
            conn.execute(f"PRAGMA user_version={LATEST_VERSION + 1}")
            conn.close()
        elif state == "locked":
            Database(db).close()
            p = subprocess.Popen([sys.executable, "-c", LOCKER, str(db)], text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            lockers.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "locked"
        else:
            assert state == "missing"
        cfg = tmp_path / "config.yaml"
        cfg.write_text(CONFIG.format(data_dir=data, sock=tmp_path / "no-engine.sock"))
        return str(cfg)

    yield make
    for p in lockers:
        p.communicate("", timeout=10)


@pytest.mark.parametrize("state", list(EXIT))
def test_database_state_of_each_file(make_state, tmp_path: Path, state: str) -> None:
    make_state(state)
    assert database_state(tmp_path / "data" / "state.db", timeout=0.2) == state


def test_the_readme_documents_these_exit_statuses() -> None:
    from mdclaw.commands.common import DB_EXIT

    section = (REPO / "README.md").read_text().split("### Exit status", 1)[1].split("##")[0]
    for state, code in EXIT.items():
        assert DB_EXIT[state] == code
        row = next(ln for ln in section.splitlines() if f"`{state}`" in ln)
        assert row.startswith(f"| {code} |"), row


def test_database_state_ready_and_unreadable(tmp_path: Path) -> None:
    Database(tmp_path / "ok.db").close()
    assert inspect_database(tmp_path / "ok.db").state == "ready"
    (tmp_path / "junk.db").write_bytes(b"not a database" * 100)
    info = inspect_database(tmp_path / "junk.db")
    assert info.state == "unreadable" and "not a database" in info.error
    # A look never creates the file.
    assert database_state(tmp_path / "none.db") == "missing"
    assert not (tmp_path / "none.db").exists()


def test_a_write_lock_in_another_thread(tmp_path: Path) -> None:
    """BEGIN EXCLUSIVE keeps readers out of a rollback-journal database (locked); in WAL
    mode (what mdclaw uses) readers go on reading the last commit during a write."""
    import threading

    rollback = tmp_path / "rollback.db"
    migrate_to(rollback, LATEST_VERSION)
    sqlite3.connect(rollback, isolation_level=None).execute("PRAGMA journal_mode=DELETE")
    wal = tmp_path / "wal.db"
    migrate_to(wal, LATEST_VERSION)
    for path, expected in ((rollback, "locked"), (wal, "ready")):
        held, release = threading.Event(), threading.Event()

        def hold(path: Path = path, held: threading.Event = held,
                 release: threading.Event = release) -> None:
            conn = sqlite3.connect(path, isolation_level=None)
            conn.execute("BEGIN EXCLUSIVE")
            conn.execute("INSERT INTO router_state VALUES ('k', 'v')")
            held.set()
            release.wait(10)
            conn.execute("ROLLBACK")
            conn.close()

        t = threading.Thread(target=hold)
        t.start()
        try:
            assert held.wait(10)
            info = inspect_database(path, timeout=0.2)
            assert info.state == expected, info
            if expected == "locked":
                assert "locked" in info.error
        finally:
            release.set()
            t.join()
        assert database_state(path) == "ready"


def json_state(command: tuple[str, ...], out: object) -> str:
    """The database state in a command's JSON: a key of the object, or doctor's check."""
    if command == ("doctor",):
        assert isinstance(out, list)
        return next(c["state"] for c in out if c["check"] == "database")
    assert isinstance(out, dict)
    return out["database"]


# How long the commands wait for the locker's lock (MDCLAW_DB_READ_TIMEOUT): long enough to
# be a real wait, short enough that eighteen commands do not wait out the default 2 s each.
SHORT_WAIT = {"MDCLAW_DB_READ_TIMEOUT": "0.2"}


@pytest.mark.parametrize("state", list(EXIT))
def test_read_only_commands_in_each_state(make_state, cli, state: str) -> None:
    cfg = make_state(state)
    for command in READ_ONLY:
        for as_json in (False, True):
            args = (*command, *(["--json"] if as_json else []), "--config", cfg)
            r = cli(*args, timeout=60, env=SHORT_WAIT)
            where = f"{' '.join(args)}: {r.stdout}\n{r.stderr}"
            assert "Traceback" not in r.stdout + r.stderr, where
            assert r.returncode == EXIT[state], where
            if as_json:
                out = json.loads(r.stdout)
                assert json_state(command, out) == state, where
                if command == ("status",):
                    assert out["daemon"] == "stopped" and "disk" in out, where
                    assert out["groups"] is None and out["database_detail"], where
            else:
                said = r.stdout + r.stderr
                assert state in said or {"missing": "does not exist",
                                          "creating": "being created",
                                          "migrating": "being migrated"}[state] in said, where
    if state != "missing":  # a read-only command changed nothing
        assert database_state(Path(cfg).parent / "data" / "state.db", timeout=0.2) == state


@pytest.mark.parametrize("state", list(EXIT))
def test_commands_without_the_database_ignore_its_state(make_state, cli, state: str) -> None:
    cfg = make_state(state)
    for command in NO_DATABASE:
        r = cli(*command, "--json", "--config", cfg, timeout=60, env=SHORT_WAIT)
        where = f"{' '.join(command)}: {r.stdout}\n{r.stderr}"
        assert "Traceback" not in r.stdout + r.stderr, where
        if command == ("ipc", "errors"):
            assert r.returncode == 0 and json.loads(r.stdout) == [], where
        else:  # the test config's engine socket answers nothing
            assert r.returncode == 1 and "engine unreachable" in r.stderr, where


def test_ready_database_still_lists(make_state, cli, tmp_path: Path) -> None:
    cfg = make_state("missing")
    assert cli("reconcile", "--config", cfg).returncode == 0
    r = cli("status", "--json", "--config", cfg)
    assert r.returncode == 0 and json.loads(r.stdout)["database"] == "ready"
    assert json.loads(r.stdout)["groups"] == 1
    r = cli("groups", "list", "--json", "--config", cfg)
    assert r.returncode == 0 and json.loads(r.stdout)[0]["folder"] == "main"


# Creates and migrates the database at each path read from stdin, after a random delay of
# up to argv[1] s; with argv[2] > 0 each statement of the migrations takes that much longer
# (a slow disk), so the creation spans the CLI's whole run.
CREATOR = """
import random, sys, time
from mdclaw.state import Database
for path in sys.stdin:
    time.sleep(random.uniform(0, float(sys.argv[1])))
    db = Database(path.strip(), migrate=False)
    if float(sys.argv[2]):
        db.conn.set_trace_callback(lambda _: time.sleep(float(sys.argv[2])))
    db.migrate()
    db.close()
    print("done", flush=True)
"""


def _creator(env: dict[str, str], delay: float, slow: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CREATOR, str(delay), str(slow)], env=env,
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def test_status_races_a_database_being_created(tmp_path: Path) -> None:
    """`mdclaw status --json` while another process creates and migrates the database:
    always JSON with a state and its documented exit status, never a traceback. Each round
    starts the CLI and the creation at once, on a fresh data dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    creator = _creator(env, 1.0, slow=0.01)
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 90
    try:
        for n in range(15):
            if time.monotonic() > deadline:
                break
            data = tmp_path / f"data{n}"
            cfg = tmp_path / f"config{n}.yaml"
            cfg.write_text(CONFIG.format(data_dir=data, sock=tmp_path / "no-engine.sock"))
            assert creator.stdin is not None and creator.stdout is not None
            status = subprocess.Popen([sys.executable, "-m", "mdclaw", "status", "--json",
                                       "--config", str(cfg)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            creator.stdin.write(f"{data / 'state.db'}\n")
            creator.stdin.flush()
            out, err = status.communicate(timeout=60)
            assert creator.stdout.readline().strip() == "done"
            assert "Traceback" not in out + err, err
            state = json.loads(out)["database"]
            assert status.returncode == {"ready": 0, **EXIT}[state], (state, err)
            seen[state] = seen.get(state, 0) + 1
    finally:
        creator.communicate("", timeout=30)
    assert creator.returncode == 0
    assert sum(seen.values()) >= 3, seen
    print(f"\nstatus during creation saw: {seen}")


def test_probe_races_databases_being_created(tmp_path: Path) -> None:
    """inspect_database() in a tight loop while another process creates and migrates one
    database after another: it never raises and only ever sees the states of a creation."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    creator = _creator(env, 0.05)
    seen: dict[str, int] = {}
    try:
        assert creator.stdin is not None and creator.stdout is not None
        for n in range(20):
            db = tmp_path / f"state{n}.db"
            creator.stdin.write(f"{db}\n")
            creator.stdin.flush()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = inspect_database(db, timeout=0.5).state
                seen[state] = seen.get(state, 0) + 1
                assert state in ("missing", "creating", "older", "locked", "ready"), state
                if state == "ready":
                    break
            assert state == "ready"
            assert creator.stdout.readline().strip() == "done"
    finally:
        creator.communicate("", timeout=30)
    assert creator.returncode == 0
    print(f"\nprobes during creation saw: {seen}")
