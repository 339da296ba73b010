// pdgate's operator page: polls the gateway's admin JSON and draws it. No libraries, no build
// step, nothing from another origin (the page's CSP allows only this one). Every value from
// the gateway goes into the page as text (textContent), never as markup: instance ids and
// group names come from the registry.
"use strict";

(() => {
  const POLL_MS = 1500;
  const HIDDEN_POLL_MS = 5000; // a background tab still notices the gateway going away
  const FETCH_TIMEOUT_MS = 4000; // a hung gateway must not stall the loop
  const CHART_WINDOW_S = 300; // the charts show the last 5 minutes (the gateway keeps 15)
  const RATE_WINDOW_S = 30; // per-instance 429 rate: over the last 30 s of polls
  const MAX_SAMPLES = 64; // per instance, bounds the rate history whatever the poll rate
  const SVG = "http://www.w3.org/2000/svg"; // a namespace name, never fetched

  // Relative URLs: the page works behind a proxy that serves the gateway under a prefix.
  const SOURCES = {
    instances: "admin/instances",
    queues: "admin/queues",
    series: "admin/series",
    ratio: "admin/ratio",
    health: "health",
  };

  let skewMs = 0; // server clock minus ours, from the Date header (bucket times are the server's)
  const samples = new Map(); // instance id -> [{t, accepted, rejected}], bounded above

  // -- small helpers ------------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "class") node.className = value;
      else if (key === "data") Object.assign(node.dataset, value);
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === undefined || child === null) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    return node;
  }

  const dash = "–";
  const num = (v, digits = 0) => (v === null || v === undefined ? dash : Number(v).toFixed(digits));
  // Two significant digits below 1 (an advised ratio of 0.012 must not read as 0.00).
  const amount = (v) => (v === null || v === undefined ? dash : v !== 0 && Math.abs(v) < 1 ? Number(v).toPrecision(2) : Number(v).toFixed(1));
  const pct = (v) => (v === null || v === undefined ? dash : `${(100 * v).toFixed(v >= 0.995 || v === 0 ? 0 : 1)}%`);
  const ms = (seconds) => (seconds === null || seconds === undefined ? dash : `${Math.round(seconds * 1000)}`);
  const duration = (s) => (s === null || s === undefined ? dash : s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(1)} s`);
  const sum = (rows, f) => rows.reduce((acc, r) => acc + (Number(f(r)) || 0), 0);
  const serverNow = () => (Date.now() + skewMs) / 1000;

  function setTile(id, value, sub, warn = false) {
    const tile = document.getElementById(id);
    tile.querySelector(".value").textContent = value;
    if (sub !== undefined) tile.querySelector(".sub").textContent = sub;
    tile.classList.toggle("warn", warn);
  }

  function setStatus(kind, text) {
    const status = document.getElementById("status");
    status.className = `status ${kind}`;
    status.textContent = text;
  }

  class HttpError extends Error {
    constructor(status, path) {
      super(`${path}: HTTP ${status}`);
      this.status = status;
    }
  }

  // The page's URL may carry credentials (user:token@ before the host): fetch() refuses
  // a URL with them, and the browser's auth cache supplies them anyway, so drop them here.
  function resolve(path) {
    const url = new URL(path, document.baseURI);
    url.username = "";
    url.password = "";
    return url.href;
  }

  async function getJSON(path) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
    try {
      const resp = await fetch(resolve(path), {
        cache: "no-store",
        credentials: "same-origin",
        headers: { accept: "application/json" },
        signal: abort.signal,
      });
      if (!resp.ok) throw new HttpError(resp.status, path);
      const date = Date.parse(resp.headers.get("date") || "");
      // The Date header has 1 s resolution: only follow it when it moved by more than that.
      if (!Number.isNaN(date) && Math.abs(date - Date.now() - skewMs) > 1500) skewMs = date - Date.now();
      return await resp.json();
    } finally {
      clearTimeout(timer);
    }
  }

  // -- header and summary -------------------------------------------------------------------

  function renderHeader(health) {
    document.getElementById("gateway").textContent =
      `gateway ${health.gateway_id} · registry ${health.registry}`;
    const fleet = health.fleet || {};
    const n = fleet.gateways || 1;
    document.getElementById("fleet").textContent =
      `${n} gateway${n === 1 ? "" : "s"} · ${fleet.shared ? "shared fleet state" : "local state"}` +
      (fleet.degraded ? " (degraded)" : "");
    const name = (p) => (p && p.name) || "?";
    document.getElementById("policies").textContent =
      `prefill ${name(health.prefill_policy)} · decode ${name(health.decode_policy)}`;
  }

  function renderSummary(instances, queues, series) {
    const prefills = instances.filter((r) => r.role === "prefill");
    const decodes = instances.filter((r) => r.role === "decode");
    const draining = instances.filter((r) => r.state !== "ready").length;
    const ejected = instances.filter((r) => r.ejected).length;
    setTile(
      "sum-instances",
      String(instances.length),
      `${prefills.length} prefill · ${decodes.length} decode · ${ejected} ejected · ${draining} draining`,
      ejected > 0,
    );
    // Each client stream is counted on its prefill and on its decode: show the decode side
    // (streams being relayed) and the prefill side beside it, never their sum.
    setTile(
      "sum-streams",
      String(sum(decodes, (r) => r.fleet_open_streams)),
      `relayed by decodes (counted on prefills: ${sum(prefills, (r) => r.fleet_open_streams)})`,
    );
    const used = (rows) => `${sum(rows, (r) => r.fleet_inflight)}/${sum(rows, (r) => r.capacity)}`;
    setTile(
      "sum-inflight",
      String(sum(instances, (r) => r.fleet_inflight)),
      `slots held: prefill ${used(prefills)} · decode ${used(decodes)}`,
    );
    const oldest = Math.max(0, ...queues.map((q) => q.head_ms || 0));
    setTile(
      "sum-queued",
      String(sum(queues, (q) => q.waiting)),
      `for a prefill; queued ${sum(queues, (q) => q.queued)}, oldest ${oldest ? `${Math.round(oldest)} ms` : dash}`,
    );

    const now = serverNow();
    const bs = series.bucket_s;
    const buckets = series.buckets || [];
    const since = Math.floor((now - RATE_WINDOW_S) / bs) * bs;
    const recent = buckets.filter((b) => b.t >= since);
    setTile(
      "sum-rate",
      num(sum(recent, (b) => b.requests) / Math.max(bs, now - since), 1),
      `finished, last ${RATE_WINDOW_S} s; prefill 429s ${sum(recent, (b) => b.rejections)}`,
    );
    const lastFive = buckets.filter((b) => b.t >= now - 300);
    const finished = sum(lastFive, (b) => b.requests);
    const success = finished ? sum(lastFive, (b) => b.ok) / finished : null;
    setTile(
      "sum-success",
      pct(success),
      finished ? `${finished} finished, last 5 min` : "no requests, last 5 min",
      success !== null && success < 0.99,
    );
    const latest = [...buckets].reverse().find((b) => b.ttft_p50 !== null && b.t >= now - 60);
    setTile(
      "sum-ttft",
      latest ? `${duration(latest.ttft_p50)} / ${duration(latest.ttft_p95)}` : dash,
      latest ? `latest ${bs} s with first tokens` : "no first tokens in the last minute",
    );
  }

  // -- instances ----------------------------------------------------------------------------

  // The share of this gateway's attempts an instance refused (429) over the last 30 s.
  function rejectionRate(row, nowMs) {
    let history = samples.get(row.id);
    if (!history) samples.set(row.id, (history = []));
    history.push({ t: nowMs, accepted: row.accepted, rejected: row.rejected });
    while (history.length > MAX_SAMPLES || (history.length > 1 && nowMs - history[0].t > RATE_WINDOW_S * 1000)) {
      history.shift();
    }
    const accepted = row.accepted - history[0].accepted;
    const rejected = row.rejected - history[0].rejected;
    if (accepted < 0 || rejected < 0) {
      // Counters went back (the gateway restarted): start the window again.
      history.splice(0, history.length - 1);
      return null;
    }
    return accepted + rejected > 0 ? rejected / (accepted + rejected) : null;
  }

  function slotsCell(row) {
    const used = row.fleet_inflight;
    const share = row.capacity > 0 ? used / row.capacity : 0;
    const fill = el("span", { class: `fill${share > 1 ? " over" : share >= 0.9 ? " high" : ""}` });
    fill.style.width = `${Math.min(100, Math.round(share * 100))}%`; // CSSOM: allowed by the CSP
    return el(
      "td",
      { data: { field: "slots" }, title: `this gateway holds ${row.inflight}` },
      el("span", { class: "bar" }, fill),
      `${used}/${row.capacity}`,
    );
  }

  function stateCell(row) {
    const cell = el("td", { data: { field: "state" } }, el("span", { class: `badge ${row.state}` }, row.state));
    if (row.ejected) cell.append(" ", el("span", { class: "badge ejected" }, "ejected"));
    if (row.busy) cell.append(" ", el("span", { class: "badge busy" }, "busy"));
    return cell;
  }

  function instanceRow(row, rate) {
    return el(
      "tr",
      { data: { instance: row.id, role: row.role } },
      el("td", { class: `role ${row.role}` }, row.role),
      el("td", { class: "id", title: `${row.id}\n${row.url}\nmodel ${row.model} · version ${row.version}` }, row.id),
      stateCell(row),
      el("td", { class: "num", data: { field: "streams" }, title: `this gateway: ${row.open_streams}` }, row.fleet_open_streams),
      el("td", { class: "num", data: { field: "inflight" }, title: `this gateway: ${row.inflight}` }, row.fleet_inflight),
      slotsCell(row),
      el("td", { class: "num", data: { field: "rejection_rate" } }, pct(rate)),
      el("td", { class: "num", data: { field: "accepted" } }, row.accepted),
      el("td", { class: "num", data: { field: "rejected" } }, row.rejected),
      el("td", { class: "num", data: { field: "failed" } }, row.failed),
    );
  }

  function renderInstances(instances) {
    const nowMs = Date.now();
    const groups = new Map();
    for (const row of instances) {
      if (!groups.has(row.group)) groups.set(row.group, []);
      groups.get(row.group).push(row);
    }
    const seen = new Set(instances.map((r) => r.id));
    for (const id of samples.keys()) if (!seen.has(id)) samples.delete(id); // departed
    const out = [];
    for (const group of [...groups.keys()].sort()) {
      // Prefills first (the side requests meet first), then decodes; by id within a role.
      const rows = groups.get(group).sort((a, b) => (a.role === b.role ? a.id.localeCompare(b.id) : a.role === "prefill" ? -1 : 1));
      const p = rows.filter((r) => r.role === "prefill").length;
      const models = [...new Set(rows.map((r) => r.model))].join(", ");
      out.push(el("h3", { data: { group } }, `group ${group} `, el("span", { class: "sub" }, `${p} prefill · ${rows.length - p} decode · ${models}`)));
      const head = el(
        "tr",
        null,
        ...["role", "instance", "state"].map((h) => el("th", null, h)),
        el("th", { class: "num" }, "streams"),
        el("th", { class: "num" }, "in flight"),
        el("th", null, "slots used"),
        el("th", { class: "num", title: "share of this gateway's tries refused with 429, last 30 s" }, "429 rate"),
        el("th", { class: "num" }, "accepted"),
        el("th", { class: "num" }, "429s"),
        el("th", { class: "num" }, "failed"),
      );
      out.push(el("table", { class: "instances" }, el("thead", null, head), el("tbody", null, ...rows.map((r) => instanceRow(r, rejectionRate(r, nowMs))))));
    }
    if (!out.length) out.push(el("p", { class: "empty" }, "no instances registered"));
    document.getElementById("instances").replaceChildren(...out);
  }

  // -- queues and ratio advice --------------------------------------------------------------

  function renderQueues(queues) {
    const rows = queues.map((q) =>
      el(
        "tr",
        { data: { queue: `${q.model}/${q.group ?? ""}` } },
        el("td", null, q.model),
        el("td", null, q.group ?? "any"),
        el("td", { class: "num" }, q.queued),
        el("td", { class: "num" }, q.waiting),
        el("td", { class: "num" }, q.head_ms === null ? dash : `${Math.round(q.head_ms)} ms`),
      ),
    );
    if (!rows.length) rows.push(el("tr", null, el("td", { class: "empty", colspan: 5 }, "no queues yet")));
    document.querySelector("#queues tbody").replaceChildren(...rows);
  }

  function renderRatio(ratio) {
    const rows = (ratio.groups || []).map((a) => {
      const detail = [
        `T_p ${ms(a.t_prefill_s)} ms (prefill batch), T_d ${ms(a.t_decode_s)} ms (decode per request)`,
        `KV transfer ξ ${ms(a.xi_s)} ms, ${num(a.tokens)} tokens, TPOT ${ms(a.tpot_s)} ms`,
        `slots b_p ${num(a.prefill_slots, 1)}, b_d ${num(a.decode_slots, 1)}`,
        `capacity P ${num(a.prefill_capacity_rps, 2)} req/s, D ${num(a.decode_capacity_rps, 2)} req/s`,
        `${a.samples} samples`,
      ].join("\n");
      const bottleneck =
        a.bottleneck === "insufficient_data" ? `insufficient data (${a.samples} samples)` : a.bottleneck;
      const cls = a.bottleneck === "prefill" || a.bottleneck === "decode" ? `${a.bottleneck}-bn` : a.bottleneck;
      return el(
        "tr",
        { data: { group: a.group }, title: detail },
        el("td", null, a.group),
        el("td", { class: "num" }, `${a.prefills}:${a.decodes}`),
        el("td", { class: "num", title: `now ${amount(a.current_ratio)}` }, amount(a.ratio)),
        el("td", { class: "num" }, `${amount(a.desired_prefills)} / ${amount(a.desired_decodes)}`),
        el("td", { data: { field: "bottleneck" } }, el("span", { class: `badge ${cls}` }, bottleneck)),
        el("td", { class: "num" }, `${num(a.demand_rps, 2)} req/s`),
      );
    });
    if (!rows.length) rows.push(el("tr", null, el("td", { class: "empty", colspan: 6 }, "no groups yet")));
    document.querySelector("#ratio tbody").replaceChildren(...rows);
    document.getElementById("ratio-note").textContent = ratio.note || "";
  }

  // -- charts (inline SVG) ------------------------------------------------------------------

  function niceCeil(v) {
    if (!(v > 0)) return 1;
    const step = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= v) return m * step;
    return 10 * step;
  }

  // lines: [{cls, color, points: [[t, value|null], ...]}]; null breaks a line.
  function drawChart(id, lines, { yMax, format }) {
    const W = 400, H = 118, L = 36, R = 6, T = 6, B = 16;
    const end = serverNow(), start = end - CHART_WINDOW_S;
    const values = lines.flatMap((l) => l.points.map((p) => p[1]).filter((v) => v !== null));
    const top = yMax ?? niceCeil(Math.max(0, ...values) * 1.1);
    const x = (t) => L + ((t - start) / (end - start)) * (W - L - R);
    const y = (v) => T + (1 - Math.min(v, top) / top) * (H - T - B);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    for (const frac of [0, 0.5, 1]) {
      const v = top * frac;
      root.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: y(v), y2: y(v) }));
      const label = svg("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end" });
      label.textContent = format(v);
      root.append(label);
    }
    // A tick a minute, labelled by how long ago.
    for (let ago = CHART_WINDOW_S; ago >= 0; ago -= 60) {
      const t = end - ago;
      if (ago > 0 && ago < CHART_WINDOW_S) root.append(svg("line", { class: "tick", x1: x(t), x2: x(t), y1: T, y2: H - B }));
      const anchor = ago === CHART_WINDOW_S ? "start" : ago === 0 ? "end" : "middle";
      const label = svg("text", { x: x(t), y: H - 3, "text-anchor": anchor });
      label.textContent = ago ? `−${ago / 60} min` : "now";
      root.append(label);
    }
    let drawn = 0;
    for (const line of lines) {
      let run = [];
      const flush = () => {
        if (run.length === 1) {
          root.append(svg("circle", { cx: run[0][0], cy: run[0][1], r: 2, fill: line.color, class: line.cls }));
        } else if (run.length > 1) {
          root.append(svg("polyline", { points: run.map((p) => p.join(",")).join(" "), fill: "none", stroke: line.color, "stroke-width": 1.6, "stroke-linejoin": "round", class: line.cls }));
        }
        drawn += run.length;
        run = [];
      };
      for (const [t, v] of line.points) {
        if (t < start) continue;
        if (v === null) flush();
        else run.push([x(t).toFixed(1), y(v).toFixed(1)]);
      }
      flush();
    }
    if (!drawn) {
      const label = svg("text", { x: (L + W - R) / 2, y: H / 2, "text-anchor": "middle", class: "empty" });
      label.textContent = `no requests in the last ${CHART_WINDOW_S / 60} minutes`;
      root.append(label);
    }
    const box = document.getElementById(id);
    box.dataset.points = String(drawn);
    box.replaceChildren(root);
  }

  function renderCharts(series) {
    const bs = series.bucket_s;
    const byStart = new Map((series.buckets || []).map((b) => [b.t, b]));
    // Every bucket of the window, so an idle stretch reads as 0 requests (and a gap in TTFT)
    // instead of a line drawn straight across it.
    const end = serverNow();
    const grid = [];
    for (let t = Math.floor((end - CHART_WINDOW_S) / bs) * bs; t <= end; t += bs) grid.push(t);
    const at = (f) => grid.map((t) => [t + bs / 2, byStart.has(t) ? f(byStart.get(t)) : null]);
    const blue = "#2f6fdf", orange = "#e07b19";
    drawChart(
      "chart-ttft",
      [
        { cls: "p50", color: blue, points: at((b) => (b.ttft_p50 === null ? null : b.ttft_p50 * 1000)) },
        { cls: "p95", color: orange, points: at((b) => (b.ttft_p95 === null ? null : b.ttft_p95 * 1000)) },
      ],
      { format: (v) => `${Math.round(v)}` },
    );
    drawChart("chart-success", [{ cls: "ok", color: blue, points: at((b) => b.success) }], {
      yMax: 1,
      format: (v) => `${Math.round(v * 100)}%`,
    });
    const zero = (f) => grid.map((t) => [t + bs / 2, byStart.has(t) ? f(byStart.get(t)) : 0]);
    drawChart(
      "chart-requests",
      [
        { cls: "req", color: blue, points: zero((b) => b.requests) },
        { cls: "rej", color: orange, points: zero((b) => b.rejections) },
      ],
      { format: (v) => (v >= 10 ? `${Math.round(v)}` : `${Number(v.toFixed(1))}`) },
    );
  }

  // -- the loop -----------------------------------------------------------------------------

  async function poll() {
    const names = Object.keys(SOURCES);
    const results = await Promise.all(names.map((n) => getJSON(SOURCES[n])));
    const data = Object.fromEntries(names.map((n, i) => [n, results[i]]));
    const instances = data.instances.instances || [];
    const queues = data.queues.queues || [];
    renderHeader(data.health);
    renderSummary(instances, queues, data.series);
    renderInstances(instances);
    renderQueues(queues);
    renderRatio(data.ratio);
    renderCharts(data.series);
  }

  async function tick() {
    if (document.hidden) {
      setTimeout(tick, HIDDEN_POLL_MS);
      return;
    }
    try {
      await poll();
      setStatus("live", `live · ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      // Keep the last picture on screen and say why it is stale.
      let why = err && err.name === "AbortError" ? "the gateway did not answer in time" : String((err && err.message) || err);
      if (err instanceof HttpError && (err.status === 401 || err.status === 403)) {
        why = "the admin token was refused: reload the page to sign in again";
      }
      setStatus("error", `stale · ${why}`);
    }
    setTimeout(tick, POLL_MS);
  }

  tick();
})();
