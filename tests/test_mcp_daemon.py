"""MCP through a real daemon (in this process, no container engine): agents' `mcp_call`
requests written into their IPC folders as the runner writes them, answered by the daemon's
IPC loop (the check) and action worker (the call) from real MCP servers the daemon started;
refusals, hostile servers and a reload, each a clear result and the daemon fine; the secret
of `env_files` nowhere under data_dir, in no result and no log line; the operator page's view
and /metrics; the servers stopped at shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from mcp_helpers import git_repo, servers_bin, servers_yaml
from mdclaw.config import load_config
from mdclaw.daemon.core import Daemon
from mdclaw.operator import views
from mdclaw.operator.metrics import render
from waiting import wait_until_async

SECRET = "sw0rdfish-" + "d4e5f6a7b8"

BASE = """\
data_dir: {data}
assistant: {{name: Andy, timezone: UTC}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true,
          mcp: {{time: ['*'], hostile: ['*'], stuck: [hang],
                     git: [git_status]}}}}
  family: {{name: Family, jid: "hl:family", mcp: {{time: [get_current_time]}},
            actions: []}}
  work: {{name: Work, jid: "hl:work"}}
runtime: {{socket: "unix://{tmp}/no-engine.sock", image: "mdclaw-agent:mcp-test"}}
server: {{listen: "127.0.0.1:0"}}
limits: {{action_jobs: 8, action_jobs_per_group: 4}}
"""


def request(data: Path, group: str, tool: str, server: str, **arguments: Any) -> str:
    """Write an mcp_call request as the agent runner does (temp name, then rename)."""
    rid = f"req-{secrets.token_hex(6)}"
    folder = data / "ipc" / group / "actions"
    folder.mkdir(parents=True, exist_ok=True)
    body = {"type": "action", "request_id": rid, "action": "mcp_call",
            "params": {"server": server, "tool": tool, "arguments": arguments}}
    tmp = folder / f".{rid}.tmp"
    tmp.write_text(json.dumps(body))
    tmp.rename(folder / f"{rid}.json")
    return rid


async def result(data: Path, group: str, rid: str, timeout: float = 30) -> dict[str, Any]:
    path = data / "ipc" / group / "action_results" / f"{rid}.json"
    await wait_until_async(path.exists, timeout, what=f"the result of {rid}")
    body: dict[str, Any] = json.loads(path.read_text())
    return body


def text(body: dict[str, Any]) -> str:
    assert body["status"] == "success", body
    return "\n".join(b.get("text", "") for b in body["result"]["content"])


def test_mcp_through_a_real_daemon(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    bin_dir = servers_bin()
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    repo = git_repo(tmp_path / "repo")
    data = tmp_path / "data"
    path = tmp_path / "config.yaml"
    config_text = BASE.format(data=data, tmp=tmp_path) + servers_yaml(
        bin_dir, tmp_path, secret_file=secret, repo=repo)
    path.write_text(config_text)

    async def go() -> None:
        d = Daemon(load_config(path), str(path), drain_timeout=1)
        ready = asyncio.Event()
        d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
        task = asyncio.create_task(d.run())
        await asyncio.wait_for(ready.wait(), 30)
        try:
            assert d.mcp is not None and await d.mcp.wait_up(60), d.mcp.status()
            snap = data / "ipc" / "main" / "mcp_tools.json"

            def offered(group: str) -> list[str]:
                try:
                    body = json.loads((data / "ipc" / group / "mcp_tools.json").read_text())
                except (OSError, ValueError):
                    return []
                return [t["name"] for t in body["tools"]]
            # Each server's listing rewrites every group's snapshot (coalesced, one group
            # after another), so one written before the last server was up can still be
            # there: wait for the state with every server's tools.
            await wait_until_async(
                lambda: {"git__git_status", "hostile__echo", "stuck__hang",
                         "time__get_current_time"} <= set(offered("main")) and
                offered("family") == ["time__get_current_time"], 20,
                what="the snapshots with every server's tools")
            assert "hostile__echo" in offered("main") and "git__git_log" not in offered("main")
            assert offered("family") == ["time__get_current_time"]
            assert offered("work") == []
            assert SECRET not in snap.read_text()

            ok = request(data, "main", "get_current_time", "time", timezone="Asia/Tokyo")
            fam = request(data, "family", "get_current_time", "time", timezone="UTC")
            gst = request(data, "main", "git_status", "git", repo_path=str(repo))
            assert '"timezone": "Asia/Tokyo"' in text(await result(data, "main", ok))
            assert '"timezone": "UTC"' in text(await result(data, "family", fam))
            assert "notes.txt" in text(await result(data, "main", gst))

            # Refused on the loop, before anything is queued: each names its rule.
            refusals = {
                "not allowed": (request(data, "family", "convert_time", "time",
                                        source_timezone="UTC", time="10:00",
                                        target_timezone="UTC"),
                                "family", "groups.family.mcp.time (get_current_time) matches "
                                "no such tool"),
                "not assigned": (request(data, "work", "get_current_time", "time",
                                         timezone="UTC"),
                                 "work", "groups.work.mcp has no 'time'"),
                "schema": (request(data, "main", "strict", "hostile", count="many"),
                           "main", "break its input schema"),
            }
            for what, (rid, group, words) in refusals.items():
                body = await result(data, group, rid)
                assert body["status"] == "error" and words in body["error"], (what, body)
            # Hostile servers: each a clear result, the daemon fine.
            hang = request(data, "main", "hang", "stuck")
            garbage = request(data, "main", "garbage", "hostile")
            leak = request(data, "main", "env", "hostile", name="SECRET_TOKEN")
            assert text(await result(data, "main", garbage)) == "answered after garbage"
            assert text(await result(data, "main", leak)) == "SECRET_TOKEN=[secret]"
            # After the garbage: stdout is one stream, so garbage printed while the 50 MB
            # answer is written runs the two into one over-long line, and that line's error
            # goes to the first call it names (the garbage one) instead.
            big = request(data, "main", "big", "hostile", megabytes=50)
            body = await result(data, "main", big)
            assert body["status"] == "error" and "over its max_result_bytes" in body["error"]
            body = await result(data, "main", hang)
            assert body["status"] == "error" and "got no result within 3 s" in body["error"]
            die = request(data, "main", "die", "hostile")
            body = await result(data, "main", die)
            assert body["status"] == "error" and "exited with status 3" in body["error"]
            again = request(data, "main", "echo", "hostile", text="I am back")
            assert text(await result(data, "main", again, 60)) == "I am back"

            # What the operator sees.
            page = views.mcp(d)
            servers = {s["server"]: s for s in page["servers"]}
            assert servers["time"]["state"] == "up"
            assert {"name": "get_current_time", "needs_approval": False} in \
                servers["time"]["tools"]
            assert {"name": "die", "needs_approval": True} in servers["hostile"]["tools"]
            assert servers["hostile"]["restarts"] >= 1
            outcomes = {(c["tool"], c["outcome"]) for c in page["recent"]}
            assert {("big", "too_large"), ("hang", "timeout"), ("die", "crashed"),
                    ("git_status", "ok")} <= outcomes
            scrape = (await render(d)).decode()
            assert 'mdclaw_mcp_calls_total{outcome="too_large",server="hostile",tool="big"}' \
                in scrape
            assert 'mdclaw_mcp_server_up{server="time"} 1.0' in scrape
            assert 'mdclaw_mcp_call_seconds_count{server="time",tool="get_current_time"}' \
                in scrape

            # A reload that takes the time server from the family: its snapshot follows.
            path.write_text(config_text.replace("mcp: {{time: [get_current_time]}}".replace(
                "{{", "{").replace("}}", "}"), "mcp: {}"))
            assert await d.reload()
            await wait_until_async(lambda: offered("family") == [], 20,
                                   what="the family's snapshot after the reload")
            late = request(data, "family", "get_current_time", "time", timezone="UTC")
            body = await result(data, "family", late)
            assert body["status"] == "error" and "groups.family.mcp has no 'time'" in \
                body["error"]
            pids = [st.client.transport.proc.pid for st in d.mcp.servers.values()
                    if st.client is not None and hasattr(st.client.transport, "proc")]
            assert pids
        finally:
            d.stop_event.set()
            assert await asyncio.wait_for(task, 60) == 0
        for pid in pids:  # every server stopped with the daemon
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)

    asyncio.run(go())
    # The secret: in no file under data_dir (results, snapshots, database) and no log line.
    for root, _dirs, files in os.walk(data):
        for name in files:
            p = Path(root) / name
            assert SECRET.encode() not in p.read_bytes(), p
    assert SECRET not in caplog.text
