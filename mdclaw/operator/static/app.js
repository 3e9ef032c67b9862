// The operator page. Everything it shows is put into the page as text (textContent,
// attributes set one by one), never as HTML: group names, prompts and quarantined files
// are written by agents and people, and may hold markup.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { csrf: null, auth: null, view: "overview", timer: null, openRuns: null,
                filters: {}, usageDays: 14 };
const POLL_MS = 1500;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "onclick") node.addEventListener("click", v);
    else if (k === "text") node.textContent = String(v);
    else node.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svgEl(tag, attrs, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = String(text);
  return node;
}

// Every column has a name (a header is never empty); `num` columns are right-aligned.
function table(columns, rows, emptyText) {
  if (!rows.length) return el("p", { class: "muted", text: emptyText });
  const head = el("tr", {}, ...columns.map((c) => el("th", { scope: "col", class: c.num ? "num" : null, text: c.label })));
  const body = rows.map((r) => el("tr", r.__attrs || {}, ...columns.map((c) => {
    const v = c.cell ? c.cell(r) : r[c.key];
    const td = el("td", { "data-label": c.label, class: [c.num ? "num" : "", c.cls || ""].join(" ").trim() || null });
    td.append(v instanceof Node ? v : document.createTextNode(v === null || v === undefined ? "-" : String(v)));
    return td;
  })));
  return el("div", { class: "scroll" }, el("table", {}, el("thead", {}, head), el("tbody", {}, ...body)));
}

function notice(text, bad) {
  const n = $("notice");
  n.textContent = text || "";
  n.className = bad ? "error" : "ok";
}

async function api(path, options) {
  const opts = Object.assign({ credentials: "same-origin", headers: {} }, options || {});
  if (opts.method === "POST") {
    opts.headers["Content-Type"] = "application/json";
    if (state.csrf) opts.headers["X-CSRF-Token"] = state.csrf;
  }
  const r = await fetch("/operator/" + path, opts);
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  if (r.status === 401 && path !== "login") { showLogin(); throw new Error("log in first"); }
  if (!r.ok) throw new Error((data && data.error) || ("HTTP " + r.status));
  return data;
}

function post(path, body) {
  return api(path, { method: "POST", body: JSON.stringify(body || {}) });
}

function showLogin() {
  $("login").hidden = false;
  $("view").hidden = true;
  $("logout").hidden = true;
  stopPolling();
}

async function start() {
  try {
    const s = await api("api/session");
    state.csrf = s.csrf;
    state.auth = s.auth;
  } catch (e) {
    if (!$("login").hidden) return;
    notice(e.message, true);
    return;
  }
  $("login").hidden = true;
  $("view").hidden = false;
  $("logout").hidden = state.auth !== "cookie";
  route();
}

$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("login-error").textContent = "";
  try {
    const r = await post("login", { token: $("token").value });
    state.csrf = r.csrf;
    $("token").value = "";
    start();
  } catch (e) {
    $("login-error").textContent = e.message;
  }
});

$("logout").addEventListener("click", async () => {
  await post("logout").catch(() => null);
  state.csrf = null;
  showLogin();
});

// ------------------------------------------------------------------ times, words

const DATE_FMT = new Intl.DateTimeFormat(undefined, {
  year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });

function relative(seconds) {
  // "just now", "3 min ago", "2 h ago", "in 5 min", "4 d ago"
  const a = Math.abs(seconds);
  let t;
  if (a < 45) return "just now";
  if (a < 5400) t = Math.round(a / 60) + " min";
  else if (a < 172800) t = Math.round(a / 3600) + " h";
  else t = Math.round(a / 86400) + " d";
  return seconds >= 0 ? t + " ago" : "in " + t;
}

// A time as people read it: the date and time in the viewer's zone, then how long ago
// ("26 Nov 2026, 14:20 (3 min ago)"); the exact UTC time in the element's datetime.
function when(iso) {
  if (!iso) return "-";
  const ms = Date.parse(iso);
  if (isNaN(ms)) return String(iso);
  return el("time", { datetime: iso }, DATE_FMT.format(new Date(ms)) + " (" + relative((Date.now() - ms) / 1000) + ")");
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 5400) return Math.round(seconds / 60) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function plural(n, one, many) { return n + " " + (n === 1 ? one : many); }

function card(title, ...body) {
  return el("div", { class: "card" }, el("h3", { text: title }), ...body);
}

function kv(pairs) {
  return el("div", {}, ...pairs.map(([k, v, cls]) =>
    el("div", {}, el("span", { class: "muted", text: k + ": " }),
      v instanceof Node ? v : el("span", { class: cls || null, text: v }))));
}

// A count that links to the view where it is dealt with.
function countLink(n, view, label, bad) {
  return el("a", { href: "#" + view, class: "count" + (bad && n ? " bad" : ""), "data-count": view }, String(n) + (label ? " " + label : ""));
}

// ------------------------------------------------------------------ confirmation

function confirmed(text, yes) {
  const d = $("confirm");
  $("confirm-text").textContent = text;
  $("confirm-yes").textContent = yes;
  d.returnValue = "";
  return new Promise((resolve) => {
    d.addEventListener("close", () => resolve(d.returnValue === "yes"), { once: true });
    d.showModal();
    $("confirm-no").focus();
  });
}

// ------------------------------------------------------------------ filters and sorting

// The view's filters (group, state, sort), kept while the page is open.
function filters(view) {
  if (!state.filters[view]) state.filters[view] = { group: "", state: "", sort: "" };
  return state.filters[view];
}

function select(id, label, value, options, onchange) {
  const s = el("select", { id });
  for (const [v, text] of options) {
    const o = el("option", { value: v }, text);
    if (v === value) o.selected = true;
    s.append(o);
  }
  s.addEventListener("change", () => onchange(s.value));
  return el("label", { for: id }, label, s);
}

// A bar of group/state/sort selects over `rows`; returns [bar, rows filtered and sorted].
function filtered(view, rows, { groupKey, stateKey, states, sorts, stateLabel }) {
  const f = filters(view);
  const groups = [...new Set(rows.map((r) => r[groupKey]).filter((g) => g))].sort();
  const stateList = states || [...new Set(rows.map((r) => r[stateKey]))].sort();
  if (!sorts.some(([k]) => k === f.sort)) f.sort = sorts[0][0];
  const bar = el("div", { class: "filters" },
    select(view + "-group", "group", f.group, [["", "all groups"], ...groups.map((g) => [g, g])], (v) => { f.group = v; refresh(); }),
    select(view + "-state", stateLabel || "state", f.state, [["", "all " + (stateLabel ? stateLabel + "s" : "states")], ...stateList.map((s) => [s, s])], (v) => { f.state = v; refresh(); }),
    select(view + "-sort", "sort by", f.sort, sorts.map(([k, label]) => [k, label]), (v) => { f.sort = v; refresh(); }));
  let out = rows.filter((r) => (!f.group || r[groupKey] === f.group) && (!f.state || r[stateKey] === f.state));
  const sort = sorts.find(([k]) => k === f.sort);
  out = out.slice().sort(sort[2]);
  return [bar, out];
}

const by = (key, desc) => (a, b) => {
  const x = a[key] === null || a[key] === undefined ? "" : a[key];
  const y = b[key] === null || b[key] === undefined ? "" : b[key];
  const c = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
  return desc ? -c : c;
};

async function bulk(path, ids, doneText) {
  try {
    const r = await post(path, { ids });
    const done = (r.done || r.deleted || []).length;
    const refused = Object.entries(r.refused || {});
    notice(doneText(done) + (refused.length ? "; not done: " + refused.map(([k, v]) => k + " (" + v + ")").join(", ") : ""), refused.length > 0);
  } catch (e) { notice(e.message, true); }
  refresh();
}

// ------------------------------------------------------------------ views

const views = {
  async overview(root) {
    const o = await api("api/overview");
    const h = o.health;
    const box = el("section", { id: "health", class: h.problems.length ? "has-problems" : "good", "aria-labelledby": "verdict" },
      el("h2", { id: "verdict", class: h.problems.length ? "bad" : "ok", text: h.problems.length ? h.verdict : "Healthy: no problems" }));
    if (h.problems.length) {
      box.append(el("ul", { id: "problems" }, ...h.problems.map((p) => el("li", { "data-problem": p.key },
        el("a", { href: "#" + p.view, text: p.text })))));
    }
    root.append(box);
    root.append(el("h2", { text: "Status" }));
    const c = o.counts;
    const ob = o.outbox;
    const cards = el("div", { class: "cards", id: "overview-cards" });
    cards.append(card("Needs a look", kv([
      ["failed deliveries", countLink(ob.failed, "outbox", "", true)],
      ["failed turns (24\u00a0h)", countLink(c.failed_turns, "groups", "", true)],
      ["quarantined files", countLink(c.quarantine, "quarantine", "", true)],
      ["tasks failing", countLink(c.tasks_failing, "tasks", "", true)],
      ["tasks paused", countLink(c.tasks_paused, "tasks")],
      ["over budget today", countLink(c.over_budget, "usage", "", true)],
    ])));
    cards.append(card("Daemon", kv([
      ["pid", o.daemon.pid], ["version", o.daemon.version],
      ["up since", when(o.daemon.started_at)],
      ["groups", countLink(o.daemon.groups, "groups")],
      ["next task", o.daemon.next_task ? when(o.daemon.next_task) : "none"],
    ])));
    const engineOk = String(o.engine).startsWith("ok");
    cards.append(card("Container engine", el("p", { class: engineOk ? "ok" : "bad", id: "engine", text: o.engine_text || o.engine })));
    const q = o.queue || {};
    cards.append(card("Queue", kv([
      ["running", Object.keys(q.running || {}).length], ["waiting", q.pending || 0],
      ["retrying", (q.retrying || []).join(", ") || "none"], ["max at once", q.max_concurrent || "-"],
    ])));
    cards.append(card("Outbox", el("div", { id: "outbox-counts" }, kv([
      ["pending", countLink(ob.pending, "outbox")], ["sending", ob.sending],
      ["failed", countLink(ob.failed, "outbox", "", true)], ["sent in 24 h", ob.sent_24h],
    ]))));
    const disk = o.disk || {};
    const blocked = Object.keys(disk.blocked || {});
    cards.append(card("Disk", el("div", { id: "disk" }, kv([
      ["free", disk.free === null || disk.free === undefined ? "unknown" : size(disk.free) + " of " + size(disk.total),
        disk.free !== null && disk.free < disk.floor ? "bad" : "ok"],
      ["runs stop below", size(disk.floor)],
      ["groups refused", blocked.length ? blocked.join(", ") : "none", blocked.length ? "bad" : null],
    ]))));
    const budgets = o.budget_today || [];
    cards.append(card("Budget today (UTC)", budgets.length ? el("div", { id: "budget" }, kv(budgets.map((b) =>
      [b.group_folder, b.tokens_today + " of " + b.tokens_per_day + " tokens" + (b.over ? " (over)" : ""), b.over ? "bad" : null])))
      : el("p", { class: "muted", text: "no group has a daily budget" })));
    const rl = o.reload;
    cards.append(card("Last reload", rl ? el("div", {}, when(rl.at), el("p", {
      class: rl.ok ? "ok" : "bad", text: rl.ok ? "applied, " + plural(rl.changes.length, "change", "changes") : "refused: " + rl.error }))
      : el("p", { class: "muted", text: "no reload since the start" })));
    const bk = o.backup || {};
    cards.append(card("Last backup", el("div", { id: "backup" }, bk.last_success
      ? el("p", { class: bk.level === "ok" ? "ok" : "bad" }, when(bk.last_success), bk.overdue ? ": " + bk.missed + " scheduled backups missed" : "")
      : el("p", { class: "muted", text: "none recorded (mdclaw backup)" }))));
    root.append(cards);
    root.append(el("h2", { text: "Channels" }));
    const chans = el("div", { class: "cards", id: "channels" });
    for (const ch of o.channels) {
      const st = ch.state || (ch.connected ? "connected" : "not connected");
      const parts = [el("p", { class: st === "connected" ? "ok" : "bad", "data-state": st, text: st })];
      if (ch.failing) parts.push(el("p", {}, el("a", { href: "#outbox", text: plural(ch.failing.failed, "delivery", "deliveries") + " failed in the last hour" }),
        ch.failing.last_error ? ": " + ch.failing.last_error : ""));
      if (ch.link_state) parts.push(el("p", { class: ch.link_state === "linked" ? "ok" : "warn", text: "link: " + ch.link_state }));
      if (ch.error) parts.push(el("p", { class: "error", text: ch.error }));
      if (ch.detail) parts.push(el("p", { class: ch.fix ? "warn" : "muted", text: ch.detail }));
      if (ch.fix) parts.push(el("p", { text: "fix: " + ch.fix }));
      if (ch.qr_svg) {
        parts.push(el("p", { text: "Scan this code with the phone to link it:" }));
        parts.push(el("div", { class: "qr" }, el("img", { src: ch.qr_svg, alt: "QR code to link " + ch.name })));
      } else if (ch.qr) {
        parts.push(el("pre", { text: ch.qr, tabindex: 0 }));
      }
      chans.append(el("div", { class: "card", "data-channel": ch.name }, el("h3", { text: ch.name }), ...parts));
    }
    root.append(chans);
    root.append(el("h2", { text: "Running containers" }));
    root.append(table([
      { label: "group", key: "group", cls: "nowrap" }, { label: "job", key: "job", cls: "nowrap" },
      { label: "running for", cell: (r) => duration(r.age_s) },
    ], o.containers, "no container is running"));
  },

  async groups(root) {
    const gs = await api("api/groups");
    root.append(el("h2", { text: "Groups" }));
    root.append(table([
      { label: "group", cell: (g) => el("span", {}, el("strong", { text: g.name }), el("br"), el("span", { class: "muted", text: g.folder + (g.is_main ? " (main)" : "") })) },
      { label: "trigger", cell: (g) => g.trigger + (g.requires_trigger ? "" : " (not needed)") },
      { label: "model", cls: "nowrap", cell: (g) => el("span", { class: g.model.startsWith("none") ? "warn" : null, "data-model": g.folder, text: g.model }) },
      { label: "last activity", cell: (g) => when(g.last_activity) },
      { label: "failed turns (24\u00a0h)", num: true, cell: (g) => g.failed_turns ? el("span", { class: "bad", text: String(g.failed_turns) }) : "0" },
      { label: "container", key: "container", cls: "nowrap" },
      { label: "chat", cls: "nowrap", cell: (g) => g.chat_url ? el("a", { href: g.chat_url, text: "open chat" }) : (g.jid || "-") },
      { label: "chats", cell: (g) => (g.chats || []).length > 1 ? g.chats.join(", ") + " (" + g.session + ")" : "-" },
    ], gs, "no groups registered"));
  },

  async tasks(root) {
    const ts = await api("api/tasks");
    root.append(el("h2", { text: "Tasks" }));
    // Which buttons a task gets is the server's rule (`actions`, mdclaw.state.tasks).
    const act = (t, action, label, cls) => !t.actions.includes(action) ? null : el("button", {
      class: cls || null, "data-task": t.id, "data-action": action,
      onclick: async (ev) => {
        if (action === "cancel" && !await confirmed("Cancel task " + t.id + "? It does not run again.", "Cancel task")) return;
        ev.target.disabled = true;
        try { notice((await post("api/tasks/" + encodeURIComponent(t.id) + "/" + action)).message); }
        catch (e) { notice(e.message, true); }
        refresh();
      },
    }, label);
    const [bar, shown] = filtered("tasks", ts, { groupKey: "group_folder", stateKey: "status",
      sorts: [["next", "next run", by("next_run")], ["id", "id", by("id")], ["group", "group", by("group_folder")], ["status", "state", by("status")]] });
    root.append(bar);
    const ids = (action) => shown.filter((t) => t.actions.includes(action)).map((t) => t.id);
    const bulkButton = (action, label, cls, ask) => {
      const n = ids(action).length;
      return el("button", { class: cls || null, "data-bulk": action, disabled: n === 0, onclick: async () => {
        const list = ids(action);
        if (ask && !await confirmed(ask(list.length), label)) return;
        bulk("api/bulk/tasks/" + action, list, (d) => plural(d, "task", "tasks") + " " + (action === "pause" ? "paused" : action === "resume" ? "resumed" : "cancelled"));
      } }, label + " (" + n + ")");
    };
    root.append(el("div", { class: "bulk" }, bulkButton("pause", "Pause all shown"), bulkButton("resume", "Resume all shown"),
      bulkButton("cancel", "Cancel all shown", "danger", (n) => "Cancel " + plural(n, "task", "tasks") + "? They do not run again.")));
    root.append(table([
      { label: "id", key: "id", cls: "nowrap" }, { label: "group", key: "group_folder", cls: "nowrap" },
      { label: "schedule", cell: (t) => el("span", {}, t.schedule, el("br"), el("span", { class: "muted", text: t.zone })) },
      { label: "state", key: "status", cls: "nowrap" },
      { label: "next run", cell: (t) => when(t.next_run) },
      { label: "last result", cell: (t) => t.last_result || "-" },
      { label: "prompt", cell: (t) => el("span", { class: "prompt", text: t.prompt }) },
      { label: "actions", cell: (t) => el("span", {},
          act(t, "pause", "Pause"), act(t, "resume", "Resume"),
          act(t, "run-now", "Run now"), act(t, "cancel", "Cancel", "danger"),
          el("button", { "data-runs": t.id, onclick: () => { state.openRuns = t.id; refresh(); } }, "History")) },
    ], shown.map((t) => Object.assign({ __attrs: { "data-task-row": t.id } }, t)), ts.length ? "no task matches" : "no tasks"));
    if (state.openRuns) {
      const h = await api("api/tasks/" + encodeURIComponent(state.openRuns) + "/runs").catch(() => null);
      if (h) {
        root.append(el("h3", { id: "runs-title", text: "Runs of " + h.task.id }));
        root.append(el("div", { id: "runs" }, table([
          { label: "due", cell: (r) => when(r.due_at) }, { label: "started", key: "started" },
          { label: "state", key: "status" }, { label: "duration", key: "duration", num: true },
          { label: "outcome", key: "outcome" }, { label: "delay", key: "delay" },
        ], h.runs, "this task has not run yet")));
      }
    }
  },

  async approvals(root) {
    const a = await api("api/approvals");
    root.append(el("h2", { text: "Approvals" }));
    if (!a.people) root.append(el("p", { class: "muted", text: "No people are configured: nothing needs approval (docs/approvals.md)." }));
    root.append(el("h3", { text: "Waiting for a person" }));
    if (!a.pending.length) root.append(el("p", { class: "muted", text: "nothing waits" }));
    const decide = (p, action, option) => async (ev) => {
      ev.target.disabled = true;
      try {
        const r = await post("api/approvals/" + p.id + "/" + action, option ? { option } : {});
        notice("#" + p.id + " " + r.status + " by " + r.decided_label);
      } catch (e) { notice(e.message, true); }
      refresh();
    };
    for (const p of a.pending) {
      const buttons = [];
      if (p.kind === "question") {
        (p.request.options || []).forEach((o, i) => buttons.push(el("button", {
          "data-approval": p.id, "data-action": "approve", onclick: decide(p, "approve", i + 1) }, o)));
      } else {
        buttons.push(el("button", { "data-approval": p.id, "data-action": "approve",
          onclick: decide(p, "approve") }, p.kind === "admission" ? "Admit" : "Approve"));
      }
      buttons.push(el("button", { class: "danger", "data-approval": p.id, "data-action": "deny",
        onclick: decide(p, "deny") }, p.kind === "admission" ? "Ignore" : "Deny"));
      root.append(el("div", { class: "card", "data-pending": p.id },
        el("h4", { text: "#" + p.id + " " + p.kind + " of " + p.group_folder }),
        // The request as the cards show it: escaped by the host, put in as text.
        el("pre", { class: "payload", tabindex: 0, text: p.shown.join("\n") }),
        kv([["rule", p.rule || "-"], ["approver", p.approver], ["asked", when(p.created_at)],
            ["expires", when(p.expires_at)], ["wrong codes", p.wrong_codes + (p.codes_locked ? " (codes locked)" : "")]]),
        el("span", {}, ...buttons)));
    }
    root.append(el("h3", { text: "Decided (the audit)" }));
    root.append(table([
      { label: "id", key: "id", num: true }, { label: "group", key: "group_folder", cls: "nowrap" }, { label: "what", key: "summary" },
      { label: "outcome", key: "status" }, { label: "by", cell: (r) => r.decided_label || "-" },
      { label: "via", key: "decided_via" }, { label: "asked", cell: (r) => when(r.created_at) },
      { label: "decided", cell: (r) => when(r.decided_at) }, { label: "result", cell: (r) => r.outcome || "-" },
    ], a.recent.map((r) => Object.assign({ __attrs: { "data-decided": r.id } }, r)), "nothing decided yet"));
  },

  async outbox(root) {
    const o = await api("api/outbox");
    root.append(el("h2", { text: "Outbox" }));
    root.append(el("p", { text: `pending ${o.counts.pending}, sending ${o.counts.sending}, failed ${o.counts.failed}, sent in the last 24 hours ${o.counts.sent_24h}` }));
    const f = filters("outbox");
    if (f.state === undefined || f.state === "" && !f.touched) { f.state = "failed"; f.touched = true; }
    const [bar, shown] = filtered("outbox", o.rows, { groupKey: "source_group", stateKey: "status",
      states: ["failed", "pending", "sending", "sent"],
      sorts: [["newest", "newest first", by("id", true)], ["oldest", "oldest first", by("id")], ["chat", "chat", by("chat_jid")], ["tries", "most tries", by("attempts", true)]] });
    root.append(bar);
    const failedShown = shown.filter((r) => r.status === "failed").map((r) => r.id);
    root.append(el("div", { class: "bulk" },
      el("button", { "data-bulk": "retry", disabled: !failedShown.length, onclick: () =>
        bulk("api/bulk/outbox/retry", failedShown, (d) => plural(d, "delivery", "deliveries") + " will be sent again") }, "Retry all failed shown (" + failedShown.length + ")"),
      el("button", { class: "danger", "data-bulk": "drop", disabled: !failedShown.length, onclick: async () => {
        if (!await confirmed("Drop " + plural(failedShown.length, "failed delivery", "failed deliveries") + "? They are deleted for good.", "Drop")) return;
        bulk("api/bulk/outbox/drop", failedShown, (d) => plural(d, "delivery", "deliveries") + " dropped");
      } }, "Drop all failed shown (" + failedShown.length + ")")));
    const act = (r, action, label, cls) => el("button", {
      class: cls || null, "data-row": r.id, "data-action": action,
      onclick: async (ev) => {
        if (action === "drop" && !await confirmed("Drop delivery " + r.id + " to " + r.chat_jid + "? It is deleted for good.", "Drop")) return;
        ev.target.disabled = true;
        try { await post("api/outbox/" + r.id + "/" + action); notice("row " + r.id + (action === "retry" ? " will be sent again" : " dropped")); }
        catch (e) { notice(e.message, true); }
        refresh();
      },
    }, label);
    root.append(table([
      { label: "id", key: "id", num: true }, { label: "chat", key: "chat_jid", cls: "nowrap" }, { label: "group", key: "source_group", cls: "nowrap" },
      { label: "what", cell: (r) => r.kind === "text" ? r.text : r.kind === "file" ? "file " + (r.file_name || "") : "reaction " + (r.emoji || "") },
      { label: "state", key: "status", cls: "nowrap" },
      { label: "tries", key: "attempts", num: true }, { label: "last change", cell: (r) => when(r.updated_at) },
      { label: "error", cell: (r) => el("span", { class: r.last_error ? "error" : null, text: r.last_error || "-" }) },
      { label: "actions", cell: (r) => r.status === "failed" ? el("span", {}, act(r, "retry", "Retry"), act(r, "drop", "Drop", "danger")) : "-" },
    ], shown.map((r) => Object.assign({ __attrs: { "data-outbox-row": r.id } }, r)), o.rows.length ? "no delivery matches" : "no deliveries"));
  },

  async quarantine(root) {
    const qs = await api("api/quarantine");
    root.append(el("h2", { text: "Quarantine" }));
    root.append(el("p", { class: "muted", text: "Command files the host refused, with the reason. Their content is shown as plain text." }));
    for (const q of qs) q.kind = (q.original_file || "").split("/")[0] || "-";
    const [bar, shown] = filtered("quarantine", qs, { groupKey: "source_group", stateKey: "kind", stateLabel: "kind",
      sorts: [["newest", "newest first", by("processed_at", true)], ["oldest", "oldest first", by("processed_at")], ["group", "group", by("source_group")]] });
    if (qs.length) {
      root.append(bar);
      const names = shown.map((q) => q.name);
      root.append(el("div", { class: "bulk" }, el("button", { class: "danger", "data-bulk": "delete", disabled: !names.length, onclick: async () => {
        if (!await confirmed("Delete " + plural(names.length, "quarantined file", "quarantined files") + "? They are gone for good.", "Delete")) return;
        bulk("api/bulk/quarantine/delete", names, (d) => plural(d, "file", "files") + " deleted");
      } }, "Delete all shown (" + names.length + ")")));
    } else {
      root.append(el("p", { class: "muted", text: "nothing is quarantined" }));
    }
    for (const q of shown) {
      root.append(el("div", { class: "card", "data-entry": q.name },
        el("h3", { text: q.source_group + " / " + q.original_file }),
        kv([["reason", q.error, "error"], ["when", when(q.processed_at)], ["entry", q.name]]),
        el("pre", { class: "payload", tabindex: 0, "aria-label": "content of " + q.original_file, text: q.payload + (q.payload_cut ? "\n… (cut)" : "") || "(empty: the file was not kept)" }),
        el("button", { class: "danger", "data-delete": q.name, onclick: async (ev) => {
          if (!await confirmed("Delete " + q.original_file + " of " + q.source_group + "? It is gone for good.", "Delete")) return;
          ev.target.disabled = true;
          try { await post("api/quarantine/delete", { name: q.name }); notice("deleted " + q.name); }
          catch (e) { notice(e.message, true); }
          refresh();
        } }, "Delete")));
    }
  },

  async usage(root) {
    const u = await api("api/usage?days=" + state.usageDays);
    root.append(el("h2", { text: "Usage" }));
    root.append(el("div", { class: "filters" }, select("usage-days", "days", String(state.usageDays),
      [["7", "last 7 days"], ["14", "last 14 days"], ["30", "last 30 days"], ["90", "last 90 days"]],
      (v) => { state.usageDays = +v; refresh(); })));
    root.append(el("p", { class: "muted legend" }, "Model tokens per UTC day: ",
      el("span", {}, el("span", { class: "swatch in" }), "input"), el("span", {}, el("span", { class: "swatch out" }), "output")));
    const days = [];
    for (let i = u.days - 1; i >= 0; i--) days.push(new Date(Date.parse(u.today_day + "T00:00:00Z") - i * 86400000).toISOString().slice(0, 10));
    const groups = [...new Set(u.rows.map((r) => r.group_folder).concat(Object.keys(u.budgets)))].sort();
    if (!groups.length) { root.append(el("p", { class: "muted", text: "no model requests recorded" })); return; }
    const W = Math.max(320, Math.min(1150, ($("view").clientWidth || 700) - 40));
    for (const g of groups) {
      const byDay = {};
      for (const r of u.rows) if (r.group_folder === g) byDay[r.day] = r;
      const budget = u.budgets[g] || null;
      const max = niceMax(Math.max(1, budget || 0, ...days.map((d) => byDay[d] ? byDay[d].tokens : 0)));
      const H = 220, L = 64, B = 34, T = 12, plotH = H - B - T, bw = (W - L - 8) / days.length;
      const y = (v) => H - B - plotH * v / max;
      const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "aria-label": "tokens per day of " + g + "; the values are in the table below" });
      const todayIndex = days.indexOf(u.today_day);
      if (todayIndex >= 0) svg.append(svgEl("rect", { class: "today-mark", x: L + todayIndex * bw, y: T, width: bw, height: plotH }));
      for (const v of [0, max / 2, max]) {
        svg.append(svgEl("line", { class: "axis", x1: L - 4, y1: y(v), x2: W - 4, y2: y(v), "stroke-opacity": v ? 0.35 : 1 }));
        svg.append(svgEl("text", { x: L - 8, y: y(v) + 4, "text-anchor": "end" }, compact(v)));
      }
      svg.append(svgEl("text", { x: 12, y: T + plotH / 2, transform: `rotate(-90 12 ${T + plotH / 2})`, "text-anchor": "middle", class: "y-label" }, "tokens"));
      const labelEvery = Math.ceil(days.length / Math.max(2, Math.floor((W - L) / 52)));
      days.forEach((d, i) => {
        const r = byDay[d];
        const inT = r ? r.input_tokens : 0, outT = r ? r.output_tokens : 0;
        const x = L + i * bw + Math.min(3, bw * 0.15), w = Math.max(1, bw - 2 * Math.min(3, bw * 0.15));
        const g1 = svgEl("g", { "data-day": d, "data-tokens": inT + outT });
        g1.append(svgEl("rect", { class: "in", x, y: y(inT), width: w, height: H - B - y(inT) }));
        g1.append(svgEl("rect", { class: "out" + (r && r.over ? " over" : ""), x, y: y(inT + outT), width: w, height: y(inT) - y(inT + outT) }));
        svg.append(g1);
        if (i === todayIndex) svg.append(svgEl("text", { class: "today-label", x: L + i * bw + bw / 2, y: H - 4, "text-anchor": "end" }, "today"));
        else if ((days.length - 1 - i) % labelEvery === 0 && i !== todayIndex - 1) svg.append(svgEl("text", { x: L + i * bw + bw / 2, y: H - B + 16, "text-anchor": "middle" }, d.slice(5)));
      });
      if (budget) {
        svg.append(svgEl("line", { class: "budget", x1: L, y1: y(budget), x2: W - 4, y2: y(budget) }));
        svg.append(svgEl("text", { x: L + 4, y: y(budget) - 4 }, "budget " + compact(budget)));
      }
      const today = u.today.find((t) => t.group_folder === g);
      const models = u.by_model.filter((r) => r.group_folder === g).sort(by("day", true));
      root.append(el("div", { class: "card chart", "data-group": g },
        el("h3", { text: g }),
        el("p", { class: today && today.over ? "bad" : "muted", text: today
          ? `today ${today.tokens_today} of ${today.tokens_per_day} tokens` + (today.over ? " (over budget)" : "")
          : "no daily budget" }),
        el("div", { class: "scroll" }, svg),
        table([
          { label: "day", cell: (r) => r.day === u.today_day ? r.day + " (today)" : r.day, cls: "nowrap" },
          { label: "model", key: "model", cls: "nowrap" },
          { label: "input", key: "input_tokens", num: true }, { label: "output", key: "output_tokens", num: true },
          { label: "requests", key: "requests", num: true },
        ], models.map((r) => Object.assign({ __attrs: { "data-usage-row": g + "/" + r.day + "/" + r.model } }, r)), "no requests in these days")));
    }
  },

  async mcp(root) {
    const m = await api("api/mcp");
    root.append(el("h2", { text: "MCP servers" }));
    if (!m.servers.length) root.append(el("p", { class: "muted", text: "no MCP servers are configured (mcp_servers)" }));
    for (const s of m.servers) {
      root.append(el("div", { class: "card", "data-server": s.server },
        el("h3", { text: s.server + " (" + s.kind + ")" }),
        kv([["state", s.state + (s.detail ? ": " + s.detail : ""), s.state === "up" ? "ok" : "error"],
            ["up since", when(s.up_since)], ["restarts", String(s.restarts)],
            ["groups", Object.entries(s.groups).map(([g, p]) => g + " (" + p.join(", ") + ")").join("; ") || "none"]]),
        table([{ label: "tool", key: "name" }, { label: "needs approval", cell: (t) => t.needs_approval ? "yes" : "no" }],
          s.tools, "no tools listed"),
        s.problems.length ? el("p", { class: "bad", text: "not offered: " + s.problems.join("; ") }) : "",
        s.stderr_tail ? el("pre", { class: "payload", tabindex: 0, "aria-label": "stderr of " + s.server, text: s.stderr_tail }) : ""));
    }
    root.append(el("h3", { text: "Recent calls" }));
    root.append(table([
      { label: "when", cell: (r) => when(r.at) }, { label: "group", key: "group", cls: "nowrap" }, { label: "server", key: "server", cls: "nowrap" },
      { label: "tool", key: "tool", cls: "nowrap" }, { label: "outcome", key: "outcome" },
      { label: "seconds", key: "seconds", num: true }, { label: "error", cell: (r) => el("span", { class: "error", text: r.error || "" }) },
    ], m.recent.map((r) => Object.assign({ __attrs: { "data-call": r.tool } }, r)), "no calls yet"));
  },

  async config(root) {
    const c = await api("api/config");
    root.append(el("h2", { text: "Config" }));
    root.append(kv([["file", c.file || "-"]]));
    const rl = c.last_reload;
    root.append(el("p", { id: "reload", class: rl ? (rl.ok ? "ok" : "bad") : "muted" }, ...(rl
      ? ["last reload ", when(rl.at), ": " + (rl.ok ? "applied (" + (rl.changes.join("; ") || "no changes") + ")" : "refused, the running config is kept: " + rl.error)]
      : ["no reload since the start"])));
    root.append(el("h3", { text: "Secret files" }));
    root.append(el("p", { class: "muted", text: "Shown as set or missing, never their content." }));
    root.append(table([
      { label: "key", key: "key", cls: "nowrap" }, { label: "file", key: "path" },
      { label: "state", cell: (s) => el("span", { class: s.state === "set" ? "ok" : "bad", text: s.state }) },
    ], c.secrets, "no secret files are configured"));
    root.append(el("h3", { text: "The file as written" }));
    if (c.yaml === null) root.append(el("p", { class: "bad", text: "the file cannot be read now" }));
    else root.append(el("pre", { id: "config-yaml", class: "yaml", tabindex: 0, role: "region", "aria-label": "config file " + (c.file || ""), text: c.yaml }));
  },
};

function size(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function compact(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(v % 1e6 ? 1 : 0) + " M";
  if (v >= 1e3) return (v / 1e3).toFixed(v % 1e3 ? 1 : 0) + " k";
  return String(Math.round(v));
}

// A round top for the y axis: 1, 2 or 5 times a power of ten, at least `v`.
function niceMax(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// ------------------------------------------------------------------ routing

function stopPolling() {
  if (state.timer) clearTimeout(state.timer);
  state.timer = null;
}

let generation = 0;

const FOCUSABLE = "a, button, select, input, [tabindex]";

function focusKey(node) {
  if (!node || node === document.body || !$("view").contains(node)) return null;
  return [node.tagName, node.id, node.getAttribute("href"), node.dataset.problem,
    node.dataset.count, node.dataset.task, node.dataset.action, node.dataset.row,
    node.dataset.delete, node.dataset.bulk, node.textContent].join("|");
}

async function refresh() {
  stopPolling();
  const my = ++generation;
  const root = el("div", { id: "view-" + state.view });
  try {
    await views[state.view](root);
    if (my !== generation) return;
    // The view is drawn anew (every 1.5 s on the overview): the keyboard's place stays.
    const focused = focusKey(document.activeElement);
    $("view").replaceChildren(root);
    if (focused) {
      const again = [...root.querySelectorAll(FOCUSABLE)].find((n) => focusKey(n) === focused);
      if (again) again.focus();
    }
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    if (my !== generation) return;
    notice(e.message, true);
  }
  if (state.view === "overview" && $("login").hidden) {
    state.timer = setTimeout(refresh, POLL_MS);
  }
}

function route() {
  const name = (location.hash || "#overview").slice(1);
  state.view = views[name] ? name : "overview";
  if (state.view !== "tasks") state.openRuns = null;
  for (const a of document.querySelectorAll("nav a[data-view]")) {
    a.classList.toggle("active", a.dataset.view === state.view);
  }
  notice("");
  refresh();
}

window.addEventListener("hashchange", route);
start();

// The chart is drawn at the width it has (its text at its real size): drawn again when the
// window's width changes (a phone turned, a window resized).
let drawnWidth = window.innerWidth;
window.addEventListener("resize", () => {
  if (state.view !== "usage" || Math.abs(window.innerWidth - drawnWidth) < 40) return;
  drawnWidth = window.innerWidth;
  refresh();
});
