"""`mdclaw backup` / `restore` / `export` (mdclaw/backup.py): an archive taken while a real
daemon works through an IPC burst and a chat holds one commit's state and every file; a
damaged, newer or hostile archive is refused before anything is written."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zstandard

from fake_engine import FakeEngine, chat_agent
from mdclaw import backup
from mdclaw.backup import BackupError, make_backup, restore, verify_archive
from mdclaw.config import load_config
from mdclaw.daemon import core
from mdclaw.daemon.core import Daemon
from mdclaw.reconcile import reconcile
from mdclaw.state import Database
from mdclaw.state.db import _split_sql
from mdclaw.state.migrations import LATEST_VERSION, MIGRATIONS
from mdclaw.state.outbox import enqueue
from mdclaw.state.transcripts import flush_index
from waiting import wait_until_async

REPO = Path(__file__).resolve().parents[1]
TOKEN = "backup-test-token"
CONFIG = """\
data_dir: {data}
assistant: {{name: Andy, timezone: UTC, model: local}}
models:
  local: {{backend: openai, model: m, base_url: "http://10.1.2.3:11434/v1"}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true}}
  family: {{name: Family, jid: "hl:family", requires_trigger: false}}
server: {{listen: "127.0.0.1:0", secret_file: {token}}}
channels: {{http: {{enabled: true}}}}
runtime: {{socket: "unix://{tmp}/no-engine.sock"}}
limits: {{errors_max_files: 10000, idle_timeout: 500ms}}
{extra}"""


def write_config(tmp_path: Path, extra: str = "") -> Path:
    token = tmp_path / "web.token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    p = tmp_path / "config.yaml"
    p.write_text(CONFIG.format(data=tmp_path / "data", token=token, tmp=tmp_path, extra=extra))
    return p


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "mdclaw", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@asynccontextmanager
async def running(config: Path, engine: FakeEngine,
                  monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Daemon]:
    """The real daemon on `config`, its containers the fake engine's, until the block ends."""
    monkeypatch.setattr(core, "create_runtime", lambda _cfg: engine)
    d = Daemon(load_config(config), str(config), drain_timeout=5)
    ready = asyncio.Event()
    d.notifier.ready = lambda status=None: ready.set()  # type: ignore[method-assign]
    task = asyncio.create_task(d.run())
    try:
        await asyncio.wait_for(ready.wait(), 60)
        assert d.orch is not None
        await asyncio.wait_for(d.orch.engine_ready.wait(), 30)
        yield d
    finally:
        d.stop_event.set()
        assert await asyncio.wait_for(task, 120) == 0


async def post(d: Daemon, jid: str, text: str) -> None:
    assert d.web is not None
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{d.web.port}/message", json={"jid": jid, "text": text},
            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status in (200, 202), await r.text()


def replies(db_path: Path, jid: str) -> list[str]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return [r[0] for r in conn.execute(
            "SELECT content FROM http_messages WHERE chat_jid = ? AND direction = 'out' "
            "ORDER BY seq", (jid,)) if r[0].startswith("re: ")]
    finally:
        conn.close()


def rows(db_path: Path, sql: str) -> set[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return set(conn.execute(sql).fetchall())
    finally:
        conn.close()


# Columns that never change once a row is committed (status columns move on after it).
FIXED = {
    "ipc_ledger": "SELECT group_folder, file_name, content_hash, outcome FROM ipc_ledger",
    "outbox": "SELECT id, chat_jid, text, source_group, created_at FROM outbox",
    "messages": "SELECT id, chat_jid, sender, content, timestamp FROM messages",
    "tasks": "SELECT id, group_folder, prompt, schedule_value, created_at "
             "FROM scheduled_tasks",
    "transcript": "SELECT source, source_id, group_folder, body FROM transcript",
}


def test_backup_during_an_ipc_burst_and_a_chat_restores_every_committed_row_and_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path)
    data = tmp_path / "data"
    archives = tmp_path / "archives"
    engine = FakeEngine(default=chat_agent())
    notes = {f"notes/n{i:03d}.md": f"note {i}\n".encode() * (i + 1) for i in range(60)}
    burst = 2000

    async def go() -> tuple[dict[str, set], dict[str, set]]:
        async with running(config, engine, monkeypatch) as d:
            for name, body in notes.items():
                p = data / "groups" / "main" / name
                p.parent.mkdir(exist_ok=True)
                p.write_bytes(body)
            ipc = data / "ipc"

            def write(group: str, sub: str, i: int, body: dict) -> None:
                tmp = ipc / group / sub / f".c{i:05d}.tmp"
                tmp.write_text(json.dumps(body))
                os.rename(tmp, ipc / group / sub / f"c{i:05d}.json")

            def command(i: int) -> None:
                g = ("main", "family")[i % 2]
                if i % 4 < 2:
                    write(g, "messages", i, {"type": "message", "text": f"burst {i}"})
                else:
                    write(g, "tasks", i, {"type": "schedule_task", "taskId": f"t{i}",
                                          "prompt": f"p{i}", "schedule_type": "interval",
                                          "schedule_value": "3600000"})

            for i in range(burst // 2):
                command(i)
            await post(d, "hl:main", "hello 0")
            before = {k: rows(d.cfg.db_path, q) for k, q in FIXED.items()}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mdclaw", "backup", "--config", str(config), "--to",
                str(archives), "--json", env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            for i in range(burst // 2, burst):
                command(i)
            for n in range(1, 6):
                await post(d, "hl:main", f"hello {n}")
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()

            def settled() -> bool:
                left = sum(1 for g in ("main", "family") for s in ("messages", "tasks")
                           for n in os.listdir(ipc / g / s) if n.endswith(".json"))
                return left == 0 and len(replies(d.cfg.db_path, "hl:main")) >= 6

            await wait_until_async(settled, 120, what="the burst and the chat to finish")
            after = {k: rows(d.cfg.db_path, q) for k, q in FIXED.items()}
            assert len(after["ipc_ledger"]) == burst
            return before, after

    before, after = asyncio.run(go())
    (archive,) = backup.list_archives(archives)
    target = tmp_path / "restored"
    r = restore(archive, target)
    assert r.files >= len(notes) + 1
    restored = {k: rows(target / "state.db", q) for k, q in FIXED.items()}
    for k in FIXED:
        assert before[k] <= restored[k], f"{k}: rows committed before the backup are lost"
        assert restored[k] <= after[k], f"{k}: rows that were never committed"
    # One commit's state: every applied message command's outbox row came with its ledger
    # row (one transaction), and no row without its command.
    applied = {int(f.rsplit("/c", 1)[1][:5])
               for _g, f, _h, o in restored["ipc_ledger"] if o == "applied"}
    assert len(applied) == len(restored["ipc_ledger"])
    texts = {t for _i, _j, t, _s, _c in restored["outbox"] if t and t.startswith("burst ")}
    assert {f"burst {i}" for i in applied if i % 4 < 2} == texts
    tasks = {i for i, *_ in restored["tasks"]}
    assert {f"t{i}" for i in applied if i % 4 >= 2} == tasks
    for name, body in notes.items():
        assert (target / "groups" / "main" / name).read_bytes() == body
    assert not (target / "ipc").exists()  # the spool is not in a backup
    with Database(target / "state.db") as db:
        assert db.user_version == LATEST_VERSION
        assert db.scalar("PRAGMA integrity_check") == "ok"


def _setup(tmp_path: Path) -> tuple[Any, Path]:
    config = write_config(tmp_path)
    cfg = load_config(config)
    with Database(cfg.db_path) as db:
        reconcile(cfg, db)
    (cfg.data_dir / "groups" / "main" / "CLAUDE.md").write_text("remember the milk\n")
    return cfg, config


def test_a_flipped_byte_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    cfg, config = _setup(tmp_path)
    r = make_backup(cfg, config, tmp_path / "b")
    data = bytearray(r.archive.read_bytes())
    for offset in (len(data) // 2, len(data) - 10, 40):
        bad = tmp_path / f"bad{offset}.tar.zst"
        flipped = bytearray(data)
        flipped[offset] ^= 0x01
        bad.write_bytes(bytes(flipped))
        with pytest.raises(BackupError, match="damaged|checksum"):
            restore(bad, tmp_path / "target")
        assert not (tmp_path / "target").exists()
        assert not [p for p in tmp_path.iterdir() if ".restore-" in p.name]
    p = cli("restore", str(bad), "--data-dir", str(tmp_path / "target"))
    assert p.returncode == 1 and "damaged" in p.stderr and "nothing was restored" in p.stderr


def _rewrite(src: Path, dst: Path, change: Callable[[list[tuple[tarfile.TarInfo, bytes]]],
                                                     None]) -> None:
    """Re-pack an archive with its members changed by `change` (manifest checksums kept in
    step, as a deliberate forgery would)."""
    members: list[tuple[tarfile.TarInfo, bytes]] = []
    with src.open("rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as z, \
            tarfile.open(fileobj=z, mode="r|") as tar:
        for m in tar:
            body = tar.extractfile(m).read() if m.isreg() else b""  # type: ignore[union-attr]
            members.append((m, body))
    change(members)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m, body in members:
            m.size = len(body)
            tar.addfile(m, io.BytesIO(body) if m.isreg() else None)
    dst.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(buf.getvalue()))


def _manifest(members: list[tuple[tarfile.TarInfo, bytes]]) -> dict[str, Any]:
    return json.loads(next(b for m, b in members if m.name == "manifest.json"))


def _set_manifest(members: list[tuple[tarfile.TarInfo, bytes]], man: dict[str, Any]) -> None:
    for i, (m, _b) in enumerate(members):
        if m.name == "manifest.json":
            members[i] = (m, json.dumps(man).encode())


def test_an_archive_of_a_newer_schema_is_refused_naming_the_version(tmp_path: Path) -> None:
    cfg, config = _setup(tmp_path)
    r = make_backup(cfg, config, tmp_path / "b")
    newer = tmp_path / "newer.tar.zst"

    def bump(members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        man = _manifest(members)
        man["schema_version"] = LATEST_VERSION + 3
        man["mdclaw_version"] = "9.9.0"
        _set_manifest(members, man)

    _rewrite(r.archive, newer, bump)
    with pytest.raises(BackupError) as e:
        restore(newer, tmp_path / "target")
    msg = str(e.value)
    assert f"schema version {LATEST_VERSION + 3}" in msg and "mdclaw 9.9.0 or newer" in msg
    assert f"up to schema version {LATEST_VERSION}" in msg
    assert not (tmp_path / "target").exists()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "extra"])
def test_a_path_escaping_archive_is_refused_before_anything_is_written(
        tmp_path: Path, kind: str) -> None:
    cfg, config = _setup(tmp_path)
    r = make_backup(cfg, config, tmp_path / "b")
    evil = tmp_path / "evil.tar.zst"
    outside = tmp_path / "outside"

    def plant(members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        man = _manifest(members)
        body = b"owned\n"
        if kind in ("symlink", "hardlink"):
            link = tarfile.TarInfo("data/groups/main/link")
            link.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
            link.linkname = str(outside)
            members.insert(1, (link, b""))
            # ... and a file written through it, should the link have been made
            m = tarfile.TarInfo("data/groups/main/link/x")
        else:
            m = tarfile.TarInfo({"dotdot": "data/../../outside",
                                 "absolute": str(outside),
                                 "extra": "data/groups/../../../outside"}[kind])
        members.insert(2, (m, body))
        man["files"].append({"path": m.name, "size": len(body),
                             "sha256": hashlib.sha256(body).hexdigest(), "mode": 0o644})
        _set_manifest(members, man)

    _rewrite(r.archive, evil, plant)
    with pytest.raises(BackupError, match="refused"):
        restore(evil, tmp_path / "target")
    assert not outside.exists()
    assert not (tmp_path / "target").exists()


def test_restore_refuses_while_the_daemon_runs(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path)
    engine = FakeEngine(default=chat_agent())

    async def go() -> None:
        async with running(config, engine, monkeypatch) as d:
            r = await asyncio.to_thread(make_backup, d.cfg, config, tmp_path / "b")
            with pytest.raises(BackupError, match=rf"daemon \(pid {os.getpid()}\) is running"):
                await asyncio.to_thread(restore, r.archive, d.cfg.data_dir)
            assert (d.cfg.data_dir / "state.db").exists()

    asyncio.run(go())


def test_an_older_schema_is_migrated_and_the_old_data_dir_kept(tmp_path: Path) -> None:
    cfg, config = _setup(tmp_path)
    r = make_backup(cfg, config, tmp_path / "b")
    old = tmp_path / "old.tar.zst"

    def downgrade(members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
        # A database made by migrations 1..3 only (an older mdclaw), with one group in it.
        path = tmp_path / "v3.db"
        conn = sqlite3.connect(path, isolation_level=None)
        for version, _d, script in MIGRATIONS:
            if version > 3:
                break
            for s in _split_sql(script):
                conn.execute(s)
            conn.execute(f"PRAGMA user_version={version}")
        conn.execute("INSERT INTO chats (jid, name, last_activity) VALUES ('hl:main', 'A', "
                     "'2025-01-01T00:00:00Z')")
        conn.close()
        body = path.read_bytes()
        man = _manifest(members)
        for e in man["files"]:
            if e["path"] == "data/state.db":
                e["size"], e["sha256"] = len(body), hashlib.sha256(body).hexdigest()
        man["schema_version"] = 3
        for i, (m, _b) in enumerate(members):
            if m.name == "data/state.db":
                members[i] = (m, body)
        _set_manifest(members, man)

    _rewrite(r.archive, old, downgrade)
    res = restore(old, cfg.data_dir)
    assert res.migrated and res.migrated[-1] == LATEST_VERSION and res.schema_version == 3
    assert res.previous is not None and (res.previous / "state.db").exists()
    with Database(cfg.db_path) as db:
        assert db.user_version == LATEST_VERSION
        assert db.scalar("SELECT name FROM chats WHERE jid = 'hl:main'") == "A"
    assert (cfg.data_dir / "groups" / "main" / "CLAUDE.md").read_text() == "remember the milk\n"
    p = cli("doctor", "--json", "--config", str(config))
    checks = {c["check"]: c for c in json.loads(p.stdout)}
    assert checks["database"]["level"] == "ok", checks["database"]


def test_retention_keeps_the_newest_and_records_the_last_success(tmp_path: Path) -> None:
    cfg, config = _setup(tmp_path)
    made = []
    for _ in range(4):
        p = cli("backup", "--config", str(config), "--to", str(tmp_path / "b"), "--keep",
                "2", "--every", "1d", "--json")
        assert p.returncode == 0, p.stderr
        made.append(json.loads(p.stdout)["archive"])
    assert [str(a) for a in backup.list_archives(tmp_path / "b")] == made[-2:]
    # Several in one second: "-1" comes after the plain name, "-10" after "-9".
    d = tmp_path / "same"
    d.mkdir()
    names = [f"mdclaw-backup-{n}" for n in (
        "20260101T000000Z-10.tar.zst", "20260101T000000Z.tar.zst",
        "20260101T000000Z-9.tar.zst.age", "20251231T235959Z-1.tar.zst",
        "20260101T000000Z-1.tar.zst")] + ["notes.txt"]
    for n in names:
        (d / n).write_bytes(b"")
    assert [p.name for p in backup.list_archives(d)] == [names[3], names[1], names[4], names[2],
                                                         names[0]]
    last = backup.last_backup(cfg.data_dir)
    assert last is not None and last.archive == made[-1] and last.every == 86400
    assert not last.overdue


def test_encrypted_to_an_age_recipient(tmp_path: Path) -> None:
    pyrage = pytest.importorskip("pyrage")
    cfg, config = _setup(tmp_path)
    ident = pyrage.x25519.Identity.generate()
    (tmp_path / "recipients").write_text(f"# the backup key\n{ident.to_public()}\n")
    (tmp_path / "identity").write_text(f"{ident}\n")
    r = make_backup(cfg, config, tmp_path / "b", recipient_file=tmp_path / "recipients")
    assert r.encrypted and r.archive.name.endswith(".tar.zst.age")
    assert r.archive.read_bytes().startswith(b"age-encryption.org/v1")
    assert b"remember the milk" not in r.archive.read_bytes()
    with pytest.raises(BackupError, match="--identity"):
        restore(r.archive, tmp_path / "t")
    res = restore(r.archive, tmp_path / "t", identity_file=tmp_path / "identity")
    assert (res.data_dir / "groups" / "main" / "CLAUDE.md").read_text() == "remember the milk\n"
    assert verify_archive(r.archive, tmp_path / "identity")["schema_version"] == LATEST_VERSION


def test_export_one_group(tmp_path: Path) -> None:
    cfg, config = _setup(tmp_path)
    with Database(cfg.db_path) as db, db.transaction() as c:
        c.execute("INSERT INTO chats (jid, name, last_activity) VALUES ('hl:main', 'A', 'x')")
        c.execute("INSERT INTO messages (id, chat_jid, sender, sender_name, content, "
                  "timestamp) VALUES ('m1', 'hl:main', 'u', 'U', 'hi there', 't')")
        c.execute("INSERT INTO chats (jid, name, last_activity) VALUES ('hl:family','F','x')")
        c.execute("INSERT INTO messages (id, chat_jid, sender, sender_name, content, "
                  "timestamp) VALUES ('m2', 'hl:family', 'u', 'U', 'not yours', 't')")
        for n, (jid, group, text) in enumerate([
                ("hl:main", "main", "the row written"), ("hl:family", "family", "not ours"),
                ("hl:main", "main", "written later")]):
            enqueue(c, chat_jid=jid, kind="text", text=text, source_group=group,
                    now=f"2026-01-01T00:00:0{n}.000Z")
        flush_index(c)
        # A reply whose transcript row is not written yet: the export reads it all the same.
        enqueue(c, chat_jid="hl:main", kind="text", text="still queued", source_group="main",
                now="2026-01-01T00:00:01.000Z")
    out = tmp_path / "main.zip"
    p = cli("export", "--group", "main", "--out", str(out), "--config", str(config))
    assert p.returncode == 0, p.stderr
    with zipfile.ZipFile(out) as z:
        msgs = json.loads(z.read("messages.json"))
        assert [m["content"] for m in msgs] == ["hi there"]
        said = json.loads(z.read("transcript.json"))
        assert [(t["kind"], t["body"]) for t in said if t["direction"] == "out"] == [
            ("reply", "the row written"), ("reply", "still queued"), ("reply", "written later")]
        assert [t["body"] for t in said if t["direction"] == "in"] == ["hi there"]
        assert z.read("files/CLAUDE.md") == b"remember the milk\n"
    p = cli("export", "--group", "nope", "--config", str(config))
    assert p.returncode == 1 and "no group 'nope'" in p.stderr


async def get_json(d: Daemon, path: str) -> tuple[int, str]:
    assert d.web is not None
    async with aiohttp.ClientSession() as s, s.get(
            f"http://127.0.0.1:{d.web.port}{path}",
            headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        return r.status, await r.text()


def test_the_last_backup_on_metrics_the_page_and_doctor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path)
    engine = FakeEngine(default=chat_agent())

    async def go() -> None:
        async with running(config, engine, monkeypatch) as d:
            status, body = await get_json(d, "/metrics")
            assert status == 200 and "mdclaw_backup_last_success_timestamp_seconds" not in body
            _s, page = await get_json(d, "/operator/api/overview")
            assert json.loads(page)["backup"]["last_success"] is None
            r = await asyncio.to_thread(make_backup, d.cfg, config, tmp_path / "b",
                                        every=86400)
            status, body = await get_json(d, "/metrics")
            line = next(x for x in body.splitlines()
                        if x.startswith("mdclaw_backup_last_success_timestamp_seconds "))
            from mdclaw.schedule import from_iso
            assert float(line.split()[1]) == pytest.approx(from_iso(r.created_at).timestamp())
            _s, page = await get_json(d, "/operator/api/overview")
            b = json.loads(page)["backup"]
            assert b["last_success"] == r.created_at and b["level"] == "ok"

    asyncio.run(go())
    data = tmp_path / "data"
    status_file = data / backup.STATUS_FILE
    rec = json.loads(status_file.read_text())

    def doctor_backup(days_ago: float) -> dict[str, str]:
        from datetime import timedelta

        from mdclaw.schedule import to_iso, utc_now
        status_file.write_text(json.dumps(
            {**rec, "last_success": to_iso(utc_now() - timedelta(days=days_ago))}))
        p = cli("doctor", "--json", "--config", str(config))
        return {c["check"]: c for c in json.loads(p.stdout)}["backup"]

    one_missed = doctor_backup(1.5)
    assert one_missed["level"] == "ok" and "last backup 1d" in one_missed["detail"]
    two_missed = doctor_backup(2.5)
    assert two_missed["level"] == "warn", two_missed
    assert "2 scheduled backups (every 1d) missed" in two_missed["detail"]
    assert "mdclaw-backup" in two_missed["fix"]
