"""Model backends. Each keeps one conversation open and answers one user turn at a time.

A backend has `start()`, `turn(text) -> TurnResult`, and `close()`; the runner feeds it the
first prompt and then each follow-up, and prints each TurnResult between the output markers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mdclaw_agent.protocol import ContainerInput


class BackendError(Exception):
    """The model could not be reached or answered with an error; the message says which."""


@dataclass(frozen=True)
class TurnResult:
    text: str | None
    session_id: str | None = None


def read_text_quietly(path: Path, limit: int = 256 * 1024) -> str | None:
    """The file's text (at most `limit` bytes), or None when it is missing or unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return None


def system_prompt(inp: ContainerInput, group_dir: Path, global_dir: Path) -> str:
    """The assistant's standing instructions: who it is, the group's CLAUDE.md and the global
    memory file (main groups see the global file too, as everyone's shared memory)."""
    parts = [
        f"You are {inp.assistant_name}, a personal assistant in a chat group. Your final "
        "answer is sent to the chat. Use the send_message tool to say something right away "
        "while you keep working. Your working folder is the group's folder; files you keep "
        "there persist between conversations.",
    ]
    if inp.is_scheduled_task:
        parts.append("This run is a scheduled task, not a live message: do the task and "
                     "report the outcome.")
    global_memory = read_text_quietly(global_dir / "CLAUDE.md")
    if global_memory:
        parts.append("## Shared memory (global CLAUDE.md)\n" + global_memory.strip())
    group_memory = read_text_quietly(group_dir / "CLAUDE.md")
    if group_memory:
        parts.append("## This group's memory (CLAUDE.md)\n" + group_memory.strip())
    return "\n\n".join(parts)
