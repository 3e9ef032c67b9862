"""Make the channels the config enables, and start them together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, cast

from mdclaw.channels.base import Channel, ChannelError, InboundCallback
from mdclaw.channels.discord import DiscordChannel  # imports discord.py only when it connects
from mdclaw.channels.email import EmailChannel  # imports imapclient only when it connects
from mdclaw.channels.http import HttpChannel
from mdclaw.channels.matrix import MatrixChannel  # imports matrix-nio only when it connects
from mdclaw.channels.slack import SlackChannel  # imports slack-bolt only when it connects
from mdclaw.channels.telegram import TelegramChannel
from mdclaw.channels.webpush import WebPush  # imports pywebpush only when it pushes
from mdclaw.channels.webpush import available as push_available
from mdclaw.channels.whatsapp import WhatsAppChannel  # imports neonize only when it connects
from mdclaw.config import Config
from mdclaw.people import identities_on, mail_senders
from mdclaw.state import Database
from mdclaw.webserver import WebServer

log = logging.getLogger("mdclaw.channels")


def build_channels(cfg: Config, db: Database, server: WebServer | None = None,
                   on_inbound: InboundCallback | None = None) -> list[Channel]:
    """The enabled channels of `cfg`, not yet connected (local HTTP first). The local HTTP
    chat adds its routes to the daemon's web server `server` (it must not be listening yet;
    None: there is none, and the chat does not run).

    Raises ChannelError if a channel's secret file cannot be read (the message names the
    file, never its content).
    """
    channels: list[Channel] = []
    http = cfg.channels.http
    if http is not None and http.enabled:
        if server is None:
            log.error("the local HTTP chat is enabled but there is no web server (server: "
                      "null): it does not run")
        else:
            push = None
            if http.push.enabled and push_available():
                push = WebPush(cfg.data_dir / "http", contact=http.push.contact,
                               include_text=http.push.include_text)
            elif http.push.enabled:
                log.warning("the web chat's notifications need pywebpush (pip install "
                            "'mdclaw[push]'); the page offers none")
            channels.append(HttpChannel(
                db, server, assistant_name=cfg.assistant.name, on_inbound=on_inbound,
                max_upload_bytes=cfg.media.limit, files_dir=cfg.data_dir / "http" / "files",
                push=push))
    tg = cfg.channels.telegram
    if tg is not None and tg.enabled:
        channels.append(TelegramChannel.from_config(tg, on_inbound=on_inbound,
                                                    trigger=f"@{cfg.assistant.name}", db=db))
    dc = cfg.channels.discord
    if dc is not None and dc.enabled:
        channels.append(DiscordChannel.from_config(dc, on_inbound=on_inbound,
                                                   trigger=f"@{cfg.assistant.name}", db=db))
    wa = cfg.channels.whatsapp
    if wa is not None and wa.enabled:
        channels.append(WhatsAppChannel.from_config(
            wa, cfg.whatsapp_session_path, on_inbound=on_inbound,
            trigger=f"@{cfg.assistant.name}", db=db))
    em = cfg.channels.email
    if em is not None and em.enabled:
        channels.append(EmailChannel.from_config(
            em, on_inbound=on_inbound, db=db, display_name=cfg.assistant.name,
            trigger=f"@{cfg.assistant.name}", max_mail_bytes=max_mail_bytes(cfg),
            is_allowed=mail_allowed(cfg)))
    sl = cfg.channels.slack
    if sl is not None and sl.enabled:
        channels.append(SlackChannel.from_config(sl, on_inbound=on_inbound,
                                                 trigger=f"@{cfg.assistant.name}", db=db))
    mx = cfg.channels.matrix
    if mx is not None and mx.enabled:
        channels.append(MatrixChannel.from_config(
            mx, cfg.data_dir, invite_allowed=matrix_inviters(cfg), on_inbound=on_inbound,
            trigger=f"@{cfg.assistant.name}", db=db))
    return channels


def max_mail_bytes(cfg: Config) -> int:
    """The largest mail the email channel reads whole: room for a few files of
    `media.max_bytes` (base64 makes each a third larger); of a larger one only the header is
    read, and the agent is told."""
    return max(10 * 1024 * 1024, 4 * cfg.media.limit)


def matrix_inviters(cfg: Config) -> Callable[[str], bool]:
    """Whose invites the Matrix bot accepts: the user ids of channels.matrix.allow_invites_from,
    and the Matrix identities of the config's people."""
    allowed = set(cfg.channels.matrix.allow_invites_from if cfg.channels.matrix else ())
    allowed.update(identities_on(cfg, MatrixChannel.name))
    return frozenset(allowed).__contains__


def mail_allowed(cfg: Config) -> Callable[[str], bool]:
    """The email channel's "may this address write?" (mdclaw.people.mail_senders)."""
    allowed = mail_senders(cfg)
    return lambda address: address.lower() in allowed


def apply_config(channels: Iterable[Channel], cfg: Config) -> None:
    """What the channels take from outside their own section, from `cfg` (a config reload;
    the `channels` section itself needs a restart): the assistant's name and trigger, and the
    largest file the local chat takes."""
    for ch in channels:
        if isinstance(ch, HttpChannel):
            ch.assistant_name = cfg.assistant.name
            ch.max_upload_bytes = cfg.media.limit
        elif hasattr(ch, "trigger"):  # Telegram, WhatsApp (whose module is optional), email,
            # Slack, Discord, Matrix
            cast(Any, ch).trigger = f"@{cfg.assistant.name}"


async def connect_all(channels: Iterable[Channel]) -> dict[str, str]:
    """Connect every channel; return {channel name: reason} for those that could not start
    (they are logged; the others run)."""
    problems: dict[str, str] = {}
    for ch in channels:
        try:
            await ch.connect()
        except ChannelError as e:
            problems[ch.name] = ch.redact(str(e))
            log.error("channel %s did not start: %s", ch.name, problems[ch.name])
    return problems


async def disconnect_all(channels: Iterable[Channel]) -> None:
    """Disconnect every channel; errors are logged, never raised."""
    for ch in channels:
        try:
            await ch.disconnect()
        except Exception as e:  # noqa: BLE001 - shutting down: the other channels still stop
            # No traceback: it could hold the channel's token; the message is redacted.
            log.warning("channel %s did not stop cleanly: %s", ch.name,
                        ch.redact(f"{type(e).__name__}: {e}"))
