"""Scripted stand-ins for model APIs, served for real on the host's loopback.

`FakeOpenAI` answers POST /v1/chat/completions from a script of steps (a tool call or a text
answer); `FakeAnthropic` answers POST /v1/messages the same way in the Messages API's shape,
streamed as server-sent events when asked. Both record every request (path, headers, body)
so tests can check what reached "the provider" — for instance that the real key did and the
placeholder did not.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from waiting import wait_until


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: Any
    at: float


@dataclass
class Step:
    """One scripted model answer: tool calls (name, args) or a final text — or a failure:
    an HTTP error `status` with a JSON `error` body, a `raw` answer that is not the API's
    shape, or `hangup` (the connection is closed without an answer)."""

    text: str | None = None
    tool_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    delay: float = 0.0
    status: int = 200
    error: Any = None
    raw: bytes | None = None
    hangup: bool = False
    headers: dict[str, str] = field(default_factory=dict)


def say(text: str, delay: float = 0.0) -> Step:
    return Step(text=text, delay=delay)


def call(name: str, delay: float = 0.0, **args: Any) -> Step:
    return Step(tool_calls=[(name, args)], delay=delay)


def refuse(status: int, message: str, *, code: str | None = None, delay: float = 0.0,
           headers: dict[str, str] | None = None) -> Step:
    """An HTTP error in the OpenAI API's shape: {"error": {"message", "type", "code"}}."""
    return Step(status=status, delay=delay, headers=dict(headers or {}),
                error={"error": {"message": message, "type": "invalid_request_error",
                                 "code": code}})


def garble(raw: bytes = b'{"choices": [{"message": {"content": "half', delay: float = 0.0) -> Step:
    """An answer that is not valid JSON (a server that broke off or misbehaves)."""
    return Step(raw=raw, delay=delay)


def hangup(delay: float = 0.0) -> Step:
    """Close the connection without answering."""
    return Step(hangup=True, delay=delay)


class _Server:
    """An aiohttp app on 127.0.0.1 in its own thread."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _record(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        rec = Recorded(request.method, request.path, request.query_string,
                       dict(request.headers), body, time.monotonic())
        with self._lock:
            self.requests.append(rec)
        return body

    def start(self, host: str = "127.0.0.1", port: int | None = None) -> _Server:
        """Serve on `port` (default: the port of an earlier start, else a free one), so a
        stopped server can come back at the same address."""
        ready = threading.Event()
        self._loop = asyncio.new_event_loop() if self._loop.is_closed() else self._loop

        async def setup() -> None:
            app = web.Application()
            self.routes(app)
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await self._runner.setup()
            site = web.TCPSite(self._runner, host, port if port is not None else self.port,
                               reuse_address=True)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(setup())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop.is_closed():
            return  # stopped already

        async def down() -> None:
            if self._runner:
                await self._runner.cleanup()

        fut = asyncio.run_coroutine_threadsafe(down(), self._loop)
        fut.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread:
            self._thread.join(10)
        self._loop.close()

    def __enter__(self):  # noqa: ANN204
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_for(self, n: int, timeout: float = 30.0) -> list[Recorded]:
        """Block until at least n requests arrived; return them all."""
        def got() -> list[Recorded] | None:
            with self._lock:
                return list(self.requests) if len(self.requests) >= n else None

        return wait_until(got, timeout, what=f"{n} request(s) to the fake model server")


async def _failure(request: web.Request, step: Step) -> web.StreamResponse | None:
    """The scripted failure of `step`, or None when it is an ordinary answer."""
    if step.hangup:
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError  # aiohttp drops the request quietly
    if step.raw is not None:
        return web.Response(body=step.raw, status=step.status,
                            headers={"Content-Type": "application/json", **step.headers})
    if step.status >= 400:
        return web.json_response(step.error if step.error is not None else {"error": "failed"},
                                 status=step.status, headers=step.headers)
    return None


class FakeOpenAI(_Server):
    """POST /v1/chat/completions answered from `script` (steps in order; when it runs out,
    `fallback(body)` or an echo of the last user message)."""

    def __init__(self, script: list[Step] | None = None,
                 fallback: Callable[[dict[str, Any]], Step] | None = None,
                 usage: tuple[int, int] = (11, 7), object_arguments: bool = False) -> None:
        super().__init__()
        self.script = list(script or [])
        self.fallback = fallback
        self.usage = usage
        # Some servers send tool-call arguments as a JSON object instead of a string.
        self.object_arguments = object_arguments
        self.models_status = 200  # what GET /v1/models answers

    def tool_results(self) -> list[str]:
        """The tool result the model saw after each of its calls, in order."""
        with self._lock:
            requests = list(self.requests)
        out = []
        for q in requests:
            if q.path != "/v1/chat/completions":
                continue
            last = q.body["messages"][-1]
            if last.get("role") == "tool":
                out.append(last["content"])
        return out

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_route("*", "/{tail:.*}", self._other)

    async def _other(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"error": "not here"}, status=418)

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.models_status != 200:
            return web.json_response({"error": {"message": "Incorrect API key provided"}},
                                     status=self.models_status)
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    def _next(self, body: dict[str, Any]) -> Step:
        with self._lock:
            if self.script:
                return self.script.pop(0)
        if self.fallback is not None:
            return self.fallback(body)
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        return say(f"echo: {users[-1]['content'] if users else ''}")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        step = self._next(body if isinstance(body, dict) else {})
        if step.delay:
            await asyncio.sleep(step.delay)
        failed = await _failure(request, step)
        if failed is not None:
            return failed
        n = len(self.requests)
        message: dict[str, Any] = {"role": "assistant", "content": step.text}
        if step.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{n}_{i}", "type": "function",
                 "function": {"name": name, "arguments": args if self.object_arguments
                              else json.dumps(args)}}
                for i, (name, args) in enumerate(step.tool_calls)]
        usage = {"prompt_tokens": self.usage[0], "completion_tokens": self.usage[1],
                 "total_tokens": sum(self.usage)}
        if isinstance(body, dict) and body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for word in (step.text or "").split(" "):
                chunk = {"id": f"c{n}", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"content": word + " "}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            final = {"id": f"c{n}", "object": "chat.completion.chunk", "choices": [],
                     "usage": usage}
            await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        return web.json_response({
            "id": f"chatcmpl-{n}", "object": "chat.completion", "model": body.get("model"),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if step.tool_calls else "stop"}],
            "usage": usage})


class FakeAnthropic(_Server):
    """POST /v1/messages answered from `script` in the Messages API's shape (streamed as SSE
    when the request asks for it)."""

    def __init__(self, script: list[Step] | None = None, usage: tuple[int, int] = (25, 9),
                 first_byte_delay: float = 0.0, event_delay: float = 0.0) -> None:
        super().__init__()
        self.script = list(script or [])
        self.usage = usage
        self.first_byte_delay = first_byte_delay
        self.event_delay = event_delay  # pause between streamed events

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/v1/messages/count_tokens", self._count)
        app.router.add_route("*", "/{tail:.*}", self._other)

    async def _other(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"type": "error", "error": {"type": "not_found_error",
                                                              "message": "no"}}, status=404)

    async def _count(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"input_tokens": self.usage[0]})

    def _next(self, body: dict[str, Any]) -> Step:
        with self._lock:
            if self.script:
                return self.script.pop(0)
        return say("ok")

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        body = body if isinstance(body, dict) else {}
        step = self._next(body)
        n = len(self.requests)
        content: list[dict[str, Any]] = []
        if step.text is not None:
            content.append({"type": "text", "text": step.text})
        for i, (name, args) in enumerate(step.tool_calls):
            content.append({"type": "tool_use", "id": f"toolu_{n}_{i}", "name": name,
                            "input": args})
        stop = "tool_use" if step.tool_calls else "end_turn"
        msg = {"id": f"msg_{n}", "type": "message", "role": "assistant",
               "model": body.get("model", "claude-fake"), "content": content,
               "stop_reason": stop, "stop_sequence": None,
               "usage": {"input_tokens": self.usage[0], "output_tokens": self.usage[1]}}
        if self.first_byte_delay:
            await asyncio.sleep(self.first_byte_delay)
        if not body.get("stream"):
            return web.json_response(msg)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(kind: str, data: dict[str, Any]) -> None:
            await resp.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
            if self.event_delay:
                await asyncio.sleep(self.event_delay)

        start = dict(msg, content=[], stop_reason=None,
                     usage={"input_tokens": self.usage[0], "output_tokens": 1})
        await event("message_start", {"type": "message_start", "message": start})
        for i, block in enumerate(content):
            if block["type"] == "text":
                await event("content_block_start", {"type": "content_block_start", "index": i,
                                                    "content_block": {"type": "text",
                                                                      "text": ""}})
                await event("content_block_delta", {"type": "content_block_delta", "index": i,
                                                    "delta": {"type": "text_delta",
                                                              "text": block["text"]}})
            else:
                await event("content_block_start", {
                    "type": "content_block_start", "index": i,
                    "content_block": {"type": "tool_use", "id": block["id"],
                                      "name": block["name"], "input": {}}})
                await event("content_block_delta", {
                    "type": "content_block_delta", "index": i,
                    "delta": {"type": "input_json_delta",
                              "partial_json": json.dumps(block["input"])}})
            await event("content_block_stop", {"type": "content_block_stop", "index": i})
        await event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop, "stop_sequence": None},
                                      "usage": {"output_tokens": self.usage[1]}})
        await event("message_stop", {"type": "message_stop"})
        await resp.write_eof()
        return resp
