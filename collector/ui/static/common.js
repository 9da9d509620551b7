// vigil web UI: shared helpers (fetch with the read token, safe DOM building, formatting).
// Every string from the server reaches the page through textContent or attributes set by
// el(), never through innerHTML, so names, labels and stack text cannot inject markup.
"use strict";
(function () {
  const V = (window.vigil = window.vigil || {});
  const TOKEN_KEY = "vigil.readToken";

  V.token = () => sessionStorage.getItem(TOKEN_KEY) || "";
  V.setToken = (t) => (t ? sessionStorage.setItem(TOKEN_KEY, t) : sessionStorage.removeItem(TOKEN_KEY));

  class AuthError extends Error {}
  V.AuthError = AuthError;

  V.fetch = async function (path) {
    const headers = {};
    const token = V.token();
    if (token) headers.Authorization = "Bearer " + token;
    const resp = await fetch(path, { headers, cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) {
      V.askToken(resp.status === 401 ? "This collector needs a read token." : "That token lacks the read scope.");
      throw new AuthError("status " + resp.status);
    }
    if (!resp.ok) {
      let detail = resp.statusText;
      try { detail = (await resp.json()).detail || detail; } catch (e) { /* not JSON */ }
      throw new Error(String(detail));
    }
    return resp;
  };
  V.json = async (path) => (await V.fetch(path)).json();

  // el("td", {class: "x", title: "..."}, child, "text", ...): children are nodes or text.
  V.el = function (tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = String(v);
      else if (k === "href") node.setAttribute("href", V.safeHref(v));
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else if (k === "dataset") Object.assign(node.dataset, v);
      else node.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  };
  V.safeHref = (h) => (typeof h === "string" && h.startsWith("/") && !h.startsWith("//") ? h : "#");
  V.clear = (node) => { while (node.firstChild) node.removeChild(node.firstChild); return node; };

  V.apiJob = (id) => "/ui/api/jobs/" + encodeURIComponent(id);
  V.pageJob = (id, params) => {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined && v !== "") q.set(k, v);
    const s = q.toString();
    return "/ui/jobs/" + encodeURIComponent(id) + (s ? "?" + s : "");
  };

  const num = (v) => typeof v === "number" && isFinite(v);
  V.fmtSeconds = (s) => {
    if (!num(s)) return "–";
    if (Math.abs(s) >= 100) return s.toFixed(0) + " s";
    if (Math.abs(s) >= 1) return s.toFixed(2) + " s";
    if (Math.abs(s) >= 1e-3) return (s * 1e3).toFixed(1) + " ms";
    return (s * 1e6).toFixed(0) + " µs";
  };
  V.fmtPct = (v) => (num(v) ? (v * 100).toFixed(1) + " %" : "–");
  V.fmtBytes = (b) => {
    if (!num(b)) return "–";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(b) >= 1024 && i < u.length - 1) { b /= 1024; i++; }
    return (i ? b.toFixed(1) : b.toFixed(0)) + " " + u[i];
  };
  V.fmtNum = (v, digits) => (num(v) ? v.toLocaleString("en-US", { maximumFractionDigits: digits === undefined ? 1 : digits }) : "–");
  V.fmtValue = (v, unit) => (unit === "s" ? V.fmtSeconds(v) : unit === "B" ? V.fmtBytes(v) : unit === "" ? V.fmtPct(v) : V.fmtNum(v));
  V.fmtAgo = (t) => {
    if (!num(t)) return "–";
    const d = Date.now() / 1000 - t;
    if (d < 0) return "now";
    if (d < 90) return d.toFixed(0) + " s ago";
    if (d < 5400) return (d / 60).toFixed(0) + " min ago";
    if (d < 172800) return (d / 3600).toFixed(1) + " h ago";
    return new Date(t * 1000).toISOString().slice(0, 16).replace("T", " ");
  };
  V.fmtTime = (t) => (num(t) ? new Date(t * 1000).toISOString().slice(11, 19) : "–");
  V.fmtLayout = (layout) => {
    const parts = Object.entries(layout || {}).filter(([, v]) => v > 1).map(([k, v]) => k + v);
    return parts.length ? parts.join(" · ") : "single";
  };

  // The read token: asked once, kept for the tab.
  let onToken = null;
  V.onToken = (fn) => { onToken = fn; };
  V.askToken = function (reason) {
    const dialog = document.getElementById("token-dialog");
    document.getElementById("token-reason").textContent = reason || "";
    if (!dialog.open) dialog.showModal();
  };
  V.initToken = function () {
    const dialog = document.getElementById("token-dialog");
    const input = document.getElementById("token-input");
    document.getElementById("token-button").addEventListener("click", () => V.askToken("Read token for this tab."));
    dialog.addEventListener("close", () => {
      if (dialog.returnValue === "save") V.setToken(input.value.trim());
      if (dialog.returnValue === "clear") V.setToken("");
      input.value = "";
      if (onToken) onToken();
    });
  };

  // Live: a refresh loop that pauses while the tab is hidden; the header says when it last ran.
  V.live = function (fn, ms) {
    let timer = null;
    const live = document.getElementById("live");
    const run = async () => {
      try {
        if (!document.hidden) {
          await fn();
          V.updated = Date.now();
          live.textContent = "live · " + new Date().toISOString().slice(11, 19);
          live.classList.remove("stale");
        }
      } catch (e) {
        live.textContent = e instanceof AuthError ? "needs a token" : "offline: " + e.message;
        live.classList.add("stale");
      }
      timer = setTimeout(run, ms);
    };
    run();
    return () => clearTimeout(timer);
  };

  V.errorBox = (where, e) => {
    if (e instanceof AuthError) return;
    V.clear(where).append(V.el("p", { class: "error", text: String(e.message || e) }));
  };

  // One tooltip for every canvas.
  V.tooltip = function (x, y, lines) {
    const tip = document.getElementById("tooltip");
    if (!lines) { tip.hidden = true; return; }
    V.clear(tip);
    for (const line of lines) tip.append(V.el("div", { text: line }));
    tip.hidden = false;
    const w = tip.offsetWidth;
    tip.style.left = Math.min(x + 14, window.innerWidth - w - 8) + "px";
    tip.style.top = y + 14 + "px";
  };
})();
