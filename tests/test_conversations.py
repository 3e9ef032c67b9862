"""Messages are stored once; cursors and sessions persist per group."""

from __future__ import annotations

from mdclaw.state import Database
from mdclaw.state.conversations import (
    StoredMessage,
    get_cursor,
    get_session,
    messages_since,
    set_cursor,
    set_session,
    store_message,
)


def msg(i: int, jid: str = "tg:1", bot: bool = False) -> StoredMessage:
    return StoredMessage(f"{jid}:{i}", jid, "u1", "Alice", f"text {i}",
                         f"2026-01-01T00:00:{i:02d}.000Z", False, bot)


def test_store_once_and_read_since_cursor(tmp_path) -> None:
    db = Database(tmp_path / "s.db")
    assert store_message(db, msg(1), chat_name="Fam", channel="telegram", is_group=True)
    assert not store_message(db, msg(1))  # duplicate delivery from the channel
    for i in range(2, 6):
        store_message(db, msg(i))
    store_message(db, msg(6, bot=True))
    store_message(db, msg(7, jid="tg:2"))
    assert [m.id for m in messages_since(db, "tg:1", None)] == [f"tg:1:{i}" for i in range(1, 6)]
    assert [m.id for m in messages_since(db, "tg:1", msg(3).timestamp)] == ["tg:1:4", "tg:1:5"]
    assert [m.id for m in messages_since(db, "tg:1", None, limit=2)] == ["tg:1:4", "tg:1:5"]
    chat = db.query_one("SELECT * FROM chats WHERE jid='tg:1'")
    assert chat["name"] == "Fam" and chat["last_activity"] == msg(6).timestamp


def test_cursor_and_session(tmp_path) -> None:
    db = Database(tmp_path / "s.db")
    assert get_cursor(db, "fam") is None
    set_cursor(db, "fam", "2026-01-01T00:00:03.000Z")
    set_session(db, "fam", "sess-1")
    db.close()
    db = Database(tmp_path / "s.db")
    assert get_cursor(db, "fam") == "2026-01-01T00:00:03.000Z"
    assert get_session(db, "fam") == "sess-1"
    set_session(db, "fam", None)
    assert get_session(db, "fam") is None
