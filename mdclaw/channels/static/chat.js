"use strict";
// The page talks only to the endpoints of the server that served it; the bearer token (if
// the server has one) is kept in this browser's localStorage and sent as a header.
const $ = (id) => document.getElementById(id);
const state = { jid: null, cursor: 0, oldest: 0, typing: false, generation: 0,
                outboxMark: "?", groups: [], offline: false };
const PAGE = 50;  // rows per history request
const GROUP_GAP = 5 * 60 * 1000;  // bubbles of one sender within 5 min are grouped

function token() { return localStorage.getItem("mdclaw-token") || ""; }

async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (token()) headers["Authorization"] = "Bearer " + token();
  let res;
  try {
    res = await fetch(path, Object.assign({}, options, { headers }));
  } catch (e) {
    setOffline(true);
    throw new Error("offline");
  }
  setOffline(false);
  if (res.status === 401) {
    $("auth").classList.add("shown");
    throw new Error("token needed");
  }
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(body.error || ("HTTP " + res.status));
  return body;
}

function postJSON(path, data) {
  return api(path, { method: "POST", headers: { "Content-Type": "application/json" },
                     body: JSON.stringify(data) });
}

function setStatus(text) { $("status").textContent = text; }

function setOffline(off) {
  if (state.offline === off) return;
  state.offline = off;
  $("offline").hidden = !off;
  if (off) setStatus("offline");
}

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

// When a message was written, in the viewer's own time zone (the day is in the separator).
function timeOf(d) {
  const t = el("time");
  if (isNaN(d)) return t;
  t.dateTime = d.toISOString();
  t.textContent = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  t.title = d.toLocaleString();
  return t;
}

function dayLabel(d) {
  const today = new Date();
  const yesterday = new Date(today.getTime() - 86400000);
  if (d.toDateString() === today.toDateString()) return "Today";
  if (d.toDateString() === yesterday.toDateString()) return "Yesterday";
  return d.toLocaleDateString([], { weekday: "short", year: "numeric", month: "short",
                                    day: "numeric" });
}

// Code blocks of the assistant's answers: a bar above the code with its language and a Copy
// button (never over the code); the block scrolls sideways and takes keyboard focus.
function addCopyButtons(body) {
  for (const pre of body.querySelectorAll("pre")) {
    const box = el("div", "code");
    pre.replaceWith(box);
    const code = pre.querySelector("code");
    const lang = code && /language-([\w+#.-]+)/.exec(code.className);
    const bar = el("div", "code-bar");
    const label = el("span", "", lang ? lang[1] : "code");
    const button = el("button", "copy", "Copy");
    button.type = "button";
    button.setAttribute("aria-label", "Copy " + (lang ? lang[1] + " " : "") + "code");
    button.addEventListener("click", async () => {
      try {
        await navigator.clipboard.writeText(pre.innerText);
        button.textContent = "Copied";
      } catch (e) {
        button.textContent = "Copy failed";
      }
      setTimeout(() => { button.textContent = "Copy"; }, 1500);
    });
    pre.tabIndex = 0;
    pre.setAttribute("aria-label", (lang ? lang[1] + " " : "") + "code");
    bar.append(label, button);
    box.append(bar, pre);
  }
}

function setState(div, s, note) {
  div.dataset.state = s;
  const meta = div.querySelector(".meta");
  let span = meta.querySelector(".state");
  if (!span) { span = el("span", "state"); meta.append(span); }
  span.textContent = { sending: "Sending…", delivered: "Delivered", failed: "Not delivered" }[s]
    + (note ? ": " + note : "");
  const old = meta.querySelector(".retry");
  if (old) old.remove();
}

function bubble(direction, kind, sender, when) {
  const div = el("div", "msg " + direction + " " + kind);
  div.dataset.sender = sender || "";
  div.dataset.time = String(when.getTime() || Date.now());
  div.append(el("span", "who", sender || ""));
  const meta = el("div", "meta");
  meta.append(timeOf(when));
  div.append(meta);
  return div;
}

function render(m, before) {
  if (document.querySelector('#log [data-seq="' + m.seq + '"]')) return;
  const div = bubble(m.direction, m.kind, m.sender_name || m.sender, new Date(m.timestamp));
  div.dataset.seq = String(m.seq);
  div.dataset.id = m.id;
  const body = el("span", "body");
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
  const meta = div.querySelector(".meta");
  div.insertBefore(body, meta);
  if (m.card) showCard(div, m);
  if (m.kind === "file" && m.html) {
    const caption = el("div", "body md caption");
    caption.innerHTML = m.html;
    addCopyButtons(caption);
    div.insertBefore(caption, meta);
  }
  if (m.download) showFile(div, m);
  if (m.direction === "in") setState(div, "delivered");
  else div.dataset.state = "delivered";
  place(div, before);
}

// Into the log: before `before` (older history), else last (above the undelivered replies).
function place(div, before) {
  const log = $("log");
  if (before) { log.insertBefore(div, before); return; }
  const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
  log.insertBefore(div, $("pending"));
  if (atBottom || div.classList.contains("in")) log.scrollTop = log.scrollHeight;
}

// Day separators, and consecutive bubbles of one sender grouped (name shown once).
function regroup() {
  const log = $("log");
  for (const d of log.querySelectorAll(".day")) d.remove();
  let prev = null;
  for (const div of log.querySelectorAll(".msg")) {
    const when = new Date(Number(div.dataset.time));
    const day = when.toDateString();
    if (!prev || new Date(Number(prev.dataset.time)).toDateString() !== day) {
      const sep = el("div", "day", dayLabel(when));
      sep.setAttribute("role", "separator");
      div.parentNode.insertBefore(sep, div);
      prev = null;
    }
    const same = prev && prev.classList.contains("in") === div.classList.contains("in")
      && prev.dataset.sender === div.dataset.sender
      && Number(div.dataset.time) - Number(prev.dataset.time) < GROUP_GAP;
    div.classList.toggle("cont", Boolean(same));
    prev = div;
  }
}

// A card (a request for a person's decision): its text as written, its choices as buttons.
// Who presses is this page's name, as for a message; the host answers in a line below.
function showCard(div, m) {
  div.classList.add("card");
  const choices = el("div", "choices");
  for (const c of m.card.choices || []) {
    const b = el("button", "", c.label);
    b.type = "button";
    b.dataset.data = c.data;
    b.addEventListener("click", async () => {
      for (const other of choices.querySelectorAll("button")) other.disabled = true;
      const note = el("span", "who");
      try {
        const r = await postJSON("/card", { jid: state.jid, id: m.id, data: c.data,
                                            sender_name: $("name").value || "me" });
        note.textContent = r.answer || "";
      } catch (err) {
        note.textContent = "not recorded: " + (err.message || err);
        for (const other of choices.querySelectorAll("button")) other.disabled = false;
      }
      div.insertBefore(note, div.querySelector(".meta"));
    });
    choices.append(b);
  }
  if (m.card.state !== "open") {
    for (const b of choices.querySelectorAll("button")) b.disabled = true;
  }
  if (choices.childElementCount) div.insertBefore(choices, div.querySelector(".meta"));
}

// The replies the outbox has not delivered: "sending", or "failed" with Retry. A delivered
// one leaves this list and comes in the transcript.
function showPending(rows) {
  const box = $("pending");
  const keep = new Set(rows.map((r) => String(r.id)));
  for (const div of [...box.children]) {
    if (!keep.has(div.dataset.outbox)) div.remove();
  }
  for (const r of rows) {
    let div = box.querySelector('[data-outbox="' + r.id + '"]');
    if (!div) {
      div = bubble("out", r.kind, "", new Date(r.timestamp));
      div.dataset.outbox = String(r.id);
      const body = el("span", "body", r.kind === "file"
        ? "\u{1F4CE} " + (r.file_name || "file") : (r.html ? undefined : r.text));
      if (r.html) {  // rendered and sanitised by the server, as a delivered reply's
        body.classList.add("md");
        body.innerHTML = r.html;
        addCopyButtons(body);
      }
      div.insertBefore(body, div.querySelector(".meta"));
      box.append(div);
    }
    if (div.dataset.state === r.state) continue;
    setState(div, r.state, r.state === "failed" ? r.error : "");
    if (r.state === "failed") {
      const b = el("button", "retry", "Retry");
      b.type = "button";
      b.setAttribute("aria-label", "Retry this reply");
      b.addEventListener("click", async () => {
        b.disabled = true;
        try {
          await postJSON("/retry", { jid: state.jid, id: r.id });
          setState(div, "sending");
        } catch (err) {
          b.disabled = false;
          setStatus("retry failed: " + (err.message || err));
        }
      });
      div.querySelector(".meta").append(b);
    }
  }
  regroup();
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
    regroup();
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
  const meta = div.querySelector(".meta");
  try {
    const headers = token() ? { Authorization: "Bearer " + token() } : {};
    const res = await fetch(m.download, { headers });
    if (!res.ok) throw new Error("HTTP " + res.status);
    const blob = await res.blob();
    const url = URL.createObjectURL(blob);
    if (blob.type.startsWith("image/")) {
      const img = el("img", "inline");
      img.alt = m.file_name || "image";
      img.src = url;
      div.insertBefore(img, meta);
    } else {
      const a = el("a", "download", "Download " + (m.file_name || "file"));
      a.href = url;
      a.download = m.file_name || "file";
      div.insertBefore(a, meta);
    }
  } catch (e) {
    div.insertBefore(el("span", "who", "(file not available: " + (e.message || e) + ")"), meta);
  }
}

function assistantName() {
  const g = state.groups.find((x) => x.jid === state.jid);
  return g && g.trigger ? g.trigger.replace(/^@/, "") : "The assistant";
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
      if (!first) q.set("outbox", state.outboxMark);
      const data = await api("/messages?" + q.toString());
      if (generation !== state.generation) return;
      if (first) {
        state.oldest = data.messages.length ? data.messages[0].seq : 0;
        showOlder(data.older);
      }
      data.messages.forEach((m) => render(m));
      state.cursor = Math.max(state.cursor, data.cursor);
      state.typing = data.typing;
      $("typing").textContent = data.typing ? assistantName() + " is writing" : "";
      if (data.outbox) {
        showPending(data.outbox);
        state.outboxMark = data.outbox_mark;
      } else if (data.messages.length) regroup();
      setStatus("connected");
      if (first) $("log").scrollTop = $("log").scrollHeight;
      first = false;
    } catch (e) {
      if (!state.offline) setStatus(String(e.message || e));
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
}

function openChat(jid) {
  state.jid = jid;
  state.cursor = 0;
  state.typing = false;
  state.oldest = 0;
  state.outboxMark = "?";  // no list yet: the first long poll answers with it at once
  state.generation += 1;
  $("pending").replaceChildren();
  $("log").replaceChildren($("older"), $("pending"));
  showOlder(false);
  const g = state.groups.find((x) => x.jid === jid);
  $("chat-name").textContent = g ? g.name : jid;
  const url = new URL(location.href);
  url.searchParams.set("jid", jid);
  history.replaceState(null, "", url);
  showNotifyState();
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
  state.groups = groups;
  for (const g of groups) {
    const opt = el("option", "", g.name + (g.is_main ? " (main)" : ""));
    opt.value = g.jid;
    select.append(opt);
  }
  select.hidden = groups.length < 2;
  const jid = wanted || (groups[0] && groups[0].jid);
  if (!jid) { setStatus("no local chat is configured"); return; }
  select.value = jid;
  openChat(jid);
  setupPush();
}

// ------------------------------------------------------------------ sending
function sendingBubble(text) {
  const div = bubble("in", "text", $("name").value || "me", new Date());
  div.insertBefore(el("span", "body", text), div.querySelector(".meta"));
  setState(div, "sending");
  place(div);
  regroup();
  return div;
}

// After the server took it: the transcript row is this bubble (or, if the transcript came
// first, the bubble goes and the row stays).
function delivered(div, r) {
  const seen = document.querySelector('#log [data-seq="' + r.seq + '"]');
  if (seen && seen !== div) { div.remove(); regroup(); return; }
  div.dataset.seq = String(r.seq);
  div.dataset.id = r.id;
  setState(div, "delivered");
}

function failed(div, err, again) {
  setState(div, "failed", err.message || String(err));
  const b = el("button", "retry", "Retry");
  b.type = "button";
  b.setAttribute("aria-label", "Retry sending this message");
  b.addEventListener("click", () => { setState(div, "sending"); again(); });
  div.querySelector(".meta").append(b);
}

async function sendText(text, div) {
  const jid = state.jid;
  try {
    const r = await postJSON("/message", { text, jid, sender_name: $("name").value || "me" });
    delivered(div, r);
  } catch (err) {
    failed(div, err, () => sendText(text, div));
  }
}

async function sendFile(file, caption, voice) {
  if (!file || !state.jid) return;
  const div = sendingBubble("\u{1F4CE} " + file.name + (caption ? "\n" + caption : ""));
  const form = new FormData();
  form.append("jid", state.jid);
  form.append("sender_name", $("name").value || "me");
  form.append("text", caption);
  if (voice) form.append("voice", "1");
  form.append("file", file, file.name);
  try {
    delivered(div, await api("/upload", { method: "POST", body: form }));
  } catch (err) {
    failed(div, err, () => { div.remove(); sendFile(file, caption, voice); });
  }
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("text").value;
  if (!text.trim() || !state.jid) return;
  $("text").value = "";
  $("text").style.height = "auto";
  sendText(text, sendingBubble(text));
  $("text").focus();
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

function takeCaption() {
  const caption = $("text").value;
  $("text").value = "";
  return caption;
}

$("attach").addEventListener("click", () => $("file").click());
$("file").addEventListener("change", async () => {
  const file = $("file").files[0];
  $("file").value = "";
  await sendFile(file, takeCaption(), false);
});
// Files dropped on the page or pasted into the message box are sent like attached ones.
let dragDepth = 0;
document.addEventListener("dragenter", (e) => {
  if (![...e.dataTransfer.types].includes("Files")) return;
  dragDepth += 1;
  document.body.classList.add("dragging");
});
document.addEventListener("dragleave", () => {
  dragDepth = Math.max(0, dragDepth - 1);
  if (!dragDepth) document.body.classList.remove("dragging");
});
document.addEventListener("dragover", (e) => e.preventDefault());
document.addEventListener("drop", (e) => {
  e.preventDefault();
  dragDepth = 0;
  document.body.classList.remove("dragging");
  for (const f of e.dataTransfer.files) sendFile(f, "", false);
});
$("text").addEventListener("paste", (e) => {
  const files = [...(e.clipboardData ? e.clipboardData.files : [])];
  if (!files.length) return;
  e.preventDefault();
  const caption = takeCaption();
  files.forEach((f, i) => sendFile(f, i ? "" : caption, false));
});

// Voice notes: recorded here (MediaRecorder), sent as a voice note; the host transcribes it.
let recorder = null;
if (!(navigator.mediaDevices && window.MediaRecorder)) $("mic").hidden = true;
$("mic").addEventListener("click", async () => {
  const mic = $("mic");
  if (recorder) { recorder.stop(); return; }
  let stream;
  try {
    stream = await navigator.mediaDevices.getUserMedia({ audio: true });
  } catch (e) {
    setStatus("no microphone: " + (e.message || e));
    return;
  }
  const chunks = [];
  recorder = new MediaRecorder(stream);
  let recorded = 0;
  recorder.addEventListener("dataavailable", (e) => {
    if (!e.data.size) return;
    chunks.push(e.data);
    recorded += e.data.size;
    mic.dataset.recorded = String(recorded);  // bytes so far (the tests wait for some)
  });
  recorder.addEventListener("stop", () => {
    stream.getTracks().forEach((t) => t.stop());
    const type = (recorder.mimeType || "audio/webm").split(";")[0];
    recorder = null;
    mic.setAttribute("aria-pressed", "false");
    mic.setAttribute("aria-label", "Record a voice note");
    const ext = type.includes("ogg") ? "ogg" : type.includes("mp4") ? "m4a" : "webm";
    const file = new File(chunks, "voice note." + ext, { type });
    if (file.size) sendFile(file, "", true);
  });
  recorder.start(250);
  mic.setAttribute("aria-pressed", "true");
  mic.setAttribute("aria-label", "Stop recording and send the voice note");
});

// ------------------------------------------------------------------ notifications
let pushKey = null;

function pushed() { return localStorage.getItem("mdclaw-push:" + state.jid) === "1"; }

function showNotifyState() {
  const b = $("notify");
  b.setAttribute("aria-pressed", pushed() ? "true" : "false");
  b.title = pushed() ? "Notifications on for this chat" : "Notify me of replies";
}

async function setupPush() {
  if (!("serviceWorker" in navigator && "PushManager" in window && "Notification" in window)) {
    return;
  }
  try {
    pushKey = (await api("/push/key")).key;
  } catch (e) {
    return;  // notifications are off on this mdclaw
  }
  $("notify").hidden = false;
  showNotifyState();
}

function keyBytes(b64) {
  const s = atob(b64.replace(/-/g, "+").replace(/_/g, "/"));
  return Uint8Array.from(s, (c) => c.charCodeAt(0));
}

$("notify").addEventListener("click", async () => {
  const jid = state.jid;
  try {
    const reg = await navigator.serviceWorker.ready;
    let sub = await reg.pushManager.getSubscription();
    if (pushed()) {
      if (sub) await postJSON("/push/unsubscribe", { jid, endpoint: sub.endpoint });
      localStorage.removeItem("mdclaw-push:" + jid);
    } else {
      if (await Notification.requestPermission() !== "granted") {
        setStatus("notifications are blocked in this browser");
        return;
      }
      if (!sub) {
        sub = await reg.pushManager.subscribe({ userVisibleOnly: true,
                                                applicationServerKey: keyBytes(pushKey) });
      }
      await postJSON("/push/subscribe", { jid, subscription: sub.toJSON() });
      localStorage.setItem("mdclaw-push:" + jid, "1");
    }
  } catch (e) {
    setStatus("notifications: " + (e.message || e));
  }
  showNotifyState();
});

// ------------------------------------------------------------------ the rest
$("chat").addEventListener("change", (e) => openChat(e.target.value));
$("name").value = localStorage.getItem("mdclaw-name") || "me";
$("name").addEventListener("change", (e) => localStorage.setItem("mdclaw-name", e.target.value));
$("save-token").addEventListener("click", () => {
  localStorage.setItem("mdclaw-token", $("token").value.trim());
  $("auth").classList.remove("shown");
  start();
});
$("older").addEventListener("click", loadOlder);
document.addEventListener("keydown", (e) => {
  if (e.key === "Escape" && $("settings").open) {
    $("settings").open = false;
    $("settings").querySelector("summary").focus();
  }
});
window.addEventListener("online", () => setOffline(false));
window.addEventListener("offline", () => setOffline(true));
if (!navigator.onLine) setOffline(true);
if ("serviceWorker" in navigator) {
  navigator.serviceWorker.register("/sw.js").catch(() => {});
}
start();
