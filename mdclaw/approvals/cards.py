"""What a card says: who asks, what exactly (the stored request, every argument), which rule,
until when, and how to answer. Plain text, never Markdown or HTML: a channel shows it as it
is.

Everything that came from an agent (argument names and values, a question, an unknown
sender's name and words) is shown escaped: control characters (ANSI escape sequences among
them), format characters (bidi overrides and isolates, zero-width characters), line and
paragraph separators, spaces other than the plain one and private-use characters become
`\\x1b`, `\\u202e`...; a backslash becomes `\\\\`, so an escape can never be faked. A
value longer than VALUE_MAX is cut with "…", and a card with more than ARGS_MAX arguments
names how many more: the whole request is one tap away ("Show all") or `mdclaw approvals
show <id>`.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

VALUE_MAX = 160
ARGS_MAX = 12
FULL_MAX = 3500  # the "show all" text, per message
# Categories shown as escapes: controls, format characters (bidi, zero width), separators,
# private use, surrogates and unassigned code points.
_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Co", "Cs", "Cn"})
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def escape(text: str) -> str:
    """`text` with every character that could hide or reorder what a person reads shown as
    an escape (see the module doc)."""
    out = []
    for ch in text:
        named = _NAMED.get(ch)
        if named is not None:
            out.append(named)
        elif unicodedata.category(ch) in _HIDDEN or (ch != " " and ch.isspace()):
            cp = ord(ch)
            out.append(f"\\x{cp:02x}" if cp < 0x100 else
                       f"\\u{cp:04x}" if cp < 0x10000 else f"\\U{cp:08x}")
        else:
            out.append(ch)
    return "".join(out)


def shown(value: Any, limit: int = VALUE_MAX) -> tuple[str, bool]:
    """A value as a card shows it (strings escaped, anything else as compact JSON), cut at
    `limit` characters with "…"; and whether it was cut."""
    text = escape(value) if isinstance(value, str) else escape(
        json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True))
    if isinstance(value, str):
        text = f'"{text}"'
    if len(text) > limit:
        return text[:limit - 1] + "…", True
    return text, False


def flatten(args: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of `args` (lists stay whole)."""
    out: list[tuple[str, Any]] = []
    for key, value in args.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out += flatten(value, path + ".")
        else:
            out.append((path, value))
    return out


def argument_lines(args: Mapping[str, Any], *, limit: int = VALUE_MAX,
                   most: int | None = ARGS_MAX) -> tuple[list[str], bool]:
    """The lines that show `args` ("  key: value"), and whether anything was cut or left
    out."""
    items = flatten(args)
    lines, cut = [], False
    for key, value in items[:most] if most is not None else items:
        text, c = shown(value, limit)
        cut = cut or c
        lines.append(f"  {escape(key)}: {text}")
    if most is not None and len(items) > most:
        lines.append(f"  … {len(items) - most} more")
        cut = True
    return lines, cut


@dataclass(frozen=True)
class CardText:
    """A card for one approver: the text with buttons, the text for channels without (with
    the reply codes), and whether something was cut (a "Show all" choice is offered)."""

    text: str
    codes_text: str
    cut: bool


KIND_TITLE = {"command": "Approval needed", "action": "Approval needed",
              "admission": "Someone wants to talk", "question": "A question for you"}


def what_lines(kind: str, request: Mapping[str, Any], *, full: bool = False
               ) -> tuple[list[str], bool]:
    """The request in lines: the command or action and its arguments; the unknown sender
    and their message; the question and its options."""
    limit = 100_000 if full else VALUE_MAX
    most = None if full else ARGS_MAX
    if kind == "command":
        body = {k: v for k, v in request.items() if k != "type"}
        lines, cut = argument_lines(body, limit=limit, most=most)
        return [f"command {escape(str(request.get('type', '?')))}", *lines], cut
    if kind == "action":
        params = request.get("params") or {}
        server, tool = params.get("server"), params.get("tool")
        if request.get("action") == "mcp_call" and isinstance(server, str) and \
                isinstance(tool, str) and isinstance(params.get("arguments"), Mapping):
            lines, cut = argument_lines(params["arguments"], limit=limit, most=most)
            return [f"MCP tool {escape(tool)} of server {escape(server)} (mcp_call), with:",
                    *lines], cut
        lines, cut = argument_lines(params, limit=limit, most=most)
        return [f"action {escape(str(request.get('action', '?')))}", *lines], cut
    if kind == "admission":
        text, cut = shown(str(request.get("content", "")), limit)
        return [f"{shown(str(request.get('sender_name', '')), 80)[0]} "
                f"({escape(str(request.get('identity', '')))}) wrote:", f"  {text}"], cut
    question, cut = shown(str(request.get("question", "")), limit)
    lines = [question]
    for n, option in enumerate(request.get("options") or [], 1):
        text, c = shown(str(option), 80 if not full else limit)
        cut = cut or c
        lines.append(f"  {n}. {text}")
    return lines, cut


def card_text(*, approval_id: int, kind: str, group: str, group_name: str,
              request: Mapping[str, Any], rule: str | None, expires: str,
              code: str | None, choices: list[tuple[str, str]]) -> CardText:
    """The card of approval `approval_id`; `choices` are (reply word, label) pairs, `code`
    the approver's reply code (None: codes are locked or there is none)."""
    title = KIND_TITLE.get(kind, "Approval needed")
    who = f"{escape(group_name)} ({group})" if group_name != group else group
    if kind == "admission":
        head = f"{title} to {who} (#{approval_id})"
    elif kind == "question":
        head = f"{title} from {who} (#{approval_id})"
    else:
        head = f"{title} (#{approval_id}): {who} asks to run"
    lines, cut = what_lines(kind, request)
    text = [head, *lines]
    if rule:
        text.append(f"Rule: {escape(rule)}")
    text.append(f"No answer by {expires}: {'ignored' if kind == 'admission' else 'denied'}.")
    if cut:
        text.append(f"Cut short: the whole request is `mdclaw approvals show {approval_id}`.")
    body = "\n".join(text)
    if code is None:
        codes = "Answer on the operator page or with `mdclaw approvals`."
    else:
        options = " / ".join(f'"{word} {code}"' for word, _label in choices)
        codes = f"Reply {options}."
    return CardText(body, f"{body}\n{codes}", cut)


def outcome_text(*, approval_id: int, kind: str, summary: str, status: str,
                 by: str | None, outcome: str | None = None) -> str:
    """What a card says once decided: the outcome and who decided."""
    verb = {"approved": "Approved", "denied": "Denied", "expired": "Expired",
            "answered": "Answered"}.get(status, status)
    if kind == "admission":
        verb = {"approved": "Admitted", "denied": "Ignored"}.get(status, verb)
    line = f"{verb} (#{approval_id}): {summary}"
    if status == "expired":
        line += " — nobody answered in time"
    elif by:
        line += f" — by {by}"
    if outcome:
        line += f"\n{escape(outcome)}"
    return line


def full_text(approval_id: int, kind: str, request: Mapping[str, Any]) -> list[str]:
    """The whole request, escaped but not cut, in messages of at most FULL_MAX characters."""
    lines, _ = what_lines(kind, request, full=True)
    text = f"#{approval_id} in full:\n" + "\n".join(lines)
    return [text[i:i + FULL_MAX] for i in range(0, len(text), FULL_MAX)] or [text]


def summary(kind: str, request: Mapping[str, Any]) -> str:
    """One line naming the request (escaped, short): for lists, notes and outcomes."""
    if kind == "command":
        ctype = str(request.get("type", "?"))
        detail = request.get("chat_jid") or request.get("folder") or request.get("task_id")
        return escape(ctype + (f" {detail}" if detail else ""))[:120]
    if kind == "action":
        params = request.get("params") or {}
        target = params.get("target") if isinstance(params, Mapping) else None
        entity = (target.get("entity_id") if isinstance(target, Mapping) else None) or \
            (params.get("entity_id") if isinstance(params, Mapping) else None)
        parts = [str(request.get("action", "?"))]
        if isinstance(params, Mapping) and isinstance(params.get("server"), str) and \
                isinstance(params.get("tool"), str):  # mcp_call: the tool's offered name
            parts.append(f"{params['server']}__{params['tool']}")
        if isinstance(params, Mapping) and params.get("domain") and params.get("service"):
            parts.append(f"{params['domain']}.{params['service']}")
        if entity:
            parts.append(str(entity))
        return escape(" ".join(parts))[:120]
    if kind == "admission":
        return escape(f"{request.get('sender_name', '')} ({request.get('identity', '')})")[:120]
    return escape(str(request.get("question", "")))[:120]
