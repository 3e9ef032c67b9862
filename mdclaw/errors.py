"""The root of every mdclaw exception and its families.

Pure: imports nothing from mdclaw, so any module may raise or catch these.

    MdclawError
    ├── ConfigProblem   the config, a schedule, reconciling the config with the database
    ├── EngineError     the container engine, the agent image, a container run (and the
    │                   credential proxy it needs)
    ├── IpcError        command files: protocol, authorization, apply, quarantine, actions
    │                   (and the integrations they call), the one door's refusals (agentfs)
    ├── ChannelError    a chat service (a send that did not happen)
    └── StateError      the database, the outbox, tasks

Each module keeps its own specific classes (`ConfigError`, `EngineUnavailable`,
`ProtocolError`...) and derives them from their family; a class that callers (or pydantic)
catch as a builtin keeps that builtin base too, e.g. `class TaskError(StateError,
ValueError)`. `except MdclawError` therefore catches every failure mdclaw itself raises and
nothing else; `tests/test_errors.py` fails when an exception class under mdclaw/ is outside
the tree.
"""

from __future__ import annotations


class MdclawError(Exception):
    """Base of every exception mdclaw defines. The message is for a person."""


class ConfigProblem(MdclawError):
    """The configuration, a schedule value or the reconciliation of the config with the
    database cannot be used as it stands."""


class EngineError(MdclawError):
    """The container engine, the agent image or a container run failed."""


class IpcError(MdclawError):
    """A command file or an action request that cannot be understood, is not allowed, cannot
    be carried out, or a path in a container-writable folder the host refuses."""


class ChannelError(MdclawError):
    """A send did not happen. The message is safe to show (it never holds a secret).

    `permanent` means retrying cannot help (unknown chat, file too large, bot blocked);
    `retry_after` is the wait in seconds the chat service asked for, if any.
    """

    def __init__(self, message: str, *, permanent: bool = False,
                 retry_after: float | None = None, code: int | None = None) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.retry_after = retry_after
        self.code = code  # the service's status code, when it gave one


class StateError(MdclawError):
    """The state database, an outbox row or a task cannot be used or changed as asked."""


__all__ = ["ChannelError", "ConfigProblem", "EngineError", "IpcError", "MdclawError",
           "StateError"]
