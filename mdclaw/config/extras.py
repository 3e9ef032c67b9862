"""The optional dependencies a setting needs (pyproject.toml's extras), and whether this
install has them.

A setting that needs an extra (`channels.whatsapp`: neonize; `channels.email`: imapclient;
`channels.slack`: slack-bolt; `channels.discord`: discord.py; `transcription.provider:
local`: faster-whisper) is valid config, but cannot work on an install without it. One
definition says so everywhere, always with the fix: `check-config` refuses the setting (a
check of this machine, left out by `--skip-host-checks`), `doctor` fails it, a command that
needs it (`mdclaw whatsapp link`) stops with the same line, and the daemon's channel or
transcriber that finds it missing says the same. The claude extra is the agent image's (its
agent runner), never imported by the host.

A program a setting names (`integrations.home_assistant.chromium`) is checked the same way
(`check_programs`). A module is looked for only (`importlib.util.find_spec`); `load=True`
(doctor) also imports it, which catches a wheel whose native library does not load.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
from dataclasses import dataclass

from mdclaw.config.schema import Config
from mdclaw.errors import ConfigProblem


@dataclass(frozen=True)
class Extra:
    """One of pyproject.toml's extras, as a setting needs it."""

    name: str  # the extra: pip install 'mdclaw[<name>]'
    module: str  # what is imported
    package: str  # what is installed, in words
    what: str  # what needs it
    nixos: str  # what the NixOS package offers instead

    @property
    def pip(self) -> str:
        return f"pip install 'mdclaw[{self.name}]'"


EXTRAS: dict[str, Extra] = {
    "whatsapp": Extra(
        "whatsapp", "neonize", "neonize", "the WhatsApp channel",
        "nixpkgs has no neonize, so the NixOS package has no WhatsApp channel: remove "
        "channels.whatsapp (or set enabled: false) and use Telegram or the local chat"),
    "discord": Extra(
        "discord", "discord", "discord.py", "the Discord channel",
        "the flake's package brings discord.py (nixpkgs' discordpy): run mdclaw from it, or "
        "remove channels.discord (or set enabled: false)"),
    "slack": Extra(
        "slack", "slack_bolt", "slack-bolt and slack-sdk", "the Slack channel",
        "the flake's package brings slack-bolt and slack-sdk (from nixpkgs): run mdclaw from "
        "it, or remove channels.slack (or set enabled: false)"),
    "transcribe": Extra(
        "transcribe", "faster_whisper", "faster-whisper", "local transcription",
        "the NixOS package has no faster-whisper: use transcription.provider: openai with an "
        "OpenAI-compatible endpoint"),
    "email": Extra(
        "email", "imapclient", "imapclient", "the email channel",
        "the NixOS package includes imapclient: update mdclaw, or report a package without "
        "it as a bug"),
    "matrix": Extra(
        "matrix", "nio", "matrix-nio", "the Matrix channel",
        "the NixOS package built by mdclaw's flake includes matrix-nio: use it (the "
        "services.mdclaw.package default), or remove channels.matrix (or set enabled: false)"),
}


def from_nix_store() -> bool:
    """This mdclaw runs from the Nix store (the flake's package, the NixOS module), where
    pip cannot add an extra."""
    return sys.prefix.startswith("/nix/store/") or sys.executable.startswith("/nix/store/")


def fix_for(extra: Extra, *, nix: bool | None = None) -> str:
    """What to do about a missing `extra`: pip, or on a Nix install what it offers."""
    if nix if nix is not None else from_nix_store():
        return extra.nixos
    return f"install mdclaw with the {extra.name} extra: {extra.pip}"


@dataclass(frozen=True)
class MissingExtra:
    """A setting in use whose extra this install lacks."""

    key: str  # the setting, as a dotted key path
    extra: Extra
    why: str  # "is not installed", "cannot be loaded: ..."

    @property
    def problem(self) -> str:
        return f"{self.extra.what} needs {self.extra.package}, which {self.why}"

    @property
    def fix(self) -> str:
        return fix_for(self.extra)

    @property
    def message(self) -> str:
        return f"{self.problem}: {self.fix}"

    def line(self) -> str:
        """`key: message`, the form check-config reports at the key's line."""
        return f"{self.key}: {self.message}"


class ExtraMissing(ConfigProblem):
    """A command or a component needs an extra this install lacks; str(e) is one line with
    the fix."""

    def __init__(self, missing: MissingExtra) -> None:
        super().__init__(missing.message)
        self.missing = missing


def settings_needing(cfg: Config) -> list[tuple[str, Extra]]:
    """(key, extra) for every setting in use that needs an extra."""
    out: list[tuple[str, Extra]] = []
    wa = cfg.channels.whatsapp
    if wa is not None and wa.enabled:
        out.append(("channels.whatsapp", EXTRAS["whatsapp"]))
    dc = cfg.channels.discord
    if dc is not None and dc.enabled:
        out.append(("channels.discord", EXTRAS["discord"]))
    em = cfg.channels.email
    if em is not None and em.enabled:
        out.append(("channels.email", EXTRAS["email"]))
    sl = cfg.channels.slack
    if sl is not None and sl.enabled:
        out.append(("channels.slack", EXTRAS["slack"]))
    mx = cfg.channels.matrix
    if mx is not None and mx.enabled:
        out.append(("channels.matrix", EXTRAS["matrix"]))
    if cfg.transcription is not None and cfg.transcription.provider == "local":
        out.append(("transcription.provider", EXTRAS["transcribe"]))
    return out


def unavailable(extra: Extra, *, load: bool = False) -> str | None:
    """Why `extra` cannot be used here ("is not installed", "cannot be loaded: ..."), or
    None when it can. `load`: import it too (slower; catches a broken native library)."""
    try:
        found = importlib.util.find_spec(extra.module) is not None
    except (ImportError, ValueError):  # a parent that fails, a module set to None
        found = False
    if not found:
        return "is not installed"
    if load:
        try:
            importlib.import_module(extra.module)
        except (ImportError, OSError) as e:
            return f"cannot be loaded ({type(e).__name__}: {str(e)[:200]})"
    return None


def missing_extras(cfg: Config, *, load: bool = False) -> list[MissingExtra]:
    """Every setting in use whose extra this install lacks."""
    out = []
    for key, extra in settings_needing(cfg):
        why = unavailable(extra, load=load)
        if why is not None:
            out.append(MissingExtra(key, extra, why))
    return out


def check_extras(cfg: Config) -> list[str]:
    """check-config's check: a line per setting whose extra is missing, at the setting."""
    return [m.line() for m in missing_extras(cfg)]


def check_programs(cfg: Config) -> list[str]:
    """check-config's check of the programs a setting names: `integrations.home_assistant.
    chromium` (ha_capture_screenshot's browser) and each `mcp_servers.<s>.command` (a stdio
    server the host starts) must be found. Left unset, the browser is looked for when a
    screenshot is asked for, and doctor warns when there is none."""
    out = []
    ha = cfg.integrations.home_assistant
    if ha is not None and ha.chromium is not None and not shutil.which(ha.chromium):
        out.append(f"integrations.home_assistant.chromium: {ha.chromium!r} is not a program "
                   "on PATH (ha_capture_screenshot runs it): install Chromium, or give its "
                   "path")
    for name, srv in cfg.mcp_servers.items():
        if srv.command is not None and not shutil.which(srv.command):
            out.append(f"mcp_servers.{name}.command: {srv.command!r} is not a program on "
                       "PATH, or not executable (the host starts it): install the server, "
                       "or give its path")
    return out


def require_extra(name: str, key: str) -> None:
    """Raise ExtraMissing (one line, with the fix) unless extra `name`, which setting `key`
    needs, can be imported."""
    extra = EXTRAS[name]
    why = unavailable(extra, load=True)
    if why is not None:
        raise ExtraMissing(MissingExtra(key, extra, why))
