"""The Discord channel: discord.py against a fake of Discord's gateway and REST API on loopback
(tests/fake_discord.py); only the REST root is pointed at the fake, and the gateway's
address is what the fake's GET /gateway/bot answers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("discord")

from fake_discord import (  # noqa: E402
    BOT_ID,
    CHANNEL_ID,
    THREAD_ID,
    TOKEN,
    FakeDiscord,
    user,
)
from mdclaw.channels.base import ChannelError, InboundMessage  # noqa: E402
from mdclaw.channels.discord import DiscordChannel  # noqa: E402
from mdclaw.config import load_config  # noqa: E402
from mdclaw.markup import utf16_len  # noqa: E402
from mdclaw.media import save_all  # noqa: E402
from mdclaw.outbox import OutboxWorker, RetryPolicy, get_row, service_replier  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw.state.outbox import enqueue  # noqa: E402
from waiting import wait_until_async  # noqa: E402

JID = f"dc:{CHANNEL_ID}"
MESSAGE_CONTENT_INTENT = 1 << 15
Body = Callable[[FakeDiscord, DiscordChannel, list[InboundMessage]], Awaitable[None]]


def run(body: Body, *, db: Database | None = None, trigger: str | None = "@Andy") -> None:
    async def main() -> None:
        fake = FakeDiscord()
        await fake.start()
        got: list[InboundMessage] = []
        ch = DiscordChannel(TOKEN, api_base=fake.api, on_inbound=got.append, trigger=trigger,
                            db=db, guild_ready_timeout=0.05)
        try:
            await body(fake, ch, got)
        finally:
            await ch.disconnect()
            await fake.stop()

    asyncio.run(main())


async def connected(fake: FakeDiscord, ch: DiscordChannel) -> None:
    await ch.connect()
    await wait_until_async(ch.is_connected, what="the gateway session is up")


def sent_texts(fake: FakeDiscord) -> list[str]:
    return [m["content"] for m in fake.sent]


# ---------------------------------------------------------------------- in and out


def test_message_in_and_a_formatted_answer_out_through_the_outbox(tmp_path: Path) -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        (ident,) = fake.identifies
        assert ident["intents"] & MESSAGE_CONTENT_INTENT  # message content asked for
        assert "secret" not in repr(ch.status_info())
        mention = user(BOT_ID, "mdclaw", bot=True)
        m = await fake.post(CHANNEL_ID, f"<@{BOT_ID}> what is **up**?", mentions=[mention])
        await wait_until_async(lambda: len(got) == 1)
        msg = got[0]
        assert msg.id == f"dc:{CHANNEL_ID}:{m['id']}" and msg.chat_jid == JID
        assert msg.sender == "77" and msg.sender_name == "alice"  # the id, never a name
        assert msg.channel == "discord" and msg.is_group and msg.addressed
        assert msg.content == "@Andy @mdclaw what is **up**?"
        # the bot's own messages and other bots' are not handed over
        await fake.post(CHANNEL_ID, "beep", author=user(99, "otherbot", bot=True))
        plain = await fake.post(CHANNEL_ID, "no mention here")
        await wait_until_async(lambda: len(got) == 2)
        assert got[1].id.endswith(plain["id"]) and not got[1].addressed

        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        await w.start()
        try:
            with db.transaction() as c:
                row = enqueue(c, chat_jid=JID, kind="text", reply_to=msg.id,
                              text="# Plan\n\nSome **bold**, a_snake_name and `code`.\n\n"
                                   "- one\n- two\n\n[docs](https://example.org/a_b)")
            w.wake()
            await wait_until_async(lambda: get_row(db, row).status == "sent")
        finally:
            await w.stop()
            db.close()
        (out,) = fake.sent
        assert out["content"] == ("# Plan\n\nSome **bold**, a\\_snake\\_name and `code`.\n\n"
                                  "- one\n- two\n\n[docs](<https://example.org/a_b>)")
        assert out["channel_id"] == str(CHANNEL_ID)
        assert int(out["message_reference"]["message_id"]) == int(m["id"])
        assert out["allowed_mentions"]["parse"] == ["users"]  # never @everyone or roles

    run(body)


def test_a_long_answer_is_split_at_2000_without_cutting_a_code_block() -> None:
    code = "\n".join(f"print({i})  # line {i}" for i in range(250))  # ~6 kB
    text = "Intro **words** " * 60 + f"\n\n```python\n{code}\n```\n\nDone."

    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        await ch.send_message(JID, text)
        texts = sent_texts(fake)
        assert len(texts) >= 4
        assert all(utf16_len(t) <= 2000 for t in texts)
        for t in texts:
            assert t.count("```") % 2 == 0  # every piece's blocks are closed
            assert t.replace("```", "").count("**") % 2 == 0  # no bold cut in two
        code_pieces = [t for t in texts if "```" in t]
        assert all(t.startswith("```python\n") for t in code_pieces[1:])
        lines = [ln for t in code_pieces for ln in t.split("\n") if ln.startswith("print(")]
        assert lines == code.split("\n")  # every line once, in order
        assert texts[-1].endswith("Done.")

    run(body)


def test_a_thread_belongs_to_its_channel_and_the_answer_goes_back_into_it() -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        bot_msg = await fake.post(THREAD_ID, "earlier answer",
                                  author=user(BOT_ID, "mdclaw", bot=True))
        m = await fake.post(THREAD_ID, "and in the thread?", reference=bot_msg)
        await wait_until_async(lambda: len(got) == 1)
        msg = got[0]
        assert msg.chat_jid == JID and msg.id == f"dc:{THREAD_ID}:{m['id']}"
        assert msg.addressed  # a reply to the bot's own message
        assert msg.reply_to == f"dc:{THREAD_ID}:{bot_msg['id']}"
        await ch.send_message(JID, "answer", reply_to=msg.id)
        (out,) = fake.sent
        assert out["channel_id"] == str(THREAD_ID)
        assert int(out["message_reference"]["message_id"]) == int(m["id"])
        # a reply_to naming a channel that is not this jid's (or its thread) is not followed
        await ch.send_message(JID, "plain", reply_to="dc:123:456")
        assert fake.sent[-1]["channel_id"] == str(CHANNEL_ID)
        assert "message_reference" not in fake.sent[-1]

    run(body)


CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC}
groups:
  main: {name: Admin, jid: "dc:600", main: true}
media: {max_bytes: 1k}
"""


def test_files_both_ways(tmp_path: Path, write_config: Any) -> None:
    cfg = load_config(write_config(CONFIG))

    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        small = fake.add_attachment("notes.txt", b"hello file", "text/plain")
        big = fake.add_attachment("big.bin", b"x" * 5000, "application/octet-stream")
        liar = fake.add_attachment("liar.bin", b"y" * 5000, "application/octet-stream")
        liar["size"] = 10  # announces less than it has
        await fake.post(CHANNEL_ID, "see files", attachments=[small, big, liar])
        await wait_until_async(lambda: len(got) == 1)
        atts = got[0].attachments
        assert [(a.name, a.kind, a.size) for a in atts] == [
            ("notes.txt", "document", 10), ("big.bin", "document", 5000),
            ("liar.bin", "document", 10)]
        (cfg.data_dir / "groups" / "main").mkdir(parents=True)
        saved = await save_all(cfg, "main", atts)
        assert saved[0].error is None and saved[0].container_path is not None
        day_dir = cfg.data_dir / "groups" / "main" / "inbox"
        (path,) = day_dir.rglob("notes.txt")
        assert path.read_bytes() == b"hello file"
        assert saved[1].error is not None and "limit" in saved[1].error
        assert saved[2].error is not None and "larger than" in saved[2].error
        assert not list(day_dir.rglob("*.bin"))

        out = tmp_path / "chart.png"
        out.write_bytes(b"\x89PNG fake image")
        mid = await ch.send_file(JID, out, caption="the **chart**")
        assert fake.files == [("chart.png", b"\x89PNG fake image")]
        assert fake.sent[-1]["content"] == "the **chart**"
        assert mid == f"dc:{CHANNEL_ID}:{fake.sent[-1]['id']}"
        missing = tmp_path / "gone.pdf"
        with pytest.raises(ChannelError) as e:
            await ch.send_file(JID, missing)
        assert e.value.permanent

    run(body)


def test_reaction_and_typing() -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        m = await fake.post(CHANNEL_ID, "react to me")
        await wait_until_async(lambda: len(got) == 1)
        await ch.react(JID, got[0].id, "\N{THUMBS UP SIGN}")
        assert fake.reactions == [(CHANNEL_ID, int(m["id"]), "\N{THUMBS UP SIGN}")]
        with pytest.raises(ChannelError) as e:
            await ch.react(JID, "tg:1:2", "x")
        assert e.value.permanent
        await ch.set_typing(JID, True)
        await fake.wait(lambda: fake.typing == [CHANNEL_ID])
        await ch.set_typing(JID, False)
        assert not ch._typing  # noqa: SLF001 - the repeat loop is stopped
        await fake.post(THREAD_ID, "asked in the thread")
        await wait_until_async(lambda: len(got) == 2)
        await ch.set_typing(JID, True)  # shows where the question was asked
        await fake.wait(lambda: fake.typing == [CHANNEL_ID, THREAD_ID])
        await ch.set_typing(JID, False)

    run(body)


def test_chatid_slash_command_and_text() -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        assert [c["name"] for c in fake.commands] == ["chatid"]  # registered at start
        await fake.dispatch("INTERACTION_CREATE", {
            "id": "1001", "application_id": "4343", "type": 2, "token": "itoken",
            "version": 1, "channel_id": str(THREAD_ID), "guild_id": "500",
            "channel": fake._thread(THREAD_ID),  # noqa: SLF001
            "member": {"user": user(77, "alice"), "roles": [], "joined_at": None,
                       "deaf": False, "mute": False, "permissions": "0", "flags": 0},
            "data": {"id": "900", "name": "chatid", "type": 1},
            "app_permissions": "0", "locale": "en-US", "entitlements": [],
            "authorizing_integration_owners": {}, "context": 0, "attachment_size_limit": 1})
        await fake.wait(lambda: len(fake.interaction_replies) == 1)
        (reply,) = fake.interaction_replies
        assert reply["type"] == 4
        assert reply["data"]["content"] == f"This channel is `{JID}`"  # the thread's channel
        assert reply["data"]["flags"] & 64  # only the one who asked sees it
        await fake.post(CHANNEL_ID, "/chatid")
        await fake.wait(lambda: len(fake.sent) == 1)
        assert fake.sent[0]["content"] == f"This channel is `{JID}`"
        assert got == []  # the command stays out of the chat

    run(body)


def test_a_rejected_token_stops_connect_with_the_fix() -> None:
    async def main() -> None:
        fake = FakeDiscord()
        await fake.start()
        ch = DiscordChannel("wrong.token.value", api_base=fake.api)
        try:
            with pytest.raises(ChannelError) as e:
                await ch.connect()
            assert "channels.discord.token_file" in str(e.value)
            assert "wrong.token" not in str(e.value)
            assert not ch.is_connected()
        finally:
            await ch.disconnect()
            await fake.stop()

    asyncio.run(main())


# ---------------------------------------------------------------------- rate limits


def test_a_429_is_waited_out_and_the_message_delivered_once(tmp_path: Path) -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        fake.fail["create_message"] = [(429, {"message": "You are being rate limited.",
                                              "retry_after": 0.6, "global": False})]
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        await w.start()
        try:
            with db.transaction() as c:
                row = enqueue(c, chat_jid=JID, kind="text", text="once")
            w.wake()
            await wait_until_async(lambda: get_row(db, row).status == "sent")
            assert get_row(db, row).attempts == 1
        finally:
            await w.stop()
            db.close()
        posts = [t for m, k, t in fake.requests if k == "create_message"]
        assert len(posts) == 2  # the 429, then the one that went through
        assert posts[1] - posts[0] >= 0.6  # after the wait Discord asked for
        assert sent_texts(fake) == ["once"]  # delivered once

    run(body)


def test_a_long_429_goes_back_to_the_outbox_with_retry_after(tmp_path: Path) -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        fake.fail["create_message"] = [(429, {"message": "You are being rate limited.",
                                              "retry_after": 45.0, "global": False})]
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        await w.start()
        try:
            with db.transaction() as c:
                row = enqueue(c, chat_jid=JID, kind="text", text="later")
            t0 = time.time()
            w.wake()
            await wait_until_async(lambda: get_row(db, row).attempts == 1
                                   and get_row(db, row).status == "pending")
            r = get_row(db, row)
            assert "rate limited for 45.0 s" in (r.last_error or "")
            from mdclaw.schedule import from_iso
            assert from_iso(r.next_attempt_at).timestamp() >= t0 + 44  # waits it out
        finally:
            await w.stop()
            db.close()
        assert fake.sent == []  # nothing sent in the meantime

    run(body)


def test_the_global_limit_holds_every_route() -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        m = await fake.post(CHANNEL_ID, "hi")
        await wait_until_async(lambda: len(got) == 1)
        fake.fail["create_message"] = [(429, {"message": "You are being rate limited.",
                                              "retry_after": 0.8, "global": True})]
        send = asyncio.create_task(ch.send_message(JID, "first"))
        http = ch._client.http  # type: ignore[union-attr]  # noqa: SLF001
        await wait_until_async(lambda: not http._global_over.is_set(),  # noqa: SLF001
                               what="discord.py holds every route for the global limit")
        t429 = next(t for _, k, t in fake.requests if k == "create_message")
        await ch.react(JID, got[0].id, "\N{EYES}")  # another route: waits for the global
        await send
        (t_react,) = [t for _, k, t in fake.requests if k == "react"]
        assert t_react - t429 >= 0.8
        assert sent_texts(fake) == ["first"]
        assert fake.reactions == [(CHANNEL_ID, int(m["id"]), "\N{EYES}")]

    run(body)


# ---------------------------------------------------------------------- connection


def test_a_dropped_connection_is_resumed_without_loss() -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        await fake.post(CHANNEL_ID, "before")
        await wait_until_async(lambda: len(got) == 1)
        await fake.drop()
        await fake.post(CHANNEL_ID, "while away 1")
        await fake.post(THREAD_ID, "while away 2")
        await wait_until_async(lambda: len(got) == 3, what="the missed events replayed")
        assert [m.content for m in got] == ["before", "while away 1", "while away 2"]
        assert len(fake.identifies) == 1 and len(fake.resumes) == 1  # the same session
        assert fake.resumes[0]["session_id"] == "session-1"
        await wait_until_async(lambda: ch.status_info()["resumes"] == 1)
        assert ch.is_connected() and ch.status_info()["sessions"] == 1
        await fake.post(CHANNEL_ID, "after")
        await wait_until_async(lambda: len(got) == 4)
        assert len({m.id for m in got}) == 4

    run(body)


def test_an_invalidated_session_catches_up_from_the_history(tmp_path: Path) -> None:
    db = Database(tmp_path / "s.db")

    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        await fake.post(CHANNEL_ID, "one")
        await fake.post(THREAD_ID, "two")
        await wait_until_async(lambda: len(got) == 2)
        fake.invalidate_next_resume = True
        await fake.drop()
        await fake.post(CHANNEL_ID, "three", dispatch=False)  # Discord would not replay it
        await fake.post(THREAD_ID, "four", dispatch=False)
        await wait_until_async(lambda: len(fake.identifies) == 2)
        await wait_until_async(lambda: len(got) == 4, what="the history read")
        assert sorted(m.content for m in got) == ["four", "one", "three", "two"]
        assert len({m.id for m in got}) == 4  # none twice

    try:
        run(body, db=db)
    finally:
        db.close()


def test_a_restart_loses_nothing_and_doubles_nothing(tmp_path: Path) -> None:
    db = Database(tmp_path / "s.db")
    got_first: list[InboundMessage] = []

    async def main() -> None:
        fake = FakeDiscord()
        await fake.start()
        try:
            ch = DiscordChannel(TOKEN, api_base=fake.api, on_inbound=got_first.append, db=db,
                                guild_ready_timeout=0.05)
            await connected(fake, ch)
            await fake.post(CHANNEL_ID, "m1")
            await fake.post(THREAD_ID, "t1")
            await wait_until_async(lambda: len(got_first) == 2)
            await ch.disconnect()
            # while mdclaw is down
            await fake.post(CHANNEL_ID, "m2", dispatch=False)
            await fake.post(THREAD_ID, "t2", dispatch=False)
            await fake.post(CHANNEL_ID, "m3", dispatch=False)
            fake.guild_lists_threads = False  # the thread must be asked for (GET /channels)
            got: list[InboundMessage] = []
            ch2 = DiscordChannel(TOKEN, api_base=fake.api, on_inbound=got.append, db=db,
                                 guild_ready_timeout=0.05)
            try:
                await connected(fake, ch2)
                await wait_until_async(lambda: len(got) == 3)
                await fake.post(CHANNEL_ID, "m4")
                await wait_until_async(lambda: len(got) == 4)
            finally:
                await ch2.disconnect()
            assert [m.content for m in got_first] == ["m1", "t1"]
            by_channel = {m.content: m.id.split(":")[1] for m in got}
            assert sorted(by_channel) == ["m2", "m3", "m4", "t2"]
            assert [m.content for m in got if m.content.startswith("m")] == ["m2", "m3", "m4"]
            assert by_channel["t2"] == str(THREAD_ID)
            assert all(m.chat_jid == JID and m.is_group for m in got)  # the thread's channel
            assert len(fake.identifies) == 2
        finally:
            await fake.stop()

    try:
        asyncio.run(main())
    finally:
        db.close()


def test_a_message_the_host_refused_is_handed_over_again_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="mdclaw.channels.discord")
    fails = [True]

    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        def take(msg: InboundMessage) -> None:
            if fails and msg.content == "a":
                fails.pop()
                raise RuntimeError("database locked")
            got.append(msg)

        ch.on_inbound(take)
        ch.reconnect_backoff = type(ch.reconnect_backoff)(base=0.05, cap=0.05)
        await connected(fake, ch)
        await fake.post(CHANNEL_ID, "a")
        await fake.post(CHANNEL_ID, "b")
        await wait_until_async(lambda: len(got) == 2)
        assert [m.content for m in got] == ["a", "b"]

    run(body)


def test_service_reply_through_the_outbox_answers_chatid_text(tmp_path: Path) -> None:
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        ch.on_service_reply(service_replier(db, w.wake))
        await w.start()
        try:
            await connected(fake, ch)
            await fake.post(THREAD_ID, "/chatid")
            await fake.wait(lambda: len(fake.sent) == 1)
            assert fake.sent[0]["content"] == f"This channel is `{JID}`"
            assert fake.sent[0]["channel_id"] == str(THREAD_ID)  # answered where asked
            (row,) = db.query("SELECT * FROM outbox")
            assert row["chat_jid"] == JID
        finally:
            await w.stop()
            db.close()

    run(body)


def test_the_token_never_reaches_an_error() -> None:
    ch = DiscordChannel(TOKEN)
    assert ch.redact(f"x {TOKEN} y") == "x *** y"
    e = ch._error("send", OSError(f"boom {TOKEN}"))  # noqa: SLF001
    assert TOKEN not in str(e)
    assert json.dumps(ch.status_info()).find(TOKEN) < 0


# ---------------------------------------------------------------------- operator


def test_doctor_checks_the_token_and_the_message_content_intent(
        write_config: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import threading

    from test_status_doctor import _doctor

    fake = FakeDiscord()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        good, bad = tmp_path / "good", tmp_path / "bad"
        good.write_text(TOKEN + "\n")
        bad.write_text("WRONG.token.x")
        for p in (good, bad):
            p.chmod(0o600)
        text = """\
            data_dir: {data_dir}
            groups: {main: {name: A, jid: "dc:600", main: true}}
            channels: {http: {enabled: false}, discord: {token_file: TOKEN, api_base: "BASE"}}
        """.replace("BASE", fake.api)
        c = _doctor(write_config, monkeypatch, text.replace("TOKEN", str(good)))
        assert c["discord"]["level"] == "ok" and "mdclaw" in c["discord"]["detail"]
        c = _doctor(write_config, monkeypatch, text.replace("TOKEN", str(bad)))
        assert c["discord"]["level"] == "fail" and "rejected" in c["discord"]["detail"]
        assert "channels.discord.token_file" in c["discord"]["fix"]
        assert "WRONG" not in json.dumps(c)
        fake.app_flags = 0
        c = _doctor(write_config, monkeypatch, text.replace("TOKEN", str(good)))
        assert c["discord"]["level"] == "fail"
        assert "Message Content Intent" in c["discord"]["fix"]
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_without_discord_py_the_setting_is_refused_with_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from mdclaw.config import check_extras, missing_extras

    token = tmp_path / "t"
    token.write_text(TOKEN)
    token.chmod(0o600)
    cfg = load_config(tmp_path / "c.yaml", text=(
        f"data_dir: {tmp_path}\nchannels: {{discord: {{token_file: {token}}}}}\n"))
    monkeypatch.setitem(sys.modules, "discord", None)
    (m,) = missing_extras(cfg, load=True)
    assert (m.key, m.extra.name) == ("channels.discord", "discord")
    (line,) = check_extras(cfg)
    assert line.startswith("channels.discord: ") and "mdclaw[discord]" in line
    ch = DiscordChannel(TOKEN, api_base="http://127.0.0.1:9")

    async def start() -> None:
        with pytest.raises(ChannelError) as e:
            await ch.connect()
        assert "mdclaw[discord]" in str(e.value)
        assert not ch.is_connected()

    asyncio.run(start())
    disabled = load_config(tmp_path / "c.yaml", text=(
        f"data_dir: {tmp_path}\nchannels: {{discord: {{token_file: {token}, "
        "enabled: false}}\n"))
    assert missing_extras(disabled) == []


def test_discord_unreachable_at_start_then_connects_with_the_backoff() -> None:
    import socket

    from mdclaw.retry import Backoff

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        got: list[InboundMessage] = []
        ch = DiscordChannel(TOKEN, api_base=f"http://127.0.0.1:{port}/api/v10",
                            on_inbound=got.append, guild_ready_timeout=0.05)
        ch.reconnect_backoff = Backoff(base=0.05, cap=0.2, jitter=0)
        fake = FakeDiscord()
        try:
            await ch.connect()  # nobody listens: starts anyway, not connected
            assert not ch.is_connected()
            await fake.start(port)
            await wait_until_async(ch.is_connected, what="connected once Discord answers")
            await fake.post(CHANNEL_ID, "hello")
            await wait_until_async(lambda: len(got) == 1)
        finally:
            await ch.disconnect()
            await fake.stop()

    asyncio.run(main())


def test_an_empty_bucket_holds_its_route_only() -> None:
    """X-RateLimit-Remaining: 0 with Reset-After: the next request of that route (the same
    channel's messages) waits for the reset; another route does not."""

    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        m = await fake.post(CHANNEL_ID, "hi <@78>", mentions=[user(78, "bob")])
        await wait_until_async(lambda: len(got) == 1)
        assert got[0].content == "hi @bob"  # a mention reads as the name
        fake.exhaust["create_message"] = 1.5
        first = asyncio.create_task(ch.send_message(JID, "one"))  # its answer empties it
        await fake.wait(lambda: any(k == "create_message" for _, k, _ in fake.requests))
        await ch.react(JID, got[0].id, "\N{EYES}")  # another bucket: at once
        second = asyncio.create_task(ch.send_message(JID, "two"))
        await first
        await second
        posts = [t for _, k, t in fake.requests if k == "create_message"]
        (t_react,) = [t for _, k, t in fake.requests if k == "react"]
        assert posts[1] - posts[0] >= 1.4  # waited for the bucket's reset
        assert t_react - posts[0] < 1.0
        assert sent_texts(fake) == ["one", "two"]
        assert fake.reactions == [(CHANNEL_ID, int(m["id"]), "\N{EYES}")]

    run(body)


def test_the_registry_builds_the_channel_from_config(tmp_path: Path, write_config: Any
                                                     ) -> None:
    from mdclaw.channels.registry import apply_config, build_channels

    token = tmp_path / "dc-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    cfg = load_config(write_config(CONFIG.replace(
        "media:", "channels: {http: {enabled: false}, discord: {token_file: " + str(token)
        + ", api_base: 'http://127.0.0.1:9/api/v10'}}\nmedia:")))
    db = Database(tmp_path / "s.db")
    try:
        (ch,) = build_channels(cfg, db)
        assert isinstance(ch, DiscordChannel)
        assert ch.api_base == "http://127.0.0.1:9/api/v10" and ch.trigger == "@Andy"
        assert ch.owns_jid("dc:600") and not ch.owns_jid("tg:600")
        assert ch.redact(TOKEN) == "***"  # the file's newline is not part of the token
        apply_config([ch], cfg.model_copy(update={
            "assistant": cfg.assistant.model_copy(update={"name": "Bo"})}))
        assert ch.trigger == "@Bo"
    finally:
        db.close()


def test_the_message_content_intent_refused_stops_the_channel_and_status_says_the_fix(
        tmp_path: Path, write_config: Any, cli: Any) -> None:
    import os

    from mdclaw.daemon.core import channel_details
    from mdclaw.ops.status import status_path
    from mdclaw.schedule import to_iso, utc_now

    refused: list[DiscordChannel] = []

    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        refused.append(ch)
        fake.app_flags = 0  # the Developer Portal's switch is off: Discord closes with 4014
        await ch.connect()
        await wait_until_async(lambda: "fix" in ch.status_info())
        info = ch.status_info()
        assert "Message Content Intent" in info["detail"]
        assert "turn on Message Content Intent" in info["fix"]
        assert not ch.is_connected()
        runner = ch._runner  # noqa: SLF001
        await wait_until_async(lambda: runner is not None and runner.done(),
                               what="no reconnect loop against a refusal")
        assert len(fake.identifies) == 1

    run(body)
    (ch_refused,) = refused
    # what `mdclaw status` prints from the daemon's published status
    cfg_path = write_config(CONFIG)
    cfg = load_config(cfg_path)
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    status_path(cfg).write_text(json.dumps({
        "pid": os.getpid(), "started_at": to_iso(utc_now()), "updated_at": to_iso(utc_now()),
        "engine": "ok", "containers": [], "queue": {}, "channels": {"discord": False},
        "channel_details": channel_details([ch_refused])}))
    out = cli("status", "--config", str(cfg_path)).stdout
    assert "channels: discord DOWN" in out
    assert ("  discord: Discord refused the Message Content Intent (close code 4014): the "
            "bot cannot read messages — fix: Developer Portal → your application → Bot → "
            "Privileged Gateway Intents: turn on Message Content Intent") in out


def test_allow_senders_of_a_discord_group_are_user_ids(tmp_path: Path) -> None:
    from mdclaw.config import ConfigError

    base = (f"data_dir: {tmp_path}\ngroups:\n  main: {{name: A, jid: 'dc:600', main: true, "
            "allow_senders: {ids: [IDS]}}\n")
    cfg = load_config(tmp_path / "c.yaml", text=base.replace("IDS", "'123456789012345678'"))
    assert cfg.groups["main"].allow_senders is not None
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "c.yaml", text=base.replace("IDS", "'alice'"))
    assert "'alice' is not a Discord user id" in str(e.value)


WHOLE_PATH_CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy, timezone: UTC}
groups:
  main: {name: Admin, jid: "dc:600", main: true}
media: {max_bytes: 1k}
limits: {run_attempts: 1, idle_timeout: 10m}
"""


def test_the_whole_path_from_a_thread_to_the_answer_in_it(write_config: Any) -> None:
    """A question asked in a thread of the group's channel, with a file, goes through the
    orchestrator (the file saved in the group's inbox by the intake) and the real container
    runner (a fake engine whose agent answers like the agent runner) and comes back through
    the outbox into the same thread, formatted."""
    import re

    from fake_engine import FakeEngine, chat_agent
    from mdclaw.orchestrator import Orchestrator
    from mdclaw.reconcile import reconcile
    from mdclaw.runner import ContainerRunner

    cfg = load_config(write_config(WHOLE_PATH_CONFIG))
    db = Database(cfg.db_path)
    reconcile(cfg, db)
    heard: list[str] = []
    engine = FakeEngine(default=chat_agent(
        lambda text: "**answer** to " + " ".join(re.findall(r"tok\d+", text)), heard=heard))

    async def main() -> None:
        fake = FakeDiscord()
        await fake.start()
        runner = ContainerRunner(cfg, engine)
        worker = OutboxWorker(db, policy=RetryPolicy(base_delay=0.05, jitter=0))
        orch = Orchestrator(cfg, db, runner=runner, wake_outbox=worker.wake)
        orch.engine_ready.set()
        ch = DiscordChannel(TOKEN, api_base=fake.api, on_inbound=orch.on_inbound, db=db,
                            trigger="@Andy", guild_ready_timeout=0.05)
        orch.channels = [ch]
        worker.set_channels([ch])
        try:
            await connected(fake, ch)
            await worker.start()
            notes = fake.add_attachment("notes.txt", b"the shopping list", "text/plain")
            q = await fake.post(THREAD_ID, "tok1 what is in the file?", attachments=[notes])
            await fake.wait(lambda: len(fake.sent) == 1, timeout=30)
            (out,) = fake.sent
            assert out["content"] == "**answer** to tok1"
            assert out["channel_id"] == str(THREAD_ID)  # back into the thread
            assert q["channel_id"] == str(THREAD_ID)
            (saved,) = (cfg.data_dir / "groups" / "main" / "inbox").rglob("notes.txt")
            assert saved.read_bytes() == b"the shopping list"
            assert any("inbox" in h and "notes.txt" in h for h in heard)  # the agent is told
        finally:
            orch.accepting = False
            orch.close_conversations()
            await orch.queue.shutdown(grace=5)
            await runner.aclose()
            await worker.stop()
            await ch.disconnect()
            await fake.stop()

    try:
        asyncio.run(main())
    finally:
        db.close()


def test_an_answer_without_reply_to_goes_where_the_chat_last_spoke_even_after_a_restart(
        tmp_path: Path) -> None:
    db = Database(tmp_path / "s.db")

    async def main() -> None:
        fake = FakeDiscord()
        await fake.start()
        try:
            got: list[InboundMessage] = []
            ch = DiscordChannel(TOKEN, api_base=fake.api, on_inbound=got.append, db=db,
                                guild_ready_timeout=0.05)
            await connected(fake, ch)
            await fake.post(CHANNEL_ID, "in the channel")
            await fake.post(THREAD_ID, "then in the thread")
            await wait_until_async(lambda: len(got) == 2)
            await ch.send_message(JID, "into the thread")
            await ch.disconnect()
            ch2 = DiscordChannel(TOKEN, api_base=fake.api, on_inbound=got.append, db=db,
                                 guild_ready_timeout=0.05)
            try:
                await connected(fake, ch2)
                await ch2.send_message(JID, "still the thread")
                await fake.post(CHANNEL_ID, "back in the channel")
                await wait_until_async(lambda: len(got) == 3)
                await ch2.send_message(JID, "the channel")
            finally:
                await ch2.disconnect()
            assert [(m["content"], m["channel_id"]) for m in fake.sent] == [
                ("into the thread", str(THREAD_ID)), ("still the thread", str(THREAD_ID)),
                ("the channel", str(CHANNEL_ID))]
        finally:
            await fake.stop()

    try:
        asyncio.run(main())
    finally:
        db.close()


def test_a_retry_after_a_lost_answer_posts_once(tmp_path: Path) -> None:
    """Discord created the message but its answer was lost: the outbox tries the row again,
    with the same nonce (enforce_nonce), and Discord hands back the first message instead of
    posting a second. Each part of a long answer has its own nonce, and the same words in a
    new row are a new message."""
    async def body(fake: FakeDiscord, ch: DiscordChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.1))
        await w.start()
        try:
            fake.lose_answers = 1
            with db.transaction() as c:
                row = enqueue(c, chat_jid=JID, kind="text", text="once")
            w.wake()
            await wait_until_async(lambda: get_row(db, row).status == "sent")
            assert get_row(db, row).attempts == 2  # the lost answer was a failed try
            assert sent_texts(fake) == ["once"] and fake.nonce_repeats == 1
            first_nonce = fake.sent[0]["nonce"]
            assert 0 < len(first_nonce) <= 25

            # two parts, the first one's answer lost: each part is posted once, in order
            long = "a" * 1500 + "\n\n" + "b" * 1500
            fake.lose_answers = 1
            with db.transaction() as c:
                row2 = enqueue(c, chat_jid=JID, kind="text", text=long)
            w.wake()
            await wait_until_async(lambda: get_row(db, row2).status == "sent")
            assert sent_texts(fake) == ["once", "a" * 1500, "b" * 1500]
            assert fake.nonce_repeats == 2

            # the same words again, in a new row: a new message
            with db.transaction() as c:
                row3 = enqueue(c, chat_jid=JID, kind="text", text="once")
            w.wake()
            await wait_until_async(lambda: get_row(db, row3).status == "sent")
            assert sent_texts(fake) == ["once", "a" * 1500, "b" * 1500, "once"]
            assert fake.sent[-1]["nonce"] != first_nonce
            nonces = [m["nonce"] for m in fake.sent]
            assert len(set(nonces)) == len(nonces)
            # the gateway session stayed up all along: sends went on without a new one
            assert (ch.status_info()["sessions"], ch.status_info()["resumes"]) == (1, 0)
        finally:
            await w.stop()
            db.close()

    run(body)
