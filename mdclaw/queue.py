"""The per-group run queue: who gets a container next.

Rules:
* one job per group at a time (a group's agent works on one thing), and at most
  `max_concurrent` jobs across all groups;
* within a group, scheduled tasks go before messages, each kind first in, first out; when a
  slot frees, groups with a task waiting go first, then groups in the order their oldest job
  arrived;
* a job whose `run_job` raises is retried (unless the error has `permanent = True`) with
  exponential backoff (`max_attempts` tries in all, or the error's `max_tries` when fewer;
  `retry_base` seconds doubling up to `retry_cap`: 5, 10, 20, 40 s by default, each
  shortened at random by up to `retry_jitter` of itself (half by default, mdclaw.retry) so
  groups that failed together do not retry together; at least the error's `retry_delay`
  when it has one); `on_retry(job, error, delay)` is called before each wait.
  Meanwhile the group holds its place and its later jobs wait, so order is kept. After the
  last try the failure is recorded in `failures` and `on_failure(job, error)` is called to
  tell the user;
* a group whose message waits to retry still runs a task that comes due meanwhile (a
  scheduled task is not held up by a chat's retry backoff); the message keeps its place;
* one task id is never queued or run twice at the same time (`enqueue_task` returns False);
* `shutdown(grace)` stops taking jobs, lets running ones finish for `grace` seconds, cancels
  the rest (the runner then kills their containers) and returns every job that did not run.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mdclaw import metrics
from mdclaw.retry import EQUAL_JITTER, Backoff
from mdclaw.state.tasks import TaskRow

log = logging.getLogger("mdclaw.queue")

Kind = Literal["task", "message"]


@dataclass(frozen=True)
class MessageTurn:
    """What a message job carries. Changed by replacing it (`dataclasses.replace`)."""

    t_inbound: float | None = None  # time.perf_counter() when the message that queued it came
    upto: int | None = None  # the newest message (its seq) its latest try gave the agent
    told_cause: str | None = None  # the failure cause the chat was told a retry is coming for
    # The chat of a per_chat group's conversation this job runs (None: the group's one).
    chat: str | None = None
    reply: str | None = None  # the chat its latest try answered (told of failures)


@dataclass(frozen=True)
class TaskRun:
    """What a scheduled task's job carries: the task, the future its result goes to, when it
    was queued (time.perf_counter()) and what it waited for (a phrase for the run log)."""

    task: TaskRow
    future: asyncio.Future[str]
    queued_at: float
    waits_for: str | None = None


@dataclass
class AgentAsk:
    """What a question from another group's agent carries (ask_agent, mdclaw.agentasks): who
    asks, the question, the chain of groups waiting for the answer (outermost first, the
    caller last), the future the answer goes to, and when it was queued. `abandoned`: the
    caller stopped waiting (timeout); a job not started yet is then skipped."""

    caller: str
    question: str
    chain: tuple[str, ...]
    request_id: str
    future: asyncio.Future[str]
    queued_at: float
    abandoned: bool = False


Payload = MessageTurn | TaskRun | AgentAsk


@dataclass
class Job:
    group: str
    kind: Kind
    id: str
    payload: Payload | None = None
    attempts: int = 0  # failed tries so far
    seq: int = 0
    enqueued_at: float = 0.0  # time.perf_counter()
    picked_at: float = 0.0  # when the queue handed it to run_job (this try)
    last_error: str | None = None


@dataclass(frozen=True)
class Failure:
    job: Job
    error: str
    at: float = field(default_factory=time.time)


class GroupQueue:
    def __init__(self, run_job: Callable[[Job], Awaitable[Any]], *, max_concurrent: int,
                 max_attempts: int = 5, retry_base: float = 5.0, retry_cap: float = 600.0,
                 retry_jitter: float = EQUAL_JITTER, rng: random.Random | None = None,
                 on_failure: Callable[[Job, BaseException], Awaitable[None] | None] | None = None,
                 on_retry: Callable[[Job, BaseException, float], Awaitable[None] | None]
                 | None = None) -> None:
        self.run_job = run_job
        self.retry_cap = retry_cap
        self.retry_jitter = retry_jitter
        self._rng = rng
        self._closing = False
        self._running: dict[str, tuple[Job, asyncio.Task[None]]] = {}
        self._set_limits(max_concurrent, max_attempts, retry_base)
        self.on_failure = on_failure
        self.on_retry = on_retry
        self.failures: list[Failure] = []
        self._tasks: dict[str, deque[Job]] = {}
        self._messages: dict[str, deque[Job]] = {}
        # Per group waiting to retry: its release timer and the kind of job that waits.
        self._held: dict[str, tuple[asyncio.TimerHandle, Kind]] = {}
        self._keys: set[tuple[str, str]] = set()
        self._seq = itertools.count(1)
        self._idle = asyncio.Event()
        self._idle.set()
        self.peak_running = 0

    def _set_limits(self, max_concurrent: int, max_attempts: int, retry_base: float) -> None:
        if max_concurrent < 1 or max_attempts < 1 or retry_base < 0:
            raise ValueError("max_concurrent and max_attempts must be >= 1, retry_base >= 0")
        self.max_concurrent = max_concurrent
        self.max_attempts = max_attempts
        self.retry_base = retry_base
        # The cap never undercuts a configured base (a base above it waits the base).
        self.backoff = Backoff(base=retry_base, factor=2.0,
                               cap=max(self.retry_cap, retry_base), jitter=self.retry_jitter,
                               rng=self._rng)

    def configure(self, *, max_concurrent: int, max_attempts: int, retry_base: float) -> None:
        """New limits (a config reload): a job already running keeps going, a higher cap
        starts waiting jobs at once, and the next failure is retried (or not) by the new
        tries and backoff; a job waiting to retry keeps the wait it was given."""
        self._set_limits(max_concurrent, max_attempts, retry_base)
        if not self._closing:
            self._pump()

    # ----------------------------------------------------------------- enqueue

    def enqueue_task(self, group: str, task_id: str,
                     payload: TaskRun | AgentAsk | None = None) -> bool:
        """Queue scheduled task `task_id` (or another agent's question, which goes with the
        tasks); False if it is already queued or running."""
        return self._enqueue(Job(group, "task", task_id, payload))

    def enqueue_message(self, group: str, payload: MessageTurn | None = None,
                        job_id: str | None = None) -> bool:
        """Queue message work for `group`; with a `job_id`, a duplicate is refused."""
        return self._enqueue(Job(group, "message", job_id or f"m{next(self._seq)}", payload))

    def _enqueue(self, job: Job) -> bool:
        if self._closing:
            log.info("queue is shutting down; not queueing %s %s", job.kind, job.id)
            return False
        key = (job.kind, job.id)
        if key in self._keys:
            log.info("%s %s for %s is already queued or running", job.kind, job.id, job.group)
            return False
        self._keys.add(key)
        job.seq = next(self._seq)
        job.enqueued_at = time.perf_counter()
        book = self._tasks if job.kind == "task" else self._messages
        book.setdefault(job.group, deque()).append(job)
        self._idle.clear()
        self._pump()
        return True

    # ----------------------------------------------------------------- status

    @property
    def running_count(self) -> int:
        return len(self._running)

    def running_groups(self) -> list[str]:
        return list(self._running)

    def running_job(self, group: str) -> Job | None:
        """The job `group` is running now, or None."""
        got = self._running.get(group)
        return got[0] if got is not None else None

    def find(self, kind: Kind, job_id: str) -> Job | None:
        """The queued, waiting or running job `job_id` of `kind`, or None."""
        for job in self.pending() + [j for j, _t in self._running.values()]:
            if job.kind == kind and job.id == job_id:
                return job
        return None

    def pending(self, group: str | None = None) -> list[Job]:
        groups = [group] if group else sorted(set(self._tasks) | set(self._messages))
        out: list[Job] = []
        for g in groups:
            out += list(self._tasks.get(g, ())) + list(self._messages.get(g, ()))
        return out

    def status(self) -> dict[str, Any]:
        return {"running": {g: f"{j.kind}:{j.id}" for g, (j, _) in self._running.items()},
                "pending": len(self.pending()), "retrying": sorted(self._held),
                "failures": len(self.failures), "max_concurrent": self.max_concurrent}

    async def join(self) -> None:
        """Wait until nothing is queued, retrying or running."""
        await self._idle.wait()

    # ----------------------------------------------------------------- scheduling

    def _head(self, group: str) -> Job | None:
        for book in (self._tasks, self._messages):
            q = book.get(group)
            if q:
                return q[0]
        return None

    def _pump(self) -> None:
        while not self._closing and len(self._running) < self.max_concurrent:
            best: tuple[int, int, str] | None = None
            for group in set(self._tasks) | set(self._messages):
                if group in self._running:
                    continue
                head = self._head(group)
                if head is None:
                    continue
                # A message waiting to retry holds its group's later messages, not a task
                # (tasks go first anyway); a task waiting to retry holds everything.
                held = self._held.get(group)
                if held is not None and (head.kind != "task" or held[1] == "task"):
                    continue
                key = (0 if head.kind == "task" else 1, head.seq, group)
                if best is None or key < best:
                    best = key
            if best is None:
                break
            group = best[2]
            book = self._tasks if best[0] == 0 else self._messages
            job = book[group].popleft()
            if not book[group]:
                del book[group]
            job.picked_at = time.perf_counter()
            if not job.attempts:
                metrics.queue_wait.get(job.kind).observe(job.picked_at - job.enqueued_at)
            task = asyncio.ensure_future(self._execute(job))
            self._running[group] = (job, task)
            self.peak_running = max(self.peak_running, len(self._running))
        self._update_idle()

    def _update_idle(self) -> None:
        if not self._running and not self._held and not self._tasks and not self._messages:
            self._idle.set()

    async def _execute(self, job: Job) -> None:
        try:
            await self.run_job(job)
        except asyncio.CancelledError:
            self._keys.discard((job.kind, job.id))
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a run is retried
            job.attempts += 1
            job.last_error = f"{type(e).__name__}: {e}"
            # An error that says retrying cannot help (e.g. the image is missing) is final.
            final = bool(getattr(e, "permanent", False))
            tries = self.max_attempts
            if isinstance(getattr(e, "max_tries", None), int):
                tries = max(1, min(tries, e.max_tries))  # type: ignore[attr-defined]
            if job.attempts < tries and not self._closing and not final:
                delay = self.backoff.delay(job.attempts)
                wanted = getattr(e, "retry_delay", None)
                if isinstance(wanted, int | float) and wanted > delay:
                    delay = float(wanted)
                log.warning("%s %s for %s failed (try %d of %d): %s; retrying in %g s",
                            job.kind, job.id, job.group, job.attempts, tries,
                            job.last_error, delay)
                if self.on_retry is not None:
                    try:
                        r = self.on_retry(job, e, delay)
                        if inspect.isawaitable(r):
                            await r
                    except Exception:  # noqa: BLE001 - the owner's callback: the retry goes on
                        log.exception("on_retry callback failed for %s %s", job.kind, job.id)
                book = self._tasks if job.kind == "task" else self._messages
                book.setdefault(job.group, deque()).appendleft(job)
                loop = asyncio.get_running_loop()
                self._held[job.group] = (loop.call_later(delay, self._release, job.group),
                                         job.kind)
            else:
                self._keys.discard((job.kind, job.id))
                log.error("%s %s for %s failed after %d tries: %s", job.kind, job.id,
                          job.group, job.attempts, job.last_error)
                self.failures.append(Failure(job, job.last_error))
                if self.on_failure is not None:
                    try:
                        r = self.on_failure(job, e)
                        if inspect.isawaitable(r):
                            await r
                    except Exception:  # noqa: BLE001 - the owner's callback: the queue goes on
                        log.exception("on_failure callback failed for %s %s", job.kind, job.id)
        else:
            self._keys.discard((job.kind, job.id))
        finally:
            current = self._running.get(job.group)
            if current is not None and current[0] is job:
                del self._running[job.group]
            if not self._closing:
                self._pump()
            else:
                self._update_idle()

    def _release(self, group: str) -> None:
        self._held.pop(group, None)
        self._pump()

    # ----------------------------------------------------------------- shutdown

    async def shutdown(self, grace: float = 10.0) -> list[Job]:
        """Stop taking jobs; give running jobs `grace` seconds, then cancel them.

        Returns the jobs that did not complete (queued, waiting to retry, or cancelled).
        """
        self._closing = True
        for handle, _kind in self._held.values():
            handle.cancel()
        self._held.clear()
        left = self.pending()
        self._tasks.clear()
        self._messages.clear()
        for job in left:
            self._keys.discard((job.kind, job.id))
        running = {task: job for job, task in self._running.values()}
        if running:
            done, still = await asyncio.wait(running, timeout=grace)
            for task in still:
                task.cancel()
            if still:
                await asyncio.gather(*still, return_exceptions=True)
                left += [running[t] for t in still]
        self._running.clear()
        self._idle.set()
        if left:
            log.info("queue stopped with %d job(s) not run", len(left))
        return left


__all__ = ["Failure", "GroupQueue", "Job", "MessageTurn", "Payload", "TaskRun"]
