// elbowroom dashboard: polls /api/elbowroom/dashboard once a second and draws it.
// Plain JavaScript and inline SVG; no dependency, no request to anywhere but this server.
"use strict";

const POLL_MS = 1000;
const WINDOW_S = 600;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = {
  usage: "#3b5bdb", limit: "#1d2330", soft: "#c77700", hard: "#c53030",
  load: "#2f855a", unload: "#6b7280", evict: "#c77700", abort: "#c53030",
  crash: "#c53030", oom_kill: "#7f1d1d", load_failed: "#c53030", refused_503: "#e03131", refused_507: "#9c36b5",
  refusing: "#c53030", admitting: "#2f855a", pause_loads: "#c77700", resume_loads: "#2f855a",
};
const MARKED = new Set(["load", "unload", "evict", "abort", "crash", "oom_kill", "load_failed",
  "refused_503", "refused_507"]);

const state = { timeline: [], last: 0, data: null, key: sessionStorage.getItem("elbowroom-key") };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "onclick") node.addEventListener("click", v);
    else if (k === "style") {
      // Through CSSOM: the page's Content-Security-Policy forbids inline style attributes.
      for (const decl of String(v).split(";")) {
        const at = decl.indexOf(":");
        if (at > 0) node.style.setProperty(decl.slice(0, at).trim(), decl.slice(at + 1).trim());
      }
    }
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function size(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(bytes);
  let i = 0;
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
}

function clock(wall) {
  return new Date(wall * 1000).toLocaleTimeString([], { hour12: false });
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "never";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " m " + String(s % 60).padStart(2, "0") + " s";
  return Math.floor(s / 3600) + " h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + " m";
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

function say(text, ok) {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = ok ? "ok" : "";
  box.hidden = !text;
}

// ---- polling -------------------------------------------------------------------------

async function poll() {
  try {
    const r = await fetch("/api/elbowroom/dashboard?since=" + state.last, { headers: headers() });
    if (r.status === 401) {
      document.getElementById("keyform").hidden = false;
      document.getElementById("updated").textContent = "this server needs its API key";
      return;
    }
    if (!r.ok) {
      document.getElementById("updated").textContent = "server answered " + r.status;
      return;
    }
    const data = await r.json();
    merge(data);
    render(data);
  } catch (err) {
    document.getElementById("updated").textContent = "server unreachable (" + err.message + ")";
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function merge(data) {
  for (const p of data.timeline) {
    if (p[0] > state.last) state.timeline.push(p);
  }
  if (state.timeline.length) state.last = state.timeline[state.timeline.length - 1][0];
  const cutoff = data.now - WINDOW_S;
  while (state.timeline.length && state.timeline[0][0] < cutoff) state.timeline.shift();
  state.data = data;
}

function render(data) {
  const level = data.pressure.level || "unknown";
  const badge = document.getElementById("pressure");
  badge.dataset.level = level;
  document.getElementById("pressure-level").textContent = level;
  badge.title = (data.pressure.reasons || []).join("\n") || "no pressure signal";
  const gate = [];
  if (!data.pressure.admission_open) gate.push("refusing new work (hard pressure)");
  if (data.pressure.loads_paused) gate.push("loads paused");
  if (!data.pressure.guard_enabled) gate.push("memory guard off");
  document.getElementById("gate").textContent = gate.join(" · ");
  document.getElementById("updated").textContent = "updated " + clock(data.now);
  renderPools(data.pools);
  renderTimeline(data);
  renderModels(data);
  renderNodes(data.nodes || [], data.cluster, data.now);
  renderEvents(data.events);
}

// ---- cluster nodes (docs/cluster.md) ---------------------------------------------------

function renderNodes(nodes, cluster, now) {
  document.getElementById("nodes-section").hidden = nodes.length === 0;
  document.getElementById("cluster-totals").textContent = cluster
    ? "cluster total over " + cluster.nodes + " live nodes (sums of the rows below): committed " +
      size(cluster.committed) + " / ceiling " + size(cluster.ceiling) + ", free " +
      size(cluster.available) + ". The pools and the timeline above are node " +
      cluster.worst_node + "'s (the most pressed)."
    : "";
  const state = (n) => n.alive ? "up"
    : n.gone_at ? "gone " + Math.max(0, Math.round(now - n.gone_at)) + " s ago" : "gone";
  const rows = nodes.map((n) => el("tr", { "data-node": n.name, "data-alive": String(n.alive) },
    el("td", {}, el("b", {}, n.name)),
    el("td", { title: n.gone_cause || "" }, state(n)),
    el("td", { "data-level": n.pressure || "" }, n.pressure || "–"),
    el("td", { class: "num" }, size(n.committed) + " / " + size(n.ceiling)),
    el("td", { class: "num" }, size(n.available)),
    el("td", {}, n.models.join(", ") || "–")));
  document.querySelector("#nodes tbody").replaceChildren(...rows);
}

// ---- pools ---------------------------------------------------------------------------

function renderPools(pools) {
  const box = document.getElementById("pools");
  box.replaceChildren(...pools.map(renderPool));
}

function renderPool(pool) {
  const total = pool.total || 1;
  const pct = (b) => (100 * Math.max(0, b) / total).toFixed(3) + "%";
  const bar = el("div", { class: "bar", role: "img", "aria-label": pool.name });
  let ours = 0;
  for (const m of pool.models || []) {
    const onGpu = pool.kind === "gpu";
    const parts = onGpu ? [["gpu", m.gpu]] : [["anon", m.anonymous], ["file", m.file_backed]];
    for (const [cls, bytes] of parts) {
      if (bytes > 0) {
        bar.append(el("div", { class: "seg " + cls, style: "width:" + pct(bytes),
          title: m.id + ": " + size(bytes) + " " + cls }));
        ours += bytes;
      }
    }
  }
  const other = Math.max(0, (pool.used || 0) - ours);
  bar.append(el("div", { class: "seg other", style: "width:" + pct(other),
    title: "everything else: " + size(other) }));
  for (const [cls, value] of [["soft", pool.soft], ["hard", pool.hard], ["limit", pool.limit]]) {
    if (value) {
      bar.append(el("div", { class: "mark " + cls, style: "left:" + pct(value),
        title: cls + " " + size(value) }));
    }
  }
  const facts = [size(pool.used) + " used of " + size(pool.total),
    size(pool.available) + " available"];
  if (pool.limit) {
    facts.push("limit " + size(pool.limit) + (pool.limit_winner ? " (" + pool.limit_winner + ")" : ""));
    facts.push("soft " + size(pool.soft), "hard " + size(pool.hard));
    facts.push("ours " + size(pool.own_usage), "committed " + size(pool.committed));
    if (pool.ceiling) facts.push("load ceiling " + size(pool.ceiling));
  }
  const holders = el("ul", { class: "holders" });
  for (const m of pool.models || []) {
    const line = pool.kind === "gpu" ? size(m.gpu) + " GPU" :
      size(m.anonymous) + " anonymous, " + size(m.file_backed) + " file-backed" +
      (m.gpu ? ", " + size(m.gpu) + " GPU" : "");
    holders.append(el("li", {}, el("b", {}, m.id), ": " + line));
  }
  return el("div", { class: "pool", "data-pool": pool.id },
    el("div", { class: "title" }, el("span", {}, pool.name), el("span", {}, size(pool.total))),
    bar,
    el("div", { class: "facts", title: pool.limit_why || "" }, facts.join(" · ")),
    (pool.models || []).length ? holders : null);
}

// ---- timeline ------------------------------------------------------------------------

function renderTimeline(data) {
  const W = 1000, H = 230, L = 70, R = 10, T = 16, B = 24;
  const points = state.timeline;
  // Up to ten minutes; a server that started a minute ago gets its minute drawn wide.
  const now = data.now;
  const oldest = points.length ? points[0][0] : now;
  const span = Math.min(WINDOW_S, Math.max(60, Math.ceil((now - oldest) / 60) * 60));
  const start = now - span;
  document.getElementById("timeline-title").textContent =
    "Pressure, last " + (span / 60) + (span === 60 ? " minute" : " minutes");
  let ymax = 1;
  for (const p of points) ymax = Math.max(ymax, p[1], p[2]);
  ymax *= 1.08;
  const x = (wall) => L + (W - L - R) * (wall - start) / span;
  const y = (bytes) => T + (H - T - B) * (1 - bytes / ymax);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", id: "timeline-svg",
    "aria-label": "memory and pressure over the last ten minutes" });
  // Pressure bands: one rectangle per run of samples at the same level above normal.
  for (let i = 0; i < points.length; i++) {
    const lvl = points[i][5];
    if (!lvl) continue;
    const x0 = x(points[i][0]);
    const x1 = i + 1 < points.length ? x(points[i + 1][0]) : x(now);
    root.append(svg("rect", { x: x0, y: T, width: Math.max(1, x1 - x0), height: H - T - B,
      fill: lvl === 2 ? "#fed7d7" : "#feebc8", "data-level": lvl === 2 ? "hard" : "soft" }));
  }
  // Axes and grid.
  for (let k = 0; k <= 4; k++) {
    const v = ymax * k / 4;
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#e9ecef" }));
    root.append(svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", "font-size": 11,
      fill: "#6b7280" }, size(v)));
  }
  for (let k = 0; k <= 5; k++) {
    const ago = span * (5 - k) / 5;
    const label = k === 5 ? "now" : "-" + (ago < 120 ? ago + " s" : ago / 60 + " min");
    root.append(svg("text", { x: x(start + span * k / 5), y: H - 6, "text-anchor": "middle",
      "font-size": 11, fill: "#6b7280" }, label));
  }
  // Lines: ours, the limit and its thresholds.
  const series = [["usage", 1, ""], ["limit", 2, ""], ["soft", 3, "6 4"], ["hard", 4, "6 4"]];
  for (const [name, idx, dash] of series) {
    if (!points.length) break;
    const d = points.map((p, i) => (i ? "L" : "M") + x(p[0]).toFixed(1) + " " + y(p[idx]).toFixed(1));
    root.append(svg("path", { d: d.join(" "), fill: "none", stroke: COLORS[name],
      "stroke-width": name === "usage" ? 2.2 : 1.2, "stroke-dasharray": dash,
      "data-series": name }));
  }
  // Events: a line and a dot at the moment, the message on hover.
  for (const e of data.events) {
    if (!MARKED.has(e.kind) || e.wall < start) continue;
    const ex = x(e.wall);
    const g = svg("g", { class: "event-mark", "data-kind": e.kind });
    g.append(svg("line", { x1: ex, x2: ex, y1: T, y2: H - B, stroke: COLORS[e.kind] || "#555",
      "stroke-width": 1.2, "stroke-dasharray": "2 2" }));
    g.append(svg("circle", { cx: ex, cy: T - 6, r: 5, fill: COLORS[e.kind] || "#555" }));
    g.append(svg("title", {}, clock(e.wall) + " " + e.kind + (e.model ? " " + e.model : "") +
      ": " + e.message));
    root.append(g);
  }
  document.getElementById("timeline").replaceChildren(root);
  renderLegend();
}

function renderLegend() {
  const box = document.getElementById("legend");
  if (box.childElementCount) return;
  const items = [["usage", "our models"], ["limit", "limit"], ["soft", "soft threshold"],
    ["hard", "hard threshold"], ["load", "load"], ["unload", "unload"], ["evict", "eviction"],
    ["abort", "abort"], ["refused_503", "503"], ["refused_507", "507"]];
  for (const [k, label] of items) {
    box.append(el("span", {}, el("i", { style: "background:" + COLORS[k] }), label));
  }
  box.append(el("span", {}, el("i", { style: "background:#feebc8;height:10px" }), "soft pressure"));
  box.append(el("span", {}, el("i", { style: "background:#fed7d7;height:10px" }), "hard pressure"));
}

// ---- models --------------------------------------------------------------------------

function kvText(kv) {
  if (!kv) return "–";
  const tiers = kv.tiers.map((t) => t.tier + " " + t.entries + " / " + size(t.bytes) + " / " +
    t.hits + " hits").join("; ");
  const rate = kv.hit_rate === null ? "no lookups" : (100 * kv.hit_rate).toFixed(0) + "% hits";
  return tiers + " · " + rate;
}

function renderModels(data) {
  const body = document.querySelector("#models tbody");
  const rows = data.models.map((m) => {
    const countdown = m.pinned ? "never (pinned)" :
      m.expires_in === null ? "never" : duration(m.expires_in);
    return el("tr", { "data-model": m.id, "data-state": m.state },
      el("td", {}, el("b", {}, m.id), " ", m.pinned ? el("span", { class: "pin" }, "pinned") : null,
        m.node ? el("span", { class: "muted" }, " on " + m.node) : null),
      el("td", {}, m.kind),
      el("td", {}, m.state),
      el("td", { class: "num" }, m.slots_busy + " / " + m.slots),
      el("td", { class: "num" }, m.queue),
      el("td", { class: "num" }, size(m.anonymous) + " / " + size(m.file_backed) + " / " + size(m.gpu)),
      el("td", { class: "num countdown" }, countdown),
      el("td", {}, kvText(m.kv)),
      el("td", {},
        el("button", { type: "button", "data-action": "unload", onclick: () => act(m.id, "unload") },
          "Unload"), " ",
        el("button", { type: "button", "data-action": m.pinned ? "unpin" : "pin",
          onclick: () => act(m.id, "load", { pin: !m.pinned }) }, m.pinned ? "Unpin" : "Pin")));
  });
  body.replaceChildren(...rows);
  document.getElementById("no-models").hidden = rows.length > 0;
  const select = document.getElementById("load-model");
  const choices = data.catalog.filter((c) => !c.loaded).map((c) => c.id);
  const current = Array.from(select.options).map((o) => o.value);
  if (choices.join("\n") !== current.join("\n")) {
    const keep = select.value;
    select.replaceChildren(...choices.map((id) => {
      const c = data.catalog.find((e) => e.id === id);
      return el("option", { value: id }, id + " (" + c.kind + ", " + size(c.size) + ")");
    }));
    if (choices.includes(keep)) select.value = keep;
  }
}

async function act(model, action, body) {
  say(action === "unload" ? "unloading " + model + "…" : "loading " + model + "…", true);
  try {
    const r = await fetch("/api/models/" + encodeURIComponent(model) + "/" + action, {
      method: "POST", headers: headers(true), body: JSON.stringify(body || {}) });
    const data = await r.json().catch(() => ({}));
    if (!r.ok) {
      const err = data.error || {};
      say(r.status + ": " + (err.message || JSON.stringify(data)), false);
      return;
    }
    say(model + ": " + (data.status || "done") + (data.pinned ? " (pinned)" : ""), true);
  } catch (err) {
    say(action + " " + model + " failed: " + err.message, false);
  }
}

// ---- events --------------------------------------------------------------------------

function renderEvents(events) {
  const list = document.getElementById("events");
  const items = events.slice(-40).reverse().map((e) =>
    el("li", { "data-kind": e.kind },
      el("span", { class: "muted" }, clock(e.wall) + " "),
      el("span", { class: "kind k-" + e.kind }, e.kind.replace("_", " ")), " ",
      e.message));
  list.replaceChildren(...items);
}

// ---- wiring --------------------------------------------------------------------------

document.getElementById("keyform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = document.getElementById("key").value.trim();
  sessionStorage.setItem("elbowroom-key", state.key);
  document.getElementById("keyform").hidden = true;
});
document.getElementById("loadform").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const model = document.getElementById("load-model").value;
  if (model) act(model, "load", {});
});
document.getElementById("load-pin-button").addEventListener("click", () => {
  const model = document.getElementById("load-model").value;
  if (model) act(model, "load", { pin: true });
});
poll();
