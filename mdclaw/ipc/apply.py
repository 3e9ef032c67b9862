"""Applying command files: read, parse, authorize, change state, record, remove.

A batch of files (fair shares from every group with work) is applied in one SQLite
transaction. Each file's command rolls back alone when it fails (a SAVEPOINT around it, or,
for a command whose only write is one statement, that statement's own atomicity), and each
file gets its own ledger row keyed by (group, sub/name, sha256@inode.ctime). Only after COMMIT are
applied files removed and rejected ones quarantined. After a crash anywhere, a file whose
ledger row exists is only finished (removed or quarantined), never applied again; a file
without one was not applied and is processed normally.

A command or action an approval rule matches (mdclaw.approvals.rules.rule_for, asked after
every authorization check) is not applied: an approval is opened instead, in the same
transaction, with the canonical command as stored and a card to each approver (an off-loop
action's job waits in `awaiting_approval`, and its caller gets an interim result saying
so). An off-loop action no rule matched may still be held by its own `needs_person` (an MCP
tool that is not read-only): for the owner, under the rule name it gives. The file is
consumed like any other. `settle` carries out decided approvals: an
approved command is applied here, from the stored request, in the transaction that marks
the approval settled, so it runs exactly once; notes and card edits go with it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from mdclaw import agentfs, metrics, schedule
from mdclaw.approvals import flow as approvals
from mdclaw.approvals import store as approval_store
from mdclaw.approvals.rules import Request, Rule, Unmatched, effective_rules, rule_for
from mdclaw.config import FOLDER_CASE_RULE, Config, LiveConfig, folder_clash
from mdclaw.errors import IpcError
from mdclaw.ipc import protocol as P
from mdclaw.ipc.actions import (
    ActionContext,
    ActionFailed,
    ActionSpec,
    action_refusal,
    check_request,
    get_spec,
    question_of,
    run_action,
)
from mdclaw.ipc.auth import (
    Caller,
    Unauthorized,
    check_chat_target,
    check_group_admin,
    check_identity,
    check_task_access,
    send_target,
)
from mdclaw.ipc.files import (
    COMMAND_DIRS,
    GroupDirs,
    Rejected,
    UnsafePath,
    Vanished,
    decode_json,
    read_command_file,
)
from mdclaw.ipc.quarantine import Quarantine
from mdclaw.ipc.spool import check_source, spool_pending
from mdclaw.ipc.writers import write_action_result, write_snapshots
from mdclaw.paths import Layout
from mdclaw.people import People
from mdclaw.schedule import iso_now, to_iso, utc_now
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, delete_group, list_groups, upsert_group
from mdclaw.state.outbox import OutboxRow, enqueue, has_open_rows
from mdclaw.state.tasks import (
    TaskError,
    cancel_task,
    change_refusal,
    delete_task,
    get_task,
    insert_task,
    pause_task,
    resume_task,
    update_task_fields,
)

log = logging.getLogger("mdclaw.ipc")

LEDGER_KEEP = timedelta(days=7)
SETTLE_NS = 1_000_000_000  # the watcher looks again at an unparsable file younger than this


# Commands whose apply makes every check first and then writes one row with one statement
# (the outbox INSERT of mdclaw.state.outbox.enqueue).
ONE_WRITE = (P.SendMessage, P.React)


class ApplyError(IpcError):
    """A well-formed, authorized command that cannot be carried out (unknown task...)."""


@dataclass(slots=True)
class Item:
    folder: str
    sub: str
    name: str
    dir_fd: int
    key: str = ""
    gen: str = ""
    cmd: Any = None
    claimed: str | None = None
    reason: str | None = None
    outcome: str = ""  # applied | rejected | gone | done (already in the ledger)
    ledger_outcome: str = ""
    held: int | None = None  # the approval it waits for (consumed, not applied yet)
    # The outbox row it wrote already claimed, handed to the worker after COMMIT (only for
    # files of a batch: `handoff`; never for an approved command carried out by settle).
    handoff: bool = False
    direct: OutboxRow | None = None
    # Its text delivered in this transaction by a channel that writes this database (the
    # chat page; `direct` is then its row, written `sent`): what to do after COMMIT.
    local: Callable[[], None] | None = None

    @property
    def ledger_name(self) -> str:
        return f"{self.sub}/{self.name}"

    @property
    def ctype(self) -> str | None:
        return getattr(self.cmd, "type", None)


class DirectOutbox(Protocol):
    """What the engine needs of the outbox worker to hand it a row it just committed
    (mdclaw.outbox.OutboxWorker)."""

    def accepts(self, jid: str) -> bool: ...

    def hand_off(self, rows: list[OutboxRow]) -> bool: ...

    def writes_locally(self, jid: str) -> bool: ...

    def write_locally(self, conn: sqlite3.Connection, jid: str, text: str | None, *,
                      reply_to: str | None, sender: str | None
                      ) -> Callable[[], None] | None: ...

    def written_locally(self, rows: list[tuple[OutboxRow, Callable[[], None]]]) -> None: ...


@dataclass
class Effects:
    task_folders: set[str] = field(default_factory=set)
    groups_changed: bool = False
    files: bool = False  # send_file rows wait for their host copy
    jobs: bool = False  # off-loop action jobs were queued
    approvals: list[int] = field(default_factory=list)  # approvals opened (cards queued)


@dataclass
class BatchResult:
    applied: int = 0
    rejected: int = 0
    finished: int = 0  # already in the ledger: only removed / quarantined now
    vanished: int = 0
    deferred: int = 0  # unparsable but just written: looked at again after SETTLE_NS

    def add(self, other: BatchResult) -> None:
        self.applied += other.applied
        self.rejected += other.rejected
        self.finished += other.finished
        self.vanished += other.vanished
        self.deferred += other.deferred


class IpcEngine:
    """The synchronous core shared by the watcher loop and `mdclaw ipc drain`."""

    # A round (one transaction) holds at most `batch_max` files (about 50-100 µs each), so
    # another group's command, or the outbox, waits for the loop only a few milliseconds.
    # A group alone with work takes `batch_per_group` files a round (fewer, larger
    # transactions for a flood); while several have work each takes at most `batch_shared`,
    # so a quiet group's command is in a short round behind at most one long one.
    def __init__(self, cfg: Config | LiveConfig, db: Database, *, batch_per_group: int = 64,
                 batch_max: int = 128, batch_shared: int = 16, settle_ns: int = 0) -> None:
        # The config in force is read at use time (self.cfg); the quarantine's caps follow
        # a reload through _config_changed.
        self.live = LiveConfig.of(cfg)
        cfg = self.live.current
        self.settle_ns = settle_ns
        self.db = db
        self.layout = Layout(cfg.data_dir)
        self.batch_per_group = batch_per_group
        self.batch_max = batch_max
        self.batch_shared = batch_shared
        agentfs.make_dirs(self.layout.ipc_dir, 0o751)
        self.ipc_root_fd = agentfs.open_root(self.layout.ipc_dir)
        self.quarantine = Quarantine(self.layout.errors_dir, cfg.limits.errors_max_files,
                                     cfg.limits.errors_max_bytes)
        self.live.subscribe(self._config_changed)
        self.dirs: dict[str, GroupDirs] = {}
        self.rows: dict[str, GroupRow] = {}
        # Where snapshot rewrites go: written at once by default; the watcher hands them to a
        # background SnapshotWriter instead.
        self.snapshots: Callable[..., None] = self._write_snapshots
        # Applied files are removed at once by default; the watcher uses a BackgroundRemover.
        self.remover: BackgroundRemover | None = None
        # Files agents send are copied into the spool at once by default (`ipc drain`); the
        # watcher hands that to a FileSpooler thread instead.
        self.spool: Callable[[], None] = self._spool_now
        # Called with the batch's items right after COMMIT (benchmarks time commits with it).
        self.on_commit: Callable[[list[Item]], None] | None = None
        # The daemon's outbox worker: a message or reaction to a chat with nothing else
        # unfinished is written already claimed and handed to it after COMMIT (Item.direct),
        # so it goes out without the worker's look for due rows and claim transaction.
        self.outbox: DirectOutbox | None = None
        # Called after a COMMIT that queued off-loop action jobs (the ActionWorker's wake).
        self.on_jobs: Callable[[], None] | None = None
        # Called with the approvals a settle pass carried out (the daemon: admitted senders'
        # messages to run, metrics).
        self.on_settled: Callable[[list[approval_store.Approval]], None] | None = None
        # The chat a group's agent is answering now (the daemon: the orchestrator's running
        # conversation's), called from the IPC thread: a held request's outcome note goes
        # there. None, or None returned: the group's first chat.
        self.answering: Callable[[str], str | None] | None = None
        self._db_mark: tuple[int, int] | None = None
        # Made from self.rows when first needed and forgotten whenever self.rows changes
        # (refresh_groups, a group command): every chat's group, each group's Caller.
        self._jid_map: dict[str, str] | None = None
        self._callers: dict[str, Caller] = {}
        # The round's one timestamp (ledger rows, outbox rows, quarantine notes, jobs).
        self._now = ""
        # Chats whose page got a row in this round's transaction (Item.local): one a round,
        # the chat page learns its kept rows before each.
        self._local_chats: set[str] = set()
        self.refresh_groups()

    @property
    def cfg(self) -> Config:
        """The config in force now."""
        return self.live.current

    def _config_changed(self, old: Config, new: Config) -> None:
        self.quarantine.set_caps(new.limits.errors_max_files, new.limits.errors_max_bytes)

    def close(self) -> None:
        for gd in self.dirs.values():
            gd.close()
        self.dirs.clear()
        self.quarantine.close()
        os.close(self.ipc_root_fd)

    # ------------------------------------------------------------------ groups
    def refresh_groups(self) -> bool:
        """Re-read registered groups; open folders of new ones, close removed ones.

        Returns True if the set of folders changed."""
        self.rows = {g.folder: g for g in list_groups(self.db)}
        self._rows_changed()
        changed = False
        for folder in list(self.dirs):
            if folder not in self.rows:
                self.dirs.pop(folder).close()
                changed = True
        for folder in self.rows:
            if folder not in self.dirs:
                self.dirs[folder] = GroupDirs(self.ipc_root_fd, folder)
                changed = True
        return changed

    def _rows_changed(self) -> None:
        self._jid_map = None
        self._callers = {}

    def _jids(self) -> dict[str, str]:
        """{chat: its group's folder} of every registered group's chats (kept while
        self.rows stays as it is: a round no longer builds it for every group)."""
        if self._jid_map is None:
            self._jid_map = {c: g.folder for g in self.rows.values() for c in g.all_chats}
        return self._jid_map

    def main_folder(self) -> str | None:
        return next((f for f, g in self.rows.items() if g.is_main), None)

    # ------------------------------------------------------------------ listing
    def collect(self, targets: dict[str, tuple[str, ...]] | None = None, *,
                cheap: bool = False, names: dict[str, dict[str, set[str]]] | None = None,
                limit: int | None = None) -> dict[str, list[tuple[str, str]]]:
        """Pending files per group, in order: {folder: [(name, sub), ...]}.

        `targets` limits the listing to some folders of some groups (inotify said so);
        `names` are the file names inotify reported since the last call ({folder: {sub:
        names}}), which lets folders with a queue of known names skip their listing (see
        GroupDirs.pending); `limit` keeps the first so many files of each group."""
        out: dict[str, list[tuple[str, str]]] = {}
        # With targets, only those groups are visited (a flood in one folder of 1,000 groups
        # must not walk the other 999 every batch); the order stays the engine's.
        folders = (self.dirs if targets is None else
                   [f for f in targets if f in self.dirs])
        for folder in folders:
            gd = self.dirs[folder]
            subs = COMMAND_DIRS if targets is None else targets.get(folder)
            if not subs:
                continue
            found = gd.pending(subs, cheap=cheap, limit=limit,
                               names=None if names is None else names.get(folder, {}))
            if self.remover is not None and self.remover.keys:
                hidden = self.remover.keys
                gone = [f for f in found if (folder, f[1], f[0]) in hidden]
                if gone:
                    # Applied, committed and being removed: not pending, and not to be kept
                    # in the folder's queue either (a listing put them there).
                    found = [f for f in found if (folder, f[1], f[0]) not in hidden]
                    for name, sub in gone:
                        gd.finished(sub, {name})
            if found:
                out[folder] = found
        return out

    def take_fair(self, pending: dict[str, list[tuple[str, str]]]
                  ) -> dict[str, list[tuple[str, str]]]:
        """A fair batch: the first few files of every group with work, bounded in total."""
        if not pending:
            return {}
        share = max(1, min(self.batch_per_group, self.batch_max // len(pending)))
        if len(pending) > 1:
            share = min(share, self.batch_shared)
        return {f: files[:share] for f, files in pending.items()}

    # ------------------------------------------------------------------ processing
    def _round_fds(self, batch: dict[str, list[tuple[str, str]]]
                   ) -> dict[tuple[str, str], int | None]:
        """The fd each (folder, sub) of the batch is read and finished through: the
        engine's own, as the listing of this round checked it. Every file of the round must
        be finished (removed or quarantined) in the folder it was read from, even if the
        container swaps the folder meanwhile; the engine's fd of a folder is closed (and its
        number maybe reused) only by a re-check of its group (GroupDirs.dir_fd), and nothing
        in a round re-checks a folder once this has run: the listing is before it, and
        refresh_groups (which closes removed groups) runs in _after, once every file of the
        round is finished. A folder the listing did not open (a batch made by hand) is
        opened here first, for every sub of the batch, and only then are the fds read, so
        one group's reopen cannot close an fd already handed out. The removal thread and the
        removals queued on the loop (BackgroundRemover) dup the fds they keep past the
        round."""
        for folder, files in batch.items():
            gd = self.dirs[folder]
            for sub in {sub for _, sub in files}:
                if sub not in gd.dirs:
                    gd.checked_fd(sub)
        fds: dict[tuple[str, str], int | None] = {}
        for folder, files in batch.items():
            dirs = self.dirs[folder].dirs
            for _, sub in files:
                if (folder, sub) not in fds:
                    st = dirs.get(sub)
                    fds[(folder, sub)] = None if st is None else st.fd
        return fds

    def _prepare(self, folder: str, name: str, sub: str, fd: int) -> Item:
        item = Item(folder, sub, name, fd, handoff=True)
        try:
            data = read_command_file(fd, name)
        except Vanished:
            item.outcome = "gone"
            return item
        except Rejected as e:
            item.reason, item.gen = e.reason, e.generation
            item.key = f"unread@{e.generation}"
            return item
        item.gen, item.key = data.generation, data.ledger_key
        try:
            body = decode_json(data.data)
        except Rejected as e:
            if time.time_ns() - data.mtime_ns < self.settle_ns:
                # Written in place (not renamed) and maybe still being written: look again
                # once it has settled instead of quarantining half a file.
                item.outcome = "deferred"
                return item
            item.reason = e.reason
            return item
        try:
            item.cmd, item.claimed = P.parse_command(body)
        except P.ProtocolError as e:
            item.reason = str(e)
        return item

    def process(self, batch: dict[str, list[tuple[str, str]]]) -> BatchResult:
        """Apply one batch (see module doc). Returns the counts."""
        res = BatchResult()
        picked = time.perf_counter()
        fds = self._round_fds(batch)
        items: list[Item] = []
        prepare = self._prepare
        for folder, files in batch.items():
            for name, sub in files:
                fd = fds[(folder, sub)]
                if fd is not None:
                    items.append(prepare(folder, name, sub, fd))
        if not items:
            return res
        now = self._now = iso_now()
        self._local_chats.clear()
        fx = Effects()
        ledger: list[tuple[Any, ...]] = []
        db = self.db
        # A plain BEGIN IMMEDIATE ... COMMIT (ROLLBACK on any error), not the context
        # manager: this runs once a round, a command at a trickle.
        conn = db.begin()
        try:
            jid_to_folder = self._jids()
            hits = self._ledger_hits(conn, items)
            for it in items:
                if it.outcome:  # gone, deferred
                    continue
                if hits:
                    hit = hits.get((it.folder, it.ledger_name, it.key))
                    if hit is not None:
                        it.outcome, it.ledger_outcome = "done", hit[0]
                        it.reason = hit[1]
                        continue
                if it.reason is None:
                    # A command whose every check comes before its only statement (ONE_WRITE)
                    # needs no SAVEPOINT: SQLite applies a statement whole or not at all
                    # (unless a rule may hold it: an approval is several).
                    savepoint = (not isinstance(it.cmd, ONE_WRITE)
                                 or bool(effective_rules(self.cfg, it.folder)))
                    if savepoint:
                        conn.execute("SAVEPOINT cmd")
                    try:
                        self._apply(conn, it, fx, jid_to_folder)
                    except (Unauthorized, ApplyError, TaskError, schedule.ScheduleError,
                            UnsafePath) as e:
                        it.reason = _reason(e)
                    except Exception as e:  # noqa: BLE001 - a bug: keep the loop and the file
                        log.exception("ipc: internal error applying %s/%s/%s", it.folder,
                                      it.sub, it.name)
                        it.reason = f"internal error: {type(e).__name__}: {e}"
                    if it.reason is not None:
                        it.direct = it.local = None  # its row, if any, is not written
                    if savepoint:
                        if it.reason is not None:
                            conn.execute("ROLLBACK TO cmd")
                        conn.execute("RELEASE cmd")
                it.outcome = "rejected" if it.reason is not None else "applied"
                detail = it.reason if it.held is None else f"awaiting approval #{it.held}"
                ledger.append((it.folder, f"{it.sub}/{it.name}", it.key, it.ctype,
                               it.outcome, detail, now))
            # The batch's ledger rows in one call, in the same transaction as the effects.
            if ledger:
                conn.executemany(
                    "INSERT INTO ipc_ledger (group_folder, file_name, content_hash,"
                    " command_type, outcome, detail, processed_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    ledger)
        except BaseException:
            db.end(commit=False)
            raise
        db.end(commit=True)
        committed = time.perf_counter() - picked
        # The rows written claimed go to the worker first: nothing else sends them (until
        # a restart's recover()), so no hook of the caller's may stand in their way.
        started = False  # every send this round handed over has started (hand_off)
        if self.outbox is not None:
            local = [(it.direct, it.local) for it in items
                     if it.direct is not None and it.local is not None]
            if local:
                self.outbox.written_locally(local)
            direct = [it.direct for it in items if it.direct is not None and it.local is None]
            if direct:
                started = self.outbox.hand_off(direct)
        if self.on_commit is not None:
            self.on_commit(items)
        # Committed: now finish every file. A crash from here on is finished on restart.
        done: dict[tuple[str, str], set[str]] = {}
        removals: list[Item] = []
        counts: dict[tuple[str, str, str], int] = {}
        for it in items:
            outcome = it.outcome
            if outcome == "deferred":
                res.deferred += 1
                continue
            names = done.get((it.folder, it.sub))
            if names is None:
                names = done[(it.folder, it.sub)] = set()
            names.add(it.name)
            if outcome == "gone":
                res.vanished += 1
                continue
            final = it.ledger_outcome if outcome == "done" else outcome
            if final == "applied":
                removals.append(it)
            else:
                self.quarantine.put(it.folder, it.dir_fd, it.sub, it.name,
                                    it.reason or "rejected", now)
            if outcome == "done":
                res.finished += 1
                continue
            if final == "applied":
                res.applied += 1
                key = (it.ctype or "other", it.folder, "applied")
                log.debug("ipc: applied %s from %s/%s/%s", it.ctype, it.folder, it.sub,
                          it.name)
            else:
                res.rejected += 1
                key = (it.ctype or "invalid", it.folder, "quarantined")
            counts[key] = counts.get(key, 0) + 1
        # The round's metrics: one observation and one increment per label set, for all
        # its files at once.
        if counts:
            metrics.observe_many(metrics.IPC_COMMIT, committed, res.applied + res.rejected)
            for key, n in counts.items():
                metrics.ipc_commands.get(*key).inc(n)
        if removals:
            self._remove_if_same(removals, sends_started=started)
        for (folder, sub), names in done.items():
            gd = self.dirs.get(folder)
            if gd is not None:
                gd.finished(sub, names)
        self._after(fx)
        return res

    @staticmethod
    def _ledger_hits(conn: sqlite3.Connection, items: list[Item]
                     ) -> dict[tuple[str, str, str], tuple[str, str | None]]:
        """Ledger rows of this batch's files, looked up per group in one query each (inside
        the transaction, so a concurrent `ipc drain` cannot slip in between)."""
        by_group: dict[str, list[str]] = {}
        for it in items:
            if it.outcome not in ("gone", "deferred"):
                by_group.setdefault(it.folder, []).append(it.ledger_name)
        hits: dict[tuple[str, str, str], tuple[str, str | None]] = {}
        for folder, names in by_group.items():
            for i in range(0, len(names), 500):
                chunk = names[i:i + 500]
                rows = conn.execute(  # placeholders only: every value is a parameter
                    "SELECT file_name, content_hash, outcome, detail FROM ipc_ledger WHERE "  # noqa: S608
                    f"group_folder = ? AND file_name IN ({','.join('?' * len(chunk))})",
                    (folder, *chunk)).fetchall()
                for r in rows:
                    hits[(folder, r[0], r[1])] = (r[2], r[3])
        return hits

    # A round with at most this many files to remove removes them itself: handing a file
    # or two to the remover's thread (a queue put, a thread wake-up, the lock for its keys)
    # costs more CPU than the unlink; a burst's larger rounds still hand theirs over.
    INLINE_REMOVALS = 4

    def _remove_if_same(self, items: list[Item], *, sends_started: bool = False) -> None:
        if self.remover is not None:
            on_loop = (len(items) <= self.INLINE_REMOVALS
                       and self.remover.call_soon is not None)
            if on_loop and (sends_started or all(it.local is not None for it in items)):
                # No send of this round waits behind the unlinks: every file's message is
                # on the chat page already, written with the command, or the outbox has
                # started the sends handed to it (hand_off, EAGER_START). The files are
                # removed now, not a turn of the loop later (that turn, a copy of the
                # folder's fd and the hiding of the names saved).
                for it in items:
                    remove_or_warn((it.folder, it.sub, it.name), it.dir_fd, it.gen)
                return
            files = [((it.folder, it.sub, it.name), it.dir_fd, it.gen) for it in items]
            if on_loop:
                # On the loop, once what this round handed to the outbox has gone out: an
                # unlink that waits for the journal does not delay a send.
                self.remover.submit_soon(files)
            else:
                self.remover.submit(files)
            return
        for it in items:
            remove_if_same(it.dir_fd, it.name, it.gen)

    def _spool_now(self) -> None:
        spool_pending(self.cfg, self.db, self.layout)

    def _write_snapshots(self, folders: set[str] | None, *, tasks: bool, groups: bool) -> None:
        write_snapshots(self.db, self.layout, folders, tasks=tasks, groups=groups)

    def _after(self, fx: Effects) -> None:
        if fx.jobs and self.on_jobs is not None:
            self.on_jobs()
        if fx.files:
            self.spool()
        if fx.groups_changed:
            self.refresh_groups()
        main = self.main_folder()
        if fx.task_folders:
            folders = set(fx.task_folders) | ({main} if main else set())
            self.snapshots(folders, tasks=True, groups=False)
        if fx.groups_changed:
            self.snapshots({main} if main else set(), tasks=True, groups=True)

    # ------------------------------------------------------------------ approvals
    def settle(self) -> list[approval_store.Approval]:
        """Expire the approvals whose time is up, then carry out every decided one not
        carried out yet, each in one transaction with its `settled_at` (so exactly once,
        also across a crash or a second process): an approved command is applied from the
        stored request; the requesting agent gets a note; the cards are edited to show the
        outcome. Returns the approvals settled."""
        due = approval_store.due(self.db)
        if due:
            with self.db.transaction() as conn:
                for approval_id in due:
                    approvals.decide(conn, self.cfg, approval_id, status="expired", by=None,
                                     label="nobody (no answer in time)", via="timeout")
            log.info("approvals: %d expired (no answer in time)", len(due))
            if self.on_jobs is not None:
                self.on_jobs()  # jobs they held get their "expired" result
        settled: list[approval_store.Approval] = []
        for a in approval_store.unsettled(self.db):
            fx = Effects()
            with self.db.transaction() as conn:
                if not approval_store.mark_settled(conn, a.id, None):
                    continue  # another process settled it meanwhile
                outcome = None
                if a.kind == "command" and a.status == "approved":
                    outcome = self._run_approved(conn, a, fx)
                    conn.execute("UPDATE approvals SET outcome = ? WHERE id = ?",
                                 (outcome, a.id))
                group = self.rows.get(a.group_folder)
                # The note goes to the chat the request came from while it is the group's.
                note_chat = ((a.chat_jid if a.chat_jid in group.all_chats else group.jid)
                             if group else None)
                approvals.settle_effects(conn, self.cfg, a, outcome=outcome,
                                         group_jid=note_chat)
            settled.append(a)
            metrics.approvals_decided.get(a.kind, a.status).inc()
            wait = a.seconds_to_decide()
            if wait is not None:
                metrics.approval_wait.get(a.status).observe(max(0.0, wait))
            log.info("approval #%d (%s of %s) %s by %s%s", a.id, a.summary, a.group_folder,
                     a.status, a.decided_label or "-", f": {outcome}" if outcome else "")
            self._after(fx)
        if settled and self.on_settled is not None:
            self.on_settled(settled)
        return settled

    def _run_approved(self, conn: sqlite3.Connection, a: approval_store.Approval,
                      fx: Effects) -> str:
        """Apply an approved command from its stored request, the checks of its group made
        again as they stand now; returns "applied" or why it was not carried out."""
        if a.group_folder not in self.rows:
            return "not carried out: the group is no longer registered"
        try:
            cmd, _ = P.parse_command(a.request)
        except P.ProtocolError as e:
            return f"not carried out: {e}"
        it = Item(a.group_folder, "approved", f"approval-{a.id}", -1, cmd=cmd)
        jid_to_folder = {c: g.folder for g in self.rows.values() for c in g.all_chats}
        conn.execute("SAVEPOINT approved")
        try:
            self._apply(conn, it, fx, jid_to_folder, approved=True)
        except (Unauthorized, ApplyError, TaskError, schedule.ScheduleError, UnsafePath) as e:
            conn.execute("ROLLBACK TO approved")
            conn.execute("RELEASE approved")
            return f"not carried out: {_reason(e)}"
        except Exception as e:  # noqa: BLE001 - a bug: the approval is settled with the reason
            log.exception("ipc: internal error applying approval #%d", a.id)
            conn.execute("ROLLBACK TO approved")
            conn.execute("RELEASE approved")
            return f"not carried out: internal error: {type(e).__name__}"
        conn.execute("RELEASE approved")
        return "applied"

    def drain(self, max_rounds: int | None = None) -> BatchResult:
        """Process every pending file (in fair rounds) until none is left; carry out the
        approvals decided meanwhile (settle) before and after."""
        total = BatchResult()
        rounds = 0
        self.settle()
        while max_rounds is None or rounds < max_rounds:
            batch = self.take_fair(self.collect())
            if not batch:
                break
            total.add(self.process(batch))
            rounds += 1
        self.settle()
        return total

    def database_changed(self) -> bool:
        """True if anything was committed to the database since the last call (the first
        call says True): `PRAGMA data_version` moves when another connection commits,
        `total_changes` when this one did (the daemon shares it with the scheduler and the
        outbox). Two integer reads: what lets an idle loop skip `state_fingerprint()`."""
        mark = self.db.change_mark()
        changed = mark != self._db_mark
        self._db_mark = mark
        return changed

    def state_fingerprint(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Fingerprints of what the snapshots show: (tasks, groups and chats). They change
        when anyone commits such a change: the scheduler, `mdclaw tasks ...`, a channel
        learning of a chat, the reconciler. The tasks part is the count of their changes
        the triggers keep (migration 20: one read, however many tasks were ever made); the
        watcher asks only after `database_changed()`."""
        tasks = self.db.query_one(
            "SELECT n FROM change_counts WHERE name = 'scheduled_tasks'")
        groups = self.db.query_one(
            "SELECT (SELECT count(*) FROM registered_groups),"
            " (SELECT max(coalesce(updated_at, added_at)) FROM registered_groups),"
            " (SELECT count(*) FROM chats), (SELECT max(last_activity) FROM chats)")
        return tuple(tasks or ()), tuple(groups or ())

    def pending_count(self) -> int:
        return sum(len(v) for v in self.collect().values())

    def start(self) -> None:
        """Start-up chores: forget old ledger rows, remove temp files a crash left behind,
        write every snapshot."""
        self.prune_ledger()
        self._remove_stale_temps()
        write_snapshots(self.db, self.layout)

    def prune_ledger(self) -> int:
        """Forget ledger rows older than LEDGER_KEEP (their files are long gone); returns
        how many. A row only matters between COMMIT and the file's removal."""
        cutoff = to_iso(utc_now() - LEDGER_KEEP)
        with self.db.transaction() as conn:
            # Finished off-loop jobs are kept as long: their requestIds stay refused as
            # duplicates meanwhile.
            conn.execute("DELETE FROM action_jobs WHERE written_at IS NOT NULL AND"
                         " written_at < ?", (cutoff,))
            return conn.execute("DELETE FROM ipc_ledger WHERE processed_at < ?",
                                (cutoff,)).rowcount

    def _remove_stale_temps(self) -> None:
        places: list[tuple[int, tuple[str, ...]]] = [(self.quarantine.fd, ())]
        for folder in self.rows:
            places += [(self.ipc_root_fd, (folder,)), (self.ipc_root_fd, (folder, "input")),
                       (self.ipc_root_fd, (folder, "action_results"))]
        for root, parts in places:
            try:
                with agentfs.opened(root, *parts) as fd:
                    for name in agentfs.listdir(fd):
                        if agentfs.is_our_temp(name):
                            try:
                                agentfs.unlink(fd, name)
                            except OSError:
                                pass
            except (OSError, UnsafePath):
                continue

    # ------------------------------------------------------------------ commands
    def _caller(self, folder: str) -> Caller:
        caller = self._callers.get(folder)
        if caller is None:
            g = self.rows[folder]
            caller = self._callers[folder] = Caller(folder, g.is_main, g.jid, g.all_chats,
                                                    g.may_send_to)
        return caller

    def _send_chat(self, caller: Caller, cmd: P.SendMessage | P.SendFile,
                   jid_to_folder: dict[str, str], what: str) -> tuple[str, bool]:
        """The chat a message or file goes to, checked (its own chats, `may_send_to`, or a
        group named by `group`), and whether it is another chat than the group's own."""
        chat = cmd.chat_jid
        if cmd.group:
            chat = send_target(caller, cmd.group, {f: g.jid for f, g in self.rows.items()
                                                   if g.jid})
            if cmd.group in caller.may_send_to or caller.is_main:
                return chat, chat not in caller.own_chats
        chat, _ = check_chat_target(caller, chat, jid_to_folder, what)
        return chat, chat not in caller.own_chats

    def _apply(self, conn: sqlite3.Connection, it: Item, fx: Effects,
               jid_to_folder: dict[str, str], *, approved: bool = False) -> None:
        """Check and apply `it`'s command, or hold it for approval when a rule says so
        (`approved`: it was approved already, and runs now)."""
        caller = self._caller(it.folder)
        check_identity(caller, it.claimed)
        cmd = it.cmd

        # No rule for the group (the common case): nothing can hold a command, and its
        # canonical form (a model dump) is not made for the rules to look at.
        ruled = not approved and bool(effective_rules(self.cfg, it.folder))

        def held(args: dict[str, Any], other_chat: bool = False) -> bool:
            if not ruled:
                return False
            return self._hold(conn, it, fx, Request("command", cmd.type, args, other_chat))

        if isinstance(cmd, P.SendMessage):
            chat, other = self._send_chat(caller, cmd, jid_to_folder, "message")
            if ruled and held(P.to_canonical_json(cmd), other):
                return
            self._enqueue(conn, it, chat_jid=chat, kind="text", text=cmd.text,
                          sender=cmd.sender, reply_to=cmd.reply_to, source_group=caller.folder)
        elif isinstance(cmd, P.React):
            chat, _ = check_chat_target(caller, cmd.chat_jid, jid_to_folder, "react")
            if ruled and held(P.to_canonical_json(cmd), chat not in caller.own_chats):
                return
            self._enqueue(conn, it, chat_jid=chat, kind="reaction", message_id=cmd.message_id,
                          emoji=cmd.emoji, source_group=caller.folder)
        elif isinstance(cmd, P.SendFile):
            chat, other = self._send_chat(caller, cmd, jid_to_folder, "send_file")
            # Checked here (no read); copied by the spooler, off the loop and outside this
            # transaction.
            name = check_source(self.cfg, self.layout, caller.folder, cmd.file_path)
            if ruled and held(P.to_canonical_json(cmd), other):
                return
            enqueue(conn, chat_jid=chat, kind="file", source_path=cmd.file_path,
                    file_name=cmd.file_name or name, text=cmd.caption,
                    source_group=caller.folder)
            fx.files = True
        elif isinstance(cmd, P.ScheduleTask):
            chat, target = check_chat_target(caller, cmd.chat_jid, jid_to_folder,
                                             "schedule_task")
            if ruled and held(P.to_canonical_json(cmd), target != caller.folder):
                return
            tz = cmd.timezone or self.cfg.assistant.timezone
            insert_task(conn, group_folder=target, chat_jid=chat, prompt=cmd.prompt,
                        schedule_type=cmd.schedule_type, schedule_value=cmd.schedule_value,
                        timezone=tz, context_mode=cmd.context_mode, task_id=cmd.task_id,
                        source="ipc", task_timezone=cmd.timezone)
            fx.task_folders.add(target)
        elif isinstance(cmd, (P.UpdateTask, P.PauseTask, P.ResumeTask, P.CancelTask,
                              P.DeleteTask)):
            task = get_task(conn, cmd.task_id)
            check_task_access(caller, cmd.task_id, task.group_folder if task else None,
                              cmd.type)
            assert task is not None
            if ruled and held(P.to_canonical_json(cmd), task.group_folder != caller.folder):
                return
            self._task_op(conn, caller, cmd, fx)
        elif isinstance(cmd, (P.RegisterGroup, P.UnregisterGroup, P.RefreshGroups)):
            check_group_admin(caller, cmd.type)
            if ruled and held(P.to_canonical_json(cmd)):
                return
            self._group_op(conn, cmd, jid_to_folder)
            fx.groups_changed = True
        elif isinstance(cmd, P.ActionRequest):
            self._action(conn, it, caller, cmd, fx, approved=approved)
        else:  # pragma: no cover - the union is exhaustive
            raise ApplyError(f"no handler for {cmd.type}")

    def _enqueue(self, conn: sqlite3.Connection, it: Item, *, chat_jid: str, kind: str,
                 text: str | None = None, message_id: str | None = None,
                 emoji: str | None = None, reply_to: str | None = None,
                 sender: str | None = None, source_group: str | None = None) -> None:
        """The outbox row of a message or reaction; written claimed and kept on `it` for
        the worker (Item.direct) when the worker takes the chat now and the chat has no
        unfinished row (an earlier row of this batch included): the row is then the chat's
        next in order, and nothing else sends it. A crash before it is sent leaves it
        `sending`: the worker's recover() at start sends it then, as any interrupted row."""
        outbox = self.outbox
        claimed = (it.handoff and outbox is not None and outbox.accepts(chat_jid)
                   and not has_open_rows(conn, chat_jid))
        now = self._now or iso_now()
        if (claimed and kind == "text" and chat_jid not in self._local_chats
                and outbox is not None and outbox.writes_locally(chat_jid)
                and self._deliver_here(conn, it, outbox, chat_jid=chat_jid, text=text,
                                       reply_to=reply_to, sender=sender,
                                       source_group=source_group, now=now)):
            return
        row_id = enqueue(conn, chat_jid=chat_jid, kind=kind, text=text,
                         message_id=message_id, emoji=emoji, reply_to=reply_to,
                         sender=sender, source_group=source_group, claimed=claimed, now=now)
        if claimed:
            # As the worker holds a row it claimed: the row as it was before its claim
            # (the try being made is attempts + 1).
            it.direct = _written_row(row_id, now, chat_jid=chat_jid, kind=kind, text=text,
                                     message_id=message_id, emoji=emoji, reply_to=reply_to,
                                     sender=sender, source_group=source_group)

    def _deliver_here(self, conn: sqlite3.Connection, it: Item, outbox: DirectOutbox, *,
                      chat_jid: str, text: str | None, reply_to: str | None,
                      sender: str | None, source_group: str | None, now: str) -> bool:
        """A text to a chat whose channel writes this database (the local chat page),
        delivered in this transaction: its outbox row written `sent` and the page's row
        with it, under a savepoint, so the command, the row and the page's row commit
        together or not at all; after COMMIT the worker is told (Item.local). False, with
        nothing written, if the channel cannot take it so or the database refuses it (the
        row goes the usual way)."""
        conn.execute("SAVEPOINT local")
        try:
            # The page's rows first: a text that cannot go so (more than one page message)
            # has nothing written, and its outbox row is written once, the usual way.
            committed = outbox.write_locally(conn, chat_jid, text, reply_to=reply_to,
                                             sender=sender)
            if committed is not None:
                row_id = enqueue(conn, chat_jid=chat_jid, kind="text", text=text,
                                 reply_to=reply_to, sender=sender, source_group=source_group,
                                 sent=True, now=now)
        except sqlite3.Error as e:
            # Not written (the page's table refused it, say): the usual way then, whose
            # delivery tries again and reports it if it keeps failing.
            log.warning("ipc: a message to %s could not be written to its page with the "
                        "command (%s); it goes through the outbox", chat_jid, e)
            conn.execute("ROLLBACK TO local")
            committed = None
        except BaseException:
            conn.execute("ROLLBACK TO local")
            conn.execute("RELEASE local")
            raise
        conn.execute("RELEASE local")
        if committed is None:
            return False
        it.direct = _written_row(row_id, now, chat_jid=chat_jid, kind="text", text=text,
                                 reply_to=reply_to, sender=sender,
                                 source_group=source_group, sent=True)
        it.local = committed
        self._local_chats.add(chat_jid)
        return True

    def _asking_chat(self, folder: str) -> str | None:
        """The chat of `folder`'s group its agent is answering now, if it is one of the
        group's chats (a request made in that turn came from there), else None."""
        if self.answering is None:
            return None
        try:
            chat = self.answering(folder)
        except Exception:  # noqa: BLE001 - a hint: without it the note goes to the first chat
            log.debug("ipc: no answering chat for %s", folder, exc_info=True)
            return None
        group = self.rows.get(folder)
        return chat if group is not None and chat in group.all_chats else None

    def _hold(self, conn: sqlite3.Connection, it: Item, fx: Effects, request: Request,
              rule: Rule | None = None) -> bool:
        """Open an approval for `it` when a rule asks for one (True: it waits). Raises
        ApplyError when the group has too many waiting already (a flood of cards is no way
        to ask a person)."""
        rule = rule or rule_for(self.cfg, it.folder, request)
        if rule is None:
            return False
        self._room_for_approval(conn, it.folder)
        canonical = P.to_canonical_json(it.cmd)
        opened = approvals.open_approval(
            conn, self.cfg, kind=request.kind, folder=it.folder,
            group_name=self.rows[it.folder].name, request=canonical,
            approver=rule.approver, timeout=rule.timeout, rule=rule.describe(),
            request_id=canonical.get("request_id"), chat_jid=self._asking_chat(it.folder))
        it.held = opened.id
        fx.approvals.append(opened.id)
        log.info("ipc: %s from %s waits for approval #%d (%s)", request.name, it.folder,
                 opened.id, rule.describe())
        return True

    def _task_op(self, conn: sqlite3.Connection, caller: Caller, cmd: Any, fx: Effects) -> None:
        task = get_task(conn, cmd.task_id)  # the caller's access was checked (_apply)
        assert task is not None
        fx.task_folders.add(task.group_folder)
        if isinstance(cmd, P.DeleteTask):
            delete_task(conn, task.id)
            return
        # Pause, resume and cancel are the state layer's operations: the same rule for
        # which status allows which change as the CLI and the operator page.
        if isinstance(cmd, P.CancelTask):
            cancel_task(conn, task.id)
        elif isinstance(cmd, P.PauseTask):
            pause_task(conn, task.id)
        elif isinstance(cmd, P.ResumeTask):
            resume_task(conn, task.id, self.cfg.assistant.timezone)
        elif isinstance(cmd, P.UpdateTask):
            if task.status == "completed":
                raise ApplyError(f"update_task: task {task.id!r} is completed; schedule a new one")
            changes = cmd.changes()
            status = changes.pop("status", None)
            if status is not None:  # a pause or a resume: the same rule as pause_task's
                why = change_refusal(task, "pause" if status == "paused" else "resume")
                if why is not None:
                    raise ApplyError(f"update_task: {why}")
            if {"schedule_type", "schedule_value", "timezone"} & set(changes):
                stype = changes.get("schedule_type", task.schedule_type)
                if "schedule_type" in changes and "schedule_value" not in changes:
                    raise ApplyError("update_task: a new schedule_type needs a schedule_value")
                value = changes.get("schedule_value", task.schedule_value)
                tz = changes.get("timezone", task.timezone) or self.cfg.assistant.timezone
                changes["schedule_value"] = schedule.validate(stype, value, tz)
                changes["next_run"] = to_iso(schedule.first_run(stype,
                                                                changes["schedule_value"], tz))
            if changes:
                update_task_fields(conn, task.id, **changes)
            # ... then the state layer's pause or resume, after the new schedule is in (a
            # resume computes its next run from the schedule, as resume_task does)
            if status == "paused":
                pause_task(conn, task.id)
            elif status == "active":
                resume_task(conn, task.id, self.cfg.assistant.timezone)

    def _group_op(self, conn: sqlite3.Connection, cmd: Any,
                  jid_to_folder: dict[str, str]) -> None:
        if isinstance(cmd, P.RefreshGroups):
            return
        if isinstance(cmd, P.RegisterGroup):
            if cmd.folder in self.rows or conn.execute(
                    "SELECT 1 FROM registered_groups WHERE folder = ?", (cmd.folder,)).fetchone():
                raise ApplyError(f"register_group: folder {cmd.folder!r} is already registered")
            # Every registered group, from the config or over IPC (also this batch's).
            registered = {r[0] for r in conn.execute("SELECT folder FROM registered_groups")}
            other = folder_clash(cmd.folder, sorted(registered | set(self.rows)))
            if other is not None:
                raise ApplyError(f"register_group: folder {cmd.folder!r} is the folder of "
                                 f"registered group {other!r} but for case: {FOLDER_CASE_RULE}")
            if cmd.jid in jid_to_folder or conn.execute(
                    "SELECT 1 FROM registered_groups WHERE jid = ? UNION ALL "
                    "SELECT 1 FROM group_chats WHERE jid = ?", (cmd.jid, cmd.jid)).fetchone():
                raise ApplyError(f"register_group: chat {cmd.jid!r} is already registered")
            upsert_group(self.db, GroupRow(
                folder=cmd.folder, name=cmd.name, jid=cmd.jid,
                trigger=cmd.trigger or f"@{self.cfg.assistant.name}",
                requires_trigger=cmd.requires_trigger, is_main=False, source="ipc"))
            self._make_group_dirs(cmd.folder)
            jid_to_folder[cmd.jid] = cmd.folder
            self._rows_changed()
            self.rows[cmd.folder] = GroupRow(cmd.folder, cmd.name, cmd.jid, "", True, False,
                                             "ipc")
            return
        assert isinstance(cmd, P.UnregisterGroup)
        if cmd.folder is not None:
            r = conn.execute("SELECT * FROM registered_groups WHERE folder = ?",
                             (cmd.folder,)).fetchone()
        else:
            r = conn.execute("SELECT * FROM registered_groups WHERE folder = (SELECT folder "
                             "FROM group_chats WHERE jid = ?)", (cmd.jid,)).fetchone()
        if r is None:
            raise ApplyError(f"unregister_group: no registered group {cmd.folder or cmd.jid!r}")
        if r["is_main"]:
            raise ApplyError("unregister_group: the main group cannot be unregistered")
        if r["source"] == "config":
            raise ApplyError(f"unregister_group: group {r['folder']!r} comes from config.yaml; "
                             "remove it there")
        delete_group(self.db, r["folder"])
        for jid in [j for j, f in jid_to_folder.items() if f == r["folder"]]:
            jid_to_folder.pop(jid, None)
        self._rows_changed()
        self.rows.pop(r["folder"], None)

    def _make_group_dirs(self, folder: str) -> None:
        try:
            agentfs.ensure_group_dirs(self.layout, folder)
        except UnsafePath as e:  # the runner refuses the same folders again at its start
            log.warning("ipc: group %s: %s", folder, e)

    def _action(self, conn: sqlite3.Connection, it: Item, caller: Caller,
                cmd: P.ActionRequest, fx: Effects, *, approved: bool = False) -> None:
        body: dict[str, Any] = {"requestId": cmd.request_id}
        spec = None
        try:
            spec = get_spec(cmd.action)
            refusal = action_refusal(self.cfg, caller.folder, caller.is_main, cmd.action)
            if refusal is not None:
                raise ActionFailed(refusal)
            if spec.offloop:  # Unauthorized from here on is quarantined, before queueing
                check_request(spec, caller, cmd.params)
            if spec.asks and not approved:
                self._ask(conn, it, caller, cmd, spec, fx, body)
                return
        except ActionFailed as e:
            body.update(status="error", error=str(e))
        else:
            request = Request("action", cmd.action, cmd.params)
            if spec.offloop:
                rule = None if approved or spec.asks else rule_for(
                    self.cfg, caller.folder, request,
                    unmatched=self._needs_person(spec, caller, cmd.params))
                if rule is not None:
                    self._hold(conn, it, fx, request, rule)
                    self._queue_job(conn, caller, cmd, spec.max_attempts, approval=it.held)
                    fx.jobs = True
                    self._interim(conn, caller, cmd, rule.approver, it.held)
                    return
                self._queue_job(conn, caller, cmd, spec.max_attempts)
                fx.jobs = True
                return
            if not approved and self._hold(conn, it, fx, request):
                return  # an on-loop action runs when approved, like a command
            self._run_inline(conn, caller, cmd, body)
        body["executedAt"] = to_iso(utc_now())
        self._write_result(caller, cmd.request_id, body)

    def _needs_person(self, spec: ActionSpec, caller: Caller,
                      params: dict[str, Any]) -> Unmatched | None:
        """The action's own say on whether a request no rule matched needs a person."""
        hook = spec.needs_person
        if hook is None:
            return None
        cfg = self.cfg
        return lambda: hook(cfg, caller, params)

    @staticmethod
    def _room_for_approval(conn: sqlite3.Connection, folder: str) -> None:
        waiting = approval_store.pending_count(conn, folder)
        if waiting >= approval_store.MAX_PENDING_PER_GROUP:
            raise ApplyError(f"{waiting} requests of group {folder!r} wait for a person "
                             "already; ask again once they are answered")

    def _ask(self, conn: sqlite3.Connection, it: Item, caller: Caller, cmd: P.ActionRequest,
             spec: ActionSpec, fx: Effects, body: dict[str, Any]) -> None:
        """An action that asks a person (ask_person): a question approval to `who`, its job
        waiting for the answer. ActionFailed for a question nobody could answer."""
        question = question_of(cmd.params)
        try:
            self._room_for_approval(conn, caller.folder)
        except ApplyError as e:
            raise ActionFailed(str(e)) from None
        who = question["who"]
        if who not in ("owner", "admin") and who not in self.cfg.people:
            known = ", ".join(sorted(self.cfg.people)) or "none"
            raise ActionFailed(f"{cmd.action}: who={who!r} is not owner, admin or a person "
                               f"(people: {known})")
        if not People.of(self.cfg).approvers(who):
            raise ActionFailed(f"{cmd.action}: nobody is {who!r} here (people has no such "
                               "person): the question cannot be asked")
        opened = approvals.open_approval(
            conn, self.cfg, kind="question", folder=caller.folder,
            group_name=self.rows[caller.folder].name, request=question, approver=who,
            timeout=self.cfg.approvals.timeout, request_id=cmd.request_id)
        it.held = opened.id
        fx.approvals.append(opened.id)
        self._queue_job(conn, caller, cmd, spec.max_attempts, approval=opened.id)
        fx.jobs = True
        self._interim(conn, caller, cmd, who, opened.id)

    def _interim(self, conn: sqlite3.Connection, caller: Caller, cmd: P.ActionRequest,
                 approver: str, approval_id: int | None) -> None:
        """The result the caller's tool reads while a person decides: it keeps waiting,
        up to `expiresAt` (the action worker writes the final one over it). Written before
        COMMIT, like every result of this loop: a crash before it makes the same file
        again."""
        assert approval_id is not None
        a = approval_store.get(conn, approval_id)
        self._write_result(caller, cmd.request_id, {
            "requestId": cmd.request_id, "status": "pending_approval", "approver": approver,
            "approvalId": approval_id, "expiresAt": a.expires_at if a else None})

    def _write_result(self, caller: Caller, request_id: str, body: dict[str, Any]) -> None:
        gfd = self.dirs[caller.folder].group_fd
        if gfd is None:
            raise ApplyError("the group's IPC folder is not open")
        write_action_result(gfd, request_id, body)

    def _run_inline(self, conn: sqlite3.Connection, caller: Caller, cmd: P.ActionRequest,
                    body: dict[str, Any]) -> None:
        ctx = ActionContext(caller, self.layout, conn)
        conn.execute("SAVEPOINT action")
        try:
            body.update(status="success", result=run_action(ctx, cmd.action, cmd.params))
            conn.execute("RELEASE action")
        except Unauthorized:
            conn.execute("ROLLBACK TO action")
            conn.execute("RELEASE action")
            raise
        except ActionFailed as e:
            conn.execute("ROLLBACK TO action")
            conn.execute("RELEASE action")
            body.update(status="error", error=str(e))
        except Exception as e:  # noqa: BLE001 - any action's bug: the agent gets an error
            conn.execute("ROLLBACK TO action")
            conn.execute("RELEASE action")
            log.exception("ipc: action %s of %s failed", cmd.action, caller.folder)
            body.update(status="error", error=f"{cmd.action} failed: {type(e).__name__}")

    @staticmethod
    def _queue_job(conn: sqlite3.Connection, caller: Caller, cmd: P.ActionRequest,
                   max_attempts: int, *, approval: int | None = None) -> None:
        """Record an off-loop request in this transaction (with its ledger row); the action
        worker runs it (one that waits for `approval` once it is decided). A requestId the
        group already used is refused, never run twice."""
        if conn.execute("SELECT 1 FROM action_jobs WHERE group_folder = ? AND request_id = ?",
                        (caller.folder, cmd.request_id)).fetchone():
            raise ApplyError(f"duplicate requestId {cmd.request_id!r}: that request was "
                             "already made; use a new requestId")
        conn.execute(
            "INSERT INTO action_jobs (group_folder, request_id, action, params, is_main,"
            " max_attempts, created_at, status, approval_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
            " ?)",
            (caller.folder, cmd.request_id, cmd.action,
             json.dumps(cmd.params, ensure_ascii=False), int(caller.is_main), max_attempts,
             to_iso(utc_now()), "queued" if approval is None else "awaiting_approval",
             approval))


def remove_if_same(dir_fd: int, name: str, gen: str) -> None:
    """Remove `name` if it is still the file that was applied (same generation): a new file
    the container put under the same name meanwhile is a new command and stays."""
    agentfs.unlink(dir_fd, name, if_generation=gen)


def remove_or_warn(key: tuple[str, str, str], dir_fd: int, gen: str) -> None:
    """remove_if_same for an applied file (key: folder, sub, name); a failure is logged and
    the file stays: its next look finds it in the ledger, done, and removes it."""
    try:
        remove_if_same(dir_fd, key[2], gen)
    except OSError as e:
        log.warning("ipc: cannot remove %s/%s/%s: %s", *key, e)


def _written_row(row_id: int, now: str, *, chat_jid: str, kind: str, text: str | None = None,
                 message_id: str | None = None, emoji: str | None = None,
                 reply_to: str | None = None, sender: str | None = None,
                 source_group: str | None = None, sent: bool = False) -> OutboxRow:
    """The outbox row `enqueue` just wrote at `now`, as the worker is given it: before its
    claim (`pending`, no try), or delivered (`sent`, its one try)."""
    return OutboxRow(
        id=row_id, chat_jid=chat_jid, kind=kind, text=text, file_path=None, file_name=None,
        message_id=message_id, emoji=emoji, reply_to=reply_to, sender=sender,
        source_group=source_group, status="sent" if sent else "pending",
        attempts=1 if sent else 0, next_attempt_at=None if sent else now, last_error=None,
        created_at=now, updated_at=now, sent_at=now if sent else None)


class BackgroundRemover:
    """Removes applied files on a thread of its own.

    Under I/O pressure an unlink can wait for the file system's journal for milliseconds; the
    loop must not wait with it. Until a file is gone its key stays in `keys`, which hides it
    from the engine's listings so it is not read again. A crash before the removal is
    finished on restart through the ledger, like any crash after COMMIT.
    """

    def __init__(self) -> None:
        self.keys: set[tuple[str, str, str]] = set()
        # The event loop's call_soon while the watcher runs: a round with few files removes
        # them itself (submit_soon), a wake-up of this thread costing more than the unlinks.
        self.call_soon: Callable[..., object] | None = None
        self._q: queue.SimpleQueue[
            tuple[list[tuple[tuple[str, str, str], int, str]], list[int]] | None] = (
            queue.SimpleQueue())
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ipc-remove", daemon=True)
        self._thread.start()

    def submit(self, files: list[tuple[tuple[str, str, str], int, str]]) -> None:
        """Queue the removal of files (key=(folder, sub, name), the open folder's fd, the
        generation read): one job for a batch's files, one wake-up of the thread."""
        job = self._job(files)
        if job is not None:
            self._q.put(job)

    def submit_soon(self, files: list[tuple[tuple[str, str, str], int, str]]) -> None:
        """Remove files as submit() does, but on the event loop at its next turn (call_soon):
        hidden from listings until then, like the thread's."""
        job = self._job(files)
        if job is not None:
            assert self.call_soon is not None
            self.call_soon(self._remove, *job)

    def _job(self, files: list[tuple[tuple[str, str, str], int, str]]
             ) -> tuple[list[tuple[tuple[str, str, str], int, str]], list[int]] | None:
        if not files:
            return None
        dups: dict[int, int] = {}
        jobs = []
        for key, dir_fd, gen in files:
            fd = dups.get(dir_fd)
            if fd is None:
                # The engine may close its own fd (a folder swapped) meanwhile.
                fd = dups[dir_fd] = os.dup(dir_fd)
            jobs.append((key, fd, gen))
        with self._cond:
            self.keys.update(key for key, _, _ in files)
        return jobs, list(dups.values())

    def _remove(self, files: list[tuple[tuple[str, str, str], int, str]],
                fds: list[int]) -> None:
        try:
            for key, fd, gen in files:
                remove_or_warn(key, fd, gen)
        finally:
            for fd in fds:
                os.close(fd)
            with self._cond:
                self.keys.difference_update(key for key, _, _ in files)
                self._cond.notify_all()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            self._remove(*job)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued removal is done. False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self.keys, timeout)

    def close(self) -> None:
        """Finish the queued removals and stop the thread."""
        self._q.put(None)
        self._thread.join(timeout=60)


def _reason(e: Exception) -> str:
    if isinstance(e, Unauthorized):
        return f"unauthorized: {e}"
    return str(e)

