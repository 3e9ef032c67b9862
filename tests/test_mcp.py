"""The host's MCP client and hub (mdclaw.mcp): the pure rules (framing cap, names, who may call
what, approval, result conversion), then real servers started by the hub: mcp-server-time and
mcp-server-git from the package registry, and tests/mcp_servers/hostile.py for every failure
path (a tool not allowed, a server not assigned, arguments that break the schema, a 50 MB
result, a server that never answers, one that dies mid-call, one that prints garbage on
stdout, one that echoes its secret environment, one that asks for the model, one that
floods unasked messages)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
from pathlib import Path

import pytest

from mcp_helpers import HOSTILE, git_repo, servers_bin, servers_yaml
from mdclaw.config import Config, check_programs, load_config
from mdclaw.mcp import policy
from mdclaw.mcp.client import McpClient
from mdclaw.mcp.convert import convert, redactor
from mdclaw.mcp.hub import McpHub
from mdclaw.mcp.policy import ToolEntry
from mdclaw.mcp.transport import READ_CHUNK, STDERR_TAIL, StdioTransport
from mdclaw.mcp.wire import (
    CallTimeout,
    LineFramer,
    Oversize,
    ProtocolFailure,
    Refused,
    ServerCrashed,
    TooLarge,
    id_in_head,
)
from mdclaw.retry import Backoff

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "container" / "agent-runner"))

# --------------------------------------------------------------------------- framing


def test_a_line_over_the_cap_is_skipped_unread_and_its_id_found() -> None:
    f = LineFramer(1000)
    head = b'{"jsonrpc":"2.0","id":7,"result":{"content":[{"type":"text","text":"'
    out = f.feed(head)
    assert out == []
    for _ in range(50 * 1024):  # 50 MiB in 1 KiB pieces: the framer never holds more
        assert f.feed(b"x" * 1024) == []
        assert f.pending() > 1000 or f.pending() <= 1000
    out = f.feed(b'"}]}}\n{"jsonrpc":"2.0","id":8,"result":{}}\n')
    assert isinstance(out[0], Oversize) and out[0].size > 50 * 1024 * 1024
    assert out[0].request_id() == 7 and len(out[0].head) <= 4096
    assert json.loads(out[1]) == {"jsonrpc": "2.0", "id": 8, "result": {}}
    assert len(f._buf) == 0  # nothing of the big line was kept


def test_ids_are_read_only_before_any_nested_object() -> None:
    assert id_in_head(b'{"jsonrpc":"2.0","id":"a-1","result":{}}') == "a-1"
    assert id_in_head(b'{"result":{"id":5},"id":6}') is None
    assert id_in_head(b"garbage") is None
    # Garbage a server printed without a newline, then the answer on the same line: the
    # answer's id is still found (else every call in flight would get its oversize error).
    assert id_in_head(b'half a line: {"jsonrpc":"2.0","id":9,"result":{"content":[') == 9
    assert id_in_head(b'junk {"jsonrpc":"2.0","result":{"id":5},"id":6}') is None


def test_lines_split_anywhere_come_out_whole() -> None:
    f = LineFramer(100)
    msg = b'{"jsonrpc":"2.0","method":"x"}\n'
    got = []
    for i in range(len(msg)):
        got += f.feed(msg[i:i + 1])
    assert got == [msg.strip()]


# --------------------------------------------------------------------------- policy

def cfg_with(**mcp: list[str]) -> Config:
    return Config(mcp_servers={"time": {"command": "x"}, "git": {
        "command": "y", "approve": {"always": ["git_commit"], "never": ["git_add"]}}},
        groups={"main": {"name": "A", "jid": "hl:1", "main": True, "mcp": mcp},
                "kids": {"name": "K", "jid": "hl:2"}})


TIME = [ToolEntry("time", "get_current_time", "now", {"type": "object"},
                  {"readOnlyHint": True}),
        ToolEntry("time", "convert_time", "convert", {"type": "object"})]


def test_who_may_call_what_names_the_rule() -> None:
    cfg = cfg_with(time=["get_*"])
    assert policy.refusal(cfg, "main", "time", "get_current_time", TIME) is None
    assert "groups.main.mcp.time (get_*) matches no such tool" in \
        policy.refusal(cfg, "main", "time", "convert_time", TIME)
    assert "is not assigned to group 'kids': groups.kids.mcp has no 'time'" in \
        policy.refusal(cfg, "kids", "time", "get_current_time", TIME)
    assert "there is no MCP server 'nope'" in policy.refusal(cfg, "main", "nope", "x", None)
    assert "has no tool 'get_weather'" in policy.refusal(cfg, "main", "time", "get_weather",
                                                         TIME)
    assert [t.offered for t in policy.allowed_tools(cfg, "main", {"time": TIME})] == [
        "time__get_current_time"]
    snap = policy.snapshot(cfg, "main", {"time": TIME})
    assert snap["tools"][0]["name"] == "time__get_current_time"
    assert snap["tools"][0]["timeout"] == 75.0
    assert policy.snapshot(cfg, "kids", {"time": TIME}) == {"version": 1, "tools": []}


def test_needs_approval_by_annotations_and_config() -> None:
    cfg = cfg_with()
    ro = {"readOnlyHint": True}
    assert policy.needs_approval(cfg, "time", "t", ro) is False
    assert policy.needs_approval(cfg, "time", "t", {}) is True  # no hint: not read-only
    assert policy.needs_approval(cfg, "time", "t", {"readOnlyHint": False}) is True
    assert policy.needs_approval(cfg, "time", "t", {**ro, "destructiveHint": True}) is True
    assert policy.needs_approval(cfg, "git", "git_commit", ro) is True  # tightened
    assert policy.needs_approval(cfg, "git", "git_add", {}) is False  # loosened
    assert policy.needs_approval(cfg, "nope", "t", ro) is True  # unknown server
    # the reason names what says so: it is the rule name on the owner's card
    assert policy.approval_reason(cfg, "time", "t", ro) is None
    assert policy.approval_reason(cfg, "time", "t", {}) == \
        "mcp_servers.time: tool annotations (not read-only)"
    assert policy.approval_reason(cfg, "time", "t", {**ro, "destructiveHint": True}) == \
        "mcp_servers.time: tool annotations (destructive)"
    assert policy.approval_reason(cfg, "git", "git_commit", ro) == \
        "mcp_servers.git.approve.always"


def test_approvals_rules_lists_the_mcp_default_the_daemon_decides_with(tmp_path: Path,
                                                                      cli) -> None:
    """`mdclaw approvals rules` shows, after a group's rules, the default that holds an MCP
    call no rule matched, per server the group may use, in the order it is tried; each step
    says what approval_reason (the daemon's decision) says for a tool it applies to."""
    from mdclaw.ops.approvals import rules_for_groups

    data = tmp_path / "data"
    cfgfile = tmp_path / "config.yaml"
    cfgfile.write_text(
        f"data_dir: {data}\n"
        "people:\n  olga: {name: Olga, role: owner, identities: {http: [o]}}\n"
        "mcp_servers:\n  time: {command: x}\n"
        "  git: {command: y, approve: {always: [git_commit], never: [git_add, git_log]}}\n"
        "groups:\n  main: {name: A, jid: 'hl:1', main: true,\n"
        "         mcp: {time: ['*'], git: [git_status, git_commit, git_add]}}\n"
        "  kids: {name: K, jid: 'hl:2'}\n")
    cfg = load_config(cfgfile)
    listing = rules_for_groups(cfg)
    assert [r for r in listing["kids"] if r.get("default")] == []  # no MCP tools: nothing
    mcp = [r for r in listing["main"] if r.get("default")]
    assert listing["main"][-len(mcp):] == mcp  # after the rules: tried when none matched
    assert [(r["args"]["server"], r["args"]["tool"], r["when"], r["approver"]) for r in mcp] == [
        ("git", "git_commit", None, "owner"),
        ("git", "git_add", None, "none"), ("git", "git_log", None, "none"),
        ("git", "*", "destructiveHint: true", "owner"),
        ("git", "*", "readOnlyHint not true", "owner"),
        ("git", "*", "readOnlyHint: true", "none"),
        ("time", "*", "destructiveHint: true", "owner"),
        ("time", "*", "readOnlyHint not true", "owner"),
        ("time", "*", "readOnlyHint: true", "none")]
    # each step is what the daemon decides for a tool it is the first to apply to
    examples = {None: {}, "destructiveHint: true": {"readOnlyHint": True,
                                                   "destructiveHint": True},
                "readOnlyHint not true": {}, "readOnlyHint: true": {"readOnlyHint": True}}
    for r in mcp:
        server, tool = r["args"]["server"], r["args"]["tool"]
        name = "git_status" if tool == "*" and server == "git" else tool.replace("*", "t")
        why = policy.approval_reason(cfg, server, name, examples[r["when"]])
        assert why == (r["source"] if r["approver"] == "owner" else None), r
    assert mcp[4]["describe"] == (
        "mcp_servers.git: tool annotations (not read-only): action mcp_call, any tool (of "
        "git_status, git_commit, git_add) of git whose annotations say readOnlyHint not true "
        "-> owner (when no rule matches)")
    # the command line shows the same
    out = cli("approvals", "rules", "-g", "main", "--config", str(cfgfile))
    assert out.returncode == 0, out.stderr
    assert "mcp_servers.time: tool annotations (not read-only): action mcp_call, any tool of " \
        "time whose annotations say readOnlyHint not true -> owner (when no rule matches)" \
        in out.stdout
    js = json.loads(cli("approvals", "rules", "--json", "--config", str(cfgfile)).stdout)
    assert [r for r in js["main"] if r.get("default")] == mcp
    # without an owner nothing holds a call by default, and nothing is listed
    cfgfile.write_text(cfgfile.read_text().replace("role: owner", "role: admin")
                       + "approvals: {defaults: false}\n")
    assert not any(r.get("default") for r in rules_for_groups(load_config(cfgfile))["main"])


def test_tools_a_model_api_would_refuse_are_not_offered() -> None:
    ok = {"name": "fine", "inputSchema": {"type": "object"}}
    tools = [ok, {"name": "has.dot", "inputSchema": {}}, {"name": "x" * 70, "inputSchema": {}},
             {"name": "arr", "inputSchema": {"type": "array"}},
             {"name": "bad", "inputSchema": {"type": "object", "minLength": "three"}}, ok]
    entries, problems = policy.entries("srv", tools)
    assert [e.name for e in entries] == ["fine"]
    assert len(problems) == 5 and "listed twice" in problems[-1]
    assert "characters model APIs refuse" in problems[0]


def test_arguments_are_checked_with_the_schema_draft() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1},
                                               "when": {"type": "string", "pattern": "^2"}},
              "required": ["n"], "additionalProperties": False}
    assert policy.argument_problems(schema, {"n": 2, "when": "2026"}) == []
    problems = policy.argument_problems(schema, {"n": 0, "when": "x", "extra": 1})
    assert len(problems) == 3 and any(p.startswith("n: 0 is less than") for p in problems)


def test_a_config_names_only_servers_that_exist(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("data_dir: /tmp/x\ngroups:\n  main: {name: A, jid: 'hl:1', main: true,"
                    " mcp: {nope: ['*']}}\nmcp_servers:\n  both: {command: x, url: "
                    "'http://a'}\n  Bad__Name: {command: x}\n")
    with pytest.raises(Exception) as e:
        load_config(path)
    text = str(e.value)
    assert "give exactly one of command" in text and "Bad__Name" in text
    path.write_text("data_dir: /tmp/x\ngroups:\n  main: {name: A, jid: 'hl:1', main: true,"
                    " mcp: {nope: ['*']}}\nmcp_servers:\n  time: {command: x}\n")
    with pytest.raises(Exception, match="'nope' is not in mcp_servers \\(known: time\\)"):
        load_config(path)
    # A stdio server's program must be there (check-config's host check, as for Chromium).
    bin_dir = servers_bin()
    path.write_text(f"data_dir: {tmp_path / 'd'}\ngroups: {{}}\nmcp_servers:\n"
                    f"  time: {{command: \"{bin_dir / 'mcp-server-time'}\"}}\n"
                    "  gone: {command: /nonexistent/mcp-server}\n"
                    "  named: {command: no-such-mcp-server-here}\n"
                    "  web: {url: 'http://127.0.0.1:1/mcp'}\n")
    problems = check_programs(load_config(path))
    assert [p.split(":")[0] for p in problems] == ["mcp_servers.gone.command",
                                                   "mcp_servers.named.command"], problems
    assert "install the server, or give its path" in problems[0]


# --------------------------------------------------------------------------- conversion

def test_results_are_converted_redacted_and_capped() -> None:
    saved = []

    def save(data: bytes, mime: str, name: str) -> str:
        saved.append((data, mime, name))
        return f"/workspace/group/mcp/day/{name}"

    result = {"content": [
        {"type": "text", "text": "token is hunter22-secret"},
        {"type": "image", "mimeType": "image/png", "data": base64.b64encode(b"PNG").decode()},
        {"type": "resource", "resource": {"uri": "file:///a", "text": "A" * 50}},
        {"type": "resource_link", "uri": "file:///b", "name": "b"},
        {"type": "weird"}], "isError": True}
    out = convert("s", "t", result, max_chars=40, save=save,
                  redact=redactor(["hunter22-secret"]))
    assert out["isError"] is True and out["truncated"] is True
    assert out["content"][0]["text"] == "token is [secret]"
    assert out["content"][1]["path"] == "/workspace/group/mcp/day/s-t-2.png"
    assert saved[0][0] == b"PNG"
    assert len(out["content"][2]["text"]) < 50
    # The secret's other spellings: inside base64 text, percent-encoded; a short one.
    echo = b"x-token: hunter22-secret"
    forms = {"content": [{"type": "text", "text": base64.b64encode(echo).decode()},
                         {"type": "text", "text": "?t=hunter22%2Fsecret&pin=4711"}]}
    out = convert("s", "t", forms, max_chars=1000, save=None,
                  redact=redactor(["hunter22-secret", "hunter22/secret", "4711", "ab"]))
    assert "hunter22" not in str(out) and "4711" not in str(out)
    assert "[secret]" in out["content"][0]["text"]
    assert out["content"][1]["text"] == "?t=[secret]&pin=[secret]"
    assert redactor(["ab"])("ab cd") == "ab cd"  # too short to be told from text
    structured = convert("s", "t", {"content": [], "structuredContent": {"a": 1}},
                         max_chars=100, save=None, redact=redactor([]))
    assert structured["content"] == [{"type": "text", "text": '{"a": 1}'}]


# --------------------------------------------------------------------------- real servers


def hub_config(tmp_path: Path, **kw: object) -> Config:
    bin_dir = servers_bin()
    secret = tmp_path / "secret"
    secret.write_text("sw0rdfish-very-secret\n")
    secret.chmod(0o600)
    repo = git_repo(tmp_path / "repo")
    text = (f"data_dir: {tmp_path / 'data'}\n"
            "groups:\n"
            "  main: {name: A, jid: 'hl:1', main: true, mcp: {time: ['*'], git: ['git_status',"
            " 'git_log'], hostile: ['*'], stuck: [hang]}}\n"
            "  kids: {name: K, jid: 'hl:2', mcp: {time: [get_current_time]}}\n"
            + servers_yaml(bin_dir, tmp_path, secret_file=secret, repo=repo, **kw))
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(path)


def call(hub: McpHub, folder: str, server: str, tool: str, **arguments: object):  # noqa: ANN201
    return hub.call(folder, {"server": server, "tool": tool, "arguments": arguments})


def text_of(result: dict) -> str:
    return "\n".join(b.get("text", "") for b in result["content"])


def test_real_servers_through_the_hub(tmp_path: Path) -> None:
    cfg = hub_config(tmp_path)
    (tmp_path / "data" / "ipc" / "main").mkdir(parents=True)
    (tmp_path / "data" / "groups" / "main").mkdir(parents=True)

    async def go() -> None:
        hub = McpHub(cfg, backoff=Backoff(base=0.2, cap=0.5, jitter=0))
        await hub.start()
        try:
            assert await hub.wait_up(60), hub.status()
            # The time server: nobody here wrote it.
            r = await call(hub, "main", "time", "get_current_time", timezone="Europe/Berlin")
            assert r["isError"] is False and '"timezone": "Europe/Berlin"' in text_of(r)
            # The git server on a repository made here.
            r = await call(hub, "main", "git", "git_status", repo_path=str(tmp_path / "repo"))
            assert "notes.txt" in text_of(r), r
            # Refusals, each naming the rule.
            with pytest.raises(Refused, match="groups.kids.mcp has no 'hostile'"):
                await call(hub, "kids", "hostile", "echo", text="x")
            with pytest.raises(Refused, match=r"groups.kids.mcp.time \(get_current_time\) "
                                              "matches no such tool"):
                await call(hub, "kids", "time", "convert_time")
            with pytest.raises(Refused, match="git_commit"):
                await call(hub, "main", "git", "git_commit", repo_path="x", message="m")
            with pytest.raises(Refused, match="break its input schema: count: 9 is greater"):
                await call(hub, "main", "hostile", "strict", count=9, mode="fast")
            # 50 MB: dropped unread at the transport, the loop kept going meanwhile.
            lags: list[float] = []

            async def tick() -> None:
                while True:
                    t = time.monotonic()
                    await asyncio.sleep(0.01)
                    lags.append(time.monotonic() - t - 0.01)
            ticker = asyncio.create_task(tick())
            with pytest.raises(TooLarge, match="over its max_result_bytes"):
                await call(hub, "main", "hostile", "big", megabytes=50)
            ticker.cancel()
            assert max(lags) < 0.25, max(lags)
            assert text_of(await call(hub, "main", "hostile", "echo", text="still"))== "still"
            # Never answers: a clear timeout at mcp_servers.stuck.timeout (3 s).
            started = time.monotonic()
            with pytest.raises(CallTimeout, match=r"within 3 s \(mcp_servers.stuck.timeout"):
                await call(hub, "main", "stuck", "hang")
            assert time.monotonic() - started < 6
            # Garbage on stdout before the answer: the answer still comes.
            r = await call(hub, "main", "hostile", "garbage")
            assert text_of(r) == "answered after garbage"
            # Sampling is refused (no capability declared), the server is told so.
            r = await call(hub, "main", "hostile", "ask_model")
            assert "sampling refused" in text_of(r)
            # The secret from env_files is in its environment, never in a result.
            r = await call(hub, "main", "hostile", "env", name="SECRET_TOKEN")
            assert text_of(r) == "SECRET_TOKEN=[secret]"
            assert "sw0rdfish" not in json.dumps(r)
            r = await call(hub, "main", "hostile", "env", name="PLAIN")
            assert text_of(r) == "PLAIN=visible"
            # An image is saved in the group's folder.
            r = await call(hub, "main", "hostile", "image")
            path = r["content"][0]["path"]
            assert path.startswith("/workspace/group/mcp/")
            host = tmp_path / "data" / "groups" / "main" / path.removeprefix("/workspace/group/")
            assert host.read_bytes().startswith(b"\x89PNG")
            # Dies mid-call: a clear error; the hub starts it again.
            with pytest.raises(ServerCrashed, match="exited with status 3"):
                await call(hub, "main", "hostile", "die")
            assert await hub.wait_up(30, ["hostile"])
            assert text_of(await call(hub, "main", "hostile", "echo", text="back")) == "back"
            status = {s["server"]: s for s in hub.status()}
            assert status["hostile"]["restarts"] >= 1
            assert "dying now" in status["hostile"]["stderr_tail"]
            # A tool added later reaches the group's snapshot.
            await call(hub, "main", "hostile", "grow")
            snap_path = tmp_path / "data" / "ipc" / "main" / "mcp_tools.json"

            def has_added() -> bool:
                snap = json.loads(snap_path.read_text())
                return "hostile__added" in [t["name"] for t in snap["tools"]]
            deadline = time.monotonic() + 10
            while not has_added():
                assert time.monotonic() < deadline, snap_path.read_text()[:500]
                await asyncio.sleep(0.05)
            outcomes = {(c["tool"], c["outcome"]) for c in hub.recent}
            assert {("big", "too_large"), ("hang", "timeout"), ("die", "crashed"),
                    ("strict", "refused"), ("get_current_time", "ok")} <= outcomes
        finally:
            await hub.stop()
        assert all(s["state"] == "stopped" for s in hub.status())

    asyncio.run(go())


def test_a_server_that_cannot_start_is_retried_with_backoff(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    cfg = Config(data_dir=tmp_path / "data",
                 mcp_servers={"gone": {"command": str(tmp_path / "no-such-program")}},
                 groups={"main": {"name": "A", "jid": "hl:1", "main": True,
                                  "mcp": {"gone": ["*"]}}})

    async def go() -> None:
        hub = McpHub(cfg, backoff=Backoff(base=0.05, cap=0.1, jitter=0), snapshots=False)
        await hub.start()
        try:
            deadline = time.monotonic() + 10
            while hub.servers["gone"].restarts < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            st = hub.status()[0]
            assert st["state"] in ("down", "starting") and "cannot start" in st["detail"]
            with pytest.raises(Exception, match="has not listed its tools yet"):
                await call(hub, "main", "gone", "x")
        finally:
            await hub.stop()

    asyncio.run(go())


def test_the_runner_offers_the_snapshot_as_tools(tmp_path: Path) -> None:
    """The agent side: mcp_tools.json becomes tools; arguments are checked against the
    server's schema before a request is written."""
    from mdclaw_agent.mcptools import load, mcp_tools
    from mdclaw_agent.tools import ToolContext, run_tool

    schema = {"type": "object", "properties": {"timezone": {"type": "string",
                                                            "format": "tz"}},
              "required": ["timezone"], "additionalProperties": False,
              "patternProperties": {"^x": {}}}
    (tmp_path / "mcp_tools.json").write_text(json.dumps({"version": 1, "tools": [
        {"name": "time__get_current_time", "server": "time", "tool": "get_current_time",
         "description": "now", "inputSchema": schema, "timeout": 1},
        {"name": "bad.name", "server": "x", "tool": "y", "inputSchema": {}}]}))
    tools = load(tmp_path)
    assert [t.name for t in tools] == ["time__get_current_time"]
    assert mcp_tools(tmp_path, frozenset({"web_fetch"})) == []
    ctx = ToolContext(ipc_dir=tmp_path, group_folder="main", chat_jid="hl:1", is_main=True,
                      action_timeout=0.2)
    reply, failed = run_tool(tools, ctx, "time__get_current_time", {"timezone": 5})
    assert failed and "timezone must be string" in reply
    assert not (tmp_path / "actions").exists()  # nothing left the container
    reply, failed = run_tool(tools, ctx, "time__get_current_time", {"timezone": "UTC"})
    assert failed and "no answer from the host to mcp_call" in reply
    written = [json.loads(p.read_text()) for p in (tmp_path / "actions").iterdir()]
    assert written[0]["action"] == "mcp_call"
    assert written[0]["params"] == {"server": "time", "tool": "get_current_time",
                                    "arguments": {"timezone": "UTC"}}


def test_unasked_messages_and_stderr_are_bounded_and_a_flood_disconnects() -> None:
    """A server that writes megabytes to stderr: drained, its tail kept. One that sends
    notifications without end: past the bound they are dropped unread (the call's answer
    still comes), far past it the server is disconnected and the call in flight fails at
    once."""
    bin_dir = servers_bin()

    async def go() -> None:
        transport = StdioTransport(str(bin_dir / "python"), [str(HOSTILE)],
                                   {"PATH": os.environ.get("PATH", "")}, None, 1 << 20)
        client = McpClient("hostile", transport, unsolicited_limit=50)
        await client.start(30)
        try:
            r = await client.call_tool("flood", {"count": 300}, 30)
            assert r["content"][0]["text"] == "flooded 300"
            assert client.stats["unsolicited"] >= 300, client.stats
            assert client.stats["dropped"] >= 250, client.stats
            assert client.is_up
            # 20 MB on stderr: drained as it comes (the server would block on a full pipe),
            # only the tail kept.
            r = await client.call_tool("shout", {"megabytes": 20}, 60)
            assert r["content"][0]["text"] == "shouted"
            assert transport.stderr_bytes > 20_000_000
            tail = transport.stderr_tail()
            assert tail.endswith("last words\n") and len(tail) <= STDERR_TAIL
            assert sum(map(len, transport._stderr)) <= STDERR_TAIL + READ_CHUNK
            started = time.monotonic()
            with pytest.raises(ProtocolFailure, match="more than 500 unasked messages in "
                               "10 s; it was disconnected"):
                await client.call_tool("flood", {"count": 100_000}, 60)
            assert time.monotonic() - started < 30
            await asyncio.wait_for(client.transport.closed.wait(), 10)
            assert client.stats["unsolicited"] < 100_000, client.stats
        finally:
            await client.close()

    asyncio.run(go())


@pytest.mark.parametrize("kind", ["http"])
def test_the_hostile_server_over_streamable_http(tmp_path: Path, kind: str) -> None:
    import socket
    import subprocess

    bin_dir = servers_bin()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([str(bin_dir / "python"), str(Path(__file__).parent / "mcp_servers"
                                                          / "hostile.py"), "--http", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (tmp_path / "data").mkdir()
        cfg = Config(data_dir=tmp_path / "data", mcp_servers={"web": {
            "url": f"http://127.0.0.1:{port}/mcp", "timeout": "2s", "max_result_bytes": "1MiB",
            "start_timeout": "20s"}},
            groups={"main": {"name": "A", "jid": "hl:1", "main": True,
                             "mcp": {"web": ["*"]}}})

        async def go() -> None:
            hub = McpHub(cfg, backoff=Backoff(base=0.2, cap=0.5, jitter=0), snapshots=False)
            await hub.start()
            try:
                assert await hub.wait_up(30), hub.status()
                assert text_of(await call(hub, "main", "web", "echo", text="over http")) == \
                    "over http"
                with pytest.raises(TooLarge):
                    await call(hub, "main", "web", "big", megabytes=5)
                with pytest.raises(CallTimeout):
                    await call(hub, "main", "web", "hang")
                assert text_of(await call(hub, "main", "web", "echo", text="again")) == "again"
            finally:
                await hub.stop()

        asyncio.run(go())
    finally:
        proc.terminate()
        proc.wait(10)
    assert os.path.exists(tmp_path / "data")


def test_the_cli_lists_and_calls_with_the_agents_rules(tmp_path: Path) -> None:
    import subprocess

    bin_dir = servers_bin()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\n"
                   "groups:\n  main: {name: A, jid: 'hl:1', main: true, mcp: {time: ['*']}}\n"
                   "  family: {name: F, jid: 'hl:2', mcp: {time: [get_current_time]}}\n"
                   f"mcp_servers:\n  time: {{command: \"{bin_dir / 'mcp-server-time'}\"}}\n"
                   "  broken: {command: /nonexistent/server}\n")

    def mdclaw(*args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
        return subprocess.run([sys.executable, "-m", "mdclaw", *args, "--config", str(cfg)],
                              capture_output=True, text=True, timeout=120, env=env)

    r = mdclaw("mcp", "list", "--json")
    assert r.returncode == 0
    rows = {x["server"]: x for x in json.loads(r.stdout)}
    assert rows["time"]["groups"] == "main, family" and rows["broken"]["kind"] == "stdio"
    r = mdclaw("mcp", "tools", "--group", "family", "--json")
    assert r.returncode == 1  # broken does not start: said, and the status says so
    rows = json.loads(r.stdout)
    assert [x["name"] for x in rows if x["server"] == "time"] == ["time__get_current_time"]
    assert any("cannot start /nonexistent/server" in x["description"] for x in rows)
    r = mdclaw("mcp", "call", "-g", "family", "time", "get_current_time",
               '{"timezone": "Asia/Tokyo"}')
    assert r.returncode == 0 and json.loads(r.stdout)["timezone"] == "Asia/Tokyo"
    r = mdclaw("mcp", "call", "-g", "family", "time", "convert_time", "{}")
    assert r.returncode == 1 and "groups.family.mcp.time (get_current_time)" in r.stderr
    r = mdclaw("mcp", "call", "-g", "family", "nope", "get_current_time", "{}")
    assert r.returncode == 1 and "there is no MCP server 'nope'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = mdclaw("mcp", "call", "-g", "family", "time", "get_current_time", '{"timezone": 5}')
    assert r.returncode == 1 and "break its input schema" in r.stderr
    r = mdclaw("doctor", "--json")
    checks = {c["check"]: c for c in json.loads(r.stdout)["checks"]} \
        if r.stdout.lstrip().startswith("{") else {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["mcp time"]["level"] == "ok" and "time__get_current_time" in \
        checks["mcp time"]["detail"]
    assert checks["mcp broken"]["level"] == "fail"


def test_a_server_behind_a_unix_socket_as_systemd_hands_it_over(tmp_path: Path) -> None:
    """`socket:`: each connection becomes a server's stdin and stdout (systemd's Accept=yes,
    as the NixOS module's mcpServers set it up); the daemon speaks the stdio framing over it
    and connects again when the server goes."""
    import socket
    import subprocess
    import threading

    bin_dir = servers_bin()
    path = tmp_path / "hostile.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    procs: list[subprocess.Popen[bytes]] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            procs.append(subprocess.Popen([str(bin_dir / "python"), str(
                Path(__file__).parent / "mcp_servers" / "hostile.py")], stdin=conn,
                stdout=conn, stderr=subprocess.DEVNULL))
            conn.close()
    threading.Thread(target=accept, daemon=True).start()
    (tmp_path / "data").mkdir()
    cfg = Config(data_dir=tmp_path / "data", mcp_servers={"sock": {"socket": str(path),
                                                                   "timeout": "5s"}},
                 groups={"main": {"name": "A", "jid": "hl:1", "main": True,
                                  "mcp": {"sock": ["*"]}}})

    async def go() -> None:
        hub = McpHub(cfg, backoff=Backoff(base=0.1, cap=0.2, jitter=0), snapshots=False)
        await hub.start()
        try:
            assert await hub.wait_up(30), hub.status()
            assert text_of(await call(hub, "main", "sock", "echo", text="via socket")) == \
                "via socket"
            with pytest.raises(ServerCrashed):
                await call(hub, "main", "sock", "die")
            assert await hub.wait_up(30)
            assert text_of(await call(hub, "main", "sock", "echo", text="again")) == "again"
        finally:
            await hub.stop()

    try:
        asyncio.run(go())
    finally:
        listener.close()
        for p in procs:
            p.kill()
            p.wait(10)
    assert len(procs) == 2  # one server per connection: the first died, a second served
