"""The operator page's HTTP side: a sub-application of the daemon's web server at /operator.

Routes (JSON unless noted; every `/api/...` route behind mdclaw.operator.access):

- `GET /operator/` — the page (HTML; app.js and app.css beside it; no CDN, no build step).
- `POST /operator/login` `{"token"}` — sets the session cookie; `POST /operator/logout`.
- `GET /operator/api/session` — how the caller got in and the CSRF token for changes.
- `GET /operator/api/overview|groups|tasks|approvals|outbox|quarantine|usage|mcp|config` —
  one view each.
- `GET /operator/api/tasks/{id}/runs` — a task's run history.
- `POST /operator/api/tasks/{id}/{pause|resume|cancel|run-now}`.
- `POST /operator/api/outbox/{id}/{retry|drop}`.
- `GET /operator/api/approvals`; `POST /operator/api/approvals/{id}/{approve|deny}`
  (`{"option": N}` answers a question).
- `POST /operator/api/quarantine/delete` `{"name"}`.
- `POST /operator/api/bulk/tasks/{pause|resume|cancel|run-now}`,
  `/api/bulk/outbox/{retry|drop}`, `/api/bulk/quarantine/delete`, each `{"ids": [...]}`:
  the same change for each (at most 1000), answered with what was done and what refused.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from mdclaw import schedule
from mdclaw.ipc.quarantine import QuarantineError
from mdclaw.operator import views
from mdclaw.operator.access import GRANT, Access, Handler
from mdclaw.ops.approvals import ApprovalError
from mdclaw.ops.view import DaemonView
from mdclaw.state.outbox import OutboxError
from mdclaw.state.tasks import TaskError
from mdclaw.webassets import SHARED_STYLE, PageAssets

log = logging.getLogger("mdclaw.operator")

PREFIX = "/operator"
STATIC = {"": "index.html", "index.html": "index.html", "app.js": "app.js",
          "app.css": "app.css", "mdclaw.css": SHARED_STYLE}
_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
            "Cache-Control": "no-store"}
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
MAX_BODY = 16 * 1024


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, headers=_HEADERS,
                             dumps=lambda o: json.dumps(o, default=str))


def _error(status: int, message: str) -> web.Response:
    return _json({"error": message}, status)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.content.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY, actual_size=len(raw))
    if not raw:
        return {}
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    return data


def build_app(d: DaemonView, access: Access) -> web.Application:
    """The operator sub-application over daemon `d`, guarded by `access`."""
    assets = PageAssets("mdclaw.operator", STATIC, headers=_HEADERS, page_csp=PAGE_CSP)

    def public(request: web.Request) -> bool:
        rel = request.match_info.get("asset")
        return rel is not None or request.path in (f"{PREFIX}/login", f"{PREFIX}/logout")

    app = web.Application(middlewares=[access.middleware(public)])

    async def asset(request: web.Request) -> web.StreamResponse:
        return assets.response(request.match_info.get("asset", ""))

    async def login(request: web.Request) -> web.Response:
        try:
            data = await _body(request)
        except ValueError:
            return _error(400, "body is not a JSON object")
        token = data.get("token")
        if not isinstance(token, str):
            return _error(400, "field 'token' is missing")
        return access.login(request, token)

    async def logout(request: web.Request) -> web.Response:
        return access.logout(request)

    async def session(request: web.Request) -> web.Response:
        grant = request[GRANT]
        return _json({"auth": grant.how, "csrf": grant.csrf})

    def view(fn: Callable[[DaemonView], Any], *, blocking: bool = False) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            data = await asyncio.to_thread(fn, d) if blocking else fn(d)
            return _json(data)
        return handler

    async def overview(request: web.Request) -> web.Response:
        o = views.overview(d)  # the daemon's own status, on the loop
        return _json(await asyncio.to_thread(views.health, d, o))

    async def ids_of(request: web.Request, kind: type) -> list[Any] | None:
        try:
            ids = (await _body(request)).get("ids")
        except ValueError:
            return None
        if (not isinstance(ids, list) or len(ids) > 1000
                or not all(isinstance(i, kind) and not isinstance(i, bool) for i in ids)):
            return None
        return ids

    async def outbox_bulk(request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("retry", "drop"):
            return _error(404, "unknown action")
        ids = await ids_of(request, int)
        if ids is None:
            return _error(400, "give {\"ids\": [row numbers]}")
        return _json(views.outbox_bulk(d, ids, action))

    async def tasks_bulk(request: web.Request) -> web.Response:
        ids = await ids_of(request, str)
        if ids is None:
            return _error(400, "give {\"ids\": [task ids]}")
        try:
            return _json(views.tasks_bulk(d, ids, request.match_info["action"]))
        except KeyError:
            return _error(404, "unknown action")

    async def quarantine_bulk(request: web.Request) -> web.Response:
        names = await ids_of(request, str)
        if names is None:
            return _error(400, "give {\"ids\": [entry names]}")
        return _json(await asyncio.to_thread(views.quarantine_delete_many, d, names))

    async def usage(request: web.Request) -> web.Response:
        try:
            days = max(1, min(int(request.query.get("days") or 14), 90))
        except ValueError:
            return _error(400, "days must be a whole number")
        return _json(views.usage(d, days))

    async def runs(request: web.Request) -> web.Response:
        got = views.task_runs(d, request.match_info["task_id"])
        return _json(got) if got is not None else _error(404, "no such task")

    async def task_action(request: web.Request) -> web.Response:
        try:
            return _json(views.change(d, request.match_info["task_id"],
                                      request.match_info["action"]))
        except KeyError:
            return _error(404, "unknown action")
        except (TaskError, schedule.ScheduleError) as e:
            return _error(409, str(e))

    async def outbox_action(request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("retry", "drop"):
            return _error(404, "unknown action")
        try:
            return _json(views.outbox_change(d, int(request.match_info["row_id"]), action))
        except ValueError as e:  # OutboxError, or an id that is not a number
            return _error(409 if isinstance(e, OutboxError) else 400, str(e))

    async def approval_action(request: web.Request) -> web.Response:
        action = request.match_info["action"]
        if action not in ("approve", "deny"):
            return _error(404, "unknown action")
        try:
            body = await _body(request)
            option = body.get("option")
            if option is not None and (not isinstance(option, int) or isinstance(option, bool)):
                return _error(400, "option must be a whole number")
            return _json(views.approval_change(d, int(request.match_info["approval_id"]),
                                               action, option))
        except ApprovalError as e:
            return _error(409, str(e))
        except ValueError:  # a body that is no JSON object, an id that is no number
            return _error(400, "give the approval's number, and a JSON object body")

    async def quarantine_delete(request: web.Request) -> web.Response:
        try:
            name = (await _body(request)).get("name")
        except ValueError:
            return _error(400, "body is not a JSON object")
        if not isinstance(name, str):
            return _error(400, "field 'name' is missing")
        try:
            found = await asyncio.to_thread(views.quarantine_delete, d, name)
        except QuarantineError as e:
            return _error(400, str(e))
        return _json({"deleted": found}) if found else _error(404, "no such quarantined file")

    r = app.router
    r.add_get("/{asset:(|index\\.html|app\\.js|app\\.css|mdclaw\\.css)}", asset)
    r.add_post("/login", login)
    r.add_post("/logout", logout)
    r.add_get("/api/session", session)
    r.add_get("/api/overview", overview)
    r.add_get("/api/groups", view(views.groups))
    r.add_get("/api/tasks", view(views.tasks))
    r.add_get("/api/tasks/{task_id}/runs", runs)
    r.add_post("/api/bulk/tasks/{action}", tasks_bulk)
    r.add_post("/api/bulk/outbox/{action}", outbox_bulk)
    r.add_post("/api/bulk/quarantine/delete", quarantine_bulk)
    r.add_post("/api/tasks/{task_id}/{action}", task_action)
    r.add_get("/api/approvals", view(views.approvals))
    r.add_post("/api/approvals/{approval_id}/{action}", approval_action)
    r.add_get("/api/outbox", view(views.outbox))
    r.add_post("/api/outbox/{row_id}/{action}", outbox_action)
    r.add_get("/api/quarantine", view(views.quarantine, blocking=True))
    r.add_post("/api/quarantine/delete", quarantine_delete)
    r.add_get("/api/usage", usage)
    r.add_get("/api/mcp", view(views.mcp))
    r.add_get("/api/config", view(views.config))
    return app
