"""How a scheduled task runs: through its group's queue, in the group's one container.

The scheduler (mdclaw.scheduler) decides when a task is due and hands it to `TaskRuns.execute`,
which queues it (tasks go before messages) and waits for its result text. A task runs with
the group's session for `context_mode: group` and a fresh one for `isolated`; its result goes
to the task's chat; a scheduled run is single-turn, so its container is closed once it
answered.

A task that comes due while its group's conversation container runs does not wait for the
idle timer (`make_way`): an idle conversation (every turn answered) is closed at once, a busy
one as soon as its turn's answer is out (no follow-up is fed into it meanwhile, see
mdclaw.turns); when every container slot is taken, the conversation of another group that
has been idle longest is closed. The run log says when the task started and what it waited
for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from mdclaw import failures
from mdclaw.config import Config
from mdclaw.failures import TurnFailure
from mdclaw.launch import Launcher, RunFailed, RunRefused
from mdclaw.queue import GroupQueue, Job, TaskRun
from mdclaw.replies import Replies, failure_context
from mdclaw.schedule import utc_now
from mdclaw.state import Database
from mdclaw.state.conversations import get_session
from mdclaw.state.groups import get_group
from mdclaw.state.tasks import TaskRow, mark_run_started
from mdclaw.turns import Conversation

# Logged under the name these lines had before they moved here, so that journal filters
# and log readers keep working.
log = logging.getLogger("mdclaw.orchestrator")


class TaskRuns:
    """Scheduled tasks through the queue (see the module's notes). `conversations` is the
    orchestrator's own map of the runs in progress (group -> mdclaw.turns.Conversation),
    shared: a task's run is entered there, and a due task makes a conversation there yield.
    `engine_wait()` is how long a run waits for an engine that is not ready yet."""

    def __init__(self, db: Database, *, config: Callable[[], Config], queue: GroupQueue,
                 launcher: Launcher, replies: Replies,
                 conversations: dict[str, Conversation],
                 engine_wait: Callable[[], float]) -> None:
        self.db = db
        self._config = config
        self.queue = queue
        self.launcher = launcher
        self.replies = replies
        self.conversations = conversations
        self._engine_wait = engine_wait

    async def execute(self, task: TaskRow) -> str:
        """The scheduler's executor: run `task` through the queue; return its result text.

        Raises RunFailed when the run failed after the queue's retries.
        """
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if not self.queue.enqueue_task(task.group_folder, task.id,
                                       payload=TaskRun(task, fut, time.perf_counter())):
            raise RunFailed(f"task {task.id} is already queued or running")
        waits_for = self.make_way(task)
        job = self.queue.find("task", task.id)
        if job is not None and isinstance(job.payload, TaskRun):
            job.payload = replace(job.payload, waits_for=waits_for)
        return await fut

    def make_way(self, task: TaskRow) -> str | None:
        """`task` was just queued: free its group's container for it. Returns what it waits
        for (None: nothing, it starts now; else a phrase for the run log).

        One container per group: an idle conversation is closed at once (nothing is lost;
        the next message starts a new container with the same session), a busy one as soon
        as its turn is answered; a running task is single-turn and ends by itself.
        """
        return self.make_way_for(task.group_folder, task.id)

    def make_way_for(self, folder: str, job_id: str) -> str | None:
        """`make_way` for the task-kind job `job_id` of `folder` (a task, or another
        agent's question: mdclaw.agentasks)."""
        task_id = job_id
        ahead = [j.id for j in self.queue.pending(folder) if j.kind == "task" and j.id != task_id]
        after = f" and for task(s) {', '.join(ahead)} queued before it" if ahead else ""
        job = self.queue.running_job(folder)
        if job is not None and job.kind == "task":
            if job.id == task_id:
                return None  # picked at once
            return f"for task {job.id} to finish{after}"
        if job is None:
            if ahead:
                return after.removeprefix(" and ")
            if self.queue.running_count < self.queue.max_concurrent:
                return None
            freed = self._close_idle_elsewhere(folder)
            if freed:
                return f"for group {freed}'s idle conversation, closed to free a container slot"
            return "for a free container slot (limits.max_concurrent_containers)"
        conv = self.conversations.get(folder)
        if conv is None or conv.scheduled:
            return f"for the group's current run to finish{after}"
        if not conv.yield_for_task():
            log.info("group %s: task %s is due; the conversation ends after its turn",
                     folder, task_id)
            return f"for the conversation's turn to finish{after}"
        handle = self.launcher.handle(folder)
        if handle is not None:
            log.info("group %s: task %s is due; closing the idle conversation", folder, task_id)
            handle.close()
        return f"for the idle conversation, closed for it, to end{after}"

    def _close_idle_elsewhere(self, folder: str) -> str | None:
        """Every container slot is taken: close the conversation idle longest (of another
        group) so a due task of `folder` gets its slot. Returns that group, or None."""
        best: tuple[float, str] | None = None
        for other in self.queue.running_groups():
            conv = self.conversations.get(other)
            handle = self.launcher.handle(other)
            if (other == folder or conv is None or conv.scheduled or conv.busy
                    or handle is None or handle.closed):
                continue
            if best is None or handle.last_activity < best[0]:
                best = (handle.last_activity, other)
        if best is None:
            return None
        self.conversations[best[1]].yield_for_task()
        log.info("group %s: closing its idle conversation so a due task of %s can start",
                 best[1], folder)
        handle = self.launcher.handle(best[1])
        if handle is not None:
            handle.close()
        return best[1]

    def _starting(self, task: TaskRow, job: Job) -> None:
        """Record in the run log that `task` is handed to the container runner now, and what
        it waited for (when it waited at all)."""
        run = job.payload if isinstance(job.payload, TaskRun) else None
        waited = time.perf_counter() - (run.queued_at if run else time.perf_counter())
        why = run.waits_for if run else None
        note = f"waited {waited:.1f} s {why}" if why else None
        if note:
            log.info("task %s: %s", task.id, note)
        try:
            mark_run_started(self.db, task.id, utc_now(), note)
        except Exception:  # noqa: BLE001 - the log line is bookkeeping; the run goes on
            log.exception("task %s: could not record its start", task.id)

    async def run(self, job: Job) -> str:
        """The queue picked `job`, a task's: run it and hand its result to the scheduler."""
        run = job.payload
        assert isinstance(run, TaskRun)
        result = await self._run(run.task, job)
        if not run.future.done():
            run.future.set_result(result)
        return result

    async def _run(self, task: TaskRow, job: Job) -> str:
        group = get_group(self.db, task.group_folder)
        if group is None or group.jid is None:
            raise RunFailed(f"task {task.id}: group {task.group_folder!r} is not registered")
        # A per_chat group's task continues the conversation of the chat it reports to.
        line = task.chat_jid if group.per_chat and task.chat_jid in group.all_chats else None
        session = (get_session(self.db, group.folder, line) if task.context_mode == "group"
                   else None)
        texts: list[str] = []
        errors: list[TurnFailure] = []
        conv = self.conversations[group.folder] = Conversation.for_task()
        conv.replied_in = task.chat_jid or None  # what it asks for comes from its chat

        def on_output(block: str) -> None:
            out = self.replies.parse_block(group, block, line)
            if out is not None and out.status == "error":
                errors.append(self.launcher.refine(group, TurnFailure.from_block(out)))
            elif out is not None:
                text = self.replies.deliver(group, out, task.chat_jid)
                if text:
                    texts.append(text)
            # A scheduled run is single-turn: close it once it answered.
            handle = self.launcher.handle(group.folder)
            if handle is not None:
                handle.close()

        try:
            result = await self.launcher.run(
                group, lambda f: self.launcher.container_input(
                    group, task.prompt, session=session, scheduled=True, fields=f,
                    chat=task.chat_jid or None), on_output,
                engine_wait=self._engine_wait(), on_start=lambda: self._starting(task, job))
        except RunRefused as e:
            self.replies.refused(group, e.verdict, task.chat_jid or None)
            raise
        finally:
            self.conversations.pop(group.folder, None)
        stopped = self.launcher.stopped(group.folder, result)
        if stopped is not None:
            self.replies.refused(group, stopped, task.chat_jid or None)
            raise RunRefused(stopped)
        if result.status != "success" and not texts or errors and not texts:
            failure = errors[-1] if errors else self.launcher.refine(
                group, failures.from_result(result))
            text = failures.describe(failure, failure_context(self._config(), group))
            raise RunFailed(f"{text} ({failure.cause}: {failure.detail or '-'})", failure)
        return "\n\n".join(texts)

    def failed(self, job: Job, error: BaseException, failure: TurnFailure) -> None:
        """The queue gave up on a task's job: its result is that error."""
        if isinstance(job.payload, TaskRun) and not job.payload.future.done():
            job.payload.future.set_exception(error if isinstance(error, RunFailed)
                                             else RunFailed(str(error), failure))

    def abandon(self, jobs: list[Job]) -> None:
        """Jobs the queue dropped at shutdown: their scheduled runs end with that reason."""
        for job in jobs:
            if isinstance(job.payload, TaskRun) and not job.payload.future.done():
                job.payload.future.set_exception(
                    RunFailed("mdclaw stopped before the task could run"))
