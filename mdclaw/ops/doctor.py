"""`mdclaw doctor`'s checks: is everything there for the assistant to answer? Each check is
{check, level: ok|warn|fail, detail, fix}; the command prints them and picks the exit status
(mdclaw/commands/status.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import tempfile
from datetime import datetime
from typing import Any

import aiohttp

from mdclaw.config import (
    Config,
    ConfigError,
    ServiceCredential,
    format_size,
    in_service_credentials,
    iter_secret_files,
    load_config,
    missing_extras,
    read_secret,
    secret_file_issues,
)
from mdclaw.diskguard import GROUP_FULL, OK, TOO_MANY_FILES, UNREADABLE
from mdclaw.failures import redact, server_name
from mdclaw.integrations.ha_screenshot import ScreenshotError, find_chromium
from mdclaw.integrations.home_assistant import probe
from mdclaw.models import Upstream, model_for_group, probe_upstream
from mdclaw.ops.database import READ_TIMEOUT, database_line
from mdclaw.ops.email import email_checks
from mdclaw.ops.health import FAILED_TURNS_WINDOW, failed_turn_groups, find_problems
from mdclaw.ops.matrix import matrix_checks, matrix_status
from mdclaw.ops.status import backup_summary, daemon_running, disk_status
from mdclaw.ops.whatsapp import whatsapp_status
from mdclaw.runtime import create_runtime, engine_errors
from mdclaw.schedule import get_zone, to_iso, utc_now
from mdclaw.senders import jid_is_group_chat, main_group_warning
from mdclaw.state import Database, DatabaseError, inspect_database
from mdclaw.state.failed_turns import failures_per_group, list_failed_turns


def _check(results: list[dict[str, str]], name: str, level: str, detail: str,
           fix: str = "") -> None:
    results.append({"check": name, "level": level, "detail": detail, "fix": fix})


def run_checks(config_path: str | None) -> list[dict[str, str]]:
    """Every doctor check as {check, level: ok|warn|fail, detail, fix}: is everything there
    for the assistant to answer?"""
    results: list[dict[str, str]] = []
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        _check(results, "config", "fail", str(e).splitlines()[0],
               "run `mdclaw check-config` for every error and fix the file")
        return results
    _check(results, "config", "ok", f"{len(cfg.groups)} group(s), main: {cfg.main_folder}")
    db_ready = _check_database(results, cfg)
    _check_main_senders(results, cfg, db_ready)
    # data dir (checked, never created here)
    target = cfg.data_dir
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".mdclaw-doctor-"):
            pass
        detail = (f"{cfg.data_dir} is writable" if target == cfg.data_dir
                  else f"{cfg.data_dir} does not exist yet; {target} lets this user create it")
        _check(results, "data_dir", "ok", detail)
    except OSError as e:
        _check(results, "data_dir", "fail", f"{target}: {e.strerror or e}",
               f"create {cfg.data_dir} and give this user write access to it")
    used = _check_models(results, cfg)
    # engine and image
    try:
        rt = create_runtime(cfg.runtime)
        desc = rt.ping()
        _check(results, "engine", "ok", desc)
        try:
            info = rt.image_info(cfg.runtime.image)
        except engine_errors() as e:
            _check(results, "image", "fail", f"{cfg.runtime.image}: {e}",
                   "run `mdclaw image build`")
        else:
            if info is not None:
                _check(results, "image", "ok", f"{cfg.runtime.image} is present")
                _check_backends(results, cfg, info.backends, used)
            else:
                _check(results, "image", "fail", f"{cfg.runtime.image} is not present",
                       "run `mdclaw image build` (or `mdclaw image load` with the flake's "
                       "container-image)")
    except engine_errors() as e:
        _check(results, "engine", "fail", f"container engine not reachable: {e}",
               "start Docker or `podman system service`, or set runtime.socket / DOCKER_HOST")
        _check(results, "image", "warn", "not checked: no engine")
    _disk_checks(results, cfg)
    b = backup_summary(cfg)
    _check(results, "backup", b["level"], b["detail"],
           "see why the backup fails: systemctl status mdclaw-backup (journalctl -u "
           "mdclaw-backup), or run `mdclaw backup`" if b["level"] != "ok" else "")
    # secret files (models, channels, integrations...): the config's check, then a read
    problems = {i.path: i.message for i in secret_file_issues(cfg)}
    for key, path in iter_secret_files(cfg):
        if key in problems:
            _check(results, key, "fail", problems[key],
                   f"make {path} a file readable by this user (and by no one else)")
            continue
        try:
            if read_secret(path):
                _check(results, key, "ok", f"{path} is readable")
            else:
                _check(results, key, "fail", f"{path} is empty", f"write the secret into {path}")
        except ServiceCredential:
            _check(results, key, "warn", f"{path}: set in the service's credentials "
                   "(readable only inside the mdclaw service)",
                   "run `sudo mdclaw doctor` to check it as the service does")
        except OSError as e:
            _check(results, key, "fail", f"{path}: {e.strerror or e}",
                   f"make {path} readable by this user (and by no one else)")
    asyncio.run(_check_endpoints(results, cfg, used))
    _check_http_port(results, cfg)
    missing = _check_extras(results, cfg)
    if "whatsapp" not in missing:
        _check_whatsapp(results, cfg)
    _check_chromium(results, cfg)
    _check_mcp(results, cfg)
    if db_ready:
        _check_failures(results, cfg)
        _check_health(results, cfg)
    # clock and timezone
    now = utc_now()
    if now.year < 2024:
        _check(results, "clock", "fail", f"system clock says {to_iso(now)}",
               "enable time sync (systemd-timesyncd or chrony)")
    else:
        local = datetime.now(get_zone(cfg.assistant.timezone))
        _check(results, "clock", "ok", f"{to_iso(now)}; {cfg.assistant.timezone} is "
               f"{local.strftime('%Y-%m-%d %H:%M %Z')}")
    return results


def _check_database(results: list[dict[str, str]], cfg: Config) -> bool:
    """The database's state (read-only; see mdclaw/commands/common.py); True when ready.
    The check carries `state`, and `mdclaw doctor` exits with its status when not ready."""
    info = inspect_database(cfg.db_path)
    level = {"ready": "ok", "newer": "fail", "unreadable": "fail"}.get(info.state, "warn")
    fix = {"newer": "upgrade mdclaw, or restore a backup made by this version",
           "locked": "try again in a moment; see which process holds state.db (fuser)",
           "unreadable": f"make {cfg.db_path} readable by this user, or restore a backup",
           "ready": ""}.get(info.state, "start the daemon or run `mdclaw reconcile`")
    _check(results, "database", level, database_line(info, cfg.db_path), fix)
    results[-1]["state"] = info.state
    return info.state == "ready"


def known_group_chat(cfg: Config, jid: str) -> bool | None:
    """What the `chats` table of the (ready) database says about `jid` (channels set
    is_group as messages arrive): None when the chat is not known yet, or on a lock."""
    try:
        with Database(cfg.db_path, readonly=True, timeout=READ_TIMEOUT) as db:
            r = db.query_one("SELECT is_group FROM chats WHERE jid = ?", (jid,))
    except sqlite3.Error:
        return None
    return None if r is None else bool(r[0])


def _check_main_senders(results: list[dict[str, str]], cfg: Config, db_ready: bool) -> None:
    """Warn when every member of a group chat can drive the main group's agent."""
    folder = cfg.main_folder
    if folder is None:
        return
    g = cfg.groups[folder]
    # The main group's chats, each checked; the first that is a group chat warns.
    group_chat: bool | None = False
    warning = None
    for chat in g.all_chats:
        known = known_group_chat(cfg, chat) if db_ready else None
        is_group = known if known is not None else jid_is_group_chat(chat)
        source = "the chats table" if known is not None else "its jid"
        if is_group is not False:
            group_chat = is_group if group_chat is False else group_chat
        warning = main_group_warning(folder, chat, group_chat=is_group,
                                     policy_set=g.allow_senders is not None, source=source)
        if warning:
            break
    if warning:
        _check(results, "main_senders", "warn", warning,
               f"add allow_senders to groups.{folder} in the config")
    elif g.allow_senders is not None:
        others = "kept as context" if g.allow_senders.mode == "trigger" else "dropped"
        _check(results, "main_senders", "ok", f"main group: {len(g.allow_senders.ids)} "
               f"allowed sender id(s); messages of others are {others}")
    else:
        kind = "a private chat" if group_chat is False else "not known to be a group chat"
        _check(results, "main_senders", "ok",
               f"main group {', '.join(g.all_chats)} is {kind}")


def _disk_checks(results: list[dict[str, str]], cfg: Config) -> None:
    """Free space on data_dir's disk and every group's files against its limits."""
    disk = disk_status(cfg)
    if disk["free"] is None:
        _check(results, "disk", "warn", f"cannot read the free space of {cfg.data_dir}")
    elif not disk["host_ok"]:
        _check(results, "disk", "fail",
               f"{format_size(disk['free'])} free, below limits.min_free_disk "
               f"({format_size(disk['floor'])}): no container runs",
               "free space on the disk holding data_dir (or lower limits.min_free_disk)")
    else:
        low = disk["free"] < 2 * disk["floor"]
        _check(results, "disk", "warn" if low else "ok",
               f"{format_size(disk['free'])} free of {format_size(disk['total'])}; runs stop "
               f"below {format_size(disk['floor'])}",
               "free space on the disk holding data_dir" if low else "")
    for folder, v in disk["groups"].items():
        name = f"disk {folder}"
        if v["state"] == "host_full":
            continue  # said once above
        if v["state"] != OK:
            where = f"{cfg.data_dir}/groups/{folder} (or ipc/{folder}, sessions/{folder})"
            fix = {
                GROUP_FULL: f"delete files in {where}, or raise groups.{folder}.disk",
                TOO_MANY_FILES: f"delete files in {where}, or raise limits.disk_files",
                UNREADABLE: f"make {cfg.data_dir}/{v['unreadable']} readable by mdclaw's "
                            "user (chmod), or delete it",
            }.get(v["state"], "")
            _check(results, name, "fail", v["summary"], fix)
        elif v["limit"] and v["used"] > 0.9 * v["limit"]:
            _check(results, name, "warn", v["summary"] + " (over 90% of its limit)",
                   f"delete files in {cfg.data_dir}/groups/{folder} or raise "
                   f"groups.{folder}.disk")
        else:
            _check(results, name, "ok", v["summary"])


def _check_models(results: list[dict[str, str]], cfg: Config) -> dict[str, list[str]]:
    """A model resolves for every group; returns {model key: [groups using it]}."""

    used: dict[str, list[str]] = {}
    missing = []
    for folder in cfg.groups:
        key, spec = model_for_group(cfg, folder)
        if spec is None or key is None:
            missing.append(folder)
        else:
            used.setdefault(key, []).append(folder)
    if missing:
        why = ("no `models:` entry" if not cfg.models else
               f"{len(cfg.models)} models and no assistant.model")
        _check(results, "models", "fail",
               f"no model for group(s) {', '.join(missing)} ({why}); they get a "
               "configuration answer instead of a reply",
               "add a `models:` entry (backend: openai with a base_url, or claude with an "
               "api_key_file) and set `assistant.model` — see docs/configuration.md")
    elif cfg.groups:
        _check(results, "models", "ok", "; ".join(
            f"{k} ({cfg.models[k].backend}) for {', '.join(g)}" for k, g in used.items()))
    return used


def _check_backends(results: list[dict[str, str]], cfg: Config,
                    backends: tuple[str, ...] | None, used: dict[str, list[str]]) -> None:
    """The image carries the backend every group needs (its mdclaw.backends label)."""
    needed: dict[str, list[str]] = {}
    for key, groups in used.items():
        needed.setdefault(cfg.models[key].backend, []).extend(groups)
    if not needed:
        return
    if backends is None:
        _check(results, "image backends", "warn",
               f"{cfg.runtime.image} has no mdclaw.backends label, so which backends it "
               f"carries is not known (needed: {', '.join(sorted(needed))})",
               "rebuild it with `mdclaw image build`, which writes the label")
        return
    lacking = {b: g for b, g in needed.items() if b not in backends}
    if lacking:
        _check(results, "image backends", "fail", "; ".join(
            f"the {b} backend (groups {', '.join(g)}) is not in {cfg.runtime.image} "
            f"(it has {', '.join(backends) or 'none'})" for b, g in lacking.items()),
               "for claude: `container/build-wheelhouse.sh --claude`, then `mdclaw image "
               "build`; or give those groups an openai model")
    else:
        _check(results, "image backends", "ok",
               f"{', '.join(backends)} (needed: {', '.join(sorted(needed))})")


async def _check_endpoints(results: list[dict[str, str]], cfg: Config,
                           used: dict[str, list[str]]) -> None:
    """Each model in use answers GET /v1/models the way the credential proxy reaches it;
    Telegram's getMe accepts the bot token; Slack's auth.test the bot token and
    apps.connections.open the app token; Home Assistant's GET /api/ accepts its token; the
    email channel's IMAP and SMTP servers take its TLS and its login; the Matrix homeserver
    accepts the bot's token, and each group's room is one it is in and not encrypted."""

    async def one(key: str) -> None:
        up = Upstream.from_spec(cfg.models[key])
        name = f"model {key}"
        if up.api_key_file is not None and in_service_credentials(up.api_key_file):
            _check(results, name, "warn", "not asked: its key is set in the service's "
                   "credentials", "run `sudo mdclaw doctor` to ask it with the service's key")
            return
        status, detail = await probe_upstream(up)
        where = f"{server_name(up.base_url)} ({up.base_url})"
        if status is None:
            _check(results, name, "fail", f"{where} does not answer: {redact(detail)}",
                   f"start the model server, or fix models.{key}.base_url")
        elif status in (401, 403):
            _check(results, name, "fail", f"{where} refused the key (HTTP {status})",
                   f"put a valid key into models.{key}.api_key_file")
        elif status < 400:
            _check(results, name, "ok", f"{where} answers (HTTP {status})")
        else:
            _check(results, name, "warn", f"{where} answers HTTP {status} to GET /v1/models: "
                   f"{redact(detail)[:120]}",
                   "check that base_url points at the API root (…/v1 for OpenAI-compatible "
                   "servers)")

    async def telegram() -> None:
        tg = cfg.channels.telegram
        if tg is None or not tg.enabled:
            return
        try:
            token = read_secret(tg.token_file)
        except OSError:
            return  # the secret file check says so
        if not token:
            return
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                             trust_env=True) as session:
                async with session.post(f"{tg.api_base.rstrip('/')}/bot{token}/getMe") as r:
                    body = await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            # Network trouble of any kind (a bad api_base too); ValueError: not JSON.
            text = f"{type(e).__name__}: {e}".replace(token, "***")
            _check(results, "telegram", "warn", f"Telegram did not answer: {text[:200]}",
                   "check the network (or channels.telegram.api_base); mdclaw keeps trying")
            return
        if isinstance(body, dict) and body.get("ok"):
            user = (body.get("result") or {}).get("username", "?")
            _check(results, "telegram", "ok", f"the bot token is accepted (@{user})")
        else:
            desc = body.get("description") if isinstance(body, dict) else None
            _check(results, "telegram", "fail",
                   f"Telegram rejected the bot token ({desc or r.status})",
                   "put the token @BotFather gave you into channels.telegram.token_file")

    async def discord() -> None:
        dc = cfg.channels.discord
        if dc is None or not dc.enabled:
            return
        try:
            token = read_secret(dc.token_file)
        except OSError:
            return  # the secret file check says so
        if not token:
            return
        level, detail, fix = await probe_discord(dc.api_base, token)
        _check(results, "discord", level, detail, fix)

    async def slack() -> None:
        sl = cfg.channels.slack
        if sl is None or not sl.enabled:
            return
        try:
            bot, app = read_secret(sl.bot_token_file), read_secret(sl.app_token_file)
        except OSError:
            return  # the secret file check says so
        if not bot or not app:
            return
        base = sl.api_base.rstrip("/")
        answers: dict[str, Any] = {}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                             trust_env=True) as session:
                for method, token in (("auth.test", bot), ("apps.connections.open", app)):
                    async with session.post(f"{base}/{method}",
                                            headers={"Authorization": f"Bearer {token}"}) as r:
                        answers[method] = await r.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            text = f"{type(e).__name__}: {e}".replace(bot, "***").replace(app, "***")
            _check(results, "slack", "warn", f"Slack did not answer: {text[:200]}",
                   "check the network (or channels.slack.api_base); mdclaw keeps trying")
            return
        me, sock = answers["auth.test"], answers["apps.connections.open"]
        if not (isinstance(me, dict) and me.get("ok")):
            err = me.get("error") if isinstance(me, dict) else None
            _check(results, "slack", "fail", f"Slack rejected the bot token ({err or '?'})",
                   "put the app's Bot User OAuth Token (xoxb-…, OAuth & Permissions) into "
                   "channels.slack.bot_token_file")
        elif not (isinstance(sock, dict) and sock.get("ok")):
            err = sock.get("error") if isinstance(sock, dict) else None
            _check(results, "slack", "fail",
                   f"Slack refused to open Socket Mode with the app token ({err or '?'})",
                   "turn on Socket Mode for the app and put an app-level token (xapp-…, scope "
                   "connections:write; Basic Information → App-Level Tokens) into "
                   "channels.slack.app_token_file")
        else:
            _check(results, "slack", "ok", f"the tokens are accepted (@{me.get('user', '?')} "
                   f"in {me.get('team', '?')}; Socket Mode opens)")

    async def home_assistant() -> None:
        ha = cfg.integrations.home_assistant
        if ha is None:
            return
        level, detail, fix = await probe(ha)
        _check(results, "home assistant", level, detail, fix)

    async def email() -> None:
        for check in await email_checks(cfg):
            _check(results, *check)

    async def matrix() -> None:
        for name, level, detail, fix in await matrix_checks(cfg):
            _check(results, name, level, detail, fix)
        mx = matrix_status(cfg)
        if mx and mx.get("session"):
            _private_file(results, "matrix_session", mx["session"], "the bot's access token")

    await asyncio.gather(*(one(k) for k in used), telegram(), slack(), discord(),
                         home_assistant(), email(), matrix())


#: The application flags saying the Message Content Intent is on (GATEWAY_MESSAGE_CONTENT,
#: and _LIMITED for a bot in fewer than 100 servers).
DISCORD_MESSAGE_CONTENT = (1 << 18) | (1 << 19)
DISCORD_PORTAL = "https://discord.com/developers/applications"


async def probe_discord(api_base: str, token: str) -> tuple[str, str, str]:
    """(level, detail, fix) of the Discord bot: GET /users/@me accepts the token, and the
    application has the Message Content Intent (without it every message arrives empty)."""
    base = api_base.rstrip("/")
    headers = {"Authorization": f"Bot {token}"}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10),
                                         trust_env=True, headers=headers) as session:
            async with session.get(f"{base}/users/@me") as r:
                me = await r.json(content_type=None) if r.status == 200 else None
                status = r.status
            app = None
            if me is not None:
                async with session.get(f"{base}/oauth2/applications/@me") as r:
                    app = await r.json(content_type=None) if r.status == 200 else None
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        text = f"{type(e).__name__}: {e}".replace(token, "***")
        return ("warn", f"Discord did not answer: {text[:200]}",
                "check the network (or channels.discord.api_base); mdclaw keeps trying")
    if not isinstance(me, dict):
        return ("fail", f"Discord rejected the bot token (HTTP {status})",
                f"put the bot's token ({DISCORD_PORTAL} → your application → Bot → Reset "
                "Token) into channels.discord.token_file")
    name = me.get("username", "?")
    flags = app.get("flags") if isinstance(app, dict) else None
    if isinstance(flags, int) and not flags & DISCORD_MESSAGE_CONTENT:
        return ("fail", f"the bot {name} is accepted, but its Message Content Intent is off "
                "(messages would arrive empty)",
                f"{DISCORD_PORTAL} → your application → Bot → Privileged Gateway Intents: "
                "turn on Message Content Intent")
    return ("ok", f"the bot token is accepted ({name})", "")


def _check_mcp(results: list[dict[str, str]], cfg: Config) -> None:
    """Each MCP server started here (as the daemon would start it) and its tools listed."""
    from mdclaw.ops.mcp import doctor_rows  # starts processes: only when servers are set

    for name, level, detail, fix in doctor_rows(cfg):
        _check(results, name, level, detail, fix)


def _private_file(results: list[dict[str, str]], name: str, path: str, holds: str) -> None:
    """Warn when `path` (a file of secrets mdclaw keeps) can be read by other users."""
    try:
        mode = os.stat(path).st_mode & 0o077
    except OSError:
        return
    if mode:
        _check(results, name, "warn", f"{path} can be read by other users (it holds {holds})",
               f"chmod 600 {path}")


# The check each extra's failure is reported under.
EXTRA_CHECKS = {"whatsapp": "whatsapp", "transcribe": "transcription", "email": "email",
                "slack": "slack", "discord": "discord", "matrix": "matrix"}


def _check_extras(results: list[dict[str, str]], cfg: Config) -> set[str]:
    """Every setting whose optional dependency is missing or does not load (imported, so a
    broken native library shows): a failure with the extra to install. Returns the names of
    the missing extras."""
    missing = missing_extras(cfg, load=True)
    for m in missing:
        _check(results, EXTRA_CHECKS.get(m.extra.name, m.extra.name), "fail",
               f"{m.problem} ({m.key})", m.fix)
    return {m.extra.name for m in missing}


def _check_chromium(results: list[dict[str, str]], cfg: Config) -> None:
    """Home Assistant: the Chromium that ha_capture_screenshot runs on the host (a program,
    not a Python extra: a warning, the other HA actions work without it)."""
    ha = cfg.integrations.home_assistant
    if ha is None:
        return
    try:
        _check(results, "chromium", "ok", find_chromium(ha.chromium))
    except ScreenshotError as e:
        _check(results, "chromium", "fail" if ha.chromium else "warn",
               f"{e} (ha_capture_screenshot cannot take screenshots)",
               "install Chromium on the host (NixOS: environment.systemPackages = "
               "[ pkgs.chromium ]) or set integrations.home_assistant.chromium to its path")


def _check_whatsapp(results: list[dict[str, str]], cfg: Config) -> None:
    """WhatsApp (its extra installed): the device linked, the session file private."""
    wa = whatsapp_status(cfg)
    if wa is None:
        return
    if wa["link_state"] == "linked":
        _check(results, "whatsapp", "ok", f"linked to {wa['account']}")
    else:
        _check(results, "whatsapp", "fail", f"{wa['link_state'].replace('_', ' ')} "
               f"({wa['session']})", wa["fix"] or "")
    session = cfg.whatsapp_session_path
    try:
        mode = session.stat().st_mode & 0o077
    except OSError:
        return
    if mode:
        _check(results, "whatsapp_session", "warn",
               f"{session} can be read by other users (it holds the account's keys)",
               f"chmod 600 {session}")


def _check_http_port(results: list[dict[str, str]], cfg: Config) -> None:
    """The web server's port (the operator page, /metrics, the local HTTP chat) is free, or
    held by this install's running daemon."""
    server = cfg.web_server
    if server is None:
        return
    listen = server.listen
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"  # noqa: S104 - the port check binds what the server would
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
        _check(results, "http port", "ok", f"{listen} is free")
    except OSError as e:
        if daemon_running(cfg):
            _check(results, "http port", "ok", f"{listen} is served by the running daemon")
        else:
            _check(results, "http port", "fail", f"{listen}: {e.strerror or e}",
                   "stop the program using it, or set server.listen to a free port")


def _check_failures(results: list[dict[str, str]], cfg: Config) -> None:
    """Repeated failed turns of one group are a warning (ops.health.failed_turn_groups)."""

    since = to_iso(utc_now() - FAILED_TURNS_WINDOW)
    try:
        with Database(cfg.db_path, readonly=True, timeout=READ_TIMEOUT) as db:
            counts = failures_per_group(db, since)
            bad = failed_turn_groups(db)
            causes = {g: sorted({r["cause"] for r in list_failed_turns(db, group=g,
                                                                          since=since)})
                      for g in bad}
    except (sqlite3.Error, DatabaseError) as e:  # locked since the database check
        _check(results, "failed turns", "warn", f"not checked: {e}")
        return
    if bad:
        _check(results, "failed turns", "warn", "; ".join(
            f"group {g}: {n} failed turns in the last 24 h ({', '.join(causes[g])})"
            for g, n in sorted(bad.items())),
               "see `mdclaw failures` and docs/troubleshooting.md for each cause")
    else:
        total = sum(counts.values())
        _check(results, "failed turns", "ok", f"{total} failed turn(s) in the last 24 h")


# ops.health's problems doctor reports as checks of their own (the rest are checked above).
HEALTH_CHECKS = {"outbox": "outbox", "tasks_failing": "tasks", "tasks_paused": "tasks",
                 "quarantine": "quarantine", "budget": "budget today"}
HEALTH_OK = {"deliveries": "no channel's deliveries fail", "outbox": "no failed deliveries",
             "tasks": "no task failed its last run or was paused by mdclaw",
             "quarantine": "no command file is quarantined",
             "budget today": "no group is over its token budget today"}
HEALTH_FIX = {"outbox": "see `mdclaw outbox list`; retry or drop (operator page: Outbox)",
              "tasks": "see `mdclaw tasks list` and `mdclaw tasks logs <id>`",
              "quarantine": "see `mdclaw ipc errors`; delete what you have read",
              "budget today": "see `mdclaw usage --budgets`; raise tokens_per_day or wait "
                              "for tomorrow (UTC)",
              "deliveries": "see `mdclaw outbox list` and the channel's detail in `mdclaw "
                            "status`"}


def _check_health(results: list[dict[str, str]], cfg: Config) -> None:
    """What mdclaw.ops.health finds in the database and the quarantine: deliveries failing
    per channel, failed deliveries, failing or self-paused tasks, quarantined files, groups
    over their budget today."""
    try:
        with Database(cfg.db_path, readonly=True, timeout=READ_TIMEOUT) as db:
            problems = find_problems(cfg, db, disk=None)
    except (sqlite3.Error, DatabaseError) as e:  # locked since the database check
        _check(results, "deliveries", "warn", f"not checked: {e}")
        return
    found: dict[str, list[str]] = {}
    for p in problems:
        name = "deliveries" if p.key.startswith("channel:") else HEALTH_CHECKS.get(p.key)
        if name:
            found.setdefault(name, []).append(p.text)
    for name, ok in HEALTH_OK.items():
        if name in found:
            _check(results, name, "warn", "; ".join(found[name]), HEALTH_FIX[name])
        else:
            _check(results, name, "ok", ok)
