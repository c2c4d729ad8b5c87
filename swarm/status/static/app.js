// The swarm status page. Its only data source is the /api/status document (docs/protocol.md),
// received once a second from /api/events (server-sent events), or polled from /api/status when
// the event stream is unavailable. Charts are drawn on <canvas> by hand: no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 2000;
const SSE_RETRY_MS = 15000;

// ---------------------------------------------------------------- formatting --
function fmt(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toFixed(digits);
}
function fmtInt(v) {
  if (v === null || v === undefined) return "–";
  return Math.round(v).toLocaleString("en-US");
}
function fmtBytes(n) {
  if (!n) return "0 B";
  const u = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return (n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + u[i];
}
function fmtMB(n) { return n ? (n / 1e6).toFixed(2) : "0.00"; }
function fmtAge(s) {
  if (s === null || s === undefined) return "–";
  if (s < 1) return "now";
  if (s < 60) return Math.round(s) + " s ago";
  if (s < 3600) return Math.round(s / 60) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
function fmtClock(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}
function short(id) { return id ? String(id).slice(0, 8) : ""; }
function sum(obj) { return Object.values(obj || {}).reduce((a, b) => a + b, 0); }

// A stable colour per peer id.
function peerColor(id) {
  let h = 0;
  for (const c of String(id)) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 62%, 48%)`;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// -------------------------------------------------------------------- charts --
// series: [{label, color, points: [[x, y], ...], dots: bool, dash: bool}]
function drawChart(canvas, series, opts = {}) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (!w || !h) return;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";

  const pts = series.flatMap((s) => s.points.filter((p) => Number.isFinite(p[1])));
  canvas.dataset.points = String(pts.length);
  const pad = { l: 48, r: 10, t: 22, b: 22 };
  const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;

  // legend
  let lx = pad.l;
  for (const s of series) {
    ctx.fillStyle = s.color;
    ctx.fillRect(lx, 6, 10, 10);
    ctx.fillStyle = "#1d2433";
    ctx.textBaseline = "middle";
    ctx.textAlign = "left";
    const label = s.label + (s.points.length ? "" : " (no data)");
    ctx.fillText(label, lx + 14, 11);
    lx += ctx.measureText(label).width + 30;
  }
  if (!pts.length) {
    ctx.fillStyle = "#6b7487";
    ctx.textAlign = "center";
    ctx.fillText(opts.empty || "waiting for data…", pad.l + pw / 2, pad.t + ph / 2);
    return;
  }
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (opts.zero) y0 = Math.min(0, y0);
  if (x1 - x0 < 1e-9) { x0 -= 1; x1 += 1; }
  if (y1 - y0 < 1e-9) { const m = Math.abs(y1) * 0.05 || 1; y0 -= m; y1 += m; }
  const ypad = (y1 - y0) * 0.06;
  y1 += ypad; if (!opts.zero || y0 < 0) y0 -= ypad;
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * pw;
  const Y = (y) => pad.t + (1 - (y - y0) / (y1 - y0)) * ph;

  // grid and axes
  ctx.strokeStyle = "#e3e7ee";
  ctx.lineWidth = 1;
  ctx.fillStyle = "#6b7487";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const v of ticks(y0, y1, 5)) {
    const y = Math.round(Y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(pad.l + pw, y); ctx.stroke();
    ctx.fillText(opts.yfmt ? opts.yfmt(v) : tickLabel(v), pad.l - 6, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const x of timeTicks(x0, x1, Math.max(2, Math.floor(pw / 80)))) {
    ctx.fillText(fmtClock(x), Math.min(Math.max(X(x), pad.l + 22), pad.l + pw - 22), pad.t + ph + 6);
  }

  // lines
  for (const s of series) {
    const p = s.points.filter((q) => Number.isFinite(q[1]));
    if (!p.length) continue;
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = s.width || 1.6;
    ctx.setLineDash(s.dash ? [5, 4] : []);
    if (!s.dots) {
      ctx.beginPath();
      p.forEach((q, i) => (i ? ctx.lineTo(X(q[0]), Y(q[1])) : ctx.moveTo(X(q[0]), Y(q[1]))));
      ctx.stroke();
    }
    if (s.dots || p.length === 1) {
      for (const q of p) { ctx.beginPath(); ctx.arc(X(q[0]), Y(q[1]), 3.2, 0, 2 * Math.PI); ctx.fill(); }
    }
    ctx.setLineDash([]);
  }
}

function ticks(lo, hi, n) {
  const span = hi - lo;
  const step0 = span / n;
  const mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || 10 * mag;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) out.push(v);
  return out;
}
// Clock ticks on whole seconds, minutes or hours, at most ``n`` of them.
function timeTicks(lo, hi, n) {
  const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400];
  const step = steps.find((s) => (hi - lo) / s <= n) || 86400;
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) out.push(t);
  return out;
}
function tickLabel(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2).replace(/\.?0+$/, "");
  return v.toPrecision(2);
}

// Rates from cumulative samples [t, a, b, ...]: [t, (a1-a0)/dt] for column ``col``.
function rate(points, col, scale = 1) {
  const out = [];
  for (let i = 1; i < points.length; i++) {
    const dt = points[i][0] - points[i - 1][0];
    if (dt <= 0) continue;
    out.push([points[i][0], Math.max(0, (points[i][col] - points[i - 1][col]) / dt) * scale]);
  }
  return smooth(out, 5);
}
function smooth(points, k) {
  return points.map((p, i) => {
    const w = points.slice(Math.max(0, i - k + 1), i + 1);
    return [p[0], w.reduce((a, q) => a + q[1], 0) / w.length];
  });
}
// Interval compression ratio: delta dense bytes / delta payload bytes (columns 4 and 3).
function intervalRatio(points) {
  const out = [];
  for (let i = 1; i < points.length; i++) {
    const dw = points[i][3] - points[i - 1][3], dd = points[i][4] - points[i - 1][4];
    if (dw > 0) out.push([points[i][0], dd / dw]);
  }
  return smooth(out, 5);
}

// ------------------------------------------------------------------ rendering --
let last = null;

// "task bytelm v1 · 0.48M dense · tables ngram 65,536×128, value 65,536×128"
function taskLine(t) {
  const dense = t.dense_values >= 1e6 ? (t.dense_values / 1e6).toFixed(2) + "M" : fmtInt(t.dense_values);
  const tables = (t.tables || []).map((x) => `${x.path} ${fmtInt(x.rows)}×${x.dim}`).join(", ");
  return `· task ${t.name} v${t.version} · ${dense} dense` + (t.buffers ? ` (${fmtInt(t.buffers)} in buffers)` : "") +
    (tables ? ` · tables ${tables}` : "");
}

// the contributor cap at work (docs/design.md, "Uneven peers and large swarms"): payloads at 1/k
// of their entries (in windows, and per step with --cap-by bytes), or per step a payload every k
// rounds (--cap-by rounds, or a free-running peer's own stride)
function capLine(s) {
  const p = s.pacing || {};
  const share = p.payload_share || 1, stride = s.sync_every > 1 ? 1 : (p.stride || 1);
  let line = "";
  if (share > 1) line += ` · payloads at 1/${share} of their entries (--max-contributors ${p.max_contributors})`;
  if (stride > 1) {
    line += ` · a payload every ${stride} rounds` +
      (p.free_running ? " (free-running)" : ` (--max-contributors ${p.max_contributors}, --cap-by rounds)`);
  }
  return line;
}

function render(s) {
  last = s;
  document.title = `swarm · ${short(s.peer_id)} · step ${s.step}`;
  $("peer-id").textContent = "peer " + s.peer_id;
  $("peer-addr").textContent = s.addr || "";
  const v = s.versions;  // "swarm 0.1.0 · protocol 3 · Python 3.11.7 · torch 2.13.0+cpu"
  $("versions").textContent = v ? `swarm ${v.swarm} · protocol ${v.protocol} · Python ${v.python} · torch ${v.torch}` : "";
  $("updated").textContent = "updated " + fmtClock(s.now || Date.now() / 1000);
  const sw = s.swarm || {};
  const members = s.members || [];

  $("c-peers").textContent = fmtInt(sw.alive ?? 0);
  $("c-peers-sub").textContent = `${sw.suspect ?? 0} suspect · ${sw.dead ?? 0} dead · ${sw.left ?? 0} left`;
  $("c-step").textContent = fmtInt(sw.step ?? s.step);
  $("c-step-sub").textContent = `this peer ${fmtInt(s.step)}` +
    (s.group ? ` · rank ${s.group.rank} of ${s.group.size} (${s.group.backend})` : s.active ? "" : " (idle)") +
    ` · epoch ${sw.epoch ?? 0}` +
    (s.sync_every > 1 ? ` · windows of ${s.sync_every} inner steps${s.overlap ? ", overlapped" : ""}` +
      ` (inner step ${fmtInt(s.inner_step)}` +
      (s.window_steps && s.window_steps < s.sync_every ? `; this peer is slower: ${fmtInt(s.window_steps)} a window` : "") +
      (s.push_lead ? `; row pushes ${fmtInt(s.push_lead)} steps before the end` : "") +
      ")" : s.overlap ? " · rounds overlapped" : "") +
    capLine(s);
  const t = s.task;
  const lm = !t || t.tokens_per_sample > 0;  // a language model counts tokens, other tasks samples
  $("task").textContent = t ? taskLine(t) : "";
  $("c-tps-label").textContent = lm ? "Tokens / s (swarm)" : "Samples / s (swarm)";
  $("th-rate").textContent = lm ? "tok/s" : "samples/s";
  $("c-tps").textContent = fmtInt(sw.tokens_per_s);
  $("c-tps-sub").textContent = `this peer ${fmtInt(lm ? s.tokens_per_s : s.samples_per_s)}`;
  $("c-loss").textContent = fmt(s.loss);
  $("c-loss-sub").textContent = `swarm mean ${fmt(sw.loss)}`;
  const val = (s.series && s.series.val_loss) || [];
  $("c-val").textContent = fmt(s.val_loss ?? (val.length ? val[val.length - 1][2] : null));
  $("c-val-sub").textContent = val.length ? `at step ${fmtInt(val[val.length - 1][1])}` : "not evaluated yet";
  $("c-ratio").textContent = s.compression_ratio ? "×" + s.compression_ratio.toFixed(0) : "–";
  $("c-ratio-sub").textContent = s.compression || "";
  $("c-wire").textContent = fmtBytes(sum(s.bytes_sent)) + " ↑";
  const we = s.wire_encoding;  // bodies on the wire against before zstd (--wire-compression)
  const plain = we ? we.sent_plain + we.received_plain : 0;
  $("c-wire-sub").textContent = `${fmtBytes(sum(s.bytes_received))} ↓ received` +
    (s.bytes_per_sample ? ` · ${fmtBytes(s.bytes_per_sample)} sent per sample` : "") +
    (plain > 0 ? ` · zstd saved ${(100 * (1 - (we.sent + we.received) / plain)).toFixed(0)}%` : "");
  $("c-wire-sub").title = `dense fp32 to the same peers: ${fmtBytes(s.dense_bytes)}`;
  const pl = s.pull_latency_ms;
  $("pull").textContent = pl ? `p50 ${fmt(pl.p50, 1)} ms · p95 ${fmt(pl.p95, 1)} ms` : "not enabled";

  $("row-health").textContent = rowHealth(s.rows);

  renderCharts(s);
  renderPhases(s.step_phases);
  renderPeers(s, members);
  renderSettings(s);
  renderTables(s.tables);
  renderLog(s.log || []);
}

function renderCharts(s) {
  const se = s.series || {};
  const xy = (pts, col) => (pts || []).map((p) => [p[0], p[col]]);
  drawChart($("loss-chart"), [
    { label: "this peer (train)", color: "#2f6fde", points: smooth(xy(se.loss, 2), 5) },
    { label: "swarm (train)", color: "#e07b39", points: xy(se.swarm_loss, 2), dash: true },
    { label: "validation", color: "#1f9d55", points: xy(se.val_loss, 2), dots: true },
  ]);
  const wire = se.wire || [];
  drawChart($("wire-chart"), [
    { label: "received", color: "#9b59b6", points: rate(wire, 2, 1e-6), width: 2.4 },
    { label: "sent", color: "#2f6fde", points: rate(wire, 1, 1e-6), dash: true },
  ], { zero: true, yfmt: (v) => tickLabel(v) });
  drawChart($("ratio-chart"), [
    { label: "compression ×", color: "#1f9d55", points: intervalRatio(wire) },
  ], { zero: true });
}

function renderPeers(s, members) {
  const order = { alive: 0, suspect: 1, dead: 2, left: 3 };
  const rows = [...members].sort((a, b) =>
    (b.self - a.self) || (order[a.state] - order[b.state]) || String(a.peer_id).localeCompare(b.peer_id));
  const rb = (s.robust && s.robust.peers) || {};
  const scores = Object.values(rb);
  const banned = scores.filter((r) => r.banned_for_s > 0).length;
  const outliers = scores.reduce((a, r) => a + (r.outliers || 0), 0);
  const invalid = scores.reduce((a, r) => a + (r.invalid || 0), 0);
  $("peers-hint").textContent = `${members.length} known to this peer` +
    (s.robust ? ` · ${s.robust.aggregation} · ${banned} banned · ${outliers} outlier and ${invalid} invalid payloads` +
      ` · ${s.robust.refused_banned || 0} refused from banned peers` : "");
  const tbody = document.querySelector("#peers tbody");
  const frag = document.createDocumentFragment();
  for (const m of rows) {
    const lagCls = m.lag !== null && m.lag > 4 ? "num lag-bad" : "num";
    const idCell = el("td", { class: "mono", title: m.peer_id },
      el("span", { class: "swatch", style: `background:${peerColor(m.peer_id)}` }),
      short(m.peer_id) + (m.self ? " (this)" : "") +
        (m.group ? ` · rank ${m.grank} of ${short(m.group)}'s group` : ""));
    const tr = el("tr", { "data-peer-id": m.peer_id, class: m.self ? "self" : "" },
      idCell,
      el("td", { class: "mono", text: m.addr }),
      el("td", { title: rb[m.peer_id] ? `score ${rb[m.peer_id].score}, outliers ${rb[m.peer_id].outliers}, ` +
          `invalid ${rb[m.peer_id].invalid}, bans ${rb[m.peer_id].bans}` : "" },
        rb[m.peer_id] && rb[m.peer_id].banned_for_s > 0
          ? el("span", { class: "pill dead", text: `banned ${Math.ceil(rb[m.peer_id].banned_for_s)}s` })
          : el("span", { class: "pill " + m.state, text: m.state })),
      el("td", { class: "num", text: fmtInt(m.step) }),
      el("td", { class: lagCls, text: m.lag === null || m.lag === undefined ? "–" : String(m.lag) }),
      el("td", { class: "num", text: fmt(m.loss) }),
      el("td", { class: "num", text: m.active ? fmtInt(m.tokens_per_s) : "–" }),
      el("td", { class: "num", text: m.rtt_ms === null || m.rtt_ms === undefined ? "–" : m.rtt_ms.toFixed(1) + " ms" }),
      el("td", { class: "num", text: m.self ? "–" : fmtMB(m.bytes_in) }),
      el("td", { class: "num", text: m.self ? "–" : fmtMB(m.bytes_out) }),
      el("td", { class: "num", text: m.self ? "self" : fmtAge(m.last_seen_s) }),
    );
    frag.append(tr);
  }
  tbody.replaceChildren(frag);
}

// "seed 0 · budget 300 · lr 0.003 · ..." and how often this peer's replica was re-synced
function renderSettings(s) {
  const st = s.settings || {};
  $("settings").textContent = Object.keys(st).map((k) => `${k} ${st[k]}`).join(" · ") || "–";
  const r = s.resyncs || {};
  const n = (r.lag || 0) + (r.diverged || 0);
  $("settings-hint").textContent = "agreed at join: every peer trains with these" +
    (s.sketch_step != null ? ` · replicas compared at step ${fmtInt(s.sketch_step)}` : "") +
    (n ? ` · re-synced ${r.diverged || 0}× (diverged), ${r.lag || 0}× (behind)` : "");
}

// the step phases of swarm/steptimes.py, in order; waits on other peers are warm colours
const PHASES = [
  ["rows", "waiting for rows", "#e8833a"],
  ["compute", "compute", "#2f6fde"],
  ["send", "send", "#8fb3ee"],
  ["held", "held for others' pushes", "#d64545"],
  ["round", "waiting for the round", "#f0b429"],
  ["apply", "apply", "#1f9d55"],
  ["after", "status, evaluation", "#b6bdca"],
];

function renderPhases(sp) {
  const box = $("phases");
  if (!sp || !sp.steps) {
    box.replaceChildren(el("p", { class: "empty", text: "no step timed yet" }));
    $("phases-hint").textContent = "";
    return;
  }
  const shown = PHASES.filter(([k]) => sp[k] && sp[k].mean_ms > 0);
  const total = shown.reduce((a, [k]) => a + sp[k].mean_ms, 0);
  $("phases-hint").textContent = `mean of its last ${fmtInt(sp.steps)} steps: ${fmt(total, 0)} ms a step` +
    (sp.wait_share != null ? ` · ${Math.round(100 * sp.wait_share)}% waiting on other peers (rows, held, round)` : "");
  const bar = el("div", { class: "phase-bar" });
  const legend = el("div", { class: "legend" });
  for (const [k, label, colour] of shown) {
    const ms = sp[k].mean_ms;
    const pct = total > 0 ? Math.round((100 * ms) / total) : 0;
    bar.append(el("div", { style: `flex:${ms} 0 0;background-color:${colour}`,
      title: `${label}: ${fmt(ms, 1)} ms mean, ${fmt(sp[k].median_ms, 1)} ms median (${pct}%)` }));
    legend.append(el("span", { class: "mono", "data-phase": k }, el("span", { class: "swatch", style: `background:${colour}` }),
      `${label} ${fmt(ms, 1)} ms`));
  }
  box.replaceChildren(bar, legend);
}

// the rows' trouble counters of /api/status "rows" (TableClient.status): only those that are not zero
function rowHealth(r) {
  if (!r) return "";
  const owed = Object.values(r.rows_owed || {}).reduce((a, n) => a + n, 0);
  const parts = [
    [r.rows_missing, "rows missing (zeros used)"],
    [r.push_failures, "push failures"],
    [r.retries, "retries"],
    [owed, "rows owed to replicas"],
    [r.flushes_partial, "partial flushes"],
    [r.replay_waits, "waits for a replay", ` (${fmt(r.replay_wait_s, 1)} s)`],
    [r.replays_given_up, "replays given up on"],
  ].filter(([n]) => n > 0).map(([n, what, more]) => `${what} ${fmtInt(n)}${more || ""}`);
  return `Rows: ${fmtInt(r.pulls)} pulls · ${fmtInt(r.rows_read_local)} rows read here, ${fmtInt(r.rows_pulled_remote)} pulled` +
    (parts.length ? " · " + parts.join(" · ") : " · no trouble");
}

function renderTables(t) {
  const box = $("tables");
  if (!t || !Array.isArray(t.owners)) {
    box.replaceChildren(el("p", { class: "empty", text: "not enabled" }));
    $("tables-hint").textContent = "";
    return;
  }
  $("tables-hint").textContent = `${fmtInt(t.slots)} slots per table · epoch ${t.epoch ?? "–"}` +
    (t.window && t.window < t.slots ? ` · bars show slots 0–${t.window - 1}` : "");
  const slots = Math.max(1, Math.min(t.slots || 1, t.window || Infinity));
  const moving = (t.handoffs || []);
  const byTable = new Map();
  for (const o of t.owners) {
    if (!byTable.has(o.table)) byTable.set(o.table, []);
    byTable.get(o.table).push(o);
  }
  const peers = new Set();
  const frag = document.createDocumentFragment();
  for (const [name, owners] of byTable) {
    owners.sort((a, b) => a.first_slot - b.first_slot);
    const bar = el("div", { class: "own-bar" });
    for (const o of owners) {
      peers.add(o.primary);
      (o.replicas || []).forEach((r) => peers.add(r));
      const n = o.last_slot - o.first_slot + 1;
      const isMoving = moving.some((h) => h.table === o.table && h.first_slot <= o.last_slot && h.last_slot >= o.first_slot);
      bar.append(el("div", {
        class: isMoving ? "moving" : "",
        style: `flex:${n} 0 0;background-color:${peerColor(o.primary)}`,
        title: `${name} slots ${o.first_slot}–${o.last_slot}: primary ${short(o.primary)}` +
          `, replicas ${(o.replicas || []).map(short).join(", ") || "none"}${isMoving ? " (hand-off under way)" : ""}`,
      }));
    }
    frag.append(el("div", { class: "own-table" },
      el("div", { class: "name" }, el("b", { text: name }), ` · ${owners.length} ranges of ${fmtInt(slots)} slots`),
      bar));
  }
  const legend = el("div", { class: "legend" });
  if (t.by_peer) Object.keys(t.by_peer).forEach((p) => peers.add(p));
  for (const p of [...peers].sort()) {
    const counted = t.by_peer && t.by_peer[p];  // all slots of all tables, when the peer reports them
    const primaries = counted ? counted.primary :
      t.owners.filter((o) => o.primary === p).reduce((a, o) => a + o.last_slot - o.first_slot + 1, 0);
    const replicas = counted ? counted.replica :
      t.owners.filter((o) => (o.replicas || []).includes(p)).reduce((a, o) => a + o.last_slot - o.first_slot + 1, 0);
    legend.append(el("span", { class: "mono" }, el("span", { class: "swatch", style: `background:${peerColor(p)}` }),
      `${short(p)} primary ${primaries} · replica ${replicas}`));
  }
  frag.append(legend);
  const ho = el("div", { class: "handoffs" });
  ho.append(el("b", { text: `Hand-offs under way: ${moving.length}` }));
  for (const h of moving.slice(0, 20)) {
    ho.append(el("div", { class: "mono",
      text: `${h.table} ${h.first_slot}–${h.last_slot}: ${short(h.from)} → ${short(h.to)}` +
        (h.progress !== undefined ? ` (${Math.round(100 * h.progress)}%)` : "") }));
  }
  frag.append(ho);
  box.replaceChildren(frag);
}

function renderLog(entries) {
  const tbody = document.querySelector("#log tbody");
  const frag = document.createDocumentFragment();
  for (const e of [...entries].reverse().slice(0, 100)) {
    frag.append(el("tr", { class: `${e.source} ${e.kind}` },
      el("td", { class: "mono muted", text: fmtClock(e.at) }),
      el("td", { class: "muted", text: e.source }),
      el("td", { class: "kind", text: e.kind }),
      el("td", { class: "mono", text: short(e.peer_id) }),
      el("td", { text: e.detail || "" })));
  }
  if (!entries.length) frag.append(el("tr", {}, el("td", { class: "empty", text: "no events yet" })));
  tbody.replaceChildren(frag);
}

// ------------------------------------------------------------------ data feed --
function setConn(kind, text) {
  $("conn-dot").className = "dot " + kind;
  $("conn-text").textContent = text;
}

let source = null, pollTimer = null, sseRetryTimer = null;

function startSSE() {
  if (!window.EventSource) { startPolling(); return; }
  clearTimeout(sseRetryTimer);
  try {
    source = new EventSource("/api/events");
  } catch (e) { startPolling(); return; }
  source.addEventListener("status", (ev) => {
    stopPolling();
    setConn("live", "live");
    try { render(JSON.parse(ev.data)); } catch (e) { /* a partial frame; the next one replaces it */ }
  });
  source.addEventListener("bye", () => { fallBack("peer is shutting down"); });
  source.onerror = () => { fallBack("event stream lost"); };
}

function fallBack(why) {
  if (source) { source.close(); source = null; }
  startPolling(why);
  clearTimeout(sseRetryTimer);
  sseRetryTimer = setTimeout(startSSE, SSE_RETRY_MS);
}

function startPolling(why) {
  if (pollTimer) return;
  setConn("poll", "polling" + (why ? ` (${why})` : ""));
  const tick = async () => {
    try {
      const r = await fetch("/api/status", { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      if (pollTimer) setConn("poll", "polling");
    } catch (e) {
      setConn("down", "peer unreachable");
    }
  };
  tick();
  pollTimer = setInterval(tick, POLL_MS);
}

function stopPolling() {
  if (pollTimer) { clearInterval(pollTimer); pollTimer = null; }
}

window.addEventListener("resize", () => { if (last) renderCharts(last); });
startSSE();
