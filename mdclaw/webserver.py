"""The daemon's web server: one aiohttp application on one listener (`server.listen`), which
every part that speaks HTTP joins: the local HTTP chat (mdclaw.channels.http), the operator
page and /metrics (mdclaw.operator). The daemon makes it from the config (mdclaw.daemon.web),
lets the parts add their routes, starts it before the channels connect and stops it after
they disconnect.

Every request, whoever serves it, passes two checks here: on a loopback address only loopback
host names are answered (no DNS rebinding), and a request naming an `Origin` other than its
own `Host` is refused (an `Origin: null` too, but for GET); with a token, a path nothing
serves needs it too (401, not 404). Who may use a route is each part's rule, made with the
one `TokenGate`: the bearer token (`server.secret_file` or the generated one) compared in
constant time, and wrong tokens throttled per client address (mdclaw.throttle), so a guess
counts wherever it is made and a lockout holds everywhere.

Slow and greedy clients are the listener's business (mdclaw.listener): a header and a body
read timeout, an idle timeout and a cap on connections per client address, from `server:`
(`connection_limits`); the /metrics listener of `metrics.listen` keeps the same ones.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from mdclaw.config import Config
from mdclaw.listener import ConnectionGuard, ConnectionLimits
from mdclaw.throttle import TokenThrottle, client_key

log = logging.getLogger("mdclaw.webserver")

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_listen(listen: str) -> tuple[str, int]:
    """"host:port" as (host, port); an empty host means 127.0.0.1. Raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {listen!r} is not host:port")
    return host or "127.0.0.1", int(port)


def connection_limits(cfg: Config) -> ConnectionLimits:
    """The web server's limits on slow and greedy clients (`server:`; its defaults when the
    config has no web server), also those of the /metrics listener."""
    server = cfg.web_server
    if server is None:
        return ConnectionLimits()
    return ConnectionLimits(header_timeout=server.header_timeout.total_seconds(),
                            body_timeout=server.body_timeout.total_seconds(),
                            idle_timeout=server.idle_timeout.total_seconds(),
                            max_per_client=server.max_connections_per_client)


def is_loopback(host: str) -> bool:
    """A loopback host name or address (`[::1]` too)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def json_error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status,
                             headers={**SECURITY_HEADERS, **headers})


def token_matches(secret: bytes | None, token: str) -> bool:
    """`token` is `secret` (constant-time); False when there is no secret. The one
    comparison of the web server's token; requests go through `TokenGate`."""
    # A header's bytes that are not UTF-8 arrive as surrogates (aiohttp), a JSON token may
    # spell one: "surrogatepass" encodes them too, so that they mismatch rather than raise.
    return secret is not None and hmac.compare_digest(
        token.strip().encode("utf-8", "surrogatepass"), secret)


def bearer_token(request: web.BaseRequest) -> str | None:
    """The token of the request's `Authorization: Bearer <token>` header, if it has one."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def _locked_out(seconds: float) -> web.Response:
    return json_error(429, "too many wrong tokens from this address; try again later",
                      **{"Retry-After": str(max(1, math.ceil(seconds)))})


class TokenGate:
    """The web server's token as a door: compared in constant time (`token_matches`), and
    wrong tokens throttled per client address (`mdclaw.throttle.TokenThrottle`). The one
    check for the chat's bearer header, the operator page's login and bearer header, and
    /metrics (on the web server and on a listener of its own)."""

    def __init__(self, secret: str | bytes | None,
                 throttle: TokenThrottle | None = None) -> None:
        self._secret = (secret.encode() if isinstance(secret, str) else secret) or None
        self.throttle = throttle if throttle is not None else TokenThrottle()

    @property
    def has_secret(self) -> bool:
        return self._secret is not None

    def token_refusal(self, request: web.BaseRequest, token: str | None, *,
                      wrong: str = "missing or wrong bearer token") -> web.Response | None:
        """None when `token` is the secret; else the answer that refuses it: 429 with
        `Retry-After` while the client's address is locked out (the right token too), else
        401 (`wrong` as the message). Only a presented token counts as a guess (None: no
        token was sent)."""
        client = client_key(request.remote)
        left = self.throttle.locked(client)
        if left is not None:
            return _locked_out(left)
        if token is None:
            return json_error(401, wrong, **{"WWW-Authenticate": 'Bearer realm="mdclaw"'})
        if token_matches(self._secret, token):
            self.throttle.succeeded(client)
            return None
        started = self.throttle.failed(client)
        if started is not None:
            log.warning("%d wrong tokens from %s within %.0f s: its tokens are refused for "
                        "%.0f s", self.throttle.max_failures, client, self.throttle.window,
                        started)
            return _locked_out(started)
        return json_error(401, wrong, **{"WWW-Authenticate": 'Bearer realm="mdclaw"'})

    def bearer_refusal(self, request: web.BaseRequest) -> web.Response | None:
        """`token_refusal` of the request's bearer header."""
        return self.token_refusal(request, bearer_token(request))


class WebServer:
    """One aiohttp application on `listen` (port 0: any free port), guarded by `gate`, its
    connections by `limits` (mdclaw.listener). Routes are added before `start()`; each
    decides on access itself (with `gate`)."""

    def __init__(self, listen: str, gate: TokenGate | None = None,
                 limits: ConnectionLimits | None = None) -> None:
        self.host, self.port = parse_listen(listen)
        self.gate = gate if gate is not None else TokenGate(None)
        self.connections = ConnectionGuard(limits, name="web")
        self.app = web.Application(middlewares=[self.connections.middleware, self._guard])
        self._runner: web.AppRunner | None = None
        self._mounts: list[str] = []  # sub-applications' prefixes: they decide for themselves

    @property
    def url(self) -> str:
        # Comparing with the any-address (S104: nothing binds here).
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"  # noqa: S104
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._runner is not None

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        """Serve `method path` with `handler` (before `start()`)."""
        self.app.router.add_route(method, path, handler)

    def mount(self, prefix: str, app: web.Application) -> None:
        """Serve the sub-application `app` under `prefix` (e.g. "/operator"), before
        `start()`; it applies its own access rule."""
        if not prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError(f"mount prefix {prefix!r} must be like /name")
        self.app.add_subapp(prefix, app)
        self._mounts.append(prefix)

    async def start(self) -> None:
        """Listen. Raises OSError naming the address when it cannot."""
        if self._runner is not None:
            return
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                               shutdown_timeout=1.0,
                               keepalive_timeout=self.connections.keepalive_timeout)
        await runner.setup()
        try:
            await self.connections.site(runner, self.host, self.port).start()
        except OSError as e:
            await runner.cleanup()
            raise OSError(f"cannot listen on {self.host}:{self.port}: {e.strerror or e}"
                          ) from None
        if self.port == 0:
            self.port = int(runner.addresses[0][1])
        self._runner = runner
        log.info("web server listening on %s", self.url)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        host_header = request.headers.get("Host", "")
        req_host = urlsplit(f"//{host_header}").hostname or ""
        if is_loopback(self.host) and not is_loopback(req_host):
            return json_error(403, "this server answers only on loopback host names")
        origin = request.headers.get("Origin")
        if origin is not None and origin != "null":
            if urlsplit(origin).netloc.lower() != host_header.lower():
                return json_error(403, "cross-origin requests are not allowed")
        elif origin == "null" and request.method != "GET":
            return json_error(403, "cross-origin requests are not allowed")
        missing = request.match_info.http_exception
        if (missing is not None and missing.status == 404 and self.gate.has_secret
                and not any(request.path == p or request.path.startswith(p + "/")
                            for p in self._mounts)):
            # A path nothing serves needs the token too: without it, nobody learns which
            # paths exist.
            refused = self.gate.bearer_refusal(request)
            if refused is not None:
                return refused
        return await handler(request)
