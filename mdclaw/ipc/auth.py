"""Who may do what over IPC. Pure functions: the caller passes what the database says.

The writer is always the folder the file was found in (`Caller.folder`); a body claiming to
be someone else is refused. Main may act on any registered group; every other group only on
its own chats and its own tasks, and may send messages and files to the chats and groups of
its `may_send_to`. Group administration is main's alone, and the main flag
itself is never granted over IPC (the parser refuses it; config.yaml decides).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mdclaw.errors import IpcError
from mdclaw.ipc.protocol import GROUP_ADMIN_TYPES


class Unauthorized(IpcError):
    """The writer may not do this; str(e) says why (logged, never sent to the container)."""


@dataclass(frozen=True)
class Caller:
    folder: str
    is_main: bool
    jid: str | None
    chats: tuple[str, ...] = ()  # every chat of the group (() : `jid` alone)
    may_send_to: tuple[str, ...] = ()  # chats and group folders it may also send to

    @property
    def own_chats(self) -> tuple[str, ...]:
        return self.chats or ((self.jid,) if self.jid else ())


#: The commands `may_send_to` opens to other chats.
SENDS = ("message", "send_file")


def send_target(caller: Caller, group: str, first_chat: Mapping[str, str]) -> str:
    """The chat a send naming group `group` goes to (its first chat), if `caller` may send
    there: main, its own group, or a group listed in its `may_send_to`."""
    if not (caller.is_main or group == caller.folder or group in caller.may_send_to):
        raise Unauthorized(f"group {group!r} is not in groups.{caller.folder}.may_send_to")
    chat = first_chat.get(group)
    if chat is None:
        raise Unauthorized(f"there is no registered group {group!r} with a chat")
    return chat


def check_identity(caller: Caller, claimed: str | None) -> None:
    """Raise Unauthorized if the body names a group other than the folder it came from."""
    if claimed is not None and claimed != caller.folder:
        raise Unauthorized(f"the body claims to come from group {claimed!r}, but the file is "
                           f"in ipc/{caller.folder}/")


def _own_chat(caller: Caller) -> str:
    if not caller.jid:
        raise Unauthorized(f"group {caller.folder!r} has no chat; give chat_jid")
    return caller.jid


def check_chat_target(caller: Caller, chat_jid: str | None, jid_to_folder: Mapping[str, str],
                      what: str) -> tuple[str, str]:
    """The (chat, owning folder) `caller` may address for `what` (a message, a task...).

    None means the caller's (first) chat. Main may address any registered group's chat;
    others their own chats, and for a message or file also the chats and groups their
    `may_send_to` lists (the owning folder of a chat no group holds is ''). Raises
    Unauthorized otherwise.
    """
    chat = chat_jid or _own_chat(caller)
    if chat in caller.own_chats:
        return chat, caller.folder
    if caller.is_main:
        folder = jid_to_folder.get(chat)
        if folder is None:
            raise Unauthorized(f"{what}: chat {chat!r} is not a registered group's chat")
        return chat, folder
    owner = jid_to_folder.get(chat)
    if what in SENDS:
        if chat in caller.may_send_to or (owner is not None and owner in caller.may_send_to):
            return chat, owner or ""
        raise Unauthorized(f"{what}: {chat!r} is not in groups.{caller.folder}.may_send_to "
                           f"(nor one of the own chats of group {caller.folder!r})")
    raise Unauthorized(f"{what}: group {caller.folder!r} may only use its own chats "
                       f"({', '.join(caller.own_chats)}), not {chat!r}")


def check_task_access(caller: Caller, task_id: str, task_folder: str | None, op: str) -> None:
    """Raise Unauthorized unless `caller` may `op` the task owned by `task_folder`.

    A missing task (task_folder None) is reported as unknown, to everyone alike.
    """
    if task_folder is None:
        raise Unauthorized(f"{op}: no task {task_id!r}")
    if not caller.is_main and task_folder != caller.folder:
        raise Unauthorized(f"{op}: task {task_id!r} belongs to another group; group "
                           f"{caller.folder!r} may only change its own tasks")


def check_group_admin(caller: Caller, ctype: str) -> None:
    """Raise Unauthorized unless `caller` is main (register/unregister/refresh groups)."""
    assert ctype in GROUP_ADMIN_TYPES
    if not caller.is_main:
        raise Unauthorized(f"{ctype} is for the main group only; {caller.folder!r} is not main")


def check_group_target(caller: Caller, target_folder: str, what: str) -> None:
    """Raise Unauthorized unless `caller` may read group `target_folder`'s data."""
    if target_folder != caller.folder and not caller.is_main:
        raise Unauthorized(f"{what}: only the main group may read another group's data")
