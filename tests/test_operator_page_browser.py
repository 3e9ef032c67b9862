"""The operator page in headless Chromium against a real daemon (no container engine):
every view shows what the state database and the IPC folders hold, its buttons change them
through the same code as the CLI (which then agrees), what agents and people wrote shows as
text, and each view fits a desktop and a 390 px phone without sideways scrolling."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

from browser import DevTools, browse, chromium
from mdclaw import schedule
from mdclaw.state import Database
from mdclaw.state.outbox import enqueue
from mdclaw.state.tasks import finish_run, insert_run
from mdclaw.usage import record_usage
from operator_helpers import free_port, running_daemon

XSS_NAME = '<img src=x onerror="window.__xss=1">Family'
XSS_PROMPT = '<script>window.__xss=2</script>Water the plants'
XSS_PAYLOAD = '<svg onload="window.__xss=3"></svg>'
MODEL_KEY = "sk-operator-test-key-never-shown"

CONFIG = """\
data_dir: {data_dir}
assistant: {{name: Andy, timezone: Europe/Berlin}}
models:
  sonnet: {{backend: claude, model: claude-sonnet-4-5, api_key_file: {key}}}
groups:
  main: {{name: Admin, jid: "hl:main", main: true}}
  family: {{name: {name}, jid: "hl:family", tokens_per_day: 5000}}
tasks:
  - id: plants
    group: family
    prompt: {prompt}
    cron: "0 8 * * *"
channels:
  http: {{listen: "127.0.0.1:{port}"}}
  email:
    address: andy@example.test
    password_file: {key}
    imap_host: 127.0.0.1
    imap_port: {closed}
    smtp_host: 127.0.0.1
    smtp_port: {closed}
"""

SIZES = {"desktop": (1280, 900), "phone": (390, 844)}


def fail_row(db: Database, text: str, error: str) -> int:
    with db.transaction() as c:
        row = enqueue(c, chat_jid="hl:family", kind="text", text=text, source_group="family")
        c.execute("UPDATE outbox SET status = 'failed', attempts = 5, last_error = ? "
                  "WHERE id = ?", (error, row))
    return row


def seed(db: Database) -> dict[str, int]:
    rows = {"retry": fail_row(db, "retry me", "chat not found (HTTP 400)"),
            "drop": fail_row(db, "drop me", "bot was blocked by the user")}
    now = schedule.utc_now()
    with db.transaction() as c:
        run = insert_run(c, "plants", now - timedelta(minutes=3), due_at=now - timedelta(minutes=3))
        finish_run(c, run, "success", now - timedelta(minutes=2), result="watered")
        run = insert_run(c, "plants", now - timedelta(minutes=1), due_at=now - timedelta(minutes=1))
        finish_run(c, run, "error", now, error="the container exited 1")
    day = now.strftime("%Y-%m-%d")
    yesterday = (now - timedelta(days=1)).strftime("%Y-%m-%d")
    record_usage(db, "family", "claude-sonnet-4-5", ok=True, input_tokens=3000,
                 output_tokens=1000, when=f"{yesterday}T10:00:00.000Z")
    record_usage(db, "family", "claude-sonnet-4-5", ok=True, input_tokens=5000,
                 output_tokens=1000, when=f"{day}T00:00:01.000Z")
    record_usage(db, "main", "claude-sonnet-4-5", ok=True, input_tokens=100,
                 output_tokens=50, when=f"{day}T00:00:02.000Z")
    return rows


async def show(page: DevTools, view: str, ready: str) -> None:
    await page.js(f"location.hash = '#{view}'")
    await page.wait_for(f"!!document.getElementById('view-{view}') && !!({ready})")


async def check_sizes(page: DevTools, view: str, shots: Path, texts: list[str]) -> None:
    """At each size: the texts show, nothing scrolls sideways, a screenshot is taken."""
    for size, (w, h) in SIZES.items():
        await page.call("Emulation.setDeviceMetricsOverride", width=w, height=h,
                        deviceScaleFactor=1, mobile=size == "phone")
        await page.wait_for(f"window.innerWidth === {w}")
        await page.wait_for(f"!!document.getElementById('view-{view}')")
        body = await page.js("document.body.innerText")
        for t in texts:
            assert t in body, f"{view} at {size}: {t!r} missing in:\n{body}"
        widths = await page.js("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], f"{view} at {size} scrolls sideways: {widths}"
        shot = await page.call("Page.captureScreenshot", format="png")
        png = base64.b64decode(shot["data"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
        (shots / f"{view}-{size}.png").write_bytes(png)
    await page.call("Emulation.clearDeviceMetricsOverride")


async def no_markup_ran(page: DevTools) -> None:
    assert await page.js("window.__xss === undefined")
    assert await page.js("document.querySelectorAll('#view script, #view img:not(.qr img), "
                         "#view svg[onload], #view [onerror]').length") == 0


def test_every_view_in_chromium(tmp_path: Path, cli) -> None:
    chromium()
    port = free_port()
    key = tmp_path / "model.key"
    key.write_text(MODEL_KEY)
    key.chmod(0o600)
    cfg_path = tmp_path / "config.yaml"
    data_dir = tmp_path / "data"
    # The email channel's servers are not there: its card says what is wrong and the fix.
    cfg_path.write_text(CONFIG.format(data_dir=data_dir, key=key, port=port, closed=free_port(),
                                      name=json.dumps(XSS_NAME), prompt=json.dumps(XSS_PROMPT)))
    shots = tmp_path / "shots"
    shots.mkdir()

    def mdclaw_json(*args: str) -> object:
        r = cli(*args, "--json", "--config", str(cfg_path))
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    async def main() -> None:
        db = Database(data_dir / "state.db")
        rows = seed(db)
        # an agent writes a command it may not: the daemon quarantines it with the reason
        bad = data_dir / "ipc" / "family" / "messages" / "evil.json"
        bad.write_text(json.dumps({"type": "message", "chatJid": "hl:main",
                                   "text": XSS_PAYLOAD}))
        try:
            async with browse(f"http://127.0.0.1:{port}/operator/",
                          tmp_path / "chromium-profile") as page:
                # Overview: live, without a reload
                await page.wait_for("!!document.getElementById('outbox-counts')")
                await page.js("window.__loaded = 1")
                await page.wait_for("document.getElementById('outbox-counts').innerText"
                                    ".includes('failed: 2')")
                text = await page.js("document.body.innerText")
                engine = await page.js("document.getElementById('engine').innerText")
                assert "unreachable" in engine or "checking" in engine, engine
                assert "http" in text and "connected" in text
                await page.wait_for("document.getElementById('channels').innerText"
                                    ".includes('fix: check channels.email.imap_host')")
                mail = await page.js("document.getElementById('channels').innerText")
                assert "IMAP 127.0.0.1:" in mail and "ConnectionRefusedError" in mail, mail
                assert "no container is running" in text
                extra = fail_row(db, "one more", "timed out")
                await page.wait_for("document.getElementById('outbox-counts').innerText"
                                    ".includes('failed: 3')")
                assert await page.js("window.__loaded") == 1  # the same page: not reloaded
                with db.transaction() as c:
                    c.execute("DELETE FROM outbox WHERE id = ?", (extra,))
                await check_sizes(page, "overview", shots, ["Daemon", "Queue", "Outbox"])

                # Groups: the name as text, trigger, model, chat link
                await show(page, "groups", "document.body.innerText.includes('@Andy')")
                text = await page.js("document.getElementById('view').innerText")
                assert XSS_NAME in text and "claude-sonnet-4-5" in text and "idle" in text
                links = await page.js("[...document.querySelectorAll('#view a')]"
                                      ".map(a => a.getAttribute('href'))")
                assert "/?jid=hl:family" in links and "/?jid=hl:main" in links
                await no_markup_ran(page)
                await check_sizes(page, "groups", shots, [XSS_NAME, "open chat"])

                # Tasks: next run in the group's zone, history, pause; the CLI agrees
                await show(page, "tasks", "document.querySelector('[data-task-row=plants]')")
                text = await page.js("document.getElementById('view').innerText")
                assert XSS_PROMPT in text and "Europe/Berlin" in text
                assert "CET" in text or "CEST" in text
                await no_markup_ran(page)
                await page.js("document.querySelector('[data-runs=plants]').click()")
                await page.wait_for("!!document.getElementById('runs')")
                runs = await page.js("document.getElementById('runs').innerText")
                assert "watered" in runs and "the container exited 1" in runs
                assert "60.0s" in runs and "error" in runs and "success" in runs
                await check_sizes(page, "tasks", shots, [XSS_PROMPT, "Pause", "Runs of plants"])
                await page.js("document.querySelector('[data-task=plants]"
                              "[data-action=pause]').click()")
                await page.wait_for("!!document.querySelector('[data-task=plants]"
                                    "[data-action=resume]')")
                listed = {t["id"]: t["status"] for t in mdclaw_json("tasks", "list")}
                assert listed["plants"] == "paused"

                # Outbox: failed rows with the error; retry one, drop the other
                retry_row = f"document.querySelector('[data-outbox-row=\"{rows['retry']}\"]')"
                drop_row = f"document.querySelector('[data-outbox-row=\"{rows['drop']}\"]')"
                await show(page, "outbox", retry_row)
                text = await page.js("document.getElementById('view').innerText")
                assert "chat not found (HTTP 400)" in text and "bot was blocked" in text
                await check_sizes(page, "outbox", shots, ["retry me", "chat not found"])
                await page.js(f"document.querySelector('[data-row=\"{rows['retry']}\"]"
                              "[data-action=retry]').click()")
                await page.wait_for(f"!{retry_row}")
                status = {r["id"]: r["status"] for r in mdclaw_json("outbox", "list")}
                assert status[rows["retry"]] in ("pending", "sending", "sent")
                await page.js(f"document.querySelector('[data-row=\"{rows['drop']}\"]"
                              "[data-action=drop]').click()")
                await page.wait_for(f"!{drop_row}")
                assert rows["drop"] not in {r["id"] for r in mdclaw_json("outbox", "list")}

                # Quarantine: the reason, the payload as text; delete
                await show(page, "quarantine", "document.querySelector('[data-entry]')")
                text = await page.js("document.getElementById('view').innerText")
                errors = mdclaw_json("ipc", "errors")
                assert len(errors) == 1 and errors[0]["error"] in text
                assert "hl:main" in errors[0]["error"] or "chat" in errors[0]["error"]
                assert json.dumps(XSS_PAYLOAD) in await page.js("document.querySelector('.payload')"
                                                    ".textContent")
                await no_markup_ran(page)
                await check_sizes(page, "quarantine", shots, ["messages/evil.json", "Delete"])
                await page.js("document.querySelector('[data-delete]').click()")
                await page.wait_for("document.body.innerText.includes('nothing is quarantined')")
                assert mdclaw_json("ipc", "errors") == []

                # Usage: a bar per day per group, the budget line, over budget today
                await show(page, "usage", "document.querySelector('[data-group=family] svg')")
                bars = await page.js("[...document.querySelectorAll('[data-group=family] rect')]"
                                     ".map(r => +r.getAttribute('data-tokens'))")
                assert sorted(b for b in bars if b) == [4000, 6000]
                assert await page.js("!!document.querySelector('[data-group=family] .budget')")
                text = await page.js("document.getElementById('view').innerText")
                assert "today 6000 of 5000 tokens (over budget)" in text
                await check_sizes(page, "usage", shots, ["family", "main"])

                # Config: secrets as set/missing, never their content; the last reload
                await show(page, "config", "document.getElementById('config-json')")
                text = await page.js("document.getElementById('view').innerText")
                assert '"api_key_file": "set"' in text and MODEL_KEY not in text
                assert "no reload since the start" in text
                await check_sizes(page, "config", shots, ["Config", "Europe/Berlin"])
                # a reload (SIGHUP) that fails keeps the running config and says why
                cfg_path.write_text(cfg_path.read_text() + "bogus_key: 1\n")
                os.kill(daemon.pid, signal.SIGHUP)
                await page.js("location.hash = '#overview'")
                await page.wait_for("document.body.innerText.includes('refused')", timeout=20)
                await show(page, "config", "document.getElementById('reload')")
                assert "bogus_key" in await page.js("document.getElementById('reload')"
                                                    ".innerText")
                assert MODEL_KEY not in await page.js("document.documentElement.outerHTML")
        finally:
            db.close()

    with running_daemon(cfg_path, port) as daemon:
        asyncio.run(main())


def test_logging_in_with_the_token_in_chromium(tmp_path: Path) -> None:
    """With a token the page asks for it; a wrong one is refused, the right one sets the
    session cookie and the views load; logging out asks again."""
    chromium()
    port = free_port()
    token = tmp_path / "http.token"
    token.write_text("browser-token\n")
    token.chmod(0o600)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(
        f"data_dir: {tmp_path / 'data'}\n"
        "groups:\n  main: {name: Admin, jid: \"hl:main\", main: true}\n"
        f"channels:\n  http: {{listen: \"127.0.0.1:{port}\", secret_file: {token}}}\n")

    async def main() -> None:
        async with browse(f"http://127.0.0.1:{port}/operator/",
                          tmp_path / "chromium-profile") as page:
            await page.wait_for("!document.getElementById('login').hidden")
            await page.type_into("token", "wrong")
            await page.click("login-button")
            await page.wait_for("document.getElementById('login-error').textContent"
                                ".includes('wrong token')")
            await page.js("document.getElementById('token').value = ''")
            await page.type_into("token", "browser-token")
            await page.click("login-button")
            await page.wait_for("!!document.getElementById('outbox-counts')")
            assert await page.js("document.cookie") == ""  # HttpOnly: not for scripts
            await show(page, "groups", "document.body.innerText.includes('Admin')")
            await page.click("logout")
            await page.wait_for("!document.getElementById('login').hidden")
            await page.js("location.reload()")
            await page.wait_for("!document.getElementById('login').hidden")

    with running_daemon(cfg_path, port):
        asyncio.run(main())
