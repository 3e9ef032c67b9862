"""Limits a hostile agent cannot get around at the credential proxy: the model it may use and
its daily token budget. The agent here is a raw HTTP client on the group's socket, as a
program in the container could be: no SDK, any bytes it likes."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime
from pathlib import Path

import pytest

from agent_helpers import ProxyThread
from fake_models import FakeAnthropic, FakeOpenAI, say
from mdclaw.budget import budget_message
from mdclaw.config import load_config
from mdclaw.failures import TurnFailure, chat_message
from mdclaw.models import Upstream
from mdclaw.paths import Layout
from mdclaw.state import Database, now_iso
from mdclaw.usage import record_usage, usage_rows


def raw_http(sock: Path, method: str, path: str, body: bytes = b"",
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request written byte by byte onto the socket; (status, headers, body)."""
    head = [f"{method} {path} HTTP/1.1", "Host: api.anthropic.com",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close", "x-api-key: placeholder"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    top, _, rest = data.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        out = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        rest = out
    return status, hdrs, rest


@pytest.fixture
def env(tmp_path: Path):
    layout = Layout(tmp_path / "d")
    db = Database(layout.db_path)
    proxy = ProxyThread(layout, db)
    yield layout, db, proxy
    proxy.close()
    db.close()


# --------------------------------------------------------------------------- the model


def test_the_upstream_sees_only_the_configured_model(env) -> None:
    layout, db, proxy = env
    with FakeAnthropic([say("a"), say("b"), say("c"), say("d")]) as up:
        sock = proxy.start_group("family", Upstream("claude", "claude-cheap", up.url))
        asked = [
            b'{"model": "claude-opus-expensive", "max_tokens": 10, "messages": []}',
            b'{"messages": []}',  # no model at all
            b'{"model": ["claude-opus-expensive"], "messages": []}',
        ]
        for body in asked:
            status, _, _ = raw_http(sock, "POST", "/v1/messages", body)
            assert status == 200
        # count_tokens takes a model too.
        raw_http(sock, "POST", "/v1/messages/count_tokens",
                 b'{"model": "claude-opus-expensive", "messages": []}')
        # Not a JSON object: refused here, never forwarded. Nor is one that repeats a key
        # (the upstream might read the first, Python the last): once rewritten, now
        # refused (test_model_pin_refuses_case_games_and_repeated_keys has the variants).
        for bad in (b"model=claude-opus-expensive", b'["claude-opus-expensive"]', b"",
                    b'{"model": "claude-cheap", "model": "claude-opus-expensive"}'):
            status, _, raw = raw_http(sock, "POST", "/v1/messages", bad)
            assert status == 400 and json.loads(raw)["error"]["type"] == "mdclaw_bad_request"
        seen = [r.body["model"] for r in up.requests]
        raws = [r.body for r in up.requests]
    assert seen == ["claude-cheap"] * 4
    assert all(json.dumps(b).count('"model"') == 1 for b in raws)
    proxy.flush()
    assert {r["model"] for r in db.query("SELECT model FROM model_usage")} == {"claude-cheap"}


@pytest.mark.parametrize(("body", "says"), [
    (b'{"Model": "claude-opus-expensive", "messages": []}', 'names the model as "Model"'),
    (b'{"model": "claude-cheap", "MODEL": "claude-opus-expensive"}',
     'names the model as "MODEL"'),
    (b'{"\\u004dODEL": "claude-opus-expensive"}', 'names the model as "MODEL"'),
    (b'{"model": "claude-cheap", "model": "claude-opus-expensive"}', 'repeats the key "model"'),
    (b'{"model": "claude-cheap", "mod\\u0065l": "claude-opus-expensive"}',
     'repeats the key "model"'),
    (b'{"max_tokens": 1, "max_tokens": 64000, "messages": []}', 'repeats the key "max_tokens"'),
    (b'{"messages": [{"role": "user", "role": "system", "content": "x"}]}',
     'repeats the key "role"'),
])
def test_model_pin_refuses_case_games_and_repeated_keys(env, body, says) -> None:
    """An upstream that matches keys without case, or keeps the first of two equal keys,
    would read a model (or a max_tokens) other than the one checked: such bodies are
    refused with 400 naming the problem, and nothing reaches the upstream."""
    layout, db, proxy = env
    with FakeAnthropic() as up:
        sock = proxy.start_group("family", Upstream("claude", "claude-cheap", up.url))
        status, _, raw = raw_http(sock, "POST", "/v1/messages", body)
        forwarded = list(up.requests)
    err = json.loads(raw)["error"]
    assert status == 400 and err["type"] == "mdclaw_bad_request"
    assert says in err["message"]
    assert forwarded == []


def test_allow_models_lets_named_models_through(env, tmp_path, write_config) -> None:
    layout, db, proxy = env
    with FakeOpenAI() as up:
        cfg = load_config(write_config(f"""\
            data_dir: {{data_dir}}
            models:
              local: {{backend: openai, model: small, base_url: "{up.url}/v1",
                       allow_models: [tiny]}}
            groups:
              main: {{name: M, jid: "hl:m", main: true, model: local}}
            """))
        sock = proxy.call(proxy.proxy.start_for_config(cfg, "main"))
        for asked in ("tiny", "huge", "small"):
            body = json.dumps({"model": asked, "messages": [{"role": "user", "content": "x"}]})
            assert raw_http(sock, "POST", "/v1/chat/completions", body.encode())[0] == 200
        assert [r.body["model"] for r in up.requests] == ["tiny", "small", "small"]


# --------------------------------------------------------------------------- the budget


def test_a_hostile_agent_is_refused_past_its_daily_budget(env) -> None:
    layout, db, proxy = env
    # 900 tokens were used earlier today (written by an earlier run).
    record_usage(db, "family", "claude-x", ok=True, input_tokens=600, output_tokens=300)
    with FakeAnthropic(usage=(40, 20)) as up:
        sock = proxy.call(proxy.proxy.start_group(
            "family", Upstream("claude", "claude-x", up.url), tokens_per_day=1000,
            timezone="Europe/Berlin"))
        other = proxy.call(proxy.proxy.start_group(
            "main", Upstream("claude", "claude-x", up.url), tokens_per_day=1000))
        replies = [raw_http(sock, "POST", "/v1/messages",
                            b'{"model": "claude-x", "max_tokens": 5, "messages": []}')
                   for _ in range(4)]
        forwarded = len(up.requests)
        # Another group's budget is its own.
        assert raw_http(other, "POST", "/v1/messages", b'{"messages": []}')[0] == 200
    # 900 + 60 < 1000: one more goes; 960 + 60 >= 1000: then every request is refused.
    assert [r[0] for r in replies] == [200, 200, 429, 429]
    assert forwarded == 2
    status, headers, raw = replies[2]
    err = json.loads(raw)["error"]
    assert err["type"] == "mdclaw_over_budget"
    assert "1020 of 1000 tokens" in err["message"]
    assert "It resets at midnight UTC" in err["message"] and "Europe/Berlin" in err["message"]
    assert headers["x-should-retry"] == "false"
    assert 1 <= int(headers["retry-after"]) <= 86400
    assert proxy.proxy.caps("family")["over_budget"] == 2
    assert proxy.proxy.recent_failure("family") == "over_budget"
    # The usage table holds every forwarded token, and only those.
    proxy.flush()
    rows = {r["group_folder"]: r for r in usage_rows(db)}
    assert rows["family"]["input_tokens"] + rows["family"]["output_tokens"] == 1020


def test_budget_counts_tokens_not_yet_written(env) -> None:
    """The in-memory counts between two flushes count as well as the database's."""
    layout, db, proxy = env
    with FakeAnthropic(usage=(30, 20)) as up:
        sock = proxy.call(proxy.proxy.start_group(
            "family", Upstream("claude", "claude-x", up.url), tokens_per_day=100))
        statuses = [raw_http(sock, "POST", "/v1/messages", b"{}")[0] for _ in range(3)]
    assert statuses == [200, 200, 429]
    assert db.query("SELECT * FROM model_usage") == []  # nothing flushed yet


def test_budget_message_and_chat_text() -> None:
    now = datetime(2026, 3, 10, 15, 0, tzinfo=UTC)
    msg = budget_message(120_500, 100_000, "Europe/Berlin", now=now)
    assert msg == ("This chat has used its model budget for today (120500 of 100000 tokens). "
                   "It resets at midnight UTC, 01:00 in Europe/Berlin.")
    assert budget_message(5, 1, "UTC", now=now).endswith("It resets at midnight UTC.")
    f = TurnFailure.from_block({"cause": "over_budget", "httpStatus": 429, "apiMessage": msg})
    text = chat_message(f, {}, outcome="config")
    assert text.startswith(msg) and "limits.tokens_per_day" in text
    assert "credit" not in text
    # The provider's own quota keeps its message.
    quota = TurnFailure("over_budget", api_message="You exceeded your current quota")
    assert "out of credit or quota" in chat_message(quota, {}, outcome="config")


def test_the_runner_maps_the_proxy_refusal_to_over_budget() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "container" / "agent-runner"))
    from mdclaw_agent.backends import budget_message as from_text
    from mdclaw_agent.backends import classify_http, classify_text

    msg = budget_message(20, 10)
    body = json.dumps({"type": "error", "error": {"type": "mdclaw_over_budget",
                                                  "message": msg}})
    err = classify_http(429, body, "3600")
    assert (err.cause, err.api_message, err.retry_after) == ("over_budget", msg, None)
    cli = f"the Claude CLI failed: API Error: 429 {body}"
    assert classify_text(cli) == "over_budget" and from_text(cli) == msg


def test_budget_comes_from_the_config_per_group(proxy_cfg) -> None:
    cfg = proxy_cfg
    assert cfg.token_budget("main") == 5000 and cfg.token_budget("family") == 200


@pytest.fixture
def proxy_cfg(write_config):  # noqa: ANN201
    return load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true}
          family: {name: F, jid: "hl:f", tokens_per_day: 200}
        limits: {tokens_per_day: 5000}
    """))


def test_usage_shows_use_against_budget(tmp_path, write_config, cli, data_dir) -> None:
    cfg_path = write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true}
          family: {name: F, jid: "hl:f", tokens_per_day: 200}
    """)
    db = Database(data_dir / "state.db")
    record_usage(db, "family", "m1", ok=True, input_tokens=150, output_tokens=100)
    record_usage(db, "main", "m1", ok=True, input_tokens=10, output_tokens=1,
                 when="2020-01-01T00:00:00.000Z")
    db.close()
    r = cli("usage", "--config", str(cfg_path))
    assert r.returncode == 0, r.stderr
    assert "family: 250 of 200 tokens today (over budget" in r.stdout
    assert "main:" not in r.stdout.split("daily token budgets")[1]  # no budget, not listed
    r = cli("usage", "--budgets", "--json", "--config", str(cfg_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"group_folder": "family", "day": now_iso()[:10],
                                     "tokens_today": 250, "tokens_per_day": 200,
                                     "over": True}]


# --------------------------------------------------------------------------- the network


def _network_cfg(write_config, group_net: str, runtime: str = ""):  # noqa: ANN202
    from mdclaw.config import ConfigError

    try:
        return load_config(write_config(f"""\
            data_dir: {{data_dir}}
            runtime: {{image: "x:1"{runtime}}}
            groups:
              main: {{name: A, jid: "hl:main", main: true}}
              fam: {{name: F, jid: "hl:f", network: "{group_net}"}}
            """))
    except ConfigError as e:
        return e


@pytest.mark.parametrize(("net", "runtime", "expect"), [
    ("none", "", "none"),
    ("bridge", ", allowed_networks: [bridge]", "bridge"),
    ("host", ", allow_host_network: true", "host"),
])
def test_allowed_networks_are_accepted(write_config, net, runtime, expect) -> None:
    cfg = _network_cfg(write_config, net, runtime)
    assert cfg.network_for("fam") == expect and cfg.network_for("main") == "none"


@pytest.mark.parametrize(("net", "runtime", "says"), [
    ("host", "", "runtime.allow_host_network: true"),
    ("host", ", allowed_networks: [bridge]", "runtime.allow_host_network: true"),
    ("bridge", "", "add 'bridge' to `runtime.allowed_networks`"),
    ("container:db", ", allowed_networks: [bridge]", "allowed: none, bridge"),
])
def test_other_networks_are_refused_with_the_fix(write_config, net, runtime, says) -> None:
    from mdclaw.config import ConfigError

    err = _network_cfg(write_config, net, runtime)
    assert isinstance(err, ConfigError)
    [issue] = err.issues
    assert issue.path == "groups.fam.network" and issue.line == 5 and says in issue.message


def test_host_cannot_be_allowed_by_the_list_alone(write_config) -> None:
    from mdclaw.config import ConfigError

    err = _network_cfg(write_config, "none", ", allowed_networks: [host]")
    assert isinstance(err, ConfigError)
    assert [i.path for i in err.issues] == ["runtime.allowed_networks"]
    assert "allow_host_network" in err.issues[0].message


def test_check_config_explains_the_refusal(write_config, cli) -> None:
    path = write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true, network: host}
        """)
    r = cli("check-config", "--config", str(path))
    assert r.returncode != 0
    assert "groups.main.network" in r.stdout + r.stderr
    assert "runtime.allow_host_network: true" in r.stdout + r.stderr
