"use strict";
// The chat page's service worker (served at /sw.js: its scope is the whole chat). It keeps
// the page's shell (HTML, script, style sheets, manifest, icons) so the page opens without a
// connection and says it is offline; messages and files always go to the network, never to
// the cache. Network first: an upgraded mdclaw is never paired with an old script.
// Push messages (Web Push, mdclaw.channels.webpush) become notifications.
const CACHE = "mdclaw-shell-v1";
const SHELL = ["/", "/chat.js", "/chat.css", "/mdclaw.css", "/manifest.webmanifest",
               "/icon-192.png", "/apple-touch-icon.png"];

self.addEventListener("install", (e) => {
  e.waitUntil(caches.open(CACHE).then((c) => c.addAll(SHELL)).then(() => self.skipWaiting()));
});

self.addEventListener("activate", (e) => {
  e.waitUntil(caches.keys()
    .then((keys) => Promise.all(keys.filter((k) => k !== CACHE).map((k) => caches.delete(k))))
    .then(() => self.clients.claim()));
});

self.addEventListener("fetch", (e) => {
  const url = new URL(e.request.url);
  if (e.request.method !== "GET" || url.origin !== self.location.origin) return;
  const path = url.pathname;
  if (!SHELL.includes(path)) return;
  e.respondWith(fetch(e.request).then((res) => {
    if (res.ok) {
      const copy = res.clone();
      e.waitUntil(caches.open(CACHE).then((c) => c.put(path, copy)));
      return res;
    }
    return caches.match(path).then((kept) => kept || res);
  }, () => caches.match(path).then((kept) => kept || Response.error())));
});

self.addEventListener("push", (e) => {
  let data = {};
  try { data = e.data ? e.data.json() : {}; } catch (err) { data = {}; }
  const options = { body: data.text || "New message", tag: data.jid || "mdclaw",
                    icon: "/icon-192.png", badge: "/icon-192.png", data: { jid: data.jid } };
  e.waitUntil(self.registration.showNotification(data.title || "mdclaw", options));
});

self.addEventListener("notificationclick", (e) => {
  e.notification.close();
  const jid = (e.notification.data || {}).jid;
  const url = "/" + (jid ? "?jid=" + encodeURIComponent(jid) : "");
  e.waitUntil(self.clients.matchAll({ type: "window" }).then((open) => {
    for (const c of open) {
      if ("focus" in c) return c.navigate(url).then((w) => (w || c).focus());
    }
    return self.clients.openWindow(url);
  }));
});
