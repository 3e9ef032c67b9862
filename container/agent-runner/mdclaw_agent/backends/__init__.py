"""Model backends. Each keeps one conversation open and answers one user turn at a time.

A backend has `start()`, `turn(text) -> TurnResult`, and `close()`; the runner feeds it the
first prompt and then each follow-up, and prints each TurnResult between the output markers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mdclaw_agent.protocol import ContainerInput


class BackendError(Exception):
    """A turn failed. The message is for the log; `cause` (one of protocol.CAUSES) is what
    the host acts on, with the details it needs for the chat message: the HTTP status and
    the API's own message, the retry-after of a rate limit, the model's context limit."""

    def __init__(self, message: str, cause: str = "agent_crash", *,
                 http_status: int | None = None, api_message: str | None = None,
                 retry_after: float | None = None, limit: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        self.http_status = http_status
        self.api_message = api_message
        self.retry_after = retry_after
        self.limit = limit

    def info(self) -> dict[str, Any]:
        """The structured fields of the output block (camelCase like newSessionId)."""
        out: dict[str, Any] = {"cause": self.cause}
        for key, value in (("httpStatus", self.http_status), ("apiMessage", self.api_message),
                           ("retryAfter", self.retry_after), ("limit", self.limit)):
            if value is not None:
                out[key] = value
        return out


# How model APIs say a request is over the context window (OpenAI, vLLM, llama.cpp, Ollama,
# Anthropic), matched case-insensitively against the error body.
CONTEXT_HINTS = ("context_length_exceeded", "maximum context length", "context length",
                 "context window", "prompt is too long", "too many tokens",
                 "exceeds the available context", "input is too long", "reduce the length")
QUOTA_HINTS = ("insufficient_quota", "exceeded your current quota", "credit balance",
               "billing", "budget")
_LIMIT_RES = (re.compile(r"maximum context length is (\d[\d,]*)\s*(tokens)?", re.I),
              re.compile(r"context (?:size|window|length)[^0-9]{0,20}(\d[\d,]*)", re.I),
              re.compile(r"> ?(\d[\d,]*) ?(?:tokens )?maximum", re.I),
              re.compile(r"(\d[\d,]*)\s*tokens", re.I))


def context_limit(text: str) -> str | None:
    """The model's context limit as the API put it ("8192 tokens"), when it says."""
    for pattern in _LIMIT_RES:
        m = pattern.search(text)
        if m:
            return f"{m.group(1).replace(',', '')} tokens"
    return None


def api_message(body: str) -> str:
    """The API's own error message out of an error body (OpenAI {"error": {"message"}},
    Ollama {"error": "..."}, Anthropic {"error": {"message"}}), else the body's start."""
    try:
        data = json.loads(body)
    except ValueError:
        return " ".join(body.split())[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or err.get("type") or ""
    else:
        msg = err
    return " ".join(str(msg).split())[:300]


def classify_http(status: int, body: str, retry_after: str | None = None) -> BackendError:
    """The BackendError for an HTTP error answer of the model API (or of the host's
    credential proxy, whose own errors have a type starting with `mdclaw_`)."""
    message = api_message(body)
    low = body.lower()
    head = f"model API answered HTTP {status}: {message}"
    if "mdclaw_upstream_unreachable" in low:
        return BackendError(head, "model_unreachable", http_status=status)
    if "mdclaw_upstream_disconnected" in low:
        return BackendError(head, "model_disconnected", http_status=status)
    if "mdclaw_upstream_timeout" in low:
        return BackendError(head, "turn_timeout", http_status=status)
    if "mdclaw_key_unreadable" in low:
        return BackendError(head, "key_missing", http_status=status)
    if "mdclaw_over_budget" in low:
        # The host's daily token budget for this group: refused until it resets (the
        # message says when); not retried.
        return BackendError(head, "over_budget", http_status=status, api_message=message)
    if "mdclaw_proxy_busy" in low or "mdclaw_proxy_rate_limited" in low:
        # The host's own caps on this group's connections and requests: wait and retry.
        try:
            after = float(retry_after) if retry_after else 1.0
        except ValueError:
            after = 1.0
        return BackendError(head, "rate_limited", http_status=status, api_message=message,
                            retry_after=after)
    if status == 402 or (status in (400, 403, 429) and any(h in low for h in QUOTA_HINTS)):
        return BackendError(head, "over_budget", http_status=status, api_message=message)
    if status == 429:
        wait: float | None = None
        try:
            wait = float(retry_after) if retry_after else None
        except ValueError:
            wait = None
        return BackendError(head, "rate_limited", http_status=status, api_message=message,
                            retry_after=wait)
    if status in (400, 413, 422) and any(h in low for h in CONTEXT_HINTS):
        return BackendError(head, "context_too_long", http_status=status, api_message=message,
                            limit=context_limit(message))
    if status >= 500:
        return BackendError(head, "model_server_error", http_status=status,
                            api_message=message)
    return BackendError(head, "model_refused", http_status=status, api_message=message)


_BUDGET_MESSAGE = re.compile(r'mdclaw_over_budget\\?"\s*,\s*\\?"message\\?"\s*:\s*\\?"'
                             r'([^"\\]{1,300})')


def budget_message(text: str) -> str | None:
    """The host's over-budget message (which says when the budget resets) out of an error
    known only as text, when the text carries the proxy's JSON answer."""
    m = _BUDGET_MESSAGE.search(text)
    return m.group(1) if m else None


def classify_text(text: str) -> str:
    """A cause for an error known only as text (the claude backend's CLI errors)."""
    low = text.lower()
    if "mdclaw_over_budget" in low:
        return "over_budget"
    m = re.search(r"api error:? (\d{3})", low) or re.search(r"\bstatus(?: code)?:? (\d{3})", low)
    if m:
        return classify_http(int(m.group(1)), text).cause
    if any(h in low for h in CONTEXT_HINTS):
        return "context_too_long"
    if "rate limit" in low or "rate_limit" in low or "overloaded" in low:
        return "rate_limited"
    if any(h in low for h in QUOTA_HINTS) or "max_budget" in low:
        return "over_budget"
    if "connection" in low or "econnrefused" in low or "unable to connect" in low:
        return "model_unreachable"
    if "timed out" in low or "timeout" in low:
        return "turn_timeout"
    return "agent_crash"


@dataclass(frozen=True)
class TurnResult:
    text: str | None
    session_id: str | None = None
    # Something the host should tell the chat besides the answer, e.g. {"cause":
    # "context_too_long", "limit": "8192 tokens"} when the history was trimmed to answer.
    notice: dict[str, Any] | None = None


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
