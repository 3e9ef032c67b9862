"""Hostile input: every trick a container can play with its IPC folder is quarantined with a
reason (or, for a swapped folder, refused and never followed), and processing goes on."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipc_helpers import Env, schedule_body
from mdclaw.agentfs import open_beneath
from mdclaw.agentfs import open_root as open_dir_path
from mdclaw.config import Config
from mdclaw.ipc.files import (
    MAX_JSON_DEPTH,
    GroupDirs,
    Rejected,
    UnsafePath,
    decode_json,
    is_candidate,
    json_depth_exceeds,
)
from mdclaw.mounts import resolve_container_path


@pytest.fixture
def env(tmp_path: Path):  # noqa: ANN201
    e = Env(tmp_path)
    yield e
    e.close()


def test_only_json_files_not_dotfiles_or_tmp() -> None:
    assert is_candidate("1700-ab.json")
    for name in (".x.json", "x.json.tmp", "x.tmp", "x.JSON", "x.json~", "_close", "x"):
        assert not is_candidate(name)


def _good(env: Env, group: str = "family") -> str:
    return env.write(group, {"type": "message", "text": "still working"}, sub="messages")


def test_hostile_corpus_each_quarantined_with_reason(env: Env, tmp_path: Path) -> None:
    tasks = env.ipc / "family" / "tasks"
    outside = tmp_path / "secret.json"
    outside.write_text(json.dumps(schedule_body("stolen")))
    cases: dict[str, str] = {}

    (tasks / "a-dir.json").mkdir()
    (tasks / "a-dir.json" / "inner.json").write_text("{}")
    cases["a-dir.json"] = "a directory"
    os.mkfifo(tasks / "b-fifo.json")
    cases["b-fifo.json"] = "a FIFO"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tasks / "c-socket.json"))
    cases["c-socket.json"] = "socket"
    os.symlink(outside, tasks / "d-symlink.json")
    cases["d-symlink.json"] = "a symlink"
    (tmp_path / "hl-target.json").write_text(json.dumps(schedule_body("hardlinked")))
    os.link(tmp_path / "hl-target.json", tasks / "e-hardlink.json")
    cases["e-hardlink.json"] = "2 hard links"
    with open(tasks / "f-huge.json", "wb") as f:  # 2 GB, sparse
        f.truncate(2 * 1024 ** 3)
    cases["f-huge.json"] = "too large: 2147483648 bytes"
    (tasks / "g-utf8.json").write_bytes(b'{"type": "message", "text": "\xff\xfe"}')
    cases["g-utf8.json"] = "not valid UTF-8"
    (tasks / "h-deep.json").write_bytes(b"[" * 100_000)
    cases["h-deep.json"] = f"nested deeper than {MAX_JSON_DEPTH}"
    (tasks / "i-truncated.json").write_text('{"type": "message", "te')
    cases["i-truncated.json"] = "invalid JSON"
    (tasks / "j-nan.json").write_text('{"type": "message", "text": NaN}')
    cases["j-nan.json"] = "NaN is not allowed"
    (tasks / "k-dupkey.json").write_text('{"type": "message", "text": "a", "text": "b"}')
    cases["k-dupkey.json"] = "duplicate key"
    (tasks / "l-notobject.json").write_text("[1, 2]")
    cases["l-notobject.json"] = "JSON object"
    good = _good(env)

    res = env.drain()
    s.close()
    assert res.rejected == len(cases) and res.applied == 1
    for name, reason in cases.items():
        meta = env.errors_for("family", name)
        assert meta is not None, name
        assert reason in meta["error"], (name, meta)
        assert set(meta) == {"original_file", "source_group", "error", "processed_at"}
        assert meta["original_file"] == f"tasks/{name}" and meta["source_group"] == "family"
        assert (env.errors / f"family.tasks.{name}.error").exists()
        assert not os.path.lexists(tasks / name)
    # Nothing was read through the symlink or the hard link, and the targets are intact.
    assert env.tasks() == []
    assert json.loads(outside.read_text())["taskId"] == "stolen"
    assert (tmp_path / "hl-target.json").exists()
    # The good file next to them was applied.
    assert [r["text"] for r in env.outbox()] == ["still working"]
    assert not (env.ipc / "family" / "messages" / good).exists()
    # Non-regular or oversized payloads are not kept in errors/: an empty stand-in is.
    for name in ("a-dir.json", "b-fifo.json", "c-socket.json", "d-symlink.json",
                 "e-hardlink.json", "f-huge.json"):
        st = os.lstat(env.errors / f"family.tasks.{name}.error")
        assert stat.S_ISREG(st.st_mode) and st.st_size == 0, name
    # A small bad file is kept as evidence.
    assert (env.errors / "family.tasks.g-utf8.json.error").read_bytes().endswith(b'\xff\xfe"}')


def test_depth_check_ignores_brackets_in_strings() -> None:
    assert not json_depth_exceeds(b'{"text": "' + b"[" * 1000 + b'"}')
    assert json_depth_exceeds(b"[" * 33 + b"]" * 33)
    assert not json_depth_exceeds(b"[" * 32 + b"]" * 32)
    assert decode_json(b'{"a": "[[[[\\"[[["}') == {"a": '[[[["[[['}
    with pytest.raises(Rejected, match="nested deeper"):
        decode_json(b'{"a":' * 40 + b"1" + b"}" * 40)


def test_swapped_tasks_dir_is_refused_never_followed(env: Env, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "evil.json").write_text(json.dumps(schedule_body("evil")))
    tasks = env.ipc / "family" / "tasks"
    env.write("family", schedule_body("before"))
    env.drain()
    assert env.task("before") is not None
    os.rename(tasks, env.ipc / "family" / "tasks.old")
    os.symlink(elsewhere, tasks)
    good = _good(env)
    with caplog.at_level(logging.WARNING, logger="mdclaw.ipc"):
        env.drain()
    assert "ipc/family/tasks is a symlink, not a directory; refused" in caplog.text
    assert env.task("evil") is None
    assert (elsewhere / "evil.json").exists()  # untouched: not read, not moved
    assert [r["text"] for r in env.outbox()] == ["still working"]  # the loop went on
    assert not (env.ipc / "family" / "messages" / good).exists()
    # Other groups are unaffected; the folder comes back once it is a directory again.
    os.unlink(tasks)
    os.rename(env.ipc / "family" / "tasks.old", tasks)
    env.write("family", schedule_body("after"))
    env.drain()
    assert env.task("after") is not None


def test_group_ipc_dir_swapped_for_symlink_is_refused(env: Env, tmp_path: Path) -> None:
    elsewhere = tmp_path / "fake-ipc"
    (elsewhere / "tasks").mkdir(parents=True)
    (elsewhere / "tasks" / "x.json").write_text(json.dumps(schedule_body("via-link")))
    os.rename(env.ipc / "work", tmp_path / "work-real")
    os.symlink(elsewhere, env.ipc / "work")
    env.write("family", schedule_body("ok"))
    env.drain()
    assert env.task("via-link") is None and env.task("ok") is not None
    assert (elsewhere / "tasks" / "x.json").exists()


def test_group_dirs_reopen_after_replacement(env: Env) -> None:
    root = open_dir_path(env.ipc)
    gd = GroupDirs(root, "family")
    try:
        fd1 = gd.dir_fd("tasks")
        assert fd1 is not None
        os.rename(env.ipc / "family" / "tasks", env.ipc / "family" / "t2")
        os.mkdir(env.ipc / "family" / "tasks")
        (env.ipc / "family" / "tasks" / "n.json").write_text("{}")
        assert gd.pending(("tasks",)) == [("n.json", "tasks")]
        assert gd.dir_fd("nope") is None
    finally:
        gd.close()
        os.close(root)


def test_cheap_listing_still_sees_new_files(env: Env) -> None:
    root = open_dir_path(env.ipc)
    gd = GroupDirs(root, "family")
    try:
        tasks = env.ipc / "family" / "tasks"
        past = os.stat(tasks).st_mtime_ns - 10 ** 9
        os.utime(tasks, ns=(past, past))
        assert gd.pending(("tasks",), cheap=True) == []
        assert gd.pending(("tasks",), cheap=True) == []  # skipped: unchanged and clean
        (tasks / "new.json").write_text("{}")
        assert gd.pending(("tasks",), cheap=True) == [("new.json", "tasks")]
    finally:
        gd.close()
        os.close(root)


# --------------------------------------------------------------------------- send_file paths

def test_container_paths_map_to_the_group_and_granted_mounts_only(tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "id_rsa").write_text("key")  # the policy refuses this mount
    cfg = Config(data_dir=tmp_path / "d", mount_policy={"allowed_roots": [{"path": str(tmp_path)}]},
                 groups={"main": {"name": "M", "jid": "tg:1", "main": True},
                         "family": {"name": "F", "jid": "tg:2", "mounts": [
                     {"host": str(photos), "container": "photos"},
                     {"host": str(tmp_path / "keys"), "container": "keys"},  # blocked name
                     {"host": str(tmp_path / "absent"), "container": "gone"}]}})
    groups = tmp_path / "d" / "groups"

    def where(path: str):  # noqa: ANN202
        return resolve_container_path(cfg, "family", path, groups)

    assert where("/workspace/group/out/a.png") == (groups, ["family", "out", "a.png"], False)
    assert where("out/./a.png") == (groups, ["family", "out", "a.png"], False)
    assert where("/workspace/extra/photos/x.jpg") == (photos, ["x.jpg"], True)
    for bad, why in [("/workspace/group/../ipc/x", "'..'"), ("../x", "'..'"),
                     ("/etc/passwd", "outside"), ("/workspace/ipc/tasks/x.json", "outside"),
                     ("/workspace/global/CLAUDE.md", "outside"),
                     ("/workspace/extra/other/x", "not under a mount"),
                     ("/workspace/extra/keys/id_rsa", "not under a mount"),  # refused mount
                     ("/workspace/extra/gone/x", "not under a mount"),
                     ("/workspace/group", "folder"), ("/workspace/group/", "folder"),
                     ("a\0b", "NUL")]:
        with pytest.raises(ValueError, match=why):
            where(bad)


def test_open_beneath_refuses_symlinks_anywhere(tmp_path: Path) -> None:
    base = tmp_path / "group"
    (base / "out").mkdir(parents=True)
    (base / "out" / "a.txt").write_text("hello")
    (tmp_path / "secret").write_text("s3cret")
    os.symlink(tmp_path / "secret", base / "out" / "link.txt")
    os.symlink(tmp_path, base / "up")
    os.mkfifo(base / "fifo")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        f, st = open_beneath(fd, ["out", "a.txt"], 100)
        assert os.read(f, 10) == b"hello"
        os.close(f)
        for parts, why in [(["out", "link.txt"], "symlink"), (["up", "secret"], "symlink"),
                           (["fifo"], "FIFO"), (["out", "missing"], "does not exist"),
                           (["nodir", "x"], "does not exist")]:
            with pytest.raises(UnsafePath, match=why):
                open_beneath(fd, parts, 100)
        with pytest.raises(UnsafePath, match="too large"):
            open_beneath(fd, ["out", "a.txt"], 3)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- properties

_bodies = st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                 lambda inner: st.lists(inner, max_size=4)
                 | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                 max_leaves=15).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["message", "send_message", "schedule_task", "pause_task",
                                  "register_group", "react", "memory_action", "nope"])},
        optional={"text": st.text(max_size=30), "chatJid": st.sampled_from(["tg:1", "tg:2",
                                                                            "tg:3", "x"]),
                  "taskId": st.text(max_size=10), "prompt": st.text(max_size=10),
                  "schedule_type": st.sampled_from(["cron", "interval", "once", "x"]),
                  "schedule_value": st.sampled_from(["0 8 * * *", "60000", "bad"]),
                  "groupFolder": st.sampled_from(["family", "main"]),
                  "requestId": st.sampled_from(["r1", "../x"]),
                  "action": st.sampled_from(["memory_search", "memory_get", "nope"]),
                  "params": st.dictionaries(st.sampled_from(["query", "path"]),
                                            st.text(max_size=10), max_size=2)},
    ).map(lambda d: json.dumps(d).encode()),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(_bodies, min_size=1, max_size=6))
def test_any_file_ends_applied_or_quarantined(bodies: list[bytes]) -> None:
    """Whatever a container writes, every file ends in exactly one place and the engine
    keeps going."""
    with tempfile.TemporaryDirectory() as tmp:
        e = Env(Path(tmp))
        try:
            names = [e.write("family", None, sub="tasks", raw=b) for b in bodies]
            res = e.drain()
            assert res.applied + res.rejected == len(bodies)
            assert e.pending("family") == []
            quarantined = [n for n in names if e.errors_for("family", n) is not None]
            assert len(quarantined) == res.rejected
            ledger = e.db.query_one("SELECT count(*) FROM ipc_ledger")[0]
            assert ledger == len(bodies)
        finally:
            e.close()
