"""`mdclaw whatsapp link`: pair mdclaw with a WhatsApp account (scan a QR code, or type a
pairing code into the phone). The link state `status` and `doctor` print is
mdclaw.ops.whatsapp."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import Any, TextIO

import segno

from mdclaw.config import ExtraMissing, require_extra
from mdclaw.ops.console import fail, load_or_exit
from mdclaw.ops.status import daemon_running


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("whatsapp", parents=[common], help="the WhatsApp channel")
    wsub = p.add_subparsers(dest="whatsapp_command", required=True)
    link = wsub.add_parser("link", parents=[common],
                           help="pair with a WhatsApp account: show a QR code to scan with "
                                "the phone (Settings → Linked devices → Link a device)")
    link.add_argument("--phone", metavar="NUMBER", default=None,
                      help="instead of a QR code, get a pairing code for this phone number "
                           "(with country code, e.g. +491701234567) to type into the phone")
    link.add_argument("--timeout", type=float, default=300, metavar="SECONDS",
                      help="give up after this long (default 300)")
    link.set_defaults(func=cmd_link)


def print_qr(code: str, out: TextIO = sys.stdout) -> None:
    """`code` as a QR code drawn in the terminal (segno), with how to scan it."""
    print("\nScan with WhatsApp on your phone: Settings → Linked devices → Link a device",
          file=out)
    segno.make_qr(code, error="l").terminal(out=out, compact=True)
    print("(a new code follows every 20 seconds or so until one is scanned)", file=out,
          flush=True)


async def run_link(channel: Any, *, phone: str | None, timeout: float,
                   out: TextIO = sys.stdout,
                   show_qr: Callable[[str, TextIO], None] = print_qr) -> int:
    """Run `channel` in the foreground until it is linked (0) or `timeout` passes (1)."""
    # Imported here (and in cmd_link) for the CLI's start-up: the channel modules bring in
    # the chat formatter (markdown-it, nh3: ~60 ms on every command).
    from mdclaw.channels.base import ChannelError
    from mdclaw.channels.whatsapp import LINKED

    asked_code = False

    def on_qr(code: str) -> None:
        nonlocal asked_code
        if phone is None:
            show_qr(code, out)
        elif not asked_code:  # the session is up and not linked: a code can be asked now
            asked_code = True
            asyncio.ensure_future(pair(phone))

    async def pair(number: str) -> None:
        try:
            code = await channel.pair_code(number)
        except ChannelError as e:
            print(f"mdclaw: {e}", file=out, flush=True)
            return
        print(f"\nOn the phone: WhatsApp → Settings → Linked devices → Link a device → "
              f"Link with phone number instead, and enter: {code}", file=out, flush=True)

    channel.on_qr = on_qr
    if channel.pairing.link_state == LINKED:
        print(f"already linked ({channel.pairing.jid}); to link another account, remove "
              f"this device in the phone first", file=out)
        return 0
    await channel.connect()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while channel.pairing.state != LINKED:
            left = deadline - loop.time()
            if left <= 0:
                print("mdclaw: not linked in time; run `mdclaw whatsapp link` again",
                      file=out)
                return 1
            channel.pairing.changed.clear()
            try:
                await asyncio.wait_for(channel.pairing.changed.wait(), left)
            except TimeoutError:
                continue
        print(f"linked to {channel.pairing.jid}; start (or restart) the daemon to use it",
              file=out)
        return 0
    finally:
        await channel.disconnect()


def cmd_link(args: argparse.Namespace) -> int:
    cfg = load_or_exit(args)
    wa = cfg.channels.whatsapp
    if wa is None:
        fail("WhatsApp is not configured: add `channels: {whatsapp: {enabled: true}}` to the "
             "config first")
    try:
        require_extra("whatsapp", "channels.whatsapp")
    except ExtraMissing as e:
        fail(str(e))
    if daemon_running(cfg):
        fail("the daemon is running and holds the WhatsApp session: stop it first (or scan "
             "the code on the operator page)")
    from mdclaw.channels.base import ChannelError
    from mdclaw.channels.whatsapp import LINKED, WhatsAppChannel, link_state

    state, account = link_state(cfg.whatsapp_session_path)
    if state == LINKED:
        print(f"already linked ({account}); to link another account, remove this device "
              "on the phone (Settings → Linked devices), then run this again")
        return 0
    try:
        channel = WhatsAppChannel.from_config(wa, cfg.whatsapp_session_path)
        return asyncio.run(run_link(channel, phone=args.phone, timeout=args.timeout))
    except ChannelError as e:
        fail(str(e))
