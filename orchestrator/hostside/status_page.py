"""The status page (issue #60): the deployment at a glance in a browser, served by the head's supervisor.

It runs in the head's supervisor process (orchestrator/hostside/supervisor.py starts it, `start(sup)`),
as a thread with a listening socket of its own: on the API's address (`api_listen`, the head's management
address by default) and `supervise.page_port` (default supervise.port + 100), admitted by the
deployment's firewall chain like the API (`api_allow`). docs/status-page.md says why there.

What it shows comes from two places, each with the time it was true ("at"):
- what the supervisor knows now, read from its memory, never waiting on Docker (`views(cached=True)`,
  as its /metrics): its state, each rank's container (exit status and signal when stopped), each host's
  agent report age (a host whose agent is silent is shown as not answering, never healthy), MemAvailable
  and NVMe free, the probes, the incidents (incidents/*.json) and the release history on the head;
  the engine's requests in flight (its /metrics) and the router's /health, asked at most every few seconds;
- what only the controller knows, pushed by it into `<state>/page/` when it has it (launch/status_page.py:
  `up` the plan's memory budget and NVMe need per node, the fabric matrix, the inventory's deployments
  and router; `bench` the last result and its plot), each file written atomically with its own "at".

Routes: GET / (the page; without the key: the login form, status 401, no fact), GET /app.js, /style.css
(every asset is served here: no CDN), GET /api/state (the JSON the page polls), GET /bench.png, POST
/login (the key once, from the form: an HttpOnly cookie), GET /?key=K (the same, then a redirect that
drops it from the address bar), GET /logout. With a key on the deployment (the API's, the `api_key`
file beside the supervisor's config) every route but the login form and the stylesheet needs
`Authorization: Bearer <key>` or the cookie, which is an HMAC of the key (never the key; a changed key
voids it). Nothing is logged per request, so a key in a URL never reaches a log. Standard library only.
"""
from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import os
import pkgutil
import socket
import threading
import time
import urllib.parse
from typing import Any, Callable

from . import metrics
from .httpcall import call

COOKIE = "deployctl_page"
SNAPSHOT_TTL_S = 0.5        # one snapshot serves every browser asking within this
IN_FLIGHT_TTL_S = 2.0       # the engine's /metrics asked at most this often
ROUTER_TTL_S = 5.0
INCIDENTS_SHOWN = 20
RELEASES_SHOWN = 10
FACTS = ("plan", "fabric", "inventory", "bench")      # the controller's files in <state>/page/
ASSETS = {"/app.js": ("app.js", "text/javascript; charset=utf-8"),
          "/style.css": ("style.css", "text/css; charset=utf-8")}
HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY",
           "Content-Security-Policy": "default-src 'self'; img-src 'self'; frame-ancestors 'none'; form-action 'self'"}


def asset(name: str) -> bytes:
    """A file of orchestrator/hostside/page/ (from the source tree or the zipapp alike)."""
    data = pkgutil.get_data("orchestrator.hostside", f"page/{name}")
    if data is None:
        raise FileNotFoundError(name)
    return data


def cookie_value(key: str, deployment: str) -> str:
    """What the login cookie holds: not the key, a digest only the key's holder can make."""
    return hmac.new(key.encode(), f"deployctl status page {deployment}".encode(), hashlib.sha256).hexdigest()


def authorized(key: str | None, deployment: str, headers: Any) -> bool:
    """The bearer key or the login cookie; everyone when the deployment has no key (like its API)."""
    if not key:
        return True
    auth = headers.get("Authorization", "") or ""
    if auth.startswith("Bearer ") and hmac.compare_digest(auth[7:].strip().encode(), key.encode()):
        return True
    want = cookie_value(key, deployment)
    for part in (headers.get("Cookie", "") or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and hmac.compare_digest(value.encode(), want.encode()):
            return True
    return False


def _json_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


class Cached:
    """A value recomputed at most every TTL seconds (one computation at a time)."""

    def __init__(self, ttl: float, make: Callable[[], Any]):
        self.ttl, self.make, self.lock = ttl, make, threading.Lock()
        self.at, self.value = 0.0, None

    def get(self) -> Any:
        with self.lock:
            if time.monotonic() - self.at >= self.ttl:
                self.value, self.at = self.make(), time.monotonic()
            return self.value


class Page:
    """What the page shows, built from the supervisor SUP (duck-typed: cfg, dir, key, mask, state, detail,
    probes, restarts, restarts_total, views(cached=True), history(), fabric())."""

    def __init__(self, sup: Any, exit_text: Callable[[dict[str, Any]], str] = lambda c: str(c.get("status"))):
        self.sup, self.cfg, self.exit_text = sup, sup.cfg, exit_text
        self.page_dir = os.path.join(sup.dir, "page")
        self.snapshot = Cached(SNAPSHOT_TTL_S, self.build)
        self.in_flight = Cached(IN_FLIGHT_TTL_S, self._in_flight)
        self.router = Cached(ROUTER_TTL_S, self._router)

    # -- facts --------------------------------------------------------------------------------
    def _in_flight(self) -> dict[str, Any]:
        at = time.time()
        try:
            code, body = call(self.cfg["api"]["url"] + "/metrics", None, None, 2.0)
        except (OSError, ValueError) as e:
            return {"at": at, "error": f"{type(e).__name__}"}
        if code != 200:
            return {"at": at, "error": f"HTTP {code}"}
        return {"at": at, **(metrics.in_flight(body.decode(errors="replace")) or {"error": "not reported"})}

    def _router(self) -> dict[str, Any] | None:
        inv = _json_file(os.path.join(self.page_dir, "inventory.json")) or {}
        r = inv.get("router") if isinstance(inv, dict) else None
        if not isinstance(r, dict) or not r.get("url"):
            return None
        at = time.time()
        try:
            code, _ = call(str(r["url"]).rstrip("/") + "/health", None, None, 2.0)
            return {"at": at, "healthy": code == 200, "detail": f"HTTP {code}"}
        except (OSError, ValueError) as e:
            return {"at": at, "healthy": False, "detail": f"no answer ({type(e).__name__})"}

    def ranks(self, now: float) -> list[dict[str, Any]]:
        sup, cfg = self.sup, self.cfg
        views = sup.views(cached=True)
        rank_of = cfg.get("ranks") or {}
        silent = float(cfg.get("silent_s") or 15)
        out = []
        for host in [cfg["host"], *cfg.get("workers", [])]:
            r = views.get(host)
            row: dict[str, Any] = {"host": host, "rank": rank_of.get(host), "role": "head" if host == cfg["host"] else "worker"}
            if r is None:
                row.update(answering=False, why="its agent has not reported since the supervisor started")
                out.append(row)
                continue
            c = r.container or {}
            row.update(answering=r.age_s <= silent, report_at=now - r.age_s,
                       why="" if r.age_s <= silent else f"its agent has not reported for {r.age_s:.0f}s",
                       container=c.get("name", ""), status=c.get("status", "none") if c else "none",
                       running=r.running, exit=self.exit_text(c) if c and not r.running else "",
                       started_at=c.get("started_at", ""), finished_at=c.get("finished_at", ""),
                       image=(c.get("image") or "")[:19], mem_available_bytes=None if r.mem_kib is None else r.mem_kib * 1024,
                       disk_avail_bytes=r.disk_avail, log_tail=list(r.log_tail)[-15:] if not r.running else [])
            out.append(row)
        return out

    def incidents(self) -> list[dict[str, Any]]:
        d = os.path.join(self.sup.dir, "incidents")
        try:
            names = sorted((n for n in os.listdir(d) if n.endswith(".json")), reverse=True)[:INCIDENTS_SHOWN]
        except OSError:
            return []
        out = []
        for n in names:
            inc = _json_file(os.path.join(d, n))
            if isinstance(inc, dict):
                keep = ("id", "time", "time_text", "kind", "summary", "outcome", "recovery_s", "evidence",
                        "actions", "mem_available_gib", "release")
                x = {k: inc.get(k) for k in keep}
                x["ranks"] = {h: {"exit": v.get("exit"), "log_tail": (v.get("log_tail") or [])[-30:],
                                  "report_age_s": v.get("report_age_s")}
                              for h, v in (inc.get("ranks") or {}).items() if isinstance(v, dict)}
                out.append(x)
        return out

    def releases(self) -> dict[str, Any]:
        hist = self.sup.history()
        rows = [{k: r.get(k) for k in ("number", "time", "image", "image_id", "command", "rollback_of", "recipe",
                                        "overrides", "checkpoint")} for r in hist]
        cur = rows[-1] if rows else None
        back = rows[-2] if len(rows) > 1 else None
        return {"current": cur, "rollback_would_restore": back, "history": list(reversed(rows))[:RELEASES_SHOWN],
                "count": len(rows)}

    def controller(self) -> dict[str, Any]:
        out = {}
        for name in FACTS:
            doc = _json_file(os.path.join(self.page_dir, f"{name}.json"))
            if isinstance(doc, dict):
                out[name] = doc
        if "bench" in out:
            out["bench"]["plot"] = os.path.exists(os.path.join(self.page_dir, "bench.png"))
        return out

    def verdict(self, ranks: list[dict[str, Any]], probes: dict[str, Any], now: float) -> tuple[str, list[str]]:
        """healthy only when every host answers, every rank runs, the last /health passed recently and the
        supervisor watches; else what is wrong, worst first."""
        sup, cfg = self.sup, self.cfg
        why: list[str] = []
        silent = [r["host"] for r in ranks if not r.get("answering")]
        down = [r for r in ranks if r.get("answering") and not r.get("running")]
        for r in down:
            why.append(f"{r['host']} (rank {r.get('rank')}): {r.get('exit') or r.get('status')}")
        for h in silent:
            why.append(f"{h}: no answer ({next(r['why'] for r in ranks if r['host'] == h)})")
        h = probes.get("health")
        fresh = max(3 * float(cfg.get("interval_s") or 2), 10.0) + float(cfg["api"].get("health_timeout_s") or 10)
        if h is None:
            why.append("/health not probed yet")
        elif not h["ok"]:
            why.append(f"/health failed {now - h['at']:.0f}s ago")
        elif now - h["at"] > fresh:
            why.append(f"/health last probed {now - h['at']:.0f}s ago")
        if sup.state != "watching":
            why.append(f"supervisor {sup.state}" + (f": {sup.mask(sup.detail)}" if sup.detail else ""))
        if not why:
            return "healthy", []
        if down or (h is not None and not h["ok"]) or sup.state == "failed":
            return ("recovering" if sup.state == "recovering" else "down"), why
        return ("unknown" if silent else "degraded"), why

    def build(self) -> bytes:
        sup, cfg = self.sup, self.cfg
        now = time.time()
        ranks = self.ranks(now)
        probes = {n: {"ok": bool(ok), "at": t} for n, (ok, t) in dict(sup.probes).items()}
        verdict, why = self.verdict(ranks, probes, now)
        recent = [t for t in sup.restarts if now - t < cfg.get("window_s", 900)]
        doc = {"now": now, "deployment": cfg["deployment"], "install": cfg.get("install"), "head": cfg["host"],
               "model": cfg["api"].get("served_name"), "api_url": cfg["api"]["url"],
               "key_required": bool(sup.key), "verdict": verdict, "why": why,
               "supervisor": {"state": sup.state, "detail": sup.detail, "restarts_total": sup.restarts_total,
                              "restarts_in_window": len(recent), "max_restarts": cfg.get("max_restarts"),
                              "window_s": cfg.get("window_s"), "interval_s": cfg.get("interval_s"),
                              "silent_s": cfg.get("silent_s")},
               "probes": probes, "ranks": ranks, "in_flight": self.in_flight.get(),
               "router": self.router.get(), "incidents": self.incidents(), "releases": self.releases(),
               "controller": self.controller(), "page": cfg.get("page") or {}}
        return sup.mask(json.dumps(doc, default=str)).encode()


# ------------------------------------------------------------------------------------------ HTTP

def handler(page: Page) -> type[http.server.BaseHTTPRequestHandler]:
    sup, dep = page.sup, page.cfg["deployment"]

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "deployctl-status-page"
        sys_version = ""

        def log_message(self, fmt: str, *args: Any) -> None:     # nothing per request: ?key= never logged
            pass

        def send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in {**HEADERS, "Content-Type": ctype, "Content-Length": str(len(body)), **(extra or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def login_page(self, code: int, note: str = "") -> None:
            body = asset("login.html").replace(b"{{deployment}}", _html(dep).encode()) \
                                      .replace(b"{{note}}", _html(note).encode())
            self.send(code, body, "text/html; charset=utf-8")

        def let_in(self) -> None:
            c = f"{COOKIE}={cookie_value(sup.key, dep)}; HttpOnly; SameSite=Strict; Path=/"
            self.send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": c})

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            path = url.path
            if path == "/style.css":            # the login form's too; no fact in it
                self.send(200, asset("style.css"), ASSETS[path][1])
                return
            ok = authorized(sup.key, dep, self.headers)
            if path == "/" and not ok and sup.key:
                given = urllib.parse.parse_qs(url.query).get("key", [""])[0]
                if given and hmac.compare_digest(given.encode(), sup.key.encode()):
                    self.let_in()
                    return
                self.login_page(401, "wrong key" if given else "")
                return
            if not ok:
                self.send(401, b'{"error": "Unauthorized"}', "application/json",
                          {"WWW-Authenticate": 'Bearer realm="deployctl status page"'})
                return
            if path == "/":
                body = asset("index.html").replace(b"{{deployment}}", _html(dep).encode())
                self.send(200, body, "text/html; charset=utf-8")
            elif path in ASSETS:
                name, ctype = ASSETS[path]
                self.send(200, asset(name), ctype)
            elif path == "/api/state":
                self.send(200, page.snapshot.get(), "application/json")
            elif path == "/bench.png":
                try:
                    with open(os.path.join(page.page_dir, "bench.png"), "rb") as fh:
                        self.send(200, fh.read(), "image/png", {"Cache-Control": "private, max-age=86400"})
                except OSError:
                    self.send(404, b"no bench plot pushed yet", "text/plain")
            elif path == "/logout":
                self.send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": f"{COOKIE}=; Max-Age=0; Path=/"})
            else:
                self.send(404, b"not found", "text/plain")

        def do_POST(self) -> None:
            if urllib.parse.urlsplit(self.path).path != "/login":
                self.send(404, b"not found", "text/plain")
                return
            try:
                n = min(int(self.headers.get("Content-Length") or 0), 4096)
            except ValueError:
                n = 0
            form = urllib.parse.parse_qs(self.rfile.read(n).decode(errors="replace"))
            given = (form.get("key") or [""])[0].strip()
            if not sup.key:
                self.send(303, b"", "text/plain", {"Location": "/"})
            elif given and hmac.compare_digest(given.encode(), sup.key.encode()):
                self.let_in()
            else:
                self.login_page(401, "wrong key")
    return Handler


def _html(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
            .replace("'", "&#39;"))


class Server6(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


def start(sup: Any, exit_text: Callable[[dict[str, Any]], str] | None = None,
          log: Callable[[str], None] = print) -> http.server.ThreadingHTTPServer | None:
    """The page's server on the config's page.listen:page.port, in a thread of its own; None when the
    config has no page or the port cannot be bound (logged: the supervisor goes on without it).
    EXIT_TEXT and LOG: the supervisor's (its wording of an exit status and signal; its log)."""
    conf = sup.cfg.get("page")
    if not conf:
        return None
    server = Server6 if ":" in str(conf["listen"]) else http.server.ThreadingHTTPServer
    try:
        srv = server((conf["listen"], int(conf["port"])), handler(Page(sup, *([exit_text] if exit_text else []))))
    except OSError as e:
        log(f"status page: cannot listen on {conf['listen']}:{conf['port']} ({e}): no status page")
        return None
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True, name="status-page").start()
    log(f"status page on {conf['listen']}:{conf['port']}" + (" (the deployment's API key required)" if sup.key else ""))
    return srv
