// The operator page. Everything it shows is put into the page as text (textContent,
// attributes set one by one), never as HTML: group names, prompts and quarantined files
// are written by agents and people, and may hold markup.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { csrf: null, auth: null, view: "overview", timer: null, openRuns: null };
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

function table(columns, rows, emptyText) {
  if (!rows.length) return el("p", { class: "muted", text: emptyText });
  const head = el("tr", {}, ...columns.map((c) => el("th", { text: c.label })));
  const body = rows.map((r) => el("tr", r.__attrs || {}, ...columns.map((c) => {
    const v = c.cell ? c.cell(r) : r[c.key];
    const td = el("td", { "data-label": c.label });
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

// ------------------------------------------------------------------ views

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  if (seconds < 90) return Math.round(seconds) + " s";
  if (seconds < 5400) return Math.round(seconds / 60) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function since(iso) {
  if (!iso) return "-";
  const s = (Date.now() - Date.parse(iso)) / 1000;
  return isNaN(s) ? iso : ago(Math.max(0, s)) + " ago";
}

function card(title, ...body) {
  return el("div", { class: "card" }, el("h3", { text: title }), ...body);
}

function kv(pairs) {
  return el("div", {}, ...pairs.map(([k, v, cls]) =>
    el("div", {}, el("span", { class: "muted", text: k + ": " }), el("span", { class: cls || null, text: v }))));
}

const views = {
  async overview(root) {
    const o = await api("api/overview");
    const engineOk = String(o.engine).startsWith("ok");
    const cards = el("div", { class: "cards", id: "overview-cards" });
    cards.append(card("Daemon", kv([
      ["pid", o.daemon.pid], ["version", o.daemon.version],
      ["up since", o.daemon.started_at + " (" + since(o.daemon.started_at) + ")"],
      ["groups", o.daemon.groups], ["next task", o.daemon.next_task || "-"],
    ])));
    cards.append(card("Engine", el("p", { class: engineOk ? "ok" : "bad", id: "engine", text: o.engine })));
    const q = o.queue || {};
    cards.append(card("Queue", kv([
      ["running", Object.keys(q.running || {}).length], ["waiting", q.pending || 0],
      ["retrying", (q.retrying || []).join(", ") || "-"], ["max at once", q.max_concurrent || "-"],
    ])));
    cards.append(card("Outbox", el("div", { id: "outbox-counts" }, kv([
      ["pending", o.outbox.pending], ["sending", o.outbox.sending],
      ["failed", o.outbox.failed, o.outbox.failed ? "bad" : "ok"], ["sent", o.outbox.sent],
    ]))));
    const rl = o.reload;
    cards.append(card("Last reload", el("p", {
      class: rl ? (rl.ok ? "ok" : "bad") : "muted",
      text: rl ? (rl.at + ": " + (rl.ok ? "applied, " + rl.changes.length + " change(s)" : "refused: " + rl.error))
        : "no reload since the start",
    })));
    const bk = o.backup || {};
    cards.append(card("Last backup", el("p", {
      id: "backup", class: bk.last_success ? (bk.level === "ok" ? "ok" : "bad") : "muted",
      text: bk.last_success ? since(bk.last_success) + (bk.overdue ? ": " + bk.missed + " scheduled backups missed" : "")
        : "none recorded (mdclaw backup)",
    })));
    root.append(cards);
    root.append(el("h2", { text: "Channels" }));
    const chans = el("div", { class: "cards", id: "channels" });
    for (const c of o.channels) {
      const parts = [el("p", { class: c.connected ? "ok" : "bad", text: c.connected ? "connected" : "not connected" })];
      if (c.link_state) parts.push(el("p", { class: c.link_state === "linked" ? "ok" : "warn", text: "link: " + c.link_state }));
      if (c.error) parts.push(el("p", { class: "error", text: c.error }));
      if (c.detail) parts.push(el("p", { class: c.fix ? "warn" : "muted", text: c.detail }));
      if (c.fix) parts.push(el("p", { text: "fix: " + c.fix }));
      if (c.qr_svg) {
        parts.push(el("p", { text: "Scan this code with the phone to link it:" }));
        parts.push(el("div", { class: "qr" }, el("img", { src: c.qr_svg, alt: "QR code to link " + c.name })));
      } else if (c.qr) {
        parts.push(el("pre", { text: c.qr }));
      }
      chans.append(card(c.name, ...parts));
    }
    root.append(chans);
    root.append(el("h2", { text: "Running containers" }));
    root.append(table([
      { label: "group", key: "group" }, { label: "job", key: "job" },
      { label: "running for", cell: (r) => ago(r.age_s) },
    ], o.containers, "no container is running"));
  },

  async groups(root) {
    const gs = await api("api/groups");
    root.append(el("h2", { text: "Groups" }));
    root.append(table([
      { label: "group", cell: (g) => el("span", {}, el("strong", { text: g.name }), el("br"), el("span", { class: "muted", text: g.folder + (g.is_main ? " (main)" : "") })) },
      { label: "trigger", cell: (g) => g.trigger + (g.requires_trigger ? "" : " (not needed)") },
      { label: "model", cell: (g) => g.model || "default" },
      { label: "last activity", cell: (g) => g.last_activity ? since(g.last_activity) : "-" },
      { label: "container", key: "container" },
      { label: "chat", cell: (g) => g.chat_url ? el("a", { href: g.chat_url, text: "open chat" }) : (g.jid || "-") },
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
        ev.target.disabled = true;
        try { notice((await post("api/tasks/" + encodeURIComponent(t.id) + "/" + action)).message); }
        catch (e) { notice(e.message, true); }
        refresh();
      },
    }, label);
    root.append(table([
      { label: "id", key: "id" }, { label: "group", key: "group_folder" },
      { label: "schedule", cell: (t) => t.schedule_type + " " + t.schedule_value },
      { label: "status", key: "status" },
      { label: "next run", cell: (t) => t.next_run_local ? t.next_run_local + " (" + t.zone + ")" : "-" },
      { label: "last result", cell: (t) => t.last_result || "-" },
      { label: "prompt", cell: (t) => el("span", { class: "prompt", text: t.prompt }) },
      { label: "", cell: (t) => el("span", {},
          act(t, "pause", "Pause"), act(t, "resume", "Resume"),
          act(t, "run-now", "Run now"), act(t, "cancel", "Cancel", "danger"),
          el("button", { "data-runs": t.id, onclick: () => { state.openRuns = t.id; refresh(); } }, "History")) },
    ], ts.map((t) => Object.assign({ __attrs: { "data-task-row": t.id } }, t)), "no tasks"));
    if (state.openRuns) {
      const h = await api("api/tasks/" + encodeURIComponent(state.openRuns) + "/runs").catch(() => null);
      if (h) {
        root.append(el("h3", { id: "runs-title", text: "Runs of " + h.task.id + " (times in " + h.zone + ")" }));
        root.append(el("div", { id: "runs" }, table([
          { label: "due", key: "due" }, { label: "started", key: "started" },
          { label: "status", key: "status" }, { label: "duration", key: "duration" },
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
        el("h3", { text: "#" + p.id + " " + p.kind + " of " + p.group_folder }),
        // The request as the cards show it: escaped by the host, put in as text.
        el("pre", { class: "payload", text: p.shown.join("\n") }),
        kv([["rule", p.rule || "-"], ["approver", p.approver], ["asked", p.created_at],
            ["expires", p.expires_at], ["wrong codes", p.wrong_codes + (p.codes_locked ? " (codes locked)" : "")]]),
        el("span", {}, ...buttons)));
    }
    root.append(el("h3", { text: "Decided (the audit)" }));
    root.append(table([
      { label: "id", key: "id" }, { label: "group", key: "group_folder" }, { label: "what", key: "summary" },
      { label: "outcome", key: "status" }, { label: "by", cell: (r) => r.decided_label || "-" },
      { label: "via", key: "decided_via" }, { label: "asked", key: "created_at" },
      { label: "decided", key: "decided_at" }, { label: "result", cell: (r) => r.outcome || "-" },
    ], a.recent.map((r) => Object.assign({ __attrs: { "data-decided": r.id } }, r)), "nothing decided yet"));
  },

  async outbox(root) {
    const o = await api("api/outbox");
    root.append(el("h2", { text: "Outbox" }));
    root.append(el("p", { text: `pending ${o.counts.pending}, sending ${o.counts.sending}, failed ${o.counts.failed}, sent ${o.counts.sent}` }));
    const act = (r, action, label, cls) => el("button", {
      class: cls || null, "data-row": r.id, "data-action": action,
      onclick: async (ev) => {
        ev.target.disabled = true;
        try { await post("api/outbox/" + r.id + "/" + action); notice("row " + r.id + (action === "retry" ? " will be sent again" : " dropped")); }
        catch (e) { notice(e.message, true); }
        refresh();
      },
    }, label);
    root.append(table([
      { label: "id", key: "id" }, { label: "chat", key: "chat_jid" },
      { label: "what", cell: (r) => r.kind === "text" ? r.text : r.kind === "file" ? "file " + (r.file_name || "") : "reaction " + (r.emoji || "") },
      { label: "tries", key: "attempts" }, { label: "failed at", key: "updated_at" },
      { label: "error", cell: (r) => el("span", { class: "error", text: r.last_error || "-" }) },
      { label: "", cell: (r) => el("span", {}, act(r, "retry", "Retry"), act(r, "drop", "Drop", "danger")) },
    ], o.failed.map((r) => Object.assign({ __attrs: { "data-outbox-row": r.id } }, r)), "no failed deliveries"));
  },

  async quarantine(root) {
    const qs = await api("api/quarantine");
    root.append(el("h2", { text: "Quarantine" }));
    root.append(el("p", { class: "muted", text: "Command files the host refused, with the reason. Their content is shown as plain text." }));
    if (!qs.length) root.append(el("p", { class: "muted", text: "nothing is quarantined" }));
    for (const q of qs) {
      root.append(el("div", { class: "card", "data-entry": q.name },
        el("h3", { text: q.source_group + " / " + q.original_file }),
        kv([["reason", q.error, "error"], ["when", q.processed_at], ["entry", q.name]]),
        el("pre", { class: "payload", text: q.payload + (q.payload_cut ? "\n… (cut)" : "") || "(empty: the file was not kept)" }),
        el("button", { class: "danger", "data-delete": q.name, onclick: async (ev) => {
          ev.target.disabled = true;
          try { await post("api/quarantine/delete", { name: q.name }); notice("deleted " + q.name); }
          catch (e) { notice(e.message, true); }
          refresh();
        } }, "Delete")));
    }
  },

  async usage(root) {
    const u = await api("api/usage?days=14");
    root.append(el("h2", { text: "Usage (tokens per day, UTC)" }));
    const days = [];
    for (let i = u.days - 1; i >= 0; i--) days.push(new Date(Date.now() - i * 86400000).toISOString().slice(0, 10));
    const groups = [...new Set(u.rows.map((r) => r.group_folder).concat(Object.keys(u.budgets)))].sort();
    if (!groups.length) { root.append(el("p", { class: "muted", text: "no model requests recorded" })); return; }
    const colors = ["#2271b1", "#00a32a", "#d63638", "#996800", "#8c5ed6", "#3582c4", "#e65054"];
    for (const [gi, g] of groups.entries()) {
      const byDay = {};
      for (const r of u.rows) if (r.group_folder === g) byDay[r.day] = r;
      const budget = u.budgets[g] || null;
      const max = Math.max(1, budget || 0, ...days.map((d) => byDay[d] ? byDay[d].tokens : 0));
      const W = 700, H = 180, L = 50, B = 24, bw = (W - L - 10) / days.length;
      const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "tokens per day of " + g });
      svg.append(svgEl("line", { x1: L, y1: H - B, x2: W - 5, y2: H - B, stroke: "#999" }));
      svg.append(svgEl("text", { x: 4, y: 14, "font-size": 11, fill: "#646970" }, String(max)));
      days.forEach((d, i) => {
        const r = byDay[d];
        const tokens = r ? r.tokens : 0;
        const h = (H - B - 10) * tokens / max;
        const bar = svgEl("rect", { x: L + i * bw + 2, y: H - B - h, width: Math.max(1, bw - 4), height: h,
          fill: r && r.over ? "#d63638" : colors[gi % colors.length], "data-day": d, "data-tokens": tokens });
        bar.append(svgEl("title", {}, `${d}: ${tokens} tokens, ${r ? r.requests : 0} request(s)`));
        svg.append(bar);
        if (i % 2 === 0 || days.length <= 7) svg.append(svgEl("text", { x: L + i * bw + bw / 2, y: H - 6, "font-size": 10, "text-anchor": "middle", fill: "#646970" }, d.slice(5)));
      });
      if (budget) {
        const y = H - B - (H - B - 10) * budget / max;
        svg.append(svgEl("line", { x1: L, y1: y, x2: W - 5, y2: y, stroke: "#d63638", "stroke-dasharray": "6 4", class: "budget" }));
        svg.append(svgEl("text", { x: L + 4, y: y - 4, "font-size": 11, fill: "#d63638" }, "budget " + budget));
      }
      const today = u.today.find((t) => t.group_folder === g);
      root.append(el("div", { class: "card chart", "data-group": g },
        el("h3", { text: g }),
        el("p", { class: today && today.over ? "bad" : "muted", text: today
          ? `today ${today.tokens_today} of ${today.tokens_per_day} tokens` + (today.over ? " (over budget)" : "")
          : "no daily budget" }),
        svg,
        el("p", { class: "muted", text: "requests in these days: " + Object.values(byDay).reduce((n, r) => n + r.requests, 0) })));
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
            ["up since", s.up_since || "-"], ["restarts", String(s.restarts)],
            ["groups", Object.entries(s.groups).map(([g, p]) => g + " (" + p.join(", ") + ")").join("; ") || "none"]]),
        table([{ label: "tool", key: "name" }, { label: "needs approval", cell: (t) => t.needs_approval ? "yes" : "no" }],
          s.tools, "no tools listed"),
        s.problems.length ? el("p", { class: "bad", text: "not offered: " + s.problems.join("; ") }) : "",
        s.stderr_tail ? el("pre", { class: "payload", text: s.stderr_tail }) : ""));
    }
    root.append(el("h3", { text: "Recent calls" }));
    root.append(table([
      { label: "when", key: "at" }, { label: "group", key: "group" }, { label: "server", key: "server" },
      { label: "tool", key: "tool" }, { label: "outcome", key: "outcome" },
      { label: "seconds", key: "seconds" }, { label: "error", cell: (r) => el("span", { class: "error", text: r.error || "" }) },
    ], m.recent.map((r) => Object.assign({ __attrs: { "data-call": r.tool } }, r)), "no calls yet"));
  },

  async config(root) {
    const c = await api("api/config");
    root.append(el("h2", { text: "Config" }));
    root.append(kv([["file", c.file || "-"]]));
    const rl = c.last_reload;
    root.append(el("p", { id: "reload", class: rl ? (rl.ok ? "ok" : "bad") : "muted", text: rl
      ? "last reload " + rl.at + ": " + (rl.ok ? "applied (" + (rl.changes.join("; ") || "no changes") + ")" : "refused, the running config is kept: " + rl.error)
      : "no reload since the start" }));
    root.append(el("p", { class: "muted", text: "Secret files show as \"set\" or \"missing\", never their content." }));
    root.append(el("pre", { id: "config-json", text: JSON.stringify(c.config, null, 2) }));
  },
};

// ------------------------------------------------------------------ routing

function stopPolling() {
  if (state.timer) clearTimeout(state.timer);
  state.timer = null;
}

let generation = 0;

async function refresh() {
  stopPolling();
  const my = ++generation;
  const root = el("div", { id: "view-" + state.view });
  try {
    await views[state.view](root);
    if (my !== generation) return;
    $("view").replaceChildren(root);
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
