"""A fake Home Assistant, written from HA's REST API documentation
(developers.home-assistant.io/docs/api/rest): every /api/ call needs
`Authorization: Bearer <token>` (401 otherwise); `GET /api/`, `/api/config`, `/api/states`,
`/api/states/<entity_id>` (404 for an unknown entity); `POST /api/services/<domain>/<service>`
answers the states that changed (400 for an unknown service);
`POST /api/config/core/check_config` answers {result, errors}. It records every call, and
serves a small frontend page under /<dashboard>/<view> that, like HA's, reads its login from
localStorage `hassTokens` and draws the states it then fetches."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

NOW = "2026-03-01T10:00:00.000000+00:00"

PAGE = """<!doctype html><html><head><title>Home Assistant</title><style>
body { margin: 0; background: #fff; font: 24px sans-serif; }
.card { display: inline-block; width: 300px; height: 200px; margin: 20px; color: #fff; }
.on { background: #f4b400; } .off { background: #263238; } .other { background: #1e88e5; }
</style></head><body><div id="root"></div><script>
(async () => {
  const raw = localStorage.getItem('hassTokens');
  if (!raw) return;  // not logged in: a blank page
  const token = JSON.parse(raw).access_token;
  const r = await fetch('/api/states', {headers: {Authorization: 'Bearer ' + token}});
  if (r.status !== 200) return;
  const states = await r.json();
  const root = document.getElementById('root');
  for (const s of states) {
    const d = document.createElement('div');
    d.className = 'card ' + (['on', 'off'].includes(s.state) ? s.state : 'other');
    d.textContent = s.entity_id + ': ' + s.state;
    root.appendChild(d);
  }
  document.body.dataset.ready = '1';
})();
</script></body></html>"""


LOGIN_PAGE = ("<!doctype html><html><head><title>Sign in</title></head><body><form "
              "method=post><input name=user><input name=password type=password></form>"
              "</body></html>")


def state(entity_id: str, value: str, **attributes: Any) -> dict[str, Any]:
    return {"entity_id": entity_id, "state": value, "attributes": attributes,
            "last_changed": NOW, "last_updated": NOW,
            "context": {"id": "01H0000000000000000000000", "parent_id": None,
                        "user_id": None}}


DEFAULT_STATES = [
    state("light.kitchen", "off", friendly_name="Kitchen", brightness=None),
    state("light.greenhouse", "on", friendly_name="Greenhouse light", brightness=200),
    state("switch.pump", "off", friendly_name="Pump"),
    state("sensor.soil_moisture", "41", unit_of_measurement="%"),
    state("sensor.secret_camera_battery", "88", unit_of_measurement="%"),
    state("climate.greenhouse", "heat", temperature=19, current_temperature=17.5),
]

SERVICES = {
    "light": {"turn_on", "turn_off", "toggle"},
    "switch": {"turn_on", "turn_off", "toggle"},
    "climate": {"set_temperature", "set_hvac_mode", "turn_on", "turn_off"},
    "homeassistant": {"restart", "check_config", "reload_core_config"},
    "lock": {"lock", "unlock", "open"},
}


@dataclass
class FakeHomeAssistant:
    token: str
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    requests: list[tuple[str, str, int]] = field(default_factory=list)
    # The client end (address, port) of each TCP connection a request came on: one entry per
    # connection the client opened.
    connections: set[tuple[str, int]] = field(default_factory=set)
    check_result: str = "valid"
    restarts: int = 0
    # Answer every /api/ call with an HTML sign-in page and 200, as a login portal or a
    # misrouted reverse proxy in front of HA does.
    login_page: bool = False

    def __post_init__(self) -> None:
        if not self.states:
            self.states = {s["entity_id"]: copy.deepcopy(s) for s in DEFAULT_STATES}

    def app(self) -> web.Application:
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            if peer is not None:
                self.connections.add((str(peer[0]), int(peer[1])))
            if request.path.startswith("/api/") and self.login_page:
                self.requests.append((request.method, request.path, 200))
                return web.Response(text=LOGIN_PAGE, content_type="text/html")
            if request.path.startswith("/api/"):
                ok = request.headers.get("Authorization") == f"Bearer {self.token}"
                if not ok:
                    self.requests.append((request.method, request.path, 401))
                    return web.Response(status=401, text="401: Unauthorized")
            resp = await handler(request)
            self.requests.append((request.method, request.path, resp.status))
            return resp

        app = web.Application(middlewares=[auth])
        app.router.add_get("/api/", self._api)
        app.router.add_get("/api/config", self._config)
        app.router.add_get("/api/states", self._states)
        app.router.add_get("/api/states/{entity_id}", self._state)
        app.router.add_post("/api/services/{domain}/{service}", self._service)
        app.router.add_post("/api/config/core/check_config", self._check)
        app.router.add_get("/{dashboard}", self._page)
        app.router.add_get("/{dashboard}/{view}", self._page)
        return app

    async def _api(self, request: web.Request) -> web.Response:
        return web.json_response({"message": "API running."})

    async def _config(self, request: web.Request) -> web.Response:
        return web.json_response({
            "components": ["api", "config", "frontend", "light", "switch"],
            "config_dir": "/config", "elevation": 50, "latitude": 52.5, "longitude": 13.4,
            "location_name": "Farm", "time_zone": "Europe/Berlin",
            "unit_system": {"length": "km", "mass": "g", "temperature": "°C",
                            "volume": "L"},
            "version": "2026.3.0", "whitelist_external_dirs": [], "state": "RUNNING",
            "safe_mode": False})

    async def _states(self, request: web.Request) -> web.Response:
        return web.json_response(list(self.states.values()))

    async def _state(self, request: web.Request) -> web.Response:
        s = self.states.get(request.match_info["entity_id"])
        if s is None:
            return web.json_response({"message": "Entity not found."}, status=404)
        return web.json_response(s)

    async def _service(self, request: web.Request) -> web.Response:
        domain, service = request.match_info["domain"], request.match_info["service"]
        if service not in SERVICES.get(domain, set()):
            return web.json_response({"message": f"Service {domain}.{service} not found."},
                                     status=400)
        body = await request.json() if request.can_read_body else {}
        self.calls.append((domain, service, body))
        if (domain, service) == ("homeassistant", "restart"):
            self.restarts += 1
            return web.json_response([])
        ids = body.get("entity_id", [])
        ids = [ids] if isinstance(ids, str) else ids
        changed = []
        for eid in ids:
            s = self.states.get(eid)
            if s is None:
                continue
            if service == "turn_on":
                s["state"] = "on" if domain != "climate" else "heat"
            elif service == "turn_off":
                s["state"] = "off"
            elif domain == "lock" and service in ("lock", "unlock"):
                s["state"] = f"{service}ed"
            elif service == "set_temperature":
                s["attributes"]["temperature"] = body.get("temperature")
            changed.append(s)
        return web.json_response(changed)

    async def _check(self, request: web.Request) -> web.Response:
        errors = None if self.check_result == "valid" else "Invalid config for [light]"
        return web.json_response({"result": self.check_result, "errors": errors})

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")
