"""Discord (`dc:<channel id>`) as a bot, through discord.py (the `discord` extra).

discord.py keeps the gateway session: IDENTIFY with the intents below (message content is a
privileged intent, switched on in the Developer Portal), heartbeats, RESUME after a dropped
connection (the events missed meanwhile are replayed by Discord), a new session after
INVALID_SESSION. Its REST client keeps Discord's per-route buckets (X-RateLimit-Bucket,
-Remaining, -Reset-After) and the global limit; a 429 it waits out itself when Discord asks
for at most `max_ratelimit_timeout` seconds (then sends once), a longer one comes back as
ChannelError(retry_after) and the outbox sends after that wait.

In: a message (not the bot's own, not another bot's) becomes an InboundMessage with id
`dc:<channel>:<message id>`, where <channel> is where it was written; its jid is the channel's,
or for a thread its parent channel's (a thread belongs to the group of its channel). An answer
goes back into the thread: the one `reply_to` names, or where the chat's last message was
written (kept with the cursors, so an answer after a restart still finds its thread).
Attachments are fetched on demand, capped. A @mention of the bot or a reply to one of its
messages is `addressed`. `/chatid` (a slash command the bot registers, or the text) answers
with the channel's jid.
Messages are handed to the host one at a time, in order; after each, the channel's last
message id is kept in the state database (`router_state`, per bot, written on a thread). A
new session (a restart, an invalidated session) first asks each known channel for the
messages after that id, so what came while the bot was away is handed over, and nothing
twice (the host drops an id it has, and an id at or before the cursor is skipped here).

Out: the assistant's Markdown as Discord Markdown (mdclaw.markup.to_discord), cut at 2,000
characters without cutting a code block or an inline style (split_discord); files (10 MiB, the
limit for bots in a server without boosts), reactions, typing (repeated while it lasts).
The token never appears in a log or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from mdclaw.channels.base import (
    Attachment,
    Channel,
    ChannelError,
    InboundCallback,
    InboundMessage,
    SavedPosition,
    delivery_key,
    kind_for_mime,
    read_upload,
)
from mdclaw.config import EXTRAS, MissingExtra, read_secret
from mdclaw.config.extras import ExtraMissing, unavailable
from mdclaw.markup import split_discord, to_discord, utf16_len
from mdclaw.retry import Backoff
from mdclaw.state import Database, now_iso

if TYPE_CHECKING:
    import discord

log = logging.getLogger("mdclaw.channels.discord")

DEFAULT_API_BASE = "https://discord.com/api/v10"
JID_RE = re.compile(r"^dc:(\d{1,20})\Z")
MESSAGE_ID_RE = re.compile(r"^dc:(\d{1,20}):(\d{1,20})\Z")
MAX_MESSAGE = 2000
MAX_UPLOAD_BYTES = 10 * 1024 * 1024
TYPING_REPEAT_SECONDS = 8.0  # Discord shows "typing" for 10 s
TYPING_MAX_SECONDS = 300.0
NONCE_CHARS = 25  # Create Message's nonce: at most 25 characters
HISTORY_PAGE = 100  # Discord's largest page of GET /channels/{id}/messages
REMEMBERED_CHANNELS = 512  # cursors kept (most recent first)


class _Refused(ChannelError):  # noqa: N818 - internal signal, never leaves the module
    """The host did not take message `message_id` of channel `channel_id`."""

    def __init__(self, channel_id: int, message_id: int) -> None:
        super().__init__(f"message {message_id} of channel {channel_id} refused")
        self.channel_id, self.message_id = channel_id, message_id


def _nonce(jid: str, what: str) -> str:
    """Create Message's `nonce` for the outbox delivery in progress: discord.py sends it with
    `enforce_nonce: true`, so Discord answers a repeat within a few minutes with the message
    the first request created instead of posting it again; the outbox's retry after a lost
    answer thus posts once. Discord takes at most 25 characters. Outside a delivery a random
    one, as discord.py would choose."""
    key = delivery_key(jid, what, size=NONCE_CHARS)
    return key if key is not None else str(secrets.randbits(64))


def require_discord() -> None:
    """Raise ExtraMissing (the fix in one line) when discord.py cannot be imported."""
    why = unavailable(EXTRAS["discord"], load=True)
    if why is not None:
        raise ExtraMissing(MissingExtra("channels.discord", EXTRAS["discord"], why))


def _snowflake(value: str, what: str) -> int:
    if not value.isdigit():
        raise ChannelError(f"{what} {value!r} is not a Discord id", permanent=True)
    return int(value)


class DiscordChannel(Channel):
    """A Discord bot. `api_base` is the REST root (a fake server in tests); the gateway's
    address comes from GET /gateway/bot there, as Discord says to find it."""

    name = "discord"
    jid_prefix = "dc:"
    max_message_length = MAX_MESSAGE
    # Starting the client again after discord.py gave up (the network gone at start, a close
    # it does not resume): 1 s doubling to 60 s, equal jitter.
    reconnect_backoff = Backoff(base=1.0, factor=2.0, cap=60.0)

    def __init__(self, token: str, *, api_base: str = DEFAULT_API_BASE,
                 on_inbound: InboundCallback | None = None, trigger: str | None = None,
                 db: Database | None = None, max_ratelimit_timeout: float = 30.0,
                 sync_commands: bool = True, guild_ready_timeout: float = 2.0) -> None:
        super().__init__(on_inbound)
        if not token or any(c.isspace() for c in token):
            raise ChannelError("the Discord bot token is empty or malformed")
        self._token = token
        self.api_base = api_base.rstrip("/")
        self.max_ratelimit_timeout = max_ratelimit_timeout
        self.sync_commands = sync_commands
        # How long discord.py waits for the servers READY named before it is ready.
        self.guild_ready_timeout = guild_ready_timeout
        self.trigger = trigger
        self.db = db
        self._client: discord.Client | None = None
        self._session: aiohttp.ClientSession | None = None
        self._runner: asyncio.Task[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._typing: dict[str, asyncio.Task[None]] = {}
        # Messages (and "catch up" marks) in the order the gateway gave them.
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._running = False
        self._ready = False  # a gateway session is up
        # A REST request lost its connection: sends wait (not counted as tries) until a probe
        # reaches Discord again; the gateway session may be fine all along, so it alone
        # would never say so.
        self._rest_down = False
        self._probe: asyncio.Task[None] | None = None
        # (what is wrong, the fix) when the bot cannot run: a refused token or intent
        self._fatal: tuple[str, str] | None = None
        self.bot_id: int | None = None
        self.bot_name: str | None = None
        self.sessions = 0  # READYs seen (new sessions), for status_info
        self.resumes = 0  # RESUMEDs seen
        # channel id -> id of the last message handed over there (what a new session
        # catches up from); a channel whose message the host refused is not moved on.
        self._cursors: dict[int, int] = {}
        self._parents: dict[int, int] = {}  # thread id -> its channel's id
        # jid -> where its last message was written (the channel, or one of its threads): an
        # answer that names no message to reply to goes there, and so does typing.
        self._last_where: dict[str, int] = {}
        # Channels whose message the host refused: their later messages wait for the next
        # catch-up (which reads them from the history, in order) instead of passing it.
        self._behind: set[int] = set()
        self._saved = SavedPosition(db, lambda: self._cursor_key, channel="discord",
                                    what="message cursors")

    @classmethod
    def from_config(cls, section: Any, *, on_inbound: InboundCallback | None = None,
                    trigger: str | None = None, db: Database | None = None) -> DiscordChannel:
        """Build from the `channels.discord` section; reads the token file now. Raises
        ChannelError naming the file (never its content) if it cannot be read."""
        try:
            token = read_secret(section.token_file)
        except OSError as e:
            raise ChannelError(f"cannot read channels.discord.token_file "
                               f"{section.token_file}: {e.strerror}") from None
        return cls(token, api_base=section.api_base, on_inbound=on_inbound, trigger=trigger,
                   db=db)

    def redact(self, text: str) -> str:
        return text.replace(self._token, "***")

    def measure(self, text: str) -> int:
        return utf16_len(text)

    def status_info(self) -> dict[str, Any]:
        """{"connected", "detail"} and, while the bot cannot run, "fix"."""
        info: dict[str, Any] = {"connected": self.is_connected(), "sessions": self.sessions,
                                "resumes": self.resumes}
        if self.bot_name:
            info["bot"] = self.bot_name
        if self._fatal:
            info["detail"], info["fix"] = self._fatal
        elif self.is_connected():
            info["detail"] = f"gateway session up as {self.bot_name or 'the bot'}"
        elif self._running:
            info["detail"] = "no gateway session: connecting (discord.py resumes or starts " \
                             "one with backoff)"
        return info

    # ------------------------------------------------------------------ cursors
    @property
    def _cursor_key(self) -> str:
        # The token's first part is the bot's user id in base64 (public); before login
        # that is all there is.
        return f"discord_cursors:{self._token.split('.', 1)[0]}"

    async def _load_cursors(self) -> None:
        value = await self._saved.load()
        try:
            saved = json.loads(value) if value else {}
        except ValueError:
            saved = {}
        if not isinstance(saved, dict):
            return
        cursors, where = saved.get("cursors"), saved.get("where")
        for k, v in (cursors.items() if isinstance(cursors, dict) else ()):
            if str(k).isdigit() and isinstance(v, int):
                self._cursors.setdefault(int(k), v)
        for k, v in (where.items() if isinstance(where, dict) else ()):
            if JID_RE.match(str(k)) and isinstance(v, int):
                self._last_where.setdefault(str(k), v)

    async def _save_cursors(self) -> None:
        recent = sorted(self._cursors.items(), key=lambda kv: kv[1])[-REMEMBERED_CHANNELS:]
        await self._saved.save(json.dumps(
            {"cursors": {str(k): v for k, v in recent},
             "where": dict(list(self._last_where.items())[-REMEMBERED_CHANNELS:])}))

    # ------------------------------------------------------------------ lifecycle
    def _make_client(self) -> discord.Client:
        import discord
        from discord import app_commands

        # The one REST root of discord.py (a class attribute): Discord's, or a fake's.
        discord.http.Route.BASE = self.api_base
        intents = discord.Intents.none()
        intents.guilds = True  # channels and threads, so a thread's parent is known
        intents.guild_messages = True
        intents.dm_messages = True
        intents.message_content = True  # privileged: the Developer Portal must allow it
        client = discord.Client(
            intents=intents, max_messages=None, chunk_guilds_at_startup=False,
            member_cache_flags=discord.MemberCacheFlags.none(),
            max_ratelimit_timeout=self.max_ratelimit_timeout,
            guild_ready_timeout=self.guild_ready_timeout,
            allowed_mentions=discord.AllowedMentions(everyone=False, roles=False,
                                                     users=True, replied_user=True))
        tree = app_commands.CommandTree(client)
        channel = self

        @tree.command(name="chatid", description="Show this channel's id for mdclaw's config")
        async def chatid(interaction: discord.Interaction) -> None:
            cid = interaction.channel_id
            parent = getattr(interaction.channel, "parent_id", None)
            jid = f"dc:{parent or channel._parents.get(cid or 0, cid) or '?'}"
            await interaction.response.send_message(f"This channel is `{jid}`",
                                                    ephemeral=True)

        async def setup_hook() -> None:
            if self.sync_commands:
                try:
                    await tree.sync()
                except discord.HTTPException as e:
                    log.warning("discord: could not register /chatid: %s", e)

        async def on_ready() -> None:
            self._ready = True
            self.sessions += 1
            user = client.user
            if user is not None:
                self.bot_id, self.bot_name = user.id, str(user)
            log.info("discord: connected as %s", self.bot_name or "?")
            self._queue.put_nowait(("catch_up", None))

        async def on_resumed() -> None:
            self._ready = True
            self.resumes += 1

        async def on_disconnect() -> None:
            self._ready = False

        async def on_message(message: discord.Message) -> None:
            self._queue.put_nowait(("message", message))

        client.setup_hook = setup_hook  # type: ignore[method-assign]
        for ev in (on_ready, on_resumed, on_disconnect, on_message):
            client.event(ev)
        return client

    async def connect(self) -> None:
        """Log in (GET /users/@me checks the token), then run the gateway session in the
        background. Raises ChannelError (with the fix) when the token is refused, and
        ExtraMissing's message when discord.py is not installed. When Discord cannot be
        reached the channel starts anyway, not connected, and keeps trying."""
        if self._running:
            return
        try:
            require_discord()
        except ExtraMissing as e:
            raise ChannelError(str(e)) from None
        import discord

        self._running = True
        self._fatal = None
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        await self._load_cursors()
        self._worker = asyncio.create_task(self._work(), name="discord-inbound")
        client = self._make_client()
        logged_in: discord.Client | None = client
        try:
            await client.login(self._token)
        except discord.LoginFailure:
            await client.close()
            await self.disconnect()
            raise ChannelError("Discord rejected the bot token; check "
                               "channels.discord.token_file") from None
        except (discord.HTTPException, aiohttp.ClientError, OSError, TimeoutError) as e:
            await client.close()
            log.warning("discord: %s; will keep trying", self.redact(f"{type(e).__name__}: "
                                                                     f"{e}"))
            logged_in = None
        self._runner = asyncio.create_task(self._run(logged_in), name="discord-gateway")

    async def _run(self, client: discord.Client | None) -> None:
        """Keep a gateway session: discord.py resumes and reconnects by itself; when it
        gives up, a new client starts after a growing wait."""
        import discord

        failures = 0
        while self._running:
            if client is None:
                client = self._make_client()
                try:
                    await client.login(self._token)
                except discord.LoginFailure:
                    self._fatal = ("Discord rejected the bot token",
                                   "put the bot's token (Developer Portal → your application "
                                   "→ Bot → Reset Token) into channels.discord.token_file")
                    log.error("discord: %s; %s", *self._fatal)
                    await client.close()
                    return
                except (discord.HTTPException, aiohttp.ClientError, OSError,
                        TimeoutError) as e:
                    await client.close()
                    client = None
                    failures += 1
                    wait = self.reconnect_backoff.delay(failures)
                    log.warning("discord: %s; retrying in %.0f s",
                                self.redact(f"{type(e).__name__}: {e}"), wait)
                    await asyncio.sleep(wait)
                    continue
            self._client = client
            try:
                await self._find_gateway(client)
                await client.connect(reconnect=True)
                failures = 0
            except discord.PrivilegedIntentsRequired:
                self._fatal = ("Discord refused the Message Content Intent (close code "
                               "4014): the bot cannot read messages",
                               "Developer Portal → your application → Bot → Privileged "
                               "Gateway Intents: turn on Message Content Intent, then "
                               "restart mdclaw")
                log.error("discord: %s; %s", *self._fatal)
                return
            except Exception as e:  # noqa: BLE001 - any end of the session: start again
                failures += 1
                log.warning("discord: the gateway session ended: %s",
                            self.redact(f"{type(e).__name__}: {e}"))
            finally:
                self._ready = False
                if not client.is_closed():
                    await client.close()
            client = None
            if self._running:
                await asyncio.sleep(self.reconnect_backoff.delay(max(failures, 1)))

    @staticmethod
    async def _find_gateway(client: discord.Client) -> None:
        """Ask GET /gateway/bot where the gateway is (Discord says to ask, not to assume):
        discord.py's one gateway address (a class attribute) is set to the answer."""
        import yarl
        from discord.gateway import DiscordWebSocket

        _shards, url, _limit = await client.http.get_bot_gateway()
        DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(url)

    async def disconnect(self) -> None:
        """Close the gateway session and the HTTP clients; the cursors are saved."""
        self._running = False
        self._ready = False
        client, self._client = self._client, None
        if client is not None and not client.is_closed():
            with contextlib.suppress(Exception):
                await client.close()
        tasks = [t for t in (self._runner, self._worker, self._probe,
                             *self._typing.values()) if t is not None]
        self._runner = self._worker = self._probe = None
        self._typing.clear()
        for t in tasks:
            t.cancel()
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            session, self._session = self._session, None
            if session is not None:
                await session.close()
            await self._save_cursors()
        for t, r in zip(tasks, results, strict=True):
            if isinstance(r, Exception):
                log.warning("discord: %s had ended with an error", t.get_name(), exc_info=r)

    def is_connected(self) -> bool:
        return self._running and self._ready and not self._rest_down

    def _rest_lost(self) -> None:
        """A REST request's connection failed: not connected until Discord answers again."""
        self._rest_down = True
        if self._running and (self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._probe_rest(), name="discord-rest-probe")

    async def _probe_rest(self) -> None:
        """Ask Discord (GET /oauth2/applications/@me) after a growing wait until it answers."""
        tries = 0
        while self._running and self._rest_down:
            tries += 1
            await asyncio.sleep(self.reconnect_backoff.delay(tries))
            client = self._client
            if client is None or client.is_closed():
                continue
            try:
                await client.application_info()
            except Exception as e:  # noqa: BLE001 - still unreachable: wait longer
                log.debug("discord: REST still unreachable: %s", type(e).__name__)
                continue
            self._rest_down = False

    # ------------------------------------------------------------------ inbound
    async def _work(self) -> None:
        """Hand messages to the host in the order they came; catch up first after every new
        session."""
        refused = 0
        while True:
            kind, item = await self._queue.get()
            try:
                if kind == "catch_up":
                    await self._catch_up()
                else:
                    await self._take(item, live=True)
                refused = 0
            except asyncio.CancelledError:
                raise
            except _Refused as e:  # the host's callback failed
                refused += 1
                self._behind.add(e.channel_id)
                self._cursors.setdefault(e.channel_id, e.message_id - 1)
                log.exception("discord: the host did not take a message; it is asked for "
                              "again")
                await asyncio.sleep(self.reconnect_backoff.delay(refused))
                self._queue.put_nowait(("catch_up", None))
            except Exception:  # noqa: BLE001 - a bug must not end the inbound worker
                log.exception("discord: handling an inbound event failed")
            if self._queue.empty():
                await self._save_cursors()

    async def _catch_up(self) -> None:
        """Hand over what each known channel got after its cursor (history, oldest first)."""
        client = self._client
        if client is None or not self._cursors:
            return
        import discord

        for channel_id in sorted(self._cursors):
            after = self._cursors[channel_id]
            # A message read from the history does not say its server: the channel (from
            # the cache, or asked of Discord) does, and a thread's its parent.
            where: Any = client.get_channel(channel_id)
            if where is None:
                try:
                    where = await client.fetch_channel(channel_id)
                except (discord.HTTPException, aiohttp.ClientError, OSError):
                    where = client.get_partial_messageable(channel_id)
            while True:
                try:
                    page = await client.http.logs_from(channel_id, HISTORY_PAGE, after=after)
                except Exception as e:  # noqa: BLE001 - a channel gone, no access: skip it
                    log.warning("discord: could not read the history of %s: %s", channel_id,
                                self.redact(f"{type(e).__name__}: {e}"))
                    break
                msgs: list[dict[str, Any]] = sorted(
                    (dict(m) for m in page if isinstance(m, dict)),
                    key=lambda m: int(m.get("id", 0)))
                if not msgs:
                    break
                for data in msgs:
                    message = self._message_from(client, where, data)
                    await self._take(message, live=False)
                after = int(msgs[-1]["id"])
                if len(msgs) < HISTORY_PAGE:
                    break
            self._behind.discard(channel_id)

    @staticmethod
    def _message_from(client: discord.Client, channel: Any,
                      data: dict[str, Any]) -> discord.Message:
        import discord

        state = client._connection  # noqa: SLF001 - how discord.py builds its own messages
        return discord.Message(state=state, channel=channel, data=data)  # type: ignore[arg-type]

    async def _take(self, message: discord.Message, *, live: bool) -> None:
        """One message: to the host (or answered, or skipped), then the cursor moves.
        Raises _Refused when the host's callback fails."""
        channel_id = message.channel.id
        if message.id <= self._cursors.get(channel_id, 0):
            return  # handed over already (caught up, then the gateway's copy)
        if live and channel_id in self._behind:
            return  # the next catch-up reads it, after the one refused
        try:
            await self._hand_over(message)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise _Refused(channel_id, message.id) from e
        self._cursors[channel_id] = message.id

    async def _hand_over(self, message: discord.Message) -> None:
        channel_id = message.channel.id
        if not (message.author.bot or (self.bot_id and message.author.id == self.bot_id)):
            if (message.content or "").strip().lower() == "/chatid":
                jid = f"dc:{await self._parent_of(message)}"
                await self.service_reply(jid, f"This channel is `{jid}`",
                                         reply_to=f"dc:{channel_id}:{message.id}")
            else:
                inbound = await self.parse_message(message)
                if inbound is not None:
                    await self.deliver_inbound(inbound)

    async def _parent_of(self, message: discord.Message) -> int:
        """The id of the channel `message` belongs to: a thread's parent, else its own."""
        import discord

        ch = message.channel
        cid = ch.id
        if cid in self._parents:
            return self._parents[cid]
        parent = getattr(ch, "parent_id", None)
        if parent is None and message.guild is not None and isinstance(
                ch, discord.PartialMessageable | discord.Object) and self._client is not None:
            with contextlib.suppress(discord.HTTPException):
                fetched = await self._client.fetch_channel(cid)
                if isinstance(fetched, discord.Thread):
                    parent = fetched.parent_id
        if isinstance(parent, int):
            self._parents[cid] = parent
            return parent
        return cid

    async def parse_message(self, message: discord.Message) -> InboundMessage | None:
        """A Discord message as an InboundMessage; None if it holds no text or file."""
        text = message.content or ""
        attachments = tuple(self._attachment(a) for a in message.attachments)
        if not text and not attachments:
            return None
        channel_id = message.channel.id
        parent = await self._parent_of(message)
        jid = f"dc:{parent}"
        self._last_where.pop(jid, None)  # the most recent last (what is saved is bounded)
        self._last_where[jid] = channel_id
        author = message.author
        name = getattr(author, "display_name", None) or author.name or str(author.id)
        addressed = self._addresses_bot(message)
        for u in message.mentions:  # "<@123>" reads as "@name" to the agent
            shown = (self.bot_name if u.id == self.bot_id and self.bot_name
                     else getattr(u, "display_name", None) or u.name)
            for token in (f"<@{u.id}>", f"<@!{u.id}>"):
                text = text.replace(token, f"@{shown}")
        text = text.strip()
        if addressed and self.trigger and not re.search(
                rf"(?<!\w){re.escape(self.trigger)}(?!\w)", text, re.IGNORECASE):
            text = f"{self.trigger} {text}".strip()
        ref = message.reference
        reply_to = (f"dc:{ref.channel_id}:{ref.message_id}"
                    if ref is not None and ref.message_id is not None else None)
        chat_name = getattr(message.channel, "name", None)
        if message.guild is not None and chat_name:
            chat_name = f"{message.guild.name} #{chat_name}"
        return InboundMessage(
            id=f"dc:{channel_id}:{message.id}", chat_jid=jid, sender=str(author.id),
            sender_name=name, content=text,
            timestamp=now_iso(message.created_at.astimezone(UTC)), chat_name=chat_name,
            is_group=message.guild is not None, channel=self.name, addressed=addressed,
            attachments=attachments, reply_to=reply_to)

    def _addresses_bot(self, message: discord.Message) -> bool:
        if self.bot_id is None:
            return False
        if any(u.id == self.bot_id for u in message.mentions):
            return True
        ref = message.reference
        resolved = ref.resolved if ref is not None else None
        author = getattr(resolved, "author", None)
        return author is not None and author.id == self.bot_id

    def _attachment(self, att: discord.Attachment) -> Attachment:
        url, size = att.url, att.size

        async def fetch(limit: int) -> bytes:
            return await self.download(url, size, limit)

        mime = att.content_type.split(";")[0] if att.content_type else None
        kind = "voice" if att.is_voice_message() else kind_for_mime(mime)
        return Attachment(kind=kind, name=att.filename, mime=mime, size=size, fetch=fetch)

    async def download(self, url: str, size: int | None, limit: int) -> bytes:
        """The attachment at `url`, at most `limit` bytes (ChannelError when larger)."""
        if size is not None and size > limit:
            raise ChannelError(f"it is {size} bytes, over the {limit} bytes a file may have "
                               "here")
        if self._session is None:
            raise ChannelError("the Discord channel is not connected")
        chunks: list[bytes] = []
        total = 0
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=120)) as r:
                if r.status != 200:
                    raise ChannelError(f"discord attachment download: HTTP {r.status}",
                                       code=r.status, permanent=r.status in (403, 404))
                async for chunk in r.content.iter_chunked(64 * 1024):
                    total += len(chunk)
                    if total > limit:
                        raise ChannelError(f"larger than the {limit} bytes a file may have "
                                           "here")
                    chunks.append(chunk)
        except TimeoutError:
            raise ChannelError("discord attachment download: no answer in time") from None
        except aiohttp.ClientError as e:
            raise ChannelError(f"discord attachment download: {type(e).__name__}") from None
        return b"".join(chunks)

    # ------------------------------------------------------------------ outbound
    def _channel_id(self, jid: str) -> int:
        m = JID_RE.match(jid)
        if not m:
            raise ChannelError(f"{jid!r} is not a Discord channel", permanent=True)
        return int(m.group(1))

    async def _target(self, jid: str, reply_to: str | None) -> tuple[int, int | None]:
        """(channel to send to, message to reply to): the thread `reply_to` was written in
        when it is one of `jid`'s (asked of Discord once when not known); without a
        `reply_to`, where the chat's last message was written (an answer goes back into the
        thread the question came from); else the channel itself."""
        channel_id = self._channel_id(jid)
        m = MESSAGE_ID_RE.match(reply_to or "")
        if not m:
            return self._last_where.get(jid, channel_id), None
        where, mid = int(m.group(1)), int(m.group(2))
        if where != channel_id and where not in self._parents and self._client is not None:
            import discord

            with contextlib.suppress(discord.HTTPException, aiohttp.ClientError, OSError):
                fetched = await self._client.fetch_channel(where)
                parent = getattr(fetched, "parent_id", None)
                self._parents[where] = parent if isinstance(parent, int) else where
        if where == channel_id or self._parents.get(where) == channel_id:
            return where, mid
        return channel_id, None

    def _api(self) -> discord.Client:
        if self._client is None or self._client.is_closed() or not self._running:
            raise ChannelError("the Discord channel is not connected")
        return self._client

    def _error(self, what: str, e: BaseException) -> ChannelError:
        """A discord.py or network failure as a ChannelError (token-free)."""
        import discord

        if isinstance(e, discord.RateLimited):
            return ChannelError(f"discord {what}: rate limited for {e.retry_after:.1f} s",
                                retry_after=float(e.retry_after), code=429)
        if isinstance(e, discord.HTTPException):
            status = e.status
            retry_after = None
            if status == 429:
                header = e.response.headers.get("Retry-After") if e.response else None
                with contextlib.suppress(TypeError, ValueError):
                    retry_after = float(header) if header else None
            # 400 (bad request, too long), 403 (no permission), 404 (channel or message
            # gone) do not heal by retrying; 401 may, once the token file is fixed.
            return ChannelError(self.redact(f"discord {what}: {status} {e.text or e}"),
                                code=status, retry_after=retry_after,
                                permanent=status in (400, 403, 404))
        if isinstance(e, aiohttp.ClientConnectionError):
            self._rest_lost()
        return ChannelError(self.redact(f"discord {what}: {type(e).__name__}: {e}"))

    def message_parts(self, text: str) -> list[str]:
        """The Markdown `text` as Discord messages of at most 2,000 characters."""
        return split_discord(to_discord(text), self.max_message_length)

    async def send_message(self, jid: str, text: str, *, reply_to: str | None = None,
                           sender: str | None = None) -> str | None:
        """Send the Markdown `text`, formatted and split; the last piece's id."""
        last = None
        for i, part in enumerate(self.message_parts(text)):
            last = await self.send_part(jid, part, reply_to=reply_to if i == 0 else None)
        return last

    async def send_part(self, jid: str, part: Any, *, reply_to: str | None = None,
                        sender: str | None = None) -> str | None:
        """Send one piece (Discord Markdown, at most 2,000 characters) into the channel, or
        into the thread `reply_to` was written in, as a reply to it."""
        import discord

        where, mid = await self._target(jid, reply_to)
        self._stop_typing(jid)
        client = self._api()
        target = client.get_partial_messageable(where)
        ref = (discord.MessageReference(message_id=mid, channel_id=where,
                                        fail_if_not_exists=False) if mid else None)
        try:
            sent = await target.send(str(part), reference=ref,  # type: ignore[arg-type]
                                     nonce=_nonce(jid, f"text\0{part}"))
        except Exception as e:  # noqa: BLE001 - mapped to a ChannelError
            raise self._error("send", e) from None
        return f"dc:{where}:{sent.id}"

    async def send_file(self, jid: str, path: Path, *, file_name: str | None = None,
                        caption: str | None = None) -> str | None:
        import io

        import discord

        self._channel_id(jid)
        where = self._last_where.get(jid, self._channel_id(jid))
        path = Path(path)
        content = await asyncio.to_thread(read_upload, path, MAX_UPLOAD_BYTES,
                                          "bots may upload at most")
        parts = self.message_parts(caption) if caption else []
        first = parts[0] if len(parts) == 1 else None  # a long caption follows as text
        self._stop_typing(jid)
        client = self._api()
        try:
            sent = await client.get_partial_messageable(where).send(
                first, file=discord.File(io.BytesIO(content), filename=file_name or path.name),
                nonce=_nonce(jid, f"file\0{file_name or path.name}\0{first or ''}"))
        except Exception as e:  # noqa: BLE001 - mapped to a ChannelError
            raise self._error("file upload", e) from None
        if caption and first is None:
            for part in parts:
                await self.send_part(jid, part)
        return f"dc:{where}:{sent.id}"

    async def react(self, jid: str, message_id: str, emoji: str) -> None:
        self._channel_id(jid)
        m = MESSAGE_ID_RE.match(message_id)
        if not m:
            raise ChannelError(f"message id {message_id!r} is not a Discord message",
                               permanent=True)
        client = self._api()
        msg = client.get_partial_messageable(int(m.group(1))).get_partial_message(
            int(m.group(2)))
        try:
            await msg.add_reaction(emoji)
        except Exception as e:  # noqa: BLE001 - mapped to a ChannelError
            raise self._error("reaction", e) from None

    def _stop_typing(self, jid: str) -> None:
        t = self._typing.pop(jid, None)
        if t is not None:
            t.cancel()

    async def set_typing(self, jid: str, typing: bool) -> None:
        if not JID_RE.match(jid):
            return
        self._stop_typing(jid)
        if typing and self._running:
            self._typing[jid] = asyncio.create_task(self._typing_loop(jid),
                                                    name=f"discord-typing-{jid}")

    async def _typing_loop(self, jid: str) -> None:
        where = self._last_where.get(jid, self._channel_id(jid))
        loop = asyncio.get_running_loop()
        until = loop.time() + TYPING_MAX_SECONDS
        try:
            while loop.time() < until:
                try:
                    await self._api().http.send_typing(where)
                except Exception as e:  # noqa: BLE001 - typing is a hint
                    log.debug("discord typing: %s", self.redact(str(e)))
                await asyncio.sleep(TYPING_REPEAT_SECONDS)
        finally:
            if self._typing.get(jid) is asyncio.current_task():
                self._typing.pop(jid, None)
