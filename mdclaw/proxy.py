"""The credential proxy: how an agent container reaches its model without holding a key.

For each running container the host serves the model API on a unix socket inside that
group's IPC folder (`ipc/<folder>/.proxy.sock`, a dot-file the IPC reader ignores). The agent
runner forwards a loopback port in the container to it. For every request the proxy:

- accepts only the model API's own paths (POST /v1/messages for claude, POST
  /v1/chat/completions for openai, and a few read-only ones) — anything else is 404;
- drops whatever credentials the client sent and injects the real one, read from the
  model's `api_key_file` (never logged, never sent back);
- forwards to the configured upstream and streams the answer back as it arrives;
- counts the request and the tokens the API reports in the state database (`model_usage`),
  per group, model and UTC day — `mdclaw usage` shows them.

The group comes from which socket the request arrived on, never from anything the client says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from mdclaw.config import Config, ModelSpec, read_secret
from mdclaw.paths import IPC_DIR_MODE, Layout
from mdclaw.state import Database, now_iso

log = logging.getLogger("mdclaw.proxy")

SOCKET_NAME = ".proxy.sock"
MAX_REQUEST_BYTES = 32 * 1024 * 1024
MAX_BUFFERED_JSON = 8 * 1024 * 1024
UNIX_PATH_MAX = 107

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


class ProxyError(RuntimeError):
    """The proxy for a group cannot be started (socket path too long, folder missing...)."""


@dataclass(frozen=True)
class Upstream:
    """Where one group's model requests go and how they are authenticated."""

    backend: str
    model: str | None
    base_url: str
    api_key_file: Path | None = None

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
                   api_key_file=spec.api_key_file)


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


async def probe_upstream(upstream: Upstream, timeout: float = 5.0) -> tuple[int | None, str]:
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
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout),
                                         trust_env=True) as session:
            async with session.get(url, headers=headers, allow_redirects=False) as r:
                body = (await r.content.read(2000)).decode("utf-8", "replace")
                return r.status, " ".join(body.split())[:200]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
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


def usage_rows(db: Database, *, group: str | None = None,
               since_day: str | None = None) -> list[dict[str, Any]]:
    """Usage totals per group and model (summed over days from `since_day` on)."""
    where, params = [], []
    if group:
        where.append("group_folder = ?")
        params.append(group)
    if since_day:
        where.append("day >= ?")
        params.append(since_day)
    sql = ("SELECT group_folder, model, SUM(requests) AS requests, SUM(errors) AS errors, "
           "SUM(input_tokens) AS input_tokens, SUM(output_tokens) AS output_tokens, "
           "MIN(day) AS first_day, MAX(day) AS last_day FROM model_usage"
           + (" WHERE " + " AND ".join(where) if where else "")
           + " GROUP BY group_folder, model ORDER BY group_folder, model")
    return [dict(r) for r in db.query(sql, tuple(params))]


# --------------------------------------------------------------------------- server


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
    requests: int = 0


class CredentialProxy:
    """Serves one unix socket per running group. Use inside a running event loop.

    `start_group` before the container starts, `stop_group` after it ended, `close` at
    shutdown. `db` may be None (then nothing is persisted; counts stay in `stats`).

    Usage is added up in memory and written every `flush_interval` seconds, when a group's
    proxy stops, and at `close` — one small transaction instead of one per request, which
    keeps database work off the request path (a crash loses at most one interval's counts).
    At most `max_concurrent` requests per group are forwarded at once; more wait.
    """

    def __init__(self, layout: Layout, db: Database | None = None, *,
                 connect_timeout: float = 30.0, read_timeout: float = 600.0,
                 flush_interval: float = 5.0, max_concurrent: int = 8) -> None:
        self.layout = layout
        self.db = db
        self.flush_interval = flush_interval
        self.max_concurrent = max_concurrent
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

    def socket_path(self, folder: str) -> Path:
        return self.layout.group_ipc_dir(folder) / SOCKET_NAME

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # trust_env: an HTTP(S)_PROXY set for the daemon applies to the upstream too.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, auto_decompress=False, trust_env=True,
                connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=60))
        return self._session

    async def start_group(self, folder: str, upstream: Upstream) -> Path:
        """Serve `folder`'s socket (replacing a stale one); return its path.

        Raises ProxyError if the socket cannot be made.
        """
        if folder in self._sites:
            await self.stop_group(folder)
        path = self.socket_path(folder)
        if len(os.fsencode(path)) > UNIX_PATH_MAX:
            raise ProxyError(f"proxy socket path {path} is longer than {UNIX_PATH_MAX} bytes; "
                             "use a shorter data_dir")
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(path.parent, IPC_DIR_MODE)
        except OSError as e:
            raise ProxyError(f"cannot make the IPC folder {path.parent}: {e.strerror}") from None
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._make_handler(folder, upstream))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.UnixSite(runner, str(path))
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise ProxyError(f"cannot listen on {path}: {e.strerror}") from None
        # The IPC folder's own mode keeps other users out; the container's uid must connect.
        os.chmod(path, 0o666)
        self._sites[folder] = _GroupSite(folder, upstream, path, runner)
        self.stats.setdefault(folder, {"requests": 0, "errors": 0, "input_tokens": 0,
                                       "output_tokens": 0})
        if self.db is not None and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.ensure_future(self._flush_loop())
        return path

    async def start_for_config(self, cfg: Config, folder: str) -> Path:
        """start_group with the upstream the config gives `folder`."""
        _key, spec = model_for_group(cfg, folder)
        return await self.start_group(folder, Upstream.from_spec(spec))

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
        await site.runner.cleanup()
        with contextlib.suppress(FileNotFoundError):
            site.socket_path.unlink()
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

    # ------------------------------------------------------------------ request path
    def _make_handler(self, folder: str, upstream: Upstream):  # noqa: ANN202
        allowed = ALLOWED_ROUTES[upstream.backend]
        # A runaway or hostile agent cannot open unbounded parallel requests on the key:
        # beyond the limit they wait their turn.
        slots = asyncio.Semaphore(self.max_concurrent)

        async def handle(request: web.Request) -> web.StreamResponse:
            if (request.method, request.path) not in allowed:
                return web.json_response(
                    {"error": {"type": "not_found",
                               "message": f"{request.method} {request.path} is not a model "
                                          "API path this proxy forwards"}}, status=404)
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

    async def _forward(self, request: web.Request, folder: str,
                       upstream: Upstream) -> web.StreamResponse:
        body = await request.read()
        model = upstream.model or ""
        if body:
            with contextlib.suppress(ValueError, UnicodeDecodeError):
                sent = json.loads(body)
                if isinstance(sent, dict) and isinstance(sent.get("model"), str):
                    model = sent["model"][:128]
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
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
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
            # The body's model name is the container's word: keep it only when the API
            # accepted the request, so made-up names cannot fill the usage table.
            self._count(folder, model if ok else (upstream.model or ""), ok=ok, usage=counter)
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
        if self.db is None:
            return
        row = self._unflushed.setdefault((folder, now_iso()[:10], model), [0, 0, 0, 0])
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
            except Exception as e:  # noqa: BLE001 - keep the counts for the next try
                log.error("could not record model usage: %s", e)
                for k, v in rows.items():
                    cur = self._unflushed.setdefault(k, [0, 0, 0, 0])
                    for i in range(4):
                        cur[i] += v[i]
