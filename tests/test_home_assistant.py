"""The Home Assistant actions against a fake Home Assistant (a real aiohttp server), driven
through the real IPC engine and action worker: action files in, result files out."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestServer

from fake_home_assistant import FakeHomeAssistant, state
from ipc_helpers import Env
from mdclaw.integrations import load_all
from mdclaw.integrations.home_assistant import (
    ACTION_NAMES,
    CONNECTIONS,
    HAClient,
    probe,
)
from mdclaw.ipc.actions import ACTIONS, action_refusal
from test_action_worker import Running, request, result
from waiting import wait_until_async

TOKEN = "hatoken-7f3a9c2e-long-lived-SECRET"

load_all()


def ha_config(url: str, tmp_path: Path, *, services: list[str], entities: list[str],
              token: str = TOKEN) -> str:
    token_file = tmp_path / "ha-token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    dash = tmp_path / "dashboards"
    dash.mkdir(exist_ok=True)
    return (f"integrations:\n  home_assistant:\n    url: {url}\n"
            f"    token_file: {token_file}\n    dashboards_dir: {dash}\n"
            f"    timeout: 5s\n    allow:\n      services: {json.dumps(services)}\n"
            f"      entities: {json.dumps(entities)}\n")


class Harness:
    def __init__(self, env: Env, fake: FakeHomeAssistant, dash: Path) -> None:
        self.env, self.fake, self.dash = env, fake, dash
        self.n = 0

    async def ask(self, group: str, name: str, **params: Any) -> dict[str, Any]:
        self.n += 1
        rid = f"r{self.n}"
        body = request(rid, name, **params)
        body["type"] = "farm_action"
        self.env.write(group, body, sub="actions")
        r = await wait_until_async(lambda: result(self.env, group, rid), timeout=60)
        assert r["requestId"] == rid and r["executedAt"]
        return r  # type: ignore[no-any-return]


@asynccontextmanager
async def harness(tmp_path: Path, *, services: list[str] | None = None,
                  entities: list[str] | None = None, family: str = "",
                  token: str = TOKEN) -> AsyncIterator[Harness]:
    fake = FakeHomeAssistant(TOKEN)
    server = TestServer(fake.app())
    await server.start_server()
    try:
        url = str(server.make_url("")).rstrip("/")
        extra = ha_config(url, tmp_path, token=token,
                          services=["light.*", "switch.turn_on", "climate.set_temperature"]
                          if services is None else services,
                          entities=["light.*", "sensor.soil_*", "climate.greenhouse",
                                    "switch.pump"] if entities is None else entities)
        env = Env(tmp_path, extra=extra, family=family)
        try:
            async with Running(env):
                yield Harness(env, fake, tmp_path / "dashboards")
        finally:
            env.close()
    finally:
        await server.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_token_nowhere(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """The token is in no file under data_dir (ipc/, results, errors, state.db) and in no
    log record."""
    for p in env.data.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert TOKEN.encode() not in p.read_bytes(), p
    assert TOKEN not in caplog.text


# --------------------------------------------------------------------------- actions


def test_status_call_set_and_refusals(tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> None:
        async with harness(tmp_path) as h:
            r = await h.ask("main", "ha_get_status", entityIds=["light.kitchen"])
            assert r["status"] == "success", r
            assert r["result"]["message"] == "API running."
            assert r["result"]["version"] == "2026.3.0"
            assert r["result"]["entities"]["light.kitchen"]["state"] == "off"

            r = await h.ask("main", "ha_call_service", domain="light", service="turn_on",
                            target={"entity_id": "light.kitchen"}, data={"brightness": 120})
            assert r["status"] == "success", r
            assert r["result"]["allowedBy"] == ["service light.turn_on allowed by 'light.*'",
                                                "entity light.kitchen allowed by 'light.*'"]
            assert ("light", "turn_on", {"brightness": 120, "entity_id": "light.kitchen"}) \
                in h.fake.calls
            assert h.fake.states["light.kitchen"]["state"] == "on"

            # A service outside allow.services, named with the rule that refused it.
            n = len(h.fake.calls)
            r = await h.ask("main", "ha_call_service", service="switch.turn_off",
                            target={"entity_id": "switch.pump"})
            assert r["status"] == "error"
            assert r["error"] == ("service switch.turn_off is not in integrations."
                                  "home_assistant.allow.services [light.*, switch.turn_on, "
                                  "climate.set_temperature]")
            # An allowed service on an entity outside allow.entities.
            r = await h.ask("main", "ha_call_service", service="light.turn_on",
                            data={"entity_id": ["light.kitchen", "sensor.secret_camera_battery"]})
            assert r["status"] == "error"
            assert r["error"].startswith("service light.turn_on allowed by 'light.*'; entity "
                                         "sensor.secret_camera_battery is not in")
            r = await h.ask("main", "ha_call_service", service="light.turn_on",
                            target={"area_id": "kitchen"})
            assert r["status"] == "error" and "area_id targets are refused" in r["error"]
            assert len(h.fake.calls) == n  # nothing refused reached Home Assistant

            r = await h.ask("main", "ha_set_entity", entity_id="light.greenhouse", state="off")
            assert r["status"] == "success", r
            assert h.fake.states["light.greenhouse"]["state"] == "off"
            r = await h.ask("main", "ha_set_entity", entity_id="climate.greenhouse",
                            attributes={"temperature": 21})
            assert r["status"] == "success", r
            assert h.fake.calls[-1] == ("climate", "set_temperature",
                                        {"entity_id": "climate.greenhouse", "temperature": 21})
            r = await h.ask("main", "ha_set_entity", entity_id="switch.pump", state="off")
            assert r["status"] == "error" and "switch.turn_off is not in" in r["error"]

            # Params are checked field by field.
            r = await h.ask("main", "ha_call_service", domain="Light!", bogus=1)
            assert r["status"] == "error"
            assert "domain: String should match pattern" in r["error"]
            assert "service: required parameter is missing" in r["error"]
            assert "bogus: unknown parameter" in r["error"]
            r = await h.ask("main", "ha_set_entity", entity_id="light.kitchen")
            assert r["status"] == "error" and "give state, value or attributes" in r["error"]

            r = await h.ask("main", "farm_state_refresh")
            assert r["status"] == "success", r
            assert set(r["result"]["entities"]) == {
                "light.kitchen", "light.greenhouse", "sensor.soil_moisture",
                "climate.greenhouse", "switch.pump"}
            assert r["result"]["count"] == 5

            # Not the main group: refused by the per-group rule (default main only).
            r = await h.ask("family", "ha_get_status")
            assert r["status"] == "error"
            assert "allowed only for the main group by default" in r["error"]
            assert_token_nowhere(h.env, caplog)
    run(go())


def test_one_action_uses_one_connection_for_all_its_calls(tmp_path: Path) -> None:
    """ha_get_status with 200 entityIds makes 202 calls (/api/, /api/config, one state each):
    they share one kept-alive connection, counted by the fake server from the client ports
    its requests arrived on; the next action opens its own."""
    async def go() -> None:
        async with harness(tmp_path) as h:
            ids = [f"light.bulb_{n:03d}" for n in range(200)]
            for e in ids:
                h.fake.states[e] = state(e, "on")
            r = await h.ask("main", "ha_get_status", entityIds=ids)
            assert r["status"] == "success", r
            assert [e for e, v in r["result"]["entities"].items() if v["state"] == "on"] == ids
            calls = [q for q in h.fake.requests if q[1].startswith("/api/")]
            assert len(calls) == 202
            assert 1 <= len(h.fake.connections) <= CONNECTIONS
            first = set(h.fake.connections)
            r = await h.ask("main", "farm_state_refresh")
            assert r["status"] == "success", r
            assert 1 <= len(h.fake.connections - first) <= CONNECTIONS
    run(go())


def test_per_group_actions_allow_another_group(tmp_path: Path) -> None:
    async def go() -> None:
        async with harness(tmp_path, family="    actions: ['ha_get_status', "
                                            "'farm_state_refresh']\n") as h:
            assert (await h.ask("family", "ha_get_status"))["status"] == "success"
            assert (await h.ask("family", "farm_state_refresh"))["status"] == "success"
            r = await h.ask("family", "ha_call_service", service="light.turn_on",
                            target={"entity_id": "light.kitchen"})
            assert r["status"] == "error" and "groups.family.actions" in r["error"]
            assert not h.fake.calls
    run(go())


def test_default_is_read_only(tmp_path: Path) -> None:
    async def go() -> None:
        async with harness(tmp_path, services=[], entities=[]) as h:
            assert (await h.ask("main", "ha_get_status"))["status"] == "success"
            r = await h.ask("main", "ha_set_entity", entity_id="light.kitchen", state="on")
            assert r["error"] == ("service light.turn_on is not in integrations.home_assistant"
                                  ".allow.services [] (empty: read-only)")
            r = await h.ask("main", "ha_restart")
            assert r["status"] == "error"
            assert "service homeassistant.restart is not in" in r["error"]
            r = await h.ask("main", "farm_state_refresh")
            assert r["status"] == "error" and "allow.entities" in r["error"]
            assert not h.fake.calls and h.fake.restarts == 0
    run(go())


def test_restart_checks_config_first(tmp_path: Path) -> None:
    async def go() -> None:
        async with harness(tmp_path, services=["homeassistant.restart"]) as h:
            h.fake.check_result = "invalid"
            r = await h.ask("main", "ha_restart")
            assert r["status"] == "error" and "configuration check says 'invalid'" in r["error"]
            assert h.fake.restarts == 0
            h.fake.check_result = "valid"
            r = await h.ask("main", "ha_restart")
            assert r["status"] == "success", r
            assert r["result"]["allowedBy"] == [
                "service homeassistant.restart allowed by 'homeassistant.restart'"]
            assert h.fake.restarts == 1
            assert ("POST", "/api/config/core/check_config", 200) in h.fake.requests
    run(go())


def test_bad_token_is_a_clear_error_and_never_leaks(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = "wrong-token-0123456789"

    async def go() -> None:
        async with harness(tmp_path, token=wrong) as h:
            r = await h.ask("main", "ha_get_status")
            assert r["status"] == "error"
            assert "refused the token (HTTP 401)" in r["error"]
            assert ("GET", "/api/", 401) in h.fake.requests
            for p in h.env.data.rglob("*"):
                if p.is_file():
                    assert wrong.encode() not in p.read_bytes(), p
            assert wrong not in caplog.text
            ha = h.env.cfg.integrations.home_assistant
            assert ha is not None
            level, detail, fix = await probe(ha)
            assert level == "fail" and "HTTP 401" in detail and "Long-lived" in fix
    run(go())


def test_unreachable_home_assistant(tmp_path: Path) -> None:
    async def go() -> None:
        async with harness(tmp_path) as h:
            ha = h.env.cfg.integrations.home_assistant
            assert ha is not None
            client = HAClient(ha.model_copy(update={"url": "http://127.0.0.1:9"}), TOKEN)
            with pytest.raises(Exception, match="cannot reach Home Assistant") as e:
                async with client:
                    await client.api_status()
            assert TOKEN not in str(e.value)
    run(go())


def test_every_action_is_registered_main_only_by_default(tmp_path: Path) -> None:
    env = Env(tmp_path)
    try:
        for name in ACTION_NAMES:
            assert ACTIONS[name].offloop, name
            assert action_refusal(env.cfg, "main", True, name) is None
            assert action_refusal(env.cfg, "family", False, name) is not None
    finally:
        env.close()


def test_not_configured(tmp_path: Path) -> None:
    async def go() -> None:
        env = Env(tmp_path)
        try:
            async with Running(env):
                h = Harness(env, FakeHomeAssistant(TOKEN), tmp_path)
                r = await h.ask("main", "ha_get_status")
                assert r["status"] == "error"
                assert "integrations.home_assistant" in r["error"]
        finally:
            env.close()
    run(go())


# --------------------------------------------------------------------------- dashboards

LIVE = """\
title: Farm
views:
  - title: Greenhouse
    path: greenhouse
    cards:
      - type: entities
        entities:
          - light.greenhouse
          - entity: sensor.soil_moisture
            name: Soil
  - title: Pumps
    path: pumps
    cards:
      - type: button
        entity: switch.pump
"""


def test_dashboard_patch_validate_apply_round_trip(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def go() -> None:
        async with harness(tmp_path) as h:
            target = h.dash / "ui-lovelace.yaml"
            target.write_text(LIVE)
            staging = h.dash / "ui-lovelace-staging.yaml"
            ops = [{"op": "add_card", "view": "greenhouse",
                    "card": {"type": "thermostat", "entity": "climate.greenhouse"}},
                   {"op": "move_view", "view": "pumps", "index": 0},
                   {"op": "set_theme", "theme": "green"},
                   {"op": "update_view", "view": "greenhouse", "changes": {"icon": "mdi:leaf"}}]
            r = await h.ask("main", "ha_dashboard_patch", operations=ops, dryRun=True)
            assert r["status"] == "success", r
            assert r["result"]["written"] is False and not staging.exists()
            r = await h.ask("main", "ha_dashboard_patch", operations=ops)
            assert r["status"] == "success", r
            assert r["result"]["startedFrom"] == "ui-lovelace.yaml"
            doc = yaml.safe_load(staging.read_text())
            assert [v["path"] for v in doc["views"]] == ["pumps", "greenhouse"]
            assert doc["views"][1]["cards"][-1] == {"type": "thermostat",
                                                    "entity": "climate.greenhouse"}
            assert {v["theme"] for v in doc["views"]} == {"green"}
            assert target.read_text() == LIVE  # the live dashboard is untouched so far

            r = await h.ask("main", "ha_dashboard_get", viewPath="greenhouse")
            assert r["result"]["view"]["icon"] == "mdi:leaf"

            r = await h.ask("main", "ha_dashboard_validate")
            assert r["result"]["valid"] is True, r
            assert "climate.greenhouse" in r["result"]["entities"]
            r = await h.ask("main", "ha_dashboard_validate",
                            content="views:\n  - cards:\n      - type: button\n"
                                    "        entity: light.nowhere\n")
            assert r["result"]["valid"] is False
            assert r["result"]["missingEntities"] == ["light.nowhere"]
            r = await h.ask("main", "ha_dashboard_validate", content="views: [\n")
            assert r["result"]["valid"] is False and "not valid YAML" in r["result"]["errors"][0]
            r = await h.ask("main", "ha_dashboard_validate",
                            content="views: !include views.yaml\n")
            assert "no !include" in r["result"]["errors"][0]

            r = await h.ask("main", "ha_apply_dashboard", stagingFile="ui-lovelace-staging.yaml")
            assert r["status"] == "success", r
            backup = h.dash / r["result"]["backup"]
            assert backup.read_text() == LIVE and backup.parent.name == "backups"
            assert target.read_text() == staging.read_text()
            assert not [p for p in h.dash.rglob("*.tmp")]

            # Refusals: names that are paths, ops that cannot apply.
            r = await h.ask("main", "ha_dashboard_get", dashboardFile="../etc/passwd.yaml")
            assert r["status"] == "error" and "plain file name" in r["error"]
            r = await h.ask("main", "ha_dashboard_patch",
                            operations=[{"op": "remove_card", "view": "nope", "card": 0}])
            assert r["status"] == "error" and "no view with path or title 'nope'" in r["error"]
            r = await h.ask("main", "ha_dashboard_patch", operations=[{"op": "explode"}])
            assert r["status"] == "error" and "op must be one of" in r["error"]
            r = await h.ask("main", "ha_apply_dashboard", stagingFile="missing.yaml")
            assert r["status"] == "error" and "does not exist" in r["error"]
            r = await h.ask("family", "ha_dashboard_patch", operations=ops)
            assert r["status"] == "error" and "main group" in r["error"]
            assert_token_nowhere(h.env, caplog)
    run(go())


def test_canvas_spec_set_patch_get(tmp_path: Path) -> None:
    async def go() -> None:
        async with harness(tmp_path) as h:
            r = await h.ask("main", "ha_canvas_get_spec")
            assert r["result"] == {"file": "canvas-spec.json", "exists": False, "spec": None}
            r = await h.ask("main", "ha_canvas_set_spec", title="Farm",
                            spec={"cards": [{"id": "a", "entity": "light.kitchen"}]})
            assert r["status"] == "success", r
            r = await h.ask("main", "ha_canvas_patch_spec", operations=[
                {"op": "add_card", "card": {"id": "b"}, "index": 0},
                {"op": "update_card", "id": "a", "changes": {"x": 3}},
                {"op": "move_card", "id": "a", "index": 0},
                {"op": "set_layout", "layout": {"columns": 2}},
                {"op": "set_title", "title": "Farm 2"}])
            assert r["status"] == "success", r
            spec = json.loads((h.dash / "canvas-spec.json").read_text())
            assert spec == {"cards": [{"id": "a", "entity": "light.kitchen", "x": 3},
                                      {"id": "b"}], "title": "Farm 2",
                            "layout": {"columns": 2}}
            assert (await h.ask("main", "ha_canvas_get_spec"))["result"]["spec"] == spec
            r = await h.ask("main", "ha_canvas_patch_spec",
                            operations=[{"op": "add_card", "card": {"id": "a"}}])
            assert r["status"] == "error" and "used twice" in r["error"]
            r = await h.ask("main", "ha_canvas_set_spec", spec={"cards": [{"x": 1}]})
            assert r["status"] == "error" and "string 'id'" in r["error"]
            r = await h.ask("main", "ha_canvas_set_spec", specFile="a/b.json", spec={})
            assert r["status"] == "error" and "plain file name" in r["error"]
    run(go())


# --------------------------------------------------------------------------- screenshot


def png_pixels(data: bytes) -> tuple[int, int, set[bytes]]:
    """(width, height, distinct RGB(A) pixels) of an 8-bit RGB/RGBA PNG, decoded here."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, ctype = 8, b"", 0, 0, 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and ctype in (2, 6)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw = zlib.decompress(idat)
    bpp = 4 if ctype == 6 else 3
    stride = width * bpp
    prev = bytearray(stride)
    colours: set[bytes] = set()
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) \
                    & 255
        if y % 8 == 0:
            colours.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp * 8))
        prev = line
    return width, height, colours


def test_screenshot_of_a_logged_in_page(tmp_path: Path,
                                        caplog: pytest.LogCaptureFixture) -> None:
    from test_chat_page_browser import chromium

    chromium()  # skips (or fails on CI) without a browser
    caplog.set_level(logging.DEBUG)

    async def go() -> None:
        async with harness(tmp_path) as h:
            r = await h.ask("main", "ha_capture_screenshot", dashboard="lovelace",
                            view="farm", width=800, height=600, waitMs=0,
                            selector="body[data-ready] #root")
            assert r["status"] == "success", r
            path = r["result"]["path"]
            assert path.startswith("/workspace/group/screenshots/ha-lovelace-farm-")
            host = h.env.data / "groups" / "main" / path.removeprefix("/workspace/group/")
            png = host.read_bytes()
            width, height, colours = png_pixels(png)
            assert (width, height) == (r["result"]["width"], r["result"]["height"])
            assert width > 100 and height > 100
            # The page drew its cards only because it was logged in with the token: the
            # picture has the "on" and "off" card colours, not just a white page.
            assert b"\xf4\xb4\x00" in colours and b"\x26\x32\x38" in colours, colours
            assert ("GET", "/api/states", 200) in h.fake.requests
            r = await h.ask("main", "ha_capture_screenshot", dashboard="../etc")
            assert r["status"] == "error" and "dashboard" in r["error"]
            assert_token_nowhere(h.env, caplog)
    run(go())


# --------------------------------------------------------------------------- config


def test_config_refuses_a_dashboards_dir_in_a_container_tree(tmp_path: Path) -> None:
    from mdclaw.config import ConfigError

    extra = ha_config("http://ha.local:8123", tmp_path, services=[], entities=[])
    extra = extra.replace(str(tmp_path / "dashboards"), str(tmp_path / "data/groups/main/d"))
    with pytest.raises(ConfigError, match="overlaps data_dir/groups"):
        Env(tmp_path, extra=extra)
    bad = ha_config("ftp://ha.local", tmp_path, services=["light turn on"], entities=[])
    with pytest.raises(ConfigError) as e:
        Env(tmp_path, extra=bad)
    text = str(e.value)
    assert "integrations.home_assistant.url" in text
    assert "integrations.home_assistant.allow.services" in text
    assert TOKEN not in text


def test_doctor_checks_url_and_token(cli: Any, write_config: Any, tmp_path: Path) -> None:
    """`mdclaw doctor` against the fake: the right token is ok, a wrong one fails with the
    fix, an unreachable URL fails with its own fix; the token is in no output."""
    import threading

    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(FakeHomeAssistant(TOKEN).app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        for token, url, level, words in (
                (TOKEN, f"http://127.0.0.1:{port}", "ok", "accepts the token"),
                ("not-the-token-123", f"http://127.0.0.1:{port}", "fail", "HTTP 401"),
                (TOKEN, "http://127.0.0.1:9", "fail", "cannot reach")):
            extra = ha_config(url, tmp_path, services=[], entities=[], token=token)
            cfg = str(write_config("data_dir: {data_dir}\ngroups:\n  main: {name: A, jid: "
                                   "\"hl:main\", main: true}\n" + extra))
            r = cli("doctor", "--json", "--config", cfg)
            check = {c["check"]: c for c in json.loads(r.stdout)}["home assistant"]
            assert check["level"] == level and words in check["detail"], check
            assert level == "ok" or check["fix"]
            assert token not in r.stdout + r.stderr
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_container_is_told_the_groups_actions(tmp_path: Path) -> None:
    from mdclaw.runner import allowed_actions

    env = Env(tmp_path, family="    actions: ['ha_get_status', 'web_*']\n")
    try:
        main = allowed_actions(env.cfg, "main", True)
        assert set(ACTION_NAMES) <= set(main)
        family = allowed_actions(env.cfg, "family", False)
        assert "ha_get_status" in family and "ha_call_service" not in family
        assert "memory_search" in family
        work = allowed_actions(env.cfg, "work", False)
        assert not [a for a in work if a.startswith("ha_")]
    finally:
        env.close()


# --------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize("entity_id,ok", [
    ("light.kitchen", True), ("sensor.soil_moisture", True), ("climate.greenhouse_2", True),
    ("light.x/../sensor.secret", False), ("light.x%2F..%2Fsensor.secret", False),
    ("Light.Kitchen", False), ("light.", False), (".kitchen", False), ("light", False),
    ("light._kitchen", False), ("light.kitchen_", False), ("light.kit__chen", False),
    ("light.kitchen.extra", False), ("light.kitchen ", False), ("light.küche", False),
    ("light.kitchen\n", False), ("light.*", False),
])
def test_entity_form_is_home_assistants(entity_id: str, ok: bool) -> None:
    from mdclaw.integrations.home_assistant import entity_form_refusal

    refusal = entity_form_refusal(entity_id)
    assert (refusal is None) is ok, (entity_id, refusal)
    if not ok:
        assert "is not an entity id" in refusal and "domain.object_id" in refusal


def test_an_entity_id_with_a_path_is_refused_before_any_rule_or_request(tmp_path: Path) -> None:
    """`light.*` would match `light.x/../sensor.secret_camera_battery`: the id's form is
    checked first, and nothing about it reaches Home Assistant."""
    sneaky = "light.x/../sensor.secret_camera_battery"

    async def go() -> None:
        async with harness(tmp_path, services=["light.*"], entities=["light.*"]) as h:
            before_requests, before_calls = len(h.fake.requests), len(h.fake.calls)
            r = await h.ask("main", "ha_get_status", entityIds=[sneaky])
            assert r["status"] == "error"
            assert "is not an entity id" in r["error"] and "allowed by" not in r["error"]
            r = await h.ask("main", "ha_call_service", service="light.turn_on",
                            target={"entity_id": [sneaky]})
            assert r["status"] == "error" and "is not an entity id" in r["error"], r
            r = await h.ask("main", "ha_call_service", service="light.turn_on",
                            data={"entity_id": "light.kitchen,light.x/../sensor.secret"})
            assert r["status"] == "error" and "is not an entity id" in r["error"], r
            assert len(h.fake.calls) == before_calls
            assert len(h.fake.requests) == before_requests  # not one request was made
            # The refusal of an entity outside the list names the real key.
            r = await h.ask("main", "ha_get_status", entityIds=["sensor.soil_moisture"])
            assert r["status"] == "error"
            assert "integrations.home_assistant.allow.entities [light.*]" in r["error"]
            assert "entitys" not in r["error"]
    run(go())


def test_an_html_answer_is_an_error_naming_what_came_back(tmp_path: Path) -> None:
    """A login page answered with 200 is not a working Home Assistant with every field
    null: the action fails and says what answered, and doctor's probe fails too."""

    async def go() -> None:
        async with harness(tmp_path) as h:
            h.fake.login_page = True
            r = await h.ask("main", "ha_get_status")
            assert r["status"] == "error", r
            assert "HTTP 200 and text/html" in r["error"]
            assert "not Home Assistant's JSON" in r["error"] and "Sign in" in r["error"]
            r = await h.ask("main", "farm_state_refresh")
            assert r["status"] == "error" and "text/html" in r["error"], r
            ha = h.env.cfg.integrations.home_assistant
            assert ha is not None
            level, what, _fix = await probe(ha)
            assert level == "fail" and "text/html" in what
    run(go())


def test_apply_refuses_what_validate_calls_invalid(tmp_path: Path) -> None:
    async def go() -> None:
        async with harness(tmp_path) as h:
            target = h.dash / "ui-lovelace.yaml"
            target.write_text(LIVE)
            staging = h.dash / "ui-lovelace-staging.yaml"
            staging.write_text("views:\n  - path: x\n    cards:\n      - type: button\n"
                               "        entity: 'not an id!'\n")
            r = await h.ask("main", "ha_dashboard_validate")
            assert r["result"]["valid"] is False
            r = await h.ask("main", "ha_apply_dashboard")
            assert r["status"] == "error", r
            assert "not a valid dashboard" in r["error"] and "'not an id!'" in r["error"]
            assert target.read_text() == LIVE and not (h.dash / "backups").exists()

            # An entity Home Assistant does not have: validate and apply agree again.
            staging.write_text("views:\n  - path: x\n    cards:\n      - type: button\n"
                               "        entity: light.nowhere\n")
            r = await h.ask("main", "ha_dashboard_validate")
            assert r["result"]["missingEntities"] == ["light.nowhere"]
            r = await h.ask("main", "ha_apply_dashboard")
            assert r["status"] == "error" and "light.nowhere does not exist" in r["error"]
            assert target.read_text() == LIVE
            r = await h.ask("main", "ha_dashboard_validate", checkEntities=False)
            assert r["result"]["valid"] is True
            r = await h.ask("main", "ha_apply_dashboard", checkEntities=False)
            assert r["status"] == "success", r
            assert target.read_text() == staging.read_text()
    run(go())
