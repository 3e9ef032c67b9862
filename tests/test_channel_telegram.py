"""The Telegram channel against a fake Bot API server on loopback (an aiohttp app)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import re
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fake_telegram import TOKEN, FakeBotApi
from mdclaw.channels.base import Card, ChannelError, InboundMessage
from mdclaw.channels.telegram import TelegramChannel, utf16_len
from mdclaw.outbox import OutboxWorker, RetryPolicy, get_row
from mdclaw.retry import Backoff
from mdclaw.state import Database
from mdclaw.state.outbox import enqueue
from waiting import wait_until_async


def run(coro_fn):
    async def main() -> None:
        api = FakeBotApi()
        await api.start()
        got: list[InboundMessage] = []
        ch = TelegramChannel(TOKEN, api_base=api.base, on_inbound=got.append, poll_timeout=1)
        try:
            await coro_fn(api, ch, got)
        finally:
            await ch.disconnect()
            await api.stop()

    asyncio.run(main())


async def restart_asks_after(api: Any, db: Any, last: int) -> None:
    """A new channel over the same database asks Telegram for the updates after `last` and
    hands nothing over twice."""
    api.offsets.clear()
    again: list[InboundMessage] = []
    second = TelegramChannel(TOKEN, api_base=api.base, on_inbound=again.append,
                             poll_timeout=1, db=db)
    await second.connect()
    # its first poll answered (nothing) and handled: the second poll has begun
    await wait_until_async(lambda: len(api.offsets) >= 2)
    await second.disconnect()
    assert api.offsets[0] == last + 1
    assert again == []  # nothing handed over twice

def test_inbound_text_and_captions_reach_the_callback() -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        assert ch.is_connected() and ch.bot_username == "mdclaw_test_bot"
        api.push({"message_id": 7, "date": 1_767_225_600,
                  "chat": {"id": -1001234, "type": "supergroup", "title": "Family"},
                  "from": {"id": 42, "first_name": "Alice", "last_name": "B"},
                  "text": "@Andy what's up?"})
        api.push({"message_id": 8, "date": 1_767_225_601,
                  "chat": {"id": 99, "type": "private", "first_name": "Bob"},
                  "from": {"id": 99, "first_name": "Bob"},
                  "photo": [{"file_id": "x"}], "caption": "look at this"})
        api.push({"message_id": 9, "date": 1_767_225_602,
                  "chat": {"id": 99, "type": "private"}, "from": {"id": 99},
                  "sticker": {"file_id": "y"}})
        await wait_until_async(lambda: len(got) == 2 and api.offsets[-1] == 503)
        assert not got[0].addressed
        a, b = got
        assert (a.id, a.chat_jid, a.sender, a.sender_name, a.content) == (
            "tg:-1001234:7", "tg:-1001234", "42", "Alice B", "@Andy what's up?")
        assert a.is_group and a.chat_name == "Family" and a.channel == "telegram"
        assert a.timestamp == "2026-01-01T00:00:00.000Z"
        assert (b.chat_jid, b.content, b.is_group, b.chat_name) == (
            "tg:99", "look at this", False, "Bob")
        # the offset confirms what was handed over: nothing comes twice
        await asyncio.sleep(0.3)
        assert len(got) == 2

    run(body)


def test_host_failure_leaves_the_update_unconfirmed() -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        seen: list[str] = []

        def flaky(msg: InboundMessage) -> None:
            seen.append(msg.id)
            if len(seen) == 1:
                raise RuntimeError("database locked")

        ch.on_inbound(flaky)
        await ch.connect()
        api.push({"message_id": 1, "date": 1, "chat": {"id": 5, "type": "private"},
                  "from": {"id": 5, "first_name": "E"}, "text": "hello"})
        await wait_until_async(lambda: len(seen) == 2, timeout=15)
        assert seen == ["tg:5:1", "tg:5:1"]  # redelivered; the host's dedupe handles it

    run(body)


def test_outbox_splits_at_4096_utf16_units_and_retries_a_5xx(tmp_path: Path) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        db = Database(tmp_path / "s.db")
        api.fail["sendMessage"] = [(502, {"ok": False, "error_code": 502,
                                          "description": "Bad Gateway"})]
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=4, base_delay=0.1))
        await w.start()
        try:
            long_text = "\n".join(f"line {i} " + "x" * 90 for i in range(100))  # ~9.8k
            emoji = "\N{GRINNING FACE}" * 3000  # 6000 UTF-16 units, one word
            with db.transaction() as c:
                r1 = enqueue(c, chat_jid="tg:-1001234", kind="text", text=long_text,
                             reply_to="tg:-1001234:7", source_group="family")
                r2 = enqueue(c, chat_jid="tg:-1001234", kind="text", text=emoji,
                             source_group="family")
            w.wake()
            await wait_until_async(lambda: get_row(db, r2).status == "sent")
            row1 = get_row(db, r1)
            assert row1.status == "sent" and row1.attempts == 2
            sends = api.of("sendMessage")
            texts = [p["text"] for p in sends]
            assert sends[0]["text"] == sends[1]["text"]  # the 502'd piece, then again
            texts = texts[1:]
            assert all(utf16_len(t) <= 4096 for t in texts)
            n1 = len(texts) - 2
            assert n1 == 3
            assert "\n".join(texts[:n1]) == long_text
            assert "".join(texts[n1:]) == emoji
            assert sends[0]["chat_id"] == -1001234
            assert sends[0]["reply_parameters"]["message_id"] == 7
            assert "reply_parameters" not in sends[2]
        finally:
            await w.stop()
            db.close()

    run(body)


def test_files_reactions_and_typing(tmp_path: Path) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        doc = tmp_path / "report.pdf"
        doc.write_bytes(b"%PDF-1.4 fake")
        png = tmp_path / "chart.png"
        png.write_bytes(b"\x89PNG fake")
        mid = await ch.send_file("tg:99", doc, caption="the report")
        assert mid and mid.startswith("tg:99:")
        await ch.send_file("tg:99", png, file_name="chart.png")
        d = api.of("sendDocument")[0]
        assert d["chat_id"] == "99" and d["caption"] == "the report"
        assert d["document"] == ("report.pdf", b"%PDF-1.4 fake")
        assert api.of("sendPhoto")[0]["photo"] == ("chart.png", b"\x89PNG fake")
        with pytest.raises(ChannelError) as ei:
            await ch.send_file("tg:99", tmp_path / "missing.txt")
        assert ei.value.permanent

        await ch.react("tg:-1001234", "tg:-1001234:55", "\N{THUMBS UP SIGN}")
        assert api.of("setMessageReaction") == [{
            "chat_id": -1001234, "message_id": 55,
            "reaction": [{"type": "emoji", "emoji": "\N{THUMBS UP SIGN}"}]}]

        await ch.set_typing("tg:99", True)
        await wait_until_async(lambda: len(api.of("sendChatAction")) == 1)
        assert api.of("sendChatAction")[0] == {"chat_id": 99, "action": "typing"}
        await ch.set_typing("tg:99", False)
        assert not ch._typing
        await ch.set_typing("hl:main", True)  # not ours: ignored

    run(body)


def test_errors_are_classified_and_never_show_the_token(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        api.fail["sendMessage"] = [
            (400, {"ok": False, "error_code": 400, "description": "Bad Request: chat not found"}),
            (429, {"ok": False, "error_code": 429, "description": "Too Many Requests",
                   "parameters": {"retry_after": 3}}),
        ]
        with pytest.raises(ChannelError) as e1:
            await ch.send_message("tg:1", "x")
        assert e1.value.permanent and "chat not found" in str(e1.value)
        with pytest.raises(ChannelError) as e2:
            await ch.send_message("tg:1", "x")
        assert not e2.value.permanent and e2.value.retry_after == 3
        with pytest.raises(ChannelError):
            await ch.send_message("hl:main", "x")
        errors = [str(e1.value), str(e2.value)]

        # a token the server rejects, and a server that is not there
        bad = TelegramChannel("999:WRONG-token", api_base=api.base)
        with pytest.raises(ChannelError) as e3:
            await bad.connect()
        assert not bad.is_connected()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead_port = s.getsockname()[1]
        gone = TelegramChannel(TOKEN, api_base=f"http://127.0.0.1:{dead_port}",
                               poll_timeout=1)
        await gone.connect()  # starts anyway, not connected, keeps polling
        try:
            assert not gone.is_connected()
            with pytest.raises(ChannelError) as e4:
                await gone.send_message("tg:1", "x")
            assert not e4.value.permanent
            await asyncio.sleep(1.2)  # a failed poll and its warning
        finally:
            await gone.disconnect()
        assert "rejected the bot token" in str(e3.value)
        errors += [str(e3.value), str(e4.value)]
        for text in errors + [r.getMessage() for r in caplog.records]:
            assert "SECRET" not in text and "WRONG-token" not in text, text

    run(body)


def test_an_update_the_host_refuses_comes_again_after_growing_pauses() -> None:
    calls: list[float] = []
    got: list[InboundMessage] = []

    async def host(msg: InboundMessage) -> None:
        calls.append(time.monotonic())
        if len(calls) <= 3:
            raise RuntimeError("database is locked")
        got.append(msg)

    async def main() -> None:
        api = FakeBotApi()
        await api.start()
        ch = TelegramChannel(TOKEN, api_base=api.base, on_inbound=host, poll_timeout=1)
        ch.poll_backoff = Backoff(base=0.1, factor=2.0, cap=1.0, jitter=0)
        try:
            await ch.connect()
            api.push({"message_id": 9, "date": 1, "chat": {"id": 5, "type": "private"},
                      "from": {"id": 5, "first_name": "A"}, "text": "hello"})
            await wait_until_async(lambda: len(got) == 1)
            await wait_until_async(lambda: api.offsets[-1] == 501)  # confirmed at last
        finally:
            await ch.disconnect()
            await api.stop()

    asyncio.run(main())
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert len(gaps) == 3 and [m.content for m in got] == ["hello"]
    # 0.1 s, 0.2 s, 0.4 s: the pause grows while the host keeps refusing (a poll that
    # succeeds in between does not reset it).
    assert gaps[0] >= 0.09 and gaps[1] >= 0.19 and gaps[2] >= 0.39
    assert gaps[2] >= gaps[0] + 0.2


def test_disconnect_passes_on_a_cancel_of_its_caller_and_still_closes() -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        stuck = asyncio.Event()

        async def ignores_cancel() -> None:
            # A task that takes its time to end once cancelled.
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                stuck.set()
                await asyncio.sleep(3600)

        ch._typing["tg:1"] = asyncio.create_task(ignores_cancel(), name="slow")
        stopping = asyncio.create_task(ch.disconnect())
        await stuck.wait()
        stopping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopping
        assert ch._session is None and not ch.is_connected()

    run(body)


def test_from_config_reads_the_token_file(tmp_path: Path) -> None:
    from mdclaw.config import TelegramChannel as Section

    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    os.chmod(f, 0o600)
    ch = TelegramChannel.from_config(Section(token_file=str(f), api_base="http://127.0.0.1:9"))
    assert ch.api_base == "http://127.0.0.1:9" and ch.redact(f"/bot{TOKEN}/x") == "/bot***/x"
    with pytest.raises(ChannelError):
        TelegramChannel("bad token with spaces")


def test_mentions_and_replies_to_the_bot_address_the_assistant() -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        ch.trigger = "@Andy"
        await ch.connect()
        group = {"id": -100, "type": "group", "title": "G"}
        who = {"id": 42, "first_name": "Alice"}
        api.push({"message_id": 1, "date": 1, "chat": group, "from": who,
                  "text": "@MDCLAW_test_bot what time is it?"})
        api.push({"message_id": 2, "date": 2, "chat": group, "from": who,
                  "text": "thanks!", "reply_to_message": {"message_id": 1001,
                                                          "from": {"id": 1, "is_bot": True}}})
        api.push({"message_id": 3, "date": 3, "chat": group, "from": who,
                  "text": "@andy and @mdclaw_test_bot"})
        api.push({"message_id": 4, "date": 4, "chat": group, "from": who,
                  "text": "mail me at x@mdclaw_test_botnet.org"})
        await wait_until_async(lambda: len(got) == 4)
        assert [(m.addressed, m.content) for m in got] == [
            (True, "@Andy @MDCLAW_test_bot what time is it?"),
            (True, "@Andy thanks!"),
            (True, "@andy and @mdclaw_test_bot"),  # the trigger is there already
            (False, "mail me at x@mdclaw_test_botnet.org"),
        ]

    run(body)


def test_an_image_telegram_refuses_as_photo_goes_as_document(tmp_path: Path) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        img = tmp_path / "wide.png"
        img.write_bytes(b"\x89PNG very wide")
        api.fail["sendPhoto"] = [(400, {"ok": False, "error_code": 400,
                                        "description": "Bad Request: PHOTO_INVALID_DIMENSIONS"})]
        assert await ch.send_file("tg:5", img, caption="chart")
        doc = api.of("sendDocument")[0]
        assert doc["document"] == ("wide.png", b"\x89PNG very wide")
        assert doc["caption"] == "chart"

    run(body)


def test_an_outage_delays_messages_without_using_up_their_tries(tmp_path: Path) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        port = int(api.base.rsplit(":", 1)[1])
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=2, base_delay=0.1),
                         disconnected_recheck=0.2)
        await w.start()
        try:
            await api.stop()  # Telegram goes away
            await wait_until_async(lambda: not ch.is_connected())
            with db.transaction() as c:
                rid = enqueue(c, chat_jid="tg:7", kind="text", text="after the outage",
                              source_group="main")
            w.wake()
            # the worker looked at it
            await wait_until_async(lambda: get_row(db, rid).last_error)
            await asyncio.sleep(1.5)  # far longer than two tries would take
            row = get_row(db, rid)
            assert row.status == "pending" and row.attempts == 0
            assert "not connected" in row.last_error
            await api.start(port)  # back; the poller reconnects, the row goes out
            await wait_until_async(lambda: get_row(db, rid).status == "sent", timeout=20)
            assert [p["text"] for p in api.of("sendMessage")] == ["after the outage"]
        finally:
            await w.stop()
            db.close()

    run(body)


def test_chatid_command_tells_the_jid_and_stays_out_of_the_chat() -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        chat = {"id": -1009, "type": "supergroup", "title": "New group"}
        api.push({"message_id": 3, "date": 1, "chat": chat, "from": {"id": 1},
                  "text": "/chatid@mdclaw_test_bot"})
        api.push({"message_id": 4, "date": 1, "chat": chat, "from": {"id": 1},
                  "text": "/chatid@other_bot"})
        api.push({"message_id": 5, "date": 2, "chat": chat, "from": {"id": 1}, "text": "hi"})
        await wait_until_async(lambda: len(got) == 2)
        assert [m.content for m in got] == ["/chatid@other_bot", "hi"]
        answer = api.of("sendMessage")
        assert [(a["chat_id"], a["text"]) for a in answer] == [(-1009, "This chat is tg:-1009")]

    run(body)


def test_the_offset_survives_a_restart(tmp_path) -> None:
    """After a restart the first getUpdates carries the saved offset: updates handed over
    before it are not delivered again."""
    from mdclaw.state import Database

    db = Database(tmp_path / "state.db")

    async def main() -> None:
        api = FakeBotApi()
        await api.start()
        try:
            for n in range(2):
                api.push({"message_id": n + 1, "date": 1_767_225_600,
                          "chat": {"id": 5, "type": "private"},
                          "from": {"id": 42, "first_name": "A"}, "text": f"m{n}"})
            got: list[InboundMessage] = []
            first = TelegramChannel(TOKEN, api_base=api.base, on_inbound=got.append,
                                    poll_timeout=1, db=db)
            await first.connect()
            await wait_until_async(lambda: len(got) == 2)
            last = max(u["update_id"] for u in api.updates)
            await wait_until_async(lambda: (last + 1) in api.offsets)
            await first.disconnect()
            await restart_asks_after(api, db, last)
        finally:
            await api.stop()

    asyncio.run(main())
    db.close()


def test_photos_documents_and_voice_notes_arrive_as_attachments_fetched_with_getfile(
        tmp_path: Path, write_config) -> None:
    from mdclaw.config import load_config
    from mdclaw.formatting import format_attachment
    from mdclaw.media import save_all

    cfg = load_config(write_config())
    (cfg.data_dir / "groups" / "main").mkdir(parents=True)
    photo_big = os.urandom(50_000)

    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        api.files["small"] = ("photos/file_1.jpg", b"small", None)
        api.files["big"] = ("photos/file_2.jpg", photo_big, None)
        api.files["doc"] = ("documents/file_3.pdf", b"%PDF-1.4 hello", None)
        api.files["voice"] = ("voice/file_4.oga", b"OggS voice", None)
        chat = {"id": 99, "type": "private", "first_name": "Bob"}
        api.push({"message_id": 20, "date": 1_767_225_600, "chat": chat, "from": {"id": 99},
                  "caption": "the garden",
                  "photo": [{"file_id": "small", "file_size": 5, "width": 90, "height": 60},
                            {"file_id": "big", "file_size": 50_000, "width": 1280,
                             "height": 960}]})
        api.push({"message_id": 21, "date": 1_767_225_601, "chat": chat, "from": {"id": 99},
                  "document": {"file_id": "doc", "file_name": "../../Report.PDF",
                               "mime_type": "application/pdf", "file_size": 14}})
        api.push({"message_id": 22, "date": 1_767_225_602, "chat": chat, "from": {"id": 99},
                  "voice": {"file_id": "voice", "mime_type": "audio/ogg", "duration": 2,
                            "file_size": 10}})
        await wait_until_async(lambda: len(got) == 3)
        photo, doc, voice = got
        assert photo.content == "the garden" and doc.content == "" and voice.content == ""
        assert [(a.kind, a.name, a.mime, a.size, a.caption) for m in got
                for a in m.attachments] == [
            ("image", "photo.jpg", "image/jpeg", 50_000, "the garden"),
            ("document", "../../Report.PDF", "application/pdf", 14, None),
            ("voice", None, "audio/ogg", 10, None)]
        saved = []
        for m in got:
            saved += await save_all(cfg, "main", m.attachments)
        assert api.of("getFile") == [{"file_id": "big"}, {"file_id": "doc"},
                                     {"file_id": "voice"}]
        assert api.downloads == ["photos/file_2.jpg", "documents/file_3.pdf",
                                 "voice/file_4.oga"]
        inbox = cfg.data_dir / "groups" / "main" / "inbox"
        (day,) = [p.name for p in inbox.iterdir()]
        assert (inbox / day / "photo.jpg").read_bytes() == photo_big
        assert (inbox / day / "Report.pdf").read_bytes() == b"%PDF-1.4 hello"
        assert (inbox / day / "voice.oga").read_bytes() == b"OggS voice"
        text = format_attachment(saved[0].as_dict(), photo.content)
        assert text == (f'<attachment kind="image" path="/workspace/group/inbox/{day}/'
                        'photo.jpg" type="image/jpeg" size="48.8 KiB"/>')

    run(body)


def test_downloads_are_capped_and_their_errors_hide_the_token(caplog) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        api.files["liar"] = ("documents/liar.bin", b"z" * 100_000, 10)  # says 10 bytes
        api.files["huge"] = ("documents/huge.bin", b"", 25 * 1024 * 1024)
        with pytest.raises(ChannelError, match="larger than the 1000 bytes"):
            await ch.download("liar", 1000)
        with pytest.raises(ChannelError, match="over the 20971520 bytes"):
            await ch.download("huge", 100 * 1024 * 1024)  # the Bot API's 20 MB wins
        assert api.downloads == ["documents/liar.bin"]  # the huge one was never asked for
        with pytest.raises(ChannelError, match="invalid file_id") as ei:
            await ch.download("unknown", 1000)
        errors = [str(ei.value)]
        api.files["ok"] = ("documents/ok.bin", b"fine", None)
        await api.stop()  # Telegram is away: a connection error, token masked
        with pytest.raises(ChannelError) as ei2:
            await ch.download("ok", 1000)
        errors.append(str(ei2.value))
        for text in errors + [r.getMessage() for r in caplog.records]:
            assert TOKEN not in text and "SECRET" not in text

    run(body)


def _covered(text: str, entities: list[dict[str, Any]]) -> list[tuple[str, str]]:
    raw = text.encode("utf-16-le")
    return [(e["type"], raw[2 * e["offset"]:2 * (e["offset"] + e["length"])].decode("utf-16-le"))
            for e in entities]


def test_markdown_goes_out_as_text_with_entities_at_utf16_offsets(tmp_path: Path) -> None:
    """Each construct arrives at the Bot API as an entity over the right text, offsets in
    UTF-16 units (an emoji counts two), through the outbox like any reply."""
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=2, base_delay=0.1))
        await w.start()
        try:
            md = ("## 😀 Plan 计划\n\n**粗体** then *ital 😀* ~~no~~ `code` "
                  "[link](https://example.org/x)\n\n- first\n- 😀 **second**\n\n"
                  "> a quote\n\n```python\nx = '😀'\n```\n\n| k | v |\n|---|---|\n| a | 1 |")
            with db.transaction() as c:
                rid = enqueue(c, chat_jid="tg:99", kind="text", text=md, source_group="g")
            w.wake()
            await wait_until_async(lambda: get_row(db, rid).status == "sent")
            (sent,) = api.of("sendMessage")
            text, ents = sent["text"], sent["entities"]
            assert "**" not in text and "```" not in text and "•" in text
            assert _covered(text, ents) == [
                ("bold", "😀 Plan 计划"), ("bold", "粗体"), ("italic", "ital 😀"),
                ("strikethrough", "no"), ("code", "code"), ("text_link", "link"),
                ("bold", "second"), ("blockquote", "a quote"), ("pre", "x = '😀'"),
                ("pre", "k | v\n--+--\na | 1")]
            assert ents[0] == {"type": "bold", "offset": 0, "length": 10}  # 😀 is 2 units
            assert [e["language"] for e in ents if e["type"] == "pre" and "language" in e] \
                == ["python"]
            assert [e["url"] for e in ents if e["type"] == "text_link"] == [
                "https://example.org/x"]
        finally:
            await w.stop()
            db.close()

    run(body)


def test_a_long_answer_is_cut_into_valid_pieces_with_their_entities(tmp_path: Path) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        code = "\n".join(f"print('line {i} 😀')" for i in range(400))  # ~9k units
        md = "**Intro** 😀\n\n```python\n" + code + "\n```\n\n_the end_"
        await ch.send_message("tg:99", md)
        sends = api.of("sendMessage")
        assert len(sends) >= 3
        for s in sends:
            assert utf16_len(s["text"]) <= 4096
            for e in s.get("entities", []):
                assert 0 <= e["offset"] and e["offset"] + e["length"] <= utf16_len(s["text"])
        pre = [t for s in sends for t, _ in [(_covered(s["text"], [e])[0][1], 0)
                                              for e in s.get("entities", [])
                                              if e["type"] == "pre"]]
        assert "\n".join(pre) == code
        assert _covered(sends[0]["text"], sends[0]["entities"])[0] == ("bold", "Intro")
        assert _covered(sends[-1]["text"], sends[-1]["entities"])[-1] == ("italic", "the end")

    run(body)


def test_entities_telegram_refuses_fall_back_to_plain_text(tmp_path: Path) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        db = Database(tmp_path / "s.db")
        refused = (400, {"ok": False, "error_code": 400,
                         "description": "Bad Request: can't parse entities: unsupported"})
        api.fail["sendMessage"] = [refused]
        api.fail["sendDocument"] = [refused]
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=1, base_delay=0.1))
        await w.start()
        try:
            with db.transaction() as c:
                rid = enqueue(c, chat_jid="tg:99", kind="text", text="**important** news",
                              source_group="g")
            w.wake()
            await wait_until_async(lambda: get_row(db, rid).status == "sent")
            first, second = api.of("sendMessage")
            assert first["entities"] and "entities" not in second
            assert first["text"] == second["text"] == "important news"
            # a caption's entities likewise
            doc = tmp_path / "r.pdf"
            doc.write_bytes(b"%PDF")
            await ch.send_file("tg:99", doc, caption="the **report**")
            a, b = api.of("sendDocument")
            assert a["caption"] == b["caption"] == "the report"
            assert json.loads(a["caption_entities"]) == [
                {"type": "bold", "offset": 4, "length": 6}]
            assert "caption_entities" not in b
        finally:
            await w.stop()
            db.close()

    run(body)


def test_chatid_answer_goes_through_the_outbox_and_survives_a_429(tmp_path: Path) -> None:
    """The /chatid answer meets Telegram's flood control first: it waits retry_after and
    arrives, instead of being logged and lost."""
    from mdclaw.outbox import service_replier

    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        ch.on_service_reply(service_replier(db, w.wake))
        api.fail["sendMessage"] = [(429, {
            "ok": False, "error_code": 429, "description": "Too Many Requests: retry after 1",
            "parameters": {"retry_after": 1}})]
        await w.start()
        await ch.connect()
        try:
            api.push({"message_id": 3, "date": 1, "from": {"id": 1},
                      "chat": {"id": -1009, "type": "supergroup", "title": "New"},
                      "text": "/chatid"})
            await wait_until_async(lambda: len(api.of("sendMessage")) == 2, timeout=15)
            first, second = api.of("sendMessage")
            assert first == second
            assert second["text"] == "This chat is tg:-1009"
            assert second["entities"] == [{"type": "code", "offset": 13, "length": 8}]
            assert second["reply_parameters"]["message_id"] == 3
            (row,) = db.query("SELECT * FROM outbox")
            await wait_until_async(lambda: get_row(db, row["id"]).status == "sent")
            final = get_row(db, row["id"])
            assert final.attempts == 2 and final.chat_jid == "tg:-1009"
            assert got == []  # the command stays out of the chat
        finally:
            await w.stop()
            db.close()

    run(body)


SLOW_CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC}
groups:
  main: {name: Admin, jid: "tg:99", main: true}
  family: {name: Family, jid: "tg:-77", requires_trigger: false}
media: {max_bytes: 1m}
"""


def test_a_slow_download_holds_up_neither_the_bot_nor_other_chats_and_keeps_order(
        write_config) -> None:
    """A file that downloads slowly (the fake holds it until told) is saved beside the
    channel's loop: another chat's text reaches the database and the queue meanwhile, and a
    text sent after the file in the same chat reaches the agent after it, never before."""
    from mdclaw.config import load_config
    from mdclaw.orchestrator import Orchestrator
    from mdclaw.reconcile import reconcile
    from mdclaw.state.conversations import messages_since

    cfg = load_config(write_config(SLOW_CONFIG))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    big = os.urandom(300_000)

    async def main() -> None:
        api = FakeBotApi()
        await api.start()
        orch = Orchestrator(cfg, db, runner=None)
        orch.queue.max_concurrent = 0  # runs are queued, never started: the inbound path
        ch = TelegramChannel(TOKEN, api_base=api.base, on_inbound=orch.on_inbound,
                             poll_timeout=1, db=db)
        try:
            await ch.connect()
            api.files["big"] = ("documents/big.bin", big, None)
            gate = api.gates["documents/big.bin"] = asyncio.Event()
            me = {"id": 99, "type": "private", "first_name": "Bob"}
            family = {"id": -77, "type": "group", "title": "Family"}
            api.push({"message_id": 1, "date": 1_767_225_600, "chat": me, "from": {"id": 99},
                      "document": {"file_id": "big", "file_name": "big.bin",
                                   "mime_type": "application/octet-stream"},
                      "caption": "the scan"})
            await asyncio.wait_for(api.download_started.wait(), 10)
            api.push({"message_id": 2, "date": 1_767_225_601, "chat": me, "from": {"id": 99},
                      "text": "what does it say?"})
            api.push({"message_id": 5, "date": 1_767_225_601, "chat": family,
                      "from": {"id": 42, "first_name": "Alice"}, "text": "dinner at 7"})
            # The other chat's message is stored and its run queued while the file is
            # still on its way; the bot confirmed all three updates.
            await wait_until_async(lambda: [m.id for m in messages_since(db, "tg:-77", None)]
                                   == ["tg:-77:5"])
            await wait_until_async(lambda: "msg:family" in [j.id for j in orch.queue.pending()])
            await wait_until_async(lambda: api.offsets and api.offsets[-1] == 503)
            assert not gate.is_set()
            # The same chat's text is kept (a redelivery would be a duplicate) but held
            # back behind the file: the agent sees neither yet.
            assert db.query_one("SELECT COUNT(*) FROM messages WHERE chat_jid = 'tg:99'")[0] == 2
            assert messages_since(db, "tg:99", None) == []
            gate.set()
            await orch.files_settled()
            msgs = messages_since(db, "tg:99", None)
            assert [m.id for m in msgs] == ["tg:99:1", "tg:99:2"]
            (f,) = msgs[0].attachments
            assert f["path"].endswith("/big.bin") and f["size"] == len(big)
            prompt = orch._prompt(msgs)
            assert prompt.index("<attachment") < prompt.index("what does it say?")
            day = f["path"].split("/")[-2]
            saved = cfg.data_dir / "groups" / "main" / "inbox" / day / "big.bin"
            assert saved.read_bytes() == big
        finally:
            await ch.disconnect()
            await api.stop()

    try:
        asyncio.run(main())
    finally:
        db.close()


def _stored_offset(path: Path) -> str | None:
    """The saved getUpdates offset, read through a connection of its own."""
    conn = sqlite3.connect(path)
    try:
        row = conn.execute("SELECT value FROM router_state WHERE key = ?",
                           (f"telegram_offset:{TOKEN.split(':', 1)[0]}",)).fetchone()
    finally:
        conn.close()
    return row[0] if row else None


def test_the_offset_is_written_off_the_event_loop_and_kept_across_restart(tmp_path) -> None:
    """Another process holds the database's write lock while a batch is handed over: the
    offset write waits for it on a thread, and the event loop keeps answering meanwhile
    (pinged from another thread). A disconnect while that write still waits keeps the
    newest offset, and a restart asks for what came after it."""
    path = tmp_path / "state.db"
    db = Database(path, timeout=30)

    async def main() -> None:
        api = FakeBotApi()
        await api.start()
        loop = asyncio.get_running_loop()
        delivered = threading.Event()
        got: list[InboundMessage] = []

        def on_inbound(m: InboundMessage) -> None:
            got.append(m)
            delivered.set()

        blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        answered: list[bool] = []

        def watch() -> None:
            """Once the batch is handed over (the write is next), ping the loop while the
            lock is held; then let the write through."""
            try:
                assert delivered.wait(10)
                for _ in range(3):
                    fut = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop)
                    try:
                        fut.result(timeout=2)
                        answered.append(True)
                    except concurrent.futures.TimeoutError:
                        answered.append(False)
            finally:
                blocker.execute("ROLLBACK")

        try:
            ch = TelegramChannel(TOKEN, api_base=api.base, on_inbound=on_inbound,
                                 poll_timeout=1, db=db)
            await ch.connect()
            blocker.execute("BEGIN IMMEDIATE")
            watcher = asyncio.create_task(asyncio.to_thread(watch))
            for n in range(3):
                api.push({"message_id": n + 1, "date": 1_767_225_600,
                          "chat": {"id": 5, "type": "private"},
                          "from": {"id": 42, "first_name": "A"}, "text": f"m{n}"})
            await wait_until_async(lambda: len(got) == 3)
            stopping = asyncio.create_task(ch.disconnect())  # while the write waits
            await watcher
            await stopping
            assert answered == [True, True, True]  # the loop never waited on the write
            last = max(u["update_id"] for u in api.updates)
            assert _stored_offset(path) == str(last + 1)

            await restart_asks_after(api, db, last)
        finally:
            blocker.close()
            await api.stop()

    asyncio.run(main())
    db.close()


def test_an_older_offset_never_overwrites_a_newer_one(tmp_path) -> None:
    """Offset writes carry the order the loop asked for them in: one that comes to the
    database after a later one was stored is dropped."""
    path = tmp_path / "state.db"
    db = Database(path)
    ch = TelegramChannel(TOKEN, api_base="http://127.0.0.1:9", db=db)
    try:
        # (mdclaw.channels.base.SavedPosition, which every channel's position uses)
        ch._saved_offset._write(2, "600")
        ch._saved_offset._write(1, "500")  # asked for first, reaching the database last
        assert _stored_offset(path) == "600"
        ch._saved_offset._write(3, "700")
        assert _stored_offset(path) == "700"
    finally:
        db.close()


# --------------------------------------------------------------------------- cards


def _card(text: str, *choices: tuple[str, str]) -> str:
    return json.dumps({"text": text, "fallback": text + "\nReply \"approve 7KQ2\"",
                       "choices": [{"label": label, "data": data} for label, data in choices]})


def test_a_card_goes_out_with_an_inline_keyboard_and_a_press_is_its_pressers(
        tmp_path: Path) -> None:
    db = Database(tmp_path / "state.db")

    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        presses: list[Any] = []

        async def host(press: Any) -> str:
            presses.append(press)
            return "Approved: ha_call_service lock.unlock"

        ch.on_press(host)
        await ch.connect()
        with db.transaction() as c:
            row = enqueue(c, chat_jid="tg:111", kind="text", card=_card(
                "Approval needed (#3): *not bold* `x` \\x1b",
                ("Approve", "mdc:3:approve"), ("Deny", "mdc:3:deny"),
                ("Show all", "mdc:3:show")))
        worker = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=1))
        assert await worker.run_once() == 1
        (sent,) = api.of("sendMessage")
        assert sent["text"] == "Approval needed (#3): *not bold* `x` \\x1b"  # as written
        assert "entities" not in sent
        assert sent["reply_markup"] == {"inline_keyboard": [
            [{"text": "Approve", "callback_data": "mdc:3:approve"},
             {"text": "Deny", "callback_data": "mdc:3:deny"}],
            [{"text": "Show all", "callback_data": "mdc:3:show"}]]}
        ((mid, _),) = api.keyboards(111)
        card = json.loads(get_row(db, row).card)
        assert card["sent"] == f"tg:111:{mid}"  # kept for the edit after the decision
        # Bob (222) presses the button on the card in Alex's chat: the press is Bob's.
        qid = api.push_press(from_id=222, chat_id=111, message_id=mid, data="mdc:3:approve",
                             first_name="Bob")
        await wait_until_async(lambda: qid in api.answered)
        (press,) = presses
        assert (press.channel, press.sender, press.sender_name, press.chat_jid,
                press.message_id, press.data) == ("telegram", "222", "Bob", "tg:111",
                                                  f"tg:111:{mid}", "mdc:3:approve")
        assert api.answered[qid]["text"] == "Approved: ha_call_service lock.unlock"
        assert len(api.of("answerCallbackQuery")) == 1

        # the decision edits the card: the outcome, no keyboard
        with db.transaction() as c:
            enqueue(c, chat_jid="tg:111", kind="text", message_id=card["sent"],
                    card=_card("Approved (#3) — by Bob (admin)"))
            enqueue(c, chat_jid="tg:111", kind="text", message_id="tg:111:99999",
                    card=_card("Denied (#4) — by Alex (owner)"))
        assert await worker.run_once() == 2
        edited = api.messages[(111, mid)]
        assert edited["text"] == "Approved (#3) — by Bob (admin)"
        assert edited["reply_markup"] is None and edited["edits"] == 1
        assert api.keyboards(111) == []
        # a card Telegram cannot find any more: the outcome comes as a new message
        assert api.of("sendMessage")[-1]["text"] == "Denied (#4) — by Alex (owner)"
        # the same edit again (a retry after a crash): "not modified" is no failure
        await ch.edit_card("tg:111", card["sent"], Card.from_json(
            _card("Approved (#3) — by Bob (admin)")))
        assert api.messages[(111, mid)]["edits"] == 1

    run(body)
    db.close()


def test_a_press_without_a_host_is_still_answered_and_a_message_still_comes(
        tmp_path: Path) -> None:
    async def body(api: FakeBotApi, ch: TelegramChannel, got: list[InboundMessage]) -> None:
        await ch.connect()
        qid = api.push_press(from_id=5, chat_id=5, message_id=1, data="mdc:1:approve")
        api.push({"message_id": 9, "date": 1767225600, "chat": {"id": 5, "type": "private"},
                  "from": {"id": 5, "first_name": "Eve"}, "text": "hello"})
        await wait_until_async(lambda: got and qid in api.answered)
        assert "text" not in api.answered[qid]
        assert [m.content for m in got] == ["hello"]

    run(body)


SAME_SECOND_CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC}
groups:
  main: {name: Admin, jid: "tg:99", main: true}
limits: {run_attempts: 1, idle_timeout: 10m}
"""


def test_messages_with_the_date_of_the_answered_one_each_get_an_answer(write_config) -> None:
    """Telegram's `date` is whole seconds. A message with the same `date` as the one just
    answered, sent while its conversation is still open and again just after the run ended,
    is answered all the same: the whole path, from getUpdates through the orchestrator and the
    real container runner (over a fake engine whose containers answer like the agent runner,
    tests/fake_engine.py's chat_agent) to sendMessage through the outbox."""
    from fake_engine import FakeEngine, chat_agent
    from mdclaw.config import load_config
    from mdclaw.orchestrator import Orchestrator
    from mdclaw.reconcile import reconcile
    from mdclaw.runner import ContainerRunner

    cfg = load_config(write_config(SAME_SECOND_CONFIG))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    engine = FakeEngine(default=chat_agent(
        lambda text: "answer to " + " ".join(re.findall(r"tok\d+", text))))

    async def main() -> list[str]:
        api = FakeBotApi()
        await api.start()
        runner = ContainerRunner(cfg, engine)
        worker = OutboxWorker(db, policy=RetryPolicy(base_delay=0.05, jitter=0))
        orch = Orchestrator(cfg, db, runner=runner, wake_outbox=worker.wake)
        orch.engine_ready.set()
        ch = TelegramChannel(TOKEN, api_base=api.base, on_inbound=orch.on_inbound,
                             poll_timeout=1, db=db)
        orch.channels = [ch]
        worker.set_channels([ch])
        me = {"id": 99, "type": "private", "first_name": "Bob"}

        def say(i: int) -> None:
            api.push({"message_id": i, "date": 1_767_225_600, "chat": me,
                      "from": {"id": 99, "first_name": "Bob"}, "text": f"tok{i}"})

        def answered() -> list[str]:
            return [p["text"] for p in api.of("sendMessage")]

        try:
            await ch.connect()
            await worker.start()
            say(1)
            await wait_until_async(lambda: len(answered()) == 1)
            say(2)  # the conversation is still open: fed into it
            await wait_until_async(lambda: len(answered()) == 2)
            handle = runner.active("main")
            assert handle is not None
            handle.close()  # as the idle timer would: the run ends
            await wait_until_async(lambda: runner.active("main") is None
                             and not orch.queue.running_groups())
            say(3)  # just after the turn, the same second
            await wait_until_async(lambda: len(answered()) == 3)
            return answered()
        finally:
            orch.accepting = False
            orch.close_conversations()
            await orch.queue.shutdown(grace=5)
            await runner.aclose()
            await worker.stop()
            await ch.disconnect()
            await api.stop()

    try:
        assert asyncio.run(main()) == ["answer to tok1", "answer to tok2", "answer to tok3"]
    finally:
        db.close()
