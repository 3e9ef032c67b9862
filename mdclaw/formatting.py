"""Pure text rules of the orchestrator: triggers, the prompt format, reply clean-up."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from mdclaw import schedule
from mdclaw.config import format_size

_INTERNAL = re.compile(r"<internal>.*?(?:</internal>|\Z)", re.DOTALL | re.IGNORECASE)


# Words a person may put before the name when addressing someone ("Hey Andy, ...").
_GREETINGS = ("hey", "hi", "hello", "ok", "okay", "yo", "dear", "hallo", "hej")


@lru_cache(maxsize=256)
def address_regexes(trigger: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The two written forms of addressing the assistant named by `trigger`: "@Name"
    anywhere (as a word), and the name first (after an optional greeting) followed by ","
    or ":" or ending the message ("Andy, ...", "hey andy: ...", "Andy?")."""
    name = trigger.strip().lstrip("@").strip()
    if not name:
        raise ValueError("empty trigger")
    at = re.compile(rf"(?<![\w@.])@{re.escape(name)}(?![\w@])", re.IGNORECASE)
    greeting = "|".join(_GREETINGS)
    first = re.compile(
        rf"^\W*(?:(?:{greeting})\b[\s,!]*)?{re.escape(name)}(?![\w@])"
        rf"\s*(?:[,:]|[!?.]*\s*\Z)", re.IGNORECASE)
    return at, first


def addresses(text: str, trigger: str) -> bool:
    """True if `text` addresses the assistant by its trigger: "@Andy" anywhere, or "Andy,"
    / "Andy:" / "Hey Andy, ..." / "Andy?" at the start. A passing mention ("I told andy
    yesterday", "andy's bike") does not. Replies to the assistant and the chat service's
    own mention of the bot are the channel's to say (InboundMessage.addressed)."""
    at, first = address_regexes(trigger)
    text = text or ""
    return bool(at.search(text) or first.match(text))


def strip_internal(text: str) -> str:
    """Remove `<internal>…</internal>` reasoning the agent keeps to itself; trim the rest."""
    return _INTERNAL.sub("", text or "").strip()


@dataclass(frozen=True)
class PromptMessage:
    sender_name: str
    content: str
    timestamp: str  # ISO-8601 UTC
    #: Files that came with the message, as the host saved them (mdclaw.media.Saved.as_dict).
    attachments: tuple[Mapping[str, Any], ...] = ()
    #: The chat it came from, shown only when the group answers in several chats.
    chat: str | None = None


# The facts of a file, in the order the <attachment> element gives them.
_FILE_ATTRS = (("kind", "kind"), ("path", "path"), ("name", "name"), ("mime", "type"),
               ("size", "size"), ("caption", "caption"), ("error", "not_saved"),
               ("transcript_note", "transcript"))


def format_attachment(file: Mapping[str, Any], text: str = "") -> str:
    """One file of a message as the agent reads it: an <attachment> element whose facts are
    quoted attributes (the transcript of a voice note its escaped content). The host writes
    these; a person's text is escaped (`<` becomes `&lt;`), so it can never make one.
    A saved file has `path`; one that was not has `not_saved` (the reason) and `name`."""
    parts = ["<attachment"]
    for key, attr in _FILE_ATTRS:
        value = file.get(key)
        if value is None or value == "":
            continue
        if key == "name" and file.get("path"):
            continue  # the path ends with it
        if key == "caption" and str(value).strip() == text.strip():
            continue  # the message's text already
        if key == "size" and isinstance(value, int):
            value = format_size(value)
        parts.append(f" {attr}={quoteattr(str(value))}")
    transcript = file.get("transcript")
    if isinstance(transcript, str):
        return "".join(parts) + f"><transcript>{escape(transcript)}</transcript></attachment>"
    return "".join(parts) + "/>"


def message_body(m: PromptMessage) -> str:
    """The inside of a <message> element: the escaped text, then its files' elements."""
    lines = [escape(m.content)] if m.content.strip() or not m.attachments else []
    lines += [format_attachment(f, m.content) for f in m.attachments]
    return "\n".join(lines)


def local_time(iso: str, tz: str) -> str:
    try:
        dt: datetime = schedule.from_iso(iso).astimezone(schedule.get_zone(tz))
    except (ValueError, schedule.ScheduleError):
        return iso
    return dt.strftime("%Y-%m-%d %H:%M")


def format_prompt(messages: Sequence[PromptMessage], tz: str, *, max_messages: int = 50,
                  max_chars: int = 60_000, failed: Sequence[str] = ()) -> str:
    """The agent's prompt: the newest messages (capped), escaped, as XML with sender and
    local time. `failed` lists earlier replies that could not be delivered."""
    kept = list(messages)[-max_messages:]
    lines = [
        f"<message sender={quoteattr(m.sender_name)}"
        f"{f' chat={quoteattr(m.chat)}' if m.chat else ''} "
        f"time={quoteattr(local_time(m.timestamp, tz))}>{message_body(m)}</message>"
        for m in kept
    ]
    # Keep the newest messages within the character budget.
    total, start = 0, len(lines)
    while start > 0 and total + len(lines[start - 1]) <= max_chars:
        total += len(lines[start - 1])
        start -= 1
    body = "\n".join(lines[start:])
    out = f"<messages>\n{body}\n</messages>"
    if failed:
        notes = "\n".join(f"<failed>{escape(f)}</failed>" for f in failed)
        out += f"\n<delivery_failures>\n{notes}\n</delivery_failures>"
    return out
