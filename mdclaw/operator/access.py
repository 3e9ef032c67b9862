"""Who may use the operator page (and whatever else mdclaw serves for the operator, such as
metrics): one rule, one place.

- With a bearer token (`server.secret_file`, or the generated one): every request needs
  `Authorization: Bearer <token>` or the session cookie a login with that token set
  (`HttpOnly`, `SameSite=Strict`, `Secure` over https; kept in memory, so a restart logs
  everyone out). Wrong tokens (login or header) count against the web server's one lockout
  per client address (`mdclaw.throttle`): too many, and that address gets 429 for a while.
- Without a token: only loopback clients, judged by the connection's peer address (never a
  header), and only under a loopback host name (no DNS rebinding).
- A request that changes something must be a POST, say where it comes from (`Origin`, else
  `Referer`) and come from this very origin, and carry the bearer header or the page's
  CSRF token (`X-CSRF-Token`, handed out by `GET .../api/session`).

`Access.check(request)` is the rule; `Access.middleware` applies it to a whole
sub-application and `Access.protect(handler)` to one handler.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from aiohttp import web

COOKIE = "mdclaw_operator"
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 64
SAFE_METHODS = frozenset({"GET", "HEAD"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenHolder(Protocol):
    """What access needs of the web server: its token as a door
    (`mdclaw.webserver.TokenGate`: compared its way, wrong tokens throttled)."""

    @property
    def has_secret(self) -> bool: ...

    def token_refusal(self, request: web.BaseRequest, token: str | None, *,
                      wrong: str = ...) -> web.Response | None: ...

    def bearer_refusal(self, request: web.BaseRequest) -> web.Response | None: ...


@dataclass
class Session:
    csrf: str
    expires: float


@dataclass(frozen=True)
class Grant:
    """How a request got in: "bearer", "cookie" or "loopback"; the CSRF token it must echo
    for changes (None for bearer requests, which cannot be forged by a browser)."""

    how: str
    csrf: str | None


# Where a checked request carries its grant (for the handlers behind the check).
GRANT = web.RequestKey("operator_grant", Grant)


def is_loopback_address(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def is_loopback_name(host: str) -> bool:
    return host.lower() in LOOPBACK_NAMES or is_loopback_address(host.strip("[]"))


def peer_host(request: web.BaseRequest) -> str | None:
    """The client's address as the connection reports it (headers play no part)."""
    transport = request.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if isinstance(peer, tuple | list) and peer:
        return str(peer[0])
    return None


def _json_error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message}, status=status,
                             headers={"Cache-Control": "no-store",
                                      "X-Content-Type-Options": "nosniff", **headers})


def same_origin(request: web.BaseRequest) -> bool:
    """The request names its origin (Origin, else Referer) and it is this server's."""
    origin = request.headers.get("Origin")
    source = origin if origin and origin != "null" else request.headers.get("Referer")
    if not source:
        return False
    parts = urlsplit(source)
    return (parts.scheme in ("http", "https") and parts.scheme == request.scheme
            and parts.netloc.lower() == request.headers.get("Host", "").lower())


class Access:
    """The operator's access rule over the web server's token."""

    def __init__(self, tokens: TokenHolder) -> None:
        self.tokens = tokens
        self._sessions: dict[str, Session] = {}
        # Without a token, the page's CSRF token: one per daemon run, readable only by a
        # page of this origin on a loopback connection.
        self._local_csrf = secrets.token_urlsafe(32)

    # ------------------------------------------------------------------ sessions
    def _session(self, request: web.BaseRequest) -> Session | None:
        sid = request.cookies.get(COOKIE)
        if not sid:
            return None
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items() if s.expires <= now]:
            del self._sessions[key]
        for key, s in self._sessions.items():
            if hmac.compare_digest(key.encode(), sid.encode("utf-8", "surrogatepass")):
                return s
        return None

    def login(self, request: web.Request, token: str) -> web.Response:
        """Check `token`; on success a JSON answer that sets the session cookie."""
        if not self.tokens.has_secret:
            return _json_error(400, "this mdclaw has no token (server.secret_file): the page "
                                    "is open to loopback clients without logging in")
        if not same_origin(request):
            return _json_error(403, "cross-origin requests are not allowed")
        refused = self.tokens.token_refusal(request, token, wrong="wrong token")
        if refused is not None:
            return refused
        while len(self._sessions) >= MAX_SESSIONS:
            oldest = min(self._sessions, key=lambda k: self._sessions[k].expires)
            del self._sessions[oldest]
        sid = secrets.token_urlsafe(32)
        session = Session(csrf=secrets.token_urlsafe(32),
                          expires=time.monotonic() + SESSION_SECONDS)
        self._sessions[sid] = session
        resp = web.json_response({"ok": True, "csrf": session.csrf},
                                 headers={"Cache-Control": "no-store"})
        resp.set_cookie(COOKIE, sid, max_age=SESSION_SECONDS, path="/", httponly=True,
                        samesite="Strict", secure=request.secure)
        return resp

    def logout(self, request: web.Request) -> web.Response:
        sid = request.cookies.get(COOKIE)
        if sid:
            self._sessions.pop(sid, None)
        resp = web.json_response({"ok": True}, headers={"Cache-Control": "no-store"})
        resp.del_cookie(COOKIE, path="/")
        return resp

    # ------------------------------------------------------------------ the rule
    def grant(self, request: web.BaseRequest) -> Grant | web.Response:
        """The grant a request has to read, or the error response that refuses it."""
        if not self.tokens.has_secret:
            if not is_loopback_address(peer_host(request)):
                return _json_error(403, "this mdclaw has no token (server.secret_file): the "
                                        "operator page is served to loopback clients only")
            host = urlsplit(f"//{request.headers.get('Host', '')}").hostname or ""
            if not is_loopback_name(host):
                return _json_error(403, "without a token the operator page answers only on "
                                        "loopback host names")
            return Grant("loopback", self._local_csrf)
        if "Authorization" in request.headers:
            # A bearer header is a token to check (and a guess to count), never passed over
            # for the session cookie.
            refused = self.tokens.bearer_refusal(request)
            return refused if refused is not None else Grant("bearer", None)
        session = self._session(request)
        if session is not None:
            return Grant("cookie", session.csrf)
        return _json_error(401, "log in with the token of server.secret_file",
                           **{"WWW-Authenticate": 'Bearer realm="mdclaw"'})

    def check(self, request: web.BaseRequest) -> Grant | web.Response:
        """`grant()`, and for a request that changes something: POST, same origin, and the
        bearer header or the CSRF token."""
        got = self.grant(request)
        if isinstance(got, web.Response) or request.method in SAFE_METHODS:
            return got
        if request.method != "POST":
            return _json_error(405, "changes are made with POST")
        if not same_origin(request):
            return _json_error(403, "cross-origin requests are not allowed")
        if got.csrf is not None:
            sent = request.headers.get("X-CSRF-Token", "")
            if not hmac.compare_digest(sent.encode("utf-8", "surrogatepass"), got.csrf.encode()):
                return _json_error(403, "missing or wrong CSRF token (reload the page)")
        return got

    def protect(self, handler: Handler) -> Handler:
        """`handler` behind `check()` (for a route outside the operator sub-application,
        e.g. metrics)."""
        async def guarded(request: web.Request) -> web.StreamResponse:
            got = self.check(request)
            if isinstance(got, web.Response):
                return got
            request[GRANT] = got
            return await handler(request)
        return guarded

    def middleware(self, public: Callable[[web.Request], bool]) -> Any:
        """An aiohttp middleware applying `check()` to every request but those `public`
        says need none (the page's static files)."""
        @web.middleware
        async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            if public(request):
                # Static files hold no data, but without a token only loopback gets them.
                got = self.grant(request)
                if (isinstance(got, web.Response) and not self.tokens.has_secret):
                    return got
                return await handler(request)
            checked = self.check(request)
            if isinstance(checked, web.Response):
                return checked
            request[GRANT] = checked
            return await handler(request)
        return guard
