"""Reconciler plans: add, change, remove, no-op, runtime groups untouched, files kept."""

from __future__ import annotations

import stat

import pytest

from mdclaw.config import load_config
from mdclaw.paths import IPC_SUBDIRS, Layout
from mdclaw.reconcile import ReconcileError, plan, reconcile
from mdclaw.state import Database
from mdclaw.state.groups import GroupRow, get_group, list_groups, upsert_group


def kinds(p) -> list[tuple[str, str]]:
    return [(a.kind, a.target) for a in p.actions if "group" in a.kind]


@pytest.fixture
def setup(write_config, data_dir):
    def _setup(text=None):
        cfg = load_config(write_config(text))
        return cfg, Database(Layout(cfg.data_dir).db_path)
    return _setup


def test_first_run_adds_groups_and_layout(setup, data_dir) -> None:
    cfg, db = setup()
    p = reconcile(cfg, db)
    assert sorted(kinds(p)) == [("add_group", "family"), ("add_group", "main")]
    lay = Layout(data_dir)
    for folder in ("main", "family"):
        assert lay.group_dir(folder).is_dir()
        for sub in IPC_SUBDIRS:
            d = lay.group_ipc_dir(folder) / sub
            assert d.is_dir()
            assert stat.S_IMODE(d.stat().st_mode) == 0o2770
    assert lay.global_dir.is_dir()
    assert stat.S_IMODE(lay.errors_dir.stat().st_mode) == 0o700
    rows = {g.folder: g for g in list_groups(db)}
    assert rows["main"].is_main and not rows["main"].requires_trigger
    assert rows["family"].trigger == "@Andy" and rows["family"].requires_trigger
    assert rows["family"].container_config == {"timeout_ms": 600000}
    assert all(g.source == "config" for g in rows.values())


def test_second_run_plans_nothing(setup) -> None:
    cfg, db = setup()
    reconcile(cfg, db)
    again = plan(cfg, db)
    assert again.empty, again.actions


def test_change_is_planned_and_applied(setup, write_config) -> None:
    cfg, db = setup()
    reconcile(cfg, db)
    cfg2 = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: Admin chat, jid: "tg:123456", main: true, requires_trigger: false}
          family: {name: The Family, jid: "tg:-1001234", trigger: "@Bob"}
    """))
    p = reconcile(cfg2, db, dry_run=True)
    (act,) = [a for a in p.actions if a.kind == "update_group"]
    assert act.target == "family"
    assert act.detail["changes"]["name"] == {"from": "Family", "to": "The Family"}
    assert act.detail["changes"]["trigger"] == {"from": "@Andy", "to": "@Bob"}
    assert get_group(db, "family").name == "Family"  # dry run changed nothing
    reconcile(cfg2, db)
    assert get_group(db, "family").name == "The Family"
    assert plan(cfg2, db).empty


def test_removed_group_is_deregistered_but_files_kept(setup, write_config, data_dir) -> None:
    cfg, db = setup()
    reconcile(cfg, db)
    memory = Layout(data_dir).group_dir("family") / "CLAUDE.md"
    memory.write_text("family notes")
    cfg2 = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: Admin chat, jid: "tg:123456", main: true}
    """))
    p = reconcile(cfg2, db)
    assert ("deregister_group", "family") in kinds(p)
    assert get_group(db, "family") is None
    assert memory.read_text() == "family notes"


def test_runtime_groups_are_left_alone(setup) -> None:
    cfg, db = setup()
    upsert_group(db, GroupRow(folder="friends", name="Friends", jid="tg:777", trigger="@Andy",
                              requires_trigger=True, is_main=False, source="ipc"))
    p = reconcile(cfg, db)
    assert ("deregister_group", "friends") not in kinds(p)
    assert get_group(db, "friends").name == "Friends"
    # and its IPC folders are kept in shape like the config's
    assert (Layout(cfg.data_dir).group_ipc_dir("friends") / "tasks").is_dir()
    assert plan(cfg, db).empty


def test_moving_main_flag(setup, write_config) -> None:
    cfg, db = setup()
    reconcile(cfg, db)
    cfg2 = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: Admin chat, jid: "tg:123456"}
          family: {name: Family, jid: "tg:-1001234", main: true}
    """))
    reconcile(cfg2, db)
    assert get_group(db, "family").is_main and not get_group(db, "main").is_main


def test_jid_held_by_runtime_group_is_a_conflict(setup) -> None:
    cfg, db = setup()
    upsert_group(db, GroupRow(folder="other", name="O", jid="tg:-1001234", trigger="@A",
                              requires_trigger=True, is_main=False, source="ipc"))
    with pytest.raises(ReconcileError, match="already registered to group 'other'"):
        reconcile(cfg, db)
    assert get_group(db, "main") is None  # nothing applied


def test_symlinked_ipc_dir_is_replaced(setup, data_dir, tmp_path) -> None:
    cfg, db = setup()
    reconcile(cfg, db)
    tasks = Layout(data_dir).group_ipc_dir("family") / "tasks"
    tasks.rmdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    tasks.symlink_to(outside)
    p = reconcile(cfg, db)
    assert [a.kind for a in p.actions] == ["replace_path"]
    assert tasks.is_dir() and not tasks.is_symlink() and outside.is_dir()


def test_mode_drift_is_fixed(setup, data_dir) -> None:
    cfg, db = setup()
    reconcile(cfg, db)
    d = Layout(data_dir).group_ipc_dir("main")
    d.chmod(0o777)
    p = reconcile(cfg, db)
    assert [(a.kind, a.detail["was"]) for a in p.actions] == [("fix_mode", "0777")]
    assert stat.S_IMODE(d.stat().st_mode) == 0o2770


def test_folders_that_differ_only_in_case(setup, write_config) -> None:
    """A database that already holds `family` and `FAMILY` (registered before the rule) is
    reconciled anyway, the pair reported; a config group that would newly share a runtime
    group's folder but for case is a conflict; renaming a config group's case is not."""
    cfg, db = setup()
    reconcile(cfg, db)
    upsert_group(db, GroupRow(folder="FAMILY", name="F", jid="tg:555", trigger="@A",
                              requires_trigger=True, is_main=False, source="ipc"))
    p = reconcile(cfg, db)
    assert p.conflicts == []
    (warning,) = p.warnings
    assert "'FAMILY' (source ipc), 'family' (source config) differ only in case" in warning
    assert "casefold()" in warning and "unregister" in warning
    assert p.as_dict()["warnings"] == [warning]
    # a config change applies as usual meanwhile
    cfg2 = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: Admin chat, jid: "tg:123456", main: true, requires_trigger: false}
          family: {name: The Family, jid: "tg:-1001234"}
          Friends: {name: Friends, jid: "tg:8"}
    """))
    p = reconcile(cfg2, db)
    assert get_group(db, "family").name == "The Family" and len(p.warnings) == 1
    # a new config group against a runtime group's folder: refused, nothing applied
    upsert_group(db, GroupRow(folder="pets", name="P", jid="tg:556", trigger="@A",
                              requires_trigger=True, is_main=False, source="ipc"))
    cfg3 = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: Admin chat, jid: "tg:123456", main: true, requires_trigger: false}
          family: {name: Family again, jid: "tg:-1001234"}
          PETS: {name: Pets, jid: "tg:9"}
    """))
    with pytest.raises(ReconcileError, match="group 'PETS': the folder is that of registered "
                                             "group 'pets' .source ipc. but for case"):
        reconcile(cfg3, db)
    assert get_group(db, "PETS") is None and get_group(db, "family").name == "The Family"
    # a config group replaced by its case variant: the old one is deregistered, no conflict
    cfg4 = load_config(write_config("""\
        data_dir: {data_dir}
        groups:
          main: {name: Admin chat, jid: "tg:123456", main: true, requires_trigger: false}
          family: {name: The Family, jid: "tg:-1001234"}
          FRIENDS: {name: Friends, jid: "tg:10"}
    """))
    p = reconcile(cfg4, db)
    assert ("deregister_group", "Friends") in kinds(p) and ("add_group", "FRIENDS") in kinds(p)
    assert p.conflicts == [] and len(p.warnings) == 1


def test_the_daemon_starts_on_a_database_with_a_case_pair(tmp_path, write_config,
                                                          data_dir) -> None:
    """`mdclaw run` on such a database: it starts, serves, and its log names the pair."""
    from operator_helpers import free_port, running_daemon

    port = free_port()
    path = write_config(f"""\
        data_dir: {{data_dir}}
        groups:
          main: {{name: Admin, jid: "hl:main", main: true}}
          family: {{name: Family, jid: "tg:-1001234"}}
        server: {{listen: "127.0.0.1:{port}"}}
    """)
    cfg = load_config(path)
    db = Database(Layout(cfg.data_dir).db_path)
    reconcile(cfg, db)
    upsert_group(db, GroupRow(folder="Family", name="F", jid="tg:555", trigger="@A",
                              requires_trigger=True, is_main=False, source="ipc"))
    db.close()
    with running_daemon(path, port) as proc:
        assert proc.poll() is None
    log = (path.parent / "daemon.log").read_text()
    assert "reconcile: registered groups 'Family' (source ipc), 'family' (source config) " \
           "differ only in case" in log
    assert "Traceback" not in log
