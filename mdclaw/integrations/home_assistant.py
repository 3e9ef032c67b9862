"""Home Assistant as a capability agents ask for: the ha_* actions and farm_state_refresh.

The agent writes an action request (`farm_action` family, see docs/ipc-protocol.md); the
action worker runs the handler here off the IPC loop; the result envelope lands in the
group's `action_results/`. The long-lived token is read on the host from
`integrations.home_assistant.token_file` at the start of each action and sent only to Home
Assistant in the Authorization header: never to a container, a log line or a result. Each
action talks to HA through one HTTP session (`client_for`), so its calls share a
kept-alive connection.

Why plain aiohttp over HA's documented REST API rather than a client library: the actions
need six endpoints (`/api/`, `/api/config`, `/api/states`, `/api/states/<id>`,
`/api/services/<domain>/<service>`, `/api/config/core/check_config`), aiohttp is already
mdclaw's HTTP client, and the maintained Python clients either wrap the REST API in their
own model layer with more dependencies to package (homeassistant-api) or speak the
WebSocket API for long-lived subscriptions mdclaw does not need (hass-client). Dashboards
are YAML files in the operator's `dashboards_dir` (HA's YAML mode), so no WebSocket
`lovelace/config` call is needed either.

Who may do what:
- which groups may call the actions: `groups.<g>.actions` (default: the main group only),
  decided by `mdclaw.ipc.actions.action_refusal`;
- which services and entities: `integrations.home_assistant.allow` (fnmatch patterns;
  default none: read-only). `service_rule` / `entity_rule` are the one definition; a refusal
  names the list that refused and what it holds, a success names the pattern that allowed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from mdclaw import agentfs
from mdclaw.agentfs import UnsafePath
from mdclaw.config import Config, HomeAssistant, read_secret
from mdclaw.errors import IpcError
from mdclaw.integrations import ha_dashboards as dash
from mdclaw.integrations import ha_screenshot
from mdclaw.ipc.actions import ActionFailed, OffloopContext, action
from mdclaw.paths import GROUP_DIR_MODE, Layout
from mdclaw.schedule import to_iso, utc_now

log = logging.getLogger("mdclaw.integrations.home_assistant")

SCREENSHOT_DIR = "screenshots"
SCREENSHOT_MAX_BYTES = 32 * 1024 * 1024
SCREENSHOT_MODE = 0o660
MAX_STATES = 5000
CONNECTIONS = 4  # at most this many connections to HA per action's session


class HAError(IpcError):
    """Home Assistant could not be reached or said no; str(e) never holds the token."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- rules


def allowed_by(patterns: tuple[str, ...], name: str) -> str | None:
    """The first pattern of `patterns` matching `name`, or None."""
    return next((p for p in patterns if fnmatchcase(name, p)), None)


def _rule(kind: str, key: str, patterns: tuple[str, ...], name: str) -> tuple[str | None, str]:
    hit = allowed_by(patterns, name)
    if hit is not None:
        return None, f"{kind} {name} allowed by {hit!r}"
    shown = ", ".join(patterns)
    return (f"{kind} {name} is not in integrations.home_assistant.allow.{key} "
            f"[{shown}]" + ("" if patterns else " (empty: read-only)"), "")


def service_rule(ha: HomeAssistant, service: str) -> tuple[str | None, str]:
    """(refusal, note): refusal names the list that refused `service` (domain.service), or
    is None and note names the pattern that allowed it."""
    return _rule("service", "services", ha.allow.services, service)


def entity_form_refusal(entity_id: str) -> str | None:
    """Why `entity_id` is not an entity id of Home Assistant's form, or None. Checked before
    any allow-list pattern or request: `light.*` must not match `light.x/../sensor.secret`,
    and only such an id may become part of a URL."""
    if dash.ENTITY_ID.match(entity_id):
        return None
    shown = entity_id if len(entity_id) <= 80 else entity_id[:77] + "..."
    return (f"{shown!r} is not an entity id: Home Assistant's form is domain.object_id, "
            "lowercase letters, digits and single underscores (e.g. light.kitchen)")


def entity_rule(ha: HomeAssistant, entity_id: str) -> tuple[str | None, str]:
    """Like service_rule, for an entity id and allow.entities; an id not of Home
    Assistant's form is refused before any pattern is tried."""
    refusal = entity_form_refusal(entity_id)
    if refusal is not None:
        return refusal, ""
    return _rule("entity", "entities", ha.allow.entities, entity_id)


# --------------------------------------------------------------------------- client


def ha_config(cfg: Config) -> HomeAssistant:
    ha = cfg.integrations.home_assistant
    if ha is None:
        raise ActionFailed("Home Assistant is not configured: the operator sets "
                           "integrations.home_assistant (docs/integrations.md)")
    return ha


class HAClient:
    """The few REST calls mdclaw makes, each with the bearer token and a timeout.

    Calls are made inside `async with HAClient(...)` (or `client_for`): one HTTP session for
    the block, whose pooled connection every call reuses (HA keeps it alive), so an action
    making 200 calls opens one connection, not 200. An action is one such block; nothing
    outlives it, so there is no session to close at shutdown."""

    def __init__(self, ha: HomeAssistant, token: str) -> None:
        self.ha = ha
        self._token = token
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HAClient:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.ha.timeout.total_seconds()),
                connector=aiohttp.TCPConnector(limit=CONNECTIONS))
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @property
    def token(self) -> str:
        """The token, for the host's own Chromium (ha_capture_screenshot) only."""
        return self._token

    def redact(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            raise RuntimeError("HAClient calls are made inside `async with` the client")
        url = self.ha.url + path
        headers = {"Authorization": f"Bearer {self._token}"}
        try:
            async with self._session.request(method, url, json=body, headers=headers) as r:
                text = await r.text()
                if r.status == 401:
                    raise HAError("Home Assistant refused the token (HTTP 401): put a valid "
                                  "long-lived access token into "
                                  "integrations.home_assistant.token_file", 401)
                if r.status >= 400:
                    raise HAError(f"Home Assistant answered HTTP {r.status} to {method} "
                                  f"{path}: {self.redact(text)[:300]}", r.status)
                if not text.strip():
                    return None
                try:
                    return json.loads(text)
                except ValueError:
                    raise HAError(self._not_json(method, path, r.status,
                                                 r.headers.get("Content-Type"), text),
                                  r.status) from None
        except TimeoutError:
            raise HAError(f"Home Assistant did not answer {method} {path} within "
                          f"{self.ha.timeout.total_seconds():g} s") from None
        except aiohttp.ClientError as e:
            raise HAError(f"cannot reach Home Assistant at {self.ha.url}: "
                          f"{self.redact(f'{type(e).__name__}: {e}')[:300]}") from None

    def _not_json(self, method: str, path: str, status: int, ctype: str | None,
                  text: str) -> str:
        """What came back instead of Home Assistant's JSON (a login page, a proxy's error
        page...), shortened and with the token taken out."""
        shown = " ".join(self.redact(text).split())
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return (f"{self.ha.url} answered {method} {path} with HTTP {status} and "
                f"{ctype or 'no content type'}, not Home Assistant's JSON ({shown!r}): check "
                "that integrations.home_assistant.url is Home Assistant itself, not a login "
                "page or a proxy in front of it")

    def _shape(self, path: str, data: Any, what: str) -> Any:
        """`data` if it is a JSON object, else HAError: valid JSON that is not Home
        Assistant's answer (another service at that address)."""
        if not isinstance(data, dict):
            kind = "nothing" if data is None else type(data).__name__
            raise HAError(f"{self.ha.url} answered GET {path} with {kind}, not {what}: "
                          "check that integrations.home_assistant.url is Home Assistant")
        return data

    async def api_status(self) -> dict[str, Any]:
        """GET /api/: {"message": "API running."}; HAError for anything else."""
        data = self._shape("/api/", await self.request("GET", "/api/"),
                           "Home Assistant's API status")
        if not isinstance(data.get("message"), str):
            raise HAError(f"{self.ha.url} answered GET /api/ without Home Assistant's "
                          "status message: check that integrations.home_assistant.url is "
                          "Home Assistant")
        return data

    async def config(self) -> dict[str, Any]:
        """GET /api/config: a JSON object (version, location_name...)."""
        return self._shape("/api/config", await self.request("GET", "/api/config"),
                           "Home Assistant's configuration")

    async def states(self) -> list[dict[str, Any]]:
        data = await self.request("GET", "/api/states")
        if not isinstance(data, list):
            raise HAError("Home Assistant's /api/states did not return a list")
        return [s for s in data[:MAX_STATES] if isinstance(s, dict)]

    async def state(self, entity_id: str) -> dict[str, Any] | None:
        try:
            data = await self.request("GET", f"/api/states/{quote(entity_id, safe='.')}")
        except HAError as e:
            if e.status == 404:
                return None
            raise
        return data if isinstance(data, dict) else None

    async def call_service(self, domain: str, service: str, data: dict[str, Any]) -> Any:
        return await self.request("POST", f"/api/services/{quote(domain)}/{quote(service)}",
                                  data)

    async def check_config(self) -> Any:
        return await self.request("POST", "/api/config/core/check_config")


async def read_token(ha: HomeAssistant) -> str:
    """The long-lived token from `token_file`, read on a thread; ActionFailed naming the
    file (never its content) when it cannot be read or is empty."""
    try:
        token = await asyncio.to_thread(read_secret, ha.token_file)
    except OSError as e:
        raise ActionFailed(f"cannot read integrations.home_assistant.token_file "
                           f"({ha.token_file}): {e.strerror or type(e).__name__}") from None
    if not token:
        raise ActionFailed(f"integrations.home_assistant.token_file ({ha.token_file}) is "
                           "empty")
    return token


@asynccontextmanager
async def client_for(ha: HomeAssistant) -> AsyncIterator[HAClient]:
    """A client for one action (or one doctor probe): the token read now, one session."""
    token = await read_token(ha)
    async with HAClient(ha, token) as client:
        yield client


async def probe(ha: HomeAssistant) -> tuple[str, str, str]:
    """(level ok|fail, what, fix) for `mdclaw doctor`: GET /api/ with the token answers
    200 (reachable and authorised), 401 (the token is refused) or nothing."""
    try:
        token = await read_token(ha)
    except ActionFailed as e:
        return "fail", str(e), f"write a long-lived access token into {ha.token_file}"
    try:
        async with HAClient(ha, token) as client:
            body = await client.api_status()
    except HAError as e:
        if e.status == 401:
            return ("fail", f"{ha.url} refused the token (HTTP 401)",
                    "create a long-lived access token (HA: your profile → Security → "
                    f"Long-lived access tokens) and put it into {ha.token_file}")
        return ("fail", str(e), "start Home Assistant or fix integrations.home_assistant.url "
                "(the address this host reaches it at, e.g. http://homeassistant.local:8123)")
    return "ok", f"{ha.url} answers and accepts the token ({body['message']})", ""


# --------------------------------------------------------------------------- params


class _Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


def parse_params(model: type[_Params], params: dict[str, Any], name: str) -> Any:
    """`params` checked against `model`; ActionFailed naming every bad field."""
    try:
        return model.model_validate(params)
    except ValidationError as e:
        parts = []
        for err in e.errors(include_url=False)[:6]:
            where = ".".join(str(p) for p in err["loc"]) or "params"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown parameter"
            elif err["type"] == "missing":
                msg = "required parameter is missing"
            parts.append(f"{where}: {msg}")
        raise ActionFailed(f"{name}: bad params: " + "; ".join(parts)) from None


EntityId = Field(pattern=r"^[a-z0-9_]+\.[a-z0-9_]+$", max_length=255)
Slug = Field(pattern=r"^[a-z0-9_]+$", min_length=1, max_length=64)


class GetStatusParams(_Params):
    entity_ids: list[str] = Field(default_factory=list, alias="entityIds", max_length=200)


class CallServiceParams(_Params):
    domain: str = Slug
    service: str = Slug
    data: dict[str, Any] = Field(default_factory=dict)
    target: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _dotted(cls, v: Any) -> Any:
        # {"service": "light.turn_on"} is the same as {"domain": "light", "service": ...}
        if isinstance(v, dict) and "domain" not in v and isinstance(v.get("service"), str) \
                and "." in v["service"]:
            v = dict(v)
            v["domain"], v["service"] = v["service"].split(".", 1)
        return v


class SetEntityParams(_Params):
    entity_id: str = Field(alias="entityId", pattern=r"^[a-z0-9_]+\.[a-z0-9_]+$",
                           max_length=255)
    state: str | None = Field(None, max_length=255)
    value: str | float | int | bool | None = None
    attributes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _something(self) -> SetEntityParams:
        if self.state is None and self.value is None and not self.attributes:
            raise ValueError("give state, value or attributes")
        return self


class RestartParams(_Params):
    check_config: bool = Field(True, alias="checkConfig")


class DashboardGetParams(_Params):
    dashboard_file: str | None = Field(None, alias="dashboardFile")
    view_path: str | None = Field(None, alias="viewPath", max_length=255)


class DashboardValidateParams(_Params):
    dashboard_file: str | None = Field(None, alias="dashboardFile")
    content: str | None = Field(None, max_length=dash.MAX_FILE_BYTES)
    check_entities: bool = Field(True, alias="checkEntities")

    @model_validator(mode="after")
    def _one(self) -> DashboardValidateParams:
        if self.dashboard_file is not None and self.content is not None:
            raise ValueError("give dashboardFile or content, not both")
        return self


class DashboardPatchParams(_Params):
    dashboard_file: str | None = Field(None, alias="dashboardFile")
    operations: list[dict[str, Any]] = Field(min_length=1, max_length=200)
    dry_run: bool = Field(False, alias="dryRun")


class ApplyDashboardParams(_Params):
    staging_file: str | None = Field(None, alias="stagingFile")
    target_file: str | None = Field(None, alias="targetFile")
    backup: bool = True
    check_entities: bool = Field(True, alias="checkEntities")


class CanvasGetParams(_Params):
    spec_file: str | None = Field(None, alias="specFile")


class CanvasSetParams(_Params):
    spec_file: str | None = Field(None, alias="specFile")
    spec: dict[str, Any]
    title: str | None = Field(None, max_length=255)


class CanvasPatchParams(_Params):
    spec_file: str | None = Field(None, alias="specFile")
    operations: list[dict[str, Any]] = Field(min_length=1, max_length=200)


class ScreenshotParams(_Params):
    dashboard: str = Field("lovelace", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    view: str | None = Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$")
    zoom: float = Field(1.0, ge=0.25, le=4.0)
    width: int = Field(1920, ge=200, le=3840)
    height: int = Field(1080, ge=200, le=2160)
    wait_ms: int = Field(1200, alias="waitMs", ge=0, le=30_000)
    selector: str | None = Field(None, min_length=1, max_length=200)


class FarmStateParams(_Params):
    domains: list[str] = Field(default_factory=list, max_length=50)


# --------------------------------------------------------------------------- helpers


def _fail(e: Exception) -> ActionFailed:
    return ActionFailed(str(e))


def _target_entities(data: dict[str, Any], target: dict[str, Any] | None) -> list[str]:
    """The entity ids a service call targets (data.entity_id and target.entity_id);
    ActionFailed for targets the entity allow-list cannot check (areas, devices, 'all')."""
    ids: list[str] = []
    for where, holder in (("data", data), ("target", target or {})):
        for key in ("area_id", "device_id", "floor_id", "label_id"):
            if key in holder:
                raise ActionFailed(f"{where}.{key} targets are refused: name the entities "
                                   "(entity_id) so the allow-list can check them")
        value = holder.get("entity_id")
        if value is None:
            continue
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ActionFailed(f"{where}.entity_id must be a string or a list of strings")
        for v in values:
            for one in v.split(","):
                one = one.strip()
                if one == "all":
                    raise ActionFailed("entity_id 'all' is refused: name the entities")
                if one:
                    ids.append(one)
    if target:
        extra = set(target) - {"entity_id"}
        if extra:
            raise ActionFailed(f"target has unknown key(s): {', '.join(sorted(extra))}")
    return ids


async def _call(ha: HomeAssistant, domain: str, service: str, data: dict[str, Any],
                target: dict[str, Any] | None) -> dict[str, Any]:
    """Check the allow-lists, then call the service; the result names the rules used."""
    name = f"{domain}.{service}"
    refusal, note = service_rule(ha, name)
    if refusal:
        raise ActionFailed(refusal)
    notes = [note]
    entities = _target_entities(data, target)
    for e in entities:
        refusal, note = entity_rule(ha, e)
        if refusal:
            raise ActionFailed(f"{notes[0]}; {refusal}")
        notes.append(note)
    body = dict(data)
    if target:
        body.update(target)
    try:
        async with client_for(ha) as client:
            changed = await client.call_service(domain, service, body)
    except HAError as e:
        raise _fail(e) from None
    shown = []
    for s in changed if isinstance(changed, list) else []:
        if isinstance(s, dict) and isinstance(s.get("entity_id"), str) \
                and allowed_by(ha.allow.entities, s["entity_id"]):
            shown.append({"entity_id": s["entity_id"], "state": s.get("state")})
    return {"service": name, "entities": entities, "allowedBy": notes, "changed": shown}


# Service for "set this entity to that": (domain -> state -> service).
_ON_OFF = {"on": "turn_on", "off": "turn_off", "toggle": "toggle"}
_STATE_SERVICES: dict[str, dict[str, str]] = {
    **{d: _ON_OFF for d in ("light", "switch", "fan", "input_boolean", "automation", "siren",
                            "humidifier", "media_player", "climate", "water_heater",
                            "remote", "vacuum")},
    "cover": {"open": "open_cover", "opened": "open_cover", "close": "close_cover",
              "closed": "close_cover", "stop": "stop_cover"},
    "valve": {"open": "open_valve", "opened": "open_valve", "close": "close_valve",
              "closed": "close_valve"},
    "lock": {"locked": "lock", "lock": "lock", "unlocked": "unlock", "unlock": "unlock"},
    "scene": {"on": "turn_on"}, "script": {"on": "turn_on", "off": "turn_off"},
    "button": {"press": "press"}, "input_button": {"press": "press"},
}
_VALUE_SERVICES = {"input_number": ("set_value", "value"), "number": ("set_value", "value"),
                   "input_text": ("set_value", "value"), "text": ("set_value", "value"),
                   "input_select": ("select_option", "option"),
                   "select": ("select_option", "option"),
                   "input_datetime": ("set_datetime", "datetime")}


def set_entity_call(p: SetEntityParams) -> tuple[str, str, dict[str, Any]]:
    """(domain, service, data) that sets entity `p.entity_id` as asked: the device is
    changed through its service, never by overwriting HA's state record."""
    domain = p.entity_id.split(".", 1)[0]
    data: dict[str, Any] = {"entity_id": p.entity_id}
    if domain in _VALUE_SERVICES:
        service, key = _VALUE_SERVICES[domain]
        value = p.value if p.value is not None else p.state
        if value is None:
            raise ActionFailed(f"ha_set_entity: {domain} entities need 'value'")
        return domain, service, {**data, key: value}
    if domain == "climate" and p.state is None:
        attrs = dict(p.attributes)
        if p.value is not None:
            attrs.setdefault("temperature", p.value)
        if "hvac_mode" in attrs and len(attrs) == 1:
            return domain, "set_hvac_mode", {**data, **attrs}
        return domain, "set_temperature", {**data, **attrs}
    table = _STATE_SERVICES.get(domain)
    if table is None:
        raise ActionFailed(f"ha_set_entity does not know how to set {domain} entities; use "
                           "ha_call_service")
    state = str(p.state if p.state is not None else p.value).lower()
    found = table.get(state)
    if found is None:
        raise ActionFailed(f"ha_set_entity: state {state!r} is not one of "
                           f"{', '.join(table)} for {domain} entities")
    extra = p.attributes if found == "turn_on" else {}
    return domain, found, {**data, **extra}


def _state_entry(s: dict[str, Any]) -> dict[str, Any]:
    return {"state": s.get("state"), "attributes": s.get("attributes") or {},
            "last_changed": s.get("last_changed"), "last_updated": s.get("last_updated")}


def _dashboards_dir(ha: HomeAssistant) -> Path:
    if ha.dashboards_dir is None:
        raise ActionFailed("no dashboards folder: the operator sets "
                           "integrations.home_assistant.dashboards_dir")
    return ha.dashboards_dir


def _yaml_name(value: str | None, default: str, field: str) -> str:
    try:
        return dash.file_name(value, default, (".yaml", ".yml"), field)
    except dash.DashboardError as e:
        raise _fail(e) from None


def _json_name(value: str | None) -> str:
    try:
        return dash.file_name(value, dash.CANVAS_FILE, (".json",), "specFile")
    except dash.DashboardError as e:
        raise _fail(e) from None


async def _read_dashboard(folder: Path, name: str, *, fallback: str | None = None
                          ) -> tuple[Any, str | None]:
    """(parsed document, the file it came from) of `name`, or of `fallback` when `name`
    does not exist yet; (None, None) when neither exists."""
    for candidate in (name, fallback):
        if candidate is None:
            continue
        try:
            data = await asyncio.to_thread(dash.read_bytes, folder, candidate)
            if data is not None:
                return dash.parse_yaml(data, candidate), candidate
        except (dash.DashboardError, OSError) as e:
            raise _fail(e) from None
    return None, None


async def _write(folder: Path, name: str, data: bytes) -> None:
    try:
        await asyncio.to_thread(dash.atomic_write, folder, name, data)
    except (dash.DashboardError, OSError) as e:
        raise ActionFailed(f"cannot write {name}: {e}") from None


# --------------------------------------------------------------------------- actions

@action("ha_get_status", offloop=True, default_scope="main", max_attempts=2, timeout=60)
async def ha_get_status(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Is Home Assistant up: its API message, version, location, state; the allow-lists;
    the states of the allowed entities named in entityIds."""
    p = parse_params(GetStatusParams, params, "ha_get_status")
    ha = ha_config(ctx.cfg)
    for e in p.entity_ids:
        refusal, _ = entity_rule(ha, e)
        if refusal:
            raise ActionFailed(refusal)
    try:
        async with client_for(ha) as client:
            api = await client.api_status()
            conf = await client.config()
            states = {e: await client.state(e) for e in p.entity_ids}
    except HAError as e:
        raise _fail(e) from None
    return {
        "message": api["message"],
        "version": conf.get("version"), "locationName": conf.get("location_name"),
        "timeZone": conf.get("time_zone"), "state": conf.get("state"),
        "safeMode": conf.get("safe_mode"),
        "components": len(conf.get("components") or []),
        "allow": {"services": list(ha.allow.services), "entities": list(ha.allow.entities)},
        "entities": {e: (_state_entry(s) if s else None) for e, s in states.items()},
    }


@action("ha_call_service", offloop=True, default_scope="main", timeout=60)
async def ha_call_service(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Call domain.service with data/target, if allow.services and allow.entities let it."""
    p = parse_params(CallServiceParams, params, "ha_call_service")
    return await _call(ha_config(ctx.cfg), p.domain, p.service, p.data, p.target)


@action("ha_set_entity", offloop=True, default_scope="main", timeout=60)
async def ha_set_entity(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Set an entity (on/off, open/closed, a value, a temperature) through its service."""
    p = parse_params(SetEntityParams, params, "ha_set_entity")
    domain, service, data = set_entity_call(p)
    result = await _call(ha_config(ctx.cfg), domain, service, data, None)
    result["entity_id"] = p.entity_id
    return result


@action("ha_restart", offloop=True, default_scope="main", timeout=120)
async def ha_restart(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Restart Home Assistant (service homeassistant.restart), after its configuration
    check passes unless checkConfig is false."""
    p = parse_params(RestartParams, params, "ha_restart")
    ha = ha_config(ctx.cfg)
    refusal, note = service_rule(ha, "homeassistant.restart")
    if refusal:
        raise ActionFailed(refusal)
    check: Any = None
    try:
        async with client_for(ha) as client:
            if p.check_config:
                check = await client.check_config()
                if isinstance(check, dict) and check.get("result") != "valid":
                    raise ActionFailed(f"not restarting: Home Assistant's configuration "
                                       f"check says {check.get('result')!r}: "
                                       f"{check.get('errors')}")
            await client.call_service("homeassistant", "restart", {})
    except HAError as e:
        raise _fail(e) from None
    return {"restarting": True, "allowedBy": [note], "checkConfig": check}


@action("ha_dashboard_get", offloop=True, default_scope="main", max_attempts=2, timeout=30)
async def ha_dashboard_get(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """The dashboard YAML file (default the staging one) parsed, or one of its views."""
    p = parse_params(DashboardGetParams, params, "ha_dashboard_get")
    folder = _dashboards_dir(ha_config(ctx.cfg))
    name = _yaml_name(p.dashboard_file, dash.STAGING_FILE, "dashboardFile")
    doc, source = await _read_dashboard(folder, name)
    if source is None:
        raise ActionFailed(f"{name} does not exist in the dashboards folder")
    if p.view_path is None:
        return {"file": name, "dashboard": doc}
    views = doc.get("views") if isinstance(doc, dict) else None
    for i, v in enumerate(views if isinstance(views, list) else []):
        if isinstance(v, dict) and p.view_path in (v.get("path"), v.get("title")):
            return {"file": name, "viewIndex": i, "view": v}
    raise ActionFailed(f"{name} has no view with path {p.view_path!r}")


@action("ha_dashboard_validate", offloop=True, default_scope="main", max_attempts=2, timeout=60)
async def ha_dashboard_validate(ctx: OffloopContext, params: dict[str, Any]
                                ) -> dict[str, Any]:
    """YAML parse, dashboard shape, and (checkEntities) every entity it names exists."""
    p = parse_params(DashboardValidateParams, params, "ha_dashboard_validate")
    ha = ha_config(ctx.cfg)
    errors: list[str] = []
    source: str | None
    if p.content is not None:
        source = None
        try:
            doc = dash.parse_yaml(p.content, "content")
        except dash.DashboardError as e:
            return {"valid": False, "file": None, "errors": [str(e)], "entities": [],
                    "missingEntities": []}
    else:
        name = _yaml_name(p.dashboard_file, dash.STAGING_FILE, "dashboardFile")
        folder = _dashboards_dir(ha)
        try:
            doc, source = await _read_dashboard(folder, name)
        except ActionFailed as e:
            return {"valid": False, "file": name, "errors": [str(e)], "entities": [],
                    "missingEntities": []}
        if source is None:
            raise ActionFailed(f"{name} does not exist in the dashboards folder")
    errors, entities, missing = await dashboard_problems(ha, doc,
                                                         check_entities=p.check_entities)
    return {"valid": not errors, "file": source, "errors": errors, "entities": entities,
            "missingEntities": missing}


async def dashboard_problems(ha: HomeAssistant, doc: Any, *, check_entities: bool
                             ) -> tuple[list[str], list[str], list[str]]:
    """(errors, entities named, entities missing) of a parsed dashboard: its shape, the form
    of every entity id, and (check_entities) that each exists in Home Assistant. The one
    check ha_dashboard_validate reports and ha_apply_dashboard requires."""
    errors = dash.structure_errors(doc)
    entities = dash.referenced_entities(doc)
    errors += dash.entity_format_errors(entities)
    missing: list[str] = []
    well_formed = [e for e in entities if dash.ENTITY_ID.match(e)]
    if check_entities and well_formed:
        try:
            async with client_for(ha) as client:
                known = {s.get("entity_id") for s in await client.states()}
        except HAError as e:
            raise _fail(e) from None
        missing = [e for e in well_formed if e not in known]
        errors += [f"entity {e} does not exist in Home Assistant" for e in missing]
    return errors, entities, missing


@action("ha_dashboard_patch", offloop=True, default_scope="main", timeout=60)
async def ha_dashboard_patch(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Apply view/card/theme operations to a dashboard file (default the staging one, made
    from the live dashboard the first time); dryRun shows the result without writing."""
    p = parse_params(DashboardPatchParams, params, "ha_dashboard_patch")
    folder = _dashboards_dir(ha_config(ctx.cfg))
    name = _yaml_name(p.dashboard_file, dash.STAGING_FILE, "dashboardFile")
    fallback = dash.TARGET_FILE if name == dash.STAGING_FILE else None
    doc, source = await _read_dashboard(folder, name, fallback=fallback)
    try:
        patched, notes = dash.apply_dashboard_ops(doc, p.operations)
    except dash.DashboardError as e:
        raise ActionFailed(f"ha_dashboard_patch: {e}") from None
    if not p.dry_run:
        await _write(folder, name, dash.dump_yaml(patched))
    return {"file": name, "startedFrom": source, "dryRun": p.dry_run,
            "written": not p.dry_run, "changes": notes, "dashboard": patched}


@action("ha_apply_dashboard", offloop=True, default_scope="main", timeout=60)
async def ha_apply_dashboard(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Copy the staging dashboard over the target (default ui-lovelace.yaml), after a
    timestamped backup of the target (unless backup is false). The staging file must pass
    the check ha_dashboard_validate makes (with its checkEntities, default true)."""
    p = parse_params(ApplyDashboardParams, params, "ha_apply_dashboard")
    ha = ha_config(ctx.cfg)
    folder = _dashboards_dir(ha)
    staging = _yaml_name(p.staging_file, dash.STAGING_FILE, "stagingFile")
    target = _yaml_name(p.target_file, dash.TARGET_FILE, "targetFile")
    if staging == target:
        raise ActionFailed("stagingFile and targetFile are the same file")
    try:
        data = await asyncio.to_thread(dash.read_bytes, folder, staging)
        if data is None:
            raise ActionFailed(f"{staging} does not exist in the dashboards folder")
        doc = dash.parse_yaml(data, staging)
    except (dash.DashboardError, OSError) as e:
        raise _fail(e) from None
    problems, _entities, _missing = await dashboard_problems(ha, doc,
                                                             check_entities=p.check_entities)
    if problems:
        raise ActionFailed(f"{staging} is not a valid dashboard: {'; '.join(problems)}")
    backup_path = None
    if p.backup:
        try:
            backup_path = await asyncio.to_thread(dash.backup, folder, target)
        except (dash.DashboardError, OSError) as e:
            raise ActionFailed(f"cannot back up {target}, nothing applied: {e}") from None
    await _write(folder, target, data)
    log.info("dashboard %s applied to %s (backup %s)", staging, target, backup_path)
    return {"staging": staging, "target": target, "backup": backup_path, "bytes": len(data)}


async def _read_canvas(folder: Path, name: str) -> dict[str, Any] | None:
    try:
        data = await asyncio.to_thread(dash.read_bytes, folder, name)
        return None if data is None else dash.parse_canvas(data, name)
    except (dash.DashboardError, OSError) as e:
        raise _fail(e) from None


async def _write_canvas(folder: Path, name: str, spec: dict[str, Any]) -> None:
    await _write(folder, name, json.dumps(spec, indent=2, ensure_ascii=False).encode() + b"\n")


@action("ha_canvas_get_spec", offloop=True, default_scope="main", max_attempts=2, timeout=30)
async def ha_canvas_get_spec(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """The canvas spec (JSON) in the dashboards folder, or exists: false."""
    p = parse_params(CanvasGetParams, params, "ha_canvas_get_spec")
    folder = _dashboards_dir(ha_config(ctx.cfg))
    name = _json_name(p.spec_file)
    spec = await _read_canvas(folder, name)
    return {"file": name, "exists": spec is not None, "spec": spec}


@action("ha_canvas_set_spec", offloop=True, default_scope="main", timeout=30)
async def ha_canvas_set_spec(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Replace the canvas spec (title, if given, is set on it)."""
    p = parse_params(CanvasSetParams, params, "ha_canvas_set_spec")
    folder = _dashboards_dir(ha_config(ctx.cfg))
    name = _json_name(p.spec_file)
    spec = dict(p.spec)
    if p.title is not None:
        spec["title"] = p.title
    try:
        dash.check_canvas(spec)
    except dash.DashboardError as e:
        raise ActionFailed(f"ha_canvas_set_spec: {e}") from None
    await _write_canvas(folder, name, spec)
    return {"file": name, "spec": spec}


@action("ha_canvas_patch_spec", offloop=True, default_scope="main", timeout=30)
async def ha_canvas_patch_spec(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """add_card/update_card/remove_card/move_card/set_layout/set_title on the canvas spec."""
    p = parse_params(CanvasPatchParams, params, "ha_canvas_patch_spec")
    folder = _dashboards_dir(ha_config(ctx.cfg))
    name = _json_name(p.spec_file)
    spec = await _read_canvas(folder, name) or {"cards": []}
    try:
        patched, notes = dash.apply_canvas_ops(spec, p.operations)
    except dash.DashboardError as e:
        raise ActionFailed(f"ha_canvas_patch_spec: {e}") from None
    await _write_canvas(folder, name, patched)
    return {"file": name, "changes": notes, "spec": patched}


def _save_screenshot(layout: Layout, folder: str, name: str, png: bytes) -> str:
    return agentfs.write_new_file(layout.groups_dir, (folder, SCREENSHOT_DIR), name, png,
                                  SCREENSHOT_MAX_BYTES, mode=SCREENSHOT_MODE,
                                  dir_mode=GROUP_DIR_MODE)


@action("ha_capture_screenshot", offloop=True, default_scope="main", timeout=120)
async def ha_capture_screenshot(ctx: OffloopContext, params: dict[str, Any]
                                ) -> dict[str, Any]:
    """A PNG of a dashboard (url/<dashboard>/<view>) by headless Chromium on the host,
    saved in the group's screenshots/ folder; the result is its path in the container."""
    p = parse_params(ScreenshotParams, params, "ha_capture_screenshot")
    ha = ha_config(ctx.cfg)
    path = f"/{p.dashboard}" + (f"/{p.view}" if p.view else "")
    url = ha.url + path
    client = HAClient(ha, await read_token(ha))  # for its token and redact(): no HTTP call
    try:
        binary = ha_screenshot.find_chromium(ha.chromium)
        shot = await ha_screenshot.capture(
            url, client.token, chromium=binary, width=p.width, height=p.height,
            zoom=p.zoom, wait_ms=p.wait_ms, selector=p.selector, timeout=90)
    except ha_screenshot.ScreenshotError as e:
        raise ActionFailed(f"ha_capture_screenshot: {client.redact(str(e))}") from None
    stamp = utc_now().strftime("%Y%m%dT%H%M%SZ")
    name = f"ha-{p.dashboard}{'-' + p.view if p.view else ''}-{stamp}.png"
    try:
        saved = await asyncio.to_thread(_save_screenshot, ctx.layout, ctx.caller.folder, name,
                                        shot.png)
    except (UnsafePath, OSError) as e:
        raise ActionFailed(f"cannot save the screenshot in the group folder: {e}") from None
    return {"path": f"/workspace/group/{SCREENSHOT_DIR}/{saved}", "url": url,
            "width": shot.width, "height": shot.height, "bytes": len(shot.png)}


@action("farm_state_refresh", offloop=True, default_scope="main", max_attempts=2, timeout=60)
async def farm_state_refresh(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of the states of every entity allow.entities lets agents see (optionally
    only those of some domains)."""
    p = parse_params(FarmStateParams, params, "farm_state_refresh")
    ha = ha_config(ctx.cfg)
    if not ha.allow.entities:
        raise ActionFailed("no entity is in integrations.home_assistant.allow.entities "
                           "(empty: agents see none)")
    try:
        async with client_for(ha) as client:
            states = await client.states()
    except HAError as e:
        raise _fail(e) from None
    entities = {}
    for s in states:
        eid = s.get("entity_id")
        if not isinstance(eid, str) or not allowed_by(ha.allow.entities, eid):
            continue
        if p.domains and eid.split(".", 1)[0] not in p.domains:
            continue
        entities[eid] = _state_entry(s)
    return {"refreshedAt": to_iso(utc_now()), "count": len(entities), "entities": entities}


ACTION_NAMES: tuple[str, ...] = (
    "ha_get_status", "ha_call_service", "ha_set_entity", "ha_restart", "ha_dashboard_get",
    "ha_dashboard_validate", "ha_dashboard_patch", "ha_apply_dashboard", "ha_canvas_get_spec",
    "ha_canvas_set_spec", "ha_canvas_patch_spec", "ha_capture_screenshot",
    "farm_state_refresh")
