"""The action worker: off-loop actions with real SQLite, the real IPC watcher and real
subprocesses killed mid-job."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipc_helpers import Env
from mdclaw.ipc.actions import ACTIONS, ActionFailed, OffloopContext, action
from mdclaw.ipc.watcher import IpcWatcher
from mdclaw.ipc.worker import ActionWorker
from waiting import wait_until, wait_until_async

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path)
    yield e
    e.close()


@pytest.fixture
def slow_actions() -> Iterator[dict[str, Any]]:
    """Off-loop test actions: `t_gate` waits for its gate (an asyncio.Event), `t_echo`
    answers at once, `t_fail` fails, `t_main` is for the main group by default."""
    state: dict[str, Any] = {"calls": [], "gate": None}

    @action("t_gate", offloop=True)
    async def gate(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
        state["calls"].append(("t_gate", ctx.caller.folder, ctx.request_id))
        await state["gate"].wait()
        return {"opened": True}

    @action("t_echo", offloop=True)
    async def echo(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
        state["calls"].append(("t_echo", ctx.caller.folder, ctx.request_id))
        return {"echo": params.get("say"), "from": ctx.caller.folder}

    @action("t_sync", offloop=True)
    def sync(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
        state["calls"].append(("t_sync", ctx.caller.folder, ctx.request_id))
        return {"thread": True}

    @action("t_fail", offloop=True)
    async def fail(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
        raise ActionFailed("asked to fail")

    @action("t_main", offloop=True, default_scope="main")
    async def main_only(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True}

    try:
        yield state
    finally:
        for n in ("t_gate", "t_echo", "t_sync", "t_fail", "t_main"):
            ACTIONS.pop(n, None)


def result(env: Env, group: str, rid: str) -> dict[str, Any] | None:
    p = env.ipc / group / "action_results" / f"{rid}.json"
    return json.loads(p.read_text()) if p.exists() else None


def request(rid: str, name: str, **params: Any) -> dict[str, Any]:
    return {"type": "action", "requestId": rid, "action": name, "params": params}


def job(env: Env, group: str, rid: str) -> dict[str, Any] | None:
    r = env.db.query_one("SELECT * FROM action_jobs WHERE group_folder = ? AND request_id = ?",
                         (group, rid))
    return dict(r) if r else None


class Running:
    """An IpcWatcher (with its action worker) serving on this test's loop."""

    def __init__(self, env: Env) -> None:
        self.watcher = IpcWatcher(env.cfg, env.db, engine=env.engine)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> IpcWatcher:
        self.task = asyncio.create_task(self.watcher.run(self.stop))
        await wait_until_async(lambda: self.watcher.actions._wake is not None)
        return self.watcher

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        assert self.task is not None
        await self.task
        self.watcher.actions.close()
        self.watcher.spooler.close()
        self.watcher.remover.close()
        self.watcher.snapshot_writer.close()
        if self.watcher.inotify is not None:
            self.watcher.inotify.close()  # (not watcher.close(): the Env closes the engine)


def test_offloop_result_appears_and_is_recorded(env: Env,
                                                slow_actions: dict[str, Any]) -> None:
    async def go() -> None:
        async with Running(env):
            env.write("family", request("a1", "t_echo", say="hi"), sub="actions")
            env.write("work", request("a2", "t_sync"), sub="actions")
            env.write("work", request("a3", "t_fail"), sub="actions")
            env.write("work", request("a4", "nope"), sub="actions")
            await wait_until_async(lambda: all(result(env, g, r) for g, r in
                                               (("family", "a1"), ("work", "a2"),
                                                ("work", "a3"), ("work", "a4"))))
            await wait_until_async(lambda: (job(env, "work", "a3") or {}).get("written_at"))
    asyncio.run(go())
    r = result(env, "family", "a1")
    assert r is not None and r["status"] == "success"
    assert r["result"] == {"echo": "hi", "from": "family"}
    assert (result(env, "work", "a2") or {})["result"] == {"thread": True}
    assert (result(env, "work", "a3") or {})["error"] == "asked to fail"
    assert "unknown action 'nope'" in (result(env, "work", "a4") or {})["error"]
    j = job(env, "family", "a1")
    assert j is not None and j["status"] == "done" and j["attempts"] == 1 and j["written_at"]
    assert (job(env, "work", "a3") or {})["status"] == "failed"
    assert job(env, "work", "a4") is None  # unknown: answered on the loop, never queued
    # The request files are applied and gone; the ledger has them.
    assert env.pending("family", "actions") == [] and env.pending("work", "actions") == []


def test_duplicate_request_id_is_not_run_twice(env: Env,
                                               slow_actions: dict[str, Any]) -> None:
    env.write("family", request("d1", "t_echo", say="one"), sub="actions")
    env.drain()  # queued by `ipc drain` (no worker); the daemon's worker runs it later
    assert (job(env, "family", "d1") or {})["status"] == "queued"
    name = env.write("family", request("d1", "t_echo", say="two"), sub="actions")
    env.drain()
    err = env.errors_for("family", name)
    assert err is not None and "duplicate requestId 'd1'" in err["error"]
    # Another group may use the same requestId (ids are per group).
    env.write("work", request("d1", "t_echo", say="three"), sub="actions")
    env.drain()

    async def go() -> None:
        async with Running(env):
            await wait_until_async(lambda: result(env, "family", "d1")
                                   and result(env, "work", "d1"))
    asyncio.run(go())
    assert (result(env, "family", "d1") or {})["result"]["echo"] == "one"
    assert [c for c in slow_actions["calls"] if c[1] == "family"] == [
        ("t_echo", "family", "d1")]


def test_loop_not_blocked_while_slow_actions_run(env: Env,
                                                 slow_actions: dict[str, Any]) -> None:
    """Another group's command commits (and the loop answers) while slow actions are in
    flight; the per-group cap keeps one group from taking every slot."""
    async def go() -> None:
        slow_actions["gate"] = asyncio.Event()
        async with Running(env) as w:
            for i in range(5):
                env.write("family", request(f"s{i}", "t_gate"), sub="actions")
            # action_jobs_per_group: 2
            await wait_until_async(lambda: len(w.actions.running) == 2)
            await asyncio.sleep(0)
            assert len(w.actions.running) == 2
            env.write("work", request("w1", "t_echo", say="quick"), sub="actions")
            env.write("work", {"type": "message", "chatJid": "tg:3", "text": "still here"},
                      sub="messages")
            await wait_until_async(lambda: result(env, "work", "w1"))
            await wait_until_async(lambda: any(r["text"] == "still here" for r in env.outbox()))
            assert all(result(env, "family", f"s{i}") is None for i in range(5))
            slow_actions["gate"].set()
            await wait_until_async(lambda: all(result(env, "family", f"s{i}")
                                               for i in range(5)))
    asyncio.run(go())
    assert {(result(env, "family", f"s{i}") or {})["status"] for i in range(5)} == {"success"}


def test_permission_refusal_is_an_error_result(tmp_path: Path,
                                               slow_actions: dict[str, Any]) -> None:
    env = Env(tmp_path, family="    actions: ['t_e*']\n")
    try:
        env.write("family", request("p1", "t_echo"), sub="actions")  # matches t_e*
        env.write("family", request("p2", "t_fail"), sub="actions")  # matches nothing
        env.write("family", request("p3", "memory_search", query="x"), sub="actions")
        env.write("work", request("p4", "t_main"), sub="actions")  # default scope: main
        env.write("main", request("p5", "t_main"), sub="actions")
        env.drain()
        assert job(env, "family", "p3")  # queued: memory_search runs off the loop too
        env.run_jobs()
        r2, r4 = result(env, "family", "p2"), result(env, "work", "p4")
        assert r2 is not None and r2["status"] == "error"
        assert "groups.family.actions (t_e*) matches no such action" in r2["error"]
        assert r4 is not None and "only for the main group by default" in r4["error"]
        assert (result(env, "family", "p3") or {})["status"] == "success"  # always allowed
        assert job(env, "family", "p1") and job(env, "main", "p5")
        assert job(env, "family", "p2") is None and job(env, "work", "p4") is None
        assert not list(env.errors.glob("*.error.json"))  # refused, not quarantined
    finally:
        env.close()


def test_stop_leaves_running_jobs_for_the_next_start(env: Env,
                                                     slow_actions: dict[str, Any]) -> None:
    async def go() -> None:
        slow_actions["gate"] = asyncio.Event()  # never opened
        running = Running(env)
        async with running as w:
            w.actions.stop_grace = 0.05
            env.write("family", request("x1", "t_gate"), sub="actions")
            await wait_until_async(lambda: w.actions.running)
        assert (job(env, "family", "x1") or {})["status"] == "running"
        # The next start: one attempt only (the default), so an interrupted result.
        worker = ActionWorker(env.cfg)
        try:
            assert worker.recover() == 1
            assert worker.recover() == 0
        finally:
            worker.close()
    asyncio.run(go())
    r = result(env, "family", "x1")
    assert r is not None and r["status"] == "error" and "interrupted by a restart" in r["error"]
    assert (job(env, "family", "x1") or {})["status"] == "failed"


CHILD = textwrap.dedent("""
    import asyncio, sys
    from mdclaw.config import load_config
    from mdclaw.ipc.actions import action
    from mdclaw.ipc.watcher import IpcWatcher
    from mdclaw.state import Database

    @action("t_crash", offloop=True, max_attempts=int(sys.argv[2]))
    async def crash(ctx, params):
        if params.get("slow"):
            await asyncio.sleep(600)
        return {"ran": True}

    cfg = load_config(sys.argv[1])
    db = Database(cfg.db_path)
    async def main():
        w = IpcWatcher(cfg, db)
        await w.run(asyncio.Event())
    asyncio.run(main())
""")


@pytest.mark.parametrize("attempts", [1, 2])
def test_kill_9_mid_job_then_restart_gives_exactly_one_result(env: Env,
                                                              attempts: int) -> None:
    """A subprocess runs the watcher; SIGKILL while the job runs; a restart (another
    process, same database) leaves exactly one result: the retry's when attempts remain,
    else "interrupted by a restart"."""
    script = env.data.parent / "child.py"
    script.write_text(CHILD)
    envvars = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.write("family", request("k1", "t_crash", slow=True), sub="actions")
    proc = subprocess.Popen([sys.executable, str(script), str(env.config_path), str(attempts)],
                            env=envvars, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def started() -> bool:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return (job(env, "family", "k1") or {}).get("status") == "running"

        wait_until(started, 30, what="the job to start")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert result(env, "family", "k1") is None
    assert env.pending("family", "actions") == []  # the request itself was applied
    # Restart: this time the action answers at once (the params still say slow, so the
    # child's handler is not used; a fresh registration in this process is).
    try:
        @action("t_crash", offloop=True, max_attempts=attempts)
        async def crash(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
            return {"ran": True}

        async def go() -> None:
            async with Running(env):
                await wait_until_async(
                    lambda: (job(env, "family", "k1") or {}).get("written_at"))
        asyncio.run(go())
    finally:
        ACTIONS.pop("t_crash", None)
    files = list((env.ipc / "family" / "action_results").glob("k1*"))
    assert [f.name for f in files] == ["k1.json"]
    r = json.loads(files[0].read_text())
    j = job(env, "family", "k1")
    assert j is not None
    if attempts == 1:
        assert r["status"] == "error" and "interrupted by a restart" in r["error"]
        assert j["status"] == "failed" and j["attempts"] == 1
    else:
        assert r == r | {"status": "success", "result": {"ran": True}}
        assert j["status"] == "done" and j["attempts"] == 2


def test_a_stored_result_not_yet_written_is_written_at_start(env: Env) -> None:
    """A crash between storing the result and writing the file: the start writes it."""
    body = {"requestId": "z1", "status": "success", "result": {"n": 1}, "executedAt": "x"}
    with env.db.transaction() as conn:
        conn.execute("INSERT INTO action_jobs (group_folder, request_id, action, params,"
                     " status, attempts, result, created_at, finished_at) VALUES"
                     " ('work', 'z1', 't_x', '{}', 'done', 1, ?, 'now', 'now')",
                     (json.dumps(body),))
    worker = ActionWorker(env.cfg)
    try:
        assert worker.recover() == 1
        assert worker.recover() == 0
    finally:
        worker.close()
    assert result(env, "work", "z1") == body
