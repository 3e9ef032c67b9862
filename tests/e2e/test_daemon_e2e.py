"""The whole path in a real subprocess daemon: chat message in, the agent's reply out.

A real `mdclaw run` with the real agent image on the real engine, a scripted fake model
server on the host's loopback (reached only through the credential proxy), the local HTTP
channel and a fake Telegram Bot API on loopback. The daemon's sd_notify messages are read
from a test NOTIFY_SOCKET.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import waiting  # noqa: E402
from fake_models import FakeOpenAI, say  # noqa: E402
from test_channel_telegram import TOKEN, FakeBotApi  # noqa: E402

pytestmark = pytest.mark.e2e

# The predicates ask the daemon over HTTP: look ten times a second, not a hundred.
wait_until = functools.partial(waiting.wait_until, interval=0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answer(body: dict[str, Any]):  # noqa: ANN201 - a fake model's Step
    """Reply by keyword of the newest user turn, so the order of requests does not matter."""
    last = last_user(body)
    for word, reply, delay in (("slow", "slow reply", 4.0), ("second", "reply two", 0),
                               ("hello", "reply one", 0), ("@Andy", "family reply", 0),
                               ("tg-one", "tg reply one", 0), ("tg-two", "tg reply two", 0),
                               ("still", "reply three", 0)):
        if word in last:
            return say(reply, delay=delay)
    return say("default reply")


class ThreadedBot:
    """FakeBotApi on its own event loop thread (the daemon under test is another process)."""

    def __init__(self) -> None:
        self.api = FakeBotApi()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.api.start(), self.loop).result(10)

    def call(self, fn, *args) -> Any:  # noqa: ANN001
        async def go() -> Any:
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.api.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


class Notifications:
    """Collects datagrams sent to a NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.got: list[str] = []
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done:
            try:
                self.got.append(self.sock.recv(65536).decode())
            except TimeoutError:
                continue
            except OSError:
                return

    def states(self) -> list[str]:
        """The state names in order (READY, RELOADING, STOPPING, ...), STATUS/WATCHDOG left out."""
        out = []
        for msg in list(self.got):
            for line in msg.splitlines():
                key = line.split("=", 1)[0]
                if key in ("READY", "RELOADING", "STOPPING"):
                    out.append(key)
        return out


def http(method: str, url: str, body: dict | None = None, timeout: float = 40) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def replies(base: str, jid: str) -> list[str]:
    got = http("GET", f"{base}/messages?jid={jid}&after=0")
    return [m["content"] for m in got["messages"] if m["direction"] == "out"]


def last_user(body: dict) -> str:
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    return str(users[-1]["content"]) if users else ""


def mdclaw(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mdclaw", *args, "--config", str(config)],
                          capture_output=True, text=True, env=env, timeout=60)


def test_daemon_end_to_end(tmp_path, engine, real_agent_image, install_id, reap) -> None:
    from mdclaw.config import load_config
    from mdclaw.runtime import install_labels

    key = tmp_path / "model.key"
    key.write_text("sk-daemon-e2e-REAL\n")
    key.chmod(0o600)
    tg_token = tmp_path / "tg.token"
    tg_token.write_text(TOKEN)
    tg_token.chmod(0o600)
    model = FakeOpenAI([], fallback=answer).start()
    bot = ThreadedBot()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg_path = tmp_path / "config.yaml"
    good_config = textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models:
          local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1",
                   api_key_file: {key}}}
        groups:
          main: {{name: Admin, jid: "hl:main", main: true}}
          family: {{name: Family, jid: "hl:family"}}
          tele: {{name: Tele, jid: "tg:555", requires_trigger: false}}
        limits: {{container_timeout: 120s, idle_timeout: 12s, memory: 256m, cpus: 1.0,
                 pids: 128, delivery_attempts: 2, delivery_retry_base: 300ms,
                 run_attempts: 2, run_retry_base: 1s}}
        runtime: {{image: "{real_agent_image}", install_id: {install_id},
                  socket: "{engine.base_url}"}}
        channels:
          http: {{listen: "127.0.0.1:{port}"}}
          telegram: {{token_file: {tg_token}, api_base: "{bot.api.base}"}}
        """)
    cfg_path.write_text(good_config)
    good_path = tmp_path / "good.yaml"  # for the CLI while config.yaml is broken
    good_path.write_text(good_config)
    reap(install_labels(load_config(cfg_path)))
    notes = Notifications(tmp_path / "notify.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env.update(PYTHONPATH=str(REPO), NOTIFY_SOCKET=str(tmp_path / "notify.sock"))
    log = open(tmp_path / "daemon.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg_path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "READY" in notes.states(), 60, what="READY=1")
        assert http("GET", f"{base}/health")["status"] == "ok"

        # 1. A message to the main group gets the agent's reply back through GET /messages.
        http("POST", f"{base}/message", {"text": "hello there", "sender": "alice"})
        wait_until(lambda: "reply one" in replies(base, "hl:main"), 120,
                   what="the first reply")

        # 2. A message while that conversation runs reaches it through input/: the model
        # sees it as a second user turn of the same conversation.
        http("POST", f"{base}/message", {"text": "a second question", "sender": "alice"})
        wait_until(lambda: "reply two" in replies(base, "hl:main"), 60,
                   what="the second reply")
        second = next(r for r in model.requests if "second question" in last_user(r.body))
        users = [m for m in second.body["messages"] if m["role"] == "user"]
        assert len(users) == 2 and "hello there" in users[0]["content"]
        assert "a second question" in users[1]["content"]

        # 3. Untriggered in a non-main group: no run, but it is in the next prompt.
        n = len(model.requests)
        http("POST", f"{base}/message", {"text": "just chatting", "sender": "bob",
                                         "jid": "hl:family"})
        time.sleep(3)
        assert len(model.requests) == n, "an untriggered message started a run"
        http("POST", f"{base}/message", {"text": "@Andy what's up?", "sender": "bob",
                                         "jid": "hl:family"})
        wait_until(lambda: "family reply" in replies(base, "hl:family"), 120,
                   what="family reply")
        fam = next(r for r in model.requests if "what's up" in last_user(r.body))
        prompt = last_user(fam.body)
        assert "just chatting" in prompt and "@Andy what's up?" in prompt

        # 4. Telegram: a failed delivery is retried, then shown as failed.
        fail = (500, {"ok": False, "error_code": 500, "description": "Internal Server Error"})
        bot.call(lambda: bot.api.fail.__setitem__("sendMessage", [fail, fail]))
        bot.call(bot.api.push, {"message_id": 1, "date": int(time.time()),
                                "chat": {"id": 555, "type": "group", "title": "Tele"},
                                "from": {"id": 9, "first_name": "Tim"}, "text": "tg-one"})

        def failed_rows() -> list[dict]:
            r = mdclaw("outbox", "list", "--json", config=cfg_path)
            return [x for x in json.loads(r.stdout) if x["status"] == "failed"]

        (row,) = wait_until(failed_rows, 120, what="the failed delivery")
        assert row["chat_jid"] == "tg:555" and row["text"] == "tg reply one"
        tries = [p for m, p in bot.api.calls if m == "sendMessage"]
        assert len(tries) == 2
        status = json.loads(mdclaw("status", "--json", config=cfg_path).stdout)
        assert status["daemon"] == "running" and status["outbox"]["failed"] == 1

        # ... and a Telegram message gets its reply in the same chat.
        bot.call(bot.api.push, {"message_id": 2, "date": int(time.time()),
                                "chat": {"id": 555, "type": "group", "title": "Tele"},
                                "from": {"id": 9, "first_name": "Tim"}, "text": "tg-two"})
        sent = wait_until(lambda: [p for m, p in bot.api.calls if m == "sendMessage"
                                   and p.get("text") == "tg reply two"], 120,
                          what="telegram reply")
        assert str(sent[0]["chat_id"]) == "555"

        # 5. SIGHUP with a broken config keeps serving, and says why.
        cfg_path.write_text("groups: [\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: notes.states().count("READY") >= 2, 30,
                   what="READY after the reload")
        status = json.loads(mdclaw("status", "--json", config=good_path).stdout)
        assert "invalid YAML" in (status.get("reload_error") or ""), status
        cfg_path.write_text(good_config)
        assert proc.poll() is None
        http("POST", f"{base}/message", {"text": "still there?", "sender": "alice"})
        wait_until(lambda: "reply three" in replies(base, "hl:main"), 120,
                   what="reply after reload")

        # 6. SIGTERM drains: the turn in progress finishes and the daemon exits in time.
        http("POST", f"{base}/message", {"text": "a slow one", "sender": "alice"})
        wait_until(lambda: any("slow one" in last_user(r.body) for r in model.requests), 60,
                   what="the slow request")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=45)
        took = time.monotonic() - t0
        assert code == 0, (tmp_path / "daemon.log").read_text()[-3000:]
        assert took < 30, took
        assert "slow reply" in [x["text"] for x in json.loads(
            mdclaw("outbox", "list", "--json", config=cfg_path).stdout)]
        # 7. The notify messages arrived in order.
        states = notes.states()
        assert states[0] == "READY" and states[-1] == "STOPPING"
        assert states.index("RELOADING") < len(states) - 1
        assert states[states.index("RELOADING") + 1] == "READY"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        notes.done = True
        model.stop()
        bot.stop()


def test_second_sigterm_exits_at_once(tmp_path, engine, real_agent_image, install_id,
                                      reap) -> None:
    from mdclaw.config import load_config
    from mdclaw.runtime import install_labels

    model = FakeOpenAI([], fallback=lambda body: say("late", delay=6)).start()
    port = free_port()
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models: {{local: {{backend: openai, model: m, base_url: "{model.url}/v1"}}}}
        groups: {{main: {{name: Admin, jid: "hl:main", main: true}}}}
        limits: {{container_timeout: 120s, idle_timeout: 60s}}
        runtime: {{image: "{real_agent_image}", install_id: {install_id},
                  socket: "{engine.base_url}"}}
        channels: {{http: {{listen: "127.0.0.1:{port}"}}}}
        """))
    reap(install_labels(load_config(cfg_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg_path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _health(base), 60, what="the HTTP channel")
        http("POST", f"{base}/message", {"text": "take your time", "sender": "alice"})
        wait_until(lambda: model.requests, 120, what="the model request")
        proc.send_signal(signal.SIGTERM)  # a turn is in progress: the drain waits for it
        time.sleep(1)
        assert proc.poll() is None, "the first SIGTERM did not wait for the running turn"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 1
        assert time.monotonic() - t0 < 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        model.stop()


def _health(base: str) -> bool:
    try:
        return http("GET", f"{base}/health", timeout=2)["status"] == "ok"
    except OSError:
        return False
