"""ask_agent end to end: a real `mdclaw run` with the real agent image on the real engine and
a scripted model (openai backend) behind the credential proxy.

A person asks the main group's agent (the local HTTP chat); its model calls the ask_agent
tool; the host runs one turn of the research group's agent in its own container, whose
model sees the question as a message from `agent:main` and answers; that answer comes back
to the main agent as the tool's result, and the main agent's reply carries it to the chat.
The research group's chat shows nothing of it, and the research agent's model use is
counted for main too (`asked:research/<model>`)."""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import waiting  # noqa: E402
from fake_models import FakeOpenAI, Step, call, say  # noqa: E402

pytestmark = pytest.mark.e2e
wait_until = functools.partial(waiting.wait_until, interval=0.1)


def http(method: str, url: str, body: dict | None = None, timeout: float = 40) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def replies(base: str, jid: str) -> list[str]:
    got = http("GET", f"{base}/messages?jid={jid}&after=0")
    return [m["content"] for m in got["messages"] if m["direction"] == "out"]


def brain(body: dict[str, Any]) -> Step:
    """Both agents' model, by what it is shown: a tool result (main, after asking); a
    question from agent:main (research); the person's request (main)."""
    msgs = body.get("messages", [])
    last = msgs[-1] if msgs else {}
    if last.get("role") == "tool":
        return say(f"main relays: {last.get('content')}")
    text = str(last.get("content"))
    if 'sender="agent:main"' in text and "capital of France" in text:
        return say("Paris, says research")
    if "ask research" in text:
        return call("ask_agent", group="research", question="What is the capital of France?")
    return say("default reply")


def test_ask_agent_round_trip(tmp_path, engine, real_agent_image, install_id, reap) -> None:
    from mdclaw.config import load_config
    from mdclaw.runtime import install_labels

    key = tmp_path / "model.key"
    key.write_text("sk-ask-e2e-REAL\n")
    key.chmod(0o600)
    model = FakeOpenAI([], fallback=brain).start()
    port = waiting_free_port()
    base = f"http://127.0.0.1:{port}"
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models:
          local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1",
                   api_key_file: {key}}}
        groups:
          main: {{name: Admin, jid: "hl:main", main: true, may_ask: [research]}}
          research: {{name: Research, jid: "hl:research"}}
        limits: {{container_timeout: 180s, idle_timeout: 10s, memory: 256m, cpus: 1.0,
                 pids: 128, run_attempts: 1}}
        runtime: {{image: "{real_agent_image}", install_id: {install_id},
                  socket: "{engine.base_url}"}}
        channels:
          http: {{listen: "127.0.0.1:{port}"}}
        """))
    reap(install_labels(load_config(cfg_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env.update(PYTHONPATH=str(REPO))
    log_path = tmp_path / "daemon.log"
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg_path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "mdclaw.daemon: ready:" in log_path.read_text(), 60,
                   what="the daemon to be ready")
        http("POST", f"{base}/message", {"text": "please ask research about France",
                                         "sender": "alice"})
        try:
            wait_until(lambda: any("main relays" in r for r in replies(base, "hl:main")), 240,
                       what="main's reply with research's answer")
        except AssertionError:
            raise AssertionError(log_path.read_text()[-4000:]) from None
        (reply,) = [r for r in replies(base, "hl:main") if "main relays" in r]
        assert "Paris, says research" in reply
        # The tool result the main agent's model saw is research's answer.
        assert any("Paris, says research" in t for t in model.tool_results())
        # Research's model saw the question as agent:main's message, never a person's.
        asked = [r for r in model.requests if r.path == "/v1/chat/completions"
                 and any('sender="agent:main"' in str(m.get("content"))
                         for m in r.body.get("messages", []) if m.get("role") == "user")]
        assert asked, "research's model never saw the question"
        # Nothing of it in research's chat.
        assert replies(base, "hl:research") == []
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        log.close()
        model.stop()
    conn = sqlite3.connect(tmp_path / "data" / "state.db")
    try:
        rows = dict(conn.execute("SELECT model, sum(input_tokens + output_tokens) FROM "
                                 "model_usage WHERE group_folder = 'main' GROUP BY model"))
    finally:
        conn.close()
    assert rows.get("asked:research/fake-model", 0) > 0, rows


def waiting_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
