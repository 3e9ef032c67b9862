"""`mdclaw status` with and without a running daemon; `mdclaw doctor` lines and exit code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from conftest import REPO
from waiting import wait_until


def test_status_without_daemon(cli, write_config) -> None:
    cfg = str(write_config())
    r = cli("status", "--json", "--config", cfg)
    assert r.returncode == 3, r.stderr  # no database yet: see README, "Exit status"
    s = json.loads(r.stdout)
    assert s["daemon"] == "stopped" and s["database"] == "missing" and s["groups"] is None
    assert "mdclaw reconcile" in s["database_detail"]
    cli("reconcile", "--config", cfg)
    r = cli("status", "--json", "--config", cfg)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["database"] == "ready" and s["groups"] == 2 and s["outbox"]["pending"] == 0
    assert "daemon: not running" in cli("status", "--config", cfg).stdout


def test_status_with_running_daemon(write_config, cli, data_dir, tmp_path) -> None:
    cfg = str(write_config(f"""\
        data_dir: {{data_dir}}
        groups:
          main: {{name: A, jid: "hl:main", main: true}}
        channels: {{http: {{listen: "127.0.0.1:0"}}}}
        runtime: {{socket: "unix://{tmp_path}/no-engine.sock"}}
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", cfg], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def running() -> dict:
            s = json.loads(cli("status", "--json", "--config", cfg).stdout)
            return s if s["daemon"] == "running" else {}

        s = wait_until(running, 30, interval=0.2, what="`status` to say the daemon runs")
        assert s["pid"] == proc.pid
        assert "unreachable" in s["engine"] or "no container engine" in s["engine"], s["engine"]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert json.loads(cli("status", "--json", "--config", cfg).stdout)["daemon"] == "stopped"


def test_doctor_reports_each_problem_with_a_fix(cli, write_config, tmp_path) -> None:
    token = tmp_path / "token"
    token.write_text("")
    token.chmod(0o600)
    cfg = str(write_config(f"""\
        data_dir: {{data_dir}}
        groups:
          main: {{name: A, jid: "hl:main", main: true}}
        channels: {{telegram: {{token_file: {token}}}}}
        runtime: {{socket: "unix://{tmp_path}/no-engine.sock"}}
    """))
    r = cli("doctor", "--json", "--config", cfg)
    assert r.returncode == 3  # no database yet comes first: see README, "Exit status"
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["database"]["state"] == "missing" and checks["database"]["level"] == "warn"
    assert checks["engine"]["level"] == "fail"  # every check is still made
    assert cli("reconcile", "--config", cfg).returncode == 0
    r = cli("doctor", "--json", "--config", cfg)
    assert r.returncode == 1
    checks = {c["check"]: c for c in json.loads(r.stdout)}
    assert checks["database"]["level"] == "ok"
    assert checks["config"]["level"] == "ok"
    assert checks["data_dir"]["level"] == "ok"
    assert checks["engine"]["level"] == "fail" and checks["engine"]["fix"]
    assert checks["channels.telegram.token_file"]["level"] == "fail"
    assert "empty" in checks["channels.telegram.token_file"]["detail"]
    assert checks["clock"]["level"] == "ok"
    human = cli("doctor", "--config", cfg).stdout
    assert "FAIL  engine" in human and "fix:" in human
    bad = write_config("groups: [\n", name="bad.yaml")
    r = cli("doctor", "--config", str(bad))
    assert r.returncode == 1 and "FAIL  config" in r.stdout


def test_sighup_applies_a_valid_config_and_says_what_needs_a_restart(write_config, cli,
                                                                      tmp_path) -> None:
    base = """\
        data_dir: {data_dir}
        groups:
          main: {name: A, jid: "hl:main", main: true}
        runtime: {socket: "unix://TMP/no-engine.sock"}
        channels: {http: {listen: "127.0.0.1:0"}}
    """.replace("TMP", str(tmp_path))
    cfg = write_config(base)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MDCLAW_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen([sys.executable, "-m", "mdclaw", "run", "--config", str(cfg)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: json.loads(cli("status", "--json", "--config", str(cfg)).stdout)
                   ["daemon"] == "running", 30, interval=0.2,
                   what="`status` to say the daemon runs")
        write_config(base.replace("""          main: {name: A, jid: "hl:main", main: true}""",
                                  """          main: {name: A, jid: "hl:main", main: true}
          extra: {name: E, jid: "hl:extra"}""").replace('"127.0.0.1:0"', '"127.0.0.1:1"'))
        proc.send_signal(signal.SIGHUP)
        def folders() -> set[str]:
            rows = json.loads(cli("groups", "list", "--json", "--config", str(cfg)).stdout)
            got = {r["folder"] for r in rows}
            return got if "extra" in got else set()

        assert wait_until(folders, 20, interval=0.2, what="the reload to add group extra") \
            == {"main", "extra"}
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "reload: channels changed; restart mdclaw to apply it" in err
    assert "reloaded: " in err


# --------------------------------------------------------------------------- doctor: will my
# assistant answer? Each check in-process, with the engine stood in for.


class _FakeRuntime:
    def __init__(self, labels: dict[str, str] | None) -> None:
        self.labels = labels

    def ping(self) -> str:
        return "Fake Engine 1.0"

    def image_info(self, ref: str):  # noqa: ANN201
        from mdclaw.runtime import ImageInfo

        return ImageInfo(ref, "sha256:x", (ref,), "", 0, dict(self.labels or {}))


def _doctor(write_config, monkeypatch, text: str, labels: dict[str, str] | None = None):
    from mdclaw.ops import doctor

    monkeypatch.setattr(doctor, "create_runtime", lambda rt: _FakeRuntime(labels))
    checks: dict[str, dict[str, str]] = {}
    for c in doctor.run_checks(str(write_config(text))):
        checks[c["check"]] = c
    return checks


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doctor_models_backends_endpoint_and_port(write_config, monkeypatch, tmp_path) -> None:
    import socket

    from fake_models import FakeOpenAI

    port = _free_port()
    with FakeOpenAI() as server:
        base = f"""\
            data_dir: {{data_dir}}
            groups:
              main: {{name: A, jid: "hl:main", main: true}}
              fam: {{name: F, jid: "hl:fam", model: big}}
            channels: {{http: {{listen: "127.0.0.1:{port}"}}}}
        """
        # No model at all: every group fails, with the fix.
        c = _doctor(write_config, monkeypatch, base, {"mdclaw.backends": "openai"})
        assert c["config"]["level"] == "fail"  # fam names a model that is not there
        c = _doctor(write_config, monkeypatch, base.replace(", model: big", ""),
                    {"mdclaw.backends": "openai"})
        assert c["models"]["level"] == "fail" and "main, fam" in c["models"]["detail"]
        assert "`models:`" in c["models"]["fix"] and "docs/configuration.md" in c["models"]["fix"]
        assert c["http port"]["level"] == "ok"
        # Two models: main uses the local one (answers), fam a claude one the image lacks.
        text = base.rstrip(" ") + f"""\
            assistant: {{model: local}}
            models:
              local: {{backend: openai, model: m, base_url: "{server.url}/v1"}}
              big: {{backend: claude, model: c, base_url: "http://127.0.0.1:9"}}
        """
        c = _doctor(write_config, monkeypatch, text, {"mdclaw.backends": "openai"})
        assert c["models"]["level"] == "ok"
        assert c["image backends"]["level"] == "fail"
        assert "claude backend (groups fam)" in c["image backends"]["detail"]
        assert "--claude" in c["image backends"]["fix"]
        assert c["model local"]["level"] == "ok"
        assert c["model big"]["level"] == "fail" and "does not answer" in c["model big"]["detail"]
        assert "base_url" in c["model big"]["fix"]
        c = _doctor(write_config, monkeypatch, text, {"mdclaw.backends": "openai,claude"})
        assert c["image backends"]["level"] == "ok"
        c = _doctor(write_config, monkeypatch, text, None)
        assert c["image backends"]["level"] == "warn" and "label" in c["image backends"]["detail"]
        # The key is refused.
        server.models_status = 401
        c = _doctor(write_config, monkeypatch, text, {"mdclaw.backends": "openai,claude"})
        assert c["model local"]["level"] == "fail" and "refused the key" in c["model local"][
            "detail"]
        # The HTTP port is taken by something else.
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()
            c = _doctor(write_config, monkeypatch, text, {"mdclaw.backends": "openai,claude"})
        assert c["http port"]["level"] == "fail" and "server.listen" in c["http port"][
            "fix"]
        # Requests through the doctor carried the real key's header form, nothing else.
        assert all(r.path == "/v1/models" for r in server.requests)


def test_doctor_checks_the_telegram_token_with_getme(write_config, monkeypatch,
                                                     tmp_path) -> None:
    import asyncio
    import threading

    from test_channel_telegram import TOKEN, FakeBotApi

    api = FakeBotApi()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(api.start(), loop).result(10)
    try:
        good, bad = tmp_path / "good", tmp_path / "bad"
        good.write_text(TOKEN)
        bad.write_text("999:WRONG")
        for p in (good, bad):
            p.chmod(0o600)
        text = """\
            data_dir: {data_dir}
            groups: {main: {name: A, jid: "tg:1", main: true}}
            channels: {http: {enabled: false}, telegram: {token_file: TOKEN, api_base: "BASE"}}
        """.replace("BASE", api.base)
        c = _doctor(write_config, monkeypatch, text.replace("TOKEN", str(good)))
        assert c["telegram"]["level"] == "ok"
        c = _doctor(write_config, monkeypatch, text.replace("TOKEN", str(bad)))
        assert c["telegram"]["level"] == "fail" and "rejected" in c["telegram"]["detail"]
        assert "WRONG" not in json.dumps(c)
    finally:
        asyncio.run_coroutine_threadsafe(api.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_doctor_checks_both_slack_tokens(write_config, monkeypatch, tmp_path) -> None:
    import asyncio
    import threading

    from slack_fake import APP_TOKEN, BOT_TOKEN, FakeSlack

    fake = FakeSlack()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        files = {}
        for name, value in (("bot", BOT_TOKEN), ("app", APP_TOKEN), ("badbot", "xoxb-WRONG"),
                            ("badapp", "xapp-WRONG")):
            files[name] = tmp_path / name
            files[name].write_text(value)
            files[name].chmod(0o600)
        text = """\
            data_dir: {data_dir}
            groups: {main: {name: A, jid: "slack:C1", main: true}}
            channels: {http: {enabled: false}, slack: {bot_token_file: BOT,
                       app_token_file: APP, api_base: "BASE"}}
        """.replace("BASE", fake.api_base)

        def doctor(bot: str, app: str) -> dict[str, dict[str, str]]:
            return _doctor(write_config, monkeypatch, text.replace("BOT", str(files[bot]))
                           .replace("APP", str(files[app])))

        c = doctor("bot", "app")
        assert c["slack"]["level"] == "ok" and "@andy" in c["slack"]["detail"]
        c = doctor("badbot", "app")
        assert c["slack"]["level"] == "fail" and "bot token" in c["slack"]["detail"]
        assert "bot_token_file" in c["slack"]["fix"]
        c = doctor("bot", "badapp")
        assert c["slack"]["level"] == "fail" and "Socket Mode" in c["slack"]["detail"]
        assert "connections:write" in c["slack"]["fix"]
        assert "WRONG" not in json.dumps(c)
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_repeated_failures_of_a_group_warn_in_doctor_and_show_in_status(write_config, cli,
                                                                      monkeypatch) -> None:
    from mdclaw.config import load_config
    from mdclaw.state import Database
    from mdclaw.state.failed_turns import record_failed_turn

    text = """\
        data_dir: {data_dir}
        groups: {main: {name: A, jid: "hl:main", main: true}}
        channels: {http: {enabled: false}}
    """
    cfg = load_config(write_config(text))
    with Database(cfg.db_path) as db, db.transaction() as conn:
        for cause in ("model_unreachable", "model_unreachable", "oom_killed"):
            record_failed_turn(conn, group_folder="main", chat_jid="hl:main", cause=cause,
                               policy="transient", outcome="retry", detail="boom")
    c = _doctor(write_config, monkeypatch, text)
    assert c["failed turns"]["level"] == "warn"
    assert "group main: 3 failed turns" in c["failed turns"]["detail"]
    assert "model_unreachable, oom_killed" in c["failed turns"]["detail"]
    path = str(write_config(text))
    status = json.loads(cli("status", "--json", "--config", path).stdout)
    assert [t["cause"] for t in status["failed_turns"]][:1] == ["oom_killed"]
    human = cli("status", "--config", path).stdout
    assert "failed turns" in human and "oom_killed" in human
    listed = json.loads(cli("failures", "--json", "--config", path).stdout)
    assert len(listed) == 3 and listed[0]["group_folder"] == "main"
