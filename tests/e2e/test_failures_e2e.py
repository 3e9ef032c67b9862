"""A real daemon, the real agent image on the real engine, and a scripted OpenAI-compatible
model server that fails on purpose, each way in its own group: it refuses a message with 400
(context too long), answers malformed JSON, closes the connection, is down (before a run and
while a conversation is open), and is slow while the container is killed.

Each scenario checks that the chat message names the cause, how long the user waited to be
told (at most 5 s), and that the next message in the same group gets a normal answer — also
after a restart, without the failed messages being run again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from test_daemon_e2e import free_port, http, wait_until  # noqa: E402

from fake_models import FakeOpenAI, garble, hangup, refuse, say  # noqa: E402

pytestmark = pytest.mark.e2e

TOLD_WITHIN = 5.0
TIMINGS: dict[str, float] = {}


def said(turn: str) -> str:
    """What the user said in a turn: the last message of a formatted prompt, or a follow-up."""
    found = re.findall(r">([^<>]*)</message>", turn)
    return (found[-1] if found else turn).strip()


def users(body: dict[str, Any]) -> str:
    """Every user turn of a request, joined: a message that rides along is seen."""
    return "\n".join(str(m.get("content")) for m in body.get("messages", [])
                     if m.get("role") == "user")


class Script:
    """Answers by keyword anywhere in the request's user turns."""

    def __init__(self) -> None:
        self.hangups = 0
        self.slow = 0

    def __call__(self, body: dict[str, Any]):  # noqa: ANN204
        text = users(body)
        last = str([m for m in body.get("messages", []) if m.get("role") == "user"][-1]
                   .get("content"))
        if "REFUSE" in text:
            return refuse(400, "This model's maximum context length is 4096 tokens. However, "
                          "your messages resulted in 9000 tokens.", code="context_length_exceeded")
        if "GARBLE" in text:
            return garble()
        if "HANGUP" in last and self.hangups < 1:
            self.hangups += 1
            return hangup()
        if "SLOWKILL" in last and self.slow < 1:
            self.slow += 1
            return say("too late", delay=60)
        return say("normal answer: " + said(last))


def replies(base: str, jid: str) -> list[str]:
    got = http("GET", f"{base}/messages?jid={jid}&after=0")
    return [m["content"] for m in got["messages"] if m["direction"] == "out"]


def send(base: str, jid: str, text: str) -> float:
    http("POST", f"{base}/message", {"text": text, "sender": "alice", "jid": jid})
    return time.monotonic()


def next_reply(base: str, jid: str, n_before: int, timeout: float = 90) -> tuple[str, float]:
    """The first reply after the first `n_before` ones, and when it was seen."""
    got = wait_until(lambda: replies(base, jid)[n_before:], timeout, what=f"a reply in {jid}")
    return got[0], time.monotonic()


class Daemon:
    def __init__(self, cfg_path: Path, log_path: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
        env["PYTHONPATH"] = str(REPO)
        self.log = open(log_path, "a")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config",
                                      str(cfg_path)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode


def healthy(base: str) -> bool:
    try:
        return http("GET", f"{base}/health", timeout=2)["status"] == "ok"
    except OSError:
        return False


def test_each_failure_is_told_and_the_group_keeps_working(tmp_path, engine, real_agent_image,
                                                          install_id, reap) -> None:
    from mdclaw.config import load_config
    from mdclaw.runtime import GROUP_LABEL, install_labels

    script = Script()
    model = FakeOpenAI([], fallback=script).start()
    flaky = FakeOpenAI([], fallback=lambda body: say(
        "flaky is back: " + said([m for m in body["messages"] if m["role"] == "user"][-1]
                                 ["content"])))
    flaky.start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models:
          local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1"}}
          flaky: {{backend: openai, model: fake-model, base_url: "{flaky.url}/v1"}}
        groups:
          main: {{name: Admin, jid: "hl:main", main: true}}
          refuse: {{name: Refuse, jid: "hl:refuse", requires_trigger: false}}
          garble: {{name: Garble, jid: "hl:garble", requires_trigger: false}}
          hangup: {{name: Hangup, jid: "hl:hangup", requires_trigger: false}}
          down: {{name: Down, jid: "hl:down", requires_trigger: false, model: flaky}}
          kill: {{name: Kill, jid: "hl:kill", requires_trigger: false}}
        limits: {{container_timeout: 120s, idle_timeout: 40s, memory: 256m, cpus: 1.0,
                 pids: 128, run_attempts: 4, run_retry_base: 2s,
                 max_concurrent_containers: 6}}
        runtime: {{image: "{real_agent_image}", install_id: {install_id},
                  socket: "{engine.base_url}"}}
        channels: {{http: {{listen: "127.0.0.1:{port}"}}}}
        """))
    labels = install_labels(load_config(cfg_path))
    reap(labels)
    daemon = Daemon(cfg_path, tmp_path / "daemon.log")

    def log_tail() -> str:
        return (tmp_path / "daemon.log").read_text()[-4000:]

    try:
        wait_until(lambda: healthy(base), 60, what="the daemon")

        # 1. The model refuses the message for good (400, context too long): told at once,
        # not retried, and the next message gets a normal answer without it.
        t0 = send(base, "hl:refuse", "REFUSE this very long message")
        told, t1 = next_reply(base, "hl:refuse", 0)
        TIMINGS["refused (400 context too long)"] = t1 - t0
        assert "too long for the model (limit 4096 tokens)" in told, told
        assert "status 1" not in told
        refused_requests = sum("REFUSE" in users(r.body) for r in model.requests)
        assert refused_requests == 1
        send(base, "hl:refuse", "a normal question")
        answer, _ = next_reply(base, "hl:refuse", 1)
        assert answer == "normal answer: a normal question", (answer, log_tail())

        # 2. Malformed JSON: asked twice in a row, then told; not retried blindly.
        t0 = send(base, "hl:garble", "GARBLE please")
        told, t1 = next_reply(base, "hl:garble", 0)
        TIMINGS["malformed answer"] = t1 - t0
        assert "broken answer twice in a row" in told, told
        assert sum("GARBLE" in users(r.body) for r in model.requests) == 2
        send(base, "hl:garble", "and now?")
        answer, _ = next_reply(base, "hl:garble", 1)
        assert answer == "normal answer: and now?", (answer, log_tail())

        # 3. The model server closes the connection: told once that a retry is coming; the
        # retry answers the same message.
        t0 = send(base, "hl:hangup", "HANGUP on me")
        told, t1 = next_reply(base, "hl:hangup", 0)
        TIMINGS["connection closed (told, retried)"] = t1 - t0
        # run_retry_base 2s with the queue's equal jitter: the first wait is 1 to 2 s.
        assert "closed the connection without answering" in told
        assert "try again in 1 s" in told or "try again in 2 s" in told, told
        answer, _ = next_reply(base, "hl:hangup", 1)
        assert answer == "normal answer: HANGUP on me", (answer, log_tail())

        # 4a. The model server is down before a run: told, then answered once it is back.
        flaky.stop()
        t0 = send(base, "hl:down", "first while down")
        told, t1 = next_reply(base, "hl:down", 0)
        TIMINGS["model down before a run (told, retried)"] = t1 - t0
        assert f"127.0.0.1:{flaky.port} is not answering" in told and "try again" in told, told
        flaky.start()
        answer, _ = next_reply(base, "hl:down", 1)
        assert answer.startswith("flaky is back"), (answer, log_tail())
        # 4b. ... and while a conversation is open (the container from 4a still runs).
        assert any(c.labels.get(GROUP_LABEL) == "down" and c.state == "running"
                   for c in engine.list(labels))
        flaky.stop()
        t0 = send(base, "hl:down", "second while down")
        told, t1 = next_reply(base, "hl:down", 2)
        TIMINGS["model down in an open conversation (told, retried)"] = t1 - t0
        assert "is not answering" in told and "try again" in told, told
        flaky.start()
        answer, _ = next_reply(base, "hl:down", 3)
        assert answer == "flaky is back: second while down", (answer, log_tail())

        # 5. The container is killed while the model is slow: told, retried, answered.
        send(base, "hl:kill", "SLOWKILL now")
        wait_until(lambda: script.slow, 60, what="the slow request")
        (victim,) = [c for c in engine.list(labels) if c.labels.get(GROUP_LABEL) == "kill"
                     and c.state == "running"]
        t0 = time.monotonic()
        engine.kill(victim.id)
        told, t1 = next_reply(base, "hl:kill", 0)
        TIMINGS["container killed mid-turn (told, retried)"] = t1 - t0
        assert "My container was stopped while I was working on that" in told, told
        assert victim.id[:12] not in told
        answer, _ = next_reply(base, "hl:kill", 1)
        assert answer == "normal answer: SLOWKILL now", (answer, log_tail())

        for what, took in TIMINGS.items():
            assert took <= TOLD_WITHIN, (what, took, TIMINGS)

        # 6. The operator sees the failures.
        env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
        env["PYTHONPATH"] = str(REPO)
        out = subprocess.run([sys.executable, "-m", "mdclaw", "failures", "--json",
                              "--config", str(cfg_path)], capture_output=True, text=True,
                             env=env, timeout=60)
        causes = {r["cause"] for r in json.loads(out.stdout)}
        assert {"context_too_long", "model_malformed", "model_disconnected",
                "model_unreachable", "container_killed"} <= causes, out

        # 7. After a restart: every group answers its next message normally, and the
        # messages set aside are not run again.
        before = len(model.requests)
        assert daemon.stop() == 0
        daemon = Daemon(cfg_path, tmp_path / "daemon.log")
        wait_until(lambda: healthy(base), 60, what="the restarted daemon")
        for jid, n in (("hl:refuse", 2), ("hl:garble", 2), ("hl:hangup", 2), ("hl:kill", 2)):
            send(base, jid, f"after the restart {jid}")
            answer, _ = next_reply(base, jid, n)
            assert answer == f"normal answer: after the restart {jid}", (jid, answer)
        send(base, "hl:down", "after the restart down")
        answer, _ = next_reply(base, "hl:down", 4)
        assert answer == "flaky is back: after the restart down", answer
        later = model.requests[before:]
        assert not any("REFUSE" in users(r.body) or "GARBLE" in users(r.body) for r in later)
        assert len(later) == 4
    finally:
        daemon.stop()
        model.stop()
        flaky.stop()
        print("\ntime until the user was told:")
        for what, took in TIMINGS.items():
            print(f"  {what}: {took:.2f} s")
