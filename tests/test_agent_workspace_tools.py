"""The agent's workspace tools on real files and real processes: confinement to the roots,
symlinks that lead out, read-only mounts (a real read-only bind mount in a private mount
namespace), exact-string edits, output caps, and bash's timeout killing the whole process
tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agent_helpers
from mdclaw_agent import filetools, shell
from mdclaw_agent.tools import ToolContext, run_tool, tools_for
from mdclaw_agent.workspace import PathRefused, glob_regex, make_roots, resolve
from waiting import wait_until

WORKSPACE = {"read_file", "write_file", "edit_file", "list_dir", "glob", "grep", "bash"}


def make_ctx(tmp: Path, *, is_main: bool = False, tool_timeout_max: float = 600.0
             ) -> ToolContext:
    for d in ("group", "extra/notes", "global", "ipc", "outside"):
        (tmp / d).mkdir(parents=True, exist_ok=True)
    return ToolContext(ipc_dir=tmp / "ipc", group_folder="family", chat_jid="tg:-100",
                       is_main=is_main, group_dir=tmp / "group", global_dir=tmp / "global",
                       extra_dir=tmp / "extra", tool_timeout_max=tool_timeout_max,
                       action_timeout=2.0)


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    return make_ctx(tmp_path)


def tool(ctx: ToolContext, name: str, **args) -> tuple[str, bool]:
    return run_tool(tools_for(ctx.is_main), ctx, name, args)


def ok(ctx: ToolContext, name: str, **args) -> str:
    reply, err = tool(ctx, name, **args)
    assert not err, reply
    return reply


def refused(ctx: ToolContext, name: str, **args) -> str:
    reply, err = tool(ctx, name, **args)
    assert err, reply
    return reply


def pid_gone(pid: int) -> bool:
    """No such process (or only its zombie, which its new parent reaps)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


# --------------------------------------------------------------------------- registry


def test_openai_gets_workspace_tools_and_claude_does_not() -> None:
    assert WORKSPACE <= {t.name for t in tools_for(False)}
    claude = {t.name for t in tools_for(False, workspace=False)}
    assert not WORKSPACE & claude
    assert {"web_fetch", "web_search", "memory_search", "send_message"} <= claude


# --------------------------------------------------------------------------- read/write


def test_write_then_read_relative_to_group(ctx: ToolContext) -> None:
    assert "Wrote 13 bytes" in ok(ctx, "write_file", path="notes/a.txt",
                                content="one\ntwo\nthree")
    assert (ctx.group_dir / "notes" / "a.txt").read_text() == "one\ntwo\nthree"
    out = ok(ctx, "read_file", path="/workspace/group/notes/a.txt")
    assert out.startswith("/workspace/group/notes/a.txt: lines 1-3 of 3\n")
    assert "one\ntwo\nthree" in out
    out = ok(ctx, "read_file", path="notes/a.txt", offset=2, limit=1)
    assert out.splitlines()[1:] == ["two", "[more lines follow; next: offset 3]"]


def test_write_is_atomic_and_keeps_no_temp_files(ctx: ToolContext) -> None:
    target = ctx.group_dir / "f.txt"
    target.write_text("old")
    target.chmod(0o600)
    ok(ctx, "write_file", path="f.txt", content="new")
    assert target.read_text() == "new"
    assert (target.stat().st_mode & 0o777) == 0o600  # the file's mode is kept
    assert sorted(p.name for p in ctx.group_dir.iterdir()) == ["f.txt"]


def test_read_cap_is_stated(ctx: ToolContext) -> None:
    line = "x" * 99 + "\n"
    (ctx.group_dir / "big.txt").write_text(line * 2000)  # 200 000 bytes
    out = ok(ctx, "read_file", path="big.txt")
    assert f"truncated at {filetools.OUTPUT_CAP} bytes; use offset/limit" in out
    assert len(out.encode()) < filetools.OUTPUT_CAP + 300
    nxt = int(out.rsplit("next: offset ", 1)[1].rstrip(")]"))
    assert nxt == filetools.OUTPUT_CAP // 100 + 1
    assert "lines 501-" in ok(ctx, "read_file", path="big.txt", offset=nxt)


def test_read_binary_and_folder(ctx: ToolContext) -> None:
    (ctx.group_dir / "b.bin").write_bytes(b"\x00\x01\x02")
    assert "binary file of 3 bytes" in ok(ctx, "read_file", path="b.bin")
    assert "is a folder" in refused(ctx, "read_file", path=".")
    assert "No such file" in refused(ctx, "read_file", path="nope.txt")


# --------------------------------------------------------------------------- confinement


def test_paths_outside_the_roots_are_refused(ctx: ToolContext, tmp_path: Path) -> None:
    (tmp_path / "outside" / "secret").write_text("s")
    for path in ("../outside/secret", str(tmp_path / "outside" / "secret"), "/etc/passwd",
                 "../ipc/x.json", "/workspace/ipc/tasks/x.json"):
        assert "outside the folders" in refused(ctx, "read_file", path=path), path
        assert "outside the folders" in refused(ctx, "write_file", path=path, content="x")
    assert (tmp_path / "outside" / "secret").read_text() == "s"
    assert not (tmp_path / "ipc" / "x.json").exists()


def test_symlink_out_of_the_roots_is_refused(ctx: ToolContext, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "secret").write_text("s")
    (ctx.group_dir / "link").symlink_to(outside)
    (ctx.group_dir / "flink").symlink_to(outside / "secret")
    for name, path in (("read_file", "link/secret"), ("read_file", "flink"),
                       ("list_dir", "link"), ("grep", "flink")):
        assert "symlink" in refused(ctx, name, path=path, **(
            {"pattern": "s"} if name == "grep" else {})), (name, path)
    assert "symlink" in refused(ctx, "write_file", path="flink", content="x")
    assert "symlink" in refused(ctx, "write_file", path="link/new", content="x")
    assert "symlink" in refused(ctx, "edit_file", path="flink", old_string="s",
                                new_string="t")
    assert (outside / "secret").read_text() == "s"
    assert not (outside / "new").exists()
    # grep over the whole folder does not follow the link out either.
    assert "No matches" in ok(ctx, "grep", pattern="^s$")


def test_symlink_loop_and_dangling_links(ctx: ToolContext, tmp_path: Path) -> None:
    """A symlink loop before a link out must not leave the rest unresolved (found by the
    property below); a dangling link out is replaced by a write, never followed."""
    g = ctx.group_dir
    (g / "loop").symlink_to("loop")
    (g / "out").symlink_to(tmp_path / "outside")
    (tmp_path / "outside" / "secret").write_text("s")
    assert "cannot be resolved" in refused(ctx, "read_file", path="loop/../out/secret")
    assert "cannot be resolved" in refused(ctx, "write_file", path="loop/../out/x",
                                           content="x")
    (g / "dangling").symlink_to(tmp_path / "outside" / "new.txt")
    ok(ctx, "write_file", path="dangling", content="inside")
    assert not (tmp_path / "outside" / "new.txt").exists()
    assert not (g / "dangling").is_symlink() and (g / "dangling").read_text() == "inside"


def test_symlink_inside_the_roots_is_followed(ctx: ToolContext) -> None:
    (ctx.group_dir / "real.txt").write_text("hello")
    (ctx.group_dir / "alias.txt").symlink_to("real.txt")
    assert "hello" in ok(ctx, "read_file", path="alias.txt")
    ok(ctx, "write_file", path="alias.txt", content="bye")
    assert (ctx.group_dir / "real.txt").read_text() == "bye"
    assert (ctx.group_dir / "alias.txt").is_symlink()


def test_global_is_read_only_for_non_main(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path / "a")
    (ctx.global_dir / "CLAUDE.md").write_text("shared")
    assert "shared" in ok(ctx, "read_file", path="/workspace/global/CLAUDE.md")
    assert "read-only" in refused(ctx, "write_file", path="/workspace/global/CLAUDE.md",
                                  content="x")
    assert "read-only" in refused(ctx, "edit_file", path="/workspace/global/CLAUDE.md",
                                  old_string="shared", new_string="x")
    main = make_ctx(tmp_path / "b", is_main=True)
    ok(main, "write_file", path="/workspace/global/CLAUDE.md", content="by main")
    assert (main.global_dir / "CLAUDE.md").read_text() == "by main"


def test_extra_mount_is_a_root(ctx: ToolContext) -> None:
    ok(ctx, "write_file", path="/workspace/extra/notes/todo.md", content="- milk\n")
    assert (ctx.extra_dir / "notes" / "todo.md").read_text() == "- milk\n"
    assert "- milk" in ok(ctx, "grep", pattern="milk", path="/workspace/extra/notes")
    assert "outside" in refused(ctx, "read_file", path="/workspace/extra/other/x")


READ_ONLY_SCRIPT = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path
    from mdclaw_agent.tools import ToolContext, run_tool, tools_for
    tmp = Path(sys.argv[1])
    ro = tmp / "extra" / "docs"
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
    ctx = ToolContext(ipc_dir=tmp / "ipc", group_folder="f", chat_jid="x", is_main=True,
                      group_dir=tmp / "group", global_dir=tmp / "global",
                      extra_dir=tmp / "extra")
    tools = tools_for(True)
    out = {}
    for name, args in (
            ("read", ("read_file", {"path": "/workspace/extra/docs/a.txt"})),
            ("write", ("write_file", {"path": "/workspace/extra/docs/a.txt", "content": "x"})),
            ("new", ("write_file", {"path": "/workspace/extra/docs/sub/b.txt",
                                    "content": "x"})),
            ("edit", ("edit_file", {"path": "/workspace/extra/docs/a.txt",
                                    "old_string": "doc", "new_string": "x"})),
            ("rw", ("write_file", {"path": "/workspace/extra/rw/a.txt", "content": "y"}))):
        out[name] = run_tool(tools, ctx, *args)
    print(json.dumps(out))
""")


def test_read_only_mount_refuses_writes(tmp_path: Path) -> None:
    """A real read-only bind mount (in a private mount namespace): readable, not writable,
    detected from the mount's flags alone (the folder's permissions allow writing)."""
    if os.geteuid() != 0 and subprocess.run(["unshare", "-Urm", "true"]).returncode != 0:
        pytest.skip("no mount namespace available")
    make_ctx(tmp_path, is_main=True)
    (tmp_path / "extra" / "docs").mkdir()
    (tmp_path / "extra" / "rw").mkdir()
    (tmp_path / "extra" / "docs" / "a.txt").write_text("doc")
    cmd = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]
    env = dict(os.environ, PYTHONPATH=str(agent_helpers.RUNNER_SRC))
    r = subprocess.run([*cmd, sys.executable, "-c", READ_ONLY_SCRIPT, str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=60)
    if r.returncode != 0 and "mount" in r.stderr and "Traceback" in r.stderr \
            and "CalledProcessError" in r.stderr:
        pytest.skip(f"cannot make a bind mount here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["read"][1] is False and "doc" in out["read"][0]
    for key in ("write", "new", "edit"):
        reply, err = out[key]
        assert err and "mounted read-only" in reply, (key, reply)
    assert out["rw"][1] is False, out["rw"]
    assert (tmp_path / "extra" / "docs" / "a.txt").read_text() == "doc"
    assert (tmp_path / "extra" / "rw" / "a.txt").read_text() == "y"


segments = st.lists(st.sampled_from(["a", "b", "..", ".", "out", "in", "loop", "g"]),
                    min_size=1, max_size=7)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=segments, write=st.booleans(), absolute=st.booleans())
def test_resolve_never_leaves_the_roots(tmp_path: Path, parts: list[str], write: bool,
                                        absolute: bool) -> None:
    """Whatever mix of .., symlinks out, symlinks in and loops a path has, resolve either
    refuses it or names a real path inside a root (and inside a writable one for a write)."""
    base = tmp_path / "prop"
    if not base.exists():
        ctx = make_ctx(base)
        g = ctx.group_dir
        (g / "a" / "b").mkdir(parents=True)
        (g / "out").symlink_to(base / "outside")
        (g / "a" / "out").symlink_to("../../outside")
        (g / "in").symlink_to(base / "extra" / "notes")
        (g / "loop").symlink_to("loop")
        (g / "g").symlink_to(base / "global")
    roots = make_roots(base / "group", base / "extra", base / "global", is_main=False)
    given_path = "/".join(parts)
    if absolute:
        given_path = "/workspace/group/" + given_path
    try:
        t = resolve(given_path, roots, write=write)
    except PathRefused:
        return
    real_roots = [r.real for r in roots if r.writable or not write]
    assert any(t.real == r or r in t.real.parents for r in real_roots), (given_path, t.real)
    assert t.real == Path(os.path.realpath(t.real))


# --------------------------------------------------------------------------- edit


def test_edit_exact_once(ctx: ToolContext) -> None:
    f = ctx.group_dir / "e.txt"
    f.write_text("alpha beta\ngamma beta\n")
    assert "occurs 2 times" in refused(ctx, "edit_file", path="e.txt", old_string="beta",
                                       new_string="B")
    assert "not found" in refused(ctx, "edit_file", path="e.txt", old_string="delta",
                                  new_string="D")
    assert f.read_text() == "alpha beta\ngamma beta\n"
    ok(ctx, "edit_file", path="e.txt", old_string="gamma beta", new_string="gamma B")
    assert f.read_text() == "alpha beta\ngamma B\n"


def test_edit_replace_all_and_missing_file(ctx: ToolContext) -> None:
    f = ctx.group_dir / "e.txt"
    f.write_text("x x x")
    assert "Replaced 3" in ok(ctx, "edit_file", path="e.txt", old_string="x", new_string="y",
                              replace_all=True)
    assert f.read_text() == "y y y"
    assert "use write_file" in refused(ctx, "edit_file", path="none.txt", old_string="a",
                                       new_string="b")


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab\n", max_size=30), old=st.text(alphabet="ab", min_size=1,
                                                                 max_size=3),
       new=st.text(alphabet="abc", max_size=3), replace_all=st.booleans())
def test_edit_property(tmp_path: Path, text: str, old: str, new: str,
                       replace_all: bool) -> None:
    """edit_file succeeds exactly when old occurs once (or at least once with replace_all)
    and old != new, and then the file is str.replace's result; otherwise it is unchanged."""
    ctx = make_ctx(tmp_path / "edit")
    f = ctx.group_dir / "p.txt"
    f.write_bytes(text.encode())
    reply, err = run_tool(tools_for(False), ctx, "edit_file",
                          {"path": "p.txt", "old_string": old, "new_string": new,
                           "replace_all": replace_all})
    n = text.count(old)
    should = old != new and (n == 1 or (replace_all and n >= 1))
    assert err == (not should), reply
    expected = text.replace(old, new) if should else text
    assert f.read_bytes().decode() == expected


# --------------------------------------------------------------------------- list/glob/grep


def test_list_dir_glob_grep(ctx: ToolContext) -> None:
    g = ctx.group_dir
    (g / "docs" / "deep").mkdir(parents=True)
    (g / "docs" / "a.md").write_text("the cat sat\n")
    (g / "docs" / "deep" / "b.md").write_text("no\nCAT again\n")
    (g / "c.txt").write_text("cat\n")
    (g / ".mdclaw").mkdir()
    (g / ".mdclaw" / "s.md").write_text("cat\n")
    out = ok(ctx, "list_dir")
    assert "docs/" in out and "c.txt (4 bytes)" in out
    out = ok(ctx, "glob", pattern="**/*.md")
    assert out.splitlines()[1:] == ["docs/a.md", "docs/deep/b.md"]
    assert ok(ctx, "glob", pattern="docs/*.md").splitlines()[1:] == ["docs/a.md"]
    out = ok(ctx, "grep", pattern="cat")
    assert "c.txt:1: cat" in out and "docs/a.md:1: the cat sat" in out
    assert "b.md" not in out and ".mdclaw" not in out
    out = ok(ctx, "grep", pattern="cat", ignore_case=True, glob="*.md")
    assert "docs/deep/b.md:2: CAT again" in out and "c.txt" not in out
    assert "not a valid regular expression" in refused(ctx, "grep", pattern="(")


def test_listing_caps_are_stated(ctx: ToolContext) -> None:
    d = ctx.group_dir / "many"
    d.mkdir()
    for i in range(filetools.LIST_CAP + 5):
        (d / f"f{i:05d}.txt").write_text("hit\n")
    out = ok(ctx, "list_dir", path="many")
    assert f"truncated at {filetools.LIST_CAP} entries" in out
    out = ok(ctx, "glob", pattern="many/*.txt")
    assert f"truncated at {filetools.LIST_CAP} of {filetools.LIST_CAP + 5} paths" in out
    out = ok(ctx, "grep", pattern="hit", path="many")
    assert f"truncated at {filetools.GREP_MATCH_CAP} matching lines" in out


@pytest.mark.parametrize("pattern,path,expected", [
    ("*.md", "a.md", True), ("*.md", "d/a.md", False), ("**/*.md", "a.md", True),
    ("**/*.md", "d/e/a.md", True), ("d/**", "d/e/a", True), ("?.md", "ab.md", False),
    ("[ab].md", "b.md", True), ("[!ab].md", "b.md", False), ("a.md", "a.md", True),
])
def test_glob_regex(pattern: str, path: str, expected: bool) -> None:
    assert bool(glob_regex(pattern).match(path)) is expected


# --------------------------------------------------------------------------- bash


def test_bash_runs_in_the_group_folder(ctx: ToolContext) -> None:
    out = json.loads(ok(ctx, "bash", command="pwd; echo err >&2; echo hi > made.txt; exit 3"))
    assert out["exit_code"] == 3 and out["timed_out"] is False
    assert Path(out["stdout"].strip()).resolve() == ctx.group_dir.resolve()
    assert out["stderr"] == "err\n"
    assert (ctx.group_dir / "made.txt").read_text() == "hi\n"


def test_bash_output_keeps_head_and_tail(ctx: ToolContext) -> None:
    out = json.loads(ok(ctx, "bash", command="echo START; head -c 200000 /dev/zero | "
                        "tr '\\0' x; echo; echo END"))
    text = out["stdout"]
    assert text.startswith("START\n") and text.endswith("END\n")
    assert f"output capped at {shell.STREAM_CAP} bytes" in text
    assert len(text.encode()) < shell.STREAM_CAP + 200


def test_bash_timeout_over_the_limit_is_refused(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, tool_timeout_max=5)
    assert "over this group's limit of 5 s" in refused(ctx, "bash", command="true",
                                                        timeout=6)
    # The default (120 s) is lowered to the limit.
    assert json.loads(ok(ctx, "bash", command="true"))["exit_code"] == 0


def test_bash_timeout_kills_the_process_tree(ctx: ToolContext) -> None:
    """An endless command whose grandchild ignores SIGTERM: the call returns at its timeout
    (plus the grace), and the grandchild is gone (checked by its pid)."""
    started = time.monotonic()
    cmd = ("bash -c 'trap \"\" TERM; echo $$ > grandchild.pid; while :; do sleep 0.1; done' & "
           "echo $! > child.pid; while :; do sleep 0.1; done")
    out = json.loads(ok(ctx, "bash", command=cmd, timeout=1))
    took = time.monotonic() - started
    assert out["timed_out"] is True and "stopped" in out["note"]
    assert out["exit_code"] != 0
    assert took < 1 + shell.KILL_GRACE + 5, took
    for name in ("child.pid", "grandchild.pid"):
        pid = int((ctx.group_dir / name).read_text())
        wait_until(lambda pid=pid: pid_gone(pid), 10, what=f"{name} {pid} to be gone")


def test_bash_background_leftovers_are_killed(ctx: ToolContext) -> None:
    out = json.loads(ok(ctx, "bash", command="sleep 300 & echo $! > bg.pid; echo started"))
    assert out["exit_code"] == 0 and out["stdout"] == "started\n" and not out["timed_out"]
    pid = int((ctx.group_dir / "bg.pid").read_text())
    wait_until(lambda: pid_gone(pid), 10, what="the background sleep to be gone")


@settings(max_examples=100, deadline=None)
@given(chunks=st.lists(st.binary(min_size=0, max_size=700), max_size=30),
       cap=st.integers(min_value=2, max_value=2000))
def test_capped_stream_keeps_exact_head_and_tail(chunks: list[bytes], cap: int) -> None:
    r, w = os.pipe()
    reader = os.fdopen(r, "rb")
    stream = shell.CappedStream(reader, cap)
    for c in chunks:
        os.write(w, c)
    os.close(w)
    stream.thread.join(10)
    reader.close()
    data = b"".join(chunks)
    half = cap // 2
    assert stream.total == len(data)
    if len(data) <= 2 * half:
        assert bytes(stream.head + stream.tail) == data
    else:
        assert bytes(stream.head) == data[:half]
        assert bytes(stream.tail) == data[-half:]
