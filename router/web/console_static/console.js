// The sluicegate console: reads <prefix>/api/live every `refresh` seconds and /admin/usage every
// 30 s, and acts through the admin API with the token kept in this tab's session storage.
// Plain DOM, no library, no inline script (the page's Content-Security-Policy forbids it).
"use strict";

(function () {
  const PREFIX = document.body.dataset.prefix;
  const TOKEN_KEY = "sluicegate.console.token";
  const USAGE_EVERY = 30000;
  const $ = (id) => document.getElementById(id);
  const rows = new Map(); // backend name -> {tr, cells, ...}
  let actions = false; // the router has an admin token and ours was accepted
  let refresh = 1000;
  let lastUsage = 0;

  const token = () => sessionStorage.getItem(TOKEN_KEY);
  function headers(json) {
    const h = {};
    const t = token();
    if (t) h.authorization = "Bearer " + t;
    if (json) h["content-type"] = "application/json";
    return h;
  }
  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function num(v, digits) {
    if (v === null || v === undefined) return "–";
    return digits === undefined ? String(v) : Number(v).toFixed(digits);
  }
  function age(now, then) {
    if (!then) return "never";
    const s = Math.max(0, now - then);
    return s < 10 ? s.toFixed(1) + " s" : s < 600 ? Math.round(s) + " s" : Math.round(s / 60) + " min";
  }
  function ms(seconds) {
    return seconds === null || seconds === undefined ? "–" : Math.round(seconds * 1000) + " ms";
  }
  function notice(text, kind) {
    const n = $("notice");
    n.hidden = !text;
    n.textContent = text || "";
    n.className = "notice " + (kind || "");
  }
  async function errorText(r) {
    try {
      const body = await r.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (e) { /* not JSON */ }
    return "HTTP " + r.status;
  }

  // -- the admin API -------------------------------------------------------------------------

  async function admin(method, path, body) {
    const r = await fetch("/admin/backends" + path, {
      method, headers: headers(body !== undefined), cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!r.ok) throw new Error(await errorText(r));
    return r.json();
  }
  async function act(row, what, call) {
    row.err.textContent = what + "…";
    try {
      await call();
      row.err.textContent = "";
      poll();
    } catch (e) {
      row.err.textContent = e.message;
    }
  }

  // -- the fleet table -----------------------------------------------------------------------

  const COLS = ["backend", "health", "draining", "in_flight", "waiting", "running", "kv_usage",
    "kv_blocks", "adapters", "scraped", "kv_event", "rps", "ttft", "weight"];

  function makeRow(name) {
    const tr = el("tr", { "data-backend": name });
    const cells = {};
    for (const c of COLS) {
      cells[c] = el("td", { "data-col": c });
      tr.appendChild(cells[c]);
    }
    const actCell = el("td", { "data-col": "actions", class: "act" });
    tr.appendChild(actCell);
    const row = { tr, cells, actCell, err: el("span", { class: "err" }), built: false, draining: false };
    return row;
  }

  function buildActions(row, name) {
    const drain = el("button", { type: "button", "data-action": "drain" });
    drain.addEventListener("click", () => act(row, row.draining ? "undraining" : "draining",
      () => admin("PATCH", "/" + encodeURIComponent(name), { draining: !row.draining })));
    const weight = el("input", { type: "number", step: "any", min: "0", "data-action": "weight-value", class: "weight" });
    const setWeight = el("button", { type: "button", "data-action": "weight" }, "set weight");
    setWeight.addEventListener("click", () => act(row, "setting weight",
      () => admin("PATCH", "/" + encodeURIComponent(name), { weight: Number(weight.value) })));
    const remove = el("button", { type: "button", "data-action": "remove", class: "danger" }, "remove");
    let armed = 0;
    remove.addEventListener("click", () => {
      if (Date.now() - armed > 3000) { // a second click within 3 s removes
        armed = Date.now();
        remove.textContent = "confirm remove";
        setTimeout(() => { remove.textContent = "remove"; }, 3000);
        return;
      }
      act(row, "draining and removing", () => admin("DELETE", "/" + encodeURIComponent(name)));
    });
    row.actCell.replaceChildren(drain, weight, setWeight, remove, row.err);
    row.drainButton = drain;
    row.weightInput = weight;
    row.built = true;
  }

  function renderFleet(data) {
    const tbody = $("fleet").querySelector("tbody");
    const seen = new Set();
    const routing = data.routing.backends;
    for (const b of data.backends) {
      seen.add(b.name);
      let row = rows.get(b.name);
      if (!row) {
        row = makeRow(b.name);
        rows.set(b.name, row);
      }
      tbody.appendChild(row.tr); // keeps the server's order
      const c = row.cells;
      c.backend.replaceChildren(el("b", {}, b.name), el("br"),
        el("span", { class: "muted" }, b.kind + " · " + b.url + " · " + b.models.join(", ")));
      c.health.textContent = b.healthy ? "healthy" : "unhealthy";
      c.health.title = b.reason || "";
      c.health.className = b.healthy ? "ok" : "bad";
      if (!b.healthy && b.reason) c.health.appendChild(el("div", { class: "reason" }, b.reason));
      c.draining.textContent = b.draining ? "draining" : "–";
      c.draining.className = b.draining ? "warn" : "";
      c.in_flight.textContent = num(b.in_flight) + (b.max_inflight ? " / " + b.max_inflight : "");
      c.waiting.textContent = num(b.waiting);
      c.running.textContent = num(b.running);
      c.kv_usage.textContent = b.kv_usage === null || b.kv_usage === undefined ? "–" : Math.round(b.kv_usage * 100) + " %";
      c.kv_blocks.textContent = b.kv_state ? num(b.kv_blocks) + " (" + b.kv_state + ")" : "–";
      c.adapters.textContent = b.adapters.length ? b.adapters.join(", ") : "–";
      c.scraped.textContent = b.scraped_at ? age(data.now, b.scraped_at) + (b.engine_stale ? " (stale)" : "") : "–";
      c.kv_event.textContent = b.kv_state ? age(data.now, b.kv_last_event) : "–";
      const r = routing[b.name];
      c.rps.textContent = r ? num(r.rps, 2) : "0";
      c.ttft.textContent = r && r.ttft_p50 !== null ? ms(r.ttft_p50) + " / " + ms(r.ttft_p99) : "–";
      c.weight.textContent = num(b.weight);
      row.draining = b.draining;
      if (actions) {
        if (!row.built) buildActions(row, b.name);
        row.drainButton.textContent = b.draining ? "undrain" : "drain";
        if (document.activeElement !== row.weightInput) row.weightInput.value = b.weight;
      } else if (row.built) {
        row.actCell.replaceChildren();
        row.built = false;
      }
    }
    for (const [name, row] of rows) {
      if (!seen.has(name)) {
        row.tr.remove();
        rows.delete(name);
      }
    }
    const more = data.backends_total - data.backends.length;
    $("fleet-count").textContent = data.backends_total + " backends" + (more > 0 ? " (" + more + " not listed)" : "");
    for (const th of document.querySelectorAll("#fleet .act")) th.hidden = !actions;
  }

  function fill(tableId, items, cells, empty) {
    const tbody = $(tableId).querySelector("tbody");
    const trs = items.map((item) => {
      const tr = el("tr");
      for (const v of cells(item)) tr.appendChild(v instanceof Node ? (() => { const td = el("td"); td.appendChild(v); return td; })() : el("td", {}, v));
      return tr;
    });
    if (!trs.length) {
      const tr = el("tr");
      tr.appendChild(el("td", { colspan: "9", class: "muted" }, empty));
      trs.push(tr);
    }
    tbody.replaceChildren(...trs);
  }

  function headroom(used, limit) {
    if (!limit) return "no limit (" + used + ")";
    return used + " / " + limit + " (" + Math.max(0, limit - used) + " left)";
  }

  function spark(id, values, unit) {
    const svg = $(id);
    const pts = values.map((v, i) => [i, v]).filter((p) => p[1] !== null);
    const max = Math.max(1e-9, ...pts.map((p) => p[1]));
    const w = 240 / Math.max(1, values.length - 1);
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", pts.map((p) => (p[0] * w).toFixed(1) + "," + (38 - (p[1] / max) * 36).toFixed(1)).join(" "));
    svg.replaceChildren(line);
    const last = pts.length ? pts[pts.length - 1][1] : null;
    $(id + "-now").textContent = last === null ? "–" : unit === "ms" ? ms(last) : String(last);
  }

  function render(data) {
    actions = data.actions && !!token();
    $("register-section").hidden = !actions;
    $("forget").hidden = !token();
    $("token-form").hidden = !data.actions || !!token();
    if (!data.actions) {
      notice("Read-only: this router has no admin token configured (SLUICEGATE_ADMIN_TOKEN), so the console shows the fleet but cannot change it.", "info");
    } else {
      notice("");
    }
    refresh = Math.max(500, data.refresh * 1000);
    renderFleet(data);
    fill("reasons", Object.entries(data.routing.reasons), ([k, v]) => [k, num(v, 2)], "no decisions in the last minute");
    fill("fallbacks", data.fallbacks || [], (f) => [f.model, f.kind, f.to.join(" → "), f.mid_stream || "–"], "no fallback chains configured");
    const bands = data.admission;
    fill("admission", bands ? Object.entries(bands) : [], ([k, v]) => [k, String(v.depth), v.depth ? v.oldest_wait.toFixed(1) + " s" : "–"],
      bands ? "" : "admission queue off (admission: not configured)");
    $("quota-scope").textContent = data.quotas.scope === "local" ? "this process" : "this process's share of the shared count";
    fill("quotas", data.quotas.keys, (q) => [q.key, headroom(q.rpm_used, q.rpm), headroom(q.tpm_used, q.tpm), headroom(q.parallel, q.max_parallel)],
      "no key has limits");
    fill("batch", data.batch || [], (j) => [j.id, j.model, j.status, j.completed + j.failed + " / " + j.total, String(j.failed)],
      data.batch ? "no batch job running" : "Batch API off (batch: not configured)");
    const s = data.routing.series;
    spark("spark-throughput", s.throughput, "");
    spark("spark-ttft", s.ttft_p50, "ms");
    spark("spark-queue", s.queue, "");
    $("status").textContent = "live · worker " + data.worker + " · " + new Date(data.now * 1000).toLocaleTimeString();
    $("status").className = "ok";
    $("footer").textContent = "One worker's view: each worker keeps its own health, engine readings and routing history. In flight and usage are shared when Redis is configured.";
  }

  async function loadUsage() {
    lastUsage = Date.now();
    const since = Math.floor(Date.now() / 1000) - 6 * 3600;
    const r = await fetch("/admin/usage?since=" + since, { headers: headers(false), cache: "no-store" });
    if (!r.ok) return;
    const data = (await r.json()).data;
    const by = new Map();
    for (const row of data) {
      const k = row.key + "\u0000" + row.model;
      let agg = by.get(k);
      if (!agg) by.set(k, agg = { key: row.key, model: row.model, requests: 0, prompt: 0, completion: 0, cached: 0, hours: [] });
      agg.requests += row.requests;
      agg.prompt += row.prompt_tokens;
      agg.completion += row.completion_tokens;
      agg.cached += row.cached_tokens;
      agg.hours.push(row.prompt_tokens + row.completion_tokens);
    }
    fill("usage", [...by.values()], (u) => {
      const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
      svg.setAttribute("viewBox", "0 0 60 16");
      svg.setAttribute("class", "mini");
      const max = Math.max(1, ...u.hours);
      u.hours.forEach((v, i) => {
        const bar = document.createElementNS("http://www.w3.org/2000/svg", "rect");
        const h = Math.max(1, (v / max) * 16);
        bar.setAttribute("x", String(i * 10));
        bar.setAttribute("y", String(16 - h));
        bar.setAttribute("width", "8");
        bar.setAttribute("height", String(h));
        svg.appendChild(bar);
      });
      return [u.key, u.model, String(u.requests), String(u.prompt), String(u.completion), String(u.cached), svg];
    }, "no usage recorded in the last 6 hours");
  }

  let timer = null;
  let generation = 0; // a poll started by an action supersedes the scheduled one
  async function poll() {
    clearTimeout(timer);
    const mine = ++generation;
    try {
      const r = await fetch(PREFIX + "/api/live", { headers: headers(false), cache: "no-store" });
      if (r.status === 401) {
        const message = await errorText(r);
        if (token()) {
          sessionStorage.removeItem(TOKEN_KEY);
          notice("The admin token was refused: " + message, "bad");
        } else {
          notice("This router has an admin token: enter it to see the fleet and act on it.", "info");
        }
        actions = false;
        $("token-form").hidden = false;
        $("forget").hidden = true;
        $("status").textContent = "waiting for the admin token";
      } else if (!r.ok) {
        $("status").textContent = "live view: " + (await errorText(r));
        $("status").className = "bad";
      } else {
        render(await r.json());
        if (Date.now() - lastUsage > USAGE_EVERY) loadUsage().catch(() => {});
      }
    } catch (e) {
      $("status").textContent = "router unreachable (" + e.message + ")";
      $("status").className = "bad";
    }
    // A tab in the background reads every 10 s at most; it catches up when shown again.
    if (mine === generation) timer = setTimeout(poll, document.hidden ? Math.max(refresh, 10000) : refresh);
  }
  document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });

  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const v = $("token").value.trim();
    $("token").value = "";
    if (v) sessionStorage.setItem(TOKEN_KEY, v);
    lastUsage = 0;
    poll();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    poll();
  });

  function parseModels(text) {
    const out = {};
    for (const part of text.split(",")) {
      const p = part.trim();
      if (!p) continue;
      const [pub, served] = p.split("=").map((x) => x.trim());
      out[pub] = served || pub;
    }
    return out;
  }
  $("register").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.target.elements;
    const body = { name: f.name.value.trim(), url: f.url.value.trim(), kind: f.kind.value, models: parseModels(f.models.value) };
    if (f.weight.value !== "") body.weight = Number(f.weight.value);
    if (f.max_inflight.value !== "") body.max_inflight = Number(f.max_inflight.value);
    const out = $("register-result");
    out.textContent = "registering…";
    try {
      const b = await admin("POST", "", body);
      out.textContent = "registered " + b.name;
      out.className = "ok";
      ev.target.reset();
      poll();
    } catch (e) {
      out.textContent = e.message;
      out.className = "err";
    }
  });

  poll();
})();
