"""The agent's tools. The IPC tools each write one canonical command file, read a host
snapshot, or ask the host for an action (memory, web) and wait for its answer; the
workspace tools (filetools, shell) read and write the group's files and run commands.

Both backends use this one registry: the claude backend wraps it as an in-process MCP server
(without the workspace tools: Claude Code has its own), the openai backend as function
tools. A tool returns plain words telling the agent what
happened; a tool that fails raises ToolError whose message is shown to the agent.

Main-only tools (group registration) are not in the list a non-main container gets at all.

The commands' types, fields, enums, defaults and limits are the host's, read through
mdclaw_agent.commands (a schema generated from the host's models): a tool argument that
becomes a command field is limited as the host limits that field, and every body is checked
against the host's schema before it is written.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mdclaw_agent import commands
from mdclaw_agent.commands import MAX_FILE_BYTES
from mdclaw_agent.filetools import FILE_TOOLS
from mdclaw_agent.hatools import HA_TOOLS
from mdclaw_agent.ipc import read_json_file
from mdclaw_agent.shell import BASH_TOOL
from mdclaw_agent.toolbase import (
    Tool,
    ToolContext,
    ToolError,
    action_result,
    request_action,
    write_command,
)
from mdclaw_agent.toolbase import schema as _schema
from mdclaw_agent.toolbase import string as _s

SCHEDULE_TYPES = commands.enum("schedule_task", "schedule_type")
CONTEXT_MODES = commands.enum("schedule_task", "context_mode")


def _command_schema(ctype: str, **descriptions: str) -> dict[str, Any]:
    """The arguments of a tool whose arguments are fields of command `ctype`: each limited
    as the host limits that field, required when the host requires it."""
    return _schema([k for k in commands.required(ctype) if k in descriptions],
                   **{k: commands.param(ctype, k, d) for k, d in descriptions.items()})


def _body(ctype: str, args: dict[str, Any], **values: Any) -> dict[str, Any]:
    """Command `ctype` from the arguments that are its fields, then `values` (None: left
    out)."""
    body: dict[str, Any] = {"type": ctype}
    body.update((k, args[k]) for k in commands.fields(ctype) if k in args)
    body.update((k, v) for k, v in values.items() if v is not None)
    return body


# --------------------------------------------------------------------------- writers


def _target(ctx: ToolContext, a: dict[str, Any]) -> str | None:
    """The chat a message or file goes to: the one named, none when a group is named (the
    host picks its chat), else the chat of the message being answered."""
    return a.get("chat_jid") or (None if a.get("group") else ctx.default_chat())


def _where(body: dict[str, Any]) -> str:
    return body.get("chat_jid") or f"group {body.get('group')}"


def _send_message(ctx: ToolContext, a: dict[str, Any]) -> str:
    body = _body("message", a, chat_jid=_target(ctx, a))
    write_command(ctx, "messages", body)
    return f"Message queued for delivery to {_where(body)}."


def _container_path(ctx: ToolContext, given: str) -> Path:
    p = Path(given)
    return p if p.is_absolute() else ctx.group_dir / p


def _send_file(ctx: ToolContext, a: dict[str, Any]) -> str:
    path = _container_path(ctx, a["file_path"])
    try:
        st = path.stat()
    except OSError:
        raise ToolError(f"send_file: {path} does not exist") from None
    if not path.is_file():
        raise ToolError(f"send_file: {path} is not a regular file")
    if st.st_size > MAX_FILE_BYTES:
        raise ToolError(f"send_file: {path} is {st.st_size} bytes; the limit is "
                        f"{MAX_FILE_BYTES // 2**20} MB")
    # The host knows the file by its container path; name it that way even when the runner
    # runs elsewhere (tests) with the group folder at another place.
    try:
        wire_path = "/workspace/group/" + path.relative_to(ctx.group_dir).as_posix()
    except ValueError:
        wire_path = str(path)
    body = _body("send_file", a, chat_jid=_target(ctx, a), file_path=wire_path)
    write_command(ctx, "messages", body)
    return f"File {path.name} queued for delivery to {_where(body)}."


def _react(ctx: ToolContext, a: dict[str, Any]) -> str:
    body = _body("react", a, chat_jid=a.get("chat_jid") or ctx.default_chat())
    write_command(ctx, "messages", body)
    return f"Reaction {a['emoji']} queued for message {a['message_id']}."


def _new_task_id() -> str:
    return f"task-{int(time.time() * 1000)}-{secrets.token_hex(3)}"


def _schedule_task(ctx: ToolContext, a: dict[str, Any]) -> str:
    task_id = a.get("task_id") or _new_task_id()
    body = _body("schedule_task", a, task_id=task_id, context_mode=a.get(
        "context_mode", commands.default("schedule_task", "context_mode")))
    write_command(ctx, "tasks", body)
    return (f"Task {task_id} requested ({a['schedule_type']} {a['schedule_value']}). "
            "The host checks the schedule; list_tasks shows it once accepted.")


def _update_task(ctx: ToolContext, a: dict[str, Any]) -> str:
    changes = {k: a[k] for k in _UPDATE_FIELDS if k in a}
    if not changes:
        raise ToolError(f"update_task: give at least one of {', '.join(_UPDATE_FIELDS)}")
    write_command(ctx, "tasks", {"type": "update_task", "task_id": a["task_id"], **changes})
    return f"Update of task {a['task_id']} requested ({', '.join(changes)})."


_UPDATE_FIELDS = tuple(k for k in commands.fields("update_task") if k != "task_id")


def _task_op(kind: str, verb: str) -> Callable[[ToolContext, dict[str, Any]], str]:
    def handler(ctx: ToolContext, a: dict[str, Any]) -> str:
        write_command(ctx, "tasks", {"type": kind, "task_id": a["task_id"]})
        return f"Task {a['task_id']}: {verb} requested."
    return handler


def _read_snapshot(ctx: ToolContext, name: str) -> Any:
    try:
        return read_json_file(ctx.ipc_dir / name, limit=16 * 1024 * 1024)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ToolError(f"could not read {name}: {e}") from None


def _list_tasks(ctx: ToolContext, a: dict[str, Any]) -> str:
    tasks = _read_snapshot(ctx, "current_tasks.json")
    if isinstance(tasks, dict):
        tasks = tasks.get("tasks")
    if not tasks:
        return "No scheduled tasks."
    lines = [f"{len(tasks)} scheduled task(s):"]
    for t in tasks:
        if not isinstance(t, dict):
            continue
        group = t.get("group_folder") or t.get("groupFolder")
        where = f" [group {group}]" if ctx.is_main and group else ""
        nxt = t.get("next_run") or "-"
        prompt = str(t.get("prompt", ""))
        prompt = prompt if len(prompt) <= 80 else prompt[:77] + "..."
        lines.append(f"- {t.get('id')}{where}: {t.get('schedule_type')} "
                     f"{t.get('schedule_value')}, {t.get('status')}, next run {nxt}: {prompt}")
    return "\n".join(lines)


def _list_groups(ctx: ToolContext, a: dict[str, Any]) -> str:
    snap = _read_snapshot(ctx, "available_groups.json")
    groups = snap.get("groups") if isinstance(snap, dict) else snap
    if not groups:
        return "No groups are known yet."
    lines = [f"{len(groups)} group(s):"]
    for g in groups:
        if not isinstance(g, dict):
            continue
        reg = g.get("isRegistered", g.get("is_registered"))
        state = "" if reg is None else (" (registered)" if reg else " (not registered)")
        folder = f", folder {g['folder']}" if g.get("folder") else ""
        chats = [c for c in g.get("chats") or () if isinstance(c, dict) and c.get("jid")]
        if len(chats) > 1:
            # A group with several chats: each one can be addressed (chat_jid).
            where = ", ".join(f"{c['jid']}{' (first)' if c.get('first') else ''}"
                              for c in chats)
            session = f", session {g['session']}" if g.get("session") else ""
            lines.append(f"- {g.get('name')} — chats {where}{folder}{session}{state}")
        else:
            lines.append(f"- {g.get('name')} — {g.get('jid')}{folder}{state}")
    return "\n".join(lines)


def _list_chats(ctx: ToolContext, a: dict[str, Any]) -> str:
    snap = _read_snapshot(ctx, "chats.json")
    if not isinstance(snap, dict) or not snap.get("chats"):
        return f"This group answers in {ctx.chat_jid}."
    lines = [f"This group answers in {len(snap['chats'])} chat(s) "
             f"(session: {snap.get('session', 'shared')}):"]
    for c in snap["chats"]:
        if isinstance(c, dict):
            first = " (first: tasks report here)" if c.get("first") else ""
            lines.append(f"- {c.get('jid')}: {c.get('name')}, {c.get('channel')}{first}")
    dests = [d for d in snap.get("maySendTo") or () if isinstance(d, dict)]
    if dests:
        lines.append("You may also send messages and files to:")
        lines.extend(f"- group {d['group']} ({d.get('jid')})" if d.get("group")
                     else f"- {d.get('jid')}" for d in dests)
    return "\n".join(lines)


def _register_group(ctx: ToolContext, a: dict[str, Any]) -> str:
    write_command(ctx, "tasks", _body("register_group", a))
    return f"Registration of {a['name']} ({a['jid']}) as folder {a['folder']} requested."


def _unregister_group(ctx: ToolContext, a: dict[str, Any]) -> str:
    given = {k: a[k] for k in ("jid", "folder") if a.get(k)}
    if len(given) != 1:
        raise ToolError("unregister_group: give exactly one of jid or folder")
    write_command(ctx, "tasks", {"type": "unregister_group", **given})
    (key, value), = given.items()
    return f"Unregistration of the group with {key} {value} requested; its files are kept."


def _refresh_groups(ctx: ToolContext, a: dict[str, Any]) -> str:
    write_command(ctx, "tasks", {"type": "refresh_groups"})
    return "Group list refresh requested; list_groups shows it after the host rewrites it."


# --------------------------------------------------------------------------- actions


def _memory_search(ctx: ToolContext, a: dict[str, Any]) -> str:
    params = {"query": a["query"], "topK": a.get("top_k", 5)}
    if a.get("sources"):
        params["sources"] = a["sources"]
    result = action_result(request_action(ctx, {"action": "memory_search", "params": params}),
                           "memory_search")
    hits = result.get("hits") if isinstance(result, dict) else result
    if not hits:
        return f"No memory matches for {a['query']!r}."
    lines = [f"{len(hits)} match(es) for {a['query']!r}:"]
    for h in hits:
        if isinstance(h, dict) and h.get("source") == "sessions":  # past conversations
            who = h.get("sender") or ("assistant" if h.get("direction") == "out" else "?")
            lines.append(f"- {h.get('timestamp', '?')} {h.get('kind', '?')} ({who}): "
                         f"{h.get('snippet') or ''}")
        elif isinstance(h, dict):
            where = h.get("path") or h.get("source") or "?"
            line = f" line {h['line']}" if h.get("line") else ""
            text = h.get("snippet") or h.get("text") or ""
            lines.append(f"- {where}{line}: {text}")
        else:
            lines.append(f"- {h}")
    return "\n".join(lines)


def _memory_get(ctx: ToolContext, a: dict[str, Any]) -> str:
    result = action_result(
        request_action(ctx, {"action": "memory_get", "params": {"path": a["path"]}}),
        "memory_get")
    if isinstance(result, dict):
        content = result.get("content", result.get("text"))
        if isinstance(content, str):
            return content if content else f"{a['path']} is empty."
    return json.dumps(result, ensure_ascii=False)


def _web_fetch(ctx: ToolContext, a: dict[str, Any]) -> str:
    params: dict[str, Any] = {"url": a["url"]}
    if "max_chars" in a:
        params["max_chars"] = a["max_chars"]
    result = action_result(request_action(ctx, {"action": "web_fetch", "params": params},
                                          timeout=ctx.web_timeout), "web_fetch")
    if not isinstance(result, dict):
        return json.dumps(result, ensure_ascii=False)
    text = result.get("text", result.get("content"))
    final = result.get("final_url") or result.get("finalUrl") or result.get("url") or a["url"]
    status = result.get("status")
    ctype = result.get("content_type") or result.get("contentType")
    head = f"{final}" + (f" (HTTP {status}" if status is not None else " (")
    head += f", {ctype})" if ctype else ")"
    if head.endswith(" ()"):
        head = head[:-3]
    notes = []
    if result.get("truncated"):
        notes.append("truncated by the host; ask with a larger max_chars for more")
    tail = f"\n[{'; '.join(notes)}]" if notes else ""
    body = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    title = result.get("title")
    title_line = f"Title: {title}\n" if isinstance(title, str) and title else ""
    return f"{head}\n{title_line}\n{body}{tail}"


def _web_search(ctx: ToolContext, a: dict[str, Any]) -> str:
    params: dict[str, Any] = {"query": a["query"]}
    if "count" in a:
        params["count"] = a["count"]
    result = action_result(request_action(ctx, {"action": "web_search", "params": params},
                                          timeout=ctx.web_timeout), "web_search")
    hits = result.get("results") if isinstance(result, dict) else result
    if not hits:
        return f"No web results for {a['query']!r}."
    if not isinstance(hits, list):
        return json.dumps(result, ensure_ascii=False)
    lines = [f"{len(hits)} web result(s) for {a['query']!r}:"]
    for n, h in enumerate(hits, 1):
        if isinstance(h, dict):
            lines.append(f"{n}. {h.get('title') or '(no title)'}\n   {h.get('url', '')}\n"
                         f"   {h.get('snippet') or ''}".rstrip())
        else:
            lines.append(f"{n}. {h}")
    return "\n".join(lines)


def _ask_person(ctx: ToolContext, a: dict[str, Any]) -> str:
    params: dict[str, Any] = {"question": a["question"],
                              "options": a.get("options") or ["Yes", "No"],
                              "who": a.get("who", "owner")}
    env = request_action(ctx, {"action": "ask_person", "params": params})
    result = action_result(env, "ask_person")
    if isinstance(result, dict) and "answer" in result:
        by = result.get("answeredBy")
        return f"{by or 'They'} answered: {result['answer']}"
    return json.dumps(result, ensure_ascii=False)


ASK_AGENT_TIMEOUT = 600  # seconds the host waits for the other agent, unless told


def _ask_agent(ctx: ToolContext, a: dict[str, Any]) -> str:
    timeout = a.get("timeout") or ASK_AGENT_TIMEOUT
    params: dict[str, Any] = {"group": a["group"], "question": a["question"],
                              "timeout": timeout}
    # The host answers by its timeout; wait a little longer for its error result.
    env = request_action(ctx, {"action": "ask_agent", "params": params},
                         timeout=float(timeout) + 60)
    result = action_result(env, "ask_agent")
    if isinstance(result, dict) and "answer" in result:
        return f"The agent of {result.get('group', a['group'])} answered:\n{result['answer']}"
    return json.dumps(result, ensure_ascii=False)


# --------------------------------------------------------------------------- registry

_TASK_ID = "The task id, as list_tasks shows it."
_CHAT = ("Target chat id; default: the chat of the message you are answering. Another "
         "group's chat only when the host allows it (chats.json lists yours and where you "
         "may send).")
_GROUP = ("Instead of chat_jid: the name of a group to send to (its first chat), when the "
          "host allows it (chats.json: maySendTo).")
_TASK_CHAT = ("The chat the task reports to: one of this group's chats (chats.json); "
              "default its first.")


def _or(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + " or " + values[-1] if len(values) > 1 else values[0]


def _task_schema(ctype: str) -> dict[str, Any]:
    return _command_schema(ctype, task_id=_TASK_ID)


_IPC_TOOLS: tuple[Tool, ...] = (
    Tool("send_message", "Send a text message to the chat now (also while you keep working).",
         _command_schema("message", text="The message text.", chat_jid=_CHAT, group=_GROUP,
                         sender="Optional display name to send as.",
                         reply_to="Optional id of the message to reply to."),
         _send_message),
    Tool("send_file", "Send a file from the group folder to the chat (at most "
         f"{MAX_FILE_BYTES // 2**20} MB).",
         _command_schema("send_file", file_path="Path of the file, absolute or relative to "
                                                "the group folder.",
                         file_name="Name shown to the recipient.",
                         caption="Optional caption.", chat_jid=_CHAT, group=_GROUP),
         _send_file),
    Tool("react", "React to a chat message with an emoji.",
         _command_schema("react", message_id="Id of the message to react to.",
                         emoji="One emoji.", chat_jid=_CHAT),
         _react),
    Tool("schedule_task",
         "Schedule a prompt to run later: cron (e.g. '0 9 * * 1-5', in the assistant's "
         "timezone), interval (milliseconds, at least 1000, e.g. '3600000') or once (local ISO "
         "time, e.g. '2026-02-01T09:00:00').",
         _command_schema("schedule_task",
                         prompt="What to do when the task runs.",
                         schedule_type=f"{_or(SCHEDULE_TYPES)}.",
                         schedule_value="The cron expression, interval in ms, or timestamp.",
                         context_mode="group: run with the conversation's history; isolated: "
                                      "a fresh session.",
                         task_id="Optional id to give the task (letters, digits, _ . : -).",
                         timezone="IANA timezone for the schedule; default the assistant's.",
                         chat_jid=_TASK_CHAT),
         _schedule_task),
    Tool("update_task", "Change a scheduled task's prompt or schedule.",
         _command_schema("update_task", task_id=_TASK_ID, prompt="New prompt.",
                         schedule_type=f"{_or(SCHEDULE_TYPES)}.",
                         schedule_value="New schedule value.",
                         context_mode=f"{_or(CONTEXT_MODES)}.",
                         status=f"{_or(commands.enum('update_task', 'status'))}.",
                         timezone="IANA timezone for the schedule."),
         _update_task),
    Tool("pause_task", "Pause a scheduled task.", _task_schema("pause_task"),
         _task_op("pause_task", "pause")),
    Tool("resume_task", "Resume a paused task.", _task_schema("resume_task"),
         _task_op("resume_task", "resume")),
    Tool("cancel_task", "Cancel a task (it stops running; its history is kept).",
         _task_schema("cancel_task"), _task_op("cancel_task", "cancel")),
    Tool("delete_task", "Delete a task and its run history permanently.",
         _task_schema("delete_task"), _task_op("delete_task", "deletion")),
    Tool("list_tasks", "List the scheduled tasks you can see.", _schema([]), _list_tasks),
    Tool("list_chats", "List the chats this group answers in and where else it may send "
         "messages and files.", _schema([]), _list_chats),
    Tool("memory_search", "Search the group's memory files and past sessions.",
         _schema(["query"], query=_s("What to look for."),
                 top_k={"type": "integer", "description": "How many matches (default 5)."},
                 sources=_s("memory, sessions or all.", enum=["memory", "sessions", "all"])),
         _memory_search, action="memory_search"),
    Tool("memory_get", "Read one memory file (MEMORY.md or memory/<name>.md).",
         _schema(["path"], path=_s("MEMORY.md or memory/<name>.md.")), _memory_get,
         action="memory_get"),
    Tool("web_fetch", "Fetch a web page (http or https) through the host and get its "
         "readable text, final URL, HTTP status and content type. The host's policy decides "
         "which sites may be fetched.",
         _schema(["url"], url=_s("The http(s) URL."),
                 max_chars={"type": "integer", "minimum": 100, "maximum": 1_000_000,
                            "description": "Most characters of text to return (the host "
                                           "caps it too)."}),
         _web_fetch, action="web_fetch"),
    Tool("web_search", "Search the web through the host's search provider; returns title, "
         "URL and snippet of each result.",
         _schema(["query"], query=_s("What to search for."),
                 count={"type": "integer", "minimum": 1, "maximum": 20,
                        "description": "How many results (default: the host's)."}),
         _web_search, action="web_search"),
    Tool("ask_person", "Ask a person a question and wait for their answer (a card with "
         "buttons in their own chat; they may take minutes). Use it before doing something "
         "you are unsure they want. The answer, or that nobody answered in time, is the "
         "result.",
         _schema(["question"], question=_s("The question, in plain words.", maxLength=1000),
                 options={"type": "array", "minItems": 1, "maxItems": 4,
                          "items": {"type": "string", "minLength": 1, "maxLength": 100},
                          "description": "The answers to offer (default Yes, No)."},
                 who=_s("Who to ask: owner (default), admin, or a person's key.",
                        maxLength=32)),
         _ask_person, action="ask_person"),
    Tool("ask_agent", "Ask the agent of another group a question and wait for its answer "
         "(it runs one turn with your question, marked as from you, not from a person; its "
         "answer is the result and is not posted in its chat). Only the groups the host "
         "allows you to ask.",
         _schema(["group", "question"], group=_s("The other group's folder name."),
                 question=_s("The question, with what it needs to know.", maxLength=20000),
                 timeout={"type": "integer", "minimum": 5, "maximum": 3600,
                          "description": "Seconds to wait for the answer (default 600)."}),
         _ask_agent, action="ask_agent"),
    Tool("register_group", "Register a chat as a new group with its own folder (main only).",
         _command_schema("register_group", jid="The chat id, e.g. tg:-100123.",
                         name="Display name.", folder="Folder name: letters, digits, _ or -.",
                         trigger="Trigger word; default '@' + the assistant's name.",
                         requires_trigger="Answer only messages with the trigger."),
         _register_group, main_only=True),
    Tool("unregister_group", "Stop answering a chat (its folder is kept) (main only). Give "
         "exactly one of jid or folder.",
         _command_schema("unregister_group", jid="The chat id of the group.",
                         folder="The group's folder."),
         _unregister_group, main_only=True),
    Tool("refresh_groups", "Ask the host to refresh the list of known chats (main only).",
         _schema([]), _refresh_groups, main_only=True),
    Tool("list_groups", "List known chats and whether they are registered (main only).",
         _schema([]), _list_groups, main_only=True),
)


# One registry for both backends; the claude backend leaves out the "workspace" ones
# (Claude Code has its own file and shell tools).
TOOLS: tuple[Tool, ...] = _IPC_TOOLS + HA_TOOLS + FILE_TOOLS + (BASH_TOOL,)


def tools_for(is_main: bool, *, workspace: bool = True,
              actions: frozenset[str] | None = None) -> list[Tool]:
    """The tools a container gets: main-only ones are left out for other groups; the
    workspace tools (files, bash) only when the backend has none of its own. `actions`: the
    host actions this group may call (MDCLAW_ACTIONS); when known, a tool asking for an
    action is given exactly when its action is among them, whatever main_only says."""
    def allowed(t: Tool) -> bool:
        if actions is not None and t.action is not None:
            return t.action in actions
        return is_main or not t.main_only
    return [t for t in TOOLS if allowed(t) and (workspace or "workspace" not in t.tags)]


def run_tool(tools: list[Tool], ctx: ToolContext, name: str, args: Any) -> tuple[str, bool]:
    """Call tool `name`; return (reply text, is_error). Never raises for a tool failure."""
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        return f"There is no tool named {name!r}.", True
    try:
        return tool.call(ctx, args if args is not None else {}), False
    except ToolError as e:
        return str(e), True
