"""The IPC command model: one canonical typed command per kind, and the dialect parser.

Containers write JSON in several dialects (see docs/ipc-protocol.md). `parse_command` maps
any of them to one canonical frozen pydantic model, or raises ProtocolError with a reason a
person can act on. Nothing here touches the disk or the database.

These models are the one definition of the canonical form. The agent runner in the container
(which cannot import mdclaw) reads their JSON Schema from a generated file,
container/agent-runner/mdclaw_agent/commands_schema.json; regenerate it after changing a
model here:

    python -m mdclaw command-schema > container/agent-runner/mdclaw_agent/commands_schema.json

(tests/test_command_schema_fresh.py fails while it is stale).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from mdclaw.config import validate_folder
from mdclaw.errors import IpcError

TASK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
MAX_TEXT = 65536
# The largest file send_file may name (checked by the host when it copies the file out, and by
# the agent's send_file tool before it asks).
SEND_FILE_MAX_BYTES = 64 * 1024 * 1024


class ProtocolError(IpcError, ValueError):
    """A command body that cannot be understood; str(e) is the reason."""


class _Cmd(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", str_strip_whitespace=False)


Jid = Annotated[str, Field(min_length=1, max_length=256)]
TaskId = Annotated[str, Field(pattern=TASK_ID_PATTERN)]
# A group's folder name, as a target (checked against the registered groups when applied).
GroupName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


# Said in the schema too, so the agent runner's check refuses what the validator below does.
_ONE_TARGET: dict[str, Any] = {"not": {"required": ["chat_jid", "group"],
                                        "description": "give chat_jid or group, not both"}}


class _Send(_Cmd):
    """A message or a file: to `chat_jid`, or to group `group` (its first chat), not both."""

    model_config = ConfigDict(json_schema_extra=_ONE_TARGET)

    @model_validator(mode="after")
    def _one_target(self) -> _Send:
        if getattr(self, "chat_jid", None) is not None and getattr(self, "group", None):
            raise ValueError("give chat_jid or group, not both")
        return self


class SendMessage(_Send):
    type: Literal["message"] = "message"
    chat_jid: Jid | None = None
    group: GroupName | None = None
    text: str = Field(min_length=1, max_length=MAX_TEXT)
    sender: str | None = Field(None, max_length=256)
    reply_to: str | None = Field(None, max_length=256)


class SendFile(_Send):
    model_config = ConfigDict(json_schema_extra={**_ONE_TARGET,
                                                 "x-max-file-bytes": SEND_FILE_MAX_BYTES})

    type: Literal["send_file"] = "send_file"
    chat_jid: Jid | None = None
    group: GroupName | None = None
    file_path: str = Field(min_length=1, max_length=4096)
    file_name: str | None = Field(None, min_length=1, max_length=255)
    caption: str | None = Field(None, max_length=MAX_TEXT)

    @field_validator("file_name")
    @classmethod
    def _plain_name(cls, v: str | None) -> str | None:
        if v is not None and ("/" in v or "\0" in v or v in (".", "..")):
            raise ValueError("file_name must be a plain file name without '/'")
        return v


class React(_Cmd):
    type: Literal["react"] = "react"
    chat_jid: Jid | None = None
    message_id: str = Field(min_length=1, max_length=256)
    emoji: str = Field(min_length=1, max_length=32)


ScheduleType = Literal["cron", "interval", "once"]
ContextMode = Literal["group", "isolated"]


def _schedule_value(v: Any) -> Any:
    # Intervals are often written as numbers; keep them as the canonical string.
    if isinstance(v, bool):
        raise ValueError("schedule_value must be a string or a whole number")
    if isinstance(v, int):
        return str(v)
    return v


class ScheduleTask(_Cmd):
    type: Literal["schedule_task"] = "schedule_task"
    prompt: str = Field(min_length=1, max_length=MAX_TEXT)
    schedule_type: ScheduleType
    schedule_value: str = Field(min_length=1, max_length=256)
    context_mode: ContextMode = "group"
    chat_jid: Jid | None = None
    task_id: TaskId | None = None
    timezone: str | None = Field(None, min_length=1, max_length=64)

    _sv = field_validator("schedule_value", mode="before")(classmethod(
        lambda cls, v: _schedule_value(v)))


class UpdateTask(_Cmd):
    type: Literal["update_task"] = "update_task"
    task_id: TaskId
    prompt: str | None = Field(None, min_length=1, max_length=MAX_TEXT)
    schedule_type: ScheduleType | None = None
    schedule_value: str | None = Field(None, min_length=1, max_length=256)
    context_mode: ContextMode | None = None
    status: Literal["active", "paused"] | None = None
    timezone: str | None = Field(None, min_length=1, max_length=64)

    _sv = field_validator("schedule_value", mode="before")(classmethod(
        lambda cls, v: _schedule_value(v)))

    def changes(self) -> dict[str, Any]:
        """The fields this command sets (those not left out)."""
        return {k: v for k, v in self.model_dump(exclude={"type", "task_id"}).items()
                if v is not None}


class PauseTask(_Cmd):
    type: Literal["pause_task"] = "pause_task"
    task_id: TaskId


class ResumeTask(_Cmd):
    type: Literal["resume_task"] = "resume_task"
    task_id: TaskId


class CancelTask(_Cmd):
    type: Literal["cancel_task"] = "cancel_task"
    task_id: TaskId


class DeleteTask(_Cmd):
    type: Literal["delete_task"] = "delete_task"
    task_id: TaskId


class RefreshGroups(_Cmd):
    type: Literal["refresh_groups"] = "refresh_groups"


class RegisterGroup(_Cmd):
    type: Literal["register_group"] = "register_group"
    jid: Jid
    name: str = Field(min_length=1, max_length=128)
    folder: str = Field(min_length=1, max_length=64)
    trigger: str | None = Field(None, min_length=1, max_length=64)
    requires_trigger: bool = True

    @field_validator("folder")
    @classmethod
    def _folder(cls, v: str) -> str:
        return validate_folder(v)


class UnregisterGroup(_Cmd):
    type: Literal["unregister_group"] = "unregister_group"
    jid: Jid | None = None
    folder: str | None = Field(None, min_length=1, max_length=64)

    def model_post_init(self, _ctx: Any) -> None:
        if (self.jid is None) == (self.folder is None):
            raise ValueError("unregister_group needs exactly one of jid, folder")


class ActionRequest(_Cmd):
    type: Literal["action"] = "action"
    request_id: str = Field(pattern=REQUEST_ID_PATTERN)
    action: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    params: dict[str, Any] = Field(default_factory=dict)
    family: Literal["action", "farm_action", "memory_action"] = "action"


Command = Annotated[
    SendMessage | SendFile | React | ScheduleTask | UpdateTask | PauseTask | ResumeTask
    | CancelTask | DeleteTask | RefreshGroups | RegisterGroup | UnregisterGroup | ActionRequest,
    Field(discriminator="type"),
]
COMMAND_ADAPTER: TypeAdapter[Any] = TypeAdapter(Command)

COMMAND_TYPES = ("message", "send_file", "react", "schedule_task", "update_task", "pause_task",
                 "resume_task", "cancel_task", "delete_task", "refresh_groups",
                 "register_group", "unregister_group", "action")
OUTBOUND_TYPES = frozenset({"message", "send_file", "react"})
TASK_ID_TYPES = frozenset({"update_task", "pause_task", "resume_task", "cancel_task",
                           "delete_task"})
GROUP_ADMIN_TYPES = frozenset({"register_group", "unregister_group", "refresh_groups"})


def command_json_schema() -> dict[str, Any]:
    """The JSON Schema of a canonical command body: one alternative per type, chosen by `type`
    (its `discriminator.mapping` names each type's definition). What the validator checks
    beyond it: `register_group.folder` is a valid folder name, `send_file.file_name` has no
    '/', `unregister_group` has exactly one of jid/folder, `update_task` changes something;
    `schedule_value` may also be a whole number. `x-max-file-bytes` on send_file is the size
    limit of the file it names."""
    schema = COMMAND_ADAPTER.json_schema(mode="validation")
    return {
        "title": "mdclaw IPC command (canonical form)",
        "description": (
            "Generated from mdclaw/ipc/protocol.py by `python -m mdclaw command-schema > "
            "container/agent-runner/mdclaw_agent/commands_schema.json`; do not edit by hand "
            "(a test fails while it is stale). The agent runner's tools read it; "
            "docs/ipc-protocol.md describes the protocol."),
        **schema,
    }

# --------------------------------------------------------------------------- dialects

TYPE_ALIASES = {"send_message": "message", "farm_action": "action", "memory_action": "action"}

# Spellings accepted for each canonical field, everywhere.
_COMMON_ALIASES = {
    "taskId": "task_id",
    "replyTo": "reply_to",
    "filePath": "file_path",
    "fileName": "file_name",
    "messageId": "message_id",
    "requestId": "request_id",
    "contextMode": "context_mode",
    "scheduleType": "schedule_type",
    "scheduleValue": "schedule_value",
    "requiresTrigger": "requires_trigger",
}
_CHAT_ALIASES = {"chatJid": "chat_jid", "targetJid": "chat_jid", "jid": "chat_jid"}
_GROUP_JID_ALIASES = {"chatJid": "jid", "chat_jid": "jid"}
# Fields a dialect may carry that mdclaw accepts and ignores, by command type.
_IGNORED = {"schedule_task": frozenset({"model"})}
_IDENTITY_KEYS = ("source_group", "groupFolder")
_MAIN_FLAG_KEYS = ("main", "is_main", "isMain")


def _aliases_for(ctype: str) -> dict[str, str]:
    table = dict(_COMMON_ALIASES)
    if ctype in ("message", "send_file", "react", "schedule_task"):
        table.update(_CHAT_ALIASES)
    if ctype in ("register_group", "unregister_group"):
        table.update(_GROUP_JID_ALIASES)
    if ctype == "message":
        table["message"] = "text"
    return table


def _canonical_fields(ctype: str, fields: dict[str, Any]) -> dict[str, Any]:
    aliases = _aliases_for(ctype)
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key in _IGNORED.get(ctype, ()):
            continue
        name = aliases.get(key, key)
        if name in out and out[name] != value:
            raise ProtocolError(f"field {name!r} is given twice with different values "
                                f"(as {key!r} and another spelling)")
        out[name] = value
    return out


def _describe_validation(e: ValidationError, ctype: str) -> str:
    parts = []
    for err in e.errors(include_url=False)[:5]:
        loc = [str(p) for p in err["loc"] if str(p) != ctype]
        where = ".".join(loc) or "body"
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] == "missing":
            msg = "required field is missing"
        parts.append(f"{where}: {msg}")
    return f"invalid {ctype}: " + "; ".join(parts)


def parse_command(body: Any) -> tuple[Any, str | None]:
    """Map a decoded JSON body in any dialect to its canonical command.

    Returns (command, claimed_group) where claimed_group is the writer the body names
    (`source_group`/`groupFolder`), or None. Raises ProtocolError saying why the body is not
    a command (not an object, unknown type, bad or unknown field, conflicting spellings).
    """
    if not isinstance(body, dict):
        raise ProtocolError(f"a command must be a JSON object, got {type(body).__name__}")
    raw_type = body.get("type")
    if not isinstance(raw_type, str):
        raise ProtocolError("the command has no string field 'type'")
    family = raw_type if raw_type in ("farm_action", "memory_action", "action") else None
    ctype = TYPE_ALIASES.get(raw_type, raw_type)
    if ctype not in COMMAND_TYPES:
        raise ProtocolError(f"unknown command type {raw_type!r}; known: "
                            f"{', '.join(COMMAND_TYPES + tuple(TYPE_ALIASES))}")

    claims: list[Any] = [body[k] for k in _IDENTITY_KEYS if k in body]
    if "payload" in body:  # the envelope dialect: {type, payload, source_group}
        extra = set(body) - {"type", "payload", *_IDENTITY_KEYS}
        if extra:
            raise ProtocolError(f"envelope has unknown field(s) beside payload: "
                                f"{', '.join(sorted(extra))}")
        payload = body["payload"]
        if payload is None:
            payload = {}
        if not isinstance(payload, dict):
            raise ProtocolError("payload must be a JSON object")
        claims += [payload[k] for k in _IDENTITY_KEYS if k in payload]
        fields = {k: v for k, v in payload.items() if k not in _IDENTITY_KEYS}
    else:
        fields = {k: v for k, v in body.items() if k not in ("type", *_IDENTITY_KEYS)}

    claimed: str | None = None
    for c in claims:
        if not isinstance(c, str):
            raise ProtocolError("source_group/groupFolder must be a string")
        if claimed is not None and c != claimed:
            raise ProtocolError(f"the body names two different groups ({claimed!r}, {c!r})")
        claimed = c

    if ctype == "register_group":
        flag = [k for k in _MAIN_FLAG_KEYS if k in fields]
        if flag:
            raise ProtocolError("the main flag cannot be granted over IPC "
                                f"(field {flag[0]!r}); only config.yaml makes a group main")
    if ctype == "update_task" and "updates" in fields:  # the {taskId, updates: {...}} form
        updates = fields.pop("updates")
        if not isinstance(updates, dict):
            raise ProtocolError("update_task.updates must be a JSON object")
        for k, v in updates.items():
            if k in fields and fields[k] != v:
                raise ProtocolError(f"update_task sets {k!r} both in updates and beside it")
            fields[k] = v
    fields = _canonical_fields(ctype, fields)
    if ctype == "action":
        fields["family"] = family or "action"
    fields["type"] = ctype
    try:
        cmd = COMMAND_ADAPTER.validate_python(fields)
    except ValidationError as e:
        raise ProtocolError(_describe_validation(e, ctype)) from None
    except ValueError as e:  # model_post_init checks
        raise ProtocolError(f"invalid {ctype}: {e}") from None
    if isinstance(cmd, UpdateTask) and not cmd.changes():
        raise ProtocolError("update_task changes nothing: give at least one field to change")
    return cmd, claimed


def to_canonical_json(cmd: Any) -> dict[str, Any]:
    """The canonical flat body of `cmd` (what mdclaw's own tools write)."""
    d = cmd.model_dump(exclude_none=True)
    if isinstance(cmd, ActionRequest):
        d.pop("family", None)
    return d
