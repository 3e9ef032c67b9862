"""The credential proxy never hands its own key back: an upstream that echoes what it was sent
(a misconfigured base_url, a debugging proxy, a compromised endpoint) puts the key into its
JSON body, into server-sent events split at every byte offset of the key, into response
headers, into its status line, compressed; the agent, a raw client on the group's socket,
must see none of it in any form mdclaw.redact covers."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import socket
import urllib.parse
from pathlib import Path

import pytest
from aiohttp import web

from agent_helpers import ProxyThread
from fake_models import _Server
from mdclaw.models import Upstream
from mdclaw.paths import Layout
from mdclaw.redact import MARKER, Redactor, all_forms, secret_forms

KEY = "sk-ant-api03-Zq8X_f3-kLmN0pQrStUvWxYz01234567890abcdEFGH-ijklMNOPqrAA"


def covered(key: str) -> list[bytes]:
    """Every spelling of `key` the agent must not see: the raw key, the Bearer header value
    and the header lines, JSON- and URL-escaped, and base64 of header lines at any offset."""
    raw = key.encode()
    texts = [raw, b"Bearer " + raw, b"x-api-key: " + raw, b"Authorization: Bearer " + raw,
             json.dumps(key).encode(), urllib.parse.quote(key, safe="").encode()]
    for prefix in (b"", b"k", b"ke", b"x-api-key: ", b"Bearer ", b"user:"):
        texts.append(base64.b64encode(prefix + raw))
        texts.append(base64.urlsafe_b64encode(prefix + raw))
    return texts


# --------------------------------------------------------------------------- the redactor


def _through(red: Redactor, chunks: list[bytes]) -> bytes:
    return b"".join(red.feed(c) for c in chunks) + red.finish()


@pytest.mark.parametrize("text", covered(KEY)[:6] + covered(KEY)[6::5])
def test_every_form_is_removed_wherever_the_chunks_split_it(text: bytes) -> None:
    forms = all_forms([KEY])
    stream = b'data: {"echo": "' + text + b'", "again": "' + text + b'"}\n\n'
    whole = _through(Redactor(forms), [stream])
    assert KEY.encode() not in whole and MARKER in whole
    for cut in range(1, len(stream)):
        got = _through(Redactor(forms), [stream[:cut], stream[cut:]])
        assert got == whole, cut
    # Also one byte at a time.
    assert _through(Redactor(forms), [bytes([b]) for b in stream]) == whole


def test_ordinary_chunks_are_not_held_back() -> None:
    """An answer streams as it comes: only a tail that could start a form waits."""
    red = Redactor(all_forms([KEY]))
    event = b'event: content_block_delta\ndata: {"text": "hello"}\n\n'
    assert red.feed(event) == event
    # A tail that could start the key waits for the next chunk, then goes.
    assert red.feed(b"the sk-a") == b"the "
    assert red.feed(b"nt and more\n") == b"sk-ant and more\n"
    assert red.feed(b"sk-") == b""
    assert red.finish() == b"sk-"


def test_forms_of_a_key_with_characters_that_escape() -> None:
    odd = "k3y/with+plus=and\u00e9tc-0123456789"
    forms = secret_forms(odd)
    assert odd.encode() in forms
    assert json.dumps(odd)[1:-1].encode() in forms  # \u00e9
    assert b"k3y\\/with" in b"".join(forms)  # the \/ spelling
    assert urllib.parse.quote(odd, safe="").encode() in forms
    red = Redactor(forms)
    for text in (json.dumps({"k": odd}).encode(), json.dumps({"k": odd}).replace("/", "\\/")
                 .encode(), urllib.parse.urlencode({"k": odd}).encode()):
        assert odd.encode() not in _through(red, [text]) and MARKER in _through(red, [text])


def test_a_key_too_short_to_be_a_secret_is_not_looked_for() -> None:
    assert secret_forms("x") == [] and not Redactor(all_forms(["x"]))
    assert Redactor([]).feed(b"x") == b"x"


# --------------------------------------------------------------------------- an echoing upstream


class Echo(_Server):
    """Answers every request by echoing its headers: into a JSON body (or an SSE stream, the
    key split at every byte offset across two writes), into response headers, into the
    reason phrase, and gzip-compressed when asked by the path."""

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self._echo)

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        sent = dict(request.headers)
        key = sent.get("x-api-key") or sent.get("Authorization", "").removeprefix("Bearer ")
        echoed = "\n".join(f"{k}: {v}" for k, v in sent.items())
        headers = {"request-id": f"req_{key}", "x-echo": echoed.replace("\n", " | "),
                   "anthropic-ratelimit-requests-remaining": f"Bearer {key}",
                   "set-cookie": f"k={key}", "x-request-id": base64.b64encode(
                       f"x-api-key: {key}".encode()).decode()}
        reason = f"OK {key}"
        if isinstance(body, dict) and body.get("stream"):
            resp = web.StreamResponse(status=200, reason=reason, headers={
                **headers, "Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for cut in range(len(key) + 1):
                event = f'data: {json.dumps({"i": cut, "echo": key})}\n\n'.encode()
                at = event.index(key.encode()) + cut
                await resp.write(event[:at])
                await asyncio.sleep(0.002)  # two reads on the proxy's side
                await resp.write(event[at:])
            extra = "\n".join(f"data: {json.dumps({'form': f.decode('latin-1')})}"
                              for f in covered(key))
            await resp.write(f"data: {json.dumps({'headers': sent})}\n{extra}\n\n".encode())
            await resp.write_eof()
            return resp
        payload = json.dumps({"headers": sent, "echo": echoed, "body": body,
                              "forms": [f.decode("latin-1") for f in covered(key)],
                              "usage": {"input_tokens": 1, "output_tokens": 1}}).encode()
        if request.query_string == "gzip":
            return web.Response(body=gzip.compress(payload), reason=reason, headers={
                **headers, "Content-Type": "application/json", "Content-Encoding": "gzip"})
        if request.query_string == "odd":
            return web.Response(body=payload, headers={"Content-Type": "application/json",
                                                       "Content-Encoding": "x-odd"})
        return web.Response(body=payload, reason=reason,
                            headers={**headers, "Content-Type": "application/json"})


def raw_exchange(sock: Path, request: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        s.connect(str(sock))
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def post(path: str, body: dict, auth: str) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\nConnection: close\r\n{auth}\r\n\r\n").encode() + raw


def dechunk(rest: bytes) -> bytes:
    out = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


@pytest.fixture
def env(tmp_path: Path):
    layout = Layout(tmp_path / "d")
    proxy = ProxyThread(layout)
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    yield proxy, key
    proxy.close()


@pytest.mark.parametrize("backend", ["claude", "openai"])
@pytest.mark.parametrize("how", ["json", "stream", "gzip"])
def test_an_echoing_upstream_never_gets_the_key_to_the_agent(env, backend, how) -> None:
    proxy, key = env
    path = "/v1/messages" if backend == "claude" else "/v1/chat/completions"
    with Echo() as up:
        sock = proxy.start_group("family", Upstream(backend, "m", up.url, key))
        body = {"model": "m", "stream": how == "stream", "messages": [{"role": "user",
                                                                      "content": "hi"}]}
        got = raw_exchange(sock, post(path + ("?gzip" if how == "gzip" else ""), body,
                                      "x-api-key: placeholder"))
        [seen] = up.requests
    # The upstream did get the real key (and echoed it), the agent did not.
    assert KEY in json.dumps(seen.headers)
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    rest = dechunk(rest)
    for form in covered(KEY) + secret_forms(KEY):
        assert form not in got, form
    assert MARKER in rest
    lower = head.lower()
    # Headers the agent needs pass (with the key replaced); the rest are dropped.
    assert b"request-id: req_[mdclaw: credential removed]" in lower
    assert b"anthropic-ratelimit-requests-remaining: bearer [mdclaw" in lower
    assert b"x-request-id:" in lower
    assert b"x-echo" not in lower and b"set-cookie" not in lower
    assert b"content-encoding" not in lower and b"server: python" not in lower.replace(
        b"server: python/3", b"")  # the proxy's own Server header names aiohttp, no more
    if how == "stream":
        # Every split of the key came through as one marker, in order.
        events = [json.loads(line[5:]) for line in rest.split(b"\n")
                  if line.startswith(b'data: {"i"')]
        assert [e["i"] for e in events] == list(range(len(KEY) + 1))
        assert {e["echo"] for e in events} == {MARKER.decode()}
    else:
        assert json.loads(rest)["echo"]  # the JSON is still JSON (and was decompressed)


def test_an_answer_the_proxy_cannot_read_is_not_passed_on(env) -> None:
    proxy, key = env
    with Echo() as up:
        sock = proxy.start_group("family", Upstream("claude", "m", up.url, key))
        got = raw_exchange(sock, post("/v1/messages?odd", {"model": "m"}, "x-api-key: p"))
    assert got.startswith(b"HTTP/1.1 502") and b"mdclaw_upstream_encoding" in got
    assert KEY.encode() not in got
