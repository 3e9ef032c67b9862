"""Agents asking agents (`ask_agent`) on a real daemon: `mdclaw run` in a process of its own
(tests/fake_daemon.py) with its orchestrator, queue, runner, IPC and action worker, the
tests' fake engine playing every group's agent (tests/ask_agents.py: it answers, asks in
turn, fails or hangs, as its question says). The asking agent of group `a` is the test: it
writes its action files into ipc/a/actions/ and reads action_results/, as the agent runner's
tool does."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from waiting import wait_until

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


class Daemon:
    def __init__(self, tmp: Path, limits: dict[str, Any] | None = None) -> None:
        self.data = tmp / "data"
        self.config = tmp / "config.yaml"
        self.log = tmp / "daemon.log"
        self.n = 0
        groups: dict[str, Any] = {
            "main": {"name": "Admin", "jid": "hl:main", "main": True},
            "a": {"name": "A", "jid": "hl:a", "may_ask": ["b", "e"]},
            "b": {"name": "B", "jid": "hl:b", "may_ask": ["a", "c"]},
            "c": {"name": "C", "jid": "hl:c", "may_ask": ["d"]},
            "d": {"name": "D", "jid": "hl:d"},
            "e": {"name": "E", "jid": "hl:e"},
        }
        self.config.write_text(yaml.safe_dump({
            "data_dir": str(self.data),
            "assistant": {"name": "Andy", "timezone": "UTC"},
            "server": None,
            "models": {"local": {"backend": "openai", "model": "fake",
                                 "base_url": "http://127.0.0.1:9/v1"}},
            "groups": groups,
            "channels": {"http": None},
            "limits": {"idle_timeout": "2s", "ipc_poll_interval": "200ms", **(limits or {})},
        }))
        env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
        self._out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fake_daemon.py"), "--config", str(self.config),
             "--agent", "ask_agents:asking_agent"], stdout=self._out,
            stderr=subprocess.STDOUT, env=env)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited:\n{self.text()[-3000:]}")
            return "mdclaw.daemon: ready:" in self.text()

        wait_until(ready, 60, interval=0.05, what="the daemon to be ready")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()

    def ask(self, frm: str, params: dict[str, Any]) -> str:
        """Write an ask_agent request of `frm`'s agent; its requestId."""
        self.n += 1
        rid = f"t-{self.n}"
        d = self.data / "ipc" / frm / "actions"
        tmp = d / f".{rid}.tmp"
        tmp.write_text(json.dumps({"type": "action", "requestId": rid, "action": "ask_agent",
                                   "params": params}))
        os.rename(tmp, d / f"{int(time.time() * 1000)}-{rid}.json")
        return rid

    def result(self, frm: str, rid: str, timeout: float = 90.0) -> dict[str, Any]:
        p = self.data / "ipc" / frm / "action_results" / f"{rid}.json"

        def read() -> dict[str, Any] | None:
            try:
                return dict(json.loads(p.read_text()))
            except (FileNotFoundError, ValueError):
                return None

        got: dict[str, Any] = wait_until(read, timeout, interval=0.05,
                                         what=f"the result of {rid}")
        return got

    def prompts(self, folder: str) -> str:
        p = self.data / "groups" / folder / "prompts.log"
        return p.read_text() if p.exists() else ""

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(self.data / "state.db")
        try:
            return list(conn.execute(sql, args))
        finally:
            conn.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    try:
        yield d
    finally:
        d.stop()


def test_round_trip_answer_is_the_result_and_nothing_reaches_the_chat(daemon: Daemon) -> None:
    rid = daemon.ask("a", {"group": "b", "question": "what is <2+2>?"})
    body = daemon.result("a", rid)
    assert body["status"] == "success", body
    assert body["result"] == {"group": "b", "answer": "b heard agent:a: what is <2+2>?"}
    # The question reached b's agent as a message from agent:a (escaped, like a person's).
    assert '<message sender="agent:a"' in daemon.prompts("b")
    assert "what is &lt;2+2&gt;?" in daemon.prompts("b")
    # Never a person's message: nothing was stored in b's chat, nothing was posted there.
    assert daemon.rows("SELECT count(*) FROM messages WHERE chat_jid = 'hl:b'") == [(0,)]
    assert daemon.rows("SELECT count(*) FROM outbox WHERE chat_jid = 'hl:b'") == [(0,)]


def test_a_cycle_is_refused_and_named(daemon: Daemon) -> None:
    # a asks b; b asks a back: a is waiting for b's answer, so b hears a refusal at once.
    rid = daemon.ask("a", {"group": "b", "question": "ASK a are you there?"})
    body = daemon.result("a", rid)
    assert body["status"] == "success", body
    answer = body["result"]["answer"]
    assert answer.startswith("b relays an error: refused: a → b → a is a cycle"), answer
    assert daemon.prompts("a") == ""  # a's agent never ran


def test_a_chain_stops_at_limits_ask_depth(daemon: Daemon) -> None:
    # a → b → c is 2 deep (the default limit); c asking d would be 3.
    rid = daemon.ask("a", {"group": "b", "question": "ASK c ASK d hello"})
    body = daemon.result("a", rid)
    assert body["status"] == "success", body
    answer = body["result"]["answer"]
    assert answer.startswith("b relays: c relays an error: refused: a → b → c → d is 3 "
                             "questions deep; limits.ask_depth is 2"), answer
    assert daemon.prompts("d") == ""
    # Within the limit the chain works: b asks c, c answers.
    rid = daemon.ask("a", {"group": "b", "question": "ASK c hello"})
    assert daemon.result("a", rid)["result"]["answer"] == "b relays: c heard agent:b: hello"


def test_refused_without_may_ask(daemon: Daemon) -> None:
    rid = daemon.ask("d", {"group": "a", "question": "hi"})
    body = daemon.result("d", rid)
    assert body["status"] == "error"
    assert "groups.d.may_ask lists no group" in body["error"]
    rid = daemon.ask("a", {"group": "c", "question": "hi"})
    body = daemon.result("a", rid)
    assert body["status"] == "error"
    assert "groups.a.may_ask (b, e) does not list it" in body["error"]
    assert daemon.prompts("a") == daemon.prompts("c") == ""


def test_a_failing_or_hanging_agent_gives_a_clear_error(daemon: Daemon) -> None:
    rid = daemon.ask("a", {"group": "e", "question": "FAIL"})
    body = daemon.result("a", rid)
    assert body["status"] == "error", body
    assert body["error"].startswith("the agent of 'e' gave no answer:"), body
    assert daemon.rows("SELECT count(*) FROM outbox WHERE chat_jid = 'hl:e'") == [(0,)]
    t0 = time.monotonic()
    rid = daemon.ask("a", {"group": "b", "question": "HANG", "timeout": 5})
    body = daemon.result("a", rid, timeout=60)
    assert body["status"] == "error", body
    assert body["error"] == "the agent of 'b' did not answer within 5 s"
    assert time.monotonic() - t0 < 30
    # b is free again afterwards (its hung container was asked to end and was stopped).
    rid = daemon.ask("a", {"group": "b", "question": "still there?"})
    assert daemon.result("a", rid, timeout=120)["result"]["answer"] == (
        "b heard agent:a: still there?")


def test_a_waiting_question_holds_no_action_slot(tmp_path: Path) -> None:
    """With one action slot for all groups, a's question to b waits while b's agent asks c:
    a waiting ask must not hold the slot b's own request needs (it would wait for a's
    timeout), nor stop other groups' actions meanwhile."""
    d = Daemon(tmp_path, limits={"action_jobs": 1, "action_jobs_per_group": 1})
    try:
        rid = d.ask("a", {"group": "b", "question": "ASK c hello", "timeout": 120})
        body = d.result("a", rid, timeout=60)
        assert body["status"] == "success", body
        assert body["result"]["answer"] == "b relays: c heard agent:b: hello"
    finally:
        d.stop()
