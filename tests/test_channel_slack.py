"""The Slack channel: the real slack-bolt and slack-sdk against a fake Slack on loopback
(tests/slack_fake.py: the Web API and Socket Mode, from Slack's API documentation); only the
Web API base URL is pointed at the fake (Socket Mode's websocket address comes from it)."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

try:
    import slack_bolt  # noqa: F401
except ImportError:  # pragma: no cover - depends on the machine
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI=true but slack-bolt is not installed (make installs '.[slack]')",
                    pytrace=False)
    pytest.skip("slack-bolt is not installed (pip install -e '.[slack]')",
                allow_module_level=True)

from mdclaw.channels.base import ChannelError, InboundMessage  # noqa: E402
from mdclaw.channels.registry import (  # noqa: E402
    apply_config,
    build_channels,
    connect_all,
    disconnect_all,
)
from mdclaw.channels.slack import SlackChannel, split_id  # noqa: E402
from mdclaw.config import load_config  # noqa: E402
from mdclaw.outbox import OutboxWorker, RetryPolicy, get_row  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw.state.conversations import StoredMessage, store_message  # noqa: E402
from mdclaw.state.outbox import enqueue  # noqa: E402
from slack_fake import APP_TOKEN, BOT_ID, BOT_TOKEN, BOT_USER, FakeSlack  # noqa: E402
from waiting import wait_until_async  # noqa: E402

Body = Callable[[FakeSlack, SlackChannel, list[InboundMessage]], Awaitable[None]]


def make_channel(fake: FakeSlack, got: list[InboundMessage], *, db: Database | None = None,
                 on_inbound: Any = None) -> SlackChannel:
    ch = SlackChannel(BOT_TOKEN, APP_TOKEN, api_base=fake.api_base, trigger="@Andy", db=db,
                      on_inbound=on_inbound or got.append, ping_interval=0.5)
    # Tests wait for events; the backoff between reconnects stays short.
    ch.reconnect_backoff = type(ch.reconnect_backoff)(base=0.05, factor=2.0, cap=0.2)
    return ch


def run(body: Body, *, db_path: Path | None = None) -> None:
    async def main() -> None:
        fake = FakeSlack()
        await fake.start()
        got: list[InboundMessage] = []
        db = Database(db_path) if db_path is not None else None
        ch = make_channel(fake, got, db=db)
        try:
            await body(fake, ch, got)
        finally:
            await ch.disconnect()
            await fake.stop()
            if db is not None:
                db.close()

    asyncio.run(main())


async def connected(fake: FakeSlack, ch: SlackChannel) -> None:
    await ch.connect()
    await wait_until_async(ch.is_connected, timeout=15)
    await asyncio.wait_for(fake.connected.wait(), 15)


async def acked(fake: FakeSlack, eid: str) -> dict[str, Any]:
    await wait_until_async(lambda: eid in fake.acks, timeout=15)
    return fake.acks[eid]


# ---------------------------------------------------------------------- in and out


def test_message_in_formatted_answer_out() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        assert fake.of("auth.test") and ch.status_info() == {
            "connected": True, "team": "Fake Team", "account": "@andy"}
        ev = fake.message(f"<@{BOT_USER}> what is 1 &lt; 2 &amp;&amp; <https://x.org|this>? "
                          "ask <@U2>")
        eid = await fake.push_event(ev)
        await acked(fake, eid)
        (msg,) = got
        assert msg.id == f"slack:C1:{ev['ts']}" and msg.chat_jid == "slack:C1"
        assert msg.sender == "U1" and msg.sender_name == "Ann" and msg.channel == "slack"
        assert msg.content == "@Andy what is 1 < 2 && this (https://x.org)? ask @Bob"
        assert msg.addressed and msg.is_group and msg.chat_name == "#general"
        assert msg.reply_to is None

        mid = await ch.send_message("slack:C1", "**Yes** & `a<b` — see [docs](https://d.io)")
        (post,) = fake.posted
        assert post["channel"] == "C1" and "thread_ts" not in post
        assert post["text"] == "*Yes* &amp; `a&lt;b` — see <https://d.io|docs>"
        assert mid == f"slack:C1:{post['ts']}"
        # the bot's own message (Slack echoes it) is no message for the host
        eid = await fake.push_event(fake.message("echo", user=BOT_USER, bot_id="BBOT"))
        await acked(fake, eid)
        assert len(got) == 1

    run(body)


def test_mentions_dms_and_plain_chatter() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        plain = fake.message("just chatting")
        await acked(fake, await fake.push_event(plain))
        dm = fake.message("hello there", channel="D9", channel_type="im")
        await acked(fake, await fake.push_event(dm))
        # a mention comes twice (message and app_mention): handed over once
        men = fake.message(f"hey <@{BOT_USER}>")
        e1 = await fake.push_event(men)
        e2 = await fake.push_event({**men, "type": "app_mention"})
        await acked(fake, e1)
        await acked(fake, e2)
        # edits and joins are no new messages
        await acked(fake, await fake.push_event(
            {**fake.message("x"), "subtype": "channel_join"}))
        assert [(m.content, m.addressed, m.is_group) for m in got] == [
            ("just chatting", False, True), ("@Andy hello there", True, False),
            ("hey @Andy", True, True)]
        assert got[1].chat_jid == "slack:D9" and got[1].chat_name == "Ann"

    run(body)


def test_chatid_slash_command_answers_in_its_response() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        ack = await acked(fake, await fake.push_command("/chatid", "C2"))
        assert ack["payload"] == {"text": "This chat is `slack:C2`"}
        assert got == [] and fake.posted == []

    run(body)


# ---------------------------------------------------------------------- split, threads


def test_a_long_answer_is_split_at_slacks_limit_without_cutting_a_code_block() -> None:
    code = "\n".join(f"line {i} <&>" for i in range(700))
    text = "Intro **bold**\n\n```python\n" + code + "\n```\n\n" + "word " * 900

    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        parts = ch.message_parts(text)
        assert len(parts) >= 3
        for p in parts:
            assert len(p) <= 4000
            assert p.count("```") % 2 == 0  # every piece's blocks are closed
        await ch.send_message("slack:C1", text)
        texts = [p["text"] for p in fake.posted]
        assert texts == parts
        joined = "\n".join(texts)
        assert all(f"line {i} &lt;&amp;&gt;" in joined for i in range(700))
        assert texts[0].startswith("Intro *bold*")

    run(body)


def test_an_answer_goes_to_the_thread_it_was_asked_in() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        root = fake.message(f"<@{BOT_USER}> start")
        await acked(fake, await fake.push_event(root))
        await ch.send_message("slack:C1", "first answer")
        assert "thread_ts" not in fake.posted[-1]
        # a reply in a thread under a person's message, to the bot's answer there
        reply = fake.message("and then?", thread_ts=root["ts"], parent_user_id="U1")
        await ch.send_message("slack:C1", "in thread", reply_to=f"slack:C1:{root['ts']}")
        assert fake.posted[-1]["thread_ts"] == root["ts"]
        await acked(fake, await fake.push_event(reply))
        msg = got[-1]
        assert msg.id == f"slack:C1:{root['ts']}/{reply['ts']}"
        assert msg.reply_to == f"slack:C1:{root['ts']}"
        assert msg.addressed  # the bot wrote in that thread
        assert split_id(msg.id) == ("C1", root["ts"], reply["ts"])
        # chatter at the top meanwhile does not move the pending answer
        await acked(fake, await fake.push_event(fake.message("unrelated")))
        mid = await ch.send_message("slack:C1", "threaded answer")
        assert fake.posted[-1]["thread_ts"] == root["ts"]
        assert mid == f"slack:C1:{root['ts']}/{fake.posted[-1]['ts']}"
        # a reply in a thread of the bot's own message is addressed to it
        bot_root = fake.posted[0]["ts"]
        await acked(fake, await fake.push_event(
            fake.message("thanks", user="U2", thread_ts=bot_root, parent_user_id=BOT_USER)))
        assert got[-1].addressed and got[-1].content == "@Andy thanks"

    run(body)


# ---------------------------------------------------------------------- files, reactions


def test_files_both_ways(tmp_path: Path, write_config) -> None:
    from mdclaw.media import save_all

    cfg = load_config(write_config())
    (cfg.data_dir / "groups" / "main").mkdir(parents=True)
    report = os.urandom(30_000)

    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        fake.files["F1"] = report
        fake.files["F2"] = b"x" * 5000
        ev = fake.message("", subtype="file_share", files=[
            {"id": "F1", "name": "../report.pdf", "mimetype": "application/pdf",
             "size": 30_000, "url_private_download": f"{fake.base}/files/F1"},
            {"id": "F2", "name": "big.bin", "mimetype": "application/octet-stream",
             "size": 10, "file_access": "check_file_info"}])  # says 10 bytes, has 5000
        await acked(fake, await fake.push_event(ev))
        (msg,) = got
        assert [(a.kind, a.name, a.size) for a in msg.attachments] == [
            ("document", "../report.pdf", 30_000), ("document", "big.bin", 10)]
        saved = await save_all(cfg.model_copy(update={"media": cfg.media.model_copy(
            update={"max_bytes": "4k"})}), "main", msg.attachments[1:])
        # over the cap (announced as 10 bytes, 5000 came): not kept, and said why
        assert saved[0].container_path is None and "4096 bytes" in (saved[0].error or "")
        saved = await save_all(cfg, "main", msg.attachments[:1])
        assert fake.downloads[-1] == ("F1", f"Bearer {BOT_TOKEN}")
        assert fake.of("files.info") == [{"file": "F2"}]
        inbox = cfg.data_dir / "groups" / "main" / "inbox"
        (day,) = [p.name for p in inbox.iterdir()]
        assert (inbox / day / "report.pdf").read_bytes() == report
        with pytest.raises(ChannelError, match="larger than the 100 bytes"):
            await msg.attachments[1].fetch(100)

        # out: upload v2 into the answer thread, the caption as mrkdwn
        out = tmp_path / "chart.png"
        out.write_bytes(b"\x89PNG" + os.urandom(2000))
        await acked(fake, await fake.push_event(
            fake.message(f"<@{BOT_USER}> chart?", thread_ts="1767225000.000100")))
        assert await ch.send_file("slack:C1", out, caption="the **chart**") is None
        (up,) = fake.of("files.getUploadURLExternal")
        assert up["filename"] == "chart.png" and int(up["length"]) == out.stat().st_size
        (fid,) = fake.uploads
        assert fake.uploads[fid]["data"] == out.read_bytes()
        (share,) = fake.shared
        assert share["channel_id"] == "C1" and share["thread_ts"] == "1767225000.000100"
        assert share["initial_comment"] == "the *chart*"
        assert share["files"][0]["id"] == fid
        with pytest.raises(ChannelError, match="does not exist") as e:
            await ch.send_file("slack:C1", tmp_path / "gone.txt")
        assert e.value.permanent

    run(body)


def test_a_token_is_sent_only_to_slack() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        with pytest.raises(ChannelError, match="no download address on Slack"):
            await ch.download({"id": "F9", "url_private_download":
                               "https://evil.example/steal"}, 1000)
        assert fake.downloads == []

    run(body)


def test_reactions() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        await ch.react("slack:C1", "slack:C1:1767225000.000100/1767225001.000200", "👍")
        await ch.react("slack:C1", "slack:C1:1767225001.000200", ":eyes:")
        await ch.react("slack:C1", "slack:C1:1767225001.000200", ":eyes:")  # already there
        assert fake.reactions == [
            {"channel": "C1", "timestamp": "1767225001.000200", "name": "+1"},
            {"channel": "C1", "timestamp": "1767225001.000200", "name": "eyes"}]
        with pytest.raises(ChannelError) as e:
            await ch.react("slack:C1", "slack:C2:1767225001.000200", "👍")
        assert e.value.permanent
        fake.fail["reactions.add"] = [(200, {"ok": False, "error": "message_not_found"}, {})]
        with pytest.raises(ChannelError, match="message_not_found") as e:
            await ch.react("slack:C1", "slack:C1:1767225009.000200", "🎉")
        assert e.value.permanent

    run(body)


# ---------------------------------------------------------------------- rate limits


def test_a_429_is_delivered_once_after_retry_after(tmp_path: Path) -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        db = Database(tmp_path / "s.db")
        w = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=3, base_delay=0.05))
        fake.fail["chat.postMessage"] = [
            (429, {"ok": False, "error": "ratelimited"}, {"Retry-After": "1"})]
        await connected(fake, ch)
        await w.start()
        try:
            with db.transaction() as c:
                rid = enqueue(c, chat_jid="slack:C1", kind="text", text="hello **there**")
            w.wake()
            await wait_until_async(lambda: get_row(db, rid).status == "sent", timeout=15)
            first, second = fake.times("chat.postMessage")  # the SDK did not retry itself
            assert second - first >= 0.95
            assert [p["text"] for p in fake.posted] == ["hello *there*"]
            assert get_row(db, rid).attempts == 2
        finally:
            await w.stop()
            db.close()

    run(body)


def test_errors_are_permanent_or_retried_and_hide_the_tokens() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        with pytest.raises(ChannelError, match="channel_not_found") as e:
            await ch.send_message("slack:C404", "hi")
        assert e.value.permanent
        fake.fail["chat.postMessage"] = [(200, {"ok": False, "error": "invalid_auth"}, {})]
        with pytest.raises(ChannelError) as e:
            await ch.send_message("slack:C1", "hi")
        assert not e.value.permanent and e.value.retry_after is None
        with pytest.raises(ChannelError) as e:
            await ch.send_message("tg:1", "hi")
        assert e.value.permanent
        # an upload whose completion is rate limited: shared once, on the retry
        fake.fail["files.completeUploadExternal"] = [
            (429, {"ok": False, "error": "ratelimited"}, {"retry-after": "7"})]
        with pytest.raises(ChannelError) as e:
            await ch.send_file("slack:C1", Path(__file__))
        assert e.value.retry_after == 7 and not e.value.permanent
        assert fake.shared == []
        await ch.send_file("slack:C1", Path(__file__))
        assert len(fake.shared) == 1
        text = ch.redact(f"{BOT_TOKEN} {APP_TOKEN}")
        assert BOT_TOKEN not in text and APP_TOKEN not in text

    run(body)


def test_a_rejected_bot_token_stops_the_channel_with_the_fix() -> None:
    async def main() -> None:
        fake = FakeSlack()
        await fake.start()
        ch = SlackChannel("xoxb-wrong", APP_TOKEN, api_base=fake.api_base)
        try:
            with pytest.raises(ChannelError, match="bot_token_file"):
                await ch.connect()
            assert not ch.is_connected()
        finally:
            await ch.disconnect()
            await fake.stop()

    asyncio.run(main())
    with pytest.raises(ChannelError, match="malformed"):
        SlackChannel(APP_TOKEN, BOT_TOKEN)


# ---------------------------------------------------------------------- acks, reconnects


def test_an_envelope_is_acked_only_after_the_host_took_it() -> None:
    release = asyncio.Event()
    entered: list[str] = []
    fail_once = [True]

    async def host(msg: InboundMessage) -> None:
        entered.append(msg.content)
        if msg.content == "fails" and fail_once:
            fail_once.clear()
            raise RuntimeError("database is locked")
        if msg.content == "slow":
            await release.wait()

    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        ch.on_inbound(host)
        await connected(fake, ch)
        eid = await fake.push_event(fake.message("slow"))
        await wait_until_async(lambda: entered == ["slow"])
        assert eid not in fake.acks
        release.set()
        await acked(fake, eid)
        bad = await fake.push_event(fake.message("fails"))
        await wait_until_async(lambda: entered == ["slow", "fails"])
        assert bad not in fake.acks  # not taken: not acked, Slack sends it again
        await fake.redeliver()
        await acked(fake, bad)
        assert entered == ["slow", "fails", "fails"]

    run(body)


def test_a_dropped_connection_resumes_without_loss_or_doubles() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        await connected(fake, ch)
        e1 = await fake.push_event(fake.message("one"))
        await acked(fake, e1)
        # the connection dies right after an envelope went out, before any ack
        e2 = await fake.push_event(fake.message("two"))
        await fake.drop()
        # what Slack has meanwhile waits for the next connection
        e3 = await fake.push_event(fake.message("three"))
        await wait_until_async(lambda: fake.connections >= 2, timeout=15)
        for e in (e2, e3):
            await acked(fake, e)
        await wait_until_async(ch.is_connected)
        assert [m.content for m in got] == ["one", "two", "three"]
        # Slack's disconnect message (refresh) opens a new connection; a copy of an acked
        # envelope that comes again on it is acked and dropped
        await fake.send_disconnect()
        await wait_until_async(lambda: fake.connections >= 3, timeout=15)
        del fake.acks[e1]
        await fake.redeliver()
        await acked(fake, e1)
        assert [m.content for m in got] == ["one", "two", "three"]
        assert len(fake.of("apps.connections.open")) == fake.connections

    run(body)


def test_a_restart_loses_nothing_and_doubles_nothing(tmp_path: Path) -> None:
    db_path = tmp_path / "state.db"

    async def main() -> None:
        fake = FakeSlack()
        await fake.start()
        db = Database(db_path)
        crashed = [True]

        async def store(msg: InboundMessage) -> None:
            if msg.content.endswith("crash") and crashed:
                raise RuntimeError("the host went down before storing it")
            await asyncio.to_thread(store_message, db, StoredMessage(
                msg.id, msg.chat_jid, msg.sender, msg.sender_name, msg.content,
                msg.timestamp, False, False), channel=msg.channel, is_group=msg.is_group)

        got: list[InboundMessage] = []
        first = make_channel(fake, got, db=db, on_inbound=store)
        try:
            await connected(fake, first)
            q = fake.message(f"<@{BOT_USER}> question", thread_ts="1767225000.000100")
            e1 = await fake.push_event(q)
            await acked(fake, e1)
            e2 = await fake.push_event(fake.message("then crash"))
            await wait_until_async(lambda: fake.sent_to.get(e2) == 1)
            await first.disconnect()  # the daemon stops; e2 was never acked
            crashed.clear()
            assert e2 not in fake.acks
            # written while it was down for longer than Slack tries to deliver an event:
            # only in the channel's history (and a reply in the thread, and an edit)
            for text in ("while away", "and more"):
                fake.record(fake.message(text))
            fake.record({**fake.message("edited"), "subtype": "message_changed"})
            second = make_channel(fake, got, db=db, on_inbound=store)
            try:
                await connected(fake, second)
                await acked(fake, e2)
                # the answer still goes to the thread the question was asked in (the chat
                # after it does not move it)
                await second.send_message("slack:C1", "the answer")
                assert fake.posted[-1]["thread_ts"] == "1767225000.000100"
                # Slack sends an acked one again too (a retry it started): no double
                del fake.acks[e1]
                await fake.redeliver()
                await acked(fake, e1)
                rows = db.query("SELECT id, content FROM messages ORDER BY seq")
                assert sorted(r["content"] for r in rows) == [
                    "@Andy question", "and more", "then crash", "while away"]
                ids = [r["id"] for r in rows]
                assert len(ids) == len(set(ids))
                # what was fetched is in the order it was written
                away = [r["content"] for r in rows if r["content"] in ("while away",
                                                                       "and more")]
                assert away == ["while away", "and more"]
                # a later start finds nothing new
                assert await second.catch_up() == 0
            finally:
                await second.disconnect()
        finally:
            await first.disconnect()
            await fake.stop()
            db.close()

    asyncio.run(main())


def test_thread_replies_written_while_down_are_caught_up_once(tmp_path: Path) -> None:
    """Replies in threads are not in conversations.history: after a restart the channel reads
    conversations.replies of the threads it was active in (a reply handed over, the bot's
    answer there) and of threads started while it was down (the parent's reply_count and
    latest_reply in the history), each message once, in the order written."""
    db_path = tmp_path / "state.db"

    async def main() -> None:
        fake = FakeSlack()
        await fake.start()
        db = Database(db_path)
        got: list[InboundMessage] = []

        async def store(msg: InboundMessage) -> None:
            got.append(msg)
            await asyncio.to_thread(store_message, db, StoredMessage(
                msg.id, msg.chat_jid, msg.sender, msg.sender_name, msg.content,
                msg.timestamp, False, False), channel=msg.channel, is_group=msg.is_group)

        first = make_channel(fake, got, db=db, on_inbound=store)
        second = make_channel(fake, got, db=db, on_inbound=store)
        try:
            await connected(fake, first)
            # a thread the bot answered in, and one it only heard a reply from
            asked = fake.message(f"<@{BOT_USER}> plan?")
            await acked(fake, await fake.push_event(asked))
            await acked(fake, await fake.push_event(
                fake.message("details please", thread_ts=asked["ts"], parent_user_id="U1")))
            await first.send_message("slack:C1", "here is the plan",
                                     reply_to=f"slack:C1:{asked['ts']}")
            assert fake.posted[-1]["thread_ts"] == asked["ts"]
            fake.record({**fake.message("here is the plan", user=BOT_USER, bot_id=BOT_ID),
                         "thread_ts": asked["ts"]})
            chatter = fake.message("lunch?", user="U2")
            await acked(fake, await fake.push_event(chatter))
            await acked(fake, await fake.push_event(
                fake.message("noon", thread_ts=chatter["ts"], parent_user_id="U2")))
            # a quiet thread from before: nothing new there, never read again needlessly
            old = fake.message("old topic")
            await acked(fake, await fake.push_event(old))
            await first.disconnect()

            # while it is down: replies in both threads, a new thread with two replies, a
            # reply also sent to the channel, and top-level chatter
            written = []
            for m in (fake.message(f"<@{BOT_USER}> and the budget?", thread_ts=asked["ts"],
                                   parent_user_id="U1"),
                      fake.message("1pm better", user="U1", thread_ts=chatter["ts"],
                                   parent_user_id="U2"),
                      new_top := fake.message("new topic"),
                      fake.message("first reply", user="U2", thread_ts=new_top["ts"],
                                   parent_user_id="U1"),
                      fake.message("broadcast reply", thread_ts=new_top["ts"],
                                   parent_user_id="U1", subtype="thread_broadcast"),
                      fake.message("last word")):
                fake.record(m)
                written.append(m)
            fake.record({**fake.message("edited"), "subtype": "message_changed"})
            # Slack's rate limit on conversations.replies, once: waited out
            fake.fail["conversations.replies"] = [
                (429, {"ok": False, "error": "ratelimited"}, {"Retry-After": "1"})]

            await connected(fake, second)
            contents = ["@Andy and the budget?", "1pm better", "new topic",
                        "first reply", "broadcast reply", "last word"]
            await wait_until_async(lambda: len(db.query("SELECT id FROM messages")) == 11)
            rows = db.query("SELECT id, content FROM messages ORDER BY seq")
            ids = [r["id"] for r in rows]
            assert len(ids) == len(set(ids))  # nothing doubled
            assert [r["content"] for r in rows][-6:] == contents  # in the order written
            assert f"slack:C1:{asked['ts']}/{written[0]['ts']}" in ids
            assert f"slack:C1:{new_top['ts']}/{written[3]['ts']}" in ids
            # the reply in the bot's thread is addressed to it
            assert [m.addressed for m in got if m.content.endswith("budget?")] == [True]
            threads = {p["ts"] for p in fake.of("conversations.replies")}
            assert {asked["ts"], chatter["ts"], new_top["ts"]} <= threads
            assert old["ts"] not in threads  # no thread there: bounded
            assert not fake.fail["conversations.replies"]  # the 429 was met and waited out
            # a later catch-up finds nothing new
            assert await second.catch_up() == 0
            assert len(db.query("SELECT id FROM messages")) == 11
        finally:
            await second.disconnect()
            await first.disconnect()
            await fake.stop()
            db.close()

    asyncio.run(main())


def test_socket_mode_reconnects_with_backoff_when_the_app_token_is_refused() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        fake.fail["apps.connections.open"] = [
            (200, {"ok": False, "error": "invalid_auth"}, {}),
            (200, {"ok": False, "error": "invalid_auth"}, {})]
        await ch.connect()
        assert not ch.is_connected() and "app_token_file" in ch.status_info()["fix"]
        await wait_until_async(ch.is_connected, timeout=15)
        t = fake.times("apps.connections.open")
        assert len(t) == 3 and t[2] - t[1] >= t[1] - t[0] - 0.05  # the waits grow

    run(body)


def test_message_parts_are_stable_and_escape_everything() -> None:
    ch = SlackChannel(BOT_TOKEN, APP_TOKEN)
    text = "a <b> & c " * 1000
    assert ch.message_parts(text) == ch.message_parts(text)
    assert all("<" not in p and ">" not in p for p in ch.message_parts(text))
    assert re.fullmatch(r"(a &lt;b&gt; &amp; c ?)+", " ".join(ch.message_parts(text)))


def test_slack_unreachable_at_the_start_is_no_reason_to_stop() -> None:
    async def body(fake: FakeSlack, ch: SlackChannel, got: list[InboundMessage]) -> None:
        fake.fail["auth.test"] = [(503, {"ok": False, "error": "service_unavailable"}, {})]
        await connected(fake, ch)  # starts; learns who it is once Slack answers
        assert ch.bot_user_id == BOT_USER
        await acked(fake, await fake.push_event(fake.message(f"<@{BOT_USER}> there?")))
        assert got[0].addressed and got[0].content == "@Andy there?"

    run(body)


def test_the_config_section_builds_the_channel(tmp_path: Path) -> None:
    bot, app = tmp_path / "bot", tmp_path / "app"
    bot.write_text(BOT_TOKEN + "\n")
    app.write_text(APP_TOKEN + "\n")

    async def main() -> None:
        fake = FakeSlack()
        await fake.start()
        text = (f"data_dir: {tmp_path / 'data'}\nassistant: {{name: Bea}}\n"
                "groups: {main: {name: Main, jid: 'slack:C1', main: true}}\n"
                f"channels: {{http: {{enabled: false}}, slack: {{bot_token_file: {bot}, "
                f"app_token_file: {app}, api_base: '{fake.api_base}'}}}}\n")
        cfg = load_config(tmp_path / "config.yaml", text=text)
        db = Database(tmp_path / "s.db")
        got: list[InboundMessage] = []
        (ch,) = build_channels(cfg, db, None, on_inbound=got.append)
        try:
            assert isinstance(ch, SlackChannel) and ch.owns_jid("slack:C1")
            assert not ch.owns_jid("tg:1") and ch.trigger == "@Bea"
            assert await connect_all([ch]) == {}
            await wait_until_async(ch.is_connected, timeout=15)
            apply_config([ch], cfg.model_copy(update={"assistant": cfg.assistant.model_copy(
                update={"name": "Cy"})}))
            assert ch.trigger == "@Cy"
            await acked(fake, await fake.push_event(fake.message(f"<@{BOT_USER}> hi")))
            assert got[0].content == "@Cy hi"
        finally:
            await disconnect_all([ch])
            await fake.stop()
            db.close()

    asyncio.run(main())
    missing = tmp_path / "missing"
    cfg_text = (f"data_dir: {tmp_path / 'data'}\n"
                f"channels: {{slack: {{bot_token_file: {missing}, app_token_file: {app}}}}}\n")
    with Database(tmp_path / "t.db") as db, pytest.raises(
            ChannelError, match="channels.slack.bot_token_file"):
        build_channels(load_config(tmp_path / "c.yaml", text=cfg_text), db)
