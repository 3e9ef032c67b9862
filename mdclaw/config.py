"""The declarative configuration: `config.yaml` is the desired state.

The pydantic models below are the single source of truth for the config: validation, the
error messages people read, `config.example.yaml` and the NixOS option descriptions all come
from them. Every model is frozen and forbids unknown keys, so a typo is an error that names
the key, where it is, and the nearest valid key.

Environment variables with the `MDCLAW_` prefix override the file (`MDCLAW_DATA_DIR`,
`MDCLAW_ASSISTANT__NAME`, ...). Secrets are never written inline: keys ending in `_file` name
a file that holds the secret; it is read only when needed and never logged.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from mdclaw import schedule
from mdclaw.errors import ConfigProblem

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
FOLDER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
RESERVED_FOLDERS = frozenset({"global", "errors"})
DEFAULT_CONFIG_PATHS = (Path("config.yaml"), Path("/etc/mdclaw/config.yaml"))


# --------------------------------------------------------------------------- value types

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


def _check_folder(name: str) -> str:
    if not FOLDER_RE.match(name):
        raise ValueError(
            f"folder name {name!r} is not allowed: use 1-64 letters, digits, '_' or '-', "
            "starting with a letter or digit"
        )
    if name.lower() in RESERVED_FOLDERS:
        raise ValueError(f"folder name {name!r} is reserved (global and errors are used by mdclaw)")
    return name


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


# Set by secret_checks_skipped(): validate everything except that secret files exist, e.g. when
# a config is checked at build time (NixOS) and its secrets appear only when the service runs.
_SKIP_SECRET_CHECKS: ContextVar[bool] = ContextVar("mdclaw_skip_secret_checks", default=False)


@contextmanager
def secret_checks_skipped() -> Iterator[None]:
    """Within this block, secret file paths are accepted without looking at the files."""
    token = _SKIP_SECRET_CHECKS.set(True)
    try:
        yield
    finally:
        _SKIP_SECRET_CHECKS.reset(token)


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


class ServiceCredential(ConfigProblem, OSError):
    """A secret that only the service can read (see in_service_credentials)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(f"{path} is set in the service's credentials: {CREDENTIALS_VAR} "
                         "exists only inside the mdclaw service; run the command as root "
                         "(`sudo mdclaw ...` runs it as the service, with its credentials)")
        self.strerror = "set in the service's credentials"
        self.filename = str(path)


def _check_secret_file(value: Any) -> Path:
    """A secret file must exist, be a regular file and not be readable by everyone."""
    if in_service_credentials(str(value)):
        return Path(str(value))  # checked where it exists: inside the service
    path = Path(os.path.expandvars(str(value))).expanduser()
    if _SKIP_SECRET_CHECKS.get():
        return path
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ValueError(f"secret file {str(path)!r} does not exist") from None
    except PermissionError:
        raise ValueError(f"secret file {str(path)!r} cannot be read by this user") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"secret file {str(path)!r} is not a regular file")
    if st.st_mode & stat.S_IROTH:
        raise ValueError(
            f"secret file {str(path)!r} is readable by every user (mode "
            f"{stat.S_IMODE(st.st_mode):04o}); run: chmod o-rwx {path}"
        )
    if not os.access(path, os.R_OK):
        raise ValueError(f"secret file {str(path)!r} cannot be read by this user")
    return path


SecretFile = Annotated[Path, BeforeValidator(_check_secret_file)]


def read_secret(path: Path) -> str:
    """Return the secret held in `path`, stripped of surrounding whitespace.

    Raises OSError if the file went away; the message names the file, never the content.
    ServiceCredential (an OSError) when the file is in the service's credentials only.
    """
    if in_service_credentials(path):
        raise ServiceCredential(path)
    return Path(path).read_text(encoding="utf-8").strip()


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


LISTEN_PATTERN = r"^[^:\s]*:\d{1,5}$"  # host:port (an empty host is 127.0.0.1)


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


def _choices(names: list[str], what: str) -> str:
    names = sorted(names)
    return f"known: {', '.join(names)}" if names else f"no {what} are configured"


# --------------------------------------------------------------------------- sections


class Assistant(Frozen):
    name: str = Field("Andy", min_length=1, max_length=64,
                      description="The assistant's name; the default trigger is '@' + name.")
    timezone: TimeZone = Field("UTC", description="IANA timezone; schedules are evaluated in it.")
    model: str | None = Field(None, description="Default model: a key of `models`.")


class GroupMount(Frozen):
    host: str = Field(description="Absolute host path; must lie under mount_policy.allowed_roots.")
    container: str = Field(description="Name under /workspace/extra/ inside the container.")
    readonly: bool = Field(True, description="Mount read-only (read-write needs an allowing root).")


def _sender_id(value: Any) -> str:
    """A sender id as the channel reports it; YAML reads an unquoted 123456 as a number."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"a sender id is a string or a number, got {_short(value)}")
    text = str(value).strip()
    if not text:
        raise ValueError("a sender id must not be empty")
    return text


SenderId = Annotated[str, BeforeValidator(_sender_id)]


class AllowSenders(Frozen):
    mode: Literal["trigger", "drop"] = Field(
        "trigger", description="What happens to a message from a sender not in `ids`: "
        "trigger: it is kept as context for the next turn an allowed sender starts, but never "
        "starts a turn nor reaches a running one; drop: it is not stored at all. Refused "
        "messages are counted (`mdclaw groups list`) and never answered.")
    ids: tuple[SenderId, ...] = Field(
        description="Sender ids that may drive the agent, as the channel reports the sender: "
        "Telegram user ids (e.g. '123456789', without 'tg:'), WhatsApp jids (e.g. "
        "'4915112345678@s.whatsapp.net', without 'wa:'), the local HTTP channel's "
        "`sender` field. An empty list lets no one.")


class Group(Frozen):
    name: str = Field(min_length=1, description="Display name of the group.")
    jid: str = Field(min_length=1, description="The chat this group answers in, e.g. tg:123456.")
    main: bool = Field(False, description="The admin group; exactly one group is main.")
    requires_trigger: bool | None = Field(
        None, description="Only answer messages that mention the trigger (default: true, "
        "false for the main group)."
    )
    trigger: str | None = Field(None, description="Trigger word; default '@' + assistant name.")
    mounts: tuple[GroupMount, ...] = Field((), description="Extra host folders for this group.")
    timeout: Duration | None = Field(None, description="Hard container timeout for this group.")
    tool_timeout: Duration | None = Field(
        None, description="Longest a single `bash` tool call of this group's agent may run "
        "(overrides `limits.tool_timeout`).")
    model: str | None = Field(None, description="Model for this group: a key of `models`.")
    network: str | None = Field(
        None, description="Container network: `none` (the default: no network at all), or a "
        "network named in `runtime.allowed_networks`; `host` only with "
        "`runtime.allow_host_network: true`.")
    allow_senders: AllowSenders | None = Field(
        None, description="Who may drive this group's agent, e.g. {mode: trigger, ids: "
        "['123456789']}; unset: everyone in the chat may (docs/configuration.md: 'Who may drive "
        "an agent').")
    disk: Size | None = Field(
        None, description="Most disk space this group's files may take, e.g. `2GiB` (overrides "
        "`limits.disk`).")
    proxy_connections: int | None = Field(
        None, ge=1, le=1024,
        description="Connections this group may hold open to the credential proxy "
        "(overrides `limits.proxy_connections`).")
    proxy_requests_per_minute: int | None = Field(
        None, ge=1, description="Model requests per minute this group may send through the "
        "credential proxy (overrides `limits.proxy_requests_per_minute`).")
    tokens_per_day: int | None = Field(
        None, ge=1, description="Model tokens (input + output) this group may use per UTC "
        "day through the credential proxy (overrides `limits.tokens_per_day`).")
    actions: tuple[str, ...] | None = Field(
        None, description="Host actions this group's agent may call, as fnmatch patterns "
        "(`web_*`, `memory_*`); memory_search and memory_get on its own memory are always "
        "allowed. Unset: each action's default applies (most: every group; some: the main "
        "group only). docs/integrations.md lists the actions.")

    @model_validator(mode="after")
    def _telegram_sender_ids(self) -> Group:
        if self.allow_senders is None or not self.jid.startswith("tg:"):
            return self
        bad = [(n, i) for n, i in enumerate(self.allow_senders.ids)
               if not i.lstrip("-").isdigit()]
        if bad:
            raise CrossKeyError([
                (("allow_senders", "ids", str(n)),
                 f"{i!r} is not a Telegram user id; write the number alone (e.g. '123456789', "
                 "not 'tg:123456789'): in a private chat with the bot, /chatid answers "
                 "tg:<your user id>") for n, i in bad])
        return self

    def effective_trigger(self, assistant: Assistant) -> str:
        return self.trigger or f"@{assistant.name}"

    def effective_requires_trigger(self) -> bool:
        return (not self.main) if self.requires_trigger is None else self.requires_trigger


class Limits(Frozen):
    max_concurrent_containers: int = Field(5, ge=1, le=256,
                                           description="Containers running at once, all groups.")
    container_timeout: Duration = Field(timedelta(minutes=30),
                                        description="Hard timeout of one container run.")
    idle_timeout: Duration = Field(timedelta(minutes=10),
                                   description="Close a conversation idle this long.")
    tool_timeout: Duration = Field(
        timedelta(minutes=10), description="Longest a single `bash` tool call of an agent "
        "(openai backend) may run: a call may ask for up to this (the default is 120 s, or "
        "this when shorter); then its process group is stopped. Per group: "
        "`groups.<g>.tool_timeout`.")
    max_output_bytes: int = Field(10 * 1024 * 1024, ge=1024,
                                  description="Container output kept per run; excess dropped.")
    memory: str = Field("2g", description="Container memory limit (docker syntax).")
    cpus: float = Field(2.0, gt=0, description="Container CPU limit.")
    pids: int = Field(512, ge=16, description="Container process limit.")
    ipc_poll_interval: Duration = Field(timedelta(seconds=1),
                                        description="IPC poll fallback interval.")
    errors_max_files: int = Field(1000, ge=10, description="Quarantine cap: number of files.")
    errors_max_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Quarantine cap: bytes.")
    run_attempts: int = Field(5, ge=1, le=20,
                              description="Tries of one agent run before the user is told.")
    run_retry_base: Duration = Field(timedelta(seconds=5),
                                     description="Wait before the second try; doubles after.")
    delivery_attempts: int = Field(5, ge=1, le=50,
                                   description="Tries to deliver one outbound message.")
    delivery_retry_base: Duration = Field(timedelta(seconds=5),
                                          description="Wait before the second delivery try; "
                                          "triples after.")
    disk: Size | None = Field(
        "10GiB", description="Most disk space one group's files may take: `groups/<g>`, "
        "`ipc/<g>`, `sessions/<g>` (and `groups/global` for main). Past it the group's "
        "container is stopped and its runs are refused, with one message to its chat, until "
        "files are deleted. Sizes: `500M`, `2G`, `1GiB` (powers of 1024), `1.5GB` (of 1000). "
        "null: no limit. Per group: `groups.<g>.disk`.")
    disk_files: int = Field(
        500_000, ge=1000, description="Most files and folders one group may have (counted "
        "like `limits.disk`); more counts as over the disk limit. Also bounds what one "
        "measurement costs.")
    min_free_disk: SizeOrPercent = Field(
        "1GiB", description="Free space kept on the file system holding `data_dir`: a size "
        "(`1GiB`) or a percentage of it (`5%`). Below it every running container is stopped "
        "and no run starts until space is freed; state.db and the outbox keep working.")
    disk_check_interval: Duration = Field(
        timedelta(seconds=10), description="How often free space and the folders of groups "
        "with a running container are measured (at least 10 times as long as the last "
        "measurement took).")
    proxy_connections: int = Field(
        32, ge=1, le=1024, description="Connections one group's container may hold open to "
        "the credential proxy; more are closed as soon as they are accepted. Per group: "
        "`groups.<g>.proxy_connections`.")
    proxy_requests_per_minute: int = Field(
        300, ge=1, description="Model requests one group may send through the credential "
        "proxy per minute (bursts up to this many); more get HTTP 429 with a Retry-After. "
        "Per group: `groups.<g>.proxy_requests_per_minute`.")
    tokens_per_day: int | None = Field(
        None, ge=1, description="Model tokens (input + output, as the API reports them) one "
        "group may use per UTC day through the credential proxy. Past it every model request "
        "of the group is refused (HTTP 429, `mdclaw_over_budget`) until midnight UTC, and its "
        "chat is told when the budget resets. null: no budget. Per group: "
        "`groups.<g>.tokens_per_day`.")
    action_jobs: int = Field(
        8, ge=1, le=256, description="Off-loop actions (web_fetch, web_search...) run at once, "
        "all groups together; more wait in the queue.")
    action_jobs_per_group: int = Field(
        2, ge=1, le=256, description="Off-loop actions one group may have running at once, so "
        "one group cannot take every slot.")

    @model_validator(mode="after")
    def _idle_below_hard(self) -> Limits:
        if self.idle_timeout >= self.container_timeout:
            raise CrossKeyError([(("idle_timeout",),
                f"idle_timeout ({format_duration(self.idle_timeout)}) must be shorter than "
                f"container_timeout ({format_duration(self.container_timeout)}): lower "
                "idle_timeout or raise container_timeout")])
        return self


class Runtime(Frozen):
    engine: Literal["docker", "podman", "apple-container"] = Field(
        "docker", description="Container engine.")
    socket: str | None = Field(None, description="Engine API socket (default: auto-detect).")
    image: str = Field("mdclaw-agent:latest", description="Agent image reference.")
    install_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Label value that keeps two installs on one host apart "
                    "(default: data_dir hash).",
    )
    allowed_networks: tuple[str, ...] = Field(
        (), description="Container networks a group's `network:` may name besides `none` "
        "(e.g. a network made with `docker network create`). Empty: every container runs "
        "without a network.")
    allow_host_network: bool = Field(
        False, description="Let a group's `network:` be `host`: the container then shares the "
        "host's network namespace and reaches every service listening on the host, "
        "localhost included. Off unless set to true here.")
    keep_created: bool = Field(
        True, description="After a group's run, create (not start) the container of its next "
        "run, with the same mounts, environment and limits, so a reply only waits for the "
        "engine to start it. Discarded when the group's settings change before it is used, "
        "after 10 minutes unused, at shutdown and by the next start's orphan cleanup. It holds "
        "no secret and runs nothing until used. Engines that cannot create without starting "
        "(apple-container) ignore it.")

    @model_validator(mode="after")
    def _host_is_explicit(self) -> Runtime:
        if "host" in self.allowed_networks and not self.allow_host_network:
            raise CrossKeyError([(("allowed_networks",),
                "'host' cannot be allowed in this list: it shares the host's network with "
                "the container; remove it, or, if you mean it, set "
                "`runtime.allow_host_network: true`")])
        return self


class AllowedRoot(Frozen):
    path: str = Field(description="Host directory under which group mounts may lie.")
    allow_read_write: bool = Field(False, description="Mounts under it may be read-write.")
    description: str | None = Field(None, description="Free text: what this root is for.")


class MountPolicy(Frozen):
    allowed_roots: tuple[AllowedRoot, ...] = Field(
        (), description="No roots: no additional mounts at all.")
    blocked_patterns: tuple[str, ...] = Field((), description="Added to the built-in block list.")
    non_main_read_only: bool = Field(True, description="Non-main groups get read-only mounts.")


class ModelSpec(Frozen):
    backend: Literal["claude", "openai"] = Field(description="claude (Agent SDK) or openai.")
    model: str = Field(min_length=1, description="Model name passed to the backend.")
    base_url: str | None = Field(None, pattern=r"^https?://",
                                 description="API base URL (default: the provider's).")
    api_key_file: SecretFile | None = Field(None, description="File holding the API key.")
    allow_models: tuple[str, ...] = Field(
        (), description="Other model names an agent may ask for with this entry's key. The "
        "credential proxy sends every request with `model` set to this entry's `model`, "
        "unless the request names one of these (the claude CLI asks for a small model for "
        "side tasks, e.g. `claude-haiku-4-5`).")


class Server(Frozen):
    listen: str = Field("127.0.0.1:3000", pattern=LISTEN_PATTERN,
                        description="host:port the daemon's web server listens on.")
    secret_file: SecretFile | None = Field(
        None, description="Bearer token file (optional): required by the chat's endpoints, "
        "the operator page and /metrics.")
    generate_secret: bool = Field(
        False, description="When `secret_file` is unset: generate a random token into "
        "`<data_dir>/http-secret` (mode 0600) on the daemon's first start and require it, so "
        "no other local user can post as the main group. `mdclaw send` and `mdclaw "
        "http-token` (for the chat page) read it. The NixOS module turns this on.")


class HttpChannel(Frozen):
    enabled: bool = Field(True, description="Serve the local HTTP chat and its page on the "
                          "daemon's web server (`server`).")
    # The old names of the web server's keys, from when the chat owned the server: read as
    # `server.<key>` (Config.web_server); check-config warns (old_server_keys).
    listen: str | None = Field(
        None, pattern=LISTEN_PATTERN, description="Deprecated: the old name of "
        "`server.listen`, read as it (check-config warns; a different `server.listen` is an "
        "error).")
    secret_file: SecretFile | None = Field(
        None, description="Deprecated: the old name of `server.secret_file`, read as it.")
    generate_secret: bool | None = Field(
        None, description="Deprecated: the old name of `server.generate_secret`, read as it.")


class TelegramChannel(Frozen):
    enabled: bool = Field(True, description="Connect to Telegram.")
    token_file: SecretFile = Field(description="File holding the bot token.")
    api_base: str = Field("https://api.telegram.org", pattern=r"^https?://",
                          description="Bot API base URL (for a local Bot API server or tests).")


class WhatsAppChannel(Frozen):
    enabled: bool = Field(True, description="Connect to WhatsApp as a linked device of your "
                          "phone's account (pair with `mdclaw whatsapp link`).")
    session_file: Path | None = Field(
        None, description="Where the linked device's keys are kept (an SQLite file, mode "
        "0600; whoever reads it can act as your WhatsApp account). Default: "
        "data_dir/whatsapp/session.sqlite3.")
    send_interval: float = Field(
        1.0, ge=0, le=60, description="Seconds between two messages the assistant sends "
        "(WhatsApp bans accounts that send in bursts).")


class Channels(Frozen):
    http: HttpChannel | None = Field(
        default_factory=HttpChannel,
        description="Local HTTP chat (jids hl:<id>), on by default, served by the daemon's "
        "web server (`server`).")
    telegram: TelegramChannel | None = Field(None, description="Telegram bot (jids tg:<chat id>).")
    whatsapp: WhatsAppChannel | None = Field(
        None, description="WhatsApp linked device (jids wa:<jid>, e.g. "
        "wa:120363012345678901@g.us for a group, wa:4915112345678@s.whatsapp.net for a person).")


class Media(Frozen):
    max_bytes: Size = Field(
        "20M", description="Largest file a person may send the assistant (photo, document, "
        "audio, voice note, web chat upload); a larger one is not saved and the chat is told. "
        "Telegram's Bot API lets bots download at most 20 MB whatever this says.")

    @property
    def limit(self) -> int:
        """`max_bytes` in bytes."""
        return parse_size(self.max_bytes)


class Transcription(Frozen):
    provider: Literal["local", "openai"] = Field(
        description="local: a faster-whisper model on this machine's CPU (int8; needs the "
        "`transcribe` extra); openai: an OpenAI-compatible /audio/transcriptions endpoint.")
    model: str | None = Field(
        None, min_length=1, description="local: a faster-whisper model name (tiny, base, "
        "small...) or the path of a downloaded model folder, default base; openai: the "
        "model name, default whisper-1.")
    base_url: str | None = Field(
        None, pattern=r"^https?://", description="openai: the API root the "
        "/audio/transcriptions path is added to (default https://api.openai.com/v1).")
    api_key_file: SecretFile | None = Field(
        None, description="openai: file holding the API key (sent as a bearer token).")
    language: str | None = Field(
        None, pattern=r"^[A-Za-z]{2,3}$",
        description="Language of the voice notes (ISO 639-1, e.g. en); default: detected.")
    timeout: Duration = Field(timedelta(minutes=2),
                              description="Longest a transcription may take.")

    @property
    def model_name(self) -> str:
        return self.model or ("base" if self.provider == "local" else "whisper-1")

    @property
    def url(self) -> str:
        """The transcription endpoint (openai)."""
        return (self.base_url or "https://api.openai.com/v1").rstrip("/") + \
            "/audio/transcriptions"


_GLOB = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.*?\[\]!-]+$")]


class HomeAssistantAllow(Frozen):
    services: tuple[_GLOB, ...] = Field(
        (), description="Services agents may call, as fnmatch patterns of `domain.service` "
        "(`light.*`, `switch.turn_on`). Empty (the default): none, read-only.")
    entities: tuple[_GLOB, ...] = Field(
        (), description="Entities agents may read and act on, as fnmatch patterns of the "
        "entity id (`light.*`, `climate.greenhouse`). Empty (the default): none.")


class HomeAssistant(Frozen):
    url: str = Field(pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
                     description="Home Assistant's base URL, e.g. http://homeassistant.local:8123.")
    token_file: SecretFile = Field(
        description="File holding a long-lived access token (HA profile → Security → "
        "Long-lived access tokens). Read on the host only; never sent to a container.")
    dashboards_dir: Path | None = Field(
        None, description="Folder of the Lovelace YAML dashboards (and canvas specs) the "
        "dashboard actions read and edit; host-only, never mounted into a container.")
    allow: HomeAssistantAllow = Field(
        default_factory=HomeAssistantAllow,
        description="What agents may call and see; the default allows nothing (read-only "
        "status only).")
    timeout: Duration = Field(timedelta(seconds=20),
                              description="Longest one request to Home Assistant may take.")
    chromium: str | None = Field(
        None, min_length=1, description="Chromium binary ha_capture_screenshot runs on the "
        "host; default: chromium (or chromium-browser, google-chrome) on PATH.")

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        return v.rstrip("/")

    @field_validator("dashboards_dir")
    @classmethod
    def _absolute_dashboards(cls, v: Path | None) -> Path | None:
        if v is None:
            return None
        v = Path(os.path.expanduser(str(v)))
        if not v.is_absolute():
            raise ValueError("dashboards_dir must be an absolute path")
        return v


class Integrations(Frozen):
    home_assistant: HomeAssistant | None = Field(
        None, description="Home Assistant actions (ha_*, farm_state_refresh); "
        "docs/integrations.md.")


def _iso_text(value: Any) -> Any:
    """YAML reads an unquoted 2026-12-01T09:00:00 as a datetime: take it as ISO text again."""
    return value.isoformat() if isinstance(value, date) else value


IsoTime = Annotated[str, BeforeValidator(_iso_text)]


class TaskSpec(Frozen):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$", description="Task id.")
    group: str = Field(description="Folder of the group the task runs in.")
    prompt: str = Field(min_length=1, description="What the agent is asked to do.")
    cron: str | None = Field(None, description="Cron expression, in the task's timezone.")
    interval: Duration | None = Field(None, description="Run every this long, e.g. '1h'.")
    once: IsoTime | None = Field(None, description="Run once at this local time (ISO 8601).")
    context_mode: Literal["group", "isolated"] = Field(
        "isolated", description="group: continue the group's session; isolated: a fresh one.")
    timezone: TimeZone | None = Field(None, description="Default: assistant.timezone.")
    catch_up: bool = Field(True, description="Run once after downtime if a run was missed.")

    @model_validator(mode="after")
    def _one_schedule(self) -> TaskSpec:
        given = [k for k in ("cron", "interval", "once") if getattr(self, k) is not None]
        if len(given) != 1:
            where = (given[1],) if given else ()
            raise CrossKeyError([(where, "give exactly one of cron, interval, once (got "
                                         f"{given or 'none'}): keep one schedule key")])
        return self

    @property
    def schedule_type(self) -> str:
        return "cron" if self.cron else "interval" if self.interval is not None else "once"

    @property
    def schedule_value(self) -> str:
        if self.cron:
            return " ".join(self.cron.split())
        if self.interval is not None:
            return str(int(self.interval.total_seconds() * 1000))
        return str(self.once)


def _cidr(value: Any) -> str:
    try:
        return str(ipaddress.ip_network(str(value), strict=False))
    except ValueError:
        raise ValueError(f"{_short(value)} is not an address or CIDR range such as "
                         "192.168.1.0/24") from None


Cidr = Annotated[str, BeforeValidator(_cidr)]


def _domain(value: Any) -> str:
    text = str(value).strip().lower().rstrip(".")
    if text.startswith("*."):
        text = text[2:]
    if not text or "/" in text or ":" in text or " " in text:
        raise ValueError(f"{_short(value)} is not a domain name such as example.org")
    return text


Domain = Annotated[str, BeforeValidator(_domain)]


class WebSearch(Frozen):
    provider: Literal["searxng", "brave"] = Field(
        description="searxng: a SearXNG instance (its JSON API must be enabled: "
        "`search.formats: [html, json]` in its settings.yml); brave: the Brave Search API.")
    url: str | None = Field(
        None, description="searxng: the instance's URL, e.g. http://searx.lan:8080 (the "
        "operator's own choice: not checked against the private-address rule). brave: the "
        "API endpoint (default https://api.search.brave.com/res/v1/web/search).")
    api_key_file: SecretFile | None = Field(
        None, description="brave: file holding the subscription token (never logged).")
    max_results: int = Field(10, ge=1, le=50, description="Most results one search returns.")

    @model_validator(mode="after")
    def _provider_needs(self) -> WebSearch:
        if self.provider == "searxng" and not self.url:
            raise CrossKeyError([(("url",), "searxng needs `url`: the instance's address, "
                                  "e.g. http://searx.lan:8080")])
        if self.provider == "brave" and self.api_key_file is None:
            raise CrossKeyError([(("api_key_file",), "brave needs `api_key_file`: a file "
                                  "holding the API token (chmod 600)")])
        if self.url and not self.url.startswith(("http://", "https://")):
            raise CrossKeyError([(("url",), f"{self.url!r} is not an http(s) URL")])
        return self


class Metrics(Frozen):
    enabled: bool = Field(
        True, description="Serve Prometheus metrics at `/metrics` on the daemon's web server "
        "(`server`; and on `listen`, when set), behind the operator page's access rule: the "
        "server's bearer token when it has one, else loopback clients only (docs/metrics.md).")
    listen: str | None = Field(
        None, pattern=LISTEN_PATTERN,
        description="host:port of a listener of its own that serves only `/metrics` (e.g. "
        "`127.0.0.1:9464`), for scraping apart from the web server. Same access rule; the "
        "token is the web server's (`server.secret_file` or the generated one).")


class Web(Frozen):
    enabled: bool = Field(
        False, description="Let agents fetch web pages and search (the web_fetch and "
        "web_search actions); the host does the fetching, containers keep no network. Off "
        "by default: pages an agent reads can carry instructions to it. Per group: "
        "`groups.<g>.actions`.")
    allow_domains: tuple[Domain, ...] = Field(
        (), description="Only these domains (and their subdomains) may be fetched; empty: "
        "any public domain.")
    deny_domains: tuple[Domain, ...] = Field(
        (), description="These domains (and their subdomains) are never fetched; wins over "
        "allow_domains.")
    allow_private: tuple[Cidr, ...] = Field(
        (), description="Non-public address ranges fetches may reach anyway, e.g. "
        "['192.168.1.20/32'] for one LAN host. Empty: loopback, private, link-local, "
        "multicast, reserved and the host's own addresses are all refused.")
    max_bytes: Size = Field("2MiB", description="Most bytes of one response body read.")
    max_chars: int = Field(20_000, ge=100, le=1_000_000,
                           description="Most characters of text one fetch returns (an agent "
                           "may ask for fewer).")
    timeout: Duration = Field(timedelta(seconds=20),
                              description="Time one fetch (all redirects) may take.")
    max_redirects: int = Field(5, ge=0, le=20,
                               description="Redirects followed; each target is checked again.")
    content_types: tuple[str, ...] = Field(
        ("text/html", "application/xhtml+xml", "text/plain", "text/markdown", "text/csv",
         "application/json", "application/xml", "text/xml"),
        description="Response media types accepted; others are refused.")
    user_agent: str = Field("mdclaw-web/0.1", description="User-Agent of the host's requests.")
    search: WebSearch | None = Field(None, description="The web_search provider; unset: "
                                     "web_search answers that no provider is configured.")


class _Settings(BaseSettings):
    """Root of config.yaml. The YAML file is the base; MDCLAW_* variables override it."""

    model_config = SettingsConfigDict(
        env_prefix="MDCLAW_", env_nested_delimiter="__", frozen=True, extra="forbid",
    )

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first (wins), then the YAML file passed as init kwargs.
        return (env_settings, init_settings)


class Config(_Settings):
    data_dir: Path = Field(Path("/var/lib/mdclaw"),
                           description="state.db, ipc/ and groups/ live under it.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Least severe log level written to stderr.")
    assistant: Assistant = Field(default_factory=Assistant,
                                 description="Who the assistant is and where it lives.")
    groups: dict[Folder, Group] = Field(default_factory=dict,
                                        description="Key: the group's folder name.")
    limits: Limits = Field(default_factory=Limits, description="Resource limits and timeouts.")
    runtime: Runtime = Field(default_factory=Runtime,
                             description="The container engine and the agent image.")
    mount_policy: MountPolicy = Field(default_factory=MountPolicy,
                                      description="Which host folders groups may mount.")
    models: dict[str, ModelSpec] = Field(default_factory=dict,
                                         description="Model backends by name; groups pick one.")
    server: Server | None = Field(
        default_factory=Server,
        description="The daemon's web server: the operator page, /metrics and, when "
        "`channels.http` is enabled, the local chat (docs/web.md). null: no web server.")
    channels: Channels = Field(default_factory=Channels,
                               description="Chat channels mdclaw listens on.")
    tasks: tuple[TaskSpec, ...] = Field((), description="Scheduled tasks declared in config.")
    media: Media = Field(default_factory=Media,
                         description="Files people send the assistant (saved in the group's "
                         "inbox/ folder).")
    transcription: Transcription | None = Field(
        None, description="Voice note transcription; without it the agent gets the audio "
        "file and a note that no transcription is configured.")
    integrations: Integrations = Field(
        default_factory=Integrations,
        description="Host-side capabilities agents may ask for (docs/integrations.md).")
    web: Web = Field(default_factory=Web, description="Web access for agents, through the host "
                     "(docs/integrations.md).")
    metrics: Metrics = Field(default_factory=Metrics,
                             description="Prometheus metrics for the operator (docs/metrics.md).")

    @field_validator("data_dir")
    @classmethod
    def _absolute_data_dir(cls, v: Path) -> Path:
        return Path(os.path.abspath(os.path.expanduser(str(v))))

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if not _DEFER_CROSS_KEY.get():
            problems, requires = cross_key_problems(self)
            if problems:
                raise CrossKeyError(problems, requires)
        return self

    # convenience -----------------------------------------------------------------
    @property
    def main_folder(self) -> str | None:
        return next((f for f, g in self.groups.items() if g.main), None)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "state.db"

    @property
    def web_server(self) -> Server | None:
        """The daemon's web server as configured: `server`, each key it leaves unset taken
        from its old name under `channels.http` when that is set (see old_server_keys);
        None for `server: null` (no web server)."""
        if self.server is None:
            return None
        old = old_server_keys(self)
        taken = {k: v for k, v in old.items() if k not in self.server.model_fields_set}
        return self.server.model_copy(update=taken) if taken else self.server

    @property
    def whatsapp_session_path(self) -> Path:
        """The WhatsApp session file (channels.whatsapp.session_file, relative to data_dir;
        default data_dir/whatsapp/session.sqlite3)."""
        wa = self.channels.whatsapp
        if wa is None or wa.session_file is None:
            return self.data_dir / "whatsapp" / "session.sqlite3"
        return self.data_dir / wa.session_file

    def group_timezone(self) -> str:
        return self.assistant.timezone

    def disk_limit(self, folder: str) -> int | None:
        """Bytes the group's files may take (groups.<g>.disk, else limits.disk); None: no
        limit."""
        group = self.groups.get(folder)
        text = group.disk if group is not None and group.disk else self.limits.disk
        return parse_size(text) if text else None

    def proxy_caps(self, folder: str) -> tuple[int, int]:
        """(connections, requests per minute) the credential proxy allows the group."""
        group = self.groups.get(folder)
        conns = group.proxy_connections if group and group.proxy_connections else None
        rate = (group.proxy_requests_per_minute
                if group and group.proxy_requests_per_minute else None)
        return (conns or self.limits.proxy_connections,
                rate or self.limits.proxy_requests_per_minute)

    def tool_timeout_seconds(self, folder: str) -> float:
        """The longest one bash tool call of the group may run (groups.<g>.tool_timeout,
        else limits.tool_timeout), in seconds."""
        group = self.groups.get(folder)
        value = group.tool_timeout if group is not None and group.tool_timeout else None
        return (value or self.limits.tool_timeout).total_seconds()

    def token_budget(self, folder: str) -> int | None:
        """Model tokens the group may use per UTC day (groups.<g>.tokens_per_day, else
        limits.tokens_per_day); None: no budget."""
        group = self.groups.get(folder)
        if group is not None and group.tokens_per_day:
            return group.tokens_per_day
        return self.limits.tokens_per_day

    def network_for(self, folder: str) -> str:
        """The container network of the group: `none` unless its `network:` names one the
        config allows (an unknown group, or one not allowed, gets `none`)."""
        group = self.groups.get(folder)
        net = group.network if group is not None and group.network else "none"
        return net if network_problem(self.runtime, net) is None else "none"


def network_problem(runtime: Runtime, network: str) -> str | None:
    """Why a group may not use container network `network`, with the fix; None if it may."""
    if network == "none":
        return None
    if network == "host":
        if runtime.allow_host_network:
            return None
        return ("'host' shares the host's network with the container (every service on "
                "the host, localhost included, becomes reachable by the agent): remove "
                "`network:` (no network), or, if you mean it, set "
                "`runtime.allow_host_network: true`")
    if network in runtime.allowed_networks:
        return None
    listed = (f"allowed: none, {', '.join(runtime.allowed_networks)}"
              if runtime.allowed_networks else "runtime.allowed_networks is empty")
    return (f"{network!r} is not an allowed network ({listed}): remove `network:` (no "
            f"network), or add {network!r} to `runtime.allowed_networks`")


def cross_key_problems(cfg: Config, names: dict[str, list[str]] | None = None,
                       ) -> tuple[list[Problem], list[tuple[tuple[str, ...], ...]]]:
    """What is wrong across keys of a config whose keys are each valid: each problem at the
    key it is about, with its value and the fix. Also, per problem, the entries it depends on
    (a problem about a name that is not there depends on that name's entry). `names`: the
    group and model names the file has and its groups marked main, when `cfg` holds only its
    valid entries."""
    names = names or {"groups": list(cfg.groups), "models": list(cfg.models),
                      "mains": [f for f, g in cfg.groups.items() if g.main]}
    problems: list[Problem] = []
    requires: list[tuple[tuple[str, ...], ...]] = []

    def add(path: tuple[str, ...], msg: str, *needs: tuple[str, ...]) -> None:
        problems.append((path, msg))
        requires.append(needs)

    mains = names["mains"]
    if len(mains) > 1:
        add(("groups", mains[1], "main"),
            f"exactly one group must have main: true; {_and(mains)} have it: keep it on the "
            "admin group only")
    elif cfg.groups and not mains:
        add(("groups",), "exactly one group must have main: true; found 0: add main: true to "
            "the admin group", ("groups",))
    seen: dict[str, str] = {}
    for folder, g in cfg.groups.items():
        if g.jid in seen:
            add(("groups", folder, "jid"),
                f"{g.jid!r} is also the jid of group {seen[g.jid]!r}: a chat belongs to one "
                "group; give this group its own chat or remove one of the two")
        else:
            seen[g.jid] = folder
        if g.network is not None:
            why = network_problem(cfg.runtime, g.network)
            if why:
                add(("groups", folder, "network"), why, ("runtime",))
        if g.model is not None and g.model not in cfg.models:
            add(("groups", folder, "model"),
                f"{g.model!r} is not in models ({_choices(names['models'], 'models')}): "
                f"name one of them or add {g.model!r} under models", ("models", g.model))
    if cfg.assistant.model is not None and cfg.assistant.model not in cfg.models:
        add(("assistant", "model"),
            f"{cfg.assistant.model!r} is not in models "
            f"({_choices(names['models'], 'models')}): name one of them or add "
            f"{cfg.assistant.model!r} under models", ("models", cfg.assistant.model))
    ids: set[str] = set()
    for n, t in enumerate(cfg.tasks):
        if t.id in ids:
            add(("tasks", str(n), "id"),
                f"{t.id!r} is the id of an earlier task too: give each task its own id")
        ids.add(t.id)
        if t.group not in cfg.groups:
            add(("tasks", str(n), "group"),
                f"{t.group!r} is not in groups ({_choices(names['groups'], 'groups')}): "
                "name one of them or add the group",
                ("groups", t.group))
        try:
            # A `once` time is checked for form only: once it has run it lies in the
            # past, and the config stays valid. Adding a new one that is already past is
            # refused by the reconciler.
            schedule.validate(t.schedule_type, t.schedule_value,
                              t.timezone or cfg.assistant.timezone,
                              now=_EPOCH if t.schedule_type == "once" else None)
        except schedule.ScheduleError as e:
            # Only a `once` time is read in a timezone (the assistant's, unless its own).
            add(("tasks", str(n), t.schedule_type), f"{e}",
                *([("assistant",)] if t.schedule_type == "once" and not t.timezone else []))
    ha = cfg.integrations.home_assistant
    if ha is not None and ha.dashboards_dir is not None:
        why = _container_tree_overlap(cfg, ha.dashboards_dir)
        if why:
            add(("integrations", "home_assistant", "dashboards_dir"),
                f"{str(ha.dashboards_dir)!r} {why}: the dashboards folder is the host's "
                "alone; put it outside data_dir's groups/, ipc/, sessions/ and every "
                "group mount", ("groups",))
    for path, msg in server_key_problems(cfg):
        add(path, msg, ("server",))
    wa = cfg.channels.whatsapp
    if wa is not None and wa.session_file is not None:
        # The session file holds the linked device's keys: never where an agent can reach.
        why = _container_tree_overlap(cfg, cfg.whatsapp_session_path)
        if why:
            add(("channels", "whatsapp", "session_file"),
                f"{str(wa.session_file)!r} {why}: the WhatsApp session holds the linked "
                "device's keys; keep it outside data_dir's groups/, ipc/, sessions/ and every "
                "group mount (the default is data_dir/whatsapp/session.sqlite3)", ("groups",))
    return problems, requires


def _container_tree_overlap(cfg: Config, path: Path) -> str | None:
    """Why `path` lies in (or holds) a folder a container can reach, or None."""
    def overlaps(a: Path, b: Path) -> bool:
        return a == b or a.is_relative_to(b) or b.is_relative_to(a)

    norm = Path(os.path.normpath(path))
    for tree in ("groups", "ipc", "sessions"):
        if overlaps(norm, cfg.data_dir / tree):
            return f"overlaps data_dir/{tree}"
    for folder, g in cfg.groups.items():
        for m in g.mounts:
            host = Path(os.path.normpath(os.path.expanduser(m.host)))
            if host.is_absolute() and overlaps(norm, host):
                return f"overlaps the mount {m.host!r} of group {folder!r}"
    return None


def _and(names: list[str]) -> str:
    quoted = [repr(n) for n in names]
    return (", ".join(quoted[:-1]) + " and " + quoted[-1]) if len(quoted) > 1 else quoted[0]


# Set by load_config, which runs cross_key_problems itself so that they are reported with
# every other problem of the file, each at its own key.
_DEFER_CROSS_KEY: ContextVar[bool] = ContextVar("mdclaw_defer_cross_key", default=False)


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config file: where, what, and the offending value (never a secret).
    A warning leaves the config valid."""

    path: str  # dotted location, e.g. groups.family.timeout
    message: str
    line: int | None = None
    severity: Literal["error", "warning"] = "error"

    def render(self, file: str) -> str:
        where = f"{file}:{self.line}" if self.line else file
        level = " warning:" if self.severity == "warning" else ""
        loc = f" {self.path}:" if self.path else ""
        return f"{where}:{level}{loc} {self.message}"

    def as_json(self, file: str) -> dict[str, Any]:
        return {"file": file, "line": self.line, "path": self.path, "message": self.message,
                "severity": self.severity}

    def sort_key(self) -> tuple[int, str]:
        """By line (problems of the whole file first), then key path."""
        return (self.line or 0, self.path)


def sorted_issues(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    return sorted(issues, key=ConfigIssue.sort_key)


@dataclass
class ConfigError(ConfigProblem):
    """The config could not be loaded; `issues` lists every problem found, by line."""

    file: str
    issues: list[ConfigIssue] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(i.render(self.file) for i in self.issues)


def find_config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """--config PATH, else $MDCLAW_CONFIG, else ./config.yaml, else /etc/mdclaw/config.yaml."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("MDCLAW_CONFIG")
    if env:
        return Path(env)
    for candidate in DEFAULT_CONFIG_PATHS:
        if candidate.exists():
            return candidate
    return DEFAULT_CONFIG_PATHS[0]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (YAML would silently keep the last)."""


def _line_map(text: str, file: str = "") -> tuple[dict[tuple[str, ...], int], list[ConfigIssue]]:
    """Map each key path in the document to its 1-based line; also report duplicate keys."""
    lines: dict[tuple[str, ...], int] = {}
    issues: list[ConfigIssue] = []
    root = yaml.compose(text, Loader=_LineLoader)

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: set[str] = set()
            for key_node, value_node in node.value:
                key = str(key_node.value)
                if key in seen:
                    issues.append(ConfigIssue(".".join(path + (key,)), f"key {key!r} appears twice",
                                              key_node.start_mark.line + 1))
                seen.add(key)
                lines[path + (key,)] = key_node.start_mark.line + 1
                walk(value_node, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (str(i),))

    if root is not None:
        walk(root, ())
    return lines, issues


def _fields_at(loc: tuple[str, ...]) -> list[str]:
    """Valid key names at the mapping `loc` (dict keys and list indexes are skipped)."""
    current: Any = Config
    i = 0
    while i < len(loc):
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return []
        f = current.model_fields.get(loc[i])
        if f is None:
            return []
        ann = f.annotation
        i += 1
        while True:
            origin = get_origin(ann)
            if origin is None:
                break
            args = [a for a in get_args(ann) if a is not type(None) and a is not Ellipsis]
            if origin in (dict, tuple, list):
                i += 1  # skip the key / index
                ann = args[-1] if args else None
            else:  # Union / Annotated / Literal
                inner = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
                ann = inner[0] if inner else (args[0] if args else None)
                if get_origin(ann) is None and not inner:
                    break
        current = ann
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Each key path of a YAML document (list items by index) to its 1-based line."""
    try:
        return _line_map(text)[0]
    except yaml.YAMLError:
        return {}


def line_of(path: tuple[str, ...], lines: dict[tuple[str, ...], int]) -> int | None:
    """The line of the key at `path`, else of its nearest enclosing key that is in the file
    (a missing key is reported where its mapping is)."""
    for k in range(len(path), -1, -1):
        if path[:k] in lines:
            return lines[path[:k]]
    return None


def issue_at(path: tuple[str, ...], message: str, lines: dict[tuple[str, ...], int],
             severity: Literal["error", "warning"] = "error") -> ConfigIssue:
    return ConfigIssue(".".join(path), message, line_of(path, lines), severity)


def _error_loc(err: Any) -> tuple[str, ...]:
    # dict-key validation errors carry a "[key]" marker: report them at the key.
    return tuple(str(p) for p in err["loc"] if str(p) != "[key]")


def _issues_from_validation(e: ValidationError,
                            lines: dict[tuple[str, ...], int]) -> list[ConfigIssue]:
    out: list[ConfigIssue] = []
    for err in e.errors(include_url=False):
        loc = _error_loc(err)
        cross = (err.get("ctx") or {}).get("error")
        if isinstance(cross, CrossKeyError):  # one issue per problem, each at its own key
            out += [issue_at(loc + path, msg, lines) for path, msg in cross.problems]
            continue
        path = ".".join(loc)
        line = line_of(loc, lines)
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "extra_forbidden":
            key = loc[-1] if loc else "?"
            valid = _fields_at(loc[:-1])
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
            msg = f"unknown key {key!r}"
            if close:
                msg += f"; did you mean {close[0]!r}?"
            elif valid:
                msg += f"; valid keys here: {', '.join(valid)}"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and err["type"] not in ("value_error",) and not isinstance(
                err.get("input"), dict):
            msg = f"{msg} (got {_short(err['input'])})"
        out.append(ConfigIssue(path, msg, line))
    return out


def load_config(path: str | os.PathLike[str] | None = None, *, text: str | None = None) -> Config:
    """Read and validate the config file at `path` (see find_config_path).

    Returns the frozen Config. Raises ConfigError listing every problem, each with the file,
    the line where possible, the key path and the offending value.
    """
    p = find_config_path(path)
    file = str(p)
    if text is None:
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(file, [ConfigIssue("", "config file not found; pass --config PATH "
                                                 "or set MDCLAW_CONFIG")]) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(file, [ConfigIssue("", f"cannot read config file: {e}")]) from None
    try:
        lines, dup_issues = _line_map(text, file)
        # _LineLoader is a SafeLoader (plus line numbers): no object is ever constructed.
        data = yaml.load(text, Loader=_LineLoader)  # noqa: S506
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(file, [ConfigIssue("", f"invalid YAML: {problem}", line)]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(file, [ConfigIssue("", f"the top level must be a mapping of keys, "
                                             f"got {type(data).__name__}", 1)])
    raw_dir = data.get("data_dir")
    if isinstance(raw_dir, str) and raw_dir and not os.path.isabs(os.path.expanduser(raw_dir)):
        # A relative data_dir is relative to the config file, not to the current directory.
        data = {**data, "data_dir": str(p.resolve().parent / raw_dir)}
    issues = list(dup_issues)
    cfg: Config | None = None
    token = _DEFER_CROSS_KEY.set(True)
    try:
        cfg = Config(**data)
        problems = cross_key_problems(cfg)[0]
    except ValidationError as e:
        issues += _issues_from_validation(e, lines)
        # The keys that are wrong on their own would hide the problems across keys: look
        # for those too, without the entries in error.
        problems = _cross_key_without(data, e)
    except TypeError as e:  # non-string keys at the top level
        issues.append(ConfigIssue("", f"invalid top-level key: {e}", 1))
        problems = []
    finally:
        _DEFER_CROSS_KEY.reset(token)
    issues += [issue_at(path, msg, lines) for path, msg in problems]
    if issues:
        raise ConfigError(file, sorted_issues(issues))
    assert cfg is not None
    return cfg


def _is_true(value: Any) -> bool:
    try:
        return TypeAdapter(bool).validate_python(value) is True
    except ValidationError:
        return False


def _cross_key_without(data: dict[str, Any], e: ValidationError) -> list[Problem]:
    """The cross-key problems of `data` with every entry that has an error left out (a
    group, a model or a task; a whole section otherwise), but only those that cannot depend on
    what was left out. Their paths are those of `data`. Called with the check deferred."""
    dropped: set[tuple[str, ...]] = set()
    errors = {_error_loc(err) for err in e.errors(include_url=False)}
    for loc in errors:
        if not loc:
            return []  # an error about the whole document: nothing to check across
        if loc[0] in ("groups", "models", "tasks") and len(loc) > 1:
            dropped.add(loc[:2])
        else:
            dropped.add(loc[:1])
    kept: dict[str, Any] = {k: v for k, v in data.items() if (k,) not in dropped}
    names: dict[str, list[str]] = {"mains": []}
    for section in ("groups", "models"):
        entries = data.get(section)
        names[section] = [str(k) for k in entries] if isinstance(entries, dict) else []
        if section == "groups" and isinstance(entries, dict):
            # A group in error is still main when its own main key is.
            names["mains"] = [str(k) for k, v in entries.items()
                              if ("groups", str(k), "main") not in errors
                              and isinstance(v, dict) and _is_true(v.get("main", False))]
        if isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items()
                             if (section, str(k)) not in dropped}
    task_index: list[int] = []  # index in `kept` -> index in `data`
    if isinstance(kept.get("tasks"), list):
        task_index = [n for n in range(len(kept["tasks"])) if ("tasks", str(n)) not in dropped]
        kept["tasks"] = [kept["tasks"][n] for n in task_index]
    try:
        problems, requires = cross_key_problems(Config(**kept), names)
    except (ValidationError, TypeError):
        return []  # the rest is not valid on its own either: report what was found

    def depends_on_dropped(needs: tuple[tuple[str, ...], ...]) -> bool:
        return any(d[:len(n)] == n or n[:len(d)] == d for n in needs for d in dropped)

    def original(path: tuple[str, ...]) -> tuple[str, ...]:
        if len(path) > 1 and path[0] == "tasks" and task_index:
            return ("tasks", str(task_index[int(path[1])]), *path[2:])
        return path

    return [(original(path), msg) for (path, msg), needs in zip(problems, requires, strict=True)
            if not depends_on_dropped(needs)]


# ------------------------------------------------------------------ the web server's keys
# `server.listen`, `server.secret_file` and `server.generate_secret` were once
# `channels.http.*` (the chat owned the web server). The old names still work: each is read as
# the new one (Config.web_server), check-config warns, and setting both to different values
# (or the old one beside `server: null`) is an error naming both keys.
SERVER_KEYS = ("listen", "secret_file", "generate_secret")


def old_server_keys(cfg: Config) -> dict[str, Any]:
    """The web server's keys set under their old names (`channels.http.<key>`)."""
    http = cfg.channels.http
    if http is None:
        return {}
    return {k: getattr(http, k) for k in SERVER_KEYS if getattr(http, k) is not None}


def server_key_problems(cfg: Config) -> list[Problem]:
    """An old name set beside `server: null`, or beside its new name with another value; and
    the chat enabled without a web server to serve it."""
    problems: list[Problem] = []
    for key, value in old_server_keys(cfg).items():
        if cfg.server is None:
            problems.append((("channels", "http", key),
                             f"channels.http.{key} is the old name of server.{key}, but "
                             "server is null (no web server): remove one of the two"))
        elif key in cfg.server.model_fields_set and getattr(cfg.server, key) != value:
            problems.append((("channels", "http", key),
                             f"channels.http.{key} ({_short(value)}) and server.{key} "
                             f"({_short(getattr(cfg.server, key))}) differ: channels.http.{key} "
                             f"is the old name of server.{key}; keep server.{key} only"))
    http = cfg.channels.http
    if cfg.server is None and http is not None and http.enabled:
        problems.append((("channels", "http"),
                         "the local HTTP chat is served by the daemon's web server, but server "
                         "is null: remove `server: null`, or turn the chat off "
                         "(channels.http.enabled: false)"))
    return problems


def old_server_key_warnings(cfg: Config) -> list[str]:
    """One warning per web server key set under its old name (check-config, start-up)."""
    return [f"channels.http.{key}: the old name of server.{key}, read as it; move it to "
            f"server.{key}" for key in old_server_keys(cfg)]


HTTP_SECRET_NAME = "http-secret"  # noqa: S105 - a file name, not a secret


def http_secret_path(cfg: Config) -> Path | None:
    """The web server's token file: `server.secret_file`, else the generated one in data_dir
    when `server.generate_secret` is on, else None (no token, or no web server)."""
    server = cfg.web_server
    if server is None:
        return None
    if server.secret_file is not None:
        return server.secret_file
    return cfg.data_dir / HTTP_SECRET_NAME if server.generate_secret else None


def ensure_http_secret(cfg: Config) -> Path | None:
    """http_secret_path(), generating the token first when it is to be generated and does
    not exist yet (a new random token, mode 0600, never replaced once written)."""
    path = http_secret_path(cfg)
    server = cfg.web_server
    if path is None or server is None or server.secret_file is not None:
        return path
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return path  # made on an earlier start (or by a racing one): keep it
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def service_credential_secrets(cfg: Config) -> list[tuple[str, Path]]:
    """The secret files this process cannot read because they are in the service's
    credentials ($CREDENTIALS_DIRECTORY is unset here), as (config key path, file path)."""
    return [(k, p) for k, p in iter_secret_files(cfg) if in_service_credentials(p)]


def iter_secret_files(cfg: Config) -> Iterator[tuple[str, Path]]:
    """Every configured secret file as (config key path, file path)."""
    for name, m in cfg.models.items():
        if m.api_key_file:
            yield f"models.{name}.api_key_file", m.api_key_file
    server = cfg.web_server
    if server is not None and server.secret_file is not None:
        key = ("server" if cfg.server is not None and "secret_file" in
               cfg.server.model_fields_set else "channels.http")
        yield f"{key}.secret_file", server.secret_file
    if cfg.channels.telegram:
        yield "channels.telegram.token_file", cfg.channels.telegram.token_file
    ha = cfg.integrations.home_assistant
    if ha is not None:
        yield "integrations.home_assistant.token_file", ha.token_file
    if cfg.web.search is not None and cfg.web.search.api_key_file is not None:
        yield "web.search.api_key_file", cfg.web.search.api_key_file


def secret_state(path: Path) -> str:
    """"set" when the secret file can be read and holds something, else "missing". The
    secret itself is read only to tell, never returned."""
    try:
        return "set" if read_secret(path) else "missing"
    except (OSError, UnicodeDecodeError):
        return "missing"


def config_for_display(cfg: Config) -> dict[str, Any]:
    """The config as JSON, each secret file shown as "set" or "missing" (never its path's
    content); for the operator page."""
    out: dict[str, Any] = cfg.model_dump(mode="json")
    for key, path in iter_secret_files(cfg):
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = secret_state(path)
    return out
