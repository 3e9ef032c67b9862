"""One fake container engine for the tests: the real `ContainerRunner` over scripted containers.

`FakeEngine` implements `mdclaw.runtime.ContainerRuntime`. Each container it starts runs a
*script* in a thread of its own, playing the agent inside: the script gets the container
(`FakeContainer`) and uses its side of it — the input on stdin (`c.input`, `c.prompt`), output
blocks on stdout (`c.say(...)`), stderr, the IPC folder the runner mounts (follow-ups in
`input/`, the `_close` sentinel) — and ends with an exit status: the value it returns (None:
0), `c.exit(code)`, or `c.oom()` (killed by the kernel's OOM killer, as the engine reports
it). A script waits only through the container (`c.sleep`, `c.wait_for`, `c.next_input`,
`c.wait_closed`, `c.hang`), so a stop or kill from the runner ends it at once, and every wait
has a deadline (a script that waits in vain fails the test instead of hanging it).

Scripts are given in order (`FakeEngine(script1, script2, default=script)`), one per started
container; an exception instance in their place is raised by that start (`ImageError(...)`:
the image went away). `agent(...)` builds the common script from steps. The engine records
what the runner asked of it (`calls`, `specs`, `containers`), so tests assert on the real
spec, stdin and timers.

Engines made in a test are shut down after it (tests/conftest.py): leftover containers are
killed, and a script that failed fails the test.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from mdclaw import schedule
from mdclaw.runner import OUTPUT_END, OUTPUT_START
from mdclaw.runtime import (
    BACKENDS_LABEL,
    STDERR,
    STDOUT,
    ContainerInfo,
    ContainerRuntime,
    ImageError,
    ImageInfo,
    RunningContainer,
    RunSpec,
    Stream,
)
from waiting import wait_until

Script = Callable[["FakeContainer"], "int | None"]

SCRIPT_WAIT = 30.0  # the longest any wait inside a container lasts (seconds)
CLOSE = "_close"

_ids = itertools.count(1)
_engines: weakref.WeakSet[FakeEngine] = weakref.WeakSet()


class Stopped(BaseException):  # noqa: N818 - not an error: the engine ended the container
    """Raised inside a script's wait once the engine stopped or killed its container."""


# --------------------------------------------------------------------------- a container


class FakeContainer(RunningContainer):
    """One started container: the engine's side (`chunks`, `wait`, `close`) for the runner,
    and the agent's side (`say`, `next_input`, `exit`...) for its script."""

    def __init__(self, engine: FakeEngine, cid: str, spec: RunSpec) -> None:
        self.engine = engine
        self.id = cid
        self.name = spec.name
        self.spec = spec
        self.input: dict[str, Any] = json.loads(spec.stdin) if spec.stdin else {}
        mounts = {m.container: Path(m.host) for m in spec.mounts}
        self.ipc_dir = mounts.get("/workspace/ipc")
        self.group_dir = mounts.get("/workspace/group")
        self.started_at: datetime = schedule.utc_now()
        self.exit_code: int | None = None
        self.oom_killed = False
        self.signals: list[str] = []  # "stop", "kill": what the engine was asked to do
        self.said: list[str] = []  # the output blocks written
        self.follow_ups: list[dict[str, Any]] = []  # the follow-ups read from input/
        self.saw_close = False  # the script saw the _close sentinel
        self.error: BaseException | None = None  # the script's own failure
        self.ended = threading.Event()
        self.released = threading.Event()  # close(): the runner let go of the stream
        self._stopping = threading.Event()  # stop or kill asked: the script's waits end
        self._out: queue.Queue[tuple[Stream, bytes] | None] = queue.Queue()
        self._pending: deque[dict[str, Any]] = deque()
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the agent's side

    @property
    def prompt(self) -> str:
        return str(self.input.get("prompt", ""))

    @property
    def is_task(self) -> bool:
        return bool(self.input.get("isScheduledTask"))

    def say(self, block: str | dict[str, Any]) -> None:
        """Write one output block (a dict is written as JSON)."""
        text = block if isinstance(block, str) else json.dumps(block)
        self._check()
        self.said.append(text)
        self.stdout(f"{OUTPUT_START}\n{text}\n{OUTPUT_END}\n".encode())

    def stdout(self, data: bytes) -> None:
        self._out.put((STDOUT, data))

    def stderr(self, data: bytes) -> None:
        self._out.put((STDERR, data))

    def sleep(self, seconds: float) -> None:
        """Sleep, unless the engine stops the container first."""
        if self._stopping.wait(seconds):
            raise Stopped

    def wait_for(self, cond: Callable[[], Any], timeout: float = SCRIPT_WAIT, *,
                 what: str | None = None) -> Any:
        """Wait (with a deadline) until `cond()` is true; return it. Ends with the container."""
        def ready() -> Any:
            self._check()
            return cond()

        return wait_until(ready, timeout, what=what)

    def next_input(self, timeout: float = SCRIPT_WAIT) -> dict[str, Any] | None:
        """The next follow-up the host wrote into input/, taken as the agent takes them
        (every complete file, in name order, removed once read); None once `_close` is
        seen and every follow-up before it was taken."""
        def step() -> bool:
            if not self._pending and not self.saw_close:
                self._take()
            return bool(self._pending) or self.saw_close

        self.wait_for(step, timeout, what=f"a follow-up or _close in {self.name}")
        if self._pending:
            got = self._pending.popleft()
            self.follow_ups.append(got)
            return got
        return None

    def wait_closed(self, timeout: float = SCRIPT_WAIT) -> None:
        """Wait for `_close` (the end of the conversation), leaving follow-ups unread."""
        assert self.ipc_dir is not None
        close = self.ipc_dir / "input" / CLOSE
        self.wait_for(close.exists, timeout, what=f"_close for {self.name}")
        self.saw_close = True
        close.unlink(missing_ok=True)

    def hang(self, timeout: float = SCRIPT_WAIT) -> None:
        """Do nothing until the engine stops or kills the container."""
        self.wait_for(lambda: False, timeout, what=f"a stop or kill of {self.name}")

    def exit(self, code: int = 0) -> None:
        """End the container now with `code`."""
        self._end(code)
        raise Stopped

    def oom(self) -> None:
        """The kernel's OOM killer ends the container (137, and the engine says why)."""
        self.oom_killed = True
        self.exit(137)

    def _check(self) -> None:
        if self._stopping.is_set() or self.ended.is_set():
            raise Stopped

    def _take(self) -> None:
        assert self.ipc_dir is not None
        folder = self.ipc_dir / "input"
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        for name in names:
            path = folder / name
            if name == CLOSE:
                self.saw_close = True
            elif name.endswith(".json") and not name.startswith("."):
                self._pending.append(json.loads(path.read_text()))
            else:
                continue
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ the engine's side

    def chunks(self) -> Iterator[tuple[Stream, bytes]]:
        while (item := self._out.get()) is not None:
            yield item

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise TimeoutError(f"{self.name} has not exited")
        assert self.exit_code is not None
        return self.exit_code

    def close(self) -> None:
        self.released.set()
        self._out.put(None)

    @property
    def state(self) -> str:
        return "exited" if self.ended.is_set() else "running"

    @property
    def killed(self) -> bool:
        return "kill" in self.signals

    def _end(self, code: int) -> None:
        if self.ended.is_set():
            return
        self.exit_code = code
        self._stopping.set()
        self.ended.set()
        self._out.put(None)

    def _main(self, script: Script) -> None:
        code = 0
        try:
            code = script(self) or 0
        except Stopped:
            return  # ended by the engine, or by exit()/oom(): _end was called
        except BaseException as e:  # noqa: BLE001 - the test fails with it at teardown
            self.error = e
            self.stderr("".join(traceback.format_exception(e)).encode())
            code = 1
        self._end(code)


# --------------------------------------------------------------------------- the engine


class FakeEngine(ContainerRuntime):
    """A container engine whose containers run scripts; see the module's docstring.

    `image_labels`: the labels of every image it has (None: it has no image at all).
    `obeys_stop`: a stop ends the container (exit 143); otherwise only a kill does.
    """

    engine = "fake"
    description = "the tests' fake engine"
    supports_create = True

    def __init__(self, *scripts: Script | BaseException, default: Script | None = None,
                 image_labels: dict[str, str] | None = None, obeys_stop: bool = True) -> None:
        self.scripts: deque[Script | BaseException] = deque(scripts)
        self.default = default
        self.image_labels = ({BACKENDS_LABEL: "openai,claude"} if image_labels is None
                             else image_labels)
        self.has_images = True
        self.obeys_stop = obeys_stop
        self.calls: list[tuple[str, str]] = []  # (what, container name), in order
        self.specs: list[RunSpec] = []  # every spec asked to start, started or not
        self.containers: list[FakeContainer] = []  # every container started, in order
        self.created: dict[str, RunSpec] = {}  # created, not started
        self.removed: set[str] = set()
        self._lock = threading.Lock()
        _engines.add(self)

    # ------------------------------------------------------------------ for tests

    @property
    def inputs(self) -> list[dict[str, Any]]:
        """What each container asked to start was given on stdin, in order."""
        return [json.loads(s.stdin) for s in self.specs]

    @property
    def prompts(self) -> list[str]:
        return [str(i.get("prompt", "")) for i in self.inputs]

    def running(self) -> list[FakeContainer]:
        return [c for c in self.containers if not c.ended.is_set()]

    def container_of(self, folder: str) -> FakeContainer | None:
        """The latest container started for group `folder`."""
        mine = [c for c in self.containers if c.spec.labels.get("mdclaw.group") == folder]
        return mine[-1] if mine else None

    def shutdown(self) -> None:
        """Kill what still runs and wait for the scripts; raise the first script failure."""
        for c in self.containers:
            c._end(137)
        for c in self.containers:
            if c.thread is not None:
                c.thread.join(5)
        errors = [c for c in self.containers if c.error is not None]
        if errors:
            c = errors[0]
            raise AssertionError(f"the script of container {c.name} failed: "
                                 f"{type(c.error).__name__}: {c.error}") from c.error

    # ------------------------------------------------------------------ ContainerRuntime

    def ping(self) -> str:
        return "fake engine 1.0"

    def image_info(self, ref: str) -> ImageInfo | None:
        if not self.has_images:
            return None
        return ImageInfo(ref, "sha256:fake", (ref,), "", 0, dict(self.image_labels))

    def build_image(self, tag: str, dockerfile: Path, context: Path,
                    progress: Callable[[str], None] | None = None,
                    build_args: dict[str, str] | None = None) -> str:
        raise NotImplementedError("the fake engine builds no image")

    def load_image(self, tarball: Path,
                   progress: Callable[[str], None] | None = None) -> list[str]:
        raise NotImplementedError("the fake engine loads no image")

    def start(self, spec: RunSpec) -> RunningContainer:
        self._record("start", spec)
        return self._run(f"fake{next(_ids):06d}", spec)

    def create(self, spec: RunSpec) -> str:
        if not self.has_images:
            raise ImageError(f"image {spec.image} not found")
        cid = f"fake{next(_ids):06d}"
        with self._lock:
            self.calls.append(("create", spec.name))
            self.created[cid] = spec
        return cid

    def start_created(self, container_id: str, spec: RunSpec) -> RunningContainer:
        with self._lock:
            self.created.pop(container_id)  # a KeyError here is a bug in the runner
        self._record("start_created", spec)
        return self._run(container_id, spec)

    def stop(self, container_id: str, grace: float = 2.0) -> None:
        c = self._find(container_id, "stop")
        if c is not None:
            c.signals.append("stop")
            if self.obeys_stop:
                c._end(143)

    def kill(self, container_id: str) -> None:
        c = self._find(container_id, "kill")
        if c is not None:
            c.signals.append("kill")
            c._end(137)

    def remove(self, container_id: str) -> None:
        c = self._find(container_id, "remove")
        with self._lock:
            self.created.pop(container_id, None)
            self.removed.add(container_id)
        if c is not None:
            c._end(137)

    def list(self, labels: dict[str, str], *, all: bool = True) -> list[ContainerInfo]:
        def matches(spec: RunSpec) -> bool:
            return all_items(labels, spec.labels)

        with self._lock:
            out = [ContainerInfo(c.id, c.name, c.state, c.spec.image, dict(c.spec.labels))
                   for c in self.containers
                   if c.id not in self.removed and matches(c.spec)
                   and (all or not c.ended.is_set())]
            if all:
                out += [ContainerInfo(cid, s.name, "created", s.image, dict(s.labels))
                        for cid, s in self.created.items() if matches(s)]
        return out

    # ------------------------------------------------------------------ internals

    def _record(self, what: str, spec: RunSpec) -> None:
        with self._lock:
            self.calls.append((what, spec.name))
            self.specs.append(spec)

    def _run(self, cid: str, spec: RunSpec) -> FakeContainer:
        if not self.has_images:
            raise ImageError(f"image {spec.image} not found")
        with self._lock:
            script = self.scripts.popleft() if self.scripts else self.default
        if script is None:
            raise AssertionError(f"no script left for container {spec.name}")
        if isinstance(script, BaseException):
            raise script
        c = FakeContainer(self, cid, spec)
        with self._lock:
            self.containers.append(c)
        c.thread = threading.Thread(target=c._main, args=(script,), name=f"fake-{spec.name}",
                                    daemon=True)
        c.thread.start()
        return c

    def _find(self, container_id: str, what: str) -> FakeContainer | None:
        with self._lock:
            c = next((c for c in self.containers if c.id == container_id), None)
            self.calls.append((what, c.name if c else container_id))
        return c


def all_items(want: dict[str, str], have: dict[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


def shutdown_all() -> None:
    """End every engine made so far (tests/conftest.py calls this after each test)."""
    engines = list(_engines)
    _engines.clear()
    first: AssertionError | None = None
    for engine in engines:
        try:
            engine.shutdown()
        except AssertionError as e:
            first = first or e
    if first is not None:
        raise first


# --------------------------------------------------------------------------- scripts

FOLLOW_UP = "<wait for a follow-up>"  # an `agent` step: take the next follow-up


def agent(*steps: Any, exit_code: int = 0, oom: bool = False, stderr: bytes = b"") -> Script:
    """The usual agent: each step in order — a str or dict is an output block, a number
    sleeps that many seconds, FOLLOW_UP takes the next follow-up, a callable is called with
    the container — then it ends: OOM-killed with `oom`, with `exit_code` when not 0, and
    otherwise, as the agent does, when the host writes `_close` (follow-ups left unread)."""

    def script(c: FakeContainer) -> int:
        for step in steps:
            if step is FOLLOW_UP:
                got = c.next_input()
                assert got is not None, f"{c.name} was closed while waiting for a follow-up"
            elif isinstance(step, bool):
                raise TypeError("a step is a block, a number of seconds, FOLLOW_UP or callable")
            elif isinstance(step, int | float):
                c.sleep(step)
            elif isinstance(step, str | dict):
                c.say(step)
            else:
                step(c)
        if stderr:
            c.stderr(stderr)
        if oom:
            c.oom()
        if exit_code:
            return exit_code
        c.wait_closed()
        return 0

    return script


def chat_agent(answer: Callable[[str], str] = lambda text: "re: " + text, *,
               heard: list[str] | None = None, idle: float = 10 * SCRIPT_WAIT) -> Script:
    """An agent in a conversation, as the agent runner holds one: it answers the prompt and
    then each follow-up, in the order the host wrote them, with a block whose result is
    `answer(text)`, until `_close` (or a stop) ends the conversation. Every text it was given
    (the prompt, each follow-up's content) is appended to `heard`, so a test can tell which
    messages reached the agent, and how often. It may sit idle up to `idle` seconds between
    two inputs (the runner's idle timer is what usually ends it)."""

    def script(c: FakeContainer) -> int:
        text: str | None = c.prompt
        while text is not None:
            if heard is not None:
                heard.append(text)
            c.say({"status": "success", "result": answer(text)})
            got = c.next_input(timeout=idle)
            text = None if got is None else str(got.get("content", ""))
        return 0

    return script
