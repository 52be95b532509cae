"""In the router's container: start the SGLang router, and keep its registry equal to the deployments
that are healthy. Standard library only (it runs from the host-side zipapp, in the router image's
python, which also holds sglang_router).

    python3 deployctl-tables-*.pyz router launch /state/config.json   # the container's command (and,
                                                                      # with a client key, the front)
    python3 deployctl-tables-*.pyz router keep /state/config.json     # started by launch, beside it
    python3 deployctl-tables-*.pyz router wait /state/config.json S   # `docker exec` by deployctl

Why a keeper beside the router (docs/router.md): sglang-router 0.3.2 in IGW mode (the mode that routes
by the request's `model`) learns its workers only through its admin API, `POST /workers {"url",
"model_id", "api_key"}`, keeps them in memory only (a restarted router starts empty), and lists a
worker's model in /v1/models until the worker is deleted, healthy or not. So every
`check_interval_s` the keeper reads the deployments deployctl wrote under /state/workers/ (one file
each: deployment, model, url, api_key), asks each engine's /health, and deletes from the router what
is not wanted or not healthy and posts what is wanted, healthy and missing. /v1/models then lists the
healthy deployments, a router restart re-registers them, and a deployment's up or down touches only
its own entry: the other workers' requests never see a change.

Checked against the released package (PyPI sglang-router 0.3.2): the arguments against
sglang_router/router_args.py (RouterArgs.add_cli_args; tests/test_router_units.py parses router_argv with
its parse_router_args), the start against sglang_router/launch_router.py (launch_router,
parse_router_args), the admin API (`POST /workers` body {url, model_id, api_key} answered 202, `GET
/workers` -> {"workers": [{id, url, model_id, is_healthy, ...}]}, `DELETE /workers/{id}`) and the admin
key format `id:name:role:key` against its README (sglang_router-0.3.2.dist-info/METADATA, "Worker
management API", "Control plane authentication") and by running it (docs/router.md).

Its client key is read from /state/api_key and handed to the router in this process
(`launch_router(parse_router_args(argv))`, sglang_router/launch_router.py), so it is in no container
argument, environment variable or process title; the admin key (/state/admin_key, made by deployctl
per install) is the keeper's only credential (`--control-plane-api-keys id:name:admin:KEY`).

With a client key the router listens on 127.0.0.1:backend_port only, and the launcher's own front
(hostside/router_front.py, a thread of this process) listens on the router's address and port:
sglang-router 0.3.2 leaves /v1/models (and its other public routes) open whatever `--api-key` says;
the front refuses every /v1/ path without the key, as vLLM does, and relays the rest.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

from .httpcall import call

WORKERS = "workers"                  # /state/workers/<deployment>.json, written by deployctl
REGISTRY = "registry.json"           # what the keeper last saw and did, for `status` and `wait`
PROBE_TIMEOUT_S = 3.0
ADMIN_ID = "deployctl"


def backend(cfg: dict, keyed: bool) -> tuple[str, int]:
    """Where the router itself listens: with a client key (KEYED) on 127.0.0.1:backend_port, behind the
    front (hostside/router_front.py) that holds the public address and port; else there itself."""
    if keyed and cfg.get("backend_port"):
        return "127.0.0.1", int(cfg["backend_port"])
    return cfg["listen"], int(cfg["port"])


def router_argv(cfg: dict, client_key: str | None, admin_key: str) -> list[str]:
    """The router's arguments (sglang_router/router_args.py RouterArgs.add_cli_args): IGW mode, one
    worker per model so round_robin (cache_aware would keep a prefix tree for nothing), the health
    checks every 2 s and out after 2 failures (its defaults, 60 s x 3, keep a dead worker ~3 min);
    with a client key, on its backend address (`backend`), the front in front of it."""
    host, port = backend(cfg, bool(client_key))
    argv = ["--host", host, "--port", str(port), "--enable-igw", "--policy", "round_robin",
            "--control-plane-api-keys", f"{ADMIN_ID}:{ADMIN_ID}:admin:{admin_key}",
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--health-check-endpoint", "/health",
            "--prometheus-host", cfg["listen"], "--prometheus-port", str(cfg["metrics_port"]),
            "--log-level", "info"]
    if client_key:
        argv += ["--api-key", client_key]
    return argv


def fingerprint(w: dict) -> str:
    """What a registration carries: a changed model name, engine key or policy is registered again."""
    pol = f"\0{w['policy']}" if w.get("policy") else ""
    return hashlib.sha256(f"{w['model']}\0{w['url']}\0{w.get('api_key') or ''}{pol}".encode()).hexdigest()[:16]


def registration(w: dict) -> dict:
    """The body of `POST /workers` for entry W. A replica's entry names its model's policy (cache_aware:
    docs/router.md, bench/replica_policy.py), which sglang-router 0.3.2 takes per model from the worker's
    labels in IGW mode; the router-wide --policy (round_robin) stays for the models served once."""
    return {"url": w["url"], "model_id": w["model"], **({"api_key": w["api_key"]} if w.get("api_key") else {}),
            **({"labels": {"policy": w["policy"]}} if w.get("policy") else {})}


def changes(want: list[dict], healthy: dict[str, bool], registered: list[dict],
            posted: dict[str, str]) -> tuple[list[str], list[dict]]:
    """(worker ids to delete, entries to post). Pure. A registered worker stays when it is wanted,
    healthy and registered as wanted (its model; its key, when this keeper posted it). One URL is one
    worker to the router (a second POST of a URL is accepted and ignored), so a URL being deleted is
    posted again on a later tick, once the router no longer lists it."""
    wanted = {w["url"]: w for w in want if healthy.get(w["url"])}
    dels = []
    for r in registered:
        w = wanted.get(r.get("url"))
        if w is None or r.get("model_id") != w["model"] or posted.get(r["url"], fingerprint(w)) != fingerprint(w):
            dels.append(r["id"])
    listed = {r.get("url") for r in registered}
    return dels, [w for u, w in wanted.items() if u not in listed]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def desired(state: str) -> list[dict]:
    d = os.path.join(state, WORKERS)
    out = []
    for n in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if n.endswith(".json"):
            try:
                with open(os.path.join(d, n)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue          # being replaced: the next tick reads it
    return out


def want_digest(want: list[dict]) -> str:
    return hashlib.sha256(json.dumps(sorted(fingerprint(w) for w in want)).encode()).hexdigest()[:16]


def _http(method: str, url: str, key: str | None, body: dict | None = None,
          timeout: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered."""
    try:
        return call(url, key, body, timeout, method)
    except (OSError, ValueError):
        return 0, b""


def _router_url(cfg: dict, keyed: bool = False) -> str:
    a, port = backend(cfg, keyed)
    a = "127.0.0.1" if a in ("0.0.0.0", "::") else a
    return f"http://{'[' + a + ']' if ':' in a else a}:{port}"


def tick(cfg: dict, state: str, admin: str, posted: dict[str, str]) -> dict:
    """One round: the registry made to match, and what was seen (written to registry.json)."""
    want = desired(state)
    healthy = {w["url"]: _http("GET", w["url"] + "/health", w.get("api_key"))[0] == 200 for w in want}
    base = _router_url(cfg, os.path.exists(os.path.join(state, "api_key")))
    code, raw = _http("GET", base + "/workers", admin)
    if code != 200:
        return {"at": time.time(), "router": f"GET /workers: {code or 'no answer'}", "digest": None}
    registered = json.loads(raw).get("workers") or []
    dels, posts = changes(want, healthy, registered, posted)
    for wid in dels:
        _http("DELETE", f"{base}/workers/{wid}", admin)
    for w in posts:
        c, _ = _http("POST", base + "/workers", admin, registration(w))
        if c in (200, 201, 202):
            posted[w["url"]] = fingerprint(w)
    code, raw = _http("GET", base + "/workers", admin)
    now = (json.loads(raw).get("workers") or []) if code == 200 else registered
    by_url = {r.get("url"): r for r in now}
    rows = [{"deployment": w.get("deployment"), "model": w["model"], "url": w["url"], "healthy": healthy[w["url"]],
             "registered": w["url"] in by_url and by_url[w["url"]].get("model_id") == w["model"]} for w in want]
    wanted_urls = {w["url"] for w in want}
    return {"at": time.time(), "router": "ok", "digest": want_digest(want), "deployments": rows,
            "strangers": sorted(u for u in by_url if u not in wanted_urls)}


def settled(doc: dict, want: list[dict]) -> bool:
    """The registry holds exactly the wanted, healthy deployments (as of the files now)."""
    if doc.get("digest") != want_digest(want) or doc.get("strangers"):
        return False
    return all(r["registered"] == r["healthy"] for r in doc.get("deployments") or [])


def _write(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def keep(cfg_path: str) -> int:
    cfg, state = _load(cfg_path)
    admin = _read(os.path.join(state, "admin_key")) or ""
    posted: dict[str, str] = {}
    while True:
        try:
            doc = tick(cfg, state, admin, posted)
            _write(os.path.join(state, REGISTRY), doc)
        except Exception as e:  # noqa: BLE001 - the keeper outlives one bad round
            print(f"router keeper: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        time.sleep(float(cfg.get("interval_s", 2.0)))


def wait(cfg_path: str, timeout_s: float) -> int:
    """Until the keeper has made the registry match the workers files as they are now (exit 0), or
    TIMEOUT_S (exit 1); prints registry.json either way."""
    cfg, state = _load(cfg_path)
    deadline = time.monotonic() + timeout_s
    doc: dict = {}
    while True:
        want = desired(state)
        try:
            with open(os.path.join(state, REGISTRY)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        # a round that began after the files were last written
        fresh = doc.get("at", 0) > max([os.stat(os.path.join(state, WORKERS)).st_mtime]
                                       if os.path.isdir(os.path.join(state, WORKERS)) else [0])
        if fresh and settled(doc, want):
            print(json.dumps(doc))
            return 0
        if time.monotonic() > deadline:
            print(json.dumps({**doc, "settled": False}))
            return 1
        time.sleep(0.3)


def _listening_fd(pid: int, port: int) -> int | None:
    """PID's listening TCP socket on PORT (IPv4 or IPv6): its fd number there, found by inode."""
    inodes = set()
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") in inodes:
                return int(name)
        except OSError:
            continue
    return None


PIDFD_GETFD = 438        # the same number on x86_64 and aarch64 (asm-generic since Linux 5.6)


@contextlib.contextmanager
def borrowed_socket(pid: int, fd: int):
    """A duplicate of process PID's socket FD (pidfd_getfd: needs ptrace rights over PID), closed
    after; PID's own stays open. OSError when the kernel refuses."""
    pidfd = os.pidfd_open(pid)
    try:
        mine = ctypes.CDLL(None, use_errno=True).syscall(PIDFD_GETFD, pidfd, fd, 0)
        if mine < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
    finally:
        os.close(pidfd)
    s = socket.socket(fileno=mine)
    try:
        yield s
    finally:
        s.close()


def nodelay(pid: int, port: int, timeout_s: float = 120.0) -> str:
    """TCP_NODELAY on the router's listening socket (in process PID, our child), once it listens;
    Linux copies it to every connection accepted after. Why: sglang-router 0.3.2 leaves Nagle's
    algorithm on for its clients' connections and writes a streamed answer's head and first chunk
    apart, so on a kept-alive connection the first chunk waits for the client's delayed ACK: +20-40 ms
    to the first token of every request but a connection's first (bench/README.md). What happened."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return "the router exited before it listened"
        fd = _listening_fd(pid, port)
        if fd is not None:
            try:
                with borrowed_socket(pid, fd) as s:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as e:
                return f"TCP_NODELAY not set: {e.strerror or e}"
            return f"TCP_NODELAY set on the router's listening socket (port {port})"
        time.sleep(0.05)
    return f"TCP_NODELAY not set: the router did not listen on {port} within {timeout_s:g}s"


def front(cfg: dict, client: str) -> str:
    """With a client key: the front (hostside/router_front.py) on the router's address and port, in a
    thread of this process, relaying to the router's backend address; the process ends (and Docker
    restarts the container) if it stops. What happened."""
    import threading
    from .router_front import serve_forever
    started = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            serve_forever(cfg["listen"], int(cfg["port"]), backend(cfg, True), client,
                          ready=lambda _server: started.set())
        except BaseException as e:  # noqa: BLE001 - said, then the container ends
            failed.append(e)
            started.set()
        print(f"router front: stopped: {failed[0] if failed else 'its loop ended'}", file=sys.stderr, flush=True)
        os._exit(1)
    threading.Thread(target=run, name="router-front", daemon=True).start()
    started.wait()
    if failed:
        return f"the key check in front of the router did not start: {failed[0]}"
    return (f"the clients' key is checked on every /v1/ path (/v1/models included) at {cfg['listen']}:{cfg['port']}; "
            f"the router listens on 127.0.0.1:{cfg['backend_port']}")


def launch(cfg_path: str) -> int:
    """The container's first process: the keeper, then the router in a child process (it holds the
    GIL in its own process for good), the front (with a client key), TCP_NODELAY on the router's
    listening socket, then wait for it, passing on docker's SIGTERM (a graceful stop: in-flight
    streams finish)."""
    cfg, state = _load(cfg_path)
    client = _read(os.path.join(state, "api_key"))
    admin = _read(os.path.join(state, "admin_key"))
    if not admin:
        print(f"router: no admin key in {state}/admin_key", file=sys.stderr)
        return 2
    subprocess.Popen([sys.executable, sys.argv[0], "router", "keep", cfg_path])
    pid = os.fork()
    if pid == 0:
        from sglang_router.launch_router import launch_router, parse_router_args   # the router image's package
        launch_router(parse_router_args(router_argv(cfg, client, admin)))
        os._exit(0)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: os.kill(pid, s))
    keyed = bool(client) and bool(cfg.get("backend_port"))
    if keyed:
        print(f"router front: {front(cfg, client)}", file=sys.stderr, flush=True)
    print(f"router keeper: {nodelay(pid, backend(cfg, keyed)[1])}", file=sys.stderr, flush=True)
    while True:
        try:
            got, status = os.waitpid(pid, 0)
        except ChildProcessError:        # reaped by nodelay()'s check: it exited
            return 1
        if got == pid:
            return os.waitstatus_to_exitcode(status)


def _load(cfg_path: str) -> tuple[dict, str]:
    with open(cfg_path) as f:
        return json.load(f), os.path.dirname(os.path.abspath(cfg_path))


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "launch":
        return launch(argv[1])
    if len(argv) >= 2 and argv[0] == "keep":
        return keep(argv[1])
    if len(argv) >= 3 and argv[0] == "wait":
        return wait(argv[1], float(argv[2]))
    print("usage: router {launch,keep} CONFIG | router wait CONFIG SECONDS", file=sys.stderr)
    return 2
