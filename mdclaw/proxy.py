"""The credential proxy: how an agent container reaches its model without holding a key.

For each running container the host serves the model API on a unix socket in a folder of its
own (`proxy/<folder>/proxy.sock`), which the container sees read-only at
/workspace/proxy: it can connect, but it cannot replace the socket or anything beside it.
The agent runner forwards a loopback port in the container to it. For every request the
proxy:

- accepts only the model API's own paths (POST /v1/messages for claude, POST
  /v1/chat/completions for openai, and a few read-only ones) — anything else is 404;
- drops whatever credentials the client sent and injects the real one, read from the
  model's `api_key_file` (never logged, never sent back);
- sends the group's configured model whatever the request names: a request body must be a
  JSON object, and its `model` is set to the configured one unless it names one of the
  entry's `allow_models` (the key is paid for the models the operator chose, not the ones
  the agent prefers);
- refuses every request of a group that used its daily token budget
  (`limits.tokens_per_day`) with HTTP 429 `mdclaw_over_budget`, saying when it resets;
- forwards to the configured upstream and streams the answer back as it arrives;
- counts the request and the tokens the API reports in the state database (`model_usage`),
  per group, model and UTC day — `mdclaw usage` shows them.

A container cannot use its socket against the host or the other groups: it may hold at most
`limits.proxy_connections` connections open (more are answered with a short 503 and closed
as soon as they are accepted, so the daemon's file descriptors stay bounded whatever the
container does; further attempts wait in the kernel's listen queue, not in the daemon), and
send at most `limits.proxy_requests_per_minute` requests (a token bucket: bursts up to that
many, then that many per minute; more get HTTP 429 with `Retry-After`). Both can be set per
group.

The group comes from which socket the request arrived on, never from anything the client says.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import os
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import aiohttp
from aiohttp import web

from mdclaw import agentfs, metrics
from mdclaw.config import Config, ModelSpec, read_secret
from mdclaw.errors import EngineError
from mdclaw.failures import BUDGET_PREFIX
from mdclaw.paths import PROXY_DIR_MODE, PROXY_SOCKET_NAME, Layout
from mdclaw.state import Database, now_iso

log = logging.getLogger("mdclaw.proxy")

SOCKET_NAME = PROXY_SOCKET_NAME
SOCKET_MODE = 0o660
MAX_REQUEST_BYTES = 32 * 1024 * 1024
MAX_BUFFERED_JSON = 8 * 1024 * 1024

DEFAULT_BASE_URLS = {"claude": "https://api.anthropic.com", "openai": "https://api.openai.com/v1"}
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
DROP_RESPONSE_HEADERS = frozenset({
    "content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive",
    "set-cookie", "trailer", "upgrade",
})


DEFAULT_MAX_CONNECTIONS = 32
DEFAULT_REQUESTS_PER_MINUTE = 300
ACCEPT_BATCH = 64  # connections accepted per readiness event, before other work runs
ACCEPT_PAUSE = 1.0  # seconds not accepting after the process ran out of descriptors
_BUSY_BODY = json.dumps({"type": "error", "error": {
    "type": "mdclaw_proxy_busy",
    "message": "too many open connections to mdclaw's model proxy from this group; close "
               "some and retry"}}).encode()
BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                 b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
                 + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class ProxyError(EngineError, RuntimeError):
    """The proxy for a group cannot be started (socket path too long, folder missing...)."""


@dataclass(frozen=True)
class Upstream:
    """Where one group's model requests go and how they are authenticated."""

    backend: str
    model: str | None
    base_url: str
    api_key_file: Path | None = None
    allow_models: tuple[str, ...] = ()

    def url_for(self, path: str, query: str) -> str:
        base = self.base_url.rstrip("/")
        # Bases are given with or without their /v1 (http://host:11434/v1 for Ollama).
        rest = path[3:] if base.endswith("/v1") and path.startswith("/v1/") else path
        return base + rest + (f"?{query}" if query else "")

    def auth_headers(self) -> dict[str, str]:
        """The real credential as headers (empty for a local server without a key).

        Raises OSError if the key file went away; the message names the file only.
        """
        if self.api_key_file is None:
            return {}
        key = read_secret(self.api_key_file)
        if self.backend == "claude":
            return {"x-api-key": key}
        return {"authorization": f"Bearer {key}"}

    @classmethod
    def from_spec(cls, spec: ModelSpec | None) -> Upstream:
        if spec is None:
            return cls(backend="claude", model=None, base_url=DEFAULT_BASE_URLS["claude"])
        return cls(backend=spec.backend, model=spec.model,
                   base_url=spec.base_url or DEFAULT_BASE_URLS[spec.backend],
                   api_key_file=spec.api_key_file, allow_models=spec.allow_models)

    def pin_model(self, body: bytes) -> tuple[bytes, str]:
        """(the body to forward, the model it names) for a request body of the agent: the
        configured model replaces whatever the body names, unless that is one of
        `allow_models`. The body is parsed and written again, so the upstream reads exactly
        what was checked (no duplicate keys). Without a configured model the body goes as
        it is. Raises ValueError when the body is not a JSON object."""
        if self.model is None:
            return body, _named_model(body) or ""
        try:
            sent = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("the request body is not JSON") from None
        if not isinstance(sent, dict):
            raise ValueError("the request body is not a JSON object")
        asked = sent.get("model")
        if not (isinstance(asked, str) and asked in self.allow_models):
            sent["model"] = self.model
        return json.dumps(sent, separators=(",", ":")).encode(), sent["model"]


def _named_model(body: bytes) -> str | None:
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        sent = json.loads(body)
        if isinstance(sent, dict) and isinstance(sent.get("model"), str):
            return str(sent["model"])[:128]
    return None


def model_for_group(cfg: Config, folder: str) -> tuple[str | None, ModelSpec | None]:
    """(model key, spec) a group uses: its own `model`, else `assistant.model`, else the only
    configured model; (None, None) means the claude backend's defaults."""
    group = cfg.groups.get(folder)
    key = (group.model if group else None) or cfg.assistant.model
    if key is None and len(cfg.models) == 1:
        key = next(iter(cfg.models))
    if key is None:
        return None, None
    return key, cfg.models[key]


async def probe_upstream(upstream: Upstream, within: float = 5.0) -> tuple[int | None, str]:
    """Ask the model API `GET /v1/models` the way the proxy forwards requests (same URL
    rules, same credential, same HTTP proxy settings): (HTTP status, detail), or (None, why)
    when nothing answered. The detail never holds the key."""
    url = upstream.url_for("/v1/models", "")
    try:
        headers = upstream.auth_headers()
    except OSError as e:
        return None, f"the key file cannot be read ({e.strerror or type(e).__name__})"
    if upstream.backend == "claude":
        headers["anthropic-version"] = "2023-06-01"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=within),
                                         trust_env=True) as session:
            async with session.get(url, headers=headers, allow_redirects=False) as r:
                body = (await r.content.read(2000)).decode("utf-8", "replace")
                return r.status, " ".join(body.split())[:200]
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return None, f"{type(e).__name__}: {e}"[:200]


def container_model_fields(cfg: Config, folder: str) -> dict[str, Any]:
    """The ContainerInput fields naming the backend and model (never a key or URL)."""
    _key, spec = model_for_group(cfg, folder)
    up = Upstream.from_spec(spec)
    return {"backend": up.backend, "model": up.model}


# --------------------------------------------------------------------------- usage


@dataclass
class UsageCounter:
    """Tokens seen in one response: JSON body or server-sent events, OpenAI or Anthropic.

    Counts are cumulative in both APIs' streams, so the largest value seen wins.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    _pending: bytes = b""
    _json: bytearray = field(default_factory=bytearray)
    _json_overflow: bool = False

    def take(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return

        def num(*keys: str) -> int:
            total = 0
            for k in keys:
                v = usage.get(k)
                if isinstance(v, int) and not isinstance(v, bool):
                    total += v
            return total

        self.input_tokens = max(self.input_tokens, num("input_tokens", "prompt_tokens",
                                                       "cache_creation_input_tokens",
                                                       "cache_read_input_tokens"))
        self.output_tokens = max(self.output_tokens, num("output_tokens", "completion_tokens"))

    def take_object(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        self.take(obj.get("usage"))
        message = obj.get("message")
        if isinstance(message, dict):
            self.take(message.get("usage"))

    def feed_sse(self, chunk: bytes) -> None:
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > MAX_BUFFERED_JSON:  # a runaway line: stop looking at it
            self._pending = b""
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:") or b"usage" not in line:
                continue
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                self.take_object(json.loads(line[5:].strip()))

    def feed_json(self, chunk: bytes) -> None:
        if self._json_overflow:
            return
        if len(self._json) + len(chunk) > MAX_BUFFERED_JSON:
            self._json_overflow = True
            self._json.clear()
            return
        self._json.extend(chunk)

    def finish(self) -> None:
        if self._pending:
            self.feed_sse(b"\n")
        if self._json:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                self.take_object(json.loads(bytes(self._json)))
            self._json.clear()


_UPSERT = """INSERT INTO model_usage (group_folder, day, model, requests, errors,
                   input_tokens, output_tokens, updated_at)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT (group_folder, day, model) DO UPDATE SET
                   requests = requests + excluded.requests,
                   errors = errors + excluded.errors,
                   input_tokens = input_tokens + excluded.input_tokens,
                   output_tokens = output_tokens + excluded.output_tokens,
                   updated_at = excluded.updated_at"""


def record_usage(db: Database, folder: str, model: str, *, ok: bool, input_tokens: int,
                 output_tokens: int, when: str | None = None) -> None:
    """Add one request to the group's row for its day."""
    stamp = when or now_iso()
    with db.transaction() as conn:
        conn.execute(_UPSERT, (folder, stamp[:10], model, 1, 0 if ok else 1, input_tokens,
                               output_tokens, stamp))


def record_usage_batch(db: Database, rows: dict[tuple[str, str, str], list[int]]) -> None:
    """Add accumulated counts {(folder, day, model): [requests, errors, in, out]} in one
    transaction."""
    stamp = now_iso()
    with db.transaction() as conn:
        conn.executemany(_UPSERT, [(f, d, m, r, e, i, o, stamp)
                                   for (f, d, m), (r, e, i, o) in rows.items()])


def tokens_on_day(db: Database, folder: str, day: str) -> int:
    """Tokens (input + output) the group's requests used on UTC day `day` (YYYY-MM-DD), as
    written to the database."""
    rows = db.query("SELECT COALESCE(SUM(input_tokens + output_tokens), 0) AS n "
                    "FROM model_usage WHERE group_folder = ? AND day = ?", (folder, day))
    return int(rows[0]["n"]) if rows else 0


def over_budget(tokens: int, budget: int | None) -> bool:
    """A day's tokens (input + output) reached the group's daily budget: its requests are
    refused here, and the day shows as over (`mdclaw usage`, the operator page)."""
    return budget is not None and tokens >= budget


def next_reset(now: datetime | None = None) -> datetime:
    """When the daily token budgets start again: the next midnight UTC."""
    now = now or datetime.now(UTC)
    return datetime(now.year, now.month, now.day, tzinfo=UTC) + timedelta(days=1)


def budget_message(used: int, budget: int, timezone: str = "UTC",
                   now: datetime | None = None) -> str:
    """What the agent (and through it the chat) is told when the group is over its budget:
    how much, and when it resets, in UTC and in the assistant's timezone."""
    reset = next_reset(now)
    when = "midnight UTC"
    if timezone != "UTC":
        with contextlib.suppress(Exception):
            local = reset.astimezone(ZoneInfo(timezone))
            when += f", {local:%H:%M} in {timezone}"
    return f"{BUDGET_PREFIX} ({used} of {budget} tokens). It resets at {when}."


def _usage_filter(group: str | None, since_day: str | None) -> tuple[str, tuple[str, ...]]:
    """The WHERE clause (fixed column names only) and its parameters for a usage query."""
    where, params = [], []
    if group:
        where.append("group_folder = ?")
        params.append(group)
    if since_day:
        where.append("day >= ?")
        params.append(since_day)
    return (" WHERE " + " AND ".join(where) if where else ""), tuple(params)


def usage_rows(db: Database, *, group: str | None = None,
               since_day: str | None = None) -> list[dict[str, Any]]:
    """Usage totals per group and model (summed over days from `since_day` on)."""
    where, params = _usage_filter(group, since_day)
    # Fixed column names only; every value is a parameter.
    sql = ("SELECT group_folder, model, SUM(requests) AS requests, SUM(errors) AS errors, "  # noqa: S608, E501
           "SUM(input_tokens) AS input_tokens, SUM(output_tokens) AS output_tokens, "
           "MIN(day) AS first_day, MAX(day) AS last_day FROM model_usage" + where
           + " GROUP BY group_folder, model ORDER BY group_folder, model")
    return [dict(r) for r in db.query(sql, params)]


def daily_usage(db: Database, *, group: str | None = None,
                since_day: str | None = None) -> list[dict[str, Any]]:
    """Usage per group and UTC day (summed over models), oldest day first."""
    where, params = _usage_filter(group, since_day)
    # Fixed column names only; every value is a parameter.
    sql = ("SELECT group_folder, day, SUM(requests) AS requests, SUM(errors) AS errors, "  # noqa: S608, E501
           "SUM(input_tokens) AS input_tokens, SUM(output_tokens) AS output_tokens "
           "FROM model_usage" + where
           + " GROUP BY group_folder, day ORDER BY day, group_folder")
    return [dict(r) for r in db.query(sql, params)]


# --------------------------------------------------------------------------- server


class _Caps:
    """One group's limits on its socket: open connections, and requests as a token bucket
    (`per_minute` tokens at most, refilled at `per_minute` a minute)."""

    def __init__(self, max_connections: int, per_minute: int,
                 tokens_per_day: int | None = None, timezone: str = "UTC") -> None:
        self.max_connections = max_connections
        self.per_minute = per_minute
        self.tokens_per_day = tokens_per_day
        self.timezone = timezone
        self.open = 0
        self.refused = 0  # connections closed at accept time
        self.limited = 0  # requests answered 429
        self.over_budget = 0  # requests refused for the daily token budget
        self._tokens = float(per_minute)
        self._at = time.monotonic()

    def take(self) -> float:
        """0 when a request may go now (and counts it), else the seconds until one may."""
        now = time.monotonic()
        rate = self.per_minute / 60.0
        self._tokens = min(float(self.per_minute), self._tokens + (now - self._at) * rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / rate


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, which gives its slot back when it ends."""

    def __init__(self, inner: asyncio.Protocol, caps: _Caps) -> None:
        self._inner = inner
        self._caps = caps
        self.made = False
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._caps.open -= 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.release()
        self._inner.connection_lost(exc)


class _Listener:
    """Accepts on one group's socket itself (instead of aiohttp's site), so that a
    connection beyond the group's cap is closed the moment it is accepted: it never gets a
    transport, a task or a buffer, and the daemon holds at most `max_connections` + 1
    descriptors for the group however many connections the container attempts."""

    def __init__(self, folder: str, sock: socket.socket, server: web.Server,
                 caps: _Caps) -> None:
        self.folder = folder
        self.sock = sock
        self.server = server
        self.caps = caps
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._paused: asyncio.TimerHandle | None = None
        self._closed = False
        self._warned = False

    def start(self) -> None:
        self._loop.add_reader(self.sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors or memory: stop accepting for a moment (the kernel
                    # keeps the waiting connections) rather than spin.
                    log.error("group %s: proxy cannot accept: %s; pausing %.0f s",
                              self.folder, e.strerror, ACCEPT_PAUSE)
                    self._pause()
                    return
                raise
            if self.caps.open >= self.caps.max_connections:
                self._refuse(conn)
                continue
            self.caps.open += 1
            task = self._loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _refuse(self, conn: socket.socket) -> None:
        self.caps.refused += 1
        if not self._warned:
            self._warned = True
            log.warning("group %s: more than %d connections to the model proxy; closing the "
                        "extra ones", self.folder, self.caps.max_connections)
        try:
            conn.setblocking(False)
            conn.send(BUSY_RESPONSE)  # best effort: the client learns why
        except OSError:
            pass
        conn.close()

    def _pause(self) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self._paused = self._loop.call_later(ACCEPT_PAUSE, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if not self._closed:
            self.start()

    async def _serve(self, conn: socket.socket) -> None:
        counted: _Counted | None = None

        def factory() -> _Counted:
            nonlocal counted
            counted = _Counted(self.server(), self.caps)
            return counted

        try:
            await self._loop.connect_accepted_socket(factory, sock=conn)
        except BaseException as e:  # noqa: BLE001 - any end of the set-up gives the slot back
            # Without a transport nobody else gives the slot back or closes the socket.
            if counted is None or not counted.made:
                if counted is not None:
                    counted.release()
                else:
                    self.caps.open -= 1
                conn.close()
            if not isinstance(e, Exception):
                raise  # cancelled, or the process is ending
            # A client gone before the set-up is an OSError; anything else is a bug: traceback.
            log.warning("group %s: proxy connection could not be set up: %r", self.folder, e,
                        exc_info=not isinstance(e, OSError))

    async def close(self) -> None:
        """Stop accepting and close the listening socket (open connections stay; the
        AppRunner's cleanup closes them)."""
        self._closed = True
        if self._paused is not None:
            self._paused.cancel()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


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
    listener: _Listener
    caps: _Caps
    requests: int = 0


class CredentialProxy:
    """Serves one unix socket per running group. Use inside a running event loop.

    `start_group` before the container starts, `stop_group` after it ended, `close` at
    shutdown. `db` may be None (then nothing is persisted; counts stay in `stats`).

    Usage is added up in memory and written every `flush_interval` seconds, when a group's
    proxy stops, and at `close` — one small transaction instead of one per request, which
    keeps database work off the request path (a crash loses at most one interval's counts).
    At most `max_concurrent` requests per group are forwarded at once; more wait. At most
    `max_connections` connections per group are open at once and `requests_per_minute`
    requests are taken (both can be given per group to `start_group`).
    """

    def __init__(self, layout: Layout, db: Database | None = None, *,
                 connect_timeout: float = 30.0, read_timeout: float = 600.0,
                 flush_interval: float = 5.0, max_concurrent: int = 8,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 requests_per_minute: int = DEFAULT_REQUESTS_PER_MINUTE) -> None:
        self.layout = layout
        self.db = db
        self.flush_interval = flush_interval
        self.max_concurrent = max_concurrent
        self.max_connections = max_connections
        self.requests_per_minute = requests_per_minute
        self._sites: dict[str, _GroupSite] = {}
        self._session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout,
                                              sock_read=read_timeout)
        self._unflushed: dict[tuple[str, str, str], list[int]] = {}
        self._flusher: asyncio.Task | None = None
        self._flush_lock = asyncio.Lock()
        self._keys: dict[Path, tuple[float, int, dict[str, str]]] = {}
        self.stats: dict[str, dict[str, int]] = {}
        # folder -> (cause, time.monotonic()) of its latest request that failed here.
        self.last_failure: dict[str, tuple[str, float]] = {}
        # folder -> request handlers under way (cancelled when the group's proxy stops).
        self._inflight: dict[str, set[asyncio.Task[Any]]] = {}
        # folder -> [UTC day, tokens used that day] (the database's count plus every request
        # counted since it was read), for the daily token budget.
        self._today: dict[str, list[Any]] = {}

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
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, auto_decompress=False, trust_env=True,
                connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=60))
        return self._session

    async def start_group(self, folder: str, upstream: Upstream, *,
                          max_connections: int | None = None,
                          requests_per_minute: int | None = None,
                          tokens_per_day: int | None = None,
                          timezone: str = "UTC") -> Path:
        """Serve `folder`'s socket (replacing a stale one); return its path. The caps
        default to the proxy's own; `tokens_per_day` None: no token budget (`timezone` is
        the one the budget's reset time is told in).

        Raises ProxyError if the socket cannot be made.
        """
        if folder in self._sites:
            await self.stop_group(folder)
        path = self.socket_path(folder)
        try:
            sock = await asyncio.to_thread(self._bind, folder)
        except (OSError, agentfs.UnsafePath) as e:
            raise ProxyError(f"cannot listen on {path}: {e}") from None
        caps = _Caps(max_connections or self.max_connections,
                     requests_per_minute or self.requests_per_minute,
                     tokens_per_day, timezone)
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._make_handler(folder, upstream, caps))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        assert runner.server is not None
        listener = _Listener(folder, sock, runner.server, caps)
        try:
            listener.start()
        except OSError as e:
            await runner.cleanup()
            sock.close()
            raise ProxyError(f"cannot listen on {path}: {e.strerror}") from None
        self._sites[folder] = _GroupSite(folder, upstream, path, runner, listener, caps)
        self.stats.setdefault(folder, {"requests": 0, "errors": 0, "input_tokens": 0,
                                       "output_tokens": 0})
        if self.db is not None and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.ensure_future(self._flush_loop())
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
                                      timezone=cfg.group_timezone())

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
        await site.runner.cleanup()
        if site.caps.over_budget:
            log.warning("group %s: the model proxy refused %d request(s) over the daily "
                        "budget of %d tokens", folder, site.caps.over_budget,
                        site.caps.tokens_per_day or 0)
        if site.caps.refused or site.caps.limited:
            log.warning("group %s: the model proxy closed %d connection(s) over the cap of %d "
                        "and answered %d request(s) over %d a minute with 429", folder,
                        site.caps.refused, site.caps.max_connections, site.caps.limited,
                        site.caps.per_minute)
        await asyncio.to_thread(self._unlink_socket, folder)
        await self.flush()

    async def close(self) -> None:
        for folder in list(self._sites):
            await self.stop_group(folder)
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
            self._flusher = None
        await self.flush()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def running(self) -> list[str]:
        return sorted(self._sites)

    def caps(self, folder: str) -> dict[str, int] | None:
        """The group's caps and how often they were hit, while its socket is served."""
        site = self._sites.get(folder)
        if site is None:
            return None
        c = site.caps
        return {"max_connections": c.max_connections, "open": c.open, "refused": c.refused,
                "requests_per_minute": c.per_minute, "limited": c.limited,
                "tokens_per_day": c.tokens_per_day or 0, "over_budget": c.over_budget}

    async def tokens_today(self, folder: str) -> int:
        """Tokens the group used today (UTC): the database's rows plus the counts not yet
        written. Read from the database once a day per group, then kept up to date by
        every counted request."""
        day = now_iso()[:10]
        got = self._today.get(folder)
        if got is not None and got[0] == day:
            return int(got[1])
        async with self._flush_lock:  # no counts in flight between memory and database
            n = (await asyncio.to_thread(tokens_on_day, self.db, folder, day)
                 if self.db is not None else 0)
            n += sum(v[2] + v[3] for (f, d, _m), v in self._unflushed.items()
                     if f == folder and d == day)
            self._today[folder] = [day, n]
        return n

    # ------------------------------------------------------------------ request path
    def _make_handler(self, folder: str, upstream: Upstream, caps: _Caps):  # noqa: ANN202
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
            if caps.tokens_per_day is not None:
                used = await self.tokens_today(folder)
                if over_budget(used, caps.tokens_per_day):
                    return self._over_budget(folder, caps, used)
            task = asyncio.current_task()
            inflight = self._inflight.setdefault(folder, set())
            if task is not None:
                inflight.add(task)
            try:
                async with slots:
                    return await self._forward(request, folder, upstream)
            finally:
                inflight.discard(task)

        return handle

    def _over_budget(self, folder: str, caps: _Caps, used: int) -> web.Response:
        caps.over_budget += 1
        if caps.over_budget == 1:
            log.warning("group %s: used %d model tokens today, over its budget of %d; "
                        "refusing its model requests until midnight UTC", folder, used,
                        caps.tokens_per_day)
        self._note_failure(folder, "over_budget")
        seconds = max(1, math.ceil((next_reset() - datetime.now(UTC)).total_seconds()))
        assert caps.tokens_per_day is not None
        return web.json_response(
            {"type": "error",
             "error": {"type": "mdclaw_over_budget",
                       "message": budget_message(used, caps.tokens_per_day, caps.timezone)}},
            # x-should-retry: the model SDKs' own retries would only be refused again.
            status=429, headers={"retry-after": str(seconds), "x-should-retry": "false"})

    async def _forward(self, request: web.Request, folder: str,
                       upstream: Upstream) -> web.StreamResponse:
        body = await request.read()
        model = upstream.model or ""
        if request.method == "POST":
            try:
                body, model = upstream.pin_model(body)
            except ValueError as e:
                return web.json_response(
                    {"type": "error", "error": {"type": "mdclaw_bad_request",
                                                "message": f"{e}; mdclaw's model proxy "
                                                           "forwards JSON objects only"}},
                    status=400)
        else:
            body = b""  # GET /v1/models: nothing for the upstream to read
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in DROP_REQUEST_HEADERS}
        try:
            headers.update(self._auth_headers(upstream))
        except OSError:
            log.error("group %s: the model key file %s cannot be read", folder,
                      upstream.api_key_file)
            self._count(folder, model, ok=False, usage=None)
            self._note_failure(folder, "key_missing")
            return web.json_response({"error": {"type": "mdclaw_key_unreadable",
                                                "message": "the host cannot read the API key"}},
                                     status=502)
        headers["accept-encoding"] = "identity"
        url = upstream.url_for(request.path, request.query_string)
        counter = UsageCounter()
        response: web.StreamResponse | None = None
        ok = False
        try:
            async with self._client().request(request.method, url, data=body or None,
                                              headers=headers, allow_redirects=False) as up:
                response = web.StreamResponse(status=up.status, reason=up.reason)
                for k, v in up.headers.items():
                    if k.lower() not in DROP_RESPONSE_HEADERS:
                        response.headers.add(k, v)
                ctype = up.headers.get("content-type", "")
                feed = counter.feed_sse if "event-stream" in ctype else counter.feed_json
                await response.prepare(request)
                async for chunk in up.content.iter_any():
                    feed(chunk)
                    await response.write(chunk)
                await response.write_eof()
                ok = up.status < 400
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.warning("group %s: upstream %s failed: %s", folder, upstream.base_url,
                        type(e).__name__)
            kind, cause, what = _upstream_failure(e)
            self._note_failure(folder, cause)
            if response is None or not response.prepared:
                response = web.json_response(
                    {"error": {"type": kind,
                               "message": f"the model API {what} ({type(e).__name__})"}},
                    status=504 if cause == "turn_timeout" else 502)
        finally:
            counter.finish()
            if ok:
                self.last_failure.pop(folder, None)
            # The model is the configured one (or an allowed one): made-up names cannot
            # fill the usage table.
            self._count(folder, model, ok=ok, usage=counter)
        return response

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

    def _auth_headers(self, upstream: Upstream) -> dict[str, str]:
        """The credential headers, re-read only when the key file changed (rotation)."""
        path = upstream.api_key_file
        if path is None:
            return {}
        st = os.stat(path)
        cached = self._keys.get(path)
        if cached is None or cached[:2] != (st.st_mtime, st.st_ino):
            cached = (st.st_mtime, st.st_ino, upstream.auth_headers())
            self._keys[path] = cached
        return cached[2]

    def _count(self, folder: str, model: str, *, ok: bool, usage: UsageCounter | None) -> None:
        tin = usage.input_tokens if usage else 0
        tout = usage.output_tokens if usage else 0
        s = self.stats.setdefault(folder, {"requests": 0, "errors": 0, "input_tokens": 0,
                                           "output_tokens": 0})
        s["requests"] += 1
        s["errors"] += 0 if ok else 1
        s["input_tokens"] += tin
        s["output_tokens"] += tout
        if folder in self._sites:
            self._sites[folder].requests += 1
        label = metrics.model_label(model or "default")
        metrics.proxy_requests.get(folder, label, "ok" if ok else "error").inc()
        if tin:
            metrics.proxy_tokens.get(folder, label, "input").inc(tin)
        if tout:
            metrics.proxy_tokens.get(folder, label, "output").inc(tout)
        day = now_iso()[:10]
        today = self._today.get(folder)
        if today is not None and today[0] == day:
            today[1] += tin + tout
        if self.db is None:
            return
        row = self._unflushed.setdefault((folder, day, model), [0, 0, 0, 0])
        row[0] += 1
        row[1] += 0 if ok else 1
        row[2] += tin
        row[3] += tout

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            await self.flush()

    async def flush(self) -> None:
        """Write every counted request to the database now."""
        if self.db is None:
            return
        async with self._flush_lock:
            if not self._unflushed:
                return
            rows, self._unflushed = self._unflushed, {}
            try:
                await asyncio.to_thread(record_usage_batch, self.db, rows)
            except sqlite3.Error as e:  # locked past the busy timeout, disk full...
                log.error("could not record model usage (kept for the next try): %s", e)
                for k, v in rows.items():
                    cur = self._unflushed.setdefault(k, [0, 0, 0, 0])
                    for i in range(4):
                        cur[i] += v[i]
