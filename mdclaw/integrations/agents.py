"""The `ask_agent` action: an agent asks another group's agent a question (docs/ipc-protocol.md).

`{"action": "ask_agent", "params": {"group": "research", "question": "...", "timeout": 600}}`.
Who may ask whom is `groups.<g>.may_ask` alone (the action's gate: `groups.<g>.actions` does
not open it, and a group with no `may_ask` is refused, the rule named). The request is an
off-loop job: the IPC loop only checks and records it; the worker hands it to the host's
*asker*, which runs one turn of the other group's agent and gives back its answer.

The asker is a port (`AgentAsker`): the daemon installs the orchestrator's
(mdclaw.agentasks.AgentAsks) with `install`; this module never imports upward. Elsewhere
(`mdclaw ipc drain`) no agent runs, so a request gets an error result saying so.

What the asker promises (held by tests/test_ask_agent_daemon.py):
- the question reaches the other agent as a message from `agent:<caller>`, never as a
  person's: it is not stored in the other group's chat, so no trigger, member rule or
  approval ever reads it;
- the other agent's answer is the result, and is not posted in its chat (its chat shows
  nothing of the exchange);
- a chain of asks is at most `limits.ask_depth` deep, and asking an agent that is waiting in
  the chain already (A asks B, B asks A) is refused at once: it could only wait for itself;
- the other agent's model use is counted against the caller's daily budget too;
- a failed or timed-out turn gives an error result saying why, never a hang.
"""

from __future__ import annotations

from typing import Any, Protocol

from mdclaw.config import Config
from mdclaw.ipc.actions import ActionFailed, OffloopContext, action
from mdclaw.ipc.auth import Caller

QUESTION_MAX = 20_000
DEFAULT_TIMEOUT = 600.0  # seconds the caller waits for the answer, unless it says
MIN_TIMEOUT, MAX_TIMEOUT = 5.0, 3600.0
NOT_HERE = ("other agents run in the daemon (`mdclaw run`); none runs in this process, so "
            "ask_agent cannot be answered here")


class AskFailed(ActionFailed):
    """The question got no answer: refused (depth, cycle, no such group), the other agent's
    turn failed, or it timed out. str(e) is the error result."""


class AgentAsker(Protocol):
    """What the action needs of the host: run one turn of `target`'s agent with `question`
    from `caller`'s agent and return its answer text. Raises AskFailed."""

    async def ask(self, caller: str, target: str, question: str, *, request_id: str,
                  timeout: float) -> str: ...


_current: AgentAsker | None = None


def install(asker: AgentAsker | None) -> None:
    """Make `asker` the one ask_agent uses (None: none)."""
    global _current
    _current = asker


def current() -> AgentAsker | None:
    return _current


def may_ask_refusal(cfg: Config, folder: str) -> str | None:
    """The gate: a group may call ask_agent when its `may_ask` lists some group."""
    group = cfg.groups.get(folder)
    if group is None or not group.may_ask:
        return (f"action 'ask_agent' is not allowed for group {folder!r}: "
                f"groups.{folder}.may_ask lists no group")
    return None


def _ask_of(caller: Caller, cfg: Config | None, params: dict[str, Any]
            ) -> tuple[str, str, float]:
    target = params.get("group")
    question = params.get("question")
    if not isinstance(target, str) or not target:
        raise ActionFailed("ask_agent needs 'group': the folder of the group whose agent to ask")
    if not isinstance(question, str) or not question.strip() or len(question) > QUESTION_MAX:
        raise ActionFailed(f"ask_agent needs a 'question' of 1 to {QUESTION_MAX} characters")
    timeout = params.get("timeout", DEFAULT_TIMEOUT)
    if (not isinstance(timeout, int | float) or isinstance(timeout, bool)
            or not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT):
        raise ActionFailed(f"ask_agent 'timeout' must be {MIN_TIMEOUT:g} to {MAX_TIMEOUT:g} "
                           "seconds")
    if cfg is not None:
        group = cfg.groups.get(caller.folder)
        allowed = group.may_ask if group is not None else ()
        if target not in allowed:
            shown = ", ".join(allowed) if allowed else "empty"
            raise ActionFailed(f"group {caller.folder!r} may not ask the agent of {target!r}: "
                               f"groups.{caller.folder}.may_ask ({shown}) does not list it")
    return target, question, float(timeout)


def _check(caller: Caller, params: dict[str, Any]) -> None:
    if current() is None:
        raise ActionFailed(NOT_HERE)
    _ask_of(caller, None, params)


@action("ask_agent", offloop=True, max_attempts=1, timeout=MAX_TIMEOUT + 60.0, check=_check,
        gate=may_ask_refusal)
async def ask_agent(ctx: OffloopContext, params: dict[str, Any]) -> dict[str, Any]:
    """The other agent's answer: {group, answer}."""
    asker = current()
    if asker is None:
        raise ActionFailed(NOT_HERE)
    target, question, timeout = _ask_of(ctx.caller, ctx.cfg, params)
    if ctx.waiting is not None:
        # From here on this job only waits for the other agent: it frees its place among
        # limits.action_jobs (the asked agent's own actions may need it), keeping its
        # group's action_jobs_per_group slot (a group cannot open asks without bound).
        ctx.waiting()
    answer = await asker.ask(ctx.caller.folder, target, question,
                             request_id=ctx.request_id, timeout=timeout)
    return {"group": target, "answer": answer}
