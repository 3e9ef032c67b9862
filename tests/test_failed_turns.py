"""Failed turns in the orchestrator, with the real database, queue, outbox rows and container
runner over the tests' fake engine (scripted containers): each cause is told once, in plain
words; transient ones are retried, deterministic ones and configuration errors are set aside
so the next message gets a normal answer; open conversations are told at once.

(The same with the real engine, image and a failing model server: tests/e2e/test_failures_e2e.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Any

from fake_engine import FOLLOW_UP, FakeContainer, FakeEngine, agent
from mdclaw.channels.base import InboundMessage
from mdclaw.config import load_config
from mdclaw.orchestrator import Orchestrator
from mdclaw.reconcile import reconcile
from mdclaw.runner import ContainerRunner
from mdclaw.runtime import ImageError
from mdclaw.state import Database
from mdclaw.state.conversations import get_cursor
from mdclaw.state.failed_turns import list_failed_turns
from mdclaw.state.outbox import list_outbox
from waiting import wait_until_async

CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC, model: local}
models:
  local: {backend: openai, model: m, base_url: "http://10.1.2.3:11434/v1"}
groups:
  main: {name: Admin, jid: "hl:main", main: true}
limits: {run_attempts: 3, run_retry_base: 50ms, memory: 2g, idle_timeout: 500ms}
"""


def msg(i: int, text: str, jid: str = "hl:main") -> InboundMessage:
    return InboundMessage(id=f"{jid}:{i}", chat_jid=jid, sender="u1", sender_name="Alice",
                          content=text, timestamp=f"2026-01-01T00:00:{i:02d}.000Z",
                          channel="http")


def ok(text: str) -> str:
    return json.dumps({"status": "success", "result": text, "newSessionId": "oai-1"})


def err(cause: str, **extra: Any) -> str:
    return json.dumps({"status": "error", "result": None, "error": f"{cause} happened",
                       "cause": cause, **extra})


BOOM = b"Traceback: boom\n"  # what a crashing agent leaves on stderr


def run(*steps: Any, exit_code: int = 0, oom: bool = False):  # noqa: ANN201
    """One scripted container: blocks to emit (a number sleeps, FOLLOW_UP waits for the
    next follow-up), then how it ends (an exit code, the OOM killer, or `_close`)."""
    return agent(*steps, exit_code=exit_code, oom=oom,
                 stderr=BOOM if exit_code or oom else b"")


DEFAULT = run(ok("default answer"))


def no_images(eng: FakeEngine) -> FakeEngine:
    eng.has_images = False
    return eng


def engine(*scripts: Any, **kw: Any) -> FakeEngine:
    """The fake engine with `scripts`; its images carry the openai backend."""
    kw.setdefault("image_labels", {"mdclaw.backends": "openai"})
    return FakeEngine(*scripts, default=DEFAULT, **kw)


class FakeProxy:
    def __init__(self) -> None:
        self.failure: str | None = None

    @contextlib.asynccontextmanager
    async def for_run(self, cfg, folder):  # noqa: ANN001, ANN201
        yield {"backend": "openai", "model": "m"}

    def recent_failure(self, folder: str) -> str | None:
        return self.failure


def setup(write_config, text: str = CONFIG):
    cfg = load_config(write_config(text))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    return cfg, db


def orchestrator(cfg, db, eng: FakeEngine, *, proxy=None) -> Orchestrator:  # noqa: ANN001
    """The orchestrator with the real container runner over `eng`."""
    orch = Orchestrator(cfg, db, runner=ContainerRunner(cfg, eng), proxy=proxy or FakeProxy())
    orch.engine_ready.set()
    return orch


def texts(db) -> list[str]:  # noqa: ANN001
    return [r.text for r in reversed(list_outbox(db))]


def prompts(eng: FakeEngine) -> list[str]:
    return eng.prompts


def test_deterministic_failure_is_told_once_and_set_aside(write_config) -> None:
    cfg, db = setup(write_config)
    eng = engine(run(err("model_refused", httpStatus=400, apiMessage="unsupported content"),
                     exit_code=1),
                 run(ok("normal answer")))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "poison pill"))
        await asyncio.wait_for(orch.queue.join(), 10)
        await orch.on_inbound(msg(2, "hello again"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    told, answer = texts(db)
    assert told.startswith("The model server refused that request (HTTP 400: unsupported "
                           "content).")
    assert answer == "normal answer"
    assert len(eng.inputs) == 2  # not retried
    assert "poison pill" not in prompts(eng)[1] and "hello again" in prompts(eng)[1]
    rows = {r["content"]: r["failed_cause"] for r in db.query("SELECT * FROM messages")}
    assert rows == {"poison pill": "model_refused", "hello again": None}
    (turn,) = list_failed_turns(db)
    assert (turn["cause"], turn["outcome"], turn["messages"]) == ("model_refused", "dropped", 1)


def test_transient_failure_is_retried_and_told_once(write_config) -> None:
    cfg, db = setup(write_config)
    down = run(err("model_unreachable"), exit_code=1)
    eng = engine(down, run(err("model_unreachable"), exit_code=1), run(ok("answered at last")))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "are you there?"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    assert texts(db) == ["The model server at 10.1.2.3:11434 is not answering. I'll try again "
                         "in 1 s.", "answered at last"]
    assert all("are you there?" in p for p in prompts(eng))
    assert db.query_one("SELECT failed_cause FROM messages")[0] is None
    assert [t["outcome"] for t in list_failed_turns(db)] == ["retry", "retry"]


def test_transient_failure_gives_up_with_a_true_count_and_is_not_run_again(write_config) -> None:
    cfg, db = setup(write_config)
    eng = engine(*[run(err("model_server_error", httpStatus=502), exit_code=1)] * 3)

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "hello"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    first, last = texts(db)
    assert "internal error (HTTP 502)" in first and "try again" in first
    assert "tried 3 times" in last and "send it again" in last
    assert len(eng.inputs) == 3

    async def restart() -> int:
        orch = orchestrator(cfg, db, engine())
        return orch.recover_pending()

    assert asyncio.run(restart()) == 0  # told to resend: not run again at the next start


def test_container_killed_is_retried_with_at_most_three_tries(write_config) -> None:
    cfg, db = setup(write_config, CONFIG.replace("run_attempts: 3", "run_attempts: 5"))
    eng = engine(*[run(0.01, exit_code=137)] * 5)

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "hello"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    first, last = texts(db)
    assert first.startswith("My container was stopped while I was working on that.")
    assert "tried 3 times" in last
    assert len(eng.inputs) == 3


def test_oom_killed_names_the_memory_limit(write_config) -> None:
    cfg, db = setup(write_config)
    eng = engine(run(0.01, exit_code=137, oom=True), run(ok("fine")))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "summarise this huge file"))
        await asyncio.wait_for(orch.queue.join(), 10)
        await orch.on_inbound(msg(2, "something small"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    assert texts(db)[0].startswith("I ran out of memory (limit 2g) while working on that.")
    assert texts(db)[1] == "fine"
    assert len(eng.inputs) == 2


def test_no_model_is_answered_at_once_without_a_container(write_config) -> None:
    cfg, db = setup(write_config, CONFIG.replace("model: local}", "}").replace(
        """models:
  local: {backend: openai, model: m, base_url: "http://10.1.2.3:11434/v1"}
""", ""))
    eng = engine()

    async def main() -> float:
        orch = orchestrator(cfg, db, eng)
        t0 = time.monotonic()
        await orch.on_inbound(msg(1, "hello"))
        await asyncio.wait_for(orch.queue.join(), 10)
        return time.monotonic() - t0

    took = asyncio.run(main())
    (told,) = texts(db)
    assert "No model is configured" in told and "`models:`" in told
    assert eng.inputs == [] and took < 1.0


def test_missing_backend_and_image_and_key_are_configuration_answers(write_config,
                                                                      tmp_path) -> None:
    cases = [
        (engine(image_labels={"mdclaw.backends": "claude"}), "",
         "openai backend this chat uses"),
        (no_images(engine()), "", "agent image mdclaw-agent:latest is not on the server"),
        (engine(), f", api_key_file: {tmp_path / 'key'}", "cannot read the API key"),
    ]
    key = tmp_path / "key"
    for i, (eng, extra, words) in enumerate(cases):
        text = CONFIG.replace('/v1"}', f'/v1"{extra}}}').replace(
            "{data_dir}", str(tmp_path / f"data{i}"))
        key.write_text("sk-x")
        key.chmod(0o600)
        cfg, db = setup(write_config, text)
        key.unlink()  # the key went away after the config was loaded

        async def main() -> None:
            orch = orchestrator(cfg, db, eng)  # noqa: B023
            await orch.on_inbound(msg(1, "hello"))
            await asyncio.wait_for(orch.queue.join(), 10)

        asyncio.run(main())
        told = texts(db)[-1]
        assert words in told, told
        assert "operator" in told and eng.inputs == []
        db.close()


def test_image_missing_at_start_is_a_configuration_answer(write_config) -> None:
    cfg, db = setup(write_config)
    eng = engine(ImageError("image x not found"), image_labels={})

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "hello"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    (told,) = texts(db)
    assert "is not on the server" in told and "mdclaw image build" in told
    assert len(eng.inputs) == 1


def test_open_conversation_transient_failure_is_told_at_once_and_retried(write_config) -> None:
    cfg, db = setup(write_config)
    eng = engine(run(ok("first answer"), FOLLOW_UP, err("model_unreachable")),
                 run(ok("second answer")))

    async def main() -> float:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "first question"))
        await wait_until_async(lambda: "first answer" in texts(db))
        await orch.on_inbound(msg(2, "second question"))  # fed into the open conversation
        t0 = time.monotonic()
        await wait_until_async(lambda: len(texts(db)) >= 2)
        told_after = time.monotonic() - t0
        await asyncio.wait_for(orch.queue.join(), 10)
        return told_after

    told_after = asyncio.run(main())
    assert told_after < 5
    first, told, second = texts(db)
    assert "not answering" in told and "try again" in told
    assert second == "second answer"
    assert "second question" in prompts(eng)[1] and "first question" not in prompts(eng)[1]


def test_open_conversation_deterministic_failure_is_told_while_it_runs(write_config) -> None:
    cfg, db = setup(write_config)
    still_open = threading.Event()

    def keep_open(c: FakeContainer) -> None:
        still_open.set()

    eng = engine(run(ok("first answer"), FOLLOW_UP, err("context_too_long", limit="4096 tokens"),
                     keep_open, FOLLOW_UP, ok("third answer")))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "first"))
        await wait_until_async(lambda: "first answer" in texts(db))
        await orch.on_inbound(msg(2, "x" * 100))
        await wait_until_async(still_open.is_set, 5)
        # The container is still open (it waits for its next input); the host tells the chat
        # once it has read the error, which may come a moment after the script went on.
        await wait_until_async(
            lambda: any("too long for the model (limit 4096 tokens)" in t for t in texts(db)))
        assert orch.queue.running_count == 1  # told while the conversation still runs
        await orch.on_inbound(msg(3, "third"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    assert texts(db)[-1] == "third answer"
    rows = {r["content"][:5]: r["failed_cause"] for r in db.query("SELECT * FROM messages")}
    assert rows == {"first": None, "xxxxx": "context_too_long", "third": None}
    assert len(eng.inputs) == 1


def test_trimmed_history_is_said_with_the_answer(write_config) -> None:
    cfg, db = setup(write_config)
    answer = json.dumps({"status": "success", "result": "short answer",
                         "notice": {"cause": "context_too_long", "limit": "8192 tokens"}})
    eng = engine(run(answer))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "long one"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    notice, text = texts(db)
    assert "too long for the model (limit 8192 tokens)" in notice
    assert "without the oldest history" in notice and text == "short answer"


def test_a_crash_without_a_cause_uses_what_the_proxy_saw(write_config) -> None:
    cfg, db = setup(write_config, CONFIG.replace("run_attempts: 3", "run_attempts: 1"))
    proxy = FakeProxy()
    proxy.failure = "model_unreachable"
    eng = engine(run(0.01, exit_code=1))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng, proxy=proxy)
        await orch.on_inbound(msg(1, "hello"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    (told,) = texts(db)
    assert "is not answering" in told and "tried once" in told


def test_a_kill_while_idle_loses_nothing(write_config) -> None:
    """The container dies after answering everything: nothing to tell, nothing to retry."""
    cfg, db = setup(write_config)
    eng = engine(run(ok("done"), 0.01, exit_code=137))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "hello"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    assert texts(db) == ["done"] and len(eng.inputs) == 1
    assert get_cursor(db, "main") == db.scalar("SELECT seq FROM messages WHERE id = 'hl:main:1'")


def test_a_new_failure_after_an_answer_is_told_again(write_config) -> None:
    """A retry answers, then the next message in the same conversation fails: that is a new
    failure (told again, counted from one), not a further try of the first."""
    cfg, db = setup(write_config)
    eng = engine(run(err("model_unreachable")),
                 run(ok("first answer"), FOLLOW_UP, err("model_unreachable")),
                 run(ok("second answer")))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "one"))
        await wait_until_async(lambda: "first answer" in texts(db))
        await orch.on_inbound(msg(2, "two"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    t = texts(db)
    assert [x for x in t if "not answering" in x and "try again" in x].__len__() == 2, t
    assert t[-1] == "second answer" and not any("gave up" in x for x in t)


def test_engine_down_is_told_within_seconds_and_retried(write_config) -> None:
    cfg, db = setup(write_config)
    eng = engine(run(ok("the engine is back")))

    async def main() -> float:
        orch = Orchestrator(cfg, db, runner=ContainerRunner(cfg, eng), proxy=FakeProxy())
        orch.engine_first_wait = 0.2  # 4 s in the daemon
        t0 = time.monotonic()
        await orch.on_inbound(msg(1, "hello"))
        await wait_until_async(lambda: texts(db))
        took = time.monotonic() - t0
        orch.engine_ready.set()
        await asyncio.wait_for(orch.queue.join(), 10)
        return took

    took = asyncio.run(main())
    told, answer = texts(db)
    assert took < 1.0
    assert "container engine on the server is not reachable" in told and "try again" in told
    assert answer == "the engine is back"


def test_a_transient_failure_overtaken_by_a_later_answer_is_told_to_resend(write_config) -> None:
    cfg, db = setup(write_config)
    # Turn 2 fails (the model hung up), turn 3 was already in the container and is answered.
    eng = engine(run(ok("one"), FOLLOW_UP, err("model_disconnected"), ok("three")))

    async def main() -> None:
        orch = orchestrator(cfg, db, eng)
        await orch.on_inbound(msg(1, "first"))
        await wait_until_async(lambda: "one" in texts(db))
        await orch.on_inbound(msg(2, "second"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    t = texts(db)
    assert t[0] == "one" and t[-1] == "three"
    assert "closed the connection" in t[1] and "send your message again" in t[1]
    assert len(eng.inputs) == 1
    (turn,) = list_failed_turns(db)
    assert turn["outcome"] == "resend"
