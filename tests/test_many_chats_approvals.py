"""An approval's outcome note goes to the chat the held request came from: in a group with
several chats, the chat of the message the agent was answering when it asked (falling back
to the group's first chat). A real daemon (tests/test_many_chats_daemon.py's world), the
owner's default rule that asks before anything goes into another chat, the operator's
decision."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

from fake_engine import FakeContainer
from mdclaw.ops.approvals import decide
from test_many_chats_daemon import ME, World, run_daemon, world  # noqa: F401 - the fixture

PEOPLE = f"""\
people:
  sam: {{name: Sam, role: owner, identities: {{telegram: ["{ME}"]}}}}
"""


def _pending(data: Path) -> list[int]:
    with sqlite3.connect(data / "state.db", timeout=30) as db:
        return [r[0] for r in db.execute("SELECT id FROM approvals WHERE status = 'pending'")]


def asking_agent(w: World):  # noqa: ANN201 - a fake engine script
    """Asked to "post the news", it sends a message to hl:news (which waits for the owner)
    before it answers; anything else it just answers."""

    def script(c: FakeContainer) -> int:
        text: str | None = c.prompt
        while text is not None:
            if "post the news" in text:
                assert c.ipc_dir is not None
                d = c.ipc_dir / "messages"
                body = {"type": "message", "chat_jid": "hl:news", "text": "the news"}
                name = f"{int(time.time() * 1000)}-news.json"
                (d / f".{name}").write_text(json.dumps(body))
                os.rename(d / f".{name}", d / name)
                c.wait_for(lambda: _pending(w.data), what="the approval opened")
            c.say({"status": "success", "result": "ok"})
            got = c.next_input(timeout=60)
            text = None if got is None else str(got.get("content", ""))
        return 0

    return script


def test_the_outcome_note_goes_to_the_chat_that_asked(world: World) -> None:  # noqa: F811
    w = world
    w.extra = PEOPLE

    async def body() -> None:
        assert w.d is not None
        w.telegram("hello")  # the first chat speaks first: the web chat is not the default
        await w.until(lambda: "ok" in w.telegram_out(), "the Telegram answer")
        await w.web("please post the news")
        await w.until(lambda: _pending(w.data), "the approval opened")
        (approval,) = _pending(w.data)
        decide(w.d.db, w.d.cfg, approval, "deny", via="page")
        w.d.wake_approvals()
        note = f"host:approval:{approval}"
        await w.until(lambda: w.query("SELECT chat_jid FROM messages WHERE id = ?", note),
                      "the outcome note")
        assert w.query("SELECT chat_jid FROM messages WHERE id = ?", note) == [("hl:me",)]
        content = w.query("SELECT content FROM messages WHERE id = ?", note)[0][0]
        assert "was denied" in content

    w.agent = asking_agent(w)  # type: ignore[assignment] - the engine runs it
    run_daemon(w, "shared", body)
