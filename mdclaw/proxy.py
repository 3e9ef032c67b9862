"""The credential proxy: how an agent container reaches its model without holding a key.

For each running container the host serves the model API on a unix socket in a folder of its
own (`proxy/<folder>/proxy.sock`), which the container sees read-only at
/workspace/proxy: it can connect, but it cannot replace the socket or anything beside it.
The agent runner forwards a loopback port in the container to it. For every request the
proxy:

- accepts only the model API's own paths (POST /v1/messages for claude, POST
  /v1/chat/completions for openai, and a few read-only ones) — anything else is 404;
- drops whatever credentials the client sent and injects the real one, read from the
  model's `api_key_file` (never logged; the endpoint, its URL rules and credential are
  mdclaw.models.Upstream);
- sends the group's configured model whatever the request names: a request body must be a
  JSON object, read strictly (mdclaw.models.read_request: a repeated key, or `model` under
  another spelling, is refused with 400), and its `model` is set to the configured one
  unless it names one of the entry's `allow_models` (the key is paid for the models the
  operator chose, not the ones the agent prefers);
- refuses (403 `mdclaw_server_tools_refused`) a request that would make the model API run
  tools or fetch URLs itself — server tools, `mcp_servers`, images by URL — unless the
  model's entry has `allow_server_tools` (the rule: mdclaw.toolpolicy);
- asks the budget (mdclaw.budget) whether the request may go: when it arrives, every
  request of a group that used its daily token budget (`limits.tokens_per_day`) is refused
  with HTTP 429 `mdclaw_over_budget`, saying when it resets; when a request that makes the
  model answer is sent upstream (after it got one of the group's concurrency slots), it
  reserves its share of what is left (`Budget.admit`), and gives it back when its answer
  ended and its real usage is counted — also when the agent hung up, the upstream failed
  or the group's proxy was stopped;
- forwards to the configured upstream and streams the answer back as it arrives, with the
  proxy's own credential removed from everything it returns: only the response headers
  the model SDKs use are passed on (`FORWARD_RESPONSE_HEADERS`), and every form of the key
  in them, in the status line and in the body (also split across chunks) is replaced by a
  marker (mdclaw.redact);
- counts the request and the tokens the API reports in the usage ledger (mdclaw.usage),
  which writes them to the state database (`model_usage`) per group, model and UTC day —
  `mdclaw usage` shows them. An agent that hangs up mid-answer does not end the upstream
  request: the answer is read to its end (and dropped) so that its usage is counted.

A container cannot use its socket against the host or the other groups: it may hold at most
`limits.proxy_connections` connections open (more are answered with a short 503 and closed
as soon as they are accepted, so the daemon's file descriptors stay bounded whatever the
container does; further attempts wait in the kernel's listen queue, not in the daemon), and
send at most `limits.proxy_requests_per_minute` requests (a token bucket: bursts up to that
many, then that many per minute; more get HTTP 429 with `Retry-After`). Both can be set per
group. A connection that sends its request's headers or body too slowly, sends nothing, or
stops reading its answer is closed (mdclaw.listener, with the web server's default limits).

The group comes from which socket the request arrived on, never from anything the client says.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from mdclaw import agentfs
from mdclaw.budget import (
    DEFAULT_ANSWER_ESTIMATE,
    Budget,
    OverBudget,
    Reservation,
    request_need,
)
from mdclaw.config import Config
from mdclaw.errors import EngineError
from mdclaw.listener import ConnectionGuard, ConnectionLimits
from mdclaw.models import BadRequestBody, Upstream, container_model_fields, model_for_group
from mdclaw.paths import PROXY_DIR_MODE, PROXY_SOCKET_NAME, Layout
from mdclaw.proxy_socket import CLOSE_GRACE, GroupCaps, GroupListener
from mdclaw.redact import MIN_SECRET, Redactor, all_forms
from mdclaw.state import Database
from mdclaw.toolpolicy import refusal, server_side_use
from mdclaw.usage import UsageCounter, UsageLedger

log = logging.getLogger("mdclaw.proxy")

SOCKET_NAME = PROXY_SOCKET_NAME
SOCKET_MODE = 0o660
MAX_REQUEST_BYTES = 32 * 1024 * 1024

# (method, path) the proxy forwards, per backend; everything else is refused.
ALLOWED_ROUTES: dict[str, frozenset[tuple[str, str]]] = {
    "claude": frozenset({("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
                         ("GET", "/v1/models")}),
    "openai": frozenset({("POST", "/v1/chat/completions"), ("GET", "/v1/models")}),
}
# Request headers never forwarded: credentials, hop-by-hop, and those aiohttp sets itself.
DROP_REQUEST_HEADERS = frozenset({
    "authorization", "x-api-key", "api-key", "proxy-authorization", "cookie", "host",
    "content-length", "connection", "keep-alive", "te", "trailer", "transfer-encoding",
    "upgrade", "accept-encoding", "forwarded", "x-forwarded-for", "x-forwarded-host",
    "x-forwarded-proto", "x-real-ip",
})
# The requests that make the model answer, and so spend tokens: each reserves its share of
# the group's daily budget while it is in flight (mdclaw.budget.Budget.admit).
ANSWERING_ROUTES = frozenset({("POST", "/v1/messages"), ("POST", "/v1/chat/completions")})
# Response headers passed on to the agent; every other one is dropped (an upstream that
# echoes what it was sent would echo the key; cookies, server names and account ids are
# nobody's business in the container). What the SDKs read, by their docs and code:
# content-type (JSON or a stream), the request id (Anthropic's `request-id`, OpenAI's
# `x-request-id`: the SDKs put it on results and errors), when to retry (`retry-after`,
# `retry-after-ms`, `x-should-retry`, which both SDKs' retry loops honour), the rate-limit
# state both APIs document (`anthropic-ratelimit-*`, `x-ratelimit-*`: what is left and when
# it resets, for a client that paces itself), and OpenAI's `openai-processing-ms` /
# `openai-version`.
# Not passed on: `anthropic-organization-id`, `openai-organization`, `openai-project`
# (which account the key belongs to), `set-cookie`, `server`, `via`, and the framing ones
# (length, encoding, connection) that the proxy's own response sets.
FORWARD_RESPONSE_HEADERS = frozenset({
    "content-type", "request-id", "x-request-id", "retry-after", "retry-after-ms",
    "x-should-retry", "openai-processing-ms", "openai-version",
})
FORWARD_RESPONSE_PREFIXES = ("anthropic-ratelimit-", "x-ratelimit-")
# Encodings of an answer the proxy can read (aiohttp decodes them) and so check for the key.
READABLE_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})


DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_REQUESTS_PER_MINUTE = 300


class ProxyError(EngineError, RuntimeError):
    """The proxy for a group cannot be started (socket path too long, folder missing...)."""


def _upstream_failure(e: BaseException) -> tuple[str, str, str]:
    """(error type for the agent, failure cause, words) for an exception of the upstream
    request. The types start with `mdclaw_` so the agent tells them from the API's own."""
    if isinstance(e, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "mdclaw_upstream_timeout", "turn_timeout", "did not answer in time"
    if isinstance(e, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | aiohttp.ClientOSError) and not isinstance(e, aiohttp.ClientConnectorError):
        return ("mdclaw_upstream_disconnected", "model_disconnected",
                "closed the connection without answering")
    return "mdclaw_upstream_unreachable", "model_unreachable", "could not be reached"


@dataclass
class _GroupSite:
    folder: str
    upstream: Upstream
    socket_path: Path
    runner: web.AppRunner
    listener: GroupListener
    caps: GroupCaps
    requests: int = 0


class CredentialProxy:
    """Serves one unix socket per running group. Use inside a running event loop.

    `start_group` before the container starts, `stop_group` after it ended, `close` at
    shutdown. Every forwarded request is counted in `ledger` (mdclaw.usage.UsageLedger over
    `db`, written every `flush_interval` seconds, when a group's proxy stops and at `close`;
    `db` None: nothing is persisted, the counts stay in `ledger.stats`), and `budget`
    (mdclaw.budget) says whether a group's request may go at all. At most `max_concurrent`
    requests per group are forwarded at once; more wait. At most `max_connections`
    connections per group are open at once and `requests_per_minute` requests are taken
    (both can be given per group to `start_group`).
    """

    def __init__(self, layout: Layout, db: Database | None = None, *,
                 connect_timeout: float = 30.0, read_timeout: float = 600.0,
                 flush_interval: float = 5.0, max_concurrent: int = 8,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 requests_per_minute: int = DEFAULT_REQUESTS_PER_MINUTE) -> None:
        self.layout = layout
        self.db = db
        self.max_concurrent = max_concurrent
        self.max_connections = max_connections
        self.requests_per_minute = requests_per_minute
        self._sites: dict[str, _GroupSite] = {}
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout,
                                              sock_read=read_timeout)
        self.ledger = UsageLedger(db, flush_interval=flush_interval)
        self.budget = Budget(self.ledger)
        # folder -> (group, tokens_per_day) of the agents waiting for its answer (charge_also)
        self._payers: dict[str, tuple[tuple[str, int | None], ...]] = {}
        # key file -> (mtime, inode, credential headers, the forms of the key to remove)
        self._keys: dict[Path, tuple[float, int, dict[str, str], list[bytes]]] = {}
        # folder -> (cause, time.monotonic()) of its latest request that failed here.
        self.last_failure: dict[str, tuple[str, float]] = {}
        # folder -> request handlers under way (cancelled when the group's proxy stops).
        self._inflight: dict[str, set[asyncio.Task[Any]]] = {}

    def socket_path(self, folder: str) -> Path:
        return self.layout.proxy_socket(folder)

    def _bind(self, folder: str) -> socket.socket:
        """The group's listening socket in proxy/<folder>/, a folder the container cannot
        write (it sees it read-only). The socket's mode comes from how it is made: the
        daemon's group, which the container runs with, may connect; nobody else."""
        agentfs.make_dirs(self.layout.proxy_root, PROXY_DIR_MODE)
        with agentfs.opened(self.layout.proxy_root) as root:
            dfd = agentfs.ensure_dir(root, agentfs.check_name(folder), PROXY_DIR_MODE,
                                     fix_mode=True)
            try:
                return agentfs.bind_socket(dfd, PROXY_SOCKET_NAME, SOCKET_MODE)
            finally:
                os.close(dfd)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # trust_env: an HTTP(S)_PROXY set for the daemon applies to the upstream too.
            # auto_decompress: an answer compressed although asked for `identity` is read
            # decoded, so that it can be checked for the key (and is sent on decoded).
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, auto_decompress=True, trust_env=True,
                connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=60))
        return self._session

    async def start_group(self, folder: str, upstream: Upstream, *,
                          max_connections: int | None = None,
                          requests_per_minute: int | None = None,
                          tokens_per_day: int | None = None,
                          timezone: str = "UTC",
                          answer_estimate: int = DEFAULT_ANSWER_ESTIMATE) -> Path:
        """Serve `folder`'s socket (replacing a stale one); return its path. The caps
        default to the proxy's own; `tokens_per_day` None: no token budget (`timezone` is
        the one the budget's reset time is told in; `answer_estimate` the tokens a request
        that does not bound its answer reserves for it).

        Raises ProxyError if the socket cannot be made.
        """
        if folder in self._sites:
            await self.stop_group(folder)
        path = self.socket_path(folder)
        try:
            sock = await asyncio.to_thread(self._bind, folder)
        except (OSError, agentfs.UnsafePath) as e:
            raise ProxyError(f"cannot listen on {path}: {e}") from None
        caps = GroupCaps(max_connections or self.max_connections,
                     requests_per_minute or self.requests_per_minute,
                     tokens_per_day, timezone, answer_estimate)
        # Slow clients: the web server's deadlines; the connection cap is the group's own.
        guard = ConnectionGuard(ConnectionLimits(max_per_client=None), name="proxy")
        app = web.Application(client_max_size=MAX_REQUEST_BYTES,
                              middlewares=[guard.middleware])
        app.router.add_route("*", "/{tail:.*}", self._make_handler(folder, upstream, caps))
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               keepalive_timeout=guard.keepalive_timeout)
        await runner.setup()
        assert runner.server is not None
        listener = GroupListener(folder, sock, runner.server, caps, guard)
        try:
            listener.start()
        except OSError as e:
            await runner.cleanup()
            sock.close()
            raise ProxyError(f"cannot listen on {path}: {e.strerror}") from None
        self._sites[folder] = _GroupSite(folder, upstream, path, runner, listener, caps)
        self.ledger.track(folder)
        return path

    def _unlink_socket(self, folder: str) -> None:
        with contextlib.suppress(FileNotFoundError, agentfs.UnsafePath), \
                agentfs.opened(self.layout.proxy_root, folder) as dfd:
            agentfs.unlink(dfd, PROXY_SOCKET_NAME)

    async def start_for_config(self, cfg: Config, folder: str) -> Path:
        """start_group with the upstream and the caps the config gives `folder`."""
        _key, spec = model_for_group(cfg, folder)
        conns, rate = cfg.proxy_caps(folder)
        return await self.start_group(folder, Upstream.from_spec(spec), max_connections=conns,
                                      requests_per_minute=rate,
                                      tokens_per_day=cfg.token_budget(folder),
                                      timezone=cfg.group_timezone(),
                                      answer_estimate=cfg.limits.answer_tokens_estimate)

    @contextlib.asynccontextmanager
    async def for_run(self, cfg: Config, folder: str):  # noqa: ANN201 - async generator
        """Serve `folder`'s socket around one container run:

            async with proxy.for_run(cfg, folder) as fields:
                await runner.run(folder, ContainerInput(..., **fields))

        `fields` are the ContainerInput's `backend` and `model`. The socket is removed and
        the usage written when the block ends. Raises ProxyError if it cannot be served.
        """
        await self.start_for_config(cfg, folder)
        try:
            yield container_model_fields(cfg, folder)
        finally:
            await self.stop_group(folder)

    async def stop_group(self, folder: str) -> None:
        site = self._sites.pop(folder, None)
        if site is None:
            return
        # The container is gone: requests it left open (a slow model) are not waited for.
        for task in self._inflight.pop(folder, set()):
            task.cancel()
        await site.listener.close()
        # Nor are its connections: one whose request was refused before its body was read
        # (a 413) is read from for up to aiohttp's lingering time (10 s) after the answer,
        # and the server's own shutdown waited for that. Each connection's shutdown with a
        # short grace cancels what still runs on it and closes it.
        server = site.runner.server
        if server is not None:
            server.pre_shutdown()  # idle connections end at once
            await asyncio.gather(*(conn.shutdown(CLOSE_GRACE) for conn in server.connections))
        await site.runner.cleanup()
        if site.caps.over_budget:
            log.warning("group %s: the model proxy refused %d request(s) over the daily "
                        "budget of %d tokens", folder, site.caps.over_budget,
                        site.caps.tokens_per_day or 0)
        if site.caps.server_tools:
            log.warning("group %s: the model proxy refused %d request(s) asking the API to run "
                        "tools or fetch URLs itself", folder, site.caps.server_tools)
        if site.caps.refused or site.caps.limited:
            log.warning("group %s: the model proxy closed %d connection(s) over the cap of %d "
                        "and answered %d request(s) over %d a minute with 429", folder,
                        site.caps.refused, site.caps.max_connections, site.caps.limited,
                        site.caps.per_minute)
        await asyncio.to_thread(self._unlink_socket, folder)
        await self.ledger.flush()

    async def close(self) -> None:
        for folder in list(self._sites):
            await self.stop_group(folder)
        await self.ledger.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def running(self) -> list[str]:
        return sorted(self._sites)

    def apply_caps(self, cfg: Config) -> None:
        """Give every group served now the caps `cfg` gives it (a config reload; a group's
        next run starts with them anyway): connections over a lowered cap are refused from
        the next one accepted, and the request bucket holds at most the new rate."""
        for folder, site in self._sites.items():
            conns, rate = cfg.proxy_caps(folder)
            site.caps.max_connections = conns
            site.caps.per_minute = rate
            site.caps.tokens_per_day = cfg.token_budget(folder)
            site.caps.answer_estimate = cfg.limits.answer_tokens_estimate

    def caps(self, folder: str) -> dict[str, int] | None:
        """The group's caps and how often they were hit, while its socket is served (and
        the requests in flight that hold a share of its budget, with the tokens they hold)."""
        site = self._sites.get(folder)
        if site is None:
            return None
        c = site.caps
        in_flight, reserved = self.budget.reserved(folder)
        return {"max_connections": c.max_connections, "open": c.open, "refused": c.refused,
                "requests_per_minute": c.per_minute, "limited": c.limited,
                "tokens_per_day": c.tokens_per_day or 0, "over_budget": c.over_budget,
                "server_tools_refused": c.server_tools,
                "answer_tokens_estimate": c.answer_estimate,
                "reserved_requests": in_flight, "reserved_tokens": reserved}

    # ------------------------------------------------------------------ request path
    def _make_handler(self, folder: str, upstream: Upstream, caps: GroupCaps):  # noqa: ANN202
        allowed = ALLOWED_ROUTES[upstream.backend]
        # A runaway or hostile agent cannot open unbounded parallel requests on the key:
        # beyond the limit they wait their turn.
        slots = asyncio.Semaphore(self.max_concurrent)

        async def handle(request: web.Request) -> web.StreamResponse:
            wait = caps.take()
            if wait:
                caps.limited += 1
                if caps.limited == 1:
                    log.warning("group %s: more than %d model requests a minute; answering "
                                "429 until it slows down", folder, caps.per_minute)
                seconds = max(1, math.ceil(wait))
                return web.json_response(
                    {"type": "error",
                     "error": {"type": "mdclaw_proxy_rate_limited",
                               "message": f"this group may send {caps.per_minute} requests "
                                          f"a minute through mdclaw's model proxy; retry in "
                                          f"{seconds} s"}},
                    status=429, headers={"retry-after": str(seconds)})
            if (request.method, request.path) not in allowed:
                return web.json_response(
                    {"error": {"type": "not_found",
                               "message": f"{request.method} {request.path} is not a model "
                                          "API path this proxy forwards"}}, status=404)
            refused = await self.budget.check(folder, caps.tokens_per_day, caps.timezone)
            for payer, budget in self._payers.get(folder, ()):
                if refused is None:  # an agent asked by payer's: its budget counts too
                    refused = await self.budget.check(payer, budget, caps.timezone)
            if refused is not None:
                # Read the body first (it is capped): an answer sent while the client still
                # writes ends in a reset it reads as a broken connection, not as the 429.
                await request.read()
                return self._over_budget(folder, caps, refused)
            task = asyncio.current_task()
            inflight = self._inflight.setdefault(folder, set())
            if task is not None:
                inflight.add(task)
            try:
                async with slots:
                    return await self._forward(request, folder, upstream, caps)
            finally:
                inflight.discard(task)

        return handle

    def _over_budget(self, folder: str, caps: GroupCaps, refused: OverBudget) -> web.Response:
        caps.over_budget += 1
        if caps.over_budget == 1:
            log.warning("group %s: used %d model tokens today, over its budget of %d; "
                        "refusing its model requests until midnight UTC", folder,
                        refused.used, refused.budget)
        self._note_failure(folder, "over_budget")
        return web.json_response(
            {"type": "error",
             "error": {"type": "mdclaw_over_budget", "message": refused.message}},
            # x-should-retry: the model SDKs' own retries would only be refused again.
            status=429, headers={"retry-after": str(refused.retry_after),
                                 "x-should-retry": "false"})

    def _server_tools(self, folder: str, caps: GroupCaps, found: str) -> web.Response:
        """Refuse a request that makes the API run tools or fetch URLs itself
        (mdclaw.toolpolicy): before the key is read or the budget asked, so it costs nothing."""
        caps.server_tools += 1
        if caps.server_tools == 1:
            log.warning("group %s: refused a model request that asks the API to run tools or "
                        "fetch URLs itself (%s); allow_server_tools is off for its model",
                        folder, found)
        return web.json_response(
            {"type": "error", "error": {"type": "mdclaw_server_tools_refused",
                                        "message": refusal(found)}}, status=403)

    async def _forward(self, request: web.Request, folder: str, upstream: Upstream,
                       caps: GroupCaps) -> web.StreamResponse:
        body = await request.read()
        model = upstream.model or ""
        sent: dict[str, Any] | None = None
        if request.method == "POST":
            try:
                pinned = upstream.pin(body)
            except BadRequestBody as e:
                return web.json_response(
                    {"type": "error", "error": {"type": "mdclaw_bad_request",
                                                "message": f"{e}; mdclaw's model proxy "
                                                           "forwards JSON objects only"}},
                    status=400)
            body, model, sent = pinned.body, pinned.model, pinned.sent
            if (sent is not None and not upstream.allow_server_tools
                    and (request.method, request.path) in ANSWERING_ROUTES
                    and (found := server_side_use(upstream.backend, sent)) is not None):
                return self._server_tools(folder, caps, found)
        else:
            body = b""  # GET /v1/models: nothing for the upstream to read
        try:
            auth, forms = self._credential(upstream)
        except OSError:
            log.error("group %s: the model key file %s cannot be read", folder,
                      upstream.api_key_file)
            self._count(folder, model, ok=False)
            self._note_failure(folder, "key_missing")
            return web.json_response({"error": {"type": "mdclaw_key_unreadable",
                                                "message": "the host cannot read the API key"}},
                                     status=502)
        grant: Reservation | None = None
        if (request.method, request.path) in ANSWERING_ROUTES:
            # The moment of dispatch: this request has a slot; does the budget left cover
            # it beside the ones in flight? (It may wait here for one of them to end.)
            got = await self.budget.admit(
                folder, caps.tokens_per_day,
                request_need(len(body), sent, caps.answer_estimate), caps.timezone)
            if isinstance(got, OverBudget):
                return self._over_budget(folder, caps, got)
            grant = got
        try:
            return await self._send(request, folder, upstream, body, model, auth,
                                    Redactor(forms), grant)
        finally:
            # After _send counted the answer's usage, with no await in between: the budget
            # never sees the tokens neither reserved nor counted.
            if grant is not None:
                grant.release()

    async def _send(self, request: web.Request, folder: str, upstream: Upstream, body: bytes,
                    model: str, auth: dict[str, str], redactor: Redactor,
                    grant: Reservation | None) -> web.StreamResponse:
        """Send the request upstream and its answer back to the agent, then count it."""
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in DROP_REQUEST_HEADERS}
        headers.update(auth)
        headers["accept-encoding"] = "identity"
        url = upstream.url_for(request.path, request.query_string)
        counter = UsageCounter()
        response: web.StreamResponse | None = None
        ok = False
        # May the upstream have spent tokens on this request? Yes from the moment it may
        # have been sent (also when the wait for the answer is cancelled: the group stopped);
        # no when it could not be connected to, or answered with an error status.
        spent = True
        agent_gone = False
        try:
            async with self._client().request(request.method, url, data=body or None,
                                              headers=headers, allow_redirects=False) as up:
                encoding = up.headers.get("content-encoding", "").strip().lower()
                if encoding not in READABLE_ENCODINGS:
                    # Bytes the proxy cannot read cannot be checked for the key.
                    log.warning("group %s: upstream %s answered in the encoding %r; not "
                                "passed on", folder, upstream.base_url, encoding[:40])
                    self._note_failure(folder, "model_unreachable")
                    spent = 200 <= up.status < 300
                    response = web.json_response(
                        {"error": {"type": "mdclaw_upstream_encoding",
                                   "message": "the model API answered in an encoding mdclaw's "
                                              "proxy cannot read"}}, status=502)
                    return response
                spent = 200 <= up.status < 300
                response = web.StreamResponse(status=up.status,
                                              reason=redactor.scrub(up.reason or "") or None)
                for k, v in up.headers.items():
                    name = k.lower()
                    if name in FORWARD_RESPONSE_HEADERS or name.startswith(
                            FORWARD_RESPONSE_PREFIXES):
                        response.headers.add(k, redactor.scrub(v))
                ctype = up.headers.get("content-type", "")
                feed = counter.feed_sse if "event-stream" in ctype else counter.feed_json
                agent_gone = not await self._to_agent(response.prepare(request))
                async for chunk in up.content.iter_any():
                    feed(chunk)
                    # An agent that hung up does not end the answer: it is read to its end
                    # (and dropped) so that what it cost is counted.
                    if not agent_gone and (out := redactor.feed(chunk)):
                        agent_gone = not await self._to_agent(response.write(out))
                if not agent_gone and (out := redactor.finish()):
                    agent_gone = not await self._to_agent(response.write(out))
                if not agent_gone:
                    agent_gone = not await self._to_agent(response.write_eof())
                ok = up.status < 400
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("group %s: upstream %s failed: %s", folder, upstream.base_url,
                        type(e).__name__)
            kind, cause, what = _upstream_failure(e)
            self._note_failure(folder, cause)
            if isinstance(e, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
                spent = False  # never connected: nothing was sent
            if response is None or not response.prepared:
                response = web.json_response(
                    {"error": {"type": kind,
                               "message": f"the model API {what} ({type(e).__name__})"}},
                    status=504 if cause == "turn_timeout" else 502)
        finally:
            # Also when cancelled (the group's proxy stopped): nothing here awaits.
            counter.finish()
            if ok:
                self.last_failure.pop(folder, None)
            tokens_in, tokens_out = counter.input_tokens, counter.output_tokens
            if grant is not None and spent and not counter.final:
                # The answer ended without the API's last word on its usage: what was not
                # reported counts as reserved.
                tokens_in = tokens_in or grant.need.input
                tokens_out = max(tokens_out, grant.need.output)
            # The model is the configured one (or an allowed one): made-up names cannot
            # fill the usage table.
            self._count(folder, model, ok=ok, input_tokens=tokens_in,
                        output_tokens=tokens_out)
        if agent_gone:
            log.info("group %s: the agent hung up before the model's answer ended (read on "
                     "upstream, to count it)", folder)
        return response

    @staticmethod
    async def _to_agent(write: Awaitable[Any]) -> bool:
        """Await one write towards the agent: False when the agent has hung up."""
        try:
            await write
        except ConnectionError:  # aiohttp's ClientConnectionResetError is one too
            return False
        return True

    def _note_failure(self, folder: str, cause: str) -> None:
        """Remember why the group's latest model request failed on the host's side, so a
        failed turn can be told apart from what the agent saw (see mdclaw/failures.py)."""
        self.last_failure[folder] = (cause, time.monotonic())

    def recent_failure(self, folder: str, within: float = 120.0) -> str | None:
        """The cause of the group's latest failed model request when it failed on the host's
        side within `within` seconds and nothing succeeded since, else None."""
        got = self.last_failure.get(folder)
        if got is None or time.monotonic() - got[1] > within:
            return None
        return got[0]

    def _credential(self, upstream: Upstream) -> tuple[dict[str, str], list[bytes]]:
        """(the credential headers, the forms of the key to remove from what goes back to
        the agent: mdclaw.redact), re-read only when the key file changed (rotation)."""
        path = upstream.api_key_file
        if path is None:
            return {}, []
        st = os.stat(path)
        cached = self._keys.get(path)
        if cached is None or cached[:2] != (st.st_mtime, st.st_ino):
            headers = upstream.auth_headers()
            # The key itself; `Bearer <key>` holds it.
            secrets = {v.removeprefix("Bearer ").strip() for v in headers.values()}
            forms = all_forms(secrets)
            if any(len(sec.encode()) < MIN_SECRET for sec in secrets):
                log.warning("the model key in %s is shorter than %d characters: it is not "
                            "looked for in what the model API answers", path, MIN_SECRET)
            cached = (st.st_mtime, st.st_ino, headers, forms)
            self._keys[path] = cached
        return cached[2], cached[3]

    def charge_also(self, folder: str, payers: list[tuple[str, int | None]]) -> None:
        """While `folder`'s agent answers a question of other agents (mdclaw.agentasks),
        its model use counts against each payer's daily budget too: [(group, its
        tokens_per_day)]; their budgets are checked before each of its requests, and its
        usage is counted for each as model `asked:<folder>/<model>`. [] ends it."""
        if payers:
            self._payers[folder] = tuple(payers)
        else:
            self._payers.pop(folder, None)

    def _count(self, folder: str, model: str, *, ok: bool, input_tokens: int = 0,
               output_tokens: int = 0) -> None:
        if folder in self._sites:
            self._sites[folder].requests += 1
        self.ledger.count(folder, model, ok=ok, input_tokens=input_tokens,
                          output_tokens=output_tokens)
        for payer, _budget in self._payers.get(folder, ()):
            self.ledger.count(payer, f"asked:{folder}/{model}", ok=ok,
                              input_tokens=input_tokens, output_tokens=output_tokens)
