"""The agent runner as a real subprocess against a scripted OpenAI-compatible server:
markers, tool calls becoming IPC files, follow-ups, `_close`, single-turn scheduled runs,
session resume, and the path through the real credential proxy and loopback forwarder."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

import agent_helpers
from agent_helpers import ProxyThread, RunnerProcess, write_input
from fake_models import FakeOpenAI, call, garble, hangup, refuse, say
from mdclaw_agent.protocol import PLACEHOLDER_KEY, ContainerInput, InputError, parse_outputs


def base_input(**over) -> dict:
    d = {"prompt": "hello", "sessionId": None, "groupFolder": "family", "chatJid": "tg:-100",
         "isMain": False, "isScheduledTask": False, "assistantName": "Andy",
         "backend": "openai", "model": "fake-model"}
    d.update(over)
    return d


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    d = {"ipc": tmp_path / "ipc", "group": tmp_path / "group", "global": tmp_path / "global"}
    for p in d.values():
        p.mkdir()
    (d["ipc"] / "input").mkdir()
    return d


def runner(dirs: dict[str, Path], inp: dict, server: FakeOpenAI, **env: str) -> RunnerProcess:
    return RunnerProcess(inp, ipc_dir=dirs["ipc"], group_dir=dirs["group"],
                         global_dir=dirs["global"],
                         env={"MDCLAW_MODEL_BASE_URL": server.url, **env})


def command_files(d: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


def test_container_input_parsing() -> None:
    inp = ContainerInput.from_json(json.dumps(base_input(secrets={"K": "v"})))
    assert inp.backend == "openai" and inp.group_folder == "family" and inp.session_id is None
    assert "secrets" not in repr(inp) and "'v'" not in repr(inp)
    nested = ContainerInput.from_json(json.dumps(
        base_input(backend=None, model={"backend": "claude", "model": "claude-x"})))
    assert (nested.backend, nested.model) == ("claude", "claude-x")
    for bad, word in [("[]", "object"), ("{", "not JSON"),
                      (json.dumps({"groupFolder": "x"}), "'prompt' is required"),
                      (json.dumps(base_input(isMain="yes")), "isMain must be boolean"),
                      (json.dumps(base_input(backend="gemini")),
                       "backend must be one of claude, openai")]:
        with pytest.raises(InputError, match=word):
            ContainerInput.from_json(bad)


def test_invalid_input_gives_marked_error_and_status_2(dirs, tmp_path) -> None:
    with FakeOpenAI() as server:
        r = runner(dirs, {"groupFolder": "family"}, server)
        assert r.wait_exit() == 2
        out = r.wait_results(1)
    assert out[0]["status"] == "error" and "prompt" in out[0]["error"]


def test_multi_turn_with_tools_follow_ups_and_close(dirs) -> None:
    (dirs["group"] / "CLAUDE.md").write_text("The family likes tomatoes.")
    (dirs["global"] / "CLAUDE.md").write_text("Everyone speaks German.")
    script = [call("send_message", text="On it!"),
              call("schedule_task", prompt="water plants", schedule_type="cron",
                   schedule_value="0 8 * * *", task_id="water"),
              say("Done: scheduled."),
              say("second answer")]
    with FakeOpenAI(script) as server:
        r = runner(dirs, base_input(prompt="please schedule watering"), server)
        first = r.wait_results(1)[0]
        assert first == {"status": "success", "result": "Done: scheduled.",
                         "newSessionId": first["newSessionId"]}
        msgs = command_files(dirs["ipc"] / "messages")
        assert msgs == [{"type": "message", "chat_jid": "tg:-100", "text": "On it!"}]
        tasks = command_files(dirs["ipc"] / "tasks")
        assert tasks[0]["type"] == "schedule_task" and tasks[0]["task_id"] == "water"
        # The follow-up mid-session becomes the second turn.
        write_input(dirs["ipc"] / "input", {"sender": "tg:42", "sender_name": "Alice",
                                            "content": "and the roses?",
                                            "timestamp": "2026-01-01T00:00:00Z"},
                    "1700000000000-aaaa.json")
        second = r.wait_results(2)[1]
        assert second["result"] == "second answer"
        assert second["newSessionId"] == first["newSessionId"]
        assert r.proc.poll() is None  # still open
        write_input(dirs["ipc"] / "input", None, "_close")
        assert r.wait_exit(10) == 0
        reqs = server.requests
    # The system prompt carries both memory files; the history grows turn by turn.
    system = reqs[0].body["messages"][0]["content"]
    assert "tomatoes" in system and "German" in system
    last = reqs[-1].body["messages"]
    assert last[-1] == {"role": "user", "content": "and the roses?"}
    assert any(m.get("role") == "tool" and "queued" in m["content"] for m in last)
    assert {t["function"]["name"] for t in reqs[0].body["tools"]} >= {"send_message",
                                                                      "schedule_task"}
    assert "register_group" not in {t["function"]["name"] for t in reqs[0].body["tools"]}
    # The sentinel and the follow-up were consumed.
    assert os.listdir(dirs["ipc"] / "input") == []


def test_several_follow_ups_at_once_each_consumed_once(dirs) -> None:
    with FakeOpenAI() as server:  # echo server
        r = runner(dirs, base_input(prompt="first"), server)
        r.wait_results(1)
        inbox = dirs["ipc"] / "input"
        for i in range(5):
            write_input(inbox, {"text": f"msg {i}"}, f"17000000000{i:02d}-x.json")
        write_input(inbox, None, "_close")  # arrives together with them: none is lost
        assert r.wait_exit(20) == 0
        results = r.results
    assert [x["result"] for x in results] == ["echo: first"] + [f"echo: msg {i}"
                                                                for i in range(5)]
    assert os.listdir(inbox) == []


def test_bad_follow_up_is_set_aside_not_fatal(dirs) -> None:
    with FakeOpenAI() as server:
        r = runner(dirs, base_input(), server)
        r.wait_results(1)
        inbox = dirs["ipc"] / "input"
        write_input(inbox, {"nothing": 1}, "1700000000000-bad.json")
        write_input(inbox, {"text": "fine"}, "1700000000001-ok.json")
        r.wait_results(2)
        write_input(inbox, None, "_close")
        assert r.wait_exit(10) == 0
    assert [x["result"] for x in r.results] == ["echo: hello", "echo: fine"]
    assert os.listdir(inbox / ".rejected") == ["1700000000000-bad.json"]


def test_follow_up_before_start_is_picked_up(dirs) -> None:
    write_input(dirs["ipc"] / "input", {"text": "early"}, "1700000000000-e.json")
    with FakeOpenAI() as server:
        r = runner(dirs, base_input(prompt="first"), server)
        r.wait_results(2)
        write_input(dirs["ipc"] / "input", None, "_close")
        assert r.wait_exit(10) == 0
    assert [x["result"] for x in r.results] == ["echo: first", "echo: early"]


def test_scheduled_task_is_single_turn(dirs) -> None:
    with FakeOpenAI([say("task done")]) as server:
        r = runner(dirs, base_input(isScheduledTask=True, prompt="do the task"), server)
        assert r.wait_exit(20) == 0
        assert len(server.requests) == 1
        assert "scheduled task" in server.requests[0].body["messages"][0]["content"]
    assert [x["result"] for x in r.results] == ["task done"]


def test_session_resume_and_missing_session(dirs) -> None:
    with FakeOpenAI() as server:
        r = runner(dirs, base_input(isScheduledTask=True, prompt="remember 42"), server)
        assert r.wait_exit(20) == 0
        sid = r.results[0]["newSessionId"]
        r2 = runner(dirs, base_input(isScheduledTask=True, prompt="what number?",
                                     sessionId=sid), server)
        assert r2.wait_exit(20) == 0
        assert r2.results[0]["newSessionId"] == sid
        history = server.requests[-1].body["messages"]
        assert {"role": "user", "content": "remember 42"} in history
        r3 = runner(dirs, base_input(isScheduledTask=True, prompt="fresh",
                                     sessionId="oai-0000000000000000"), server)
        assert r3.wait_exit(20) == 0
        assert r3.results[0]["newSessionId"] != "oai-0000000000000000"
        assert [m["role"] for m in server.requests[-1].body["messages"]] == ["system", "user"]


def test_tool_loop_is_bounded(dirs) -> None:
    with FakeOpenAI(fallback=lambda body: call("list_tasks")) as server:
        r = runner(dirs, base_input(isScheduledTask=True), server, MDCLAW_MAX_TOOL_ROUNDS="3")
        assert r.wait_exit(20) == 0
        # 3 rounds with tools, then one last request without them.
        assert len(server.requests) == 4
        assert "tools" not in server.requests[-1].body


def test_model_error_is_reported(dirs) -> None:
    with FakeOpenAI() as server:
        r = runner(dirs, base_input(isScheduledTask=True), server,
                   MDCLAW_MODEL_BASE_URL=server.url + "/nowhere")
        assert r.wait_exit(20) == 1
    assert r.results[0]["status"] == "error" and "HTTP 418" in r.results[0]["error"]
    assert r.results[0]["cause"] == "model_refused" and r.results[0]["httpStatus"] == 418


def test_missing_proxy_socket_is_reported(dirs) -> None:
    r = RunnerProcess(base_input(), ipc_dir=dirs["ipc"], group_dir=dirs["group"])
    assert r.wait_exit(20) == 1
    assert "proxy socket" in r.results[0]["error"]
    assert r.results[0]["cause"] == "proxy_missing"


def test_through_real_proxy_and_forwarder(tmp_path: Path) -> None:
    """Runner → loopback forwarder → unix socket → credential proxy → fake provider."""
    from mdclaw.models import Upstream
    from mdclaw.paths import Layout
    from mdclaw.state import Database

    data = tmp_path / "d"
    layout = Layout(data)
    ipc = layout.group_ipc_dir("family")
    (ipc / "input").mkdir(parents=True)
    group = layout.group_dir("family")
    group.mkdir(parents=True)
    key_file = tmp_path / "key"
    key_file.write_text("sk-real-secret-123\n")
    key_file.chmod(0o600)
    db = Database(layout.db_path)
    proxy = ProxyThread(layout, db)
    try:
        with FakeOpenAI([call("send_message", text="hi from the agent"), say("all done")],
                        usage=(100, 20)) as server:
            sock = proxy.start_group("family", Upstream(
                backend="openai", model="fake-model", base_url=server.url + "/v1",
                api_key_file=key_file))
            assert sock == layout.proxy_socket("family")
            r = RunnerProcess(base_input(isScheduledTask=True), ipc_dir=ipc, group_dir=group)
            assert r.wait_exit(30) == 0, r.stderr_lines
            assert r.results[0]["result"] == "all done"
            reqs = server.requests
        for req in reqs:
            assert req.headers["Authorization"] == "Bearer sk-real-secret-123"
            assert PLACEHOLDER_KEY not in json.dumps(req.headers)
        proxy.flush()
        rows = [dict(x) for x in db.query("SELECT * FROM model_usage")]
    finally:
        proxy.close()
        db.close()
    assert len(rows) == 1
    assert rows[0]["group_folder"] == "family" and rows[0]["requests"] == 2
    assert (rows[0]["input_tokens"], rows[0]["output_tokens"]) == (200, 40)
    # The runner's own output and logs never saw the key.
    assert "sk-real-secret" not in "\n".join(r.stdout_lines + r.stderr_lines)
    assert command_files(ipc / "messages")[0]["text"] == "hi from the agent"


def test_parse_outputs_reads_every_pair() -> None:
    text = ("noise\n---NANOCLAW_OUTPUT_START---\n{\"status\":\"success\",\"result\":\"a\"}\n"
            "---NANOCLAW_OUTPUT_END---\nmore\n---NANOCLAW_OUTPUT_START---\n"
            "{\"status\":\"error\",\"result\":null,\"error\":\"x\"}\n---NANOCLAW_OUTPUT_END---\n")
    assert [o["status"] for o in parse_outputs(text)] == ["success", "error"]


def test_watcher_latency_with_inotify(tmp_path: Path) -> None:
    from mdclaw_agent.ipc import InputWatcher

    w = InputWatcher(tmp_path / "input", poll_seconds=60.0)  # a poll would take a minute
    assert w.uses_inotify
    written: list[float] = []
    waiting = threading.Event()
    real_wait = w._wait  # noqa: SLF001

    def noted_wait(seconds: float) -> None:
        waiting.set()
        real_wait(seconds)

    w._wait = noted_wait  # noqa: SLF001 - to write only once it waits

    def write_later() -> None:
        # Only once next() has scanned the empty folder and waits: the file is news to it.
        assert waiting.wait(20)
        written.append(time.monotonic())
        write_input(tmp_path / "input", {"text": "ping"}, "1-a.json")

    writer = threading.Thread(target=write_later)
    try:
        writer.start()
        item = w.next(timeout=20)  # only inotify can wake it before the poll
        assert item is not None and item.text == "ping"
        assert time.monotonic() - written[0] < 5
    finally:
        writer.join()
        w.close()


def test_claude_backend_missing_from_image_is_reported(dirs, tmp_path) -> None:
    """An image built without the claude wheels: a clear error, not a hang."""
    blocker = tmp_path / "blocker" / "claude_agent_sdk"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not in this image')\n")
    r = RunnerProcess(base_input(backend="claude", isScheduledTask=True), ipc_dir=dirs["ipc"],
                      group_dir=dirs["group"], global_dir=dirs["global"],
                      env={"MDCLAW_MODEL_BASE_URL": "http://127.0.0.1:9",
                           "PYTHONPATH": f"{blocker.parent}:{agent_helpers.RUNNER_SRC}"})
    assert r.wait_exit(30) == 1
    assert "claude-agent-sdk is missing" in r.results[0]["error"]
    assert r.results[0]["cause"] == "backend_missing"


def test_tool_arguments_given_as_object(dirs) -> None:
    """Some servers send tool arguments as an object instead of a JSON string."""
    with FakeOpenAI([call("send_message", text="obj args"), say("ok")],
                    object_arguments=True) as server:
        r = runner(dirs, base_input(isScheduledTask=True), server)
        assert r.wait_exit(20) == 0
        sent_back = server.requests[1].body["messages"][2]["tool_calls"][0]["function"]
        assert json.loads(sent_back["arguments"]) == {"text": "obj args"}
    assert command_files(dirs["ipc"] / "messages")[0]["text"] == "obj args"


def test_openai_history_window_drops_oldest_whole_turns(dirs) -> None:
    with FakeOpenAI() as server:  # echo
        r = runner(dirs, base_input(prompt="x" * 400), server, MDCLAW_HISTORY_CHARS="3000")
        r.wait_results(1)
        inbox = dirs["ipc"] / "input"
        for i in range(8):
            write_input(inbox, {"text": f"turn {i} " + "y" * 400}, f"17000000000{i:02d}-x.json")
        r.wait_results(9)
        write_input(inbox, None, "_close")
        assert r.wait_exit(10) == 0
        last = server.requests[-1].body["messages"]
    assert last[0]["role"] == "system" and last[1]["role"] == "user"
    assert len(json.dumps(last)) <= 3000 + 600
    assert last[-1]["content"].startswith("turn 7")
    assert not any(m["content"].startswith("x") for m in last[1:])  # the oldest turn went


def test_sigterm_ends_an_open_session_cleanly(dirs) -> None:
    import signal

    with FakeOpenAI() as server:
        r = runner(dirs, base_input(), server)
        r.wait_results(1)
        time.sleep(0.2)  # waiting for follow-ups now
        t0 = time.monotonic()
        r.proc.send_signal(signal.SIGTERM)
        assert r.wait_exit(10) == 0
        assert time.monotonic() - t0 < 3


# ----------------------------------------------------------------- failed turns and causes


def one_turn(dirs, script, **env) -> tuple[dict, FakeOpenAI]:
    with FakeOpenAI(script) as server:
        r = runner(dirs, base_input(isScheduledTask=True), server, **env)
        r.wait_exit(30)
    return r.results[-1], server


@pytest.mark.parametrize("step, cause, extra", [
    (refuse(400, "This model's maximum context length is 8192 tokens. However, you "
            "requested 9000 tokens.", code="context_length_exceeded"), "context_too_long",
     {"limit": "8192 tokens", "httpStatus": 400}),
    (refuse(401, "Incorrect API key provided"), "model_refused",
     {"httpStatus": 401, "apiMessage": "Incorrect API key provided"}),
    (refuse(429, "Rate limit reached", headers={"Retry-After": "7"}), "rate_limited",
     {"retryAfter": 7.0}),
    (refuse(429, "You exceeded your current quota", code="insufficient_quota"), "over_budget",
     {}),
    (refuse(402, "Payment required"), "over_budget", {}),
    (refuse(503, "overloaded"), "model_server_error", {"httpStatus": 503}),
    (hangup(), "model_disconnected", {}),
])
def test_a_failed_turn_names_its_cause(dirs, step, cause, extra) -> None:
    out, _ = one_turn(dirs, [step, step])
    assert out["status"] == "error" and out["cause"] == cause, out
    for k, v in extra.items():
        assert out[k] == v, (k, out)


def test_model_down_is_unreachable(dirs) -> None:
    r = RunnerProcess(base_input(isScheduledTask=True), ipc_dir=dirs["ipc"],
                      group_dir=dirs["group"], env={"MDCLAW_MODEL_BASE_URL": "http://127.0.0.1:9"})
    assert r.wait_exit(20) == 1
    assert r.results[0]["cause"] == "model_unreachable"


def test_malformed_answer_is_asked_once_more_then_reported(dirs) -> None:
    out, server = one_turn(dirs, [garble(), say("fine after all")])
    assert out["status"] == "success" and out["result"] == "fine after all"
    assert len(server.requests) == 2
    out, server = one_turn(dirs, [garble(), garble(b'{"no": "choices"}'), say("never")])
    assert out["status"] == "error" and out["cause"] == "model_malformed"
    assert len(server.requests) == 2  # twice in a row, then no more


def test_context_too_long_trims_the_history_and_tries_once_more(dirs) -> None:
    too_long = refuse(400, "maximum context length is 4096 tokens",
                      code="context_length_exceeded")
    with FakeOpenAI([say("first"), too_long, say("answered short")]) as server:
        r = runner(dirs, base_input(prompt="old turn " + "x" * 3000), server)
        r.wait_results(1)
        write_input(dirs["ipc"] / "input", {"text": "new question"}, "1700000000001-a.json")
        out = r.wait_results(2)[1]
        assert out["status"] == "success" and out["result"] == "answered short"
        assert out["notice"] == {"cause": "context_too_long", "limit": "4096 tokens"}
        retry = server.requests[2].body["messages"]
        assert not any("old turn" in str(m.get("content")) for m in retry)
        assert retry[-1]["content"] == "new question"
        # The current turn alone is over the limit: reported, not retried without end.
        server.script[:] = [too_long, say("normal again")]
        write_input(dirs["ipc"] / "input", {"text": "y" * 2000}, "1700000000002-a.json")
        out = r.wait_results(3)[2]
        assert out["status"] == "error" and out["cause"] == "context_too_long"
        n = len(server.requests)
        assert n == 4  # nothing to trim: no second request for it
        # The refused message does not ride along in the next request.
        write_input(dirs["ipc"] / "input", {"text": "next one"}, "1700000000003-a.json")
        out = r.wait_results(4)[3]
        assert out["status"] == "success" and out["result"] == "normal again"
        assert len(server.requests) == n + 1
        assert not any("yyyy" in str(m.get("content"))
                       for m in server.requests[-1].body["messages"])
        write_input(dirs["ipc"] / "input", None, "_close")
        assert r.wait_exit(10) == 0


def test_a_failed_follow_up_is_not_kept_in_the_history(dirs) -> None:
    with FakeOpenAI([say("one"), refuse(400, "bad request: unsupported content"),
                     say("three")]) as server:
        r = runner(dirs, base_input(prompt="first"), server)
        r.wait_results(1)
        write_input(dirs["ipc"] / "input", {"text": "poison"}, "1700000000001-a.json")
        out = r.wait_results(2)[1]
        assert out["cause"] == "model_refused" and out["apiMessage"].startswith("bad request")
        write_input(dirs["ipc"] / "input", {"text": "fine"}, "1700000000002-a.json")
        assert r.wait_results(3)[2]["result"] == "three"
        write_input(dirs["ipc"] / "input", None, "_close")
        assert r.wait_exit(10) == 0
        contents = [m.get("content") for m in server.requests[-1].body["messages"]]
    assert "poison" not in contents and "fine" in contents


def test_causes_through_the_real_proxy(tmp_path: Path) -> None:
    """What the proxy sees (upstream down, connection closed, key gone) reaches the runner
    as the right cause."""
    from mdclaw.models import Upstream
    from mdclaw.paths import Layout

    layout = Layout(tmp_path / "d")
    ipc = layout.group_ipc_dir("family")
    (ipc / "input").mkdir(parents=True)
    group = layout.group_dir("family")
    group.mkdir(parents=True)
    proxy = ProxyThread(layout, None)
    try:
        def cause_with(upstream: Upstream) -> str:
            proxy.start_group("family", upstream)
            r = RunnerProcess(base_input(isScheduledTask=True), ipc_dir=ipc, group_dir=group)
            assert r.wait_exit(30) == 1, r.stderr_lines
            return r.results[0]["cause"]

        assert cause_with(Upstream("openai", "m", "http://127.0.0.1:9/v1")) == "model_unreachable"
        assert proxy.proxy.recent_failure("family") == "model_unreachable"
        with FakeOpenAI([hangup(), hangup()]) as server:
            assert cause_with(Upstream("openai", "m", server.url + "/v1")) == "model_disconnected"
        with FakeOpenAI() as server:
            assert cause_with(Upstream("openai", "m", server.url + "/v1",
                                       tmp_path / "no.key")) == "key_missing"
    finally:
        proxy.close()


def test_causes_of_errors_known_only_as_text() -> None:
    """The claude backend's CLI reports errors as text; they get a cause too."""
    from mdclaw_agent.backends import classify_text, context_limit
    from mdclaw_agent.protocol import CAUSES

    cases = {
        'API Error: 400 {"type":"error","error":{"type":"invalid_request_error","message":'
        '"prompt is too long: 210000 tokens > 200000 maximum"}}': "context_too_long",
        "API Error: 429 rate_limit_error": "rate_limited",
        "API Error: 529 Overloaded": "model_server_error",
        "API Error: 401 invalid x-api-key": "model_refused",
        "Connection error.": "model_unreachable",
        "Request timed out.": "turn_timeout",
        "Your credit balance is too low": "over_budget",
        "something else entirely": "agent_crash",
    }
    for text, cause in cases.items():
        assert classify_text(text) == cause, text
        assert cause in CAUSES
    assert context_limit("prompt is too long: 210000 tokens > 200000 maximum") == "200000 tokens"
    assert context_limit("maximum context length is 8,192 tokens") == "8192 tokens"


def test_a_failed_first_turn_keeps_the_conversation_open(dirs) -> None:
    """The host may already have written the next message: it is answered, not lost."""
    with FakeOpenAI([refuse(400, "unsupported"), say("second works")]) as server:
        r = runner(dirs, base_input(prompt="bad one"), server)
        assert r.wait_results(1)[0]["cause"] == "model_refused"
        write_input(dirs["ipc"] / "input", {"text": "good one"}, "1700000000001-a.json")
        assert r.wait_results(2)[1]["result"] == "second works"
        write_input(dirs["ipc"] / "input", None, "_close")
        assert r.wait_exit(10) == 0
        assert "bad one" not in json.dumps(server.requests[-1].body)


def test_the_proxys_own_caps_read_as_rate_limited() -> None:
    """The host proxy's answers to a group over its connection or request caps are
    'wait and retry', not a model server error."""
    from mdclaw_agent.backends import classify_http

    busy = classify_http(503, json.dumps({"type": "error", "error": {
        "type": "mdclaw_proxy_busy", "message": "too many open connections"}}), "1")
    assert (busy.cause, busy.retry_after) == ("rate_limited", 1.0)
    rate = classify_http(429, json.dumps({"type": "error", "error": {
        "type": "mdclaw_proxy_rate_limited", "message": "retry in 12 s"}}), "12")
    assert (rate.cause, rate.retry_after) == ("rate_limited", 12.0)
    assert classify_http(503, '{"error": {"message": "overloaded"}}').cause == \
        "model_server_error"


def test_a_follow_up_from_another_chat_is_answered_there_by_default(dirs) -> None:
    """A group with several chats: the host gives each follow-up the chat it came from, and
    send_message without a chat goes to the chat of the message being answered; a chat the
    agent names wins; the next follow-up without one goes back to the first prompt's chat."""
    script = [call("send_message", text="from the first"), say("one"),
              call("send_message", text="to the web"), say("two"),
              call("send_message", text="named", chat_jid="tg:-100"), say("three"),
              call("send_message", text="back home"), say("four")]
    with FakeOpenAI(script) as server:
        r = runner(dirs, base_input(prompt="hi"), server)
        r.wait_results(1)
        inbox = dirs["ipc"] / "input"
        write_input(inbox, {"content": "hello from the web", "chat_jid": "hl:me"},
                    "1700000000001-a.json")
        r.wait_results(2)
        write_input(inbox, {"content": "again", "chat_jid": "hl:me"}, "1700000000002-b.json")
        r.wait_results(3)
        write_input(inbox, {"content": "a plain one"}, "1700000000003-c.json")
        r.wait_results(4)
        write_input(inbox, None, "_close")
        assert r.wait_exit(10) == 0
    sent = [(m["chat_jid"], m["text"]) for m in command_files(dirs["ipc"] / "messages")]
    assert sorted(sent, key=lambda s: ["from the first", "to the web", "named",
                                       "back home"].index(s[1])) == [
        ("tg:-100", "from the first"), ("hl:me", "to the web"), ("tg:-100", "named"),
        ("tg:-100", "back home")]
