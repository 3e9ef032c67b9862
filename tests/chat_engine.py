"""A container engine whose containers act like the agent runner, for tests that drive the real
orchestrator and the real ContainerRunner without a container engine.

Each started container is a thread: it reads the `ContainerInput` the runner wrote on stdin,
answers its prompt with one output block, then reads the follow-up files the host writes
into the group's `input/` folder (oldest name first, as the agent runner does; woken by
inotify, so an idle container costs no CPU), answers each with a block of its own, and exits
with 0 when `_close` appears (or when the engine stops it).
Every input it was given (the prompt, each follow-up's content) is recorded in `inputs`, so a
test can tell which messages reached the agent, and how often.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from inotify_simple import INotify
from inotify_simple import flags as F

from mdclaw.runner import CLOSE_SENTINEL, OUTPUT_END, OUTPUT_START
from mdclaw.runtime import (
    STDOUT,
    ContainerInfo,
    ContainerRuntime,
    ImageInfo,
    RunningContainer,
    RunSpec,
)


class ChatContainer(RunningContainer):
    """A started container: its output is what its agent thread says."""

    def __init__(self, cid: str, name: str) -> None:
        self.id = cid
        self.name = name
        self.exit_code = 0
        self.ended = threading.Event()
        self._out: queue.Queue[tuple[int, bytes] | None] = queue.Queue()

    def say(self, block: dict[str, object]) -> None:
        self._out.put((STDOUT, f"{OUTPUT_START}\n{json.dumps(block)}\n{OUTPUT_END}\n".encode()))

    def end(self, code: int) -> None:
        if not self.ended.is_set():
            self.exit_code = code
            self.ended.set()
            self._out.put(None)

    def chunks(self) -> Iterator[tuple[int, bytes]]:  # type: ignore[override]
        while (item := self._out.get()) is not None:
            yield item

    def wait(self, timeout: float | None = None) -> int:
        self.ended.wait(timeout)
        return self.exit_code

    def close(self) -> None:
        self._out.put(None)


class ChatEngine(ContainerRuntime):
    """The engine (see the module's notes). `answer(text)` makes the reply to an input
    (default: "re: " and the input). Thread-safe: containers run on threads of their own."""

    engine = "chat-fake"
    description = "a fake engine whose containers answer like the agent runner"

    def __init__(self, answer: Callable[[str], str] | None = None, *,
                 poll: float = 0.1) -> None:
        self.answer = answer or (lambda text: "re: " + text)
        self.poll = poll  # seconds between looks at whether the container was stopped
        self.inputs: list[str] = []
        self.runs = 0
        self._lock = threading.Lock()
        self._containers: dict[str, ChatContainer] = {}

    # ------------------------------------------------------------------ the agent
    def _agent(self, c: ChatContainer, prompt: str, input_dir: Path) -> None:
        with INotify() as ino:
            ino.add_watch(input_dir, F.CREATE | F.MOVED_TO | F.CLOSE_WRITE)
            self._said(c, prompt)
            while not c.ended.is_set():
                for name in sorted(os.listdir(input_dir)):
                    if name == CLOSE_SENTINEL:
                        c.end(0)
                        return
                    if not name.endswith(".json") or name.startswith("."):
                        continue
                    path = input_dir / name
                    body = json.loads(path.read_text())
                    path.unlink()
                    self._said(c, str(body.get("content", "")))
                ino.read(timeout=int(self.poll * 1000))

    def _said(self, c: ChatContainer, text: str) -> None:
        with self._lock:
            self.inputs.append(text)
        c.say({"status": "success", "result": self.answer(text)})

    # ------------------------------------------------------------------ the engine
    def start(self, spec: RunSpec) -> RunningContainer:
        ipc = next(m.host for m in spec.mounts if m.container == "/workspace/ipc")
        prompt = json.loads(spec.stdin)["prompt"]
        with self._lock:
            self.runs += 1
            c = self._containers[spec.name] = ChatContainer(f"c{self.runs:06d}", spec.name)
        threading.Thread(target=self._agent, args=(c, prompt, Path(ipc) / "input"),
                         daemon=True).start()
        return c

    def _by_id(self, container_id: str) -> ChatContainer | None:
        with self._lock:
            return next((c for c in self._containers.values() if c.id == container_id), None)

    def stop(self, container_id: str, grace: float = 2.0) -> None:
        c = self._by_id(container_id)
        if c is not None:
            c.end(143)

    def kill(self, container_id: str) -> None:
        c = self._by_id(container_id)
        if c is not None:
            c.end(137)

    def remove(self, container_id: str) -> None:
        with self._lock:
            for name, c in list(self._containers.items()):
                if c.id == container_id:
                    c.end(137)
                    del self._containers[name]

    def ping(self) -> str:
        return self.description

    def image_info(self, ref: str) -> ImageInfo | None:
        return ImageInfo(ref, "sha256:chat", (ref,), "", 0, {"mdclaw.backends": "openai,claude"})

    def build_image(self, tag: str, dockerfile: Path, context: Path, progress=None,
                    build_args=None) -> str:  # noqa: ANN001
        raise NotImplementedError

    def load_image(self, tarball: Path, progress=None) -> list[str]:  # noqa: ANN001
        raise NotImplementedError

    def list(self, labels: dict[str, str], *, all: bool = True) -> list[ContainerInfo]:
        return []
