"""The credential proxy on a real unix socket in front of real (fake-provider) servers."""

from __future__ import annotations

import asyncio
import json
import stat
import time
from pathlib import Path

import aiohttp
import pytest

from agent_helpers import ProxyThread
from fake_models import FakeAnthropic, FakeOpenAI, say
from mdclaw.config import ModelSpec, load_config
from mdclaw.models import Upstream, container_model_fields, model_for_group
from mdclaw.paths import Layout
from mdclaw.state import Database
from mdclaw.usage import UsageCounter


@pytest.fixture
def env(tmp_path: Path):
    layout = Layout(tmp_path / "d")
    for g in ("family", "main"):
        layout.group_ipc_dir(g).mkdir(parents=True)
    key = tmp_path / "anthropic.key"
    key.write_text("sk-ant-REAL\n")
    key.chmod(0o600)
    db = Database(layout.db_path)
    proxy = ProxyThread(layout, db)
    yield layout, db, proxy, key
    proxy.close()
    db.close()


async def _request(sock: Path, method: str, path: str, *, body=None, headers=None):
    conn = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=conn) as s:
        async with s.request(method, f"http://localhost{path}", json=body,
                             headers=headers or {}) as r:
            return r.status, dict(r.headers), await r.read()


def request(sock: Path, method: str, path: str, **kw):
    return asyncio.run(_request(sock, method, path, **kw))


def test_claude_streaming_auth_and_usage(env) -> None:
    layout, db, proxy, key = env
    with FakeAnthropic([say("Hello there")], usage=(30, 12)) as up:
        sock = proxy.start_group("family", Upstream("claude", "claude-x", up.url, key))
        assert sock == layout.proxy_socket("family")
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        status, headers, raw = request(
            sock, "POST", "/v1/messages?beta=true",
            body={"model": "claude-x", "stream": True, "max_tokens": 10,
                  "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "placeholder", "Authorization": "Bearer placeholder",
                     "anthropic-version": "2023-06-01", "Cookie": "a=b"})
        rec = up.requests[0]
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    text = raw.decode()
    assert "message_start" in text and "Hello there" in text and "message_stop" in text
    assert rec.headers["x-api-key"] == "sk-ant-REAL"
    assert "Authorization" not in rec.headers and "Cookie" not in rec.headers
    assert rec.headers["anthropic-version"] == "2023-06-01"
    assert rec.query == "beta=true"
    proxy.flush()
    row = dict(db.query("SELECT * FROM model_usage")[0])
    assert (row["group_folder"], row["model"], row["requests"], row["errors"]) == \
        ("family", "claude-x", 1, 0)
    assert (row["input_tokens"], row["output_tokens"]) == (30, 12)


def test_only_model_paths_are_forwarded(env) -> None:
    layout, db, proxy, key = env
    with FakeAnthropic() as up:
        sock = proxy.start_group("family", Upstream("claude", "claude-x", up.url, key))
        for method, path in [("GET", "/"), ("POST", "/v1/complete"), ("GET", "/v1/messages"),
                             ("POST", "/v1/messages/../../admin"), ("DELETE", "/v1/messages"),
                             ("POST", "/v1/chat/completions")]:
            status, _, raw = request(sock, method, path, body={})
            assert status == 404, (method, path)
        assert up.requests == []
        status, _, raw = request(sock, "POST", "/v1/messages/count_tokens",
                                 body={"model": "claude-x", "messages": []})
        assert status == 200 and json.loads(raw) == {"input_tokens": 25}


def test_openai_upstream_with_v1_base_and_json_usage(env, tmp_path) -> None:
    layout, db, proxy, _ = env
    with FakeOpenAI([say("plain answer")], usage=(5, 3)) as up:
        # A local server without a key: nothing is injected, the client's is still dropped.
        sock = proxy.start_group("main", Upstream("openai", "m", up.url + "/v1", None))
        status, _, raw = request(sock, "POST", "/v1/chat/completions",
                                 body={"model": "m", "messages": []},
                                 headers={"Authorization": "Bearer placeholder"})
        assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == \
            "plain answer"
        assert "Authorization" not in up.requests[0].headers
        assert up.requests[0].path == "/v1/chat/completions"
        status, _, _ = request(sock, "POST", "/v1/messages", body={})
        assert status == 404
    proxy.flush()
    row = dict(db.query("SELECT * FROM model_usage")[0])
    assert (row["requests"], row["input_tokens"], row["output_tokens"]) == (1, 5, 3)


def test_upstream_down_and_unreadable_key_are_502_and_counted(env, tmp_path) -> None:
    layout, db, proxy, key = env
    sock = proxy.start_group("family", Upstream("claude", "c", "http://127.0.0.1:9", key))
    status, _, raw = request(sock, "POST", "/v1/messages", body={"model": "c"})
    assert status == 502 and b"could not be reached" in raw
    gone = tmp_path / "gone.key"
    sock = proxy.start_group("family", Upstream("claude", "c", "http://127.0.0.1:9", gone))
    status, _, raw = request(sock, "POST", "/v1/messages", body={"model": "c"})
    assert status == 502 and b"cannot read the API key" in raw
    assert str(gone) not in raw.decode()
    proxy.flush()
    row = dict(db.query("SELECT SUM(requests) r, SUM(errors) e FROM model_usage")[0])
    assert row == {"r": 2, "e": 2}


def test_socket_removed_on_stop_and_long_data_dirs_work(env, tmp_path) -> None:
    layout, db, proxy, key = env
    sock = proxy.start_group("family", Upstream("claude", "c", "http://127.0.0.1:9", key))
    assert sock.is_socket()
    proxy.call(proxy.proxy.stop_group("family"))
    assert not sock.exists()
    # Beyond the 107 bytes a unix socket path may have: bound through the folder's fd.
    deep = Layout(tmp_path / ("x" * 120))
    p2 = ProxyThread(deep)
    try:
        long_sock = p2.start_group("family", Upstream("claude", "c", "http://127.0.0.1:9", key))
        assert len(str(long_sock)) > 107 and long_sock.is_socket()
        assert stat.S_IMODE(long_sock.stat().st_mode) == 0o660
    finally:
        p2.close()
    assert not long_sock.exists()


def test_the_socket_folder_is_the_hosts_and_a_planted_link_is_replaced(env, tmp_path) -> None:
    """The socket's folder is not the container's to write; even so, whatever stands at the
    socket's name is replaced, never followed, and the mode lands on the socket itself."""
    layout, db, proxy, key = env
    victim = tmp_path / "victim"
    victim.write_text("host data")
    victim.chmod(0o600)
    pdir = layout.proxy_dir("family")
    pdir.mkdir(parents=True)
    (pdir / "proxy.sock").symlink_to(victim)
    sock = proxy.start_group("family", Upstream("claude", "c", "http://127.0.0.1:9", key))
    assert sock.is_socket() and not sock.is_symlink()
    assert victim.read_text() == "host data" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert stat.S_IMODE(pdir.stat().st_mode) == 0o750  # group may enter, nobody may write


def test_usage_counter_both_stream_dialects() -> None:
    c = UsageCounter()
    c.feed_sse(b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
               b'{"input_tokens":10,"cache_read_input_tokens":5,"output_tokens":1}}}\n\nda')
    c.feed_sse(b'ta: {"type":"message_delta","usage":{"output_tokens":42}}\n\n')
    c.finish()
    assert (c.input_tokens, c.output_tokens) == (15, 42)
    o = UsageCounter()
    o.feed_sse(b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}\n\n'
               b"data: [DONE]\n\n")
    o.finish()
    assert (o.input_tokens, o.output_tokens) == (7, 2)


def test_model_selection_from_config(tmp_path, write_config) -> None:
    key = tmp_path / "k"
    key.write_text("x")
    key.chmod(0o600)
    cfg = load_config(write_config(f"""\
        data_dir: {{data_dir}}
        models:
          claude: {{backend: claude, model: claude-sonnet-4-5, api_key_file: {key}}}
          local: {{backend: openai, model: "qwen2.5:7b", base_url: "http://127.0.0.1:11434/v1"}}
        assistant: {{name: Andy, timezone: UTC, model: claude}}
        groups:
          main: {{name: Main, jid: "tg:1", main: true}}
          family: {{name: Family, jid: "tg:-1001234", model: local}}
        """))
    assert model_for_group(cfg, "family")[0] == "local"
    assert model_for_group(cfg, "main")[0] == "claude"
    assert container_model_fields(cfg, "family") == {"backend": "openai", "model": "qwen2.5:7b"}
    up = Upstream.from_spec(cfg.models["claude"])
    assert up.base_url == "https://api.anthropic.com" and up.api_key_file == key
    assert Upstream.from_spec(ModelSpec(backend="openai", model="m")).url_for(
        "/v1/chat/completions", "") == "https://api.openai.com/v1/chat/completions"


def test_usage_cli(tmp_path, write_config, cli, data_dir) -> None:
    from mdclaw.usage import record_usage

    cfg_path = write_config()
    db = Database(data_dir / "state.db")
    record_usage(db, "family", "m1", ok=True, input_tokens=10, output_tokens=4)
    record_usage(db, "family", "m1", ok=False, input_tokens=0, output_tokens=0)
    record_usage(db, "main", "m2", ok=True, input_tokens=1, output_tokens=1,
                 when="2020-01-01T00:00:00.000Z")
    db.close()
    r = cli("usage", "--json", "--config", str(cfg_path))
    assert r.returncode == 0, r.stderr
    rows = {x["group_folder"]: x for x in json.loads(r.stdout)}
    assert rows["family"]["requests"] == 2 and rows["family"]["errors"] == 1
    assert rows["family"]["input_tokens"] == 10 and rows["main"]["requests"] == 1
    r = cli("usage", "--days", "7", "--config", str(cfg_path))
    assert r.returncode == 0
    assert "family" in r.stdout and "main " not in r.stdout and "total: 2 request(s)" in r.stdout
    r = cli("usage", "--group", "nobody", "--config", str(cfg_path))
    assert "no model requests recorded" in r.stdout


def test_key_rotation_and_counts_persisted_on_stop(env) -> None:
    layout, db, proxy, key = env
    with FakeAnthropic([say("a"), say("b")]) as up:
        sock = proxy.start_group("family", Upstream("claude", "claude-x", up.url, key))
        request(sock, "POST", "/v1/messages", body={"model": "claude-x"})
        key.write_text("sk-ant-ROTATED\n")  # a new key file content is picked up
        import os
        os.utime(key, (1, 1))
        request(sock, "POST", "/v1/messages", body={"model": "claude-x"})
        assert [q.headers["x-api-key"] for q in up.requests] == ["sk-ant-REAL", "sk-ant-ROTATED"]
    assert db.query("SELECT * FROM model_usage") == []  # not yet flushed (5 s interval)
    proxy.call(proxy.proxy.stop_group("family"))
    row = dict(db.query("SELECT * FROM model_usage")[0])
    assert row["requests"] == 2 and row["input_tokens"] == 50


def test_for_run_serves_only_during_the_block(tmp_path, write_config) -> None:
    cfg = load_config(write_config("""\
        data_dir: {data_dir}
        models:
          local: {backend: openai, model: "qwen2.5:7b", base_url: "http://127.0.0.1:9/v1"}
        groups:
          main: {name: Main, jid: "tg:1", main: true, model: local}
        """))
    layout = Layout(cfg.data_dir)
    layout.group_ipc_dir("main").mkdir(parents=True)
    sock = layout.proxy_socket("main")

    async def scenario() -> dict:
        from mdclaw.proxy import CredentialProxy

        proxy = CredentialProxy(layout)
        async with proxy.for_run(cfg, "main") as fields:
            assert sock.is_socket() and proxy.running() == ["main"]
        assert not sock.exists() and proxy.running() == []
        await proxy.close()
        return fields

    assert asyncio.run(scenario()) == {"backend": "openai", "model": "qwen2.5:7b"}


async def _first_and_total(sock: Path, body: dict) -> tuple[float, float, bytes]:
    import time

    conn = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=conn) as s:
        t0 = time.monotonic()
        async with s.post("http://localhost/v1/messages", json=body) as r:
            first_chunk = await r.content.readany()
            t_first = time.monotonic() - t0
            rest = await r.read()
            return t_first, time.monotonic() - t0, first_chunk + rest


def test_responses_stream_through_not_buffered(env) -> None:
    layout, db, proxy, key = env
    with FakeAnthropic([say("slowly")], event_delay=0.25) as up:
        sock = proxy.start_group("family", Upstream("claude", "claude-x", up.url, key))
        t_first, t_total, raw = asyncio.run(_first_and_total(
            sock, {"model": "claude-x", "stream": True}))
    assert b"message_stop" in raw
    assert t_total > 1.2  # 7 events, 0.25 s apart
    assert t_first < 0.6  # the first event arrived while the rest was still coming


def test_groups_are_told_apart_by_socket(env) -> None:
    layout, db, proxy, key = env
    with FakeAnthropic(usage=(10, 1)) as up:
        s1 = proxy.start_group("family", Upstream("claude", "claude-x", up.url, key))
        s2 = proxy.start_group("main", Upstream("claude", "claude-x", up.url, key))
        for sock, n in ((s1, 3), (s2, 1)):
            for _ in range(n):
                # Whatever the body claims, the socket says who is asking.
                request(sock, "POST", "/v1/messages",
                        body={"model": "claude-x", "metadata": {"group": "main"}})
    proxy.flush()
    rows = {r["group_folder"]: r["requests"] for r in db.query("SELECT * FROM model_usage")}
    assert rows == {"family": 3, "main": 1}


def test_oversized_request_is_refused(env) -> None:
    layout, db, proxy, key = env
    with FakeAnthropic() as up:
        sock = proxy.start_group("family", Upstream("claude", "claude-x", up.url, key))
        status, _, _ = request(sock, "POST", "/v1/messages",
                               body={"model": "x", "pad": "a" * (33 * 1024 * 1024)})
        assert status == 413
        assert up.requests == []


def test_parallel_requests_per_group_are_capped(env) -> None:
    layout, db, proxy, key = env
    with FakeOpenAI(fallback=lambda body: say("slow", delay=0.3)) as up:
        sock = proxy.start_group("main", Upstream("openai", "m", up.url + "/v1", None))

        async def burst() -> float:
            import time

            conn = aiohttp.UnixConnector(path=str(sock), limit=0)
            async with aiohttp.ClientSession(connector=conn) as s:
                async def one() -> None:
                    async with s.post("http://x/v1/chat/completions",
                                      json={"model": "m", "messages": []}) as r:
                        assert r.status == 200
                        await r.read()
                t0 = time.monotonic()
                await asyncio.gather(*(one() for _ in range(16)))
                return time.monotonic() - t0

        elapsed = asyncio.run(burst())
    # 16 requests of 0.3 s each, at most 8 at once: at least two rounds.
    assert elapsed >= 0.55


def test_made_up_model_names_of_failed_requests_are_not_recorded(env) -> None:
    layout, db, proxy, key = env
    sock = proxy.start_group("family", Upstream("claude", "claude-x", "http://127.0.0.1:9", key))
    for i in range(5):
        status, _, _ = request(sock, "POST", "/v1/messages", body={"model": f"junk-{i}"})
        assert status == 502
    proxy.flush()
    rows = [dict(r) for r in db.query("SELECT model, requests, errors FROM model_usage")]
    assert rows == [{"model": "claude-x", "requests": 5, "errors": 5}]


def test_stopping_a_group_does_not_wait_for_a_slow_model(env) -> None:
    """The container was killed while the model was slow: its proxy stops at once."""
    import threading

    layout, db, proxy, key = env
    with FakeOpenAI([say("late", delay=30)]) as server:
        sock = proxy.start_group("family", Upstream("openai", "m", server.url + "/v1", key))
        t = threading.Thread(target=lambda: _quiet(request, sock, "POST",
                                                   "/v1/chat/completions",
                                                   body={"model": "m", "messages": []}),
                             daemon=True)
        t.start()
        server.wait_for(1, 10)
        t0 = time.monotonic()
        proxy.call(proxy.proxy.stop_group("family"))
        assert time.monotonic() - t0 < 5


def _quiet(fn, *args, **kw) -> None:  # noqa: ANN001
    try:
        fn(*args, **kw)
    except Exception:  # noqa: BLE001 - the connection is cut on purpose
        pass
