"""The claude backend for real: the Agent SDK's bundled Claude Code CLI, driven offline
against a scripted fake Messages API on the loopback (directly and through the real
credential proxy). Skipped only where claude-agent-sdk is not installed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent_helpers import ProxyThread, RunnerProcess, write_input
from fake_models import FakeAnthropic, call, say

try:
    import claude_agent_sdk  # noqa: F401
except ImportError:  # pragma: no cover - depends on the machine
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI=true but claude-agent-sdk is not installed (make installs "
                    "'.[test,claude]')", pytrace=False)
    pytest.skip("claude-agent-sdk is not installed (pip install -e '.[claude]')",
                allow_module_level=True)

from mdclaw_agent.backends.claude import MCP_SERVER_NAME, build_options, tool_names  # noqa: E402
from mdclaw_agent.protocol import PLACEHOLDER_KEY  # noqa: E402
from mdclaw_agent.tools import ToolContext, tools_for  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    d = {k: tmp_path / k for k in ("ipc", "group", "global", "home")}
    for p in d.values():
        p.mkdir()
    (d["ipc"] / "input").mkdir()
    return d


def inp(**over) -> dict:
    d = {"prompt": "say hi", "groupFolder": "family", "chatJid": "tg:-100", "isMain": False,
         "isScheduledTask": False, "assistantName": "Andy", "backend": "claude",
         "model": "claude-sonnet-4-5"}
    d.update(over)
    return d


def run(dirs, body: dict, base_url: str | None) -> RunnerProcess:
    env = {"HOME": str(dirs["home"])}
    if base_url:
        env["MDCLAW_MODEL_BASE_URL"] = base_url
    return RunnerProcess(body, ipc_dir=dirs["ipc"], group_dir=dirs["group"],
                         global_dir=dirs["global"], env=env)


def test_options_wiring(dirs) -> None:
    ctx = ToolContext(ipc_dir=dirs["ipc"], group_folder="family", chat_jid="tg:1",
                      is_main=False, group_dir=dirs["group"])
    tools = tools_for(False)
    opts = build_options(model="claude-x", system="SYSTEM TEXT", tools=tools, ctx=ctx,
                         cwd=dirs["group"], resume="abc", env={"ANTHROPIC_BASE_URL": "u"},
                         extra_dirs=[dirs["global"], dirs["home"] / "missing"])
    assert opts.cwd == str(dirs["group"]) and opts.resume == "abc" and opts.model == "claude-x"
    assert opts.permission_mode == "bypassPermissions"
    assert opts.system_prompt["append"] == "SYSTEM TEXT"
    assert set(opts.mcp_servers) == {MCP_SERVER_NAME}
    assert opts.mcp_servers[MCP_SERVER_NAME]["type"] == "sdk"
    assert opts.allowed_tools == tool_names(tools)
    assert "mcp__mdclaw__send_message" in opts.allowed_tools
    assert "mcp__mdclaw__register_group" not in opts.allowed_tools
    assert opts.add_dirs == [str(dirs["global"])]
    # No network in the container: the CLI's own web tools are off; ours ask the host.
    assert set(opts.disallowed_tools) == {"WebFetch", "WebSearch"}


def test_cli_tool_call_follow_up_close_and_resume(dirs) -> None:
    (dirs["group"] / "CLAUDE.md").write_text("GROUP-MEMORY: the family likes tomatoes")
    (dirs["global"] / "CLAUDE.md").write_text("GLOBAL-MEMORY: answer in German")
    script = [call("mcp__mdclaw__send_message", text="hello from claude"),
              say("first answer"), say("second answer")]
    with FakeAnthropic(script) as api:
        r = run(dirs, inp(), api.url)
        first = r.wait_results(1, timeout=120)[0]
        assert first["status"] == "success" and first["result"] == "first answer"
        sid = first["newSessionId"]
        msgs = [json.loads(p.read_text()) for p in (dirs["ipc"] / "messages").glob("*.json")]
        assert msgs == [{"type": "message", "chat_jid": "tg:-100", "text": "hello from claude"}]
        write_input(dirs["ipc"] / "input", {"sender": "tg:42", "sender_name": "Alice",
                                            "content": "and now?", "timestamp": "x"},
                    "1700000000000-a.json")
        second = r.wait_results(2, timeout=120)[1]
        assert second == {"status": "success", "result": "second answer", "newSessionId": sid}
        write_input(dirs["ipc"] / "input", None, "_close")
        assert r.wait_exit(60) == 0
        reqs = [q for q in api.requests if q.path == "/v1/messages"]
    body = json.dumps(reqs[0].body)
    assert "GROUP-MEMORY" in body and "GLOBAL-MEMORY" in body
    assert body.count("GROUP-MEMORY") == 1  # not loaded a second time from disk
    tools = {t["name"] for t in reqs[0].body["tools"]}
    assert "mcp__mdclaw__send_message" in tools and "mcp__mdclaw__register_group" not in tools
    assert all(q.headers.get("x-api-key") == PLACEHOLDER_KEY for q in reqs)
    # The tool result went back to the model in the next request.
    assert "queued for delivery" in json.dumps(reqs[1].body)

    # A new container with the session id resumes the conversation.
    with FakeAnthropic([say("resumed")]) as api:
        r = run(dirs, inp(sessionId=sid, isScheduledTask=True, prompt="again"), api.url)
        assert r.wait_exit(120) == 0
        assert r.results[0] == {"status": "success", "result": "resumed", "newSessionId": sid}
        history = json.dumps(api.requests[-1].body["messages"])
    assert "first answer" in history and "second answer" in history


def test_cli_missing_session_starts_fresh_and_main_sees_group_tools(dirs) -> None:
    with FakeAnthropic([say("fresh start")]) as api:
        r = run(dirs, inp(sessionId="00000000-0000-4000-8000-000000000000", isMain=True,
                          isScheduledTask=True), api.url)
        assert r.wait_exit(120) == 0
        res = r.results[0]
        tools = {t["name"] for t in api.requests[-1].body["tools"]}
    assert res["status"] == "success" and res["result"] == "fresh start"
    assert res["newSessionId"] != "00000000-0000-4000-8000-000000000000"
    assert {"mcp__mdclaw__register_group", "mcp__mdclaw__list_groups"} <= tools


def test_cli_through_proxy_gets_real_key(tmp_path: Path) -> None:
    from mdclaw.models import Upstream
    from mdclaw.paths import Layout

    layout = Layout(tmp_path / "d")
    ipc = layout.group_ipc_dir("family")
    (ipc / "input").mkdir(parents=True)
    group = layout.group_dir("family")
    group.mkdir(parents=True)
    home = tmp_path / "home"
    home.mkdir()
    key = tmp_path / "key"
    key.write_text("sk-ant-api03-REALKEY")
    key.chmod(0o600)
    proxy = ProxyThread(layout)
    try:
        with FakeAnthropic([say("via proxy")], usage=(40, 8)) as api:
            proxy.start_group("family", Upstream("claude", "claude-sonnet-4-5", api.url, key))
            r = RunnerProcess(inp(isScheduledTask=True), ipc_dir=ipc, group_dir=group,
                              env={"HOME": str(home)})
            assert r.wait_exit(120) == 0, r.stderr_lines[-20:]
            reqs = [q for q in api.requests if q.path == "/v1/messages"]
        assert r.results[0]["result"] == "via proxy"
        assert reqs and all(q.headers["x-api-key"] == "sk-ant-api03-REALKEY" for q in reqs)
        stats = proxy.proxy.ledger.stats["family"]
        assert stats["requests"] >= 1 and stats["input_tokens"] >= 40
    finally:
        proxy.close()
    leaked = [p for p in home.rglob("*") if p.is_file() and b"REALKEY" in p.read_bytes()]
    assert leaked == []


def test_cli_keeps_its_own_tools_and_gets_web_tools_through_the_host(dirs) -> None:
    """The CLI offers the model its own file and shell tools plus the mdclaw IPC, memory
    and web tools (not its network-needing WebFetch/WebSearch, not our file tools); a
    web_fetch call becomes an action request that a stand-in host answers."""
    import threading
    import time

    from mdclaw_agent.ipc import write_json_atomic

    stop = threading.Event()
    asked: list[dict] = []

    def host() -> None:
        actions = dirs["ipc"] / "actions"
        while not stop.is_set():
            for p in sorted(actions.glob("*.json")) if actions.is_dir() else []:
                body = json.loads(p.read_text())
                p.unlink()
                asked.append(body)
                write_json_atomic(dirs["ipc"] / "action_results", {
                    "requestId": body["request_id"], "status": "success",
                    "result": {"final_url": body["params"]["url"], "status": 200,
                               "content_type": "text/html", "text": "PAGE-TEXT-42"}},
                    f"{body['request_id']}.json")
            time.sleep(0.01)

    thread = threading.Thread(target=host, daemon=True)
    thread.start()
    script = [call("mcp__mdclaw__web_fetch", url="https://example.test/page"), say("fetched")]
    try:
        with FakeAnthropic(script) as api:
            r = run(dirs, inp(isScheduledTask=True), api.url)
            assert r.wait_exit(120) == 0, r.stderr_lines[-20:]
            reqs = [q for q in api.requests if q.path == "/v1/messages"]
    finally:
        stop.set()
        thread.join(5)
    assert r.results[0]["result"] == "fetched"
    tools = {t["name"] for t in reqs[0].body["tools"]}
    assert {"mcp__mdclaw__web_fetch", "mcp__mdclaw__web_search",
            "mcp__mdclaw__memory_search", "Bash", "Read", "Edit", "Write"} <= tools
    assert not {"WebFetch", "WebSearch", "mcp__mdclaw__read_file",
                "mcp__mdclaw__bash"} & tools
    assert [(b["action"], b["params"]) for b in asked] == [
        ("web_fetch", {"url": "https://example.test/page"})]
    assert "PAGE-TEXT-42" in json.dumps(reqs[1].body)
