"""The reconciler: make the database and the disk match the config.

desired (Config) + actual (database rows, directories) -> Plan -> apply. Planning is pure
reading; `apply_plan` does the work. Running it twice plans nothing the second time.
A group removed from the config is deregistered, but its folders are never deleted; groups
registered at runtime over IPC are left alone.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mdclaw import agentfs, schedule
from mdclaw.config import FOLDER_CASE_RULE, Config, Group, TaskSpec, folder_clash, folder_key
from mdclaw.errors import ConfigProblem
from mdclaw.paths import (
    DATA_DIR_MODE,
    GLOBAL_DIR_MODE,
    GROUP_DIR_MODE,
    IPC_DIR_MODE,
    IPC_SUBDIRS,
    PRIVATE_DIR_MODE,
    Layout,
)
from mdclaw.senders import SenderPolicy
from mdclaw.state import Database
from mdclaw.state.conversations import get_cursor, has_own_cursor, newest_seq, set_cursor
from mdclaw.state.groups import GroupRow, delete_group, list_groups, upsert_group
from mdclaw.state.tasks import delete_task, insert_task, list_tasks, update_task_fields


@dataclass(frozen=True)
class Action:
    """One step of a plan. `kind` is one of the ACTION_KINDS below."""

    kind: str
    target: str
    detail: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "update_group":
            changes = ", ".join(f"{k}: {v['from']!r} -> {v['to']!r}"
                                for k, v in self.detail.get("changes", {}).items())
            return f"update group {self.target} ({changes})"
        if self.kind == "add_group":
            return f"add group {self.target} (jid {self.detail.get('jid')!r})"
        if self.kind == "deregister_group":
            return f"deregister group {self.target} (its files are kept)"
        if self.kind == "add_task":
            return (f"add task {self.target} (group {self.detail.get('group_folder')!r}, "
                    f"{self.detail.get('schedule_type')} {self.detail.get('schedule_value')!r})")
        if self.kind == "update_task":
            changes = ", ".join(f"{k}: {v['from']!r} -> {v['to']!r}"
                                for k, v in self.detail.get("changes", {}).items())
            again = "; new next_run" if self.detail.get("reschedule") else ""
            return f"update task {self.target} ({changes}){again}"
        if self.kind == "remove_task":
            return f"remove task {self.target} (no longer in the config)"
        if self.kind == "create_dir":
            return f"create {self.target} (mode {self.detail['mode']})"
        if self.kind == "fix_mode":
            return f"chmod {self.detail['mode']} {self.target} (was {self.detail['was']})"
        if self.kind == "replace_path":
            return f"replace {self.target} ({self.detail['was']}) with a directory"
        return f"{self.kind} {self.target}"


ACTION_KINDS = ("create_dir", "fix_mode", "replace_path", "add_group", "update_group",
                "deregister_group", "add_task", "update_task", "remove_task")


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    # Found in the database as it is, not caused by the config: reported, never blocking
    # (e.g. two registered group folders that differ only in case, from before the rule).
    warnings: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.actions

    def as_dict(self) -> dict[str, Any]:
        return {"actions": [asdict(a) for a in self.actions], "conflicts": self.conflicts,
                "warnings": self.warnings, "changes": len(self.actions)}


class ReconcileError(ConfigProblem, RuntimeError):
    """The config cannot be applied as it stands (e.g. a jid held by a runtime group)."""


def desired_row(folder: str, g: Group, cfg: Config) -> GroupRow:
    """The registered_groups row that config group `folder` should have."""
    cc: dict[str, Any] = {}
    if g.mounts:
        cc["mounts"] = [m.model_dump() for m in g.mounts]
    if g.timeout is not None:
        cc["timeout_ms"] = int(g.timeout.total_seconds() * 1000)
    if g.model is not None:
        cc["model"] = g.model
    if g.network is not None:
        cc["network"] = g.network
    if g.session != "shared":
        cc["session"] = g.session
    if g.may_send_to:
        cc["may_send_to"] = list(g.may_send_to)
    policy = (SenderPolicy(g.allow_senders.mode, frozenset(g.allow_senders.ids))
              if g.allow_senders is not None else None)
    return GroupRow(folder=folder, name=g.name, jid=g.jid,
                    trigger=g.effective_trigger(cfg.assistant),
                    requires_trigger=g.effective_requires_trigger(), is_main=g.main,
                    source="config", container_config=cc, allow_senders=policy,
                    chats=g.all_chats)


_COMPARED = ("name", "jid", "chats", "trigger", "requires_trigger", "is_main", "source",
             "container_config", "allow_senders")


def _shown(value: Any) -> Any:
    """A compared value as plans show it (plain data, so `reconcile --json` can print it)."""
    if isinstance(value, tuple):
        return list(value)
    return value.as_dict() if isinstance(value, SenderPolicy) else value

# Declarative tasks. The stored timezone of a config task is its effective zone (its own or
# the assistant's), so changing assistant.timezone reschedules the tasks that follow it.
_TASK_COMPARED = ("group_folder", "chat_jid", "prompt", "schedule_type", "schedule_value",
                  "context_mode", "timezone", "catch_up", "source")
_TASK_SCHEDULE = ("schedule_type", "schedule_value", "timezone")


def desired_task(spec: TaskSpec, cfg: Config) -> dict[str, Any]:
    """The scheduled_tasks fields that config task `spec` should have."""
    group = cfg.groups.get(spec.group)
    return {"group_folder": spec.group,
            "chat_jid": spec.chat or group.jid if group else "",
            "prompt": spec.prompt, "schedule_type": spec.schedule_type,
            "schedule_value": spec.schedule_value, "context_mode": spec.context_mode,
            "timezone": spec.timezone or cfg.assistant.timezone, "catch_up": spec.catch_up,
            "source": "config"}


def _plan_tasks(cfg: Config, db: Database, p: Plan) -> None:
    actual = {t.id: t for t in list_tasks(db)}
    for spec in cfg.tasks:
        want = desired_task(spec, cfg)
        have = actual.get(spec.id)
        if have is None:
            try:
                schedule.validate(want["schedule_type"], want["schedule_value"], want["timezone"])
            except schedule.ScheduleError as e:
                p.conflicts.append(f"task {spec.id!r}: {e}; give it a future time or remove "
                                   "it from the config")
                continue
            p.actions.append(Action("add_task", spec.id, dict(want)))
            continue
        if have.source != "config":
            p.conflicts.append(
                f"task {spec.id!r}: the id is already used by a task scheduled at runtime "
                f"(group {have.group_folder!r}); cancel that task or rename the config task")
            continue
        changes = {k: {"from": getattr(have, k), "to": want[k]}
                   for k in _TASK_COMPARED if getattr(have, k) != want[k]}
        if changes:
            p.actions.append(Action("update_task", spec.id, {
                "changes": changes,
                "reschedule": any(k in changes for k in _TASK_SCHEDULE)}))
    wanted = {t.id for t in cfg.tasks}
    for tid, have in actual.items():
        if have.source == "config" and tid not in wanted:
            p.actions.append(Action("remove_task", tid, {"group_folder": have.group_folder}))


def _apply_task(cfg: Config, conn: Any, a: Action) -> None:
    """One task action inside the reconcile transaction. Raises ReconcileError for a schedule
    that cannot be used any more (e.g. a `once` time that passed since the config was read)."""
    try:
        if a.kind == "add_task":
            spec = next(t for t in cfg.tasks if t.id == a.target)
            want = desired_task(spec, cfg)
            insert_task(conn, group_folder=want["group_folder"], chat_jid=want["chat_jid"],
                        prompt=want["prompt"], schedule_type=want["schedule_type"],
                        schedule_value=want["schedule_value"], timezone=want["timezone"],
                        context_mode=want["context_mode"], task_id=spec.id, source="config",
                        catch_up=want["catch_up"], task_timezone=want["timezone"])
        elif a.kind == "update_task":
            spec = next(t for t in cfg.tasks if t.id == a.target)
            want = desired_task(spec, cfg)
            fields = {k: (int(v["to"]) if k == "catch_up" else v["to"])
                      for k, v in a.detail["changes"].items()}
            if a.detail.get("reschedule"):
                value = schedule.validate(want["schedule_type"], want["schedule_value"],
                                          want["timezone"])
                fields["schedule_value"] = value
                fields["next_run"] = schedule.to_iso(schedule.first_run(
                    want["schedule_type"], value, want["timezone"]))
                row = conn.execute("SELECT status FROM scheduled_tasks WHERE id = ?",
                                   (a.target,)).fetchone()
                if row and row[0] == "completed":
                    fields["status"] = "active"  # a finished one-shot given a new time
            update_task_fields(conn, a.target, **fields)
        elif a.kind == "remove_task":
            delete_task(conn, a.target)
    except schedule.ScheduleError as e:
        raise ReconcileError(f"task {a.target!r}: {e}") from None


def _dirs(cfg: Config, folders: list[str]) -> list[tuple[Path, int, bool]]:
    """(path, mode, repairable) for every directory the layout needs."""
    lay = Layout(cfg.data_dir)
    out: list[tuple[Path, int, bool]] = [
        (lay.data_dir, DATA_DIR_MODE, False),
        (lay.groups_dir, 0o751, False),
        (lay.global_dir, GLOBAL_DIR_MODE, False),
        (lay.ipc_dir, 0o751, False),
        (lay.errors_dir, PRIVATE_DIR_MODE, False),
        (lay.sessions_dir, PRIVATE_DIR_MODE, False),
    ]
    for folder in folders:
        out.append((lay.group_dir(folder), GROUP_DIR_MODE, False))
        ipc = lay.group_ipc_dir(folder)
        out.append((ipc, IPC_DIR_MODE, False))
        # The container can replace these with symlinks or files: they are repairable.
        out.extend((ipc / sub, IPC_DIR_MODE, True) for sub in IPC_SUBDIRS)
    return out


def _where(data_dir: Path, path: Path) -> tuple[Path, tuple[str, ...]]:
    """(trusted root, components) that reach `path`, a folder mdclaw keeps in data_dir:
    every folder below data_dir is reached from it without following a symlink (some are
    a container's to write)."""
    if path == data_dir:
        return data_dir.parent, (data_dir.name,)
    return data_dir, path.relative_to(data_dir).parts


def _entry(data_dir: Path, path: Path) -> os.stat_result | None:
    """What stands at `path` itself (a symlink is not followed); None if nothing."""
    root, parts = _where(data_dir, path)
    try:
        with agentfs.opened(root, *parts[:-1]) as fd:
            return agentfs.lstat(fd, parts[-1])
    except FileNotFoundError:
        return None


def _make_dir(data_dir: Path, path: Path, mode: int, kind: str) -> None:
    """Carry out one folder action: make the folder (after removing what stood there, for
    `replace_path`) or correct its mode, by fchmod on the folder's own fd."""
    if kind == "create_dir" and path == data_dir:
        agentfs.make_dirs(path, mode)
    root, parts = _where(data_dir, path)
    with agentfs.opened(root, *parts[:-1]) as fd:
        if kind == "replace_path":
            agentfs.remove_entry(fd, parts[-1])
        if kind == "fix_mode":
            agentfs.set_mode(fd, parts[-1], mode)
        else:
            os.close(agentfs.ensure_dir(fd, parts[-1], mode, fix_mode=True))


def plan(cfg: Config, db: Database) -> Plan:
    """Compute what must change so the database and disk match `cfg`. Changes nothing."""
    p = Plan()
    actual = {g.folder: g for g in list_groups(db)}
    by_jid = {c: g for g in actual.values() for c in g.all_chats}

    for folder, g in cfg.groups.items():
        want = desired_row(folder, g, cfg)
        held = [(c, by_jid[c]) for c in g.all_chats if c in by_jid
                and by_jid[c].folder != folder and by_jid[c].folder not in cfg.groups]
        if held:
            chat, holder = held[0]
            p.conflicts.append(
                f"group {folder!r}: chat {chat!r} is already registered to group "
                f"{holder.folder!r} (source {holder.source}); unregister it or change the jid"
            )
            continue
        have = actual.get(folder)
        if have is None:
            # A new folder must not be a runtime group's but for case (a config group
            # that goes is a rename, and two config groups are refused by the schema).
            other = folder_clash(folder, [f for f, g in actual.items()
                                          if g.source != "config" or f in cfg.groups])
            if other is not None:
                p.conflicts.append(
                    f"group {folder!r}: the folder is that of registered group {other!r} "
                    f"(source {actual[other].source}) but for case: {FOLDER_CASE_RULE}; "
                    "unregister that group or rename this one")
                continue
            p.actions.append(Action("add_group", folder, {"name": want.name, "jid": want.jid,
                                                          "is_main": want.is_main}))
            continue
        changes = {k: {"from": _shown(getattr(have, k)), "to": _shown(getattr(want, k))}
                   for k in _COMPARED if getattr(have, k) != getattr(want, k)}
        if changes:
            p.actions.append(Action("update_group", folder, {"changes": changes}))

    for folder, have in actual.items():
        if have.source == "config" and folder not in cfg.groups:
            p.actions.append(Action("deregister_group", folder, {"jid": have.jid}))
        elif have.source != "config" and have.is_main and cfg.main_folder not in (None, folder):
            # Only the config decides which group is main.
            p.actions.append(Action("update_group", folder,
                                    {"changes": {"is_main": {"from": True, "to": False}}}))

    # Among the groups registered after this plan (config groups that go are deregistered).
    p.warnings.extend(folder_case_warnings(
        {f: g for f, g in actual.items() if g.source != "config" or f in cfg.groups}))
    folders = sorted(set(cfg.groups) | {f for f, g in actual.items() if g.source != "config"})
    for path, mode, repairable in _dirs(cfg, folders):
        try:
            st = _entry(cfg.data_dir, path)
        except agentfs.UnsafePath as e:
            p.conflicts.append(f"{path}: {e}")
            continue
        if st is None:
            p.actions.append(Action("create_dir", str(path), {"mode": f"{mode:04o}"}))
            continue
        if not stat.S_ISDIR(st.st_mode):
            kind = "symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            if repairable:
                p.actions.append(Action("replace_path", str(path),
                                        {"mode": f"{mode:04o}", "was": kind}))
            else:
                p.conflicts.append(f"{path} is a {kind}; mdclaw needs a directory there")
            continue
        have_mode = stat.S_IMODE(st.st_mode)
        if have_mode != mode:
            p.actions.append(Action("fix_mode", str(path),
                                    {"mode": f"{mode:04o}", "was": f"{have_mode:04o}"}))
    _plan_tasks(cfg, db, p)
    return p


def folder_case_warnings(groups: dict[str, GroupRow]) -> list[str]:
    """Registered groups whose folders differ only in case (registered before the rule, or
    by hand): each pair named, with what to do. Both keep working where names are
    case-sensitive (Linux); on macOS they share their folders."""
    by_key: dict[str, list[str]] = {}
    for folder in sorted(groups):
        by_key.setdefault(folder_key(folder), []).append(folder)
    out = []
    for same in by_key.values():
        if len(same) > 1:
            named = ", ".join(f"{f!r} (source {groups[f].source})" for f in same)
            out.append(f"registered groups {named} differ only in case: {FOLDER_CASE_RULE}; "
                       "unregister all but one (a group registered over IPC: "
                       "unregister_group; from the config: remove or rename it there)")
    return out


def apply_plan(cfg: Config, db: Database, p: Plan) -> None:
    """Carry out `p`. Directories first, then every database change in one transaction.

    Raises ReconcileError (changing nothing) if the plan has conflicts.
    """
    if p.conflicts:
        raise ReconcileError("; ".join(p.conflicts))
    for a in p.actions:
        if a.kind in ("create_dir", "replace_path", "fix_mode"):
            _make_dir(cfg.data_dir, Path(a.target), int(a.detail.get("mode", "0"), 8), a.kind)
    before = {g.folder: g for g in list_groups(db)}
    with db.transaction():
        if any(a.kind in ("add_group", "update_group") for a in p.actions):
            # One main at a time (a unique index): clear the old flag before setting the new.
            db.conn.execute("UPDATE registered_groups SET is_main = 0 WHERE folder IS NOT ?",
                            (cfg.main_folder,))
        for a in p.actions:
            if a.kind in ("add_group", "update_group"):
                if a.target in cfg.groups:
                    want = desired_row(a.target, cfg.groups[a.target], cfg)
                    upsert_group(db, want)
                    align_cursors(db, before.get(a.target), want)
                else:  # a runtime group losing a main flag it must not hold
                    db.conn.execute("UPDATE registered_groups SET is_main = 0 WHERE folder = ?",
                                    (a.target,))
            elif a.kind == "deregister_group":
                delete_group(db, a.target)
            elif a.kind in ("add_task", "update_task", "remove_task"):
                _apply_task(cfg, db.conn, a)


def align_cursors(db: Database, have: GroupRow | None, want: GroupRow) -> None:
    """Keep each conversation of a group where it was when its chats or `session` change,
    so no answered message is answered again: a chat that joins the group starts after its
    newest stored message; a switch to per_chat gives each chat the shared cursor; a switch
    back gives the shared conversation the furthest of the chats' cursors."""
    folder = want.folder
    old = set(have.all_chats) if have is not None else set()
    shared = get_cursor(db, folder)
    to_per_chat = want.per_chat and (have is None or not have.per_chat)
    for chat in want.all_chats:
        start = None
        if chat not in old and (have is not None or len(want.all_chats) > 1):
            start = newest_seq(db, chat)
        if to_per_chat and shared is not None:
            start = max(start or 0, shared)
        if start is not None and (to_per_chat or not has_own_cursor(db, folder, chat)):
            set_cursor(db, folder, start, chat)
    if have is not None and have.per_chat and not want.per_chat:
        own = [get_cursor(db, folder, c) for c in have.all_chats]
        known = [c for c in own if c is not None]
        if known:
            set_cursor(db, folder, max(known))


def reconcile(cfg: Config, db: Database, *, dry_run: bool = False) -> Plan:
    """Plan and (unless `dry_run`) apply. Returns the plan that was (or would be) applied."""
    p = plan(cfg, db)
    if not dry_run:
        apply_plan(cfg, db, p)
    return p
