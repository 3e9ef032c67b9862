"""The value types config keys are made of, and the base every section model builds on.

Durations ("90s", "10m"), sizes ("500M", "2GiB") and free-space floors ("5%"), group folder
names, time zones, sender ids, CIDR ranges, domain names, ISO times and secret file paths:
each is a pydantic `Annotated` type whose validator says, in words, what is accepted, with
the parse/format functions the rest of mdclaw uses. `Frozen` is the base of every section
(immutable, unknown keys refused); `CrossKeyError` is how a section reports a problem across
its keys, each at the key it is about.
"""

from __future__ import annotations

import ipaddress
import os
import re
import unicodedata
from collections.abc import Iterable
from datetime import date, timedelta
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer

from mdclaw import schedule
from mdclaw.errors import ConfigProblem

FOLDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
RESERVED_FOLDERS = frozenset({"global", "errors"})


def short_repr(value: Any) -> str:
    """`value` as a message quotes it: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --------------------------------------------------------------------------- durations

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: Any) -> timedelta:
    """Read "90s", "10m", "1h", "2d", "500ms" or an integer (milliseconds) as a timedelta."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError("expected a duration such as '90s', '10m', '1h' or milliseconds")
    if isinstance(value, int | float):
        if value <= 0:
            raise ValueError(f"duration must be positive, got {value}")
        return timedelta(milliseconds=value)
    m = _DURATION_RE.match(str(value))
    if not m:
        raise ValueError(
            f"invalid duration {value!r}: use e.g. '90s', '10m', '1h' or an integer of milliseconds"
        )
    number, unit = float(m.group(1)), m.group(2)
    seconds = number / 1000 if unit is None else number * _UNIT_SECONDS[unit]
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {value!r}")
    return timedelta(seconds=seconds)


def format_duration(td: timedelta) -> str:
    ms = int(td.total_seconds() * 1000)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]


# --------------------------------------------------------------------------- sizes

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_POWER = {"k": 1, "m": 2, "g": 3, "t": 4}
# What the JSON Schema (and so the NixOS options) accept for a size; parse_size decides.
SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*([kKmMgGtT][iI]?[bB]?|[bB])?\s*$"
FLOOR_PATTERN = r"^\s*\d+(\.\d+)?\s*([kKmMgGtT][iI]?[bB]?|[bB]|%)?\s*$"


def parse_size(value: Any) -> int:
    """Read a size as bytes: an integer (bytes) or "500M", "2G", "1GiB", "1.5GB", "64k".

    K, M, G, T with or without i (KiB, GiB...) are powers of 1024, as in docker's `2g`;
    KB, MB, GB, TB are powers of 1000. Raises ValueError saying what is accepted.
    """
    if isinstance(value, bool):
        raise ValueError("expected a size such as '500M', '2G' or '1GiB'")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}: use e.g. '500M', '2G', '1GiB', '1.5GB' or "
                         "an integer of bytes")
    number, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "b":
        size = number
    else:
        base = 1000 if unit.endswith("b") and "i" not in unit else 1024
        size = number * base ** _SIZE_POWER[unit[0]]
    if int(size) <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return int(size)


def format_size(n: float) -> str:
    """A byte count for people: '2.1 GiB', '512 MiB', '900 B'."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.0f} {unit}" if value >= 100 or value == int(value) \
                else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def _size_text(value: Any) -> str:
    """Check a size and keep it as written (an integer becomes its text)."""
    parse_size(value)
    return str(value).strip()


def _floor_text(value: Any) -> str:
    """A size, or a percentage of the file system ("5%")."""
    text = str(value).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"invalid percentage {value!r}: use e.g. '5%'") from None
        if not 0 < pct < 100:
            raise ValueError(f"percentage must be between 0 and 100, got {value!r}")
        return text
    return _size_text(value)


Size = Annotated[str, BeforeValidator(_size_text), Field(pattern=SIZE_PATTERN)]
SizeOrPercent = Annotated[str, BeforeValidator(_floor_text), Field(pattern=FLOOR_PATTERN)]


def floor_bytes(value: str, total: int) -> int:
    """`limits.min_free_disk` in bytes, for a file system of `total` bytes."""
    if value.endswith("%"):
        return int(total * float(value[:-1]) / 100)
    return parse_size(value)


# --------------------------------------------------------------------------- names

def _check_folder(name: str) -> str:
    if not FOLDER_RE.match(name):
        raise ValueError(
            f"folder name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    if folder_key(name) in RESERVED_FOLDERS:
        raise ValueError(f"folder name {name!r} is reserved (global and errors are used by mdclaw)")
    return name


FOLDER_CASE_RULE = ("group folders must differ by more than case (compared after NFC "
                    "normalisation and casefold()): on a case-insensitive file system (macOS) "
                    "two such groups would share their groups/, ipc/ and sessions/ folders")


def folder_key(name: str) -> str:
    """What no two group folders may share: the name NFC-normalised and case-folded, as a
    case-insensitive file system (macOS's APFS, by default) compares names."""
    return unicodedata.normalize("NFC", name).casefold()


def folder_clash(folder: str, others: Iterable[str]) -> str | None:
    """The first of `others` that is `folder` but for case or normalisation (never `folder`
    itself), or None. The rule is FOLDER_CASE_RULE."""
    key = folder_key(folder)
    return next((o for o in others if o != folder and folder_key(o) == key), None)


def validate_folder(name: str) -> str:
    """Return `name` if it is a valid group folder; raise ValueError saying why not."""
    return _check_folder(name)


Folder = Annotated[str, BeforeValidator(lambda v: _check_folder(str(v)))]


def _check_timezone(name: str) -> str:
    try:
        schedule.get_zone(name)
    except schedule.ScheduleError as e:
        raise ValueError(str(e)) from None
    return name


TimeZone = Annotated[str, BeforeValidator(lambda v: _check_timezone(str(v)))]


def _sender_id(value: Any) -> str:
    """A sender id as the channel reports it; YAML reads an unquoted 123456 as a number."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"a sender id is a string or a number, got {short_repr(value)}")
    text = str(value).strip()
    if not text:
        raise ValueError("a sender id must not be empty")
    return text


SenderId = Annotated[str, BeforeValidator(_sender_id)]


def _iso_text(value: Any) -> Any:
    """YAML reads an unquoted 2026-12-01T09:00:00 as a datetime: take it as ISO text again."""
    return value.isoformat() if isinstance(value, date) else value


IsoTime = Annotated[str, BeforeValidator(_iso_text)]

# An fnmatch pattern of names (Home Assistant services and entities).
Glob = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.*?\[\]!-]+$")]


def _cidr(value: Any) -> str:
    try:
        return str(ipaddress.ip_network(str(value), strict=False))
    except ValueError:
        raise ValueError(f"{short_repr(value)} is not an address or CIDR range such as "
                         "192.168.1.0/24") from None


Cidr = Annotated[str, BeforeValidator(_cidr)]


def _domain(value: Any) -> str:
    text = str(value).strip().lower().rstrip(".")
    if text.startswith("*."):
        text = text[2:]
    if not text or "/" in text or ":" in text or " " in text:
        raise ValueError(f"{short_repr(value)} is not a domain name such as example.org")
    return text


Domain = Annotated[str, BeforeValidator(_domain)]


# --------------------------------------------------------------------------- secret paths

# systemd's LoadCredential hands secrets to the service in $CREDENTIALS_DIRECTORY, a folder
# that exists only inside the unit. A secret path naming it, read where the variable is unset
# (the administrator's shell), is "set in the service's credentials": the config is valid, the
# secret is simply not readable from here. Commands that need it say so (ServiceCredential).
CREDENTIALS_VAR = "CREDENTIALS_DIRECTORY"
_CREDENTIALS_REF = re.compile(r"\$(?:CREDENTIALS_DIRECTORY\b|\{CREDENTIALS_DIRECTORY\})")


def in_service_credentials(path: str | os.PathLike[str]) -> bool:
    """True for a secret path that names $CREDENTIALS_DIRECTORY while this process has none."""
    return (_CREDENTIALS_REF.search(str(path)) is not None
            and not os.environ.get(CREDENTIALS_VAR))


def _secret_path(value: Any) -> Path:
    """A secret file's path with $VARIABLES and ~ expanded; one in the service's credentials
    (seen from outside the service) is kept as written. The file itself is not looked at
    here: mdclaw.config.secrets.secret_file_issues does that, in one explicit pass."""
    if in_service_credentials(str(value)):
        return Path(str(value))
    return Path(os.path.expandvars(str(value))).expanduser()


SecretFile = Annotated[Path, BeforeValidator(_secret_path)]


# --------------------------------------------------------------------------- model base

# host:port (an empty host is 127.0.0.1). A pydantic pattern (Rust regex: `$` is the end of the
# text) that the JSON Schema and so the NixOS options carry as it is.
LISTEN_PATTERN = r"^[^:\s]*:\d{1,5}$"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Problem = tuple[tuple[str, ...], str]  # (key path relative to the model checked, message)


class CrossKeyError(ConfigProblem, ValueError):
    """Problems a model validator found across keys, each at the key it is about (a path
    relative to the model). `load_config` reports each as its own issue at that key's line;
    anyone else constructing a model sees them joined in one message."""

    def __init__(self, problems: list[Problem],
                 requires: list[tuple[tuple[str, ...], ...]] | None = None) -> None:
        super().__init__("; ".join(f"{'.'.join(path)}: {msg}" if path else msg
                                   for path, msg in problems))
        self.problems = problems
        # For each problem, the entries whose presence it depends on (see load_config).
        self.requires = requires or [() for _ in problems]
