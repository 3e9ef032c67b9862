"""The WhatsApp channel against neonize's own protobuf messages and events.

Only the network end is fake: `FakeClient` stands where neonize's NewAClient stands (connect,
send_message, upload, download_any, send_chat_presence, get_me, get_joined_groups, PairPhone)
and records what the channel asks of it; events are neonize's real protobuf types handed to
the handlers the channel registered, as neonize's dispatcher does. The database is real
SQLite, and the session file checks use a session file whatsmeow itself created.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

try:
    import neonize  # noqa: F401
except ImportError:  # pragma: no cover - depends on the machine
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail("CI=true but neonize is not installed (make installs "
                    "'.[test,whatsapp]')", pytrace=False)
    pytest.skip("neonize is not installed (pip install -e '.[whatsapp]')",
                allow_module_level=True)

from neonize.proto import Neonize_pb2 as T  # noqa: E402
from neonize.proto.waE2E import WAWebProtobufsE2E_pb2 as E  # noqa: E402
from neonize.utils.enum import ChatPresence, MediaType  # noqa: E402

from mdclaw.channels.base import ChannelError  # noqa: E402
from mdclaw.channels.whatsapp import (  # noqa: E402
    LINKED,
    LOGGED_OUT,
    UNLINKED,
    Pairing,
    WhatsAppChannel,
    link_state,
    message_time,
)
from mdclaw.outbox import OutboxWorker, RetryPolicy  # noqa: E402
from mdclaw.retry import Backoff  # noqa: E402
from mdclaw.state import Database  # noqa: E402
from mdclaw.state.chats import list_chats  # noqa: E402
from mdclaw.state.outbox import enqueue, list_outbox  # noqa: E402
from waiting import wait_until_async

ME = "491700000001"
ME_LID = "77123456789012"
GROUP = "120363012345678901@g.us"
ALICE = "491700000002@s.whatsapp.net"


def jid(text: str) -> T.JID:
    user, server = text.split("@")
    return T.JID(User=user, Server=server, RawAgent=0, Device=0, Integrator=0, IsEmpty=False)


class FakeEvents:
    def __init__(self) -> None:
        self.handlers: dict[type, Any] = {}
        self.qr_handler: Any = None

    def qr(self, f: Any) -> None:
        self.qr_handler = f

    def __call__(self, ev_type: type) -> Any:
        def register(f: Any) -> None:
            self.handlers[ev_type] = f
        return register


class FakeClient:
    """neonize's NewAClient at the network boundary: records calls, answers like WhatsApp."""

    def __init__(self) -> None:
        self.event = FakeEvents()
        self.sent: list[tuple[T.JID, E.Message]] = []
        self.sent_at: list[float] = []
        self.presence: list[tuple[str, ChatPresence]] = []
        self.uploads: list[tuple[bytes, MediaType]] = []
        self.media = b"\x89PNG fake image"
        self.downloads = 0
        self.send_error: Exception | None = None
        self.groups = [T.GroupInfo(JID=jid(GROUP), GroupName=T.GroupName(Name="Family"),
                                   GroupCreated=1_700_000_000)]
        self.session: asyncio.Future[None] | None = None
        self.stopped = False

    async def connect(self) -> asyncio.Future[None]:
        self.session = asyncio.get_running_loop().create_future()
        return self.session

    def end(self, error: Exception | None = None) -> None:
        assert self.session is not None
        if error is None:
            self.session.set_result(None)
        else:
            self.session.set_exception(error)

    async def disconnect(self) -> None:
        pass

    async def stop(self) -> None:
        self.stopped = True
        if self.session is not None and not self.session.done():
            self.session.set_result(None)

    async def emit(self, ev: Any) -> None:
        await self.event.handlers[type(ev)](self, ev)

    async def get_me(self) -> T.Device:
        return T.Device(JID=jid(f"{ME}@s.whatsapp.net"), LID=jid(f"{ME_LID}@lid"))

    async def get_joined_groups(self) -> list[T.GroupInfo]:
        return self.groups

    async def send_message(self, to: T.JID, message: E.Message) -> T.SendResponse:
        if self.send_error is not None:
            raise self.send_error
        self.sent.append((to, message))
        self.sent_at.append(time.monotonic())
        return T.SendResponse(ID=f"3EB0{len(self.sent):04d}", Timestamp=int(time.time()))

    async def upload(self, data: bytes, media_type: MediaType) -> T.UploadResponse:
        self.uploads.append((data, media_type))
        return T.UploadResponse(url="https://mmg.example/x", DirectPath="/v/x", MediaKey=b"k",
                                FileEncSHA256=b"e", FileSHA256=b"s", FileLength=len(data))

    async def download_any(self, message: E.Message) -> bytes:
        self.downloads += 1
        return self.media

    async def send_chat_presence(self, to: T.JID, state: ChatPresence, media: Any) -> None:
        self.presence.append((f"{to.User}@{to.Server}", state))

    async def PairPhone(self, phone: str, push: bool) -> str:  # noqa: N802 - neonize's name
        return f"CODE-{phone[-4:]}"


def make_channel(tmp_path: Path, db: Database | None = None, **kw: Any
                 ) -> tuple[WhatsAppChannel, list[FakeClient]]:
    clients: list[FakeClient] = []

    def factory(ch: WhatsAppChannel) -> FakeClient:
        clients.append(FakeClient())
        return clients[-1]

    ch = WhatsAppChannel(tmp_path / "wa" / "session.sqlite3", trigger="@Andy", db=db,
                         client_factory=factory, send_interval=kw.pop("send_interval", 0.0),
                         **kw)
    ch.reconnect_backoff = Backoff(base=0.05, factor=1.0, cap=0.05, jitter=0)
    return ch, clients


async def connected(tmp_path: Path, db: Database | None = None, **kw: Any
                    ) -> tuple[WhatsAppChannel, FakeClient]:
    ch, clients = make_channel(tmp_path, db, **kw)
    await ch.connect()
    await wait_until_async(lambda: clients and clients[0].session is not None)
    await clients[0].emit(T.Connected(status=True))
    assert ch.is_connected()
    await wait_until_async(lambda: ch.groups_synced > 0)  # the group list read on connect
    return ch, clients[0]


def message_event(message: E.Message, *, chat: str = GROUP, sender: str = ALICE,
                  msg_id: str = "ABC123", from_me: bool = False, push: str = "Alice",
                  ts: int = 1_750_000_000) -> T.Message:
    return T.Message(
        Info=T.MessageInfo(
            MessageSource=T.MessageSource(Chat=jid(chat), Sender=jid(sender), IsFromMe=from_me,
                                          IsGroup=chat.endswith("@g.us")),
            ID=msg_id, Pushname=push, Timestamp=ts),
        Message=message)


# ---------------------------------------------------------------------- pairing


def test_pairing_state_machine() -> None:
    p = Pairing()
    assert (p.state, p.link_state) == (UNLINKED, UNLINKED)
    p.qr_code("2@abc")
    assert (p.state, p.link_state, p.qr) == ("qr", UNLINKED, "2@abc")
    p.qr_code("2@def")  # WhatsApp rotates the code
    assert p.qr == "2@def"
    p.paired(f"{ME}@s.whatsapp.net")
    assert (p.state, p.link_state, p.qr, p.jid) == (LINKED, LINKED, None,
                                                    f"{ME}@s.whatsapp.net")
    p.logged_out("LOGGED_OUT")
    assert (p.link_state, p.error) == (LOGGED_OUT, "LOGGED_OUT")
    p.qr_code("2@again")  # pairing again after a logout
    assert p.link_state == UNLINKED and p.qr == "2@again"
    p.pair_failed("timeout")
    assert (p.link_state, p.qr, p.error) == (UNLINKED, None, "timeout")
    p.connected(f"{ME}@s.whatsapp.net")  # a session with stored keys
    assert p.link_state == LINKED


def test_pairing_by_qr_then_logged_out_by_the_phone(tmp_path: Path) -> None:
    async def main() -> None:
        shown: list[str] = []
        ch, clients = make_channel(tmp_path, on_qr=shown.append)
        await ch.connect()
        try:
            await wait_until_async(lambda: clients and clients[0].session is not None)
            c = clients[0]
            assert ch.status_info() == {"connected": False, "link_state": UNLINKED,
                                        "fix": ch.status_info()["fix"]}
            await c.event.qr_handler(c, b"2@qrcode,key,adv")
            info = ch.status_info()
            assert info["link_state"] == UNLINKED and info["qr"] == "2@qrcode,key,adv"
            assert "mdclaw whatsapp link" in info["fix"]
            assert shown == ["2@qrcode,key,adv"]
            assert not ch.is_connected()
            await c.emit(T.PairStatus(ID=jid(f"{ME}@s.whatsapp.net"),
                                      Status=T.PairStatus.SUCCESS))
            await c.emit(T.Connected(status=True))
            info = ch.status_info()
            assert info == {"connected": True, "link_state": LINKED,
                            "account": f"{ME}@s.whatsapp.net"}
            await c.emit(T.LoggedOut(OnConnect=False, Reason=T.ConnectFailureReason.LOGGED_OUT))
            info = ch.status_info()
            assert info["link_state"] == LOGGED_OUT and not info["connected"]
            assert "pair it again" in info["fix"]
            # What status and doctor read when the daemon is not asked: the files say so too.
            assert link_state(ch.session_path)[0] == LOGGED_OUT
        finally:
            await ch.disconnect()
    asyncio.run(main())


def test_session_file_is_private(tmp_path: Path) -> None:
    async def main() -> None:
        ch, _ = make_channel(tmp_path)
        await ch.connect()
        await ch.disconnect()
        assert stat.S_IMODE(ch.session_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(ch.session_path.parent.stat().st_mode) == 0o700
    asyncio.run(main())


def in_subprocess(code: str) -> None:
    """Run `code` in a Python of its own: whatsmeow's native library calls back into Python
    from Go threads, and this CPython (3.11.7) can then fail later `ast.parse` calls of the
    test process (SystemError "AST constructor recursion depth mismatch")."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_link_state_read_from_a_session_whatsmeow_made(tmp_path: Path) -> None:
    session = tmp_path / "session.sqlite3"
    assert link_state(session) == (UNLINKED, None)  # no file
    in_subprocess(f"""
        from neonize.aioze.client import ClientFactory
        ClientFactory.get_all_devices_from_db({str(session)!r})  # whatsmeow makes its tables
    """)
    assert link_state(session) == (UNLINKED, None)  # no device: never paired
    with sqlite3.connect(session) as c:
        cols = [r[1] for r in c.execute("PRAGMA table_info(whatsmeow_device)")]
        assert "jid" in cols
    (tmp_path / "link-state.json").write_text(json.dumps({"state": LOGGED_OUT,
                                                          "jid": "x@s.whatsapp.net"}))
    assert link_state(session) == (LOGGED_OUT, "x@s.whatsapp.net")


def test_pair_code_for_a_phone_number(tmp_path: Path) -> None:
    async def main() -> None:
        ch, clients = make_channel(tmp_path)
        await ch.connect()
        try:
            await wait_until_async(lambda: clients and clients[0].session is not None)
            assert await ch.pair_code("+49 170 0000001") == "CODE-0001"
            with pytest.raises(ChannelError, match="not a phone number"):
                await ch.pair_code("12")
        finally:
            await ch.disconnect()
    asyncio.run(main())


# ---------------------------------------------------------------------- inbound


def collect(ch: WhatsAppChannel) -> list[Any]:
    got: list[Any] = []
    ch.on_inbound(got.append)
    return got


def test_text_in_a_group(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        got = collect(ch)
        await c.emit(message_event(E.Message(conversation="hello all")))
        m = got[0]
        assert (m.id, m.chat_jid, m.sender, m.sender_name, m.content) == (
            f"wa:{GROUP}:ABC123", f"wa:{GROUP}", ALICE, "Alice", "hello all")
        assert m.is_group and m.channel == "whatsapp" and not m.addressed
        assert m.chat_name == "Family"  # from the group list read on connect
        assert m.timestamp == "2025-06-15T15:06:40.000Z"
        await ch.disconnect()
    asyncio.run(main())


def test_a_timestamp_in_milliseconds_keeps_its_milliseconds(tmp_path: Path) -> None:
    """What WhatsApp gives is kept: a time in milliseconds is not rounded to the second (two
    messages of one second keep their order in time)."""
    async def main() -> None:
        ch, c = await connected(tmp_path)
        got = collect(ch)
        await c.emit(message_event(E.Message(conversation="one"), msg_id="A1",
                                   ts=1_750_000_000_007))
        await c.emit(message_event(E.Message(conversation="two"), msg_id="A2",
                                   ts=1_750_000_000_999))
        assert [m.timestamp for m in got] == ["2025-06-15T15:06:40.007Z",
                                              "2025-06-15T15:06:40.999Z"]
        await ch.disconnect()
    asyncio.run(main())
    assert message_time(1_750_000_000) == "2025-06-15T15:06:40.000Z"  # seconds


def test_own_messages_status_and_empty_messages_are_ignored(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        got = collect(ch)
        await c.emit(message_event(E.Message(conversation="mine"), from_me=True))
        await c.emit(message_event(E.Message(conversation="story"), chat="status@broadcast"))
        await c.emit(message_event(E.Message(
            reactionMessage=E.ReactionMessage(text="👍"))))
        assert got == []
        await ch.disconnect()
    asyncio.run(main())


def test_a_mention_of_the_account_becomes_the_trigger(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        got = collect(ch)
        ext = E.ExtendedTextMessage(
            text=f"@{ME} what's the weather? cc @491700000009",
            contextInfo=E.ContextInfo(mentionedJID=[f"{ME}@s.whatsapp.net",
                                                    "491700000009@s.whatsapp.net"]))
        await c.emit(message_event(E.Message(extendedTextMessage=ext)))
        assert got[0].content == "@Andy what's the weather? cc @491700000009"
        assert got[0].addressed
        # Groups that address people by lid: the account's lid counts as well.
        ext = E.ExtendedTextMessage(text=f"hi @{ME_LID}",
                                    contextInfo=E.ContextInfo(mentionedJID=[f"{ME_LID}@lid"]))
        await c.emit(message_event(E.Message(extendedTextMessage=ext), msg_id="M2"))
        assert got[1].content == "hi @Andy" and got[1].addressed
        # Someone else mentioned: not addressed, text as written.
        ext = E.ExtendedTextMessage(text="@491700000009 hi", contextInfo=E.ContextInfo(
            mentionedJID=["491700000009@s.whatsapp.net"]))
        await c.emit(message_event(E.Message(extendedTextMessage=ext), msg_id="M3"))
        assert got[2].content == "@491700000009 hi" and not got[2].addressed
        await ch.disconnect()
    asyncio.run(main())


def test_a_reply_carries_the_quoted_id_and_text(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        got = collect(ch)
        ext = E.ExtendedTextMessage(text="and tomorrow?", contextInfo=E.ContextInfo(
            stanzaID="3EB0OLD", participant=f"{ME}@s.whatsapp.net",
            quotedMessage=E.Message(conversation="Sunny, 24 degrees")))
        await c.emit(message_event(E.Message(extendedTextMessage=ext)))
        m = got[0]
        assert m.reply_to == f"wa:{GROUP}:3EB0OLD"
        assert m.addressed  # a reply to the assistant's own message
        assert m.content == '@Andy and tomorrow?\n(replying to you: "Sunny, 24 degrees")'
        ext = E.ExtendedTextMessage(text="agreed", contextInfo=E.ContextInfo(
            stanzaID="XYZ", participant="491700000009@s.whatsapp.net",
            quotedMessage=E.Message(conversation="pizza tonight")))
        await c.emit(message_event(E.Message(extendedTextMessage=ext), msg_id="M2"))
        assert got[1].content == 'agreed\n(replying to 491700000009: "pizza tonight")'
        assert not got[1].addressed
        await ch.disconnect()
    asyncio.run(main())


def test_media_arrives_as_attachments(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        got = collect(ch)
        await c.emit(message_event(E.Message(imageMessage=E.ImageMessage(
            mimetype="image/jpeg", caption="our garden", fileLength=15, URL="https://x",
            directPath="/v/1", mediaKey=b"k")), msg_id="IMG"))
        await c.emit(message_event(E.Message(audioMessage=E.AudioMessage(
            mimetype="audio/ogg; codecs=opus", PTT=True, fileLength=4000, seconds=3)),
            msg_id="PTT"))
        await c.emit(message_event(E.Message(documentWithCaptionMessage=E.FutureProofMessage(
            message=E.Message(documentMessage=E.DocumentMessage(
                mimetype="application/pdf", fileName="bill.pdf", caption="pay this",
                fileLength=20_000)))), msg_id="DOC"))
        await c.emit(message_event(E.Message(ephemeralMessage=E.FutureProofMessage(
            message=E.Message(videoMessage=E.VideoMessage(mimetype="video/mp4",
                                                          fileLength=50)))), msg_id="VID"))
        await c.emit(message_event(E.Message(audioMessage=E.AudioMessage(
            mimetype="audio/mpeg", fileLength=10)), msg_id="AUD"))
        image, voice, doc, video, audio = got
        a = image.attachments[0]
        assert (a.kind, a.mime, a.size, a.caption, a.name) == ("image", "image/jpeg", 15,
                                                               "our garden", None)
        assert image.content == "our garden"
        assert await a.fetch(1000) == c.media and c.downloads == 1
        with pytest.raises(ChannelError, match="more than 10"):
            await a.fetch(10)
        assert c.downloads == 1  # refused on the announced size, nothing downloaded
        assert voice.attachments[0].kind == "voice" and voice.content == ""
        assert (doc.attachments[0].kind, doc.attachments[0].name, doc.content) == (
            "document", "bill.pdf", "pay this")
        assert video.attachments[0].kind == "video"
        assert audio.attachments[0].kind == "audio"
        big = c.media * 100
        c.media = big  # WhatsApp sent more than it announced: still bounded
        with pytest.raises(ChannelError):
            await video.attachments[0].fetch(len(big) - 1)
        await ch.disconnect()
    asyncio.run(main())


def test_groups_go_into_the_chats_table_for_the_main_agent(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch, c = await connected(tmp_path, db)
        await wait_until_async(lambda: any(r["jid"] == f"wa:{GROUP}" for r in list_chats(db)))
        row = next(r for r in list_chats(db) if r["jid"] == f"wa:{GROUP}")
        assert (row["name"], row["channel"], row["is_group"]) == ("Family", "whatsapp", 1)
        await c.emit(T.JoinedGroup(GroupInfo=T.GroupInfo(
            JID=jid("120363000000000002@g.us"), GroupName=T.GroupName(Name="Book club"))))
        await c.emit(T.GroupInfoEvent(JID=jid(GROUP), Name=T.GroupName(Name="Family 2026")))
        names = {r["jid"]: r["name"] for r in list_chats(db)}
        assert names["wa:120363000000000002@g.us"] == "Book club"
        assert names[f"wa:{GROUP}"] == "Family 2026"

        from mdclaw.ipc.writers import groups_snapshot
        from mdclaw.state.groups import list_groups
        snap = groups_snapshot(list_groups(db), list_chats(db), is_main=True)
        assert {g["jid"] for g in snap["groups"]} >= {f"wa:{GROUP}",
                                                       "wa:120363000000000002@g.us"}
        await ch.disconnect()
        db.close()
    asyncio.run(main())


# ---------------------------------------------------------------------- outbound


def test_markdown_goes_out_in_whatsapp_formatting(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        pieces = ch.split_text("**Done**: see [the list](https://example.org)\n\n- a\n- b")
        assert pieces == ["*Done*: see the list (https://example.org)\n\n- a\n- b"]
        mid = await ch.send_message(f"wa:{GROUP}", pieces[0])
        to, msg = c.sent[0]
        assert [to.User, to.Server] == GROUP.split("@")
        assert msg.conversation == pieces[0]
        assert mid == f"wa:{GROUP}:3EB00001"
        long = "\n\n".join(f"Paragraph {i} " + "word " * 150 for i in range(12))
        parts = ch.split_text(long)
        assert len(parts) > 1 and all(len(p) <= ch.max_message_length for p in parts)
        await ch.disconnect()
    asyncio.run(main())


def test_reply_reaction_and_typing(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        got = collect(ch)
        await c.emit(message_event(E.Message(conversation="@Andy hi")))
        inbound = got[0].id
        await ch.send_message(f"wa:{GROUP}", "hello Alice", reply_to=inbound)
        msg = c.sent[0][1]
        ctx = msg.extendedTextMessage.contextInfo
        assert msg.extendedTextMessage.text == "hello Alice"
        assert (ctx.stanzaID, ctx.participant) == ("ABC123", ALICE)
        await ch.react(f"wa:{GROUP}", inbound, "👍")
        r = c.sent[1][1].reactionMessage
        assert (r.text, r.key.ID, r.key.remoteJID, r.key.participant, r.key.fromMe) == (
            "👍", "ABC123", GROUP, ALICE, False)
        with pytest.raises(ChannelError):
            await ch.react(f"wa:{GROUP}", "tg:1:2", "👍")
        await ch.set_typing(f"wa:{GROUP}", True)
        await wait_until_async(lambda: c.presence)
        await ch.set_typing(f"wa:{GROUP}", False)
        assert [s for _, s in c.presence] == [ChatPresence.CHAT_PRESENCE_COMPOSING,
                                              ChatPresence.CHAT_PRESENCE_PAUSED]
        await ch.disconnect()
    asyncio.run(main())


@pytest.mark.parametrize(("name", "body", "kind", "mtype"), [
    ("photo.jpg", b"\xff\xd8\xff jpeg", "imageMessage", MediaType.MediaImage),
    ("report.pdf", b"%PDF-1.4", "documentMessage", MediaType.MediaDocument),
    ("note.mp3", b"ID3 mp3", "audioMessage", MediaType.MediaAudio),
])
def test_files_go_out_by_type(tmp_path: Path, name: str, body: bytes, kind: str,
                              mtype: MediaType) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        f = tmp_path / name
        f.write_bytes(body)
        await ch.send_file(f"wa:{GROUP}", f, caption="**look**")
        assert c.uploads == [(body, mtype)]
        msg = c.sent[0][1]
        media = getattr(msg, kind)
        assert msg.HasField(kind) and media.fileLength == len(body)
        assert media.URL == "https://mmg.example/x"
        if kind == "audioMessage":  # no caption on audio: it follows as text
            assert c.sent[1][1].conversation == "*look*"
        else:
            assert media.caption == "*look*"
        if kind == "documentMessage":
            assert media.fileName == "report.pdf" and media.mimetype == "application/pdf"
        with pytest.raises(ChannelError) as e:
            await ch.send_file(f"wa:{GROUP}", tmp_path / "missing.png")
        assert e.value.permanent
        await ch.disconnect()
    asyncio.run(main())


def test_sends_are_spaced_and_rate_limits_are_retried_later(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path, send_interval=0.2)
        await ch.send_message(f"wa:{ALICE}", "one")
        await ch.send_message(f"wa:{ALICE}", "two")
        assert c.sent_at[1] - c.sent_at[0] >= 0.2
        c.send_error = Exception("server returned error 429: rate-overlimit")
        with pytest.raises(ChannelError) as e:
            await ch.send_message(f"wa:{ALICE}", "three")
        assert e.value.retry_after == 60.0 and not e.value.permanent
        with pytest.raises(ChannelError) as e:
            await ch.send_message("wa:not-a-jid", "x")
        assert e.value.permanent
        await ch.disconnect()
    asyncio.run(main())


# ---------------------------------------------------------------------- reconnects, outbox


def test_a_session_that_ends_is_started_again(tmp_path: Path) -> None:
    async def main() -> None:
        ch, c = await connected(tmp_path)
        assert ch.is_connected()
        ch_clients: list[FakeClient] = []
        old_factory = ch.client_factory

        def factory(chan: WhatsAppChannel) -> Any:
            ch_clients.append(old_factory(chan))
            return ch_clients[-1]

        ch.client_factory = factory
        c.end(RuntimeError("websocket closed"))
        await wait_until_async(lambda: not ch.is_connected())
        await wait_until_async(lambda: ch_clients and ch_clients[0].session is not None)
        assert ch.sessions_started == 2
        with pytest.raises(ChannelError, match="not connected"):
            await ch.send_message(f"wa:{ALICE}", "while down")
        await ch_clients[0].emit(T.Connected(status=True))
        assert ch.is_connected()
        await ch.disconnect()
        assert not ch.is_connected() and ch_clients[0].stopped
    asyncio.run(main())


def test_outbox_keeps_rows_while_disconnected_and_sends_after_reconnect(tmp_path: Path) -> None:
    async def main() -> None:
        db = Database(tmp_path / "s.db")
        ch, clients = make_channel(tmp_path, db)
        await ch.connect()
        await wait_until_async(lambda: clients and clients[0].session is not None)
        with db.transaction() as conn:
            rid = enqueue(conn, chat_jid=f"wa:{GROUP}", kind="text", text="**hi** there")
        worker = OutboxWorker(db, [ch], policy=RetryPolicy(max_attempts=2, base_delay=0,
                                                           jitter=0),
                              disconnected_recheck=0)
        for _ in range(3):
            assert await worker.run_once() == 0
        row = list_outbox(db)[0]
        assert (row.id, row.status, row.attempts) == (rid, "pending", 0)
        assert "not connected" in (row.last_error or "")
        assert clients[0].sent == []
        await clients[0].emit(T.Connected(status=True))
        assert await worker.run_once() == 1
        row = list_outbox(db)[0]
        assert row.status == "sent"
        assert clients[0].sent[0][1].conversation == "*hi* there"
        await ch.disconnect()
        db.close()
    asyncio.run(main())


# ---------------------------------------------------------------------- wiring


def test_registry_builds_the_channel_from_config(tmp_path: Path) -> None:
    from mdclaw.channels.registry import build_channels
    from mdclaw.config import load_config

    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        "assistant: {name: Andy}\n"
        "groups: {main: {name: Main, jid: 'hl:main', main: true}}\n"
        "channels: {whatsapp: {enabled: true}}\n")
    cfg = load_config(cfg_file)
    db = Database(tmp_path / "s.db")
    try:
        chans = build_channels(cfg, db)
        wa = [c for c in chans if c.name == "whatsapp"]
        assert len(wa) == 1 and isinstance(wa[0], WhatsAppChannel)
        assert wa[0].session_path == tmp_path / "data" / "whatsapp" / "session.sqlite3"
        assert wa[0].trigger == "@Andy" and wa[0].owns_jid(f"wa:{GROUP}")
    finally:
        db.close()


def test_the_real_neonize_client_starts_and_stops_without_a_network(tmp_path: Path) -> None:
    """The real client on a real session file: this machine cannot reach WhatsApp, so the
    session fails to dial; the channel stays not connected, retries, and stops cleanly."""
    session = tmp_path / "wa" / "session.sqlite3"
    in_subprocess(f"""
        import asyncio, stat, time
        from pathlib import Path
        from mdclaw.channels.whatsapp import UNLINKED, WhatsAppChannel, link_state
        from mdclaw.retry import Backoff

        async def main():
            ch = WhatsAppChannel(Path({str(session)!r}), trigger="@Andy")
            ch.reconnect_backoff = Backoff(base=0.2, factor=1.0, cap=0.2, jitter=0)
            await ch.connect()
            deadline = time.monotonic() + 60
            while ch.sessions_started < 2:  # (a script of its own: no tests/ on its path)
                assert time.monotonic() < deadline, "no second session"
                await asyncio.sleep(0.05)
            assert not ch.is_connected()
            assert ch.status_info()["link_state"] == UNLINKED
            await ch.disconnect()
            assert link_state(ch.session_path) == (UNLINKED, None)
            assert stat.S_IMODE(ch.session_path.stat().st_mode) == 0o600

        asyncio.run(main())
    """)


# ---------------------------------------------------------------------- CLI


def test_link_draws_qr_codes_until_a_phone_scans_one(tmp_path: Path) -> None:
    import io

    from mdclaw.commands.whatsapp import run_link

    async def main() -> None:
        ch, clients = make_channel(tmp_path)
        out = io.StringIO()
        link = asyncio.create_task(run_link(ch, phone=None, timeout=30, out=out))
        await wait_until_async(lambda: clients and clients[0].session is not None)
        c = clients[0]
        await c.event.qr_handler(c, b"2@first,code")
        await c.event.qr_handler(c, b"2@second,code")
        assert out.getvalue().count("Linked devices") == 2
        assert "█" in out.getvalue() or "▀" in out.getvalue()  # segno's terminal drawing
        await c.emit(T.PairStatus(ID=jid(f"{ME}@s.whatsapp.net"), Status=T.PairStatus.SUCCESS))
        assert await link == 0
        assert f"linked to {ME}@s.whatsapp.net" in out.getvalue()
        assert c.stopped  # the foreground session ended
    asyncio.run(main())


def test_link_with_a_phone_number_prints_a_pairing_code(tmp_path: Path) -> None:
    import io

    from mdclaw.commands.whatsapp import run_link

    async def main() -> None:
        ch, clients = make_channel(tmp_path)
        out = io.StringIO()
        link = asyncio.create_task(run_link(ch, phone="+49 170 0000001", timeout=30, out=out))
        await wait_until_async(lambda: clients and clients[0].session is not None)
        c = clients[0]
        await c.event.qr_handler(c, b"2@code")
        await wait_until_async(lambda: "CODE-0001" in out.getvalue())
        assert "█" not in out.getvalue()
        await c.emit(T.PairStatus(ID=jid(f"{ME}@s.whatsapp.net"), Status=T.PairStatus.SUCCESS))
        assert await link == 0
    asyncio.run(main())


WA_CONFIG = """\
data_dir: {data_dir}
assistant: {name: Andy}
groups: {main: {name: Main, jid: 'hl:main', main: true}}
channels: {whatsapp: {enabled: true}}
"""


def test_status_and_doctor_say_unlinked_with_the_fix(cli, write_config, data_dir) -> None:
    cfg = write_config(WA_CONFIG)
    r = cli("status", "--config", str(cfg))
    assert "whatsapp: unlinked — fix: pair it: run `mdclaw whatsapp link`" in r.stdout
    r = cli("status", "--json", "--config", str(cfg))
    assert json.loads(r.stdout)["whatsapp"]["link_state"] == UNLINKED
    r = cli("doctor", "--json", "--config", str(cfg), timeout=120)
    wa = next(c for c in json.loads(r.stdout) if c["check"] == "whatsapp")
    assert wa["level"] == "fail" and "mdclaw whatsapp link" in wa["fix"]
    # Logged out by the phone: the record beside the session says so.
    (data_dir / "whatsapp").mkdir(parents=True)
    (data_dir / "whatsapp" / "link-state.json").write_text(
        json.dumps({"state": LOGGED_OUT, "jid": f"{ME}@s.whatsapp.net"}))
    r = cli("status", "--config", str(cfg))
    assert f"whatsapp: logged_out ({ME}@s.whatsapp.net) — fix: the phone removed" in r.stdout


def test_status_and_doctor_say_linked(cli, write_config, data_dir) -> None:
    cfg = write_config(WA_CONFIG)
    session = data_dir / "whatsapp" / "session.sqlite3"
    session.parent.mkdir(parents=True)
    with sqlite3.connect(session) as c:  # the one column mdclaw reads of whatsmeow's table
        c.execute("CREATE TABLE whatsmeow_device (jid TEXT PRIMARY KEY)")
        c.execute("INSERT INTO whatsmeow_device VALUES (?)", (f"{ME}.0:3@s.whatsapp.net",))
    session.chmod(0o644)
    r = cli("doctor", "--json", "--config", str(cfg), timeout=120)
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["whatsapp"]["level"] == "ok"
    assert checks["whatsapp_session"]["level"] == "warn"
    r = cli("status", "--config", str(cfg))
    assert f"whatsapp: linked ({ME}.0:3@s.whatsapp.net)" in r.stdout


def test_link_refuses_without_the_channel_configured(cli, write_config) -> None:
    r = cli("whatsapp", "link", "--config", str(write_config()))
    assert r.returncode != 0 and "not configured" in r.stderr
