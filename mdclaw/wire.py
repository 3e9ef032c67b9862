"""The host <-> container contract: the input document on stdin, the output blocks on stdout.

One definition, used by both sides. The host builds its input through `ContainerInput` and
reads every output block through `OutputBlock`; the agent runner (container/agent-runner,
standard library only, cannot import mdclaw) reads the JSON Schema generated from these
models, `mdclaw_agent/wire_schema.json`, checks its stdin against it, takes the input's
defaults from it and checks every block it writes against it. Regenerate it after changing
this module (a test fails while the committed file is stale):

    python -m mdclaw wire-schema > container/agent-runner/mdclaw_agent/wire_schema.json

The format is the one images have always read and written (camelCase keys, the markers
below), so an older image keeps working with a newer host. Writers write only what the
schema has; readers ignore keys they do not know (a newer peer) and read a `null` as the key
left out. The host reads a block leniently (`OutputBlock.from_dict`): an answer is not thrown
away because one detail has the wrong type.

Pure: imports nothing from mdclaw.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import GenerateJsonSchema, models_json_schema
from typing_extensions import TypeAliasType

# Each output block is one JSON document on its own line between these two lines.
OUTPUT_START = "---NANOCLAW_OUTPUT_START---"
OUTPUT_END = "---NANOCLAW_OUTPUT_END---"

Backend = TypeAliasType("Backend", Literal["claude", "openai"])
BACKENDS: tuple[str, ...] = get_args(Backend.__value__)

# Why a turn failed, as the runner reports it in an error block's `cause` (the host maps each
# to what happens next and to the chat message: mdclaw/failures.py, which adds the causes the
# host sees itself). The host reads a cause it does not know as "agent_crash".
Cause = TypeAliasType("Cause", Literal[
    "model_unreachable",   # nothing answers at the model's address (connection refused...)
    "model_disconnected",  # the model server closed the connection without a full answer
    "model_server_error",  # HTTP 5xx from the model server
    "rate_limited",        # HTTP 429 (retryAfter: seconds, when the API said)
    "over_budget",         # the account is out of credit/quota (HTTP 402, insufficient_quota)
    "context_too_long",    # the request is over the model's context (limit: what the API said)
    "model_refused",       # any other HTTP 4xx (httpStatus, apiMessage)
    "model_malformed",     # the answer was not the API's JSON (twice in a row)
    "turn_timeout",        # no answer from the model in time
    "tool_crash",          # a tool raised an unexpected error
    "agent_crash",         # the runner itself failed (a bug)
    "backend_missing",     # the backend the group needs is not in this image
    "key_missing",         # the host cannot read the model's key file (said by the proxy)
    "proxy_missing",       # the credential proxy's socket is not there
    "invalid_input",       # the ContainerInput on stdin was wrong (a host bug)
])
RUNNER_CAUSES: tuple[str, ...] = get_args(Cause.__value__)


class _Wire(BaseModel):
    # strict: JSON's own types only (no "1" for 1, no 1 for true); camelCase on the wire,
    # snake_case in Python (both accepted when building one).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True,
                              alias_generator=to_camel, populate_by_name=True)


class ContainerInput(_Wire):
    """What the agent is told on stdin. It has no secrets field, on purpose."""

    prompt: str = Field(description="This turn's prompt (the new messages, formatted).")
    group_folder: str = Field(description="The group's folder name (the IPC identity).")
    chat_jid: str = Field(description="The chat this run answers in (of a group with "
                                      "several chats: the chat of the message that started "
                                      "it; a follow-up may name another); the tools' default "
                                      "target.")
    is_main: bool = Field(False, description="The main group (admin tools).")
    is_scheduled_task: bool = Field(False, description="A scheduled task: one turn, no "
                                                       "follow-ups.")
    assistant_name: str = Field("Andy", description="The assistant's name in the chat.")
    session_id: str | None = Field(None, description="The conversation to resume, if any.")
    backend: Backend = Field("claude", description="Which model API the runner speaks.")
    model: str | None = Field(None, description="The model name (the backend's default "
                                                "when absent).")

    @field_validator("session_id", "model", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == "" else value  # as absent as null: the key is left out

    def __init__(self, prompt: str, group_folder: str, chat_jid: str, **fields: Any) -> None:
        # The three required fields may be given by position (`ContainerInput("hi", "fam",
        # "tg:2")`); the rest by name.
        given = {"prompt": prompt, "group_folder": group_folder, "chat_jid": chat_jid}
        super().__init__(**given, **fields)

    def to_json(self) -> bytes:
        """The stdin document: camelCase keys, a key whose value is null left out."""
        body = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return json.dumps(body, ensure_ascii=False).encode()


class Notice(_Wire):
    """Something the chat should be told besides a successful answer."""

    cause: Cause = Field(description="Why (today: context_too_long, the history was "
                                     "trimmed).")
    limit: str | None = Field(None, description="The model's context limit, as the API "
                                                "said it.")


class OutputBlock(_Wire):
    """One result of the runner: a turn's answer, or why the turn failed."""

    status: Literal["success", "error"]
    result: str | None = Field(None, description="The answer's text (null in an error).")
    new_session_id: str | None = Field(None, description="The conversation to resume next "
                                                         "time.")
    error: str | None = Field(None, description="What failed, for the log (never shown in "
                                                "the chat).")
    cause: Cause | None = Field(None, description="Why the turn failed (an error block).")
    http_status: int | None = Field(None, description="The model API's HTTP status.")
    api_message: str | None = Field(None, description="The model API's own error message.")
    retry_after: float | None = Field(None, description="Seconds the API asked to wait "
                                                        "(Retry-After).")
    limit: str | None = Field(None, description="The model's context limit, as the API "
                                                "said it.")
    notice: Notice | None = None

    # What `from_dict` did not take: unknown keys and fields of the wrong type, as given.
    _ignored: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def ignored(self) -> dict[str, Any]:
        return self._ignored

    @classmethod
    def read(cls, text: str) -> OutputBlock | None:
        """The block between the markers, or None when it is not a JSON object."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        return cls.from_dict(data) if isinstance(data, dict) else None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OutputBlock:
        """`data` read leniently: keys this host does not know and fields of the wrong type
        are left out (kept in `ignored`), a null is the key left out, and any status but
        "error" is a success (an answer is delivered)."""
        known = {f.alias or name for name, f in cls.model_fields.items()}
        body = {k: v for k, v in data.items() if k in known and v is not None}
        ignored = {k: v for k, v in data.items() if k not in known}
        body["status"] = "error" if data.get("status") == "error" else "success"
        while True:
            try:
                block = cls.model_validate(body)
                break
            except ValidationError as e:
                bad = {str(err["loc"][0]) for err in e.errors() if err["loc"]}
                bad = (bad & set(body)) - {"status"}
                if not bad:  # nothing left to leave out: a bug in this model
                    raise
                for key in bad:
                    ignored[key] = body.pop(key)
        block._ignored = ignored
        return block

    def to_json(self) -> str:
        """The block as the runner writes it (tests and stand-in agents)."""
        body = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return json.dumps({"status": body.pop("status"), "result": body.pop("result", None),
                           **body}, ensure_ascii=False)


class _Schema(GenerateJsonSchema):
    """No per-field titles (pydantic's "Groupfolder"); descriptions say what a field is."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def wire_json_schema() -> dict[str, Any]:
    """The contract as one JSON Schema document: the input and the block under `$defs`, the
    markers as `x-output-start` / `x-output-end`."""
    _, top = models_json_schema([(ContainerInput, "validation"), (OutputBlock, "validation")],
                                by_alias=True, schema_generator=_Schema)
    return {
        "title": "mdclaw host <-> container wire contract",
        "description": "Generated by `mdclaw wire-schema` from mdclaw/wire.py; do not edit by "
                       "hand. stdin: one ContainerInput; stdout: OutputBlocks, each between "
                       "the two marker lines.",
        "x-output-start": OUTPUT_START,
        "x-output-end": OUTPUT_END,
        **top,
    }


__all__ = ["BACKENDS", "OUTPUT_END", "OUTPUT_START", "RUNNER_CAUSES", "Backend", "Cause",
           "ContainerInput", "Notice", "OutputBlock", "wire_json_schema"]
