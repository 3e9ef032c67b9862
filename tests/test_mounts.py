"""Mount security rules on real directories and symlinks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mdclaw.config import Config, GroupMount, MountPolicy
from mdclaw.mounts import (
    BLOCKED_PATTERNS,
    check_config,
    check_container_path,
    group_mounts,
    validate_mount,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "shared"
    (r / "docs").mkdir(parents=True)
    (r / "docs" / "a.txt").write_text("a")
    return r


def policy(*roots: Path | tuple[Path, bool], blocked: tuple[str, ...] = (),
           non_main_read_only: bool = True) -> MountPolicy:
    items = []
    for r in roots:
        path, rw = (r, False) if isinstance(r, Path) else r
        items.append({"path": str(path), "allow_read_write": rw})
    return MountPolicy(allowed_roots=items, blocked_patterns=blocked,
                       non_main_read_only=non_main_read_only)


def gm(host: Path | str, container: str = "docs", readonly: bool = True) -> GroupMount:
    return GroupMount(host=str(host), container=container, readonly=readonly)


def test_a_folder_under_an_allowed_root_is_mounted_read_only(root: Path) -> None:
    d = validate_mount(gm(root / "docs"), policy(root), is_main=False)
    assert d.allowed and d.readonly
    assert d.host == str((root / "docs").resolve())
    assert d.container == "/workspace/extra/docs"


def test_no_allowed_roots_means_no_extra_mounts(root: Path) -> None:
    d = validate_mount(gm(root / "docs"), MountPolicy(), is_main=True)
    assert not d.allowed and "allowed_roots" in d.reason


def test_a_path_outside_every_root_is_refused(root: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    d = validate_mount(gm(other), policy(root), is_main=True)
    assert not d.allowed and "not under an allowed root" in d.reason


def test_a_sibling_with_the_root_as_prefix_is_not_under_it(root: Path, tmp_path: Path) -> None:
    sibling = tmp_path / "shared-evil"
    sibling.mkdir()
    assert not validate_mount(gm(sibling), policy(root), is_main=True).allowed


def test_symlinks_are_resolved_before_the_checks(root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    d = validate_mount(gm(root / "link"), policy(root), is_main=True)
    assert not d.allowed and "not under an allowed root" in d.reason
    # and a link into a blocked folder is caught by the resolved path
    ssh = tmp_path / "home" / ".ssh"
    ssh.mkdir(parents=True)
    (root / "keys").symlink_to(ssh)
    d = validate_mount(gm(root / "keys"), policy(root), is_main=True)
    assert not d.allowed and ".ssh" in d.reason


def test_a_symlinked_root_still_admits_paths_through_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "docs").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(real)
    d = validate_mount(gm(tmp_path / "alias" / "docs"), policy(tmp_path / "alias"),
                       is_main=True)
    assert d.allowed


@pytest.mark.parametrize("name", BLOCKED_PATTERNS)
def test_every_blocked_pattern_is_refused(root: Path, name: str) -> None:
    p = root / name
    p.mkdir()
    d = validate_mount(gm(p), policy(root), is_main=True)
    assert not d.allowed and repr(name) in d.reason


def test_a_folder_holding_a_blocked_entry_is_refused(root: Path) -> None:
    home = root / "home"
    (home / ".aws").mkdir(parents=True)
    d = validate_mount(gm(home), policy(root), is_main=True)
    assert not d.allowed and ".aws" in d.reason
    env = root / "project"
    env.mkdir()
    (env / ".env").write_text("TOKEN=1")
    assert not validate_mount(gm(env), policy(root), is_main=True).allowed


def test_config_patterns_are_added_to_the_built_in_list(root: Path) -> None:
    p = root / "vault-data"
    p.mkdir()
    assert validate_mount(gm(p), policy(root), is_main=True).allowed
    d = validate_mount(gm(p), policy(root, blocked=("vault",)), is_main=True)
    assert not d.allowed and "'vault'" in d.reason


def test_missing_relative_and_file_paths_are_refused(root: Path) -> None:
    assert "does not exist" in validate_mount(gm(root / "nope"), policy(root),
                                              is_main=True).reason
    assert "absolute" in validate_mount(gm("shared/docs"), policy(root), is_main=True).reason
    assert "not a directory" in validate_mount(gm(root / "docs" / "a.txt"), policy(root),
                                               is_main=True).reason


@pytest.mark.parametrize("name,why", [
    ("/abs", "relative"), ("../up", ".."), ("a/../b", ".."), ("a:b", ":"), ("a,b", ","),
    ("", "empty"), ("a//b", "empty"), ("./a", "'.'"), ("a\nb", "control"),
])
def test_bad_container_paths(root: Path, name: str, why: str) -> None:
    d = validate_mount(gm(root / "docs", container=name), policy(root), is_main=True)
    assert not d.allowed and why in d.reason


@given(st.text(min_size=1, max_size=40))
def test_an_accepted_container_path_stays_under_extra(name: str) -> None:
    if check_container_path(name) is None:
        full = os.path.normpath(f"/workspace/extra/{name}")
        assert full.startswith("/workspace/extra/")
        assert ":" not in name and "," not in name and ".." not in name.split("/")


@pytest.mark.parametrize("requested_rw,root_rw,is_main,non_main_ro,expect_ro", [
    (False, True, True, True, True),     # not requested
    (True, False, True, True, True),     # root does not allow
    (True, True, True, True, False),     # main, allowed
    (True, True, False, True, True),     # non-main with non_main_read_only
    (True, True, False, False, False),   # non-main, policy off
])
def test_read_write_needs_request_root_and_group(root: Path, requested_rw: bool, root_rw: bool,
                                                 is_main: bool, non_main_ro: bool,
                                                 expect_ro: bool) -> None:
    d = validate_mount(gm(root / "docs", readonly=not requested_rw),
                       policy((root, root_rw), non_main_read_only=non_main_ro), is_main=is_main)
    assert d.allowed and d.readonly is expect_ro
    if requested_rw and expect_ro:
        assert d.note


def _cfg(tmp_path: Path, root: Path, mounts: list[dict]) -> Config:
    return Config(
        data_dir=tmp_path / "data",
        groups={"main": {"name": "A", "jid": "tg:1", "main": True},
                "fam": {"name": "F", "jid": "tg:2", "mounts": mounts}},
        mount_policy={"allowed_roots": [{"path": str(root)}]},
    )


def test_duplicate_container_paths_are_refused(tmp_path: Path, root: Path) -> None:
    (root / "more").mkdir()
    cfg = _cfg(tmp_path, root, [{"host": str(root / "docs"), "container": "x"},
                                {"host": str(root / "more"), "container": "x"}])
    first, second = group_mounts(cfg, "fam")
    assert first.allowed and not second.allowed and "twice" in second.reason


def test_check_config_lists_every_refused_mount(tmp_path: Path, root: Path) -> None:
    cfg = _cfg(tmp_path, root, [{"host": str(root / "docs"), "container": "ok"},
                                {"host": "/etc", "container": "etc"},
                                {"host": str(root / "docs"), "container": "../x"}])
    lines = list(check_config(cfg))
    assert len(lines) == 2
    assert lines[0].startswith("groups.fam.mounts.1: mount refused:")
    assert lines[1].startswith("groups.fam.mounts.2: mount refused:")


def test_check_config_command_reports_refused_mounts(tmp_path: Path, root: Path, cli) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(f"""\
data_dir: {tmp_path / 'data'}
mount_policy:
  allowed_roots: [{{path: {root}}}]
groups:
  main: {{name: A, jid: "tg:1", main: true, mounts: [{{host: {root / 'docs'}, container: d}}]}}
  fam:
    name: F
    jid: "tg:2"
    mounts:
      - {{host: /etc, container: etc}}
""")
    p = cli("check-config", "--config", str(cfg))
    assert p.returncode == 1
    assert "groups.fam.mounts.0: mount refused" in p.stderr and "/etc" in p.stderr
    assert "groups.main" not in p.stderr
