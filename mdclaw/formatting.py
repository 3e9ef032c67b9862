"""Pure text rules of the orchestrator: triggers, the prompt format, reply clean-up."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from xml.sax.saxutils import escape, quoteattr

from mdclaw import schedule

_INTERNAL = re.compile(r"<internal>.*?(?:</internal>|\Z)", re.DOTALL | re.IGNORECASE)


@lru_cache(maxsize=256)
def trigger_regex(trigger: str) -> re.Pattern[str]:
    """A case-insensitive whole-word pattern for `trigger`.

    "@Andy" and "Andy" configure the same trigger: either matches "@Andy hi", "hey andy," but
    not "Andyman" or "email@andy.com". Regex characters in the name are taken literally.
    """
    name = trigger.strip().lstrip("@").strip()
    if not name:
        raise ValueError("empty trigger")
    return re.compile(rf"(?<![\w@.])@?{re.escape(name)}(?![\w@])", re.IGNORECASE)


def mentions_trigger(text: str, trigger: str) -> bool:
    return bool(trigger_regex(trigger).search(text or ""))


def strip_internal(text: str) -> str:
    """Remove `<internal>…</internal>` reasoning the agent keeps to itself; trim the rest."""
    return _INTERNAL.sub("", text or "").strip()


@dataclass(frozen=True)
class PromptMessage:
    sender_name: str
    content: str
    timestamp: str  # ISO-8601 UTC


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
        f"<message sender={quoteattr(m.sender_name)} time={quoteattr(local_time(m.timestamp, tz))}>"
        f"{escape(m.content)}</message>"
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
