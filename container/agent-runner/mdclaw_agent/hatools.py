"""The Home Assistant tools: one per host action (ha_*, farm_state_refresh). Each asks the
host for its action and shows the result; the host holds the token, checks the operator's
allow-lists and says which rule refused a call.

Which groups get them: by default only the main group (they are main_only); the host lists
the actions this group may call in MDCLAW_ACTIONS (from `groups.<g>.actions`), and a tool is
given exactly when its action is on that list.
"""

from __future__ import annotations

import json
from typing import Any

from mdclaw_agent.toolbase import Tool, ToolContext, action_result, request_action
from mdclaw_agent.toolbase import schema as _schema
from mdclaw_agent.toolbase import string as _s

# ha_capture_screenshot may take two minutes on the host; the others far less.
HA_TIMEOUT = 150.0
MAX_REPLY = 60_000

_OBJ = {"type": "object"}
_OPS = {"type": "array", "items": _OBJ, "minItems": 1, "maxItems": 200}
_FILE = "File name in the operator's dashboards folder (default: the staging dashboard " \
        "ui-lovelace-staging.yaml)."
_BOOL = {"type": "boolean"}


def _ask(name: str) -> Any:
    def handler(ctx: ToolContext, args: dict[str, Any]) -> str:
        env = request_action(ctx, {"action": name, "params": args},
                             timeout=max(ctx.web_timeout, HA_TIMEOUT))
        text = json.dumps(action_result(env, name), ensure_ascii=False, indent=1)
        if len(text) > MAX_REPLY:
            text = text[:MAX_REPLY] + "\n[cut: the result is longer]"
        return text
    return handler


def _tool(name: str, description: str, params: dict[str, Any]) -> Tool:
    return Tool(name, description, params, _ask(name), main_only=True, action=name)


HA_TOOLS: tuple[Tool, ...] = (
    _tool("ha_get_status", "Home Assistant's status (version, state, location), the "
          "operator's allow-lists, and the states of allowed entities you name.",
          _schema([], entityIds={"type": "array", "items": {"type": "string"},
                                 "maxItems": 200,
                                 "description": "Entity ids whose state to include."})),
    _tool("ha_call_service", "Call a Home Assistant service (e.g. light.turn_on) on entities; "
          "only services and entities the operator allows.",
          _schema(["domain", "service"], domain=_s("Service domain, e.g. light."),
                  service=_s("Service name, e.g. turn_on."),
                  data={"type": "object", "description": "Service data, e.g. "
                                                         "{\"brightness\": 120}."},
                  target={"type": "object", "description": "{\"entity_id\": \"light.x\"} "
                                                           "or a list of ids."})),
    _tool("ha_set_entity", "Set an entity: state on/off/toggle (lights, switches...), "
          "open/closed (covers), locked/unlocked, a value (numbers, selects, texts), or "
          "attributes such as temperature (climate).",
          _schema(["entity_id"], entity_id=_s("The entity id, e.g. light.kitchen."),
                  state=_s("The state to set, e.g. on."),
                  value={"type": ["string", "number", "boolean"],
                         "description": "The value to set (numbers, selects, texts)."},
                  attributes={"type": "object", "description": "e.g. {\"brightness\": 200} "
                                                               "or {\"temperature\": 21}."})),
    _tool("ha_restart", "Restart Home Assistant (after its configuration check passes).",
          _schema([], checkConfig={"type": "boolean",
                                   "description": "Check the configuration first "
                                                  "(default true)."})),
    _tool("ha_dashboard_get", "Read a Lovelace dashboard YAML file, or one view of it.",
          _schema([], dashboardFile=_s(_FILE), viewPath=_s("Path or title of one view."))),
    _tool("ha_dashboard_validate", "Check a dashboard: YAML, shape, and that every entity it "
          "names exists in Home Assistant.",
          _schema([], dashboardFile=_s(_FILE), content=_s("YAML text to check instead of a "
                                                          "file."),
                  checkEntities={"type": "boolean", "description": "Default true."})),
    _tool("ha_dashboard_patch", "Change a dashboard file (default the staging one) with "
          "operations, each {op, ...}: add_view {view, index?}, update_view {view, changes}, "
          "remove_view {view}, move_view {view, index}, add_card {view, card, index?}, "
          "update_card {view, card, changes}, remove_card {view, card}, move_card {view, card, "
          "index, toView?}, set_theme {theme, view?}. A view is its path, title or index; a "
          "card its index. dryRun shows the result without writing.",
          _schema(["operations"], dashboardFile=_s(_FILE), operations=_OPS, dryRun=_BOOL)),
    _tool("ha_apply_dashboard", "Make the staging dashboard live: copy it over the target "
          "(default ui-lovelace.yaml) after a timestamped backup. Refused unless it passes "
          "the check ha_dashboard_validate makes.",
          _schema([], stagingFile=_s(_FILE), targetFile=_s("Default ui-lovelace.yaml."),
                  backup={"type": "boolean", "description": "Default true."},
                  checkEntities={"type": "boolean", "description": "Default true."})),
    _tool("ha_canvas_get_spec", "Read the canvas spec (JSON) in the dashboards folder.",
          _schema([], specFile=_s("Default canvas-spec.json."))),
    _tool("ha_canvas_set_spec", "Replace the canvas spec: an object whose cards each have a "
          "unique id.",
          _schema(["spec"], specFile=_s("Default canvas-spec.json."), spec=_OBJ,
                  title=_s("Title to set."))),
    _tool("ha_canvas_patch_spec", "Change the canvas spec with operations {op, ...}: "
          "add_card {card, index?}, update_card {id, changes}, remove_card {id}, move_card "
          "{id, index}, set_layout {layout}, set_title {title}.",
          _schema(["operations"], specFile=_s("Default canvas-spec.json."), operations=_OPS)),
    _tool("ha_capture_screenshot", "Take a PNG screenshot of a Home Assistant dashboard "
          "(saved in your group folder; the reply gives its path, which send_file can send).",
          _schema([], dashboard=_s("Dashboard url path (default lovelace)."),
                  view=_s("View path."),
                  zoom={"type": "number", "minimum": 0.25, "maximum": 4},
                  width={"type": "integer", "minimum": 200, "maximum": 3840},
                  height={"type": "integer", "minimum": 200, "maximum": 2160},
                  waitMs={"type": "integer", "minimum": 0, "maximum": 30000,
                          "description": "Time to let the page render (default 1200)."},
                  selector=_s("CSS selector of the element to capture."))),
    _tool("farm_state_refresh", "A fresh snapshot of the states of every entity the operator "
          "lets you see (optionally only some domains).",
          _schema([], domains={"type": "array", "items": {"type": "string"},
                               "description": "e.g. [\"sensor\", \"light\"]."})),
)
