"""Starting a group's agent container, with everything a run needs around it.

`Launcher.run` is the one way the orchestrator starts a container, for a message turn or a
scheduled task. In order, a run that cannot work is refused before anything starts, with
the failure that names the cause (mdclaw/failures.py):

1. configuration errors the engine is not needed for (mdclaw.preflight.config_problem: no
   model resolves, the key file cannot be read) — `RunFailed`, not retried;
2. the disk rule (mdclaw.diskguard, asked through preflight.DiskRule): a group past a limit
   gets no run — `RunRefused`, not retried (its messages wait);
3. no container engine, or one that does not answer within the wait the caller allows
   (`engine_ready` is set once the engine answered; `stopping` ends the wait) — `RunFailed`
   with `engine_down`, retried by the queue;
4. the image is missing or lacks the group's backend (mdclaw.preflight.ImageCheck).

Then the credential proxy serves the group's socket around the run (mdclaw.proxy) and the
runner (mdclaw.runner) starts the container and follows it. An exception of the engine, the
image or the proxy becomes a `RunFailed` with its cause. `refine` names an unclear failure
better with what the proxy saw on the host's side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from mdclaw import failures
from mdclaw.config import Config
from mdclaw.errors import EngineError
from mdclaw.failures import TRANSIENT, TurnFailure
from mdclaw.preflight import DiskRule, DiskVerdict, ImageCheck, config_problem
from mdclaw.proxy import CredentialProxy
from mdclaw.runner import ContainerInput, ContainerResult, ContainerRunner, RunHandle
from mdclaw.state.groups import GroupRow


class RunFailed(EngineError, RuntimeError):
    """A container run ended without a usable result. With a transient `failure` the queue
    retries it (after at least `retry_delay` seconds, at most `max_tries` tries in all);
    otherwise it is final (`permanent`)."""

    def __init__(self, message: str, failure: TurnFailure | None = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.permanent = failure is not None and failure.policy != TRANSIENT
        self.retry_delay = failure.retry_after if failure is not None else None
        self.max_tries = (failures.rule(failure.cause).max_tries
                          if failure is not None else None)


class RunRefused(RunFailed):
    """The disk rule refuses runs of this group for now (see mdclaw.diskguard); retrying at
    once cannot help, so the queue does not."""

    permanent = True

    def __init__(self, verdict: DiskVerdict) -> None:
        super().__init__(verdict.summary())
        self.verdict = verdict
        self.permanent = True


class Launcher:
    """Starts groups' containers (see the module's notes). `runner` None: the engine is not
    reachable; `proxy` None: no model path at all (tests, benchmarks), so the model checks
    are skipped too. `config` is asked at every run (a reload may change it)."""

    def __init__(self, *, config: Callable[[], Config], runner: ContainerRunner | None,
                 proxy: CredentialProxy | None, diskguard: DiskRule | None,
                 engine_ready: asyncio.Event, stopping: asyncio.Event) -> None:
        self._config = config
        self.runner = runner
        self.proxy = proxy
        self.diskguard = diskguard
        self.engine_ready = engine_ready
        self.stopping = stopping
        self.image_check = ImageCheck()

    def handle(self, folder: str) -> RunHandle | None:
        """The group's starting or running container, if any."""
        return self.runner.active(folder) if self.runner else None

    def container_input(self, group: GroupRow, prompt: str, *, session: str | None,
                        scheduled: bool, fields: dict[str, Any],
                        chat: str | None = None) -> ContainerInput:
        """`chat`: the chat the run answers in (the tools' default target); default the
        group's first."""
        chat = chat or group.jid
        assert chat is not None
        return ContainerInput(prompt=prompt, group_folder=group.folder, chat_jid=chat,
                              is_main=group.is_main, is_scheduled_task=scheduled,
                              assistant_name=self._config().assistant.name,
                              session_id=session, **fields)

    async def run(self, group: GroupRow, make_input: Callable[[dict[str, Any]],
                  ContainerInput], on_output: Callable[[str], Any], *, engine_wait: float,
                  on_start: Callable[[], None] | None = None) -> ContainerResult:
        """Start the group's container and wait for it. Raises RunFailed with the failure
        when it cannot run (configuration, engine, image, proxy), RunRefused when the disk
        rule refuses it. `engine_wait`: how long to wait for an engine not ready yet. The config
        is read at each step, as a reload may come while the run waits for the engine."""
        pre = (await config_problem(self._config(), group.folder)
               if self.proxy is not None else None)
        if pre is not None:
            raise RunFailed(pre.detail or pre.cause, pre)
        if self.diskguard is not None:
            verdict = await self.diskguard.admit(group.folder)
            if not verdict.ok:
                raise RunRefused(verdict)
        if self.runner is None:
            raise RunFailed("the container engine is not reachable",
                            TurnFailure("engine_down", detail="no container engine configured "
                                        "or found"))
        if not self.engine_ready.is_set():
            ready = asyncio.ensure_future(self.engine_ready.wait())
            stopping = asyncio.ensure_future(self.stopping.wait())
            await asyncio.wait([ready, stopping], timeout=engine_wait,
                               return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            stopping.cancel()
            if not self.engine_ready.is_set():
                raise RunFailed("the container engine is not reachable",
                                TurnFailure("engine_down", detail="the engine did not answer"
                                            + (" and mdclaw is stopping"
                                               if self.stopping.is_set() else "")))
        pre = (await self.image_check.problem(self._config(), group.folder,
                                              self.runner.runtime)
               if self.proxy is not None else None)
        if pre is not None:
            raise RunFailed(pre.detail or pre.cause, pre)
        timeout = (group.container_config.get("timeout_ms") or 0) / 1000 or None
        if on_start is not None:
            on_start()
        try:
            if self.proxy is not None:
                async with self.proxy.for_run(self._config(), group.folder) as fields:
                    return await self.runner.run(group.folder, make_input(fields),
                                                 on_output=on_output, timeout=timeout)
            return await self.runner.run(group.folder, make_input({}), on_output=on_output,
                                         timeout=timeout)
        except (RunFailed, asyncio.CancelledError):
            raise
        except Exception as e:  # noqa: BLE001 - the engine, the image, the proxy
            failure = failures.from_exception(e)
            if failure.cause == "image_missing":
                self.image_check.forget(self._config().runtime.image)
            raise RunFailed(str(e), failure) from e

    def stopped(self, folder: str, result: ContainerResult) -> DiskVerdict | None:
        """The disk rule's verdict when it stopped this run (it did not succeed and the group
        is refused now), else None."""
        if self.diskguard is None or result.status == "success":
            return None
        return self.diskguard.blocked(folder)

    def refine(self, group: GroupRow, failure: TurnFailure) -> TurnFailure:
        """Name the cause better with what the credential proxy saw on the host's side (a
        backend that reports only text, or a run that ended without a structured error)."""
        if failure.cause != "agent_crash" or self.proxy is None:
            return failure
        seen = self.proxy.recent_failure(group.folder)
        if seen:
            return TurnFailure(seen, detail=failure.detail, exit_code=failure.exit_code)
        return failure
