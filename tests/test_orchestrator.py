"""The orchestrator in-process with the real database, queue and outbox rows; no engine.

(The whole path with a real engine and image is tests/e2e/test_daemon_e2e.py.)
"""

from __future__ import annotations

import asyncio

from mdclaw.channels.base import InboundMessage
from mdclaw.config import load_config
from mdclaw.orchestrator import Orchestrator
from mdclaw.reconcile import reconcile
from mdclaw.state import Database
from mdclaw.state.conversations import get_cursor
from mdclaw.state.outbox import list_outbox

CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC}
groups:
  main: {name: Admin, jid: "hl:main", main: true}
  family: {name: Family, jid: "hl:family"}
limits: {run_attempts: 1}
"""


def msg(i: int, jid: str, text: str) -> InboundMessage:
    return InboundMessage(id=f"{jid}:{i}", chat_jid=jid, sender="u1", sender_name="Alice",
                          content=text, timestamp=f"2026-01-01T00:00:{i:02d}.000Z",
                          channel="http")


def setup(write_config):
    cfg = load_config(write_config(CONFIG))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    return cfg, db


def test_trigger_decides_and_duplicates_are_dropped(write_config) -> None:
    cfg, db = setup(write_config)

    async def main() -> list[str]:
        orch = Orchestrator(cfg, db, runner=None)
        await orch.on_inbound(msg(1, "hl:family", "just chatting"))
        await orch.on_inbound(msg(1, "hl:family", "just chatting"))  # redelivered
        untriggered = [j.id for j in orch.queue.pending()] + orch.queue.running_groups()
        await orch.on_inbound(msg(2, "hl:family", "hey @andy, what now?"))
        triggered = orch.queue.running_groups() + [j.id for j in orch.queue.pending()]
        await orch.queue.join()
        return [str(untriggered), str(triggered)]

    untriggered, triggered = asyncio.run(main())
    assert untriggered == "[]"
    assert "family" in triggered or "msg:family" in triggered
    assert db.query_one("SELECT COUNT(*) FROM messages")[0] == 2


def test_failed_run_tells_the_chat_once_with_the_cause_and_true_count(write_config) -> None:
    cfg, db = setup(write_config)

    async def main() -> None:
        orch = Orchestrator(cfg, db, runner=None)
        await orch.on_inbound(msg(1, "hl:main", "hello"))
        await asyncio.wait_for(orch.queue.join(), 10)

    asyncio.run(main())
    (row,) = list_outbox(db)
    assert row.chat_jid == "hl:main" and row.source_group == "main"
    assert "container engine" in row.text and "not reachable" in row.text
    assert "tried once" in row.text and "send it again" in row.text  # run_attempts: 1
    # The user was told to resend: the message is set aside, not run again at the next start.
    assert get_cursor(db, "main") == db.scalar("SELECT seq FROM messages WHERE id = 'hl:main:1'")
    assert db.query_one("SELECT failed_cause FROM messages")[0] == "engine_down"


def test_recover_pending_queues_only_groups_with_triggered_messages(write_config) -> None:
    cfg, db = setup(write_config)
    from mdclaw.state.conversations import StoredMessage, store_message

    store_message(db, StoredMessage("a", "hl:main", "u", "U", "hi", "2026-01-01T00:00:01Z",
                                    False, False))
    store_message(db, StoredMessage("b", "hl:family", "u", "U", "no trigger here",
                                    "2026-01-01T00:00:02Z", False, False))

    async def main() -> int:
        orch = Orchestrator(cfg, db, runner=None)
        n = orch.recover_pending()
        groups = set(orch.queue.running_groups()) | {j.group for j in orch.queue.pending()}
        assert groups == {"main"}
        await asyncio.wait_for(orch.queue.join(), 10)
        return n

    assert asyncio.run(main()) == 1


def test_a_typing_indicator_that_fails_never_fails_the_run_and_is_logged(
        write_config, caplog) -> None:
    import logging

    from mdclaw.channels.base import ChannelError
    from mdclaw.channels.http import HttpChannel
    from mdclaw.webserver import WebServer

    cfg, db = setup(write_config)

    class Flaky(HttpChannel):
        def __init__(self, error: Exception) -> None:
            super().__init__(db, WebServer("127.0.0.1:0"))
            self.error = error

        async def set_typing(self, jid: str, typing: bool) -> None:
            raise self.error

    async def main() -> None:
        orch = Orchestrator(cfg, db, runner=None)
        orch.channels = [Flaky(ChannelError("chat service away"))]
        await orch._set_typing("hl:main", True)
        orch.channels = [Flaky(KeyError("a bug"))]
        await orch._set_typing("hl:main", True)

    with caplog.at_level(logging.DEBUG, logger="mdclaw.orchestrator"):
        asyncio.run(main())
    away = [r for r in caplog.records if "chat service away" in r.getMessage()]
    assert [r.levelno for r in away] == [logging.DEBUG]
    bug = [r for r in caplog.records if "failed to set typing" in r.getMessage()]
    assert len(bug) == 1 and bug[0].levelno == logging.WARNING
    assert bug[0].exc_info is not None and bug[0].exc_info[0] is KeyError
