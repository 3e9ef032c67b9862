"""The Matrix channel as `status` and `doctor` describe it: its login from the files alone
(`matrix_status`), and the homeserver's word on the token and on the rooms of the configured
groups (`matrix_checks`, for doctor)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import aiohttp

from mdclaw.config import Config, read_secret
from mdclaw.config.extras import EXTRAS, unavailable

ENCRYPTED_FIX = ("create a room with encryption off (it cannot be turned off later), invite "
                 "{bot} to it and put its mx: id as groups.{folder}.jid (mdclaw does not take "
                 "part in end-to-end encrypted rooms: docs/channels.md)")


def matrix_status(cfg: Config) -> dict[str, Any] | None:
    """{account, homeserver, login, device, session, fix} of the configured Matrix channel
    (None when it is not enabled), from the config and the stored login alone."""
    mx = cfg.channels.matrix
    if mx is None or not mx.enabled:
        return None
    # Imported here for the CLI's start-up (the channel brings in the formatter), and only by
    # an install with Matrix.
    from mdclaw.channels.matrix import read_session, session_path

    path = session_path(cfg.data_dir)
    out: dict[str, Any] = {"account": mx.user_id, "homeserver": mx.homeserver, "device": None,
                           "session": None, "fix": None}
    if mx.access_token_file is not None:
        out["login"] = "access token file"
        return out
    out["session"] = str(path)
    stored = read_session(path)
    if stored and stored.get("user_id") == mx.user_id:
        out["login"] = "logged in"
        out["device"] = stored.get("device_id")
    else:
        out["login"] = "not logged in"
        out["fix"] = ("start the daemon: it logs in once with channels.matrix.password_file "
                      f"and keeps the token in {path}")
    return out


def _token(cfg: Config) -> str | None:
    mx = cfg.channels.matrix
    assert mx is not None
    if mx.access_token_file is not None:
        try:
            return read_secret(mx.access_token_file) or None
        except OSError:
            return None  # the secret file check says so
    from mdclaw.channels.matrix import read_session, session_path

    stored = read_session(session_path(cfg.data_dir))
    return stored["access_token"] if stored and stored.get("user_id") == mx.user_id else None


async def matrix_checks(cfg: Config) -> list[tuple[str, str, str, str]]:
    """doctor's Matrix checks as (check, level, detail, fix) when matrix-nio is installed: the
    token accepted, and each group's room one the bot is in and not end-to-end encrypted."""
    mx = cfg.channels.matrix
    if mx is None or not mx.enabled:
        return []
    out: list[tuple[str, str, str, str]] = []
    if unavailable(EXTRAS["matrix"]):
        return out  # doctor's check of the extras names it, with the fix
    token = _token(cfg)
    if token is None:
        status = matrix_status(cfg) or {}
        if status.get("login") == "not logged in":
            out.append(("matrix", "warn", f"{mx.user_id} has not logged in yet",
                        status.get("fix") or ""))
        return out
    base = mx.homeserver.rstrip("/")
    headers = {"Authorization": f"Bearer {token}"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                         headers=headers) as session:
            async with session.get(f"{base}/_matrix/client/v3/account/whoami") as r:
                body = await r.json(content_type=None)
                status_code = r.status
            if status_code != 200 or not isinstance(body, dict):
                why = body.get("errcode") if isinstance(body, dict) else status_code
                key = ("access_token_file" if mx.access_token_file is not None
                       else "password_file")
                out.append(("matrix", "fail", f"the homeserver refused the bot's access token "
                            f"({why})", f"put a valid access token of {mx.user_id} into "
                            f"channels.matrix.{key}" if key == "access_token_file" else
                            "delete the stored session (data_dir/matrix/session.json) and "
                            "restart: the daemon logs in again with channels.matrix."
                            "password_file"))
                return out
            if body.get("user_id") != mx.user_id:
                out.append(("matrix", "fail", f"the access token is {body.get('user_id')}'s, "
                            f"not {mx.user_id}'s", "set channels.matrix.user_id to the "
                            "token's account, or use a token of that account"))
                return out
            out.append(("matrix", "ok", f"the access token is accepted ({mx.user_id}, device "
                        f"{body.get('device_id') or '?'})", ""))
            async with session.get(f"{base}/_matrix/client/v3/joined_rooms") as r:
                joined = (await r.json(content_type=None) or {}).get("joined_rooms") or []
            for folder, g in cfg.groups.items():
                for jid in g.all_chats:
                    if not jid.startswith("mx:"):
                        continue
                    room = jid[3:]
                    name = f"matrix room {folder}"
                    url = (f"{base}/_matrix/client/v3/rooms/{quote(room, safe='')}/state/"
                           "m.room.encryption")
                    async with session.get(url) as r:
                        encrypted = r.status == 200
                    if encrypted:
                        out.append((name, "fail", f"{jid} is end-to-end encrypted; the bot "
                                    "does not take part (it told the room and left)",
                                    ENCRYPTED_FIX.format(bot=mx.user_id, folder=folder)))
                    elif room not in joined:
                        out.append((name, "fail", f"{mx.user_id} is not in {jid}",
                                    f"invite {mx.user_id} to the room from an account listed "
                                    "in channels.matrix.allow_invites_from"))
                    else:
                        out.append((name, "ok", f"{mx.user_id} is in {jid} (not encrypted)",
                                    ""))
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        text = f"{type(e).__name__}: {e}".replace(token, "***")
        out.append(("matrix", "warn", f"the homeserver {base} did not answer: {text[:200]}",
                    "check the network and channels.matrix.homeserver; mdclaw keeps trying"))
    return out
