"""Pre-flight checks: what is wrong before a group's container is started, said at once.

A run that cannot work is not started, so the chat hears the cause in plain words and the fix
(mdclaw/failures.py) instead of waiting for a container to fail:

* before anything else (the engine is not needed): no model resolves for the group (no
  `models:` entry, or several and no `assistant.model`), or its `api_key_file` cannot be read
  or is empty (`config_problem`);
* the disk rule (mdclaw.diskguard, asked through `DiskRule`): the group is past one of its
  disk limits;
* once the engine answers: the image is missing, or its `mdclaw.backends` label lacks the
  group's backend (`ImageCheck.problem`). What the engine says of an image is kept for
  IMAGE_CHECK_TTL seconds; an image found missing is asked again next time, and an engine
  that does not answer counts as having the image (the run then says what is wrong).

The failures' words (with the fix each configuration error needs) are mdclaw/failures.py's;
mdclaw.launch runs these checks before every run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from mdclaw.config import Config, read_secret
from mdclaw.failures import TurnFailure
from mdclaw.models import model_for_group
from mdclaw.runtime import ContainerRuntime, engine_errors

# Logged under the name these lines had before they moved here, so that journal filters
# and log readers keep working.
log = logging.getLogger("mdclaw.orchestrator")

IMAGE_CHECK_TTL = 30.0  # seconds an image's backends label is trusted before asking again


class DiskVerdict(Protocol):
    """What the disk rule decided for a group (mdclaw.diskguard.Verdict)."""

    @property
    def ok(self) -> bool: ...

    def summary(self) -> str: ...


class DiskRule(Protocol):
    """The disk limits, asked before and after a run (mdclaw.diskguard.DiskGuard, which
    sits beside the orchestrator and is not imported by what runs containers)."""

    async def admit(self, folder: str) -> DiskVerdict: ...

    def blocked(self, folder: str) -> DiskVerdict | None: ...

    def notice(self, folder: str, verdict: Any) -> str | None: ...


async def config_problem(cfg: Config, folder: str) -> TurnFailure | None:
    """Configuration errors found before anything is started (the engine is not needed):
    no model resolves for the group, or its key file cannot be read."""
    key, spec = model_for_group(cfg, folder)
    if spec is None:
        return TurnFailure("no_model", detail="no model resolves for the group: no "
                           "models entry, or several and no assistant.model")
    if spec.api_key_file is not None:
        try:
            ok = bool(await asyncio.to_thread(read_secret, spec.api_key_file))
        except OSError as e:
            ok = False
            why = e.strerror or type(e).__name__
        else:
            why = "empty"
        if not ok:
            return TurnFailure("key_missing", detail=f"models.{key}.api_key_file: {why}")
    return None


class ImageCheck:
    """Whether the agent image is there and carries a group's backend, asked of the engine
    at most every IMAGE_CHECK_TTL seconds per image."""

    def __init__(self) -> None:
        # image ref -> (time.monotonic(), backends label or None, present)
        self._seen: dict[str, tuple[float, tuple[str, ...] | None, bool]] = {}

    async def problem(self, cfg: Config, folder: str,
                      runtime: ContainerRuntime) -> TurnFailure | None:
        """The image is missing, or its mdclaw.backends label lacks the group's backend."""
        _key, spec = model_for_group(cfg, folder)
        if spec is None:
            return None
        backends, present = await self.look(cfg.runtime.image, runtime)
        if not present:
            return TurnFailure("image_missing", detail=f"{cfg.runtime.image} not found")
        if backends is not None and spec.backend not in backends:
            return TurnFailure("backend_missing", detail=f"image {cfg.runtime.image} "
                               f"carries {','.join(backends) or 'no backend'}")
        return None

    async def look(self, image: str,
                   runtime: ContainerRuntime) -> tuple[tuple[str, ...] | None, bool]:
        """(backends label, present) of `image`, asked at most every IMAGE_CHECK_TTL s; an
        engine that does not answer counts as present (the run then says what is wrong)."""
        now = time.monotonic()
        got = self._seen.get(image)
        if got is not None and now - got[0] < IMAGE_CHECK_TTL:
            return got[1], got[2]
        try:
            info = await asyncio.to_thread(runtime.image_info, image)
        except engine_errors():  # the engine will be asked again by the run, which says why
            log.debug("could not look at image %s", image, exc_info=True)
            return None, True
        result = (info.backends if info is not None else None, info is not None)
        if info is not None:  # a missing image is looked for again next time
            self._seen[image] = (now, *result)
        return result

    def forget(self, image: str) -> None:
        """The engine said `image` is missing after all: ask again next time."""
        self._seen.pop(image, None)
