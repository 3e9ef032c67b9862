"""Why an agent turn failed, what happens next, and what the chat is told.

One table, `CAUSES`, maps every cause to

* a policy: `transient` (retried with backoff; the chat is told once that a retry is coming,
  and again only if mdclaw gives up), `deterministic` (not retried blindly: the message is
  set aside, marked failed, and the chat is told why at once) or `config` (the operator must
  change something: the chat is told at once, with the fix);
* the chat text saying what went wrong, in plain words (no secrets, no stack traces, no
  container ids) — `chat_message` adds what happens now;
* what the operator can do (docs/troubleshooting.md lists the same).

Causes come from the agent runner's error blocks (`cause`, one of mdclaw.wire.RUNNER_CAUSES,
read through mdclaw.wire.OutputBlock), from what the host sees itself (the
container was OOM-killed, killed or vanished, the image is missing, the engine is down, the
credential proxy failed) and from checks before a run (no model configured, the backend is not
in the image, the key file is missing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from mdclaw.budget import BUDGET_PREFIX
from mdclaw.retry import NO_JITTER, Backoff
from mdclaw.runtime import EngineCallError, EngineUnavailable, ImageError
from mdclaw.wire import OutputBlock

TRANSIENT = "transient"
DETERMINISTIC = "deterministic"
CONFIG = "config"


@dataclass(frozen=True)
class Cause:
    name: str
    policy: str
    what: str  # chat text: what went wrong ({placeholders} from the failure and the config)
    operator: str  # what the operator can do about it
    then: str = ""  # deterministic causes: what the user can do now
    fix: str = ""  # config causes: the fix, as said in the chat
    max_tries: int | None = None  # transient: tries in all (None: limits.run_attempts)


_CAUSES = (
    # ---- transient: retried with backoff
    Cause("model_unreachable", TRANSIENT,
          "The model server at {server} is not answering.",
          "Start the model server, or fix models.<name>.base_url; `mdclaw doctor` checks that "
          "it answers."),
    Cause("model_disconnected", TRANSIENT,
          "The model server at {server} closed the connection without answering.",
          "Look at the model server's log: it crashed or was restarted while answering."),
    Cause("model_server_error", TRANSIENT,
          "The model server at {server} had an internal error (HTTP {status}).",
          "Look at the model server's log; a 5xx is its own failure."),
    Cause("rate_limited", TRANSIENT,
          "The model server at {server} says I'm sending too many requests right now.",
          "Wait, or raise the rate limit of the API account; the retry waits as long as the "
          "API asks (Retry-After)."),
    Cause("engine_down", TRANSIENT,
          "The container engine on the server is not reachable.",
          "Start Docker or Podman's API service (`podman system service`); `mdclaw doctor` "
          "checks it."),
    Cause("container_killed", TRANSIENT,
          "My container was stopped while I was working on that.",
          "Something killed the container (an engine restart, `docker kill`, the host's OOM "
          "killer when the engine does not report it as such); `journalctl -u mdclaw` and "
          "the engine's log say more.", max_tries=3),
    Cause("container_start", TRANSIENT,
          "My container could not be started.",
          "The engine refused to create or start the container; the daemon log has the "
          "engine's reason."),
    Cause("proxy_failure", TRANSIENT,
          "The connection to the model could not be set up on the server.",
          "The credential proxy could not listen in ipc/<group>/ (a data_dir path too long "
          "for a unix socket, or a permission problem); the daemon log names it."),
    Cause("proxy_missing", TRANSIENT,
          "The connection to the model was not there when my container started.",
          "The credential proxy's socket was missing inside the container; check that "
          "data_dir is on a file system that supports unix sockets.", max_tries=2),
    Cause("agent_crash", TRANSIENT,
          "Something went wrong inside my container.",
          "A bug in the agent runner or the image; `mdclaw failures` and the daemon log "
          "have the container's last lines.", max_tries=2),
    # ---- deterministic: set aside, not retried blindly
    Cause("context_too_long", DETERMINISTIC,
          "That message is too long for the model{limit_paren}.",
          "Use a model with a larger context window; the runner already trims the oldest "
          "history once and tries again before this is said.",
          then="Please send it in shorter parts."),
    Cause("model_refused", DETERMINISTIC,
          "The model server refused that request (HTTP {status}{api_message_colon}).",
          "The model API rejected the request for good; the API message says why (a wrong "
          "model name, a revoked key, content rules).",
          then="Please rephrase it; your next message gets a fresh start."),
    Cause("model_malformed", DETERMINISTIC,
          "The model server at {server} sent a broken answer twice in a row.",
          "The model server answers with something that is not the OpenAI API's JSON; check "
          "its version and that base_url points at its OpenAI-compatible /v1."),
    Cause("turn_timeout", DETERMINISTIC,
          "That took longer than my time limit ({limit}), so I stopped.",
          "Raise groups.<g>.timeout or limits.container_timeout if long work is expected.",
          then="Please ask for something smaller."),
    Cause("tool_crash", DETERMINISTIC,
          "One of my tools failed while I was working on that.",
          "A bug in one of the agent's tools; the daemon log has the container's last lines."),
    Cause("oom_killed", DETERMINISTIC,
          "I ran out of memory (limit {memory}) while working on that.",
          "Raise limits.memory if the agent's work needs more.",
          then="Please ask for something smaller."),
    Cause("invalid_input", DETERMINISTIC,
          "The server sent my container something it could not read.",
          "A bug: the host and the image disagree on the ContainerInput; rebuild the image "
          "from the same mdclaw version."),
    # ---- config: answered at once with the fix
    Cause("no_model", CONFIG,
          "No model is configured for this chat.",
          "Add a `models:` entry and set `assistant.model` (or the group's `model`); see "
          "docs/configuration.md.",
          fix="add a `models:` entry to the config and set `assistant.model` — see "
              "docs/configuration.md"),
    Cause("backend_missing", CONFIG,
          "The {backend} backend this chat uses is not in the agent image {image}.",
          "Rebuild the image with the backend (`container/build-wheelhouse.sh --claude`, then "
          "`mdclaw image build`), or give the group an openai model.",
          fix="rebuild the image with the {backend} backend (for claude: "
              "`container/build-wheelhouse.sh --claude`, then `mdclaw image build`)"),
    Cause("key_missing", CONFIG,
          "The server cannot read the API key for the model {model_key}.",
          "Put the key into the file named by models.<name>.api_key_file, readable by the "
          "mdclaw user only.",
          fix="put the key into the file named by models.{model_key}.api_key_file"),
    Cause("image_missing", CONFIG,
          "The agent image {image} is not on the server.",
          "Build it (`mdclaw image build`) or load it (`mdclaw image load`).",
          fix="run `mdclaw image build` (or `mdclaw image load`)"),
    Cause("over_budget", CONFIG,
          "The model account is out of credit or quota{api_message_paren}.",
          "Add credit or raise the quota of the API account.",
          fix="add credit or raise the quota of the model's API account"),
)

CAUSES: dict[str, Cause] = {c.name: c for c in _CAUSES}

# BUDGET_PREFIX: how the credential proxy's refusal for a group's daily token budget begins
# (mdclaw/budget.py budget_message): an over_budget failure whose API message starts so is the
# host's own budget, not the provider's account, and the message says when it resets.


def is_group_budget(failure: TurnFailure) -> bool:
    return failure.cause == "over_budget" and (failure.api_message or "").startswith(
        BUDGET_PREFIX)
UNKNOWN = "agent_crash"


def rule(cause: str) -> Cause:
    """The table entry for `cause` (an unknown cause is an agent crash)."""
    return CAUSES.get(cause) or CAUSES[UNKNOWN]


# --------------------------------------------------------------------------- a failure


@dataclass
class TurnFailure:
    """One failed turn: its cause and the details the chat message and the log need."""

    cause: str
    detail: str = ""  # for the log and `mdclaw failures` (redacted), never for the chat
    http_status: int | None = None
    api_message: str | None = None
    retry_after: float | None = None
    limit: str | None = None
    exit_code: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            self.detail = f"[{self.cause}] {self.detail}".strip()
            self.cause = UNKNOWN
        self.detail = redact(self.detail)[:500]
        if self.api_message is not None:
            self.api_message = redact(self.api_message)[:200]

    @property
    def policy(self) -> str:
        return rule(self.cause).policy

    @classmethod
    def from_block(cls, block: OutputBlock | Mapping[str, Any]) -> TurnFailure:
        """From an error block of the agent runner (a mapping is read as the host reads a
        block: mdclaw.wire.OutputBlock.from_dict). A cause this host does not know becomes
        agent_crash, named in the detail."""
        if not isinstance(block, OutputBlock):
            block = OutputBlock.from_dict(block)
        unknown = block.ignored.get("cause")
        cause = block.cause or (unknown if isinstance(unknown, str) and unknown else UNKNOWN)
        return cls(cause=cause, detail=block.error or "", http_status=block.http_status,
                   api_message=block.api_message, retry_after=block.retry_after,
                   limit=block.limit)


def from_result(result: Any) -> TurnFailure:
    """What the host saw of a run that ended without a usable answer (a runner
    ContainerResult): timed out, OOM-killed, killed or vanished, or an exit without a
    structured error."""
    code = int(getattr(result, "exit_code", -1))
    tail = str(getattr(result, "stderr_tail", "") or "").strip().splitlines()[-3:]
    detail = f"exit status {code}" + (f"; last lines: {' | '.join(tail)}" if tail else "")
    if getattr(result, "timed_out", False):
        return TurnFailure("turn_timeout", detail="no output before the hard timeout",
                           exit_code=code)
    if getattr(result, "oom_killed", False):
        return TurnFailure("oom_killed", detail=detail, exit_code=code)
    error = str(getattr(result, "error", "") or "")
    if code in (-1, 137, 143) or error.startswith("reading container output failed"):
        why = "the container vanished" if code == -1 else "the container was killed"
        return TurnFailure("container_killed", detail=f"{why} ({detail}) {error}".strip(),
                           exit_code=code)
    if code == 2:
        return TurnFailure("invalid_input", detail=detail, exit_code=code)
    return TurnFailure("agent_crash", detail=detail, exit_code=code)


def from_exception(e: BaseException) -> TurnFailure:
    """A run that could not start: the engine, the image, the credential proxy."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, EngineUnavailable):
        return TurnFailure("engine_down", detail=text)
    if isinstance(e, ImageError):
        return TurnFailure("image_missing", detail=text)
    if isinstance(e, EngineCallError):
        return TurnFailure("container_start", detail=text)
    if type(e).__name__ == "ProxyError":
        return TurnFailure("proxy_failure", detail=text)
    return TurnFailure("agent_crash", detail=text)


# --------------------------------------------------------------------------- chat text


def plural_times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def fmt_seconds(seconds: float) -> str:
    s = max(1, round(seconds))
    if s < 90:
        return f"{s} s"
    if s < 5400:
        return f"{round(s / 60)} min"
    return f"{round(s / 3600)} h"


def server_name(base_url: str | None) -> str:
    """The model server as the chat may see it: host and port, never credentials."""
    if not base_url:
        return "the provider"
    try:
        parts = urlsplit(base_url)
        host = parts.hostname or "?"
        return f"{host}:{parts.port}" if parts.port else host
    except ValueError:
        return "the configured address"


def _fields(failure: TurnFailure, ctx: dict[str, Any]) -> dict[str, str]:
    limit = failure.limit or ctx.get("limit")
    msg = failure.api_message
    out = {
        "server": server_name(ctx.get("base_url")),
        "status": str(failure.http_status or "error"),
        "limit": str(limit or "the configured limit"),
        "limit_paren": f" (limit {limit})" if limit else "",
        "api_message_colon": f": {msg}" if msg else "",
        "api_message_paren": f" ({msg})" if msg else "",
        "memory": str(ctx.get("memory") or "?"),
        "image": str(ctx.get("image") or "?"),
        "backend": str(ctx.get("backend") or "?"),
        "model_key": str(ctx.get("model_key") or "?"),
    }
    return out


def describe(failure: TurnFailure, ctx: dict[str, Any] | None = None) -> str:
    """What went wrong, as the chat is told (no 'what happens now')."""
    if is_group_budget(failure):
        return str(failure.api_message)
    c = rule(failure.cause)
    return c.what.format(**_fields(failure, ctx or {}))


def chat_message(failure: TurnFailure, ctx: dict[str, Any] | None = None, *,
                 outcome: str, delay: float | None = None, attempts: int = 1) -> str:
    """The one chat message for a failure.

    outcome: `retry` (a retry in `delay` seconds is coming), `gave_up` (transient, out of
    tries), `dropped` (deterministic: set aside), `config` (the operator must fix something),
    `resend` (the message could not be kept for a retry: send it again).
    """
    ctx = ctx or {}
    c = rule(failure.cause)
    what = describe(failure, ctx)
    if is_group_budget(failure):
        return (f"{what} Please send your message again after that; the server's operator "
                "can raise the budget (limits.tokens_per_day).")
    if outcome == "retry":
        return f"{what} I'll try again in {fmt_seconds(delay or 0)}."
    if outcome == "gave_up":
        return (f"{what} I tried {plural_times(attempts)} and gave up on that message; "
                "please send it again later.")
    if outcome == "config":
        return f"{what} I can't answer until the server's operator fixes it: " \
               f"{c.fix.format(**_fields(failure, ctx))}."
    if outcome == "resend":
        return f"{what} Please send your message again."
    then = c.then or "Your next message gets a fresh start."
    return f"{what} {then}"


def trimmed_notice(limit: str | None) -> str:
    """Told when the history was trimmed so a message could be answered."""
    paren = f" (limit {limit})" if limit else ""
    return (f"That message was too long for the model{paren} together with our conversation "
            "so far; I've answered without the oldest history.")


def retry_delay(attempts: int, base: float, retry_after: float | None = None,
                cap: float = 600.0) -> float:
    """Seconds before the next try after `attempts` failed ones: `base` doubling, at least
    what the API asked for (Retry-After), at most `cap`. Without jitter (the queue's retries
    add it: mdclaw.queue)."""
    delay = Backoff(base=base, factor=2.0, cap=cap, jitter=NO_JITTER).delay(attempts)
    if retry_after:
        delay = max(delay, retry_after)
    return min(delay, cap)


# --------------------------------------------------------------------------- redaction

_SECRETS = (
    (re.compile(r"(?i)\bbearer\s+[^\s\"',;]+"), "Bearer ***"),
    (re.compile(r"\b(?:sk|pk|rk|xox[abp]|ghp|gho|glpat)[-_][A-Za-z0-9_\-*]{6,}"), "***"),
    (re.compile(r"\b[0-9]{6,12}:[A-Za-z0-9_-]{30,}\b"), "***"),  # Telegram bot tokens
    (re.compile(r"\b[a-f0-9]{64}\b"), "***"),  # container ids, hashes
    (re.compile(r"(?i)\b(x-api-key|api[_-]?key|token|password|secret)([\"'=: ]+)"
                r"(?!\*\*\*)[^\s\"',;}]+"), r"\1\2***"),
    (re.compile(r"\b[A-Za-z0-9+/_-]{40,}={0,2}"), "***"),  # long opaque strings
    (re.compile(r"(?<=//)[^/\s:@]+:[^/\s@]+@"), "***@"),  # user:password@ in URLs
)


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """`text` with anything that looks like a key, token or container id replaced by ***,
    and the given `secrets` too."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, "***")
    for pattern, repl in _SECRETS:
        text = pattern.sub(repl, text)
    return text


__all__ = ["BUDGET_PREFIX", "CAUSES", "CONFIG", "DETERMINISTIC", "TRANSIENT", "Cause",
           "TurnFailure", "chat_message", "describe", "fmt_seconds", "from_exception",
           "from_result", "is_group_budget", "plural_times", "redact", "retry_delay", "rule",
           "server_name", "trimmed_notice"]
