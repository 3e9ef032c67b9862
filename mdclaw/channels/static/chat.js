"use strict";
// The page talks only to the endpoints of the server that served it; the bearer token (if
// the channel has one) is kept in this browser's localStorage and sent as a header.
const $ = (id) => document.getElementById(id);
const state = { jid: null, cursor: 0, oldest: 0, typing: false, generation: 0 };

function token() { return localStorage.getItem("mdclaw-token") || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers["Authorization"] = "Bearer " + token();
  const res = await fetch(path, Object.assign({}, options, { headers }));
  if (res.status === 401) {
    $("auth").classList.add("shown");
    throw new Error("token needed");
  }
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(body.error || ("HTTP " + res.status));
  return body;
}

function setStatus(text) { $("status").textContent = text; }

const PAGE = 50;  // rows per history request

// When a message was written, in the viewer's own time zone (the date too if not today).
function timeOf(iso) {
  const t = document.createElement("time");
  const d = new Date(iso);
  if (isNaN(d)) return t;
  t.dateTime = d.toISOString();
  const today = new Date().toDateString() === d.toDateString();
  t.textContent = today
    ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })
    : d.toLocaleString([], { year: "numeric", month: "short", day: "numeric",
                             hour: "2-digit", minute: "2-digit" });
  t.title = d.toLocaleString();
  return t;
}

// Code blocks of the assistant's answers get a Copy button.
function addCopyButtons(body) {
  for (const pre of body.querySelectorAll("pre")) {
    const box = document.createElement("div");
    box.className = "code";
    pre.replaceWith(box);
    const button = document.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(pre.innerText);
        button.textContent = "Copied";
      } catch (e) {
        button.textContent = "Copy failed";
      }
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
    box.append(pre, button);
  }
}

function render(m, before) {
  if (document.querySelector('[data-seq="' + m.seq + '"]')) return;
  const div = document.createElement("div");
  div.className = "msg " + m.direction + " " + m.kind;
  div.dataset.seq = String(m.seq);
  div.dataset.id = m.id;
  const who = document.createElement("span");
  who.className = "who";
  who.textContent = m.sender_name || m.sender || "";
  who.append(timeOf(m.timestamp));
  const body = document.createElement("span");
  body.className = "body";
  if (m.kind === "reaction") body.textContent = "reacted " + m.content;
  else if (m.kind === "file") {
    body.textContent = "\u{1F4CE} " + (m.file_name || "file") +
      (m.content && !m.html ? "\n" + m.content : "");
  } else if (m.html) {
    // The assistant's Markdown, rendered and sanitised by the server (allow-listed tags,
    // http/https/mailto links only); people's text is never parsed as HTML.
    body.classList.add("md");
    body.innerHTML = m.html;
    addCopyButtons(body);
  } else body.textContent = m.content;
  div.append(who, body);
  if (m.card) showCard(div, m);
  if (m.kind === "file" && m.html) {
    const caption = document.createElement("div");
    caption.className = "body md caption";
    caption.innerHTML = m.html;
    addCopyButtons(caption);
    div.append(caption);
  }
  if (m.download) showFile(div, m);
  const log = $("log");
  if (before) { log.insertBefore(div, before); return; }
  const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  log.append(div);
  if (atBottom || m.direction === "in") log.scrollTop = log.scrollHeight;
}

// A card (a request for a person's decision): its text as written, its choices as buttons.
// Who presses is this page's name, as for a message; the host answers in a line below.
function showCard(div, m) {
  div.classList.add("card");
  const choices = document.createElement("div");
  choices.className = "choices";
  for (const c of m.card.choices || []) {
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = c.label;
    b.dataset.data = c.data;
    b.addEventListener("click", async () => {
      for (const other of choices.querySelectorAll("button")) other.disabled = true;
      const note = document.createElement("span");
      note.className = "who";
      try {
        const r = await api("/card", {
          method: "POST",
          headers: { "Content-Type": "application/json" },
          body: JSON.stringify({ jid: state.jid, id: m.id, data: c.data,
                                 sender_name: $("name").value || "me" }),
        });
        note.textContent = r.answer || "";
      } catch (err) {
        note.textContent = "not recorded: " + (err.message || err);
        for (const other of choices.querySelectorAll("button")) other.disabled = false;
      }
      div.append(note);
    });
    choices.append(b);
  }
  if (m.card.state !== "open") {
    for (const b of choices.querySelectorAll("button")) b.disabled = true;
  }
  if (choices.childElementCount) div.append(choices);
}

function showOlder(more) { $("older").classList.toggle("shown", Boolean(more)); }

async function loadOlder() {
  const generation = state.generation;
  const q = new URLSearchParams({ jid: state.jid, before: String(state.oldest),
                                  limit: String(PAGE) });
  $("older").disabled = true;
  try {
    const data = await api("/messages?" + q.toString());
    if (generation !== state.generation) return;
    const log = $("log");
    const first = $("older").nextSibling;
    const height = log.scrollHeight;
    data.messages.forEach((m) => render(m, first));
    log.scrollTop += log.scrollHeight - height;  // keep what was in view where it was
    if (data.messages.length) state.oldest = data.messages[0].seq;
    showOlder(data.older);
  } catch (e) {
    setStatus(String(e.message || e));
  } finally {
    $("older").disabled = false;
  }
}

// A file the assistant sent: fetched with the token (an <img src> could not send it), shown
// inline when the server says it is an image, else offered as a download link.
async function showFile(div, m) {
  try {
    const headers = token() ? { Authorization: "Bearer " + token() } : {};
    const res = await fetch(m.download, { headers });
    if (!res.ok) throw new Error("HTTP " + res.status);
    const blob = await res.blob();
    const url = URL.createObjectURL(blob);
    if (blob.type.startsWith("image/")) {
      const img = document.createElement("img");
      img.className = "inline";
      img.alt = m.file_name || "image";
      img.src = url;
      div.append(img);
    } else {
      const a = document.createElement("a");
      a.className = "download";
      a.href = url;
      a.download = m.file_name || "file";
      a.textContent = "Download";
      div.append(document.createElement("br"), a);
    }
  } catch (e) {
    const note = document.createElement("span");
    note.className = "who";
    note.textContent = "(file not available: " + (e.message || e) + ")";
    div.append(note);
  }
}

async function poll(generation) {
  let first = true;  // the newest page of history comes at once; then long polls wait
  while (generation === state.generation) {
    try {
      const q = first
        ? new URLSearchParams({ jid: state.jid, before: String(Number.MAX_SAFE_INTEGER),
                                limit: String(PAGE) })
        : new URLSearchParams({ jid: state.jid, after: String(state.cursor), wait: "25",
                                typing: state.typing ? "1" : "0" });
      const data = await api("/messages?" + q.toString());
      if (generation !== state.generation) return;
      if (first) {
        state.oldest = data.messages.length ? data.messages[0].seq : 0;
        showOlder(data.older);
      }
      data.messages.forEach((m) => render(m));
      state.cursor = Math.max(state.cursor, data.cursor);
      state.typing = data.typing;
      $("typing").textContent = data.typing ? "writing…" : "";
      setStatus("connected");
      if (first) $("log").scrollTop = $("log").scrollHeight;
      first = false;
    } catch (e) {
      setStatus(String(e.message || e));
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
}

function openChat(jid) {
  state.jid = jid;
  state.cursor = 0;
  state.typing = false;
  state.oldest = 0;
  state.generation += 1;
  $("log").replaceChildren($("older"));
  showOlder(false);
  const url = new URL(location.href);
  url.searchParams.set("jid", jid);
  history.replaceState(null, "", url);
  poll(state.generation);
}

async function start() {
  const wanted = new URL(location.href).searchParams.get("jid");
  let groups = [];
  try {
    groups = (await api("/groups")).groups;
  } catch (e) {
    setStatus(String(e.message || e));
    if (!wanted) return;
  }
  const select = $("chat");
  select.replaceChildren();
  const jids = groups.map((g) => g.jid);
  if (wanted && !jids.includes(wanted)) groups.unshift({ jid: wanted, name: wanted });
  for (const g of groups) {
    const opt = document.createElement("option");
    opt.value = g.jid;
    opt.textContent = g.name + (g.is_main ? " (main)" : "");
    select.append(opt);
  }
  const jid = wanted || (groups[0] && groups[0].jid);
  if (!jid) { setStatus("no local chat is configured"); return; }
  select.value = jid;
  openChat(jid);
}

$("chat").addEventListener("change", (e) => openChat(e.target.value));
$("name").value = localStorage.getItem("mdclaw-name") || "me";
$("name").addEventListener("change", (e) => localStorage.setItem("mdclaw-name", e.target.value));
$("save-token").addEventListener("click", () => {
  localStorage.setItem("mdclaw-token", $("token").value.trim());
  $("auth").classList.remove("shown");
  start();
});
$("form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("text").value;
  if (!text.trim() || !state.jid) return;
  $("send").disabled = true;
  try {
    await api("/message", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ text, jid: state.jid, sender_name: $("name").value || "me" }),
    });
    $("text").value = "";
    $("text").style.height = "auto";
  } catch (err) {
    setStatus("not sent: " + (err.message || err));
  } finally {
    $("send").disabled = false;
    $("text").focus();
  }
});
// Enter sends, Shift+Enter (or Enter while an input method composes) starts a new line.
$("text").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("form").requestSubmit();
  }
});
$("text").addEventListener("input", () => {
  const t = $("text");
  t.style.height = "auto";
  t.style.height = t.scrollHeight + 2 + "px";
});
$("older").addEventListener("click", loadOlder);
$("attach").addEventListener("click", () => $("file").click());
$("file").addEventListener("change", async () => {
  const file = $("file").files[0];
  if (!file || !state.jid) return;
  const form = new FormData();
  form.append("jid", state.jid);
  form.append("sender_name", $("name").value || "me");
  form.append("text", $("text").value);
  form.append("file", file, file.name);
  $("attach").disabled = true;
  setStatus("sending " + file.name + "…");
  try {
    await api("/upload", { method: "POST", body: form });
    $("text").value = "";
    setStatus("connected");
  } catch (err) {
    setStatus("not sent: " + (err.message || err));
  } finally {
    $("file").value = "";
    $("attach").disabled = false;
  }
});
start();
