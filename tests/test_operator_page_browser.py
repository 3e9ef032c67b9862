"""The operator page in headless Chromium against a real daemon (no container engine):
every view shows what the state database and the IPC folders hold, its buttons change them
through the same code as the CLI (which then agrees), what agents and people wrote shows as
text, and each view fits a desktop (1280x800) and a 390 px phone, light and dark, without
sideways scrolling and without a serious or critical axe-core violation.

One check per point of the operator page's brief: the health verdict (the same problems as
`mdclaw status`), each problem and count a link to its view; a channel whose deliveries fail
is not "connected"; Cancel, Drop and Delete ask first; filters, sorting and bulk actions;
times in one readable form, intervals as "every 1 h", no exception names; no word broken in
a table at 1280 px; the usage chart's axis, today, input/output and models, its range, and
readable text on a phone; a group without a model; the config as written; no console error
on load, no empty table header, no skipped heading level.

DOCS_SCREENSHOTS=<folder> keeps the screenshots docs/web.md shows (`DOCS_SCREENSHOTS=docs/images
pytest tests/test_operator_page_browser.py -k every_view`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

from browser import SIZES, DevTools, browse, check_accessible, chromium
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
  - id: hourly-check
    group: main
    prompt: Look at the weather station
    interval: 1h
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

# What no person should read: an exception class name with its colon, a raw ISO time.
EXCEPTION_NAME = re.compile(r"\b[A-Z][A-Za-z]*(?:Error|Failed|Exception):")
RAW_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d")

# Page checks, evaluated in the page.
HEADINGS_IN_ORDER = """(() => { let last = 0; const bad = [];
  for (const h of document.querySelectorAll('h1,h2,h3,h4,h5,h6')) {
    if (h.closest('[hidden]')) continue;
    const n = +h.tagName[1];
    if (n > last + 1) bad.push(h.tagName + ' ' + h.textContent + ' after h' + last);
    last = n;
  } return bad; })()"""
EMPTY_HEADERS = ("[...document.querySelectorAll('th')].filter(th => !th.textContent.trim())"
                 ".length")
# Every word in a table cell on one line: a word whose range has two boxes is broken.
BROKEN_WORDS = """(() => { const bad = [];
  const walk = document.createTreeWalker(document.querySelector('#view'), NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) {
    const node = walk.currentNode;
    if (!node.parentElement.closest('td, th')) continue;
    const re = /\\S+/g; let m;
    while ((m = re.exec(node.data))) {
      const r = document.createRange(); r.setStart(node, m.index);
      r.setEnd(node, m.index + m[0].length);
      const lines = new Set([...r.getClientRects()].filter(b => b.width > 0)
                              .map(b => Math.round(b.top)));
      if (lines.size > 1) bad.push(m[0]);
    }
  } return bad; })()"""


def fail_row(db: Database, text: str, error: str) -> int:
    with db.transaction() as c:
        row = enqueue(c, chat_jid="hl:family", kind="text", text=text, source_group="family")
        c.execute("UPDATE outbox SET status = 'failed', attempts = 5, last_error = ? "
                  "WHERE id = ?", (error, row))
    return row


def seed(db: Database) -> dict[str, int]:
    rows = {"retry": fail_row(db, "retry me", "ChannelError: chat not found (HTTP 400)"),
            "drop": fail_row(db, "drop me", "bot was blocked by the user")}
    now = schedule.utc_now()
    with db.transaction() as c:
        run = insert_run(c, "plants", now - timedelta(minutes=3), due_at=now - timedelta(minutes=3))
        finish_run(c, run, "success", now - timedelta(minutes=2), result="watered")
        run = insert_run(c, "plants", now - timedelta(minutes=1), due_at=now - timedelta(minutes=1))
        finish_run(c, run, "error", now, error="RunFailed: the container exited 1")
        c.execute("UPDATE scheduled_tasks SET last_result = ? WHERE id = 'plants'",
                  ("error: RunFailed: the container exited 1",))
    day = now.strftime("%Y-%m-%d")
    yesterday = (now - timedelta(days=1)).strftime("%Y-%m-%d")
    record_usage(db, "family", "claude-sonnet-4-5", ok=True, input_tokens=3000,
                 output_tokens=1000, when=f"{yesterday}T10:00:00.000Z")
    record_usage(db, "family", "claude-sonnet-4-5", ok=True, input_tokens=5000,
                 output_tokens=1000, when=f"{day}T00:00:01.000Z")
    record_usage(db, "family", "claude-haiku-4-5", ok=True, input_tokens=700,
                 output_tokens=300, when=f"{day}T00:00:01.500Z")
    record_usage(db, "main", "claude-sonnet-4-5", ok=True, input_tokens=100,
                 output_tokens=50, when=f"{day}T00:00:02.000Z")
    return rows


async def show(page: DevTools, view: str, ready: str) -> None:
    await page.js(f"location.hash = '#{view}'")
    await page.wait_for(f"!!document.getElementById('view-{view}') && !!({ready})")


async def view_text(page: DevTools) -> str:
    return str(await page.js("document.getElementById('view').innerText"))


async def check_view(page: DevTools, view: str, shots: Path, texts: list[str]) -> None:
    """At each size: the texts show, nothing scrolls sideways, no word in a table is broken
    at 1280 px, headings do not skip a level, no table header is empty; axe-core finds
    nothing serious light or dark (a screenshot of each)."""
    for size, (w, h) in SIZES.items():
        await page.viewport(w, h)
        await page.wait_for(f"!!document.getElementById('view-{view}')")
        body = await page.js("document.body.innerText")
        for t in texts:
            assert t in body, f"{view} at {size}: {t!r} missing in:\n{body}"
        widths = await page.js("[document.documentElement.scrollWidth, window.innerWidth]")
        assert widths[0] <= widths[1], f"{view} at {size} scrolls sideways: {widths}"
        if size == "desktop":
            assert await page.js(BROKEN_WORDS) == [], f"{view}: words broken at 1280 px"
    assert await page.js(HEADINGS_IN_ORDER) == [], view
    assert await page.js(EMPTY_HEADERS) == 0, view
    await check_accessible(page, shots, view)


async def no_markup_ran(page: DevTools) -> None:
    assert await page.js("window.__xss === undefined")
    assert await page.js("document.querySelectorAll('#view script, #view img:not(.qr img), "
                         "#view svg[onload], #view [onerror]').length") == 0


async def choose(page: DevTools, select_id: str, value: str) -> None:
    """Pick `value` in a filter as a person does (the change event)."""
    await page.js(f"(() => {{ const s = document.getElementById({json.dumps(select_id)}); "
                  f"s.value = {json.dumps(value)}; "
                  "s.dispatchEvent(new Event('change')); })()")


async def answer_dialog(page: DevTools, yes: bool) -> str:
    """The confirmation asked: its question; answered yes or no."""
    await page.wait_for("document.getElementById('confirm').open")
    text = str(await page.js("document.getElementById('confirm-text').textContent"))
    await page.js(f"document.getElementById('confirm-{'yes' if yes else 'no'}').click()")
    await page.wait_for("!document.getElementById('confirm').open")
    return text


def console_errors(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = []
    for method, params in events:
        if method == "Runtime.exceptionThrown":
            out.append(json.dumps(params.get("exceptionDetails", {}))[:300])
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            out.append(json.dumps(params.get("args", []))[:300])
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            e = params["entry"]
            out.append(f"{e.get('text')} {e.get('url', '')}")
    return out


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

    def mdclaw_json(*args: str) -> Any:
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
                # No console error on load (the favicon is a data-less link: no request)
                await page.wait_for("!!document.getElementById('outbox-counts')")
                await page.call("Runtime.enable")
                await page.call("Log.enable")
                page.events.clear()
                await page.js("location.reload()")
                await page.wait_for("!!document.getElementById('outbox-counts')")
                await page.js("1")  # collects what came meanwhile
                assert console_errors(page.events) == []
                assert await page.js("document.querySelector('link[rel=icon]').href") \
                    == "data:,"

                # Overview: live, without a reload
                await page.js("window.__loaded = 1")
                await page.wait_for("document.getElementById('outbox-counts').innerText"
                                    ".includes('failed: 2')")
                text = await page.js("document.body.innerText")
                engine = await page.js("document.getElementById('engine').innerText")
                assert "unreachable" in engine or "checking" in engine, engine
                assert "no container is running" in text
                await page.wait_for("document.getElementById('channels').innerText"
                                    ".includes('fix: check channels.email.imap_host')")
                mail = await page.js("document.getElementById('channels').innerText")
                assert "IMAP 127.0.0.1:" in mail, mail

                # The verdict: the same problems as `mdclaw status`, each a link to its view
                await page.wait_for("document.querySelectorAll('#problems li').length >= 6")
                cli_problems = {p["key"]: p for p in mdclaw_json("status")["problems"]}
                page_problems = await page.js(
                    "[...document.querySelectorAll('#problems li')].map(li => "
                    "[li.dataset.problem, li.querySelector('a').getAttribute('href')])")
                assert {k for k, _ in page_problems} == set(cli_problems), page_problems
                verdict = await page.js("document.getElementById('verdict').textContent")
                assert verdict == f"{len(page_problems)} problems"
                links = dict(page_problems)
                assert links["quarantine"] == "#quarantine" and links["outbox"] == "#outbox"
                assert links["tasks_failing"] == "#tasks" and links["budget"] == "#usage"
                assert links["channel:http"] == "#outbox"  # its deliveries fail
                assert links["channel:email"] == "#overview"  # its server refuses
                assert all(cli_problems[k]["view"] == h[1:] for k, h in page_problems)
                # counts are links to their views
                counts = await page.js("Object.fromEntries([...document.querySelectorAll("
                                       "'#overview-cards a[data-count]')].map(a => "
                                       "[a.closest('div').innerText, a.getAttribute('href')]))")
                assert counts["failed deliveries: 2"] == "#outbox", counts
                assert counts["quarantined files: 1"] == "#quarantine", counts
                assert counts["tasks failing: 1"] == "#tasks", counts
                assert counts["over budget today: 1"] == "#usage", counts

                # A channel whose deliveries fail is not shown green "connected"
                http_state = await page.js(
                    "document.querySelector('[data-channel=http] [data-state]').dataset.state")
                assert http_state == "deliveries failing"
                assert await page.js("document.querySelector('[data-channel=http] "
                                     "[data-state]').className") == "bad"
                status = mdclaw_json("status")
                assert status["channel_states"]["http"] == "deliveries failing"
                # connected, but its mail server refuses: not green either
                assert await page.js("document.querySelector('[data-channel=email] "
                                     "[data-state]').dataset.state") == "needs attention"
                assert status["channel_states"]["email"] == "needs attention"

                extra = fail_row(db, "one more", "timed out")
                await page.wait_for("document.getElementById('outbox-counts').innerText"
                                    ".includes('failed: 3')")
                assert await page.js("window.__loaded") == 1  # the same page: not reloaded
                # a keyboard's place survives the refreshes
                await page.js("document.querySelector('[data-problem=quarantine] a').focus()")
                await page.js("window.__focused = document.activeElement")
                await page.wait_for("document.activeElement !== window.__focused && "
                                    "!!document.activeElement.closest('[data-problem=quarantine]')")
                with db.transaction() as c:
                    c.execute("DELETE FROM outbox WHERE id = ?", (extra,))
                text = await view_text(page)
                assert not EXCEPTION_NAME.search(text), text
                assert not RAW_TIME.search(text), text
                await check_view(page, "overview", shots, ["problems", "Status", "Channels"])
                # following a problem's link opens the view that fixes it
                await page.js("document.querySelector('[data-problem=quarantine] a').click()")
                await page.wait_for("!!document.getElementById('view-quarantine')")

                # Groups: the name as text, trigger, model, chat link
                await show(page, "groups", "document.body.innerText.includes('@Andy')")
                text = await view_text(page)
                assert XSS_NAME in text and "claude-sonnet-4-5" in text and "idle" in text
                links = await page.js("[...document.querySelectorAll('#view a')]"
                                      ".map(a => a.getAttribute('href'))")
                assert "/?jid=hl:family" in links and "/?jid=hl:main" in links
                await no_markup_ran(page)
                await check_view(page, "groups", shots, [XSS_NAME, "open chat"])

                # Tasks: readable times and schedules, no exception names; history
                await show(page, "tasks", "document.querySelector('[data-task-row=plants]')")
                text = await view_text(page)
                assert XSS_PROMPT in text and "Europe/Berlin" in text
                assert "every 1 h" in text and "cron 0 8 * * *" in text
                assert re.search(r"\(in \d+ (min|h)\)", text), text  # the next run
                assert "the container exited 1" in text
                assert not EXCEPTION_NAME.search(text) and not RAW_TIME.search(text), text
                await no_markup_ran(page)
                await page.js("document.querySelector('[data-runs=plants]').click()")
                await page.wait_for("!!document.getElementById('runs')")
                runs = await page.js("document.getElementById('runs').innerText")
                assert "watered" in runs and "the container exited 1" in runs
                assert "60.0s" in runs and "error" in runs and "success" in runs
                assert "min ago)" in runs and "RunFailed" not in runs
                await check_view(page, "tasks", shots, [XSS_PROMPT, "Pause", "Runs of plants"])
                # filtered by group, sorted
                await choose(page, "tasks-group", "family")
                await page.wait_for("!document.querySelector('[data-task-row=hourly-check]')")
                await choose(page, "tasks-group", "")
                await choose(page, "tasks-sort", "id")
                await page.wait_for("document.querySelectorAll('[data-task-row]').length === 2")
                order = await page.js("[...document.querySelectorAll('[data-task-row]')]"
                                      ".map(r => r.dataset.taskRow)")
                assert order == ["hourly-check", "plants"]
                # Cancel asks first; "Keep" changes nothing
                await page.js("document.querySelector('[data-task=plants]"
                              "[data-action=cancel]').click()")
                assert "Cancel task plants?" in await answer_dialog(page, yes=False)
                listed = {t["id"]: t["status"] for t in mdclaw_json("tasks", "list")}
                assert listed["plants"] == "active"
                # bulk: pause all shown (only family's), the CLI agrees
                await choose(page, "tasks-group", "family")
                await page.wait_for("!document.querySelector('[data-task-row=hourly-check]')")
                await page.js("document.querySelector('[data-bulk=pause]').click()")
                await page.wait_for("!!document.querySelector('[data-task=plants]"
                                    "[data-action=resume]')")
                listed = {t["id"]: t["status"] for t in mdclaw_json("tasks", "list")}
                assert listed == {"plants": "paused", "hourly-check": "active"}
                await choose(page, "tasks-group", "")

                # Outbox: failed rows with the error; filter, retry one, drop asks first
                retry_row = f"document.querySelector('[data-outbox-row=\"{rows['retry']}\"]')"
                drop_row = f"document.querySelector('[data-outbox-row=\"{rows['drop']}\"]')"
                await show(page, "outbox", retry_row)
                text = await view_text(page)
                assert "chat not found (HTTP 400)" in text and "bot was blocked" in text
                assert "ChannelError" not in text and not RAW_TIME.search(text)
                await check_view(page, "outbox", shots, ["retry me", "chat not found"])
                await page.js(f"document.querySelector('[data-row=\"{rows['retry']}\"]"
                              "[data-action=retry]').click()")
                await page.wait_for(f"!{retry_row}")
                status = {r["id"]: r["status"] for r in mdclaw_json("outbox", "list")}
                assert status[rows["retry"]] in ("pending", "sending", "sent")
                await page.js(f"document.querySelector('[data-row=\"{rows['drop']}\"]"
                              "[data-action=drop]').click()")
                assert "Drop delivery" in await answer_dialog(page, yes=False)
                assert rows["drop"] in {r["id"] for r in mdclaw_json("outbox", "list")}
                await page.js(f"document.querySelector('[data-row=\"{rows['drop']}\"]"
                              "[data-action=drop]').click()")
                await answer_dialog(page, yes=True)
                await page.wait_for(f"!{drop_row}")
                assert rows["drop"] not in {r["id"] for r in mdclaw_json("outbox", "list")}
                # bulk: three more fail; retry all failed shown, then drop the rest
                more = [fail_row(db, f"bulk {i}", "timed out") for i in range(3)]
                await page.js("location.hash = '#overview'")
                row = "document.querySelector('[data-outbox-row=\"{}\"]')".format
                await show(page, "outbox", row(more[2]))
                await page.js("document.querySelector('[data-bulk=retry]').click()")
                await page.wait_for(f"!{row(more[0])}")
                status = {r["id"]: r["status"] for r in mdclaw_json("outbox", "list")}
                assert all(status[i] != "failed" for i in more), status
                with db.transaction() as c:
                    c.execute("UPDATE outbox SET status = 'failed' WHERE id IN (?, ?)",
                              (more[0], more[1]))
                await choose(page, "outbox-state", "")  # every state shown
                await choose(page, "outbox-state", "failed")
                await page.wait_for(f"!!{row(more[1])}")
                await page.js("document.querySelector('[data-bulk=drop]').click()")
                assert "Drop 2 failed deliveries?" in await answer_dialog(page, yes=True)
                await page.wait_for(f"!{row(more[1])}")
                assert not {more[0], more[1]} & {r["id"] for r in mdclaw_json("outbox", "list")}

                # Quarantine: the reason, the payload as text; delete asks first
                await show(page, "quarantine", "document.querySelector('[data-entry]')")
                text = await view_text(page)
                errors = mdclaw_json("ipc", "errors")
                assert len(errors) == 1 and errors[0]["error"] in text
                assert json.dumps(XSS_PAYLOAD) in await page.js(
                    "document.querySelector('.payload').textContent")
                await no_markup_ran(page)
                await check_view(page, "quarantine", shots, ["messages/evil.json", "Delete"])
                await page.js("document.querySelector('[data-delete]').click()")
                await answer_dialog(page, yes=False)
                assert len(mdclaw_json("ipc", "errors")) == 1
                await page.js("document.querySelector('[data-bulk=delete]').click()")
                assert "Delete 1 quarantined file?" in await answer_dialog(page, yes=True)
                await page.wait_for("document.body.innerText.includes('nothing is quarantined')")
                assert mdclaw_json("ipc", "errors") == []

                # Usage: a labelled y axis, today marked, input and output, per model, range
                await show(page, "usage", "document.querySelector('[data-group=family] svg')")
                totals = await page.js("[...document.querySelectorAll('[data-group=family] "
                                       "g[data-day]')].map(g => +g.dataset.tokens)")
                assert len(totals) == 14 and sorted(t for t in totals if t) == [4000, 7000]
                labels = await page.js("[...document.querySelectorAll('[data-group=family] "
                                       "svg text')].map(t => t.textContent)")
                assert "tokens" in labels and "today" in labels and "0" in labels
                assert "10 k" in labels  # the axis' top: a round number above 7000
                assert await page.js("!!document.querySelector('[data-group=family] .budget')")
                assert await page.js("document.querySelectorAll('[data-group=family] "
                                     "rect.in').length") == 14
                assert await page.js("!!document.querySelector('[data-group=family] "
                                     ".today-mark')")
                assert await page.js("document.querySelectorAll('#view svg title').length") == 0
                text = await view_text(page)
                assert "today 7000 of 5000 tokens (over budget)" in text
                per_model = await page.js("[...document.querySelectorAll('[data-usage-row]')]"
                                          ".map(r => r.dataset.usageRow)")
                today = schedule.utc_now().strftime("%Y-%m-%d")
                assert f"family/{today}/claude-haiku-4-5" in per_model
                assert f"family/{today}/claude-sonnet-4-5" in per_model
                await check_view(page, "usage", shots, ["family", "main", "input", "output"])
                # readable on a phone: no text under 11 px as drawn (drawn again for the
                # phone's width)
                await page.viewport(*SIZES["phone"])
                await page.wait_for("document.querySelector('[data-group=family] svg')"
                                    ".getAttribute('width') < 400")
                smallest = await page.js("Math.min(...[...document.querySelectorAll('#view svg "
                                         "text')].map(t => t.getBoundingClientRect().height))")
                assert smallest >= 11, smallest
                await page.call("Emulation.clearDeviceMetricsOverride")
                await choose(page, "usage-days", "7")
                await page.wait_for("document.querySelectorAll('[data-group=family] "
                                    "g[data-day]').length === 7")

                # Config: the YAML as written, secrets set/missing, the box focusable
                await show(page, "config", "document.getElementById('config-yaml')")
                yaml = await page.js("document.getElementById('config-yaml').textContent")
                assert yaml.startswith(f"data_dir: {data_dir}\n")
                assert "interval: 1h" in yaml and f"api_key_file: {key}}}  # set" in yaml
                assert await page.js("document.getElementById('config-yaml').tabIndex") == 0
                text = await view_text(page)
                assert '"api_key_file"' not in text and MODEL_KEY not in text
                assert "no reload since the start" in text
                await check_view(page, "config", shots, ["Config", "Europe/Berlin"])

                await show(page, "approvals", "true")
                await check_view(page, "approvals", shots, ["Approvals"])
                await show(page, "mcp", "true")
                await check_view(page, "mcp", shots, ["MCP servers"])

                # a reload (SIGHUP) that fails keeps the running config and says why
                cfg_path.write_text(cfg_path.read_text() + "bogus_key: 1\n")
                os.kill(daemon.pid, signal.SIGHUP)
                await page.js("location.hash = '#overview'")
                await page.wait_for("!!document.querySelector('[data-problem=reload]')",
                                    timeout=20)
                assert "the last config reload was refused" in await view_text(page)
                await show(page, "config", "document.getElementById('reload')")
                assert "bogus_key" in await page.js("document.getElementById('reload')"
                                                    ".innerText")
                assert MODEL_KEY not in await page.js("document.documentElement.outerHTML")
        finally:
            db.close()
        keep = os.environ.get("DOCS_SCREENSHOTS")  # docs/images: the ones docs/web.md shows
        if keep:
            for name in ("overview", "tasks", "usage", "outbox"):
                for variant in ("desktop-light", "phone-dark"):
                    src = shots / f"{name}-{variant}.png"
                    (Path(keep) / f"operator-{name}-{variant}.png").write_bytes(src.read_bytes())

    with running_daemon(cfg_path, port) as daemon:
        asyncio.run(main())


def test_logging_in_with_the_token_in_chromium(tmp_path: Path) -> None:
    """With a token the page asks for it; a wrong one is refused, the right one sets the
    session cookie and the views load; logging out asks again. This install has no model:
    its group says so, and the verdict names it."""
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
            await check_accessible(page, None, "login")
            await page.type_into("token", "wrong")
            await page.click("login-button")
            await page.wait_for("document.getElementById('login-error').textContent"
                                ".includes('wrong token')")
            await page.js("document.getElementById('token').value = ''")
            await page.type_into("token", "browser-token")
            await page.click("login-button")
            await page.wait_for("!!document.getElementById('outbox-counts')")
            assert await page.js("document.cookie") == ""  # HttpOnly: not for scripts
            await page.wait_for("[...document.querySelectorAll('#problems li')].some("
                                "li => li.textContent.includes('no model for 1 group (main)'))")
            assert await page.js("document.getElementById('verdict').textContent") != "healthy"
            await show(page, "groups", "document.body.innerText.includes('Admin')")
            model = await page.js("document.querySelector('[data-model=main]').textContent")
            assert model == "none: answers with the setup message"
            await page.click("logout")
            await page.wait_for("!document.getElementById('login').hidden")
            await page.js("location.reload()")
            await page.wait_for("!document.getElementById('login').hidden")

    with running_daemon(cfg_path, port):
        asyncio.run(main())


def test_the_page_is_small_and_has_no_inline_script_or_style() -> None:
    """No bundler: the page's own files and the shared style sheet, under 150 KB
    compressed; no inline script or style for the CSP to refuse."""
    import gzip
    import re as regex

    from mdclaw.operator.web import PAGE_CSP, STATIC
    from mdclaw.webassets import PageAssets

    assets = PageAssets("mdclaw.operator", STATIC, page_csp=PAGE_CSP, headers={
        "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"})
    files = {route: assets.body(route) for route in STATIC if route}
    compressed = sum(len(gzip.compress(b, 9)) for route, b in files.items()
                     if route != "index.html")  # "" and "index.html" are the same file
    assert compressed < 150 * 1024, compressed
    html = files["index.html"].decode()
    assert not regex.search(r"<script(?![^>]*\bsrc=)", html)
    assert "<style" not in html and not regex.search(r"\sstyle=", html)
    assert not regex.search(r"\son[a-z]+=", html)
    js = files["app.js"].decode()
    assert "innerHTML" not in js and "setAttribute(\"style\"" not in js
    assert "script-src 'self'" in PAGE_CSP and "style-src 'self'" in PAGE_CSP
