"""Agents asking agents: one turn of a group's agent answering another agent's question.

The `ask_agent` action (mdclaw.integrations.agents) reaches the host through its port; the
daemon installs `AgentAsks.ask`. A question is queued for the asked group like a scheduled
task (tasks go before messages; an idle conversation of that group is closed for it, see
mdclaw.taskruns.make_way_for) and runs in the group's one container, with the group's own
session, as a single turn whose prompt is one message from `agent:<caller>`.

- **Never a person.** The question is not stored in the asked group's chat: no trigger, member
  rule, admission or approval ever reads it (those read stored messages and channel
  senders only). The prompt names the sender `agent:<caller>`.
- **The answer is the result.** The turn's answer blocks are collected (internal tags
  stripped) and returned; nothing is posted in the asked group's chat (what the agent sends
  itself with send_message still goes out, as for any run).
- **Depth and cycles.** While a group's agent answers a question, the chain of groups waiting
  for it is kept (`_chains`); a question it asks in turn extends the chain. A target already
  in the chain is refused at once (it is waiting for this very answer: its container is busy,
  so the question could only wait until it timed out); a chain longer than
  `limits.ask_depth` is refused naming that key.
- **Budget.** While the asked agent runs, the credential proxy counts its model use against
  every group waiting in the chain too (`CredentialProxy.charge_also`): each waiting group's
  daily budget is checked before the asked agent's requests, and its usage gets a row
  `asked:<group>/<model>`.
- **Failure.** A turn that fails, cannot start, or is stopped gives AskFailed with the
  reason, at once (no retries: the caller is waiting); past the caller's `timeout` the
  caller gets AskFailed and the question is dropped: not started yet, it is skipped;
  started, its container is stopped (the turn was for that answer alone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from mdclaw import failures
from mdclaw.config import Config
from mdclaw.failures import TurnFailure
from mdclaw.formatting import PromptMessage, format_prompt, strip_internal
from mdclaw.integrations.agents import AskFailed
from mdclaw.launch import Launcher, RunFailed, RunRefused
from mdclaw.queue import AgentAsk, GroupQueue, Job
from mdclaw.replies import Replies, failure_context
from mdclaw.state import Database
from mdclaw.state.conversations import get_session
from mdclaw.state.groups import get_group
from mdclaw.taskruns import TaskRuns
from mdclaw.turns import Conversation

log = logging.getLogger("mdclaw.agentasks")

AGENT_SENDER = "agent:"  # the prompt's sender of a question: agent:<asking group>


class AgentAsks:
    """Questions between agents (see the module's notes). Shares the orchestrator's queue,
    launcher, replies and map of runs in progress (`conversations`) with `tasks`."""

    def __init__(self, db: Database, *, config: Callable[[], Config], queue: GroupQueue,
                 launcher: Launcher, replies: Replies, tasks: TaskRuns,
                 conversations: dict[str, Conversation],
                 engine_wait: Callable[[], float]) -> None:
        self.db = db
        self._config = config
        self.queue = queue
        self.launcher = launcher
        self.replies = replies
        self.tasks = tasks
        self.conversations = conversations
        self._engine_wait = engine_wait
        # group -> the groups waiting for the answer its agent is working on now.
        self._chains: dict[str, tuple[str, ...]] = {}

    # ------------------------------------------------------------------ the port
    async def ask(self, caller: str, target: str, question: str, *, request_id: str,
                  timeout: float) -> str:
        """Run one turn of `target`'s agent with `question` from `caller`'s agent; its
        answer. Raises AskFailed (refused, failed, timed out)."""
        cfg = self._config()
        chain = self._chains.get(caller, ()) + (caller,)
        if target in chain:
            shown = " → ".join(chain + (target,))
            raise AskFailed(f"refused: {shown} is a cycle: the agent of {target!r} is waiting "
                            "for this answer already")
        if len(chain) > cfg.limits.ask_depth:
            shown = " → ".join(chain + (target,))
            raise AskFailed(f"refused: {shown} is {len(chain)} questions deep; "
                            f"limits.ask_depth is {cfg.limits.ask_depth}")
        group = get_group(self.db, target)
        if group is None or group.jid is None:
            raise AskFailed(f"group {target!r} is not registered: there is no agent to ask")
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        job_id = f"ask:{caller}:{request_id}"
        run = AgentAsk(caller, question, chain, request_id, fut, time.perf_counter())
        if not self.queue.enqueue_task(target, job_id, payload=run):
            raise AskFailed("the host is stopping or this question is asked already")
        waits_for = self.tasks.make_way_for(target, job_id)
        log.info("group %s: agent %s asks it a question (request %s, chain %s)%s", target,
                 caller, request_id, " → ".join(chain), f"; waits {waits_for}"
                 if waits_for else "")
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            run.abandoned = True
            await self._stop(target, job_id)
            raise AskFailed(f"the agent of {target!r} did not answer within {timeout:g} s"
                            ) from None

    async def _stop(self, folder: str, job_id: str) -> None:
        """The caller stopped waiting: if `folder`'s container is answering this question
        now, stop it (the turn was for that answer alone)."""
        job = self.queue.running_job(folder)
        handle = self.launcher.handle(folder)
        if job is None or job.id != job_id or handle is None:
            return  # not started yet: skipped when picked
        log.warning("group %s: the question it works on is no longer waited for; stopping "
                    "its container", folder)
        handle.close()
        try:
            await handle.kill()
        except Exception as e:  # noqa: BLE001 - the engine's error: the run's timer remains
            log.warning("group %s: could not stop its container: %s", folder, e)

    # ------------------------------------------------------------------ the run
    async def run(self, job: Job) -> str:
        """The queue picked a question's job: run the turn and hand the answer (or why
        there is none) to the waiting caller. Never raises for the turn's failure: the
        caller has it, and the queue must not retry (the caller waits)."""
        run = job.payload
        assert isinstance(run, AgentAsk)
        if run.abandoned or run.future.done():
            return ""
        try:
            answer = await self._run(job.group, run)
        except AskFailed as e:
            log.warning("group %s: no answer for agent %s: %s", job.group, run.caller, e)
            if not run.future.done():
                run.future.set_exception(e)
            return ""
        if not run.future.done():
            run.future.set_result(answer)
        return answer

    async def _run(self, folder: str, run: AgentAsk) -> str:
        group = get_group(self.db, folder)
        if group is None or group.jid is None:
            raise AskFailed(f"group {folder!r} is not registered: there is no agent to ask")
        cfg = self._config()
        prompt = format_prompt([PromptMessage(
            AGENT_SENDER + run.caller, run.question,
            datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"))],
            cfg.assistant.timezone)
        session = get_session(self.db, folder)
        texts: list[str] = []
        errors: list[TurnFailure] = []
        self.conversations[folder] = Conversation.for_task()
        self._chains[folder] = run.chain
        proxy = self.launcher.proxy
        if proxy is not None:
            proxy.charge_also(folder, [(g, cfg.token_budget(g)) for g in run.chain])

        def on_output(block: str) -> None:
            out = self.replies.parse_block(group, block)
            if out is not None and out.status == "error":
                errors.append(self.launcher.refine(group, TurnFailure.from_block(out)))
            elif out is not None:
                text = strip_internal(out.result or "")
                if text:
                    texts.append(text)
            # One turn: the container ends once it answered.
            handle = self.launcher.handle(folder)
            if handle is not None:
                handle.close()

        try:
            result = await self.launcher.run(
                group, lambda f: self.launcher.container_input(
                    group, prompt, session=session, scheduled=False, fields=f), on_output,
                engine_wait=self._engine_wait())
        except RunRefused as e:
            raise AskFailed(f"the agent of {folder!r} may not run now: "
                            f"{e.verdict.summary()}") from None
        except RunFailed as e:
            raise AskFailed(f"the agent of {folder!r} could not run: {e}") from None
        finally:
            self.conversations.pop(folder, None)
            self._chains.pop(folder, None)
            if proxy is not None:
                proxy.charge_also(folder, [])
        if texts and not errors:
            return "\n\n".join(texts)
        failure = errors[-1] if errors else self.launcher.refine(
            group, failures.from_result(result))
        if texts:  # an answer came, then the turn failed: the answer stands
            return "\n\n".join(texts)
        why = failures.describe(failure, failure_context(cfg, group))
        raise AskFailed(f"the agent of {folder!r} gave no answer: {why} "
                        f"({failure.cause}: {failure.detail or '-'})")

    # ------------------------------------------------------------------ shutdown
    @staticmethod
    def abandon(jobs: list[Job]) -> None:
        """Jobs the queue dropped at shutdown: their callers hear so."""
        for job in jobs:
            if isinstance(job.payload, AgentAsk) and not job.payload.future.done():
                job.payload.future.set_exception(
                    AskFailed("mdclaw stopped before the other agent could answer"))
