// deployctl status page: polls /api/state and renders it (docs/status-page.md). No library, no CDN.
// Every value goes into the page as text (textContent), never as markup.
"use strict";
(function () {
  let doc = null, fetchedAt = 0, lastOk = 0, failing = "";
  const open = new Set();                  // incidents the reader opened stay open across refreshes

  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const k of kids.flat()) if (k !== null && k !== undefined && k !== false)
      e.appendChild(typeof k === "object" ? k : document.createTextNode(String(k)));
    return e;
  }
  // seconds since T (server clock), however long ago the page fetched
  function since(t) { return doc && t ? (doc.now - t) + (Date.now() - fetchedAt) / 1000 : null; }
  function dur(s) {
    if (s === null || s === undefined || isNaN(s)) return "?";
    s = Math.max(0, s);
    if (s < 90) return Math.round(s) + " s";
    if (s < 5400) return Math.round(s / 60) + " min";
    if (s < 172800) return (s / 3600).toFixed(1) + " h";
    return Math.round(s / 86400) + " d";
  }
  function age(t, what) { const a = since(t); return el("span", {class: "age", "data-age": a === null ? "" : a.toFixed(1)}, (what ? what + " " : "") + (a === null ? "never" : dur(a) + " ago")); }
  function gib(b) { return b === null || b === undefined ? "?" : (b / 1073741824).toFixed(1) + " GiB"; }
  function gb(b) { return b === null || b === undefined ? "?" : (b / 1e9).toFixed(1) + " GB"; }
  function utc(t) { return t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "?"; }
  function table(head, rows, attrs) {
    return el("table", attrs || {}, el("thead", {}, el("tr", {}, head.map(h => el("th", {}, h)))), el("tbody", {}, rows));
  }
  function fill(id, ...kids) { const b = document.querySelector("#" + id + " .body"); b.replaceChildren(...kids.flat()); }
  function renderHeader() {
    const d = doc, stale = !!failing;
    document.body.classList.toggle("stale", stale);
    document.getElementById("model").textContent = d.model ? "serving " + d.model : "";
    const v = document.getElementById("verdict");
    const verdict = stale ? "no answer" : d.verdict;
    v.textContent = verdict;
    v.className = "verdict " + (stale ? "stale" : d.verdict);
    v.dataset.verdict = stale ? "no-answer" : d.verdict;
    const banner = document.getElementById("banner");
    banner.hidden = !stale;
    banner.textContent = stale ? "The head's supervisor (this page's server) does not answer: " + failing +
      "; last answer " + dur((Date.now() - lastOk) / 1000) + " ago. What follows is as it was then, not now." : "";
    document.getElementById("updated").textContent = "head " + d.head + ", API " + d.api_url +
      (d.key_required ? " (key required)" : " (no key: open to whoever reaches it)") + "; updated " + dur((Date.now() - lastOk) / 1000) + " ago";
    document.getElementById("why").replaceChildren(...(d.why || []).map(w => el("li", {}, w)));
  }

  function renderDeployments() {
    const inv = (doc.controller || {}).inventory;
    if (!inv) { fill("s-deployments", el("p", {class: "dim"}, "only " + doc.deployment + " (the controller has not pushed the inventory's list: deployctl up does)")); return; }
    const rows = (inv.deployments || []).map(x => el("tr", {"data-deployment": x.name},
      el("td", {}, x.name === doc.deployment ? el("b", {}, x.name + " (this page)") : x.name),
      el("td", {}, x.model || ""), el("td", {}, (x.hosts || []).join(", ")),
      el("td", {}, x.page_url ? el("a", {href: x.page_url}, x.page_url) : el("span", {class: "dim"}, "no page (not supervised)"))));
    fill("s-deployments", table(["deployment", "model", "hosts", "its status page"], rows), age(inv.at, "as the controller pushed it"));
  }

  function renderRanks() {
    const plan = ((doc.controller || {}).plan || {}), hosts = plan.hosts || {};
    const rows = doc.ranks.map(r => {
      const p = hosts[r.host] || {};
      let state;
      if (!r.answering) state = el("span", {class: "bad"}, "no answer: " + (r.why || ""));
      else if (r.running) state = el("span", {class: "ok"}, "running");
      else state = el("span", {class: "bad"}, "down: " + (r.exit || r.status));
      const mem = r.mem_available_bytes, need = p.planned_bytes, floor = p.mem_floor_bytes;
      const disk = r.disk_avail_bytes, stage = p.staging_need_bytes;
      return el("tr", {"data-host": r.host, "data-state": !r.answering ? "no-answer" : r.running ? "running" : "down"},
        el("td", {}, r.host + (r.role === "head" ? " (head)" : "")), el("td", {}, r.rank === null || r.rank === undefined ? "" : String(r.rank)),
        el("td", {class: "state"}, state, r.running === false && r.log_tail && r.log_tail.length ?
          el("details", {}, el("summary", {}, "last log lines"), el("pre", {}, r.log_tail.join("\n"))) : ""),
        el("td", {}, age(r.report_at)),
        el("td", {}, el("span", {class: floor && mem < floor ? "bad" : ""}, gib(mem)),
          floor ? el("span", {class: "dim"}, " (floor " + gib(floor) + ")") : "",
          need ? el("span", {class: "dim"}, "; the plan uses " + gb(need)) : ""),
        el("td", {}, gb(disk), stage ? el("span", {class: disk < stage ? "bad" : "dim"}, " (staging needs " + gb(stage) + ")") : ""));
    });
    fill("s-ranks", table(["host", "rank", "engine container", "agent report", "MemAvailable", "NVMe free"], rows, {id: "ranks"}),
      plan.at ? age(plan.at, "plan pushed by the controller") : el("span", {class: "dim"}, "no plan pushed yet"));
  }

  function renderServing() {
    const s = doc.supervisor, p = doc.probes || {}, f = doc.in_flight || {};
    const probe = (name, label) => {
      const x = p[name];
      return el("tr", {}, el("td", {}, label), el("td", {}, x ? el("span", {class: x.ok ? "ok" : "bad"}, x.ok ? "passed" : "failed") : "not run yet"), el("td", {}, x ? age(x.at) : ""));
    };
    const cls = {watching: "ok", recovering: "warn", paused: "warn", waiting: "warn"}[s.state] || "bad";
    fill("s-serving", table(["", "", ""], [
      el("tr", {}, el("td", {}, "supervisor"), el("td", {id: "sup-state"}, el("span", {class: cls}, s.state), s.detail ? " (" + s.detail + ")" : ""), el("td", {}, "")),
      el("tr", {}, el("td", {}, "restarts"), el("td", {}, s.restarts_in_window + " of at most " + s.max_restarts + " in " + dur(s.window_s) + " (" + s.restarts_total + " since installed)"), el("td", {}, "")),
      probe("health", "/health (every rank running)"), probe("completion", "a small completion"),
      el("tr", {}, el("td", {}, "requests in flight"), el("td", {id: "in-flight"}, f.error ? el("span", {class: "dim"}, "not read: " + f.error) : (f.running || 0) + " running, " + (f.waiting || 0) + " waiting"), el("td", {}, age(f.at))),
      el("tr", {}, el("td", {}, "release"), el("td", {}, doc.releases.current ? "release " + doc.releases.current.number + " (" + (doc.releases.current.command || "") + ")" : "none recorded"), el("td", {}, doc.releases.current ? age(doc.releases.current.time) : "")),
    ]));
  }

  function renderIncidents() {
    const items = doc.incidents || [];
    if (!items.length) { fill("s-incidents", el("p", {class: "dim"}, "none recorded")); return; }
    fill("s-incidents", items.map(i => {
      const d = el("details", {"data-id": i.id, "data-kind": i.kind, "data-outcome": i.outcome, open: open.has(i.id),
        ontoggle: e => { if (e.target.open) open.add(i.id); else open.delete(i.id); }},
        el("summary", {}, el("b", {}, utc(i.time) + " "), age(i.time), " ", el("span", {class: "warn"}, i.kind), ": ", i.summary, " -> ",
          el("span", {class: i.outcome === "recovered" || /rolled back/.test(i.outcome) ? "ok" : i.outcome === "open" ? "warn" : "bad"}, i.outcome),
          i.recovery_s !== null && i.recovery_s !== undefined ? " in " + i.recovery_s + " s" : ""),
        table(["host", "exit", "MemAvailable", "report age"], Object.entries(i.ranks || {}).map(([h, r]) =>
          el("tr", {}, el("td", {}, h), el("td", {}, r.exit || ""), el("td", {}, ((i.mem_available_gib || {})[h] ?? "?") + " GiB"), el("td", {}, (r.report_age_s ?? "?") + " s")))),
        Object.entries(i.ranks || {}).filter(([, r]) => (r.log_tail || []).length).map(([h, r]) =>
          el("div", {}, el("div", {class: "dim"}, h + ": last log lines"), el("pre", {}, r.log_tail.join("\n")))),
        (i.actions || []).length ? el("div", {}, el("div", {class: "dim"}, "what the supervisor did"),
          el("pre", {}, i.actions.map(a => "+" + a.t + "s " + a.what).join("\n"))) : "",
        i.release ? el("div", {class: "dim"}, "release then: " + (i.release.number ?? "?")) : "");
      return d;
    }));
  }

  function renderReleases() {
    const r = doc.releases;
    if (!r.count) { fill("s-releases", el("p", {class: "dim"}, "no release recorded on the head")); return; }
    const ck = c => c && (c.commit ? (c.repo || "") + "@" + c.commit.slice(0, 12) : c.dir || "") || "";
    const back = r.rollback_would_restore;
    fill("s-releases",
      el("p", {}, "deployctl rollback would restore: ", back ? el("b", {id: "rollback-to"}, "release " + back.number + ": image " + (back.image || "") +
        " (" + (back.image_id || "").slice(7, 19) + ")" + (ck(back.checkpoint) ? ", " + ck(back.checkpoint) : "")) : el("span", {class: "dim"}, "nothing (one release only)")),
      table(["#", "when", "command", "image", "checkpoint"], r.history.map(x => el("tr", {"data-release": x.number},
        el("td", {}, String(x.number) + (r.current && x.number === r.current.number ? " (current)" : "")), el("td", {}, utc(x.time), " ", age(x.time)),
        el("td", {}, x.rollback_of !== null && x.rollback_of !== undefined ? x.command + " (rollback of " + x.rollback_of + ")" : x.command || ""),
        el("td", {}, (x.image || "") + " ", el("span", {class: "dim"}, (x.image_id || "").slice(7, 19))), el("td", {}, ck(x.checkpoint))))),
      r.count > r.history.length ? el("p", {class: "dim"}, "the last " + r.history.length + " of " + r.count + " (deployctl history has all)") : "");
  }

  function renderFabric() {
    const f = (doc.controller || {}).fabric;
    if (!f) { fill("s-fabric", el("p", {class: "dim"}, "no fabric check pushed yet (deployctl up or deployctl fabric)")); return; }
    const rows = (f.links || []).map(l => el("tr", {"data-link": l.a + "-" + l.b},
      el("td", {}, l.a + " - " + l.b), el("td", {}, l.gbps === null || l.gbps === undefined ? "-" : l.gbps.toFixed(2) + " Gbit/s"),
      el("td", {}, l.mtu ? String(l.mtu) : "-"), el("td", {}, l.rtt_ms === null || l.rtt_ms === undefined ? "-" : l.rtt_ms.toFixed(2) + " ms"),
      el("td", {class: l.ok ? "ok" : "bad"}, l.ok ? "ok" : l.detail || "failed")));
    fill("s-fabric", rows.length ? table(["link", "rate (iperf3)", "path MTU", "rtt", ""], rows) : el("p", {class: "dim"}, "one host: no link"),
      el("div", {}, age(f.at, "checked"), f.topology ? el("span", {class: "dim"}, " topology " + f.topology) : ""));
  }

  function renderRouter() {
    const inv = (doc.controller || {}).inventory || {}, r = inv.router, live = doc.router;
    if (!r) { fill("s-router", el("p", {class: "dim"}, "no router in this inventory")); return; }
    fill("s-router", el("p", {}, r.url + " on " + r.host + ": ",
      live ? el("span", {class: live.healthy ? "ok" : "bad"}, live.healthy ? "answers /health" : "not answering (" + live.detail + ")") : "not asked yet", " ", live ? age(live.at) : ""),
      table(["model (the request's \"model\")", "deployment"], (r.routes || []).map(x => el("tr", {}, el("td", {}, x.model), el("td", {}, x.deployment)))),
      age(inv.at, "routes as the controller pushed them"));
  }

  let plotImg = null;           // one element per plot: a refresh does not fetch the image again
  function plot(src) {
    if (!plotImg || plotImg.getAttribute("src") !== src) plotImg = el("img", {class: "plot", src: src, alt: "TTFT and TPS against concurrency"});
    return plotImg;
  }

  function renderBench() {
    const b = (doc.controller || {}).bench;
    if (!b) { fill("s-bench", el("p", {class: "dim"}, "no bench pushed yet (deployctl bench)")); return; }
    fill("s-bench", el("div", {}, age(b.at, "run"), b.max_c !== null && b.max_c !== undefined ? " - Max C meeting the SLO: " + b.max_c : ""),
      table(["C", "TTFT ms", "TPS", "ITL ms", "errors", "SLO"], (b.levels || []).map(l => el("tr", {},
        el("td", {}, String(l.concurrency)), el("td", {}, l.ttft_ms === null ? "-" : l.ttft_ms.toFixed(1)), el("td", {}, l.tps === null ? "-" : l.tps.toFixed(1)),
        el("td", {}, l.itl_ms === null ? "-" : l.itl_ms.toFixed(1)), el("td", {}, String(l.errors)), el("td", {class: l.meets_slo ? "ok" : "bad"}, l.meets_slo ? "met" : "missed")))),
      b.plot ? plot("/bench.png?at=" + b.at) : "");
  }

  function render() {
    if (!doc) return;
    for (const f of [renderHeader, renderDeployments, renderRanks, renderServing, renderIncidents, renderReleases, renderFabric, renderRouter, renderBench]) {
      try { f(); } catch (e) { console.error(f.name, e); }
    }
    document.body.dataset.rendered = String(Date.now());
  }

  async function poll() {
    try {
      const r = await fetch("/api/state", {cache: "no-store", credentials: "same-origin"});
      if (r.status === 401) { location.reload(); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      doc = await r.json();
      fetchedAt = lastOk = Date.now();
      failing = "";
    } catch (e) {
      failing = String(e.message || e);
      if (!doc) { document.getElementById("updated").textContent = "no answer from the head's supervisor: " + failing; }
    }
    render();
    setTimeout(poll, failing || !doc || doc.verdict !== "healthy" ? 1000 : 2000);
  }
  poll();
})();
