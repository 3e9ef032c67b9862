"""Messages are stored once, each with the host's sequence number; cursors (a sequence
number) and sessions persist per group."""

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
    since = messages_since(db, "tg:1", None)
    assert [m.id for m in since] == [f"tg:1:{i}" for i in range(1, 6)]
    seqs = [m.seq for m in since]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5  # in the order stored (gaps allowed)
    assert [m.id for m in messages_since(db, "tg:1", since[2].seq)] == ["tg:1:4", "tg:1:5"]
    assert [m.id for m in messages_since(db, "tg:1", None, limit=2)] == ["tg:1:4", "tg:1:5"]
    chat = db.query_one("SELECT * FROM chats WHERE jid='tg:1'")
    assert chat["name"] == "Fam" and chat["last_activity"] == msg(6).timestamp


def test_cursor_and_session(tmp_path) -> None:
    db = Database(tmp_path / "s.db")
    assert get_cursor(db, "fam") is None
    set_cursor(db, "fam", 3)
    set_session(db, "fam", "sess-1")
    db.close()
    db = Database(tmp_path / "s.db")
    assert get_cursor(db, "fam") == 3
    assert get_session(db, "fam") == "sess-1"
    set_session(db, "fam", None)
    assert get_session(db, "fam") is None
    set_cursor(db, "fam", None)  # back to before the first message
    assert get_cursor(db, "fam") is None


def test_the_order_is_the_order_stored_never_the_services_clock(tmp_path) -> None:
    """Messages of one second, and a message whose clock is behind (a phone's clock, a
    service's late delivery), are after the cursor once stored after it moved."""
    db = Database(tmp_path / "s.db")
    same = "2026-01-01T00:00:07.000Z"
    store_message(db, StoredMessage("tg:1:1", "tg:1", "u", "U", "a", same, False, False))
    (first,) = messages_since(db, "tg:1", None)
    set_cursor(db, "fam", first.seq)  # its turn is done
    store_message(db, StoredMessage("tg:1:2", "tg:1", "u", "U", "b", same, False, False))
    store_message(db, StoredMessage("tg:1:3", "tg:1", "u", "U", "c",
                                    "2026-01-01T00:00:03.000Z", False, False))
    after = messages_since(db, "tg:1", get_cursor(db, "fam"))
    assert [m.id for m in after] == ["tg:1:2", "tg:1:3"]
    # A number is never given twice, not even once the newest message is gone.
    with db.transaction() as c:
        c.execute("DELETE FROM messages WHERE id = 'tg:1:3'")
    store_message(db, StoredMessage("tg:1:4", "tg:1", "u", "U", "d", same, False, False))
    assert messages_since(db, "tg:1", after[-1].seq)[0].id == "tg:1:4"
