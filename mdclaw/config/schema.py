"""The config's root model: `Config` (config.yaml, with MDCLAW_* environment overrides), its
own sections `limits`, `runtime` and `mount_policy`, and the rules across sections
(`cross_key_problems`: one main group, known models and groups, networks, task schedules,
host-only paths). The other sections are in schema_groups and schema_services.

The pydantic models are the single source of truth for the config: validation, the error
messages people read, `config.example.yaml` and the NixOS option descriptions all come from
them. Every model is frozen and forbids unknown keys, so a typo is an error that names the key,
where it is, and the nearest valid key. A field whose description ends in "(restart to
apply)" is read once at start: mdclaw.config.live names those keys for the reload.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from mdclaw import schedule
from mdclaw.config.schema_groups import AllowSenders, Assistant, Group, GroupMount, TaskSpec
from mdclaw.config.schema_people import (
    ApprovalMatch,
    ApprovalRule,
    Approvals,
    Person,
    PersonKey,
    people_problems,
)
from mdclaw.config.schema_services import (
    Channels,
    EmailChannel,
    HomeAssistant,
    HomeAssistantAllow,
    HttpChannel,
    Integrations,
    McpApprove,
    McpServer,
    McpServerName,
    Media,
    Metrics,
    ModelSpec,
    Server,
    SlackChannel,
    TelegramChannel,
    Transcription,
    Web,
    WebSearch,
    WhatsAppChannel,
)
from mdclaw.config.types import (
    FOLDER_CASE_RULE,
    CrossKeyError,
    Duration,
    Folder,
    Frozen,
    Problem,
    Size,
    SizeOrPercent,
    folder_key,
    format_duration,
    parse_size,
    short_repr,
)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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
        "chat is told when the budget resets. A request is sent only when the budget left "
        "covers the requests in flight plus its own reservation (see "
        "`limits.answer_tokens_estimate`), so a group spends at most its budget plus one "
        "answer. null: no budget. Per group: `groups.<g>.tokens_per_day`.")
    answer_tokens_estimate: int = Field(
        4096, ge=1, le=1_000_000, description="With a token budget (`tokens_per_day`): the "
        "tokens reserved for the answer of a model request whose body does not bound it "
        "(no `max_tokens`, `max_completion_tokens` or `max_output_tokens`). From the moment "
        "a request is sent upstream until its answer ends, it holds a reservation: its "
        "body's size in bytes for its input (a token stands for at least one byte) plus its "
        "`max_tokens` (at most 1,000,000) or this estimate for its answer. Requests go side "
        "by side only while the day's budget left covers all their reservations, else they "
        "wait for one in flight to end; one request alone goes while any budget is left. "
        "So a day's spend stays within the budget plus one answer, as long as each answer "
        "stays within its reservation: an unbounded answer longer than this estimate adds "
        "what it ran past. An answer cut short before the API reported its usage (the "
        "group stopped, the upstream broken off) counts as its reservation for what was "
        "not reported; when the agent hangs up, the answer is read on and counted.")
    action_jobs: int = Field(
        8, ge=1, le=256, description="Off-loop actions (web_fetch, web_search...) run at once, "
        "all groups together; more wait in the queue. An `ask_agent` question waiting for "
        "the other agent's answer takes no place here (only its group's "
        "`action_jobs_per_group`), so waiting chains never hold the places other actions, "
        "the asked agent's included, need.")
    action_jobs_per_group: int = Field(
        2, ge=1, le=256, description="Off-loop actions one group may have running at once, so "
        "one group cannot take every slot. An `ask_agent` question counts here until its "
        "answer comes (up to its timeout): a group waiting on that many questions runs its "
        "other actions after them.")
    ask_depth: int = Field(
        2, ge=1, le=10, description="How many agents may wait on each other through "
        "`ask_agent` at once: A asking B is one, B then asking C two. A question past it is "
        "refused with an error result naming this key; a question to an agent already "
        "waiting in the chain (A asks B, B asks A) is refused at any depth.")

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
                           description="state.db, ipc/ and groups/ live under it (restart to "
                           "apply).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Least severe log level written to stderr.")
    assistant: Assistant = Field(default_factory=Assistant,
                                 description="Who the assistant is and where it lives.")
    groups: dict[Folder, Group] = Field(
        default_factory=dict, description="Key: the group's folder name (1-64 letters, digits, "
        "'_' or '-'; not global or errors; unique without regard to case: `family` and "
        "`FAMILY` would share one folder on a case-insensitive file system).")
    people: dict[PersonKey, Person] = Field(
        default_factory=dict, description="The people mdclaw knows, by key (e.g. alex): "
        "their role and their identities on each channel (docs/approvals.md).")
    approvals: Approvals = Field(default_factory=Approvals,
                                 description="What needs a person's yes before it happens "
                                 "(docs/approvals.md).")
    limits: Limits = Field(default_factory=Limits,
                           description="Resource limits and timeouts. A reload (SIGHUP) applies "
                           "every one; those of a container from its group's next run.")
    runtime: Runtime = Field(default_factory=Runtime,
                             description="The container engine and the agent image (restart "
                             "to apply).")
    mount_policy: MountPolicy = Field(default_factory=MountPolicy,
                                      description="Which host folders groups may mount.")
    models: dict[str, ModelSpec] = Field(default_factory=dict,
                                         description="Model backends by name; groups pick one.")
    server: Server | None = Field(
        default_factory=Server,
        description="The daemon's web server: the operator page, /metrics and, when "
        "`channels.http` is enabled, the local chat (docs/web.md). null: no web server "
        "(restart to apply).")
    channels: Channels = Field(default_factory=Channels,
                               description="Chat channels mdclaw listens on (restart to "
                               "apply).")
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
                             description="Prometheus metrics for the operator, "
                             "docs/metrics.md (restart to apply).")
    mcp_servers: dict[McpServerName, McpServer] = Field(
        default_factory=dict, description="MCP servers the host runs (or reaches) for agents, "
        "by name; each group gets the tools `groups.<g>.mcp` allows, as `<server>__<tool>` "
        "(docs/mcp.md).")

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
    folders: dict[str, str] = {}  # folder_key -> the first group's folder
    for folder, g in cfg.groups.items():
        first = folders.setdefault(folder_key(folder), folder)
        if first != folder:
            add(("groups", folder),
                f"{folder!r} is the folder of group {first!r} but for case: "
                f"{FOLDER_CASE_RULE}; rename one of the two")
        for chat in g.all_chats:
            key = "jid" if chat == g.jid else "chats"
            if chat in seen:
                other = seen[chat]
                what = "the jid" if cfg.groups[other].jid == chat else "a chat"
                add(("groups", folder, key),
                    f"{chat!r} is also {what} of group {other!r}: a chat belongs to one "
                    f"group; give this group its own chat or remove one of the two (from "
                    f"{other!r} or from {folder!r})")
            else:
                seen[chat] = folder
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
        elif t.chat is not None and t.chat not in cfg.groups[t.group].all_chats:
            add(("tasks", str(n), "chat"),
                f"{t.chat!r} is not a chat of group {t.group!r} "
                f"({', '.join(cfg.groups[t.group].all_chats)}): name one of them",
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
    for folder, g in cfg.groups.items():
        for n, dest in enumerate(g.may_send_to):
            if ":" not in dest and dest not in cfg.groups:
                add(("groups", folder, "may_send_to", str(n)),
                    f"{dest!r} is neither a chat (a jid such as tg:123456) nor a group "
                    f"({_choices(names['groups'], 'groups')}): name a chat or a group",
                    ("groups", dest))
        for server in (g.mcp or {}):
            if server not in cfg.mcp_servers:
                known = _choices(list(cfg.mcp_servers), "mcp_servers")
                add(("groups", folder, "mcp", server),
                    f"{server!r} is not in mcp_servers ({known}): name one of them or add "
                    "it under mcp_servers", ("mcp_servers", server))
    for folder, g in cfg.groups.items():
        for n, other in enumerate(g.may_ask):
            if other == folder:
                add(("groups", folder, "may_ask", str(n)),
                    f"{other!r} is this group itself: an agent does not ask itself; remove it")
            elif other not in cfg.groups:
                add(("groups", folder, "may_ask", str(n)),
                    f"{other!r} is not in groups ({_choices(names['groups'], 'groups')}): "
                    "name one of them or add the group", ("groups", other))
    for name, srv in cfg.mcp_servers.items():
        if srv.cwd is not None:
            why = _container_tree_overlap(cfg, srv.cwd)
            if why:
                add(("mcp_servers", name, "cwd"),
                    f"{str(srv.cwd)!r} {why}: an MCP server runs on the host with mdclaw's "
                    "rights; give it a folder outside data_dir's groups/, ipc/, sessions/ and "
                    "every group mount", ("groups",))
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
    for (path, msg), needs in people_problems(cfg.people, cfg.approvals, cfg.groups):
        add(path, msg, *needs)
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


@contextmanager
def cross_key_checks_deferred() -> Iterator[None]:
    """Within this block, Config leaves cross_key_problems to its caller (load_config)."""
    token = _DEFER_CROSS_KEY.set(True)
    try:
        yield
    finally:
        _DEFER_CROSS_KEY.reset(token)


def _choices(names: list[str], what: str) -> str:
    names = sorted(names)
    return f"known: {', '.join(names)}" if names else f"no {what} are configured"


__all__ = ["AllowSenders", "AllowedRoot", "ApprovalMatch", "ApprovalRule", "Approvals",
           "Assistant", "Channels", "Config", "EmailChannel", "Group",
           "GroupMount", "HomeAssistant", "HomeAssistantAllow", "HttpChannel", "Integrations",
           "Limits", "McpApprove", "McpServer", "McpServerName", "Media", "Metrics",
           "ModelSpec", "MountPolicy", "Person", "Runtime", "SlackChannel", "TaskSpec",
           "TelegramChannel", "Transcription", "Web", "WebSearch", "WhatsAppChannel",
           "cross_key_checks_deferred", "cross_key_problems", "network_problem"]


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
                             f"channels.http.{key} ({short_repr(value)}) and server.{key} "
                             f"({short_repr(getattr(cfg.server, key))}) differ: "
                             f"channels.http.{key} is the old name of server.{key}; keep "
                             f"server.{key} only"))
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
