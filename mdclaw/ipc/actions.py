"""Action requests (`actions/*.json` with a requestId) and their handlers.

An action is one registered function. There are two kinds.

**On-loop actions** (quick and local: a small lookup; none is shipped, even the memory
actions run off the loop) run inside the command's transaction on the IPC loop:

    @action("weather_get")
    def weather_get(ctx: ActionContext, params: dict) -> dict:
        ...
        return {"temperature": 21}

`ctx.conn` is the command's transaction, so database changes commit with the ledger row;
anything done outside the database must be safe to repeat (a crash before the commit runs it
again). Such a handler must never wait on the network or on anything slow.

**Off-loop actions** (network, slow work: a web fetch, a Home Assistant call) run on the
action worker (`mdclaw/ipc/worker.py`), never on the IPC loop:

    @action("web_fetch", offloop=True, default_scope="all", max_attempts=3, timeout=60)
    async def web_fetch(ctx: OffloopContext, params: dict) -> dict:
        cfg = ctx.cfg            # the running config (reloads reach it)
        ...
        return {"text": "..."}

The handler may be `async def` (run on the daemon's event loop: use aiohttp, never block)
or a plain function (run on a thread). It gets an `OffloopContext` without a database
connection (a thread handler that reads the database opens its own read-only one, as
memory_search does). An off-loop action may name a `check(caller, params)`: a quick,
I/O-free test run on the loop before the request is queued, which raises Unauthorized (the
request is quarantined at once, like any unauthorized command) or ActionFailed (an error
result at once, nothing queued). What happens to a request:

1. On the loop, inside the command's transaction: the permission check (`action_refusal`)
   and the action's `check`, then a row in `action_jobs` (status `queued`) is inserted with
   the command's ledger row.
   A second request with the same requestId from the same group is refused (quarantined,
   "duplicate requestId"): it is never run twice.
2. The worker claims queued rows (bounded concurrency overall and per group, fair between
   groups), runs the handler, stores the result body in the row (`done`/`failed`), then
   writes `action_results/<requestId>.json` through the one door.
3. After a crash, the daemon's next start finishes every row: a stored result is written
   again (the same body), a job left `queued`/`running` is run again if it has attempts left
   (`max_attempts`, default 1: no repeat) or gets the error result "interrupted by a
   restart". A request is never lost and never gets two different results.

Choose `max_attempts > 1` only for actions that are safe to repeat (a GET, a search); an
action that changes the world (switching a light) keeps the default 1. `timeout` (seconds)
bounds one run; past it the result is an error. `default_scope` is who may call the action
when `groups.<g>.actions` is not set: "all" groups, or only the "main" group (see
`action_refusal`).

Both kinds: return the `result` object; raise ActionFailed("reason") for an error result;
raise Unauthorized for a request the caller may not make at all (it is quarantined, like
any unauthorized command). A module adding actions lives outside `ipc/` (e.g.
`mdclaw/integrations/`) and is imported by `mdclaw.integrations.load_all()`.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from itertools import zip_longest
from typing import Any, Literal

from mdclaw import agentfs
from mdclaw.agentfs import UnsafePath
from mdclaw.config import Config, validate_folder
from mdclaw.errors import IpcError
from mdclaw.ipc.auth import Caller, check_group_target
from mdclaw.paths import Layout
from mdclaw.state import Database, transcripts


class ActionFailed(IpcError):
    """The handler could not do what was asked; str(e) goes into the error result."""


@dataclass(frozen=True)
class ActionContext:
    """What an on-loop handler gets: the caller and the command's transaction."""
    caller: Caller
    layout: Layout
    conn: sqlite3.Connection


@dataclass(frozen=True)
class Decision:
    """A person's decision on an approval a job waited for: status (approved, answered),
    the chosen answer (a question's option), who decided ("Alex (owner)")."""
    approval_id: int
    status: str
    choice: str | None
    by: str | None


@dataclass(frozen=True)
class OffloopContext:
    """What an off-loop handler gets: the caller, the running config, the request's id, and
    for a job that waited for a person, their decision. No database connection: an
    off-loop handler keeps its state outside the database or in its own module's tables,
    through its own short transactions."""
    caller: Caller
    cfg: Config
    layout: Layout
    request_id: str
    decision: Decision | None = None
    # Called by a handler that from now on only waits (ask_agent: for another agent's
    # answer): the job no longer counts against `limits.action_jobs`, so waiting chains do
    # not hold the slots other groups' actions (and the asked agent's own) need; it still
    # counts against its group's `limits.action_jobs_per_group`. None: no worker to tell.
    waiting: Callable[[], None] | None = None


Scope = Literal["all", "main"]
Handler = Callable[[ActionContext, dict[str, Any]], dict[str, Any]]
Check = Callable[[Caller, dict[str, Any]], None]
# Why a request needs a person when no approval rule matched it (the rule name for the card
# and the audit, e.g. "mcp_servers.git: tool annotations"); None: it does not.
NeedsPerson = Callable[[Config, Caller, dict[str, Any]], "str | None"]
# Who may call the action, in place of `groups.<g>.actions` (ask_agent: `groups.<g>.may_ask`):
# why group `folder` may not (naming the rule), None if it may.
Gate = Callable[[Config, str], "str | None"]
OffloopHandler = Callable[[OffloopContext, dict[str, Any]],
                          "dict[str, Any] | Awaitable[dict[str, Any]]"]


@dataclass(frozen=True)
class ActionSpec:
    name: str
    handler: Callable[..., Any]
    offloop: bool = False
    default_scope: Scope = "all"
    max_attempts: int = 1
    timeout: float = 120.0
    check: Check | None = None
    asks: bool = False  # the request is a question to a person; the job runs on the answer
    needs_person: NeedsPerson | None = None  # asked when no approval rule matched
    gate: Gate | None = None  # its own permission rule, instead of groups.<g>.actions


ACTIONS: dict[str, ActionSpec] = {}
# Actions every group may always call, whatever `groups.<g>.actions` says: the memory ones on
# its own folder, and mcp_call, which `groups.<g>.mcp` gates tool by tool.
ALWAYS_ALLOWED = ("memory_search", "memory_get", "mcp_call")


def action(name: str, *, offloop: bool = False, default_scope: Scope = "all",
           max_attempts: int = 1, timeout: float = 120.0,
           check: Check | None = None, asks: bool = False,
           needs_person: NeedsPerson | None = None,
           gate: Gate | None = None) -> Callable[[Any], Any]:
    """Register the decorated function as the handler of action `name` (see module doc).
    `asks`: each request is a question to a person (params `question`, `options`, `who`),
    and the handler runs once they answered, with their answer in `ctx.decision`.
    `needs_person(cfg, caller, params)`: asked (on the loop, after `check`) when no approval
    rule matched the request: a reason holds it for the owner, None lets it run.
    `gate(cfg, folder)`: the action's own permission rule, asked instead of
    `groups.<g>.actions` and `default_scope` (a reason naming the rule refuses it)."""
    if check is not None and not offloop:
        raise ValueError("check is for off-loop actions (an on-loop handler checks itself)")
    if asks and not offloop:
        raise ValueError("an action that asks a person waits: it must run off the loop")
    if default_scope not in ("all", "main"):
        raise ValueError(f"default_scope must be 'all' or 'main', not {default_scope!r}")
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")

    def deco(fn: Any) -> Any:
        ACTIONS[name] = ActionSpec(name, fn, offloop, default_scope, max_attempts, timeout,
                                   check, asks, needs_person, gate)
        return fn
    return deco


def get_spec(name: str) -> ActionSpec:
    """The registered action `name`; ActionFailed (naming the known ones) if there is none."""
    spec = ACTIONS.get(name)
    if spec is None:
        raise ActionFailed(f"unknown action {name!r}; known: {', '.join(sorted(ACTIONS))}")
    return spec


def action_refusal(cfg: Config, folder: str, is_main: bool, name: str) -> str | None:
    """Why group `folder` may not call action `name`, naming the rule; None if it may.

    The one definition of the per-group action permission (the worker, doctor and the
    operator page ask it):
    - `groups.<folder>.actions` unset (or the group is not in the config): the action's
      `default_scope` decides: "all" groups, or "main" only;
    - set: exactly the actions matching one of its fnmatch patterns (`web_*`, `ha.*`),
      plus memory_search and memory_get, which every group may call on its own folder, and
      mcp_call, whose permission is `groups.<g>.mcp` (mdclaw.mcp.policy).
    An action with its own `gate` (ask_agent: `groups.<g>.may_ask`) is asked that alone.
    An unknown action is not refused here (the request gets "unknown action").
    """
    spec = ACTIONS.get(name)
    if spec is None:
        return None
    if spec.gate is not None:
        return spec.gate(cfg, folder)
    group = cfg.groups.get(folder)
    patterns = group.actions if group is not None else None
    if patterns is None:
        if spec.default_scope == "main" and not is_main:
            return (f"action {name!r} is allowed only for the main group by default; "
                    f"list it in groups.{folder}.actions to allow it")
        return None
    if name in ALWAYS_ALLOWED or any(fnmatchcase(name, p) for p in patterns):
        return None
    shown = ", ".join(patterns) if patterns else "empty"
    return (f"action {name!r} is not allowed for group {folder!r}: groups.{folder}.actions "
            f"({shown}) matches no such action")


def check_request(spec: ActionSpec, caller: Caller, params: dict[str, Any]) -> None:
    """Run the off-loop action's quick `check` (on the loop, before queueing): raises
    Unauthorized or ActionFailed. Nothing to do for an action without one."""
    if spec.check is not None:
        spec.check(caller, params)


def run_action(ctx: ActionContext, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run the on-loop handler `name`; returns its result. Raises ActionFailed (unknown
    action, handler failure) or Unauthorized (the caller may not do it: quarantined)."""
    spec = get_spec(name)
    if spec.offloop:
        raise ActionFailed(f"action {name!r} runs off the loop; it cannot run inline")
    result: dict[str, Any] = spec.handler(ctx, params)
    return result


# --------------------------------------------------------------------------- memory

MEMORY_FILE_MAX = 1024 * 1024
MEMORY_MAX_FILES = 200
_MEMORY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.md\Z")


def _target_folder(caller: Caller, params: dict[str, Any], what: str) -> str:
    """The group whose memory is asked for: the caller's own, or `groupFolder` (main only;
    another group naming one raises Unauthorized)."""
    folder = params.get("groupFolder", caller.folder)
    if not isinstance(folder, str):
        raise ActionFailed("groupFolder must be a string")
    try:
        validate_folder(folder)
    except ValueError as e:
        raise ActionFailed(str(e)) from None
    check_group_target(caller, folder, what)
    return folder


def _memory_files(layout: Layout, folder: str,
                  only: str | None = None) -> list[tuple[str, str]]:
    """(relative path, text) of MEMORY.md and memory/*.md of `folder` (the first
    MEMORY_MAX_FILES of these by name), never via symlinks. With `only` (one such relative
    path), just that file is read, if it is one of them."""
    try:
        gfd = agentfs.open_root(layout.groups_dir)
    except (FileNotFoundError, UnsafePath):
        return []
    out = []
    try:
        with agentfs.opened(gfd, folder) as fd:
            if only in (None, "MEMORY.md"):
                text = agentfs.read_text(fd, "MEMORY.md", MEMORY_FILE_MAX)
                if text is not None:
                    out.append(("MEMORY.md", text))
            if only != "MEMORY.md":
                with agentfs.opened(fd, "memory") as mfd:
                    for name in sorted(n for n in agentfs.listdir(mfd)
                                       if _MEMORY_NAME.match(n))[:MEMORY_MAX_FILES]:
                        if only is not None and only != f"memory/{name}":
                            continue
                        text = agentfs.read_text(mfd, name, MEMORY_FILE_MAX)
                        if text is not None:
                            out.append((f"memory/{name}", text))
    except (FileNotFoundError, UnsafePath):
        pass
    finally:
        os.close(gfd)
    return out


@dataclass(frozen=True)
class _SearchAsk:
    query: str
    top_k: int
    sources: str
    folder: str


def _search_ask(caller: Caller, params: dict[str, Any]) -> _SearchAsk:
    query = params.get("query")
    if not isinstance(query, str) or not query.strip():
        raise ActionFailed("memory_search needs a non-empty string 'query'")
    top_k = params.get("topK", params.get("top_k", 5))
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 50:
        raise ActionFailed("topK must be a whole number from 1 to 50")
    sources = params.get("sources", "memory")
    if sources not in ("memory", "sessions", "all"):
        raise ActionFailed("sources must be 'memory', 'sessions' or 'all'")
    return _SearchAsk(query, top_k, sources, _target_folder(caller, params, "memory_search"))


def _get_ask(caller: Caller, params: dict[str, Any]) -> tuple[str, str]:
    path = params.get("path")
    if not isinstance(path, str):
        raise ActionFailed("memory_get needs a string 'path'")
    if path != "MEMORY.md":
        prefix, _, name = path.partition("/")
        if prefix != "memory" or not _MEMORY_NAME.match(name):
            raise ActionFailed(f"path {path!r} is not allowed: use MEMORY.md or memory/<name>.md")
    return path, _target_folder(caller, params, "memory_get")


def _search_sessions(cfg: Config, folder: str, query: str, top_k: int) -> list[dict[str, Any]]:
    """Ranked transcript matches, through a connection of this thread's own (never the IPC
    loop's). It may write: rows still queued for the full-text index are indexed first, so
    what was stored before the search is found (mdclaw.state.transcripts.search)."""
    db = Database(cfg.db_path, migrate=False, timeout=10.0)
    try:
        return [{"source": "sessions", **h.as_dict()}
                for h in transcripts.search(db.conn, folder, query, top_k)]
    finally:
        db.close()


# memory_search and memory_get run off the loop, on a thread: a search of very common words
# reads long posting lists (tens of ms), and memory files are up to 200 x 1 MiB. Their checks
# (parameters, and whether the caller may name that group) run on the loop before queueing,
# so a non-main group asking for another group's memory is quarantined as before. Searching
# is safe to repeat.
def _check_search(caller: Caller, params: dict[str, Any]) -> None:
    _search_ask(caller, params)


def _check_get(caller: Caller, params: dict[str, Any]) -> None:
    _get_ask(caller, params)


@action("memory_search", offloop=True, max_attempts=3, timeout=60, check=_check_search)
def memory_search(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """Lines of the group's memory files that contain the query's words, best first
    (`sources: memory`); ranked matches in its past conversations (`sessions`, see
    mdclaw.state.transcripts); or both, interleaved (`all`)."""
    ask = _search_ask(ctx.caller, params)
    terms = [t for t in re.findall(r"\w+", ask.query.lower()) if t]
    hits: list[dict[str, Any]] = []
    if ask.sources in ("memory", "all"):
        for path, text in _memory_files(ctx.layout, ask.folder):
            for lineno, line in enumerate(text.splitlines(), 1):
                low = line.lower()
                score = sum(low.count(t) for t in terms)
                if score:
                    hits.append({"source": "memory", "path": path, "line": lineno,
                                 "snippet": line.strip()[:300], "score": score})
    hits.sort(key=lambda h: (-h["score"], h["path"], h["line"]))
    if ask.sources == "memory":
        return {"hits": hits[:ask.top_k]}
    said = _search_sessions(ctx.cfg, ask.folder, ask.query, ask.top_k)
    if ask.sources == "sessions":
        return {"hits": said}
    # The two rankings' scores do not compare: take the best of each in turn.
    merged = [h for pair in zip_longest(hits[:ask.top_k], said) for h in pair if h is not None]
    return {"hits": merged[:ask.top_k]}


@action("memory_get", offloop=True, max_attempts=3, timeout=60, check=_check_get)
def memory_get(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """The text of MEMORY.md or memory/<name>.md of the group (nothing else)."""
    path, folder = _get_ask(ctx.caller, params)
    for p, text in _memory_files(ctx.layout, folder, only=path):
        if p == path:
            return {"path": path, "content": text}
    raise ActionFailed(f"{path} does not exist")


# --------------------------------------------------------------------------- ask_person

QUESTION_MAX = 1000
OPTION_MAX = 100
MAX_OPTIONS = 4


def question_of(params: dict[str, Any]) -> dict[str, Any]:
    """An ask_person request's question as stored for the card: {question, options, who}.
    Raises ActionFailed saying what is wrong (nothing is asked)."""
    question = params.get("question")
    if not isinstance(question, str) or not question.strip() or len(question) > QUESTION_MAX:
        raise ActionFailed(f"ask_person needs a 'question' of 1 to {QUESTION_MAX} characters")
    options = params.get("options", ["Yes", "No"])
    if (not isinstance(options, list) or not 1 <= len(options) <= MAX_OPTIONS
            or not all(isinstance(o, str) and 0 < len(o.strip()) <= OPTION_MAX
                       for o in options)):
        raise ActionFailed(f"ask_person 'options' must be 1 to {MAX_OPTIONS} strings of at "
                           f"most {OPTION_MAX} characters")
    who = params.get("who", "owner")
    if not isinstance(who, str) or not who:
        raise ActionFailed("ask_person 'who' must be owner, admin or a person's key")
    return {"question": question, "options": list(options), "who": who}


def _check_question(caller: Caller, params: dict[str, Any]) -> None:
    question_of(params)


@action("ask_person", offloop=True, asks=True, check=_check_question, timeout=10)
def ask_person(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """The person's answer to the question (the worker runs this once they answered; an
    unanswered question gets its error result without it)."""
    d = ctx.decision
    if d is None or d.choice is None:
        raise ActionFailed("ask_person: no answer was recorded")
    options = question_of(params)["options"]
    n = int(d.choice) if d.choice.isdigit() else 0
    answer = options[n - 1] if 1 <= n <= len(options) else d.choice
    return {"answer": answer, "option": n or None, "answeredBy": d.by}
