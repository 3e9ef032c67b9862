"""MCP end to end: a real `mdclaw run` starts mcp-server-time (from the package registry) on
the host; a message on the HTTP channel starts the real agent image on the real engine; the
scripted model (openai backend) calls `time__get_current_time`, which the runner offers from
the host's snapshot, and gets the server's answer back through the container's IPC folder.
A call the group may not make is refused with the rule; the container holds no secret."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from fake_models import FakeOpenAI, call, say  # noqa: E402
from mcp_helpers import servers_bin  # noqa: E402

pytestmark = pytest.mark.e2e


def test_the_model_calls_an_mcp_tool_from_its_container(tmp_path, engine, real_agent_image,
                                                        install_id, reap) -> None:
    from test_daemon_e2e import free_port, http, replies, wait_until
    from test_failures_e2e import Daemon, healthy

    from mdclaw.config import load_config
    from mdclaw.runtime import install_labels

    bin_dir = servers_bin()
    secret = tmp_path / "secret"
    secret.write_text("e2e-s3cret-value\n")
    secret.chmod(0o600)
    offered: list[list[str]] = []

    def answer(body: dict):  # noqa: ANN202 - a fake model's Step
        offered.append([t["function"]["name"] for t in body.get("tools", [])])
        last = body["messages"][-1]
        if last.get("role") == "tool":
            return say("tool said: " + last["content"])
        text = str(last.get("content"))
        if "convert" in text:
            return call("time__convert_time", source_timezone="UTC", time="10:00",
                        target_timezone="Asia/Tokyo")
        if "bad" in text:
            return call("time__get_current_time", timezone=12)
        if "secret" in text:
            return call("bash", command="env; cat /workspace/ipc/mcp_tools.json")
        return call("time__get_current_time", timezone="Europe/Berlin")

    model = FakeOpenAI([], fallback=answer).start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        data_dir: {tmp_path / 'data'}
        assistant: {{name: Andy, timezone: UTC, model: local}}
        models: {{local: {{backend: openai, model: fake-model, base_url: "{model.url}/v1"}}}}
        groups: {{main: {{name: Admin, jid: "hl:main", main: true,
                         mcp: {{time: [get_current_time]}}}}}}
        mcp_servers:
          time: {{command: "{bin_dir / 'mcp-server-time'}", args: [--local-timezone, UTC],
                  env_files: {{UNUSED_TOKEN: "{secret}"}}}}
        limits: {{container_timeout: 120s, idle_timeout: 30s, memory: 256m, cpus: 1.0,
                 pids: 128}}
        runtime: {{image: "{real_agent_image}", install_id: {install_id},
                  socket: "{engine.base_url}"}}
        channels: {{http: {{listen: "127.0.0.1:{port}"}}}}
        """))
    reap(install_labels(load_config(cfg_path)))
    daemon = Daemon(cfg_path, tmp_path / "daemon.log")
    snapshot = tmp_path / "data" / "ipc" / "main" / "mcp_tools.json"

    def said(text: str) -> str:
        before = len(replies(base, "hl:main"))
        http("POST", f"{base}/message", {"text": text, "sender": "alice"})
        got = wait_until(lambda: replies(base, "hl:main")[before:], 120,
                         what=f"a reply to {text!r}")
        return got[0]

    try:
        wait_until(lambda: healthy(base), 60, what="the HTTP channel")
        wait_until(lambda: snapshot.exists() and "time__get_current_time" in
                   snapshot.read_text(), 60, what="the MCP tool snapshot")
        got = said("what time is it in Berlin?")
        assert got.startswith("tool said: "), got
        answer_json = json.loads(got.removeprefix("tool said: "))
        assert answer_json["timezone"] == "Europe/Berlin" and "datetime" in answer_json
        assert "time__get_current_time" in offered[0]
        assert "time__convert_time" not in offered[0]  # not allowed: never offered
        # Asked for anyway (the model invents it): refused by the host, naming the rule.
        refused = said("convert 10:00 to Tokyo")
        assert "no tool named 'time__convert_time'" in refused or \
            "matches no such tool" in refused, refused
        # Arguments that break the schema never leave the container.
        bad = said("bad arguments please")
        assert "timezone must be string" in bad, bad
        # The container sees the offer, never the server's secret.
        seen = said("show me a secret")
        assert "time__get_current_time" in seen and "e2e-s3cret-value" not in seen
    finally:
        code = daemon.stop()
        model.stop()
    log = (tmp_path / "daemon.log").read_text()
    assert code == 0, log[-3000:]
    assert "e2e-s3cret-value" not in log
