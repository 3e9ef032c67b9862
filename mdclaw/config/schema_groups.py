"""Who the assistant is, its groups and their tasks: the `assistant`, `groups` and `tasks`
sections of config.yaml (the rules across sections are in mdclaw.config.schema)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from mdclaw.config.schema_people import ApprovalRule, Member
from mdclaw.config.schema_services import McpToolGlob
from mdclaw.config.types import (
    CrossKeyError,
    Duration,
    Frozen,
    IsoTime,
    SenderId,
    Size,
    TimeZone,
)


class Assistant(Frozen):
    name: str = Field("Andy", min_length=1, max_length=64,
                      description="The assistant's name; the default trigger is '@' + name.")
    timezone: TimeZone = Field("UTC", description="IANA timezone; schedules are evaluated in it.")
    model: str | None = Field(None, description="Default model: a key of `models`.")


class GroupMount(Frozen):
    host: str = Field(description="Absolute host path; must lie under mount_policy.allowed_roots.")
    container: str = Field(description="Name under /workspace/extra/ inside the container.")
    readonly: bool = Field(True, description="Mount read-only (read-write needs an allowing root).")


class AllowSenders(Frozen):
    mode: Literal["trigger", "drop"] = Field(
        "trigger", description="What happens to a message from a sender not in `ids`: "
        "trigger: it is kept as context for the next turn an allowed sender starts, but never "
        "starts a turn nor reaches a running one; drop: it is not stored at all. Refused "
        "messages are counted (`mdclaw groups list`) and never answered.")
    ids: tuple[SenderId, ...] = Field(
        description="Sender ids that may drive the agent, as the channel reports the sender: "
        "Telegram user ids (e.g. '123456789', without 'tg:'), WhatsApp jids (e.g. "
        "'4915112345678@s.whatsapp.net', without 'wa:'), Slack user ids (e.g. 'U0123ABCD'), "
        "Discord user ids (e.g. '123456789012345678'; Developer Mode → Copy User ID), "
        "Matrix user ids (e.g. '@alice:example.org'), "
        "the local HTTP channel's `sender` field. An empty list lets no one.")


ChatJid = Annotated[str, Field(min_length=1, max_length=256)]


class Group(Frozen):
    name: str = Field(min_length=1, description="Display name of the group.")
    jid: str = Field("", description="The chat this group answers in, e.g. tg:123456. "
                     "Required unless `chats` is given (empty: the first of `chats`; with "
                     "both, `jid` is the first chat).")
    chats: tuple[ChatJid, ...] = Field(
        (), description="Every chat this group's agent answers in, on any channel, e.g. "
        "[tg:123456, hl:me]: one agent, one folder and memory for all of them. The first "
        "(or `jid`) is where tasks report and where a message the agent sends without "
        "naming a chat goes (docs/configuration.md: 'One agent in many chats').")
    session: Literal["shared", "per_chat"] = Field(
        "shared", description="With several chats: shared: one conversation, every message "
        "marked with the chat it came from and answered in that chat; per_chat: a "
        "conversation of its own for each chat, over the same folder, memory and tasks.")
    may_send_to: tuple[ChatJid, ...] = Field(
        (), description="Chats (jids) and groups (names of `groups`) this group's agent may "
        "send messages and files to besides its own chats; anything else is refused "
        "(approval rules apply on top).")
    main: bool = Field(False, description="The admin group; exactly one group is main.")
    requires_trigger: bool | None = Field(
        None, description="Only answer messages that address the assistant: '@Name' "
        "anywhere, the name first followed by ',' or ':', a reply to the assistant, or the "
        "chat service's own mention of the bot (default: true, false for the main group)."
    )
    trigger: str | None = Field(None, description="The name a message addresses the "
                                "assistant by; default '@' + assistant name.")
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
    members: tuple[Member, ...] | None = Field(
        None, description="Who may drive this group's agent: people (keys of `people`) and "
        "roles (role:owner, role:admin, role:member). Unset: everyone in the chat (or "
        "allow_senders). A person who is not a member is context only; anyone who is no "
        "person at all is an unknown sender.")
    unknown_senders: Literal["ignore", "ask_owner", "allow"] = Field(
        "ignore", description="What happens to a message from someone who is no person of "
        "`people` (needs members): ignore: not stored, never answered; ask_owner: the owner "
        "gets an admit card, and once admitted the sender may talk (mdclaw people list|revoke); "
        "allow: treated as a member.")
    approvals: tuple[ApprovalRule, ...] = Field(
        (), description="Approval rules for this group only, after the global ones (a later "
        "matching rule wins; approver: none loosens), docs/approvals.md.")
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
    may_ask: tuple[str, ...] = Field(
        (), description="Groups whose agent this group's agent may ask a question "
        "(`ask_agent`): the other agent runs one turn with the question, marked as from this "
        "agent (never from a person), and its answer is the action's result; nothing is "
        "posted in the other group's chat. Empty (the default): it may ask none. Chains of "
        "asks are bounded by `limits.ask_depth`; a cycle is refused (docs/ipc-protocol.md).")
    mcp: dict[str, tuple[McpToolGlob, ...]] | None = Field(
        None, description="MCP tools this group's agent may call: for each server of "
        "`mcp_servers`, fnmatch patterns of its tool names, e.g. {time: ['*'], git: "
        "[git_status, git_log]}. Unset or {}: none (docs/mcp.md).")

    @model_validator(mode="before")
    @classmethod
    def _first_chat(cls, data: Any) -> Any:
        # `chats` alone: its first chat is the group's `jid` (what one-chat code reads).
        if isinstance(data, dict) and not data.get("jid") and isinstance(
                data.get("chats"), (list, tuple)) and data["chats"]:
            return {**data, "jid": data["chats"][0]}
        return data

    @model_validator(mode="after")
    def _some_chat(self) -> Group:
        if not self.jid:
            raise CrossKeyError([(("jid",), "a group needs a chat: give `jid: <chat>` or "
                                  "`chats: [<chat>, ...]`")])
        seen: set[str] = set()
        for n, c in enumerate(self.chats):
            if c in seen:
                raise CrossKeyError([(("chats", str(n)), f"{c!r} is listed twice: list each "
                                      "chat once")])
            seen.add(c)
        return self

    @property
    def all_chats(self) -> tuple[str, ...]:
        """Every chat of the group, the first one first (`jid`, then `chats`)."""
        return (self.jid, *(c for c in self.chats if c != self.jid))

    def _only_on(self, prefix: str) -> bool:
        """Every chat of the group is on the channel of `prefix` (sender ids are then that
        channel's)."""
        return all(c.startswith(prefix) for c in self.all_chats)

    @model_validator(mode="after")
    def _telegram_sender_ids(self) -> Group:
        if self.allow_senders is None or not self._only_on("tg:"):
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

    @model_validator(mode="after")
    def _discord_sender_ids(self) -> Group:
        if self.allow_senders is None or not self._only_on("dc:"):
            return self
        bad = [(n, i) for n, i in enumerate(self.allow_senders.ids) if not i.isdigit()]
        if bad:
            raise CrossKeyError([
                (("allow_senders", "ids", str(n)),
                 f"{i!r} is not a Discord user id; write the number (Discord: User Settings → "
                 "Advanced → Developer Mode, then a person's name → Copy User ID), never a "
                 "name") for n, i in bad])
        return self

    @model_validator(mode="after")
    def _matrix_sender_ids(self) -> Group:
        if self.allow_senders is None or not self._only_on("mx:"):
            return self
        bad = [(n, i) for n, i in enumerate(self.allow_senders.ids)
               if not re.match(r"^@[^:\s]+:\S+\Z", i)]
        if bad:
            raise CrossKeyError([
                (("allow_senders", "ids", str(n)),
                 f"{i!r} is not a Matrix user id; write @name:server (e.g. "
                 "'@alice:example.org', as the person's profile shows it), never a display "
                 "name") for n, i in bad])
        return self

    def effective_trigger(self, assistant: Assistant) -> str:
        return self.trigger or f"@{assistant.name}"

    def effective_requires_trigger(self) -> bool:
        return (not self.main) if self.requires_trigger is None else self.requires_trigger


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
    chat: str | None = Field(None, min_length=1, description="The chat the task reports to: "
                             "one of its group's chats (default: the group's first).")

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

