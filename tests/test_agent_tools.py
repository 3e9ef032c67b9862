"""The agent's tools: canonical IPC files (checked with the host's own parser), snapshots,
action requests answered by a real writer thread, main-only tools."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

import agent_helpers  # noqa: F401 - puts the runner package on sys.path
from mdclaw_agent.ipc import write_json_atomic
from mdclaw_agent.tools import TOOLS, ToolContext, run_tool, tools_for
from waiting import wait_until

NAME_RE = re.compile(r"^\d{13}-[0-9a-f]{8}\.json$")


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    (tmp_path / "group").mkdir()
    return ToolContext(ipc_dir=tmp_path / "ipc", group_folder="family", chat_jid="tg:-100",
                       is_main=False, group_dir=tmp_path / "group", action_timeout=2.0)


def files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir()) if d.is_dir() else []


def only_file(d: Path) -> dict:
    found = files(d)
    assert len(found) == 1, found
    assert NAME_RE.match(found[0].name), found[0].name
    return json.loads(found[0].read_text())


def host_parse(body: dict):
    """The host's own parser: what the IPC engine will do with the file."""
    protocol = pytest.importorskip("mdclaw.ipc.protocol")
    cmd, claimed = protocol.parse_command(body)
    assert claimed is None
    return cmd


def test_non_main_does_not_see_group_tools() -> None:
    main = {t.name for t in tools_for(True)}
    other = {t.name for t in tools_for(False)}
    admin = {"register_group", "unregister_group", "refresh_groups", "list_groups"}
    assert admin <= main
    assert not admin & other
    assert {"send_message", "send_file", "react", "schedule_task", "update_task", "pause_task",
            "resume_task", "cancel_task", "delete_task", "list_tasks", "memory_search",
            "memory_get"} <= other


def test_send_message_writes_canonical_file(ctx: ToolContext) -> None:
    reply, err = run_tool(tools_for(False), ctx, "send_message", {"text": "Hello there"})
    assert not err and "queued" in reply
    body = only_file(ctx.ipc_dir / "messages")
    assert body == {"type": "message", "chat_jid": "tg:-100", "text": "Hello there"}
    cmd = host_parse(body)
    assert cmd.text == "Hello there"
    # No temp file is left behind.
    assert not [p for p in files(ctx.ipc_dir / "messages") if p.name.startswith(".")]


@pytest.mark.parametrize("name,args,subdir,expect", [
    ("schedule_task", {"prompt": "water plants", "schedule_type": "cron",
                       "schedule_value": "0 8 * * *", "task_id": "t-1"}, "tasks",
     {"type": "schedule_task", "task_id": "t-1", "prompt": "water plants",
      "schedule_type": "cron", "schedule_value": "0 8 * * *", "context_mode": "group"}),
    ("update_task", {"task_id": "t-1", "prompt": "new"}, "tasks",
     {"type": "update_task", "task_id": "t-1", "prompt": "new"}),
    ("pause_task", {"task_id": "t-1"}, "tasks", {"type": "pause_task", "task_id": "t-1"}),
    ("resume_task", {"task_id": "t-1"}, "tasks", {"type": "resume_task", "task_id": "t-1"}),
    ("cancel_task", {"task_id": "t-1"}, "tasks", {"type": "cancel_task", "task_id": "t-1"}),
    ("delete_task", {"task_id": "t-1"}, "tasks", {"type": "delete_task", "task_id": "t-1"}),
    ("react", {"message_id": "42", "emoji": "👍"}, "messages",
     {"type": "react", "chat_jid": "tg:-100", "message_id": "42", "emoji": "👍"}),
])
def test_each_command_kind(ctx: ToolContext, name: str, args: dict, subdir: str,
                           expect: dict) -> None:
    reply, err = run_tool(tools_for(False), ctx, name, args)
    assert not err, reply
    body = only_file(ctx.ipc_dir / subdir)
    assert body == expect
    host_parse(body)


def test_main_group_commands(ctx: ToolContext) -> None:
    main_ctx = ToolContext(**{**ctx.__dict__, "is_main": True})
    tools = tools_for(True)
    for name, args in [("register_group", {"jid": "tg:7", "name": "Seven", "folder": "seven"}),
                       ("unregister_group", {"folder": "seven"}),
                       ("refresh_groups", {})]:
        reply, err = run_tool(tools, main_ctx, name, args)
        assert not err, reply
    bodies = [json.loads(p.read_text()) for p in files(ctx.ipc_dir / "tasks")]
    assert [b["type"] for b in bodies] == ["register_group", "unregister_group",
                                           "refresh_groups"]
    for b in bodies:
        host_parse(b)
    reply, err = run_tool(tools, main_ctx, "unregister_group", {})
    assert err and "exactly one" in reply


def test_non_main_cannot_call_group_tools_even_by_name(ctx: ToolContext) -> None:
    reply, err = run_tool(tools_for(False), ctx, "register_group",
                          {"jid": "x", "name": "x", "folder": "x"})
    assert err and "no tool" in reply
    assert not (ctx.ipc_dir / "tasks").exists()


def test_send_file_checks_and_names_container_path(ctx: ToolContext) -> None:
    (ctx.group_dir / "out").mkdir()
    (ctx.group_dir / "out" / "chart.png").write_bytes(b"\x89PNG")
    reply, err = run_tool(tools_for(False), ctx, "send_file",
                          {"file_path": "out/chart.png", "caption": "The chart"})
    assert not err, reply
    body = only_file(ctx.ipc_dir / "messages")
    assert body["file_path"] == "/workspace/group/out/chart.png"
    host_parse(body)
    reply, err = run_tool(tools_for(False), ctx, "send_file", {"file_path": "missing.txt"})
    assert err and "does not exist" in reply


def test_bad_arguments_are_explained(ctx: ToolContext) -> None:
    tools = tools_for(False)
    reply, err = run_tool(tools, ctx, "schedule_task", {"prompt": "x", "schedule_type": "weekly",
                                                        "schedule_value": "1"})
    assert err and "cron, interval, once" in reply
    reply, err = run_tool(tools, ctx, "send_message", {"txt": "typo"})
    assert err and "'text' is required" in reply
    reply, err = run_tool(tools, ctx, "send_message", {"text": "x", "bogus": 1})
    assert err and "unknown argument" in reply
    reply, err = run_tool(tools, ctx, "update_task", {"task_id": "t"})
    assert err and "at least one" in reply
    assert not (ctx.ipc_dir / "messages").exists()


def test_list_tasks_reads_snapshot(ctx: ToolContext) -> None:
    reply, _ = run_tool(tools_for(False), ctx, "list_tasks", {})
    assert reply == "No scheduled tasks."
    write_json_atomic(ctx.ipc_dir, [
        {"id": "t-1", "groupFolder": "family", "prompt": "water the plants",
         "schedule_type": "cron", "schedule_value": "0 8 * * *", "status": "active",
         "next_run": "2026-01-01T08:00:00Z"}], "current_tasks.json")
    reply, err = run_tool(tools_for(False), ctx, "list_tasks", {})
    assert not err
    assert "t-1" in reply and "water the plants" in reply and "0 8 * * *" in reply


def test_list_groups_reads_snapshot(ctx: ToolContext) -> None:
    main_ctx = ToolContext(**{**ctx.__dict__, "is_main": True})
    write_json_atomic(ctx.ipc_dir, {"groups": [
        {"jid": "tg:1", "name": "Family", "folder": "family", "isRegistered": True},
        {"jid": "tg:2", "name": "Club", "folder": None, "isRegistered": False}],
        "lastSync": "x"}, "available_groups.json")
    reply, _ = run_tool(tools_for(True), main_ctx, "list_groups", {})
    assert "Family" in reply and "(registered)" in reply and "(not registered)" in reply


def test_list_groups_names_every_chat_of_a_group(ctx: ToolContext) -> None:
    main_ctx = ToolContext(**{**ctx.__dict__, "is_main": True})
    write_json_atomic(ctx.ipc_dir, {"groups": [
        {"jid": "tg:1", "name": "Me", "folder": "me", "isRegistered": True,
         "session": "per_chat", "chats": [{"jid": "tg:1", "first": True},
                                          {"jid": "hl:me", "first": False}]}],
        "lastSync": "x"}, "available_groups.json")
    reply, _ = run_tool(tools_for(True), main_ctx, "list_groups", {})
    assert "chats tg:1 (first), hl:me" in reply and "session per_chat" in reply


def _answer_actions(ipc: Path, answer, stop: threading.Event) -> threading.Thread:
    """A host stand-in: reads action requests, writes results atomically."""
    def loop() -> None:
        while not stop.is_set():
            d = ipc / "actions"
            for p in files(d):
                if p.name.startswith("."):
                    continue
                body = json.loads(p.read_text())
                p.unlink()
                result = answer(body)
                write_json_atomic(ipc / "action_results",
                                  {"requestId": body["request_id"], **result,
                                   "executedAt": "2026-01-01T00:00:00Z"},
                                  f"{body['request_id']}.json")
            time.sleep(0.005)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_memory_search_and_get_round_trip(ctx: ToolContext) -> None:
    seen = []

    def answer(body: dict) -> dict:
        seen.append(body)
        host_parse(body)
        if body["action"] == "memory_search":
            return {"status": "success", "result": {"hits": [
                {"path": "MEMORY.md", "line": 3, "snippet": "tomatoes like sun", "score": 1}]}}
        return {"status": "success", "result": {"path": "MEMORY.md", "content": "# Memory"}}

    stop = threading.Event()
    _answer_actions(ctx.ipc_dir, answer, stop)
    try:
        reply, err = run_tool(tools_for(False), ctx, "memory_search", {"query": "tomatoes"})
        assert not err, reply
        assert "MEMORY.md line 3: tomatoes like sun" in reply
        reply, err = run_tool(tools_for(False), ctx, "memory_get", {"path": "MEMORY.md"})
        assert not err and reply == "# Memory"
    finally:
        stop.set()
    assert seen[0]["type"] == "action" and seen[0]["params"] == {"query": "tomatoes", "topK": 5}
    # Results are consumed.
    assert files(ctx.ipc_dir / "action_results") == []


def test_memory_error_result_and_timeout(ctx: ToolContext) -> None:
    stop = threading.Event()
    host = _answer_actions(ctx.ipc_dir,
                           lambda b: {"status": "error", "error": "path not allowed"}, stop)
    try:
        reply, err = run_tool(tools_for(False), ctx, "memory_get", {"path": "../etc/passwd"})
        assert err and "path not allowed" in reply
    finally:
        stop.set()
    host.join(5)  # nobody answers from here on
    assert not host.is_alive()
    quick = ToolContext(**{**ctx.__dict__, "action_timeout": 0.3})
    t0 = time.monotonic()
    reply, err = run_tool(tools_for(False), quick, "memory_search", {"query": "x"})
    assert err and "no answer from the host" in reply
    assert 0.25 < time.monotonic() - t0 < 10  # its own 0.3 s, not the default 30 s


def test_web_fetch_and_search_round_trip(ctx: ToolContext) -> None:
    """web_fetch and web_search are action requests the host answers (a stand-in here);
    they wait for the web timeout, longer than other actions' (a fetch is slow)."""
    seen = []

    def answer(body: dict) -> dict:
        seen.append(body)
        host_parse(body)
        if body["action"] == "web_fetch":
            time.sleep(0.6)  # a slow fetch: longer than the memory actions' timeout
            return {"status": "success", "result": {
                "url": "http://example.test/a", "final_url": "http://example.test/b",
                "status": 200, "content_type": "text/html", "title": "B",
                "text": "# B\nhello web", "truncated": True}}
        return {"status": "success", "result": {"results": [
            {"title": "One", "url": "http://one.test/", "snippet": "first"},
            {"title": "Two", "url": "http://two.test/", "snippet": "second"}]}}

    quick = ToolContext(**{**ctx.__dict__, "action_timeout": 0.3, "web_timeout": 10.0})
    stop = threading.Event()
    _answer_actions(ctx.ipc_dir, answer, stop)
    try:
        reply, err = run_tool(tools_for(False), quick, "web_fetch",
                              {"url": "http://example.test/a", "max_chars": 5000})
        assert not err, reply
        assert reply.startswith("http://example.test/b (HTTP 200, text/html)\nTitle: B\n")
        assert "hello web" in reply and "larger max_chars" in reply
        reply, err = run_tool(tools_for(False), quick, "web_search",
                              {"query": "mdclaw", "count": 2})
        assert not err, reply
        assert "1. One\n   http://one.test/\n   first" in reply and "2. Two" in reply
    finally:
        stop.set()
    assert [(b["action"], b["params"]) for b in seen] == [
        ("web_fetch", {"url": "http://example.test/a", "max_chars": 5000}),
        ("web_search", {"query": "mdclaw", "count": 2})]
    assert files(ctx.ipc_dir / "action_results") == []


def test_web_refusal_and_timeout(ctx: ToolContext) -> None:
    stop = threading.Event()
    host = _answer_actions(ctx.ipc_dir, lambda b: {
        "status": "error", "error": "127.0.0.1 is a loopback address"}, stop)
    try:
        reply, err = run_tool(tools_for(False), ctx, "web_fetch",
                              {"url": "http://127.0.0.1:9/"})
        assert err and "web_fetch failed: 127.0.0.1 is a loopback address" in reply
    finally:
        stop.set()
        host.join(5)  # nobody answers from here on
    quick = ToolContext(**{**ctx.__dict__, "web_timeout": 0.3})
    reply, err = run_tool(tools_for(False), quick, "web_search", {"query": "x"})
    assert err and "no answer from the host to web_search within 0.3 s" in reply


def test_every_tool_schema_is_an_object_schema() -> None:
    for t in TOOLS:
        assert t.parameters["type"] == "object"
        assert set(t.parameters["required"]) <= set(t.parameters["properties"])
        assert t.description


def test_memory_tools_answered_by_the_real_ipc_engine(tmp_path, write_config, cli,
                                                      data_dir) -> None:
    """The tools' action requests, answered by `mdclaw ipc drain` (the host's IPC engine)."""
    cfg = write_config()
    assert cli("reconcile", "--config", str(cfg)).returncode == 0
    group = data_dir / "groups" / "family"
    (group / "MEMORY.md").write_text("# Family\nTomatoes need water every morning.\n")
    ctx = ToolContext(ipc_dir=data_dir / "ipc" / "family", group_folder="family",
                      chat_jid="tg:-1001234", is_main=False, group_dir=group,
                      action_timeout=30.0)
    replies: dict[str, tuple[str, bool]] = {}

    def ask(name: str, args: dict) -> threading.Thread:
        t = threading.Thread(target=lambda: replies.__setitem__(
            name, run_tool(tools_for(False), ctx, name, args)))
        t.start()
        return t

    for name, args in [("memory_search", {"query": "tomatoes water"}),
                       ("memory_get", {"path": "MEMORY.md"})]:
        t = ask(name, args)
        wait_until(lambda: list((ctx.ipc_dir / "actions").glob("*.json")), 10,
                   what=f"the {name} request file")
        # The memory actions run off the loop: --run-actions runs the worker's jobs too.
        r = cli("ipc", "drain", "--run-actions", "--config", str(cfg))
        assert r.returncode == 0, r.stderr
        t.join(30)
    text, err = replies["memory_search"]
    assert not err and "MEMORY.md line 2: Tomatoes need water every morning." in text
    text, err = replies["memory_get"]
    assert not err and text.startswith("# Family")


def test_every_command_applied_by_the_real_ipc_engine(write_config, cli, data_dir) -> None:
    """What the tools write is what the host applies: task life cycle, outbox rows, groups."""
    from mdclaw.state import Database

    cfg = write_config()
    assert cli("reconcile", "--config", str(cfg)).returncode == 0
    group = data_dir / "groups" / "family"
    (group / "chart.png").write_bytes(b"\x89PNG fake")
    fam = ToolContext(ipc_dir=data_dir / "ipc" / "family", group_folder="family",
                      chat_jid="tg:-1001234", is_main=False, group_dir=group)
    main = ToolContext(ipc_dir=data_dir / "ipc" / "main", group_folder="main",
                       chat_jid="tg:123456", is_main=True, group_dir=data_dir / "groups" / "main")

    def do(ctx: ToolContext, tool: str, **args) -> None:
        reply, err = run_tool(tools_for(ctx.is_main), ctx, tool, args)
        assert not err, reply
        r = cli("ipc", "drain", "--json", "--config", str(cfg))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["rejected"] == 0 and out["applied"] >= 1, (tool, out)

    def task() -> dict | None:
        db = Database(data_dir / "state.db")
        try:
            row = db.query_one("SELECT * FROM scheduled_tasks WHERE id = 'plants'")
            return dict(row) if row else None
        finally:
            db.close()

    do(fam, "schedule_task", prompt="water", schedule_type="interval",
       schedule_value="3600000", task_id="plants")
    assert task()["status"] == "active" and task()["group_folder"] == "family"
    do(fam, "pause_task", task_id="plants")
    assert task()["status"] == "paused"
    do(fam, "resume_task", task_id="plants")
    assert task()["status"] == "active"
    do(fam, "update_task", task_id="plants", prompt="water twice")
    assert task()["prompt"] == "water twice"
    do(fam, "cancel_task", task_id="plants")
    assert task()["status"] == "completed"
    do(fam, "delete_task", task_id="plants")
    assert task() is None

    do(fam, "send_message", text="hi all")
    do(fam, "react", message_id="42", emoji="👍")
    do(fam, "send_file", file_path="chart.png", caption="the chart")
    r = cli("outbox", "list", "--json", "--config", str(cfg))
    rows = sorted(json.loads(r.stdout), key=lambda x: x["id"])
    assert [(x["kind"], x["chat_jid"]) for x in rows] == [
        ("text", "tg:-1001234"), ("reaction", "tg:-1001234"), ("file", "tg:-1001234")]

    do(main, "register_group", jid="tg:777", name="Club", folder="club")
    r = cli("groups", "list", "--json", "--config", str(cfg))
    assert "club" in {g["folder"] for g in json.loads(r.stdout)}
    do(main, "unregister_group", folder="club")
    do(main, "refresh_groups")
    r = cli("groups", "list", "--json", "--config", str(cfg))
    assert "club" not in {g["folder"] for g in json.loads(r.stdout)}


def test_arguments_are_limited_as_the_host_limits_the_fields(ctx: ToolContext) -> None:
    """The limits come from the host's models (commands_schema.json): a message longer than
    the host takes is refused by the tool, and nothing is written."""
    protocol = pytest.importorskip("mdclaw.ipc.protocol")
    tools = tools_for(False)
    reply, err = run_tool(tools, ctx, "send_message", {"text": "x" * (protocol.MAX_TEXT + 1)})
    assert err and f"text must be at most {protocol.MAX_TEXT} characters" in reply
    reply, err = run_tool(tools, ctx, "react", {"message_id": "42", "emoji": "👍" * 33})
    assert err and "emoji must be at most 32 characters" in reply
    reply, err = run_tool(tools, ctx, "update_task", {"task_id": "t-1", "status": "done"})
    assert err and "status must be one of active, paused" in reply
    assert not ctx.ipc_dir.exists()
    reply, err = run_tool(tools, ctx, "send_message", {"text": "x" * protocol.MAX_TEXT})
    assert not err, reply
    host_parse(only_file(ctx.ipc_dir / "messages"))


def test_empty_optional_arguments_are_left_out(ctx: ToolContext) -> None:
    tools = tools_for(False)
    reply, err = run_tool(tools, ctx, "send_message", {"text": "hi", "sender": "",
                                                       "reply_to": None, "chat_jid": ""})
    assert not err, reply
    assert only_file(ctx.ipc_dir / "messages") == {"type": "message", "chat_jid": "tg:-100",
                                                   "text": "hi"}
    reply, err = run_tool(tools, ctx, "update_task", {"task_id": "t-1", "prompt": "",
                                                      "timezone": None})
    assert err and "at least one" in reply
    reply, err = run_tool(tools, ctx, "send_message", {"text": ""})
    assert err and "'text' is required" in reply


def test_a_body_the_host_would_refuse_is_not_written(ctx: ToolContext) -> None:
    """The body itself is checked against the host's schema, also what the tool adds (here
    the context's own chat id, empty)."""
    no_chat = ToolContext(**{**ctx.__dict__, "chat_jid": ""})
    reply, err = run_tool(tools_for(False), no_chat, "send_message", {"text": "hi"})
    assert err and reply == "message: chat_jid must be at least 1 characters"
    assert not ctx.ipc_dir.exists()


def _field_values(schema: dict):
    """Values of a field of the host's schema: mostly fitting ones at and inside its limits,
    else just outside them or of a wrong type."""
    from hypothesis import strategies as st

    node = next((a for a in schema.get("anyOf", ()) if a.get("type") != "null"), schema)
    if node.get("type") == "boolean":
        fit, misfit = [True, False], ["x", 2]
    elif "enum" in node:
        fit, misfit = list(node["enum"]), ["bogus", 3]
    elif node.get("type") == "object":
        fit, misfit = [{}, {"a": 1}], [[], "x"]
    else:
        lo, hi = node.get("minLength", 0), node.get("maxLength", 300)
        fit = ["a" * n for n in sorted({lo, lo + 1, hi})]
        misfit = ["a" * (hi + 1), 7] + (["a" * (lo - 1)] if lo else [])
    return st.integers(0, 3).flatmap(
        lambda i: st.sampled_from(misfit if i == 0 else fit))


# Fields whose host check goes beyond the schema (a pattern, a validator): given valid values.
_FIXED = {"task_id": "t-1", "request_id": "req-1", "action": "memory_get", "folder": "club",
          "file_name": "a.png"}
_UNLIMITED = ("refresh_groups", "unregister_group")  # no field limits / a cross-field rule


def test_the_body_check_agrees_with_the_hosts_parser() -> None:
    """commands.problems (the runner's check before writing) refuses a body exactly when the
    host's parser does, for bodies that vary every schema-limited field."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    protocol = pytest.importorskip("mdclaw.ipc.protocol")
    from mdclaw_agent import commands

    @st.composite
    def bodies(draw):
        ctype = draw(st.sampled_from([t for t in commands.COMMAND_TYPES
                                      if t not in _UNLIMITED]))
        body = {"type": ctype}
        for name, prop in commands.command(ctype)["properties"].items():
            if name in ("type", "family"):
                continue
            if name in commands.required(ctype):
                if draw(st.integers(0, 9)) == 0:
                    continue  # a required field left out
            elif not draw(st.booleans()):
                continue
            body[name] = _FIXED[name] if name in _FIXED else draw(_field_values(prop))
        if draw(st.integers(0, 9)) == 0:
            body["bogus"] = 1
        return body

    @settings(max_examples=400, deadline=None)
    @given(bodies())
    def check(body: dict) -> None:
        try:
            protocol.parse_command(body)
            host_ok = True
        except protocol.ProtocolError as e:
            host_ok = False
            if "changes nothing" in str(e):  # update_task's cross-field rule
                return
        fits = commands.problems(body) == []
        if fits:  # never a body the host refuses
            assert host_ok, body
        elif host_ok:  # the host also takes a whole-number schedule_value (dialects do)
            assert isinstance(body.get("schedule_value"), int), (body, commands.problems(body))

    check()


def test_memory_search_shows_when_and_who_for_past_conversations(ctx: ToolContext) -> None:
    hits = [{"source": "sessions", "kind": "message", "direction": "in", "sender": "Alice",
             "timestamp": "2026-01-01T10:00:00.000Z", "snippet": "rent a **kayak**"},
            {"source": "sessions", "kind": "reply", "direction": "out", "sender": None,
             "timestamp": "2026-01-01T10:00:05.000Z", "snippet": "a **kayak** costs 40"}]
    stop = threading.Event()
    _answer_actions(ctx.ipc_dir, lambda b: {"status": "success", "result": {"hits": hits}},
                    stop)
    try:
        reply, err = run_tool(tools_for(False), ctx, "memory_search",
                              {"query": "kayak", "sources": "sessions"})
    finally:
        stop.set()
    assert not err, reply
    assert "- 2026-01-01T10:00:00.000Z message (Alice): rent a **kayak**" in reply
    assert "- 2026-01-01T10:00:05.000Z reply (assistant): a **kayak** costs 40" in reply


def test_action_tools_follow_the_hosts_list() -> None:
    """Home Assistant tools are main-only by default; when the host lists the group's
    actions (MDCLAW_ACTIONS from groups.<g>.actions), exactly those action tools are given."""
    from mdclaw_agent.protocol import Settings

    main = {t.name for t in tools_for(True)}
    other = {t.name for t in tools_for(False)}
    assert {"ha_call_service", "ha_capture_screenshot", "farm_state_refresh"} <= main
    assert not {n for n in other if n.startswith("ha_")} and "farm_state_refresh" not in other
    told = Settings.from_env({"MDCLAW_ACTIONS": "ha_get_status,memory_get,memory_search"})
    names = {t.name for t in tools_for(False, actions=told.allowed_actions)}
    assert {"ha_get_status", "memory_get", "memory_search"} <= names
    assert "ha_call_service" not in names and "web_fetch" not in names
    assert "send_message" in names  # tools that are not actions are unaffected
    assert Settings.from_env({}).allowed_actions is None
