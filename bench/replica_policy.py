#!/usr/bin/env python3
"""Which balancing policy for replicas (#58 item 2): the released router (deployctl-router:0.3.2, the image
`up` runs) in IGW mode, the keeper's flags but --policy, in front of N stand-in workers registered under
ONE model, as the keeper registers replicas. A workload that shares prefixes: P "conversations", each a
long system prefix of its own, requests picked at random among them, C clients at once.

    python3 bench/replica_policy.py [--workers 2] [--prefixes 16] [--requests 400] [--concurrency 4]
                                    [--policies round_robin,cache_aware,power_of_two,random] [--json]

What it measures, per policy: requests per worker and their spread (max/min); the prefixes each worker
saw (the prefix-cache footprint each replica must hold); the cold prefills (the first request of a
prefix on a worker: a prefix-cache miss on a real engine, whatever its cache size); /v1/models (the model
listed once). The workers are stand-ins (they answer at once): the routing decision is the router's own,
what an engine would do with it is not measured here (docs/router.md says what this does and does not show).
Needs Docker and the image deployctl-router:0.3.2 (tests/router_image.py builds it).
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

IMAGE = "deployctl-router:0.3.2"
ADMIN = "bench-admin-key"


def worker(port: int, model: str, seen: list, delay_s: float = 0.0) -> ThreadingHTTPServer:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, doc):
            b = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(b)))
            self.end_headers()
            self.wfile.write(b)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send({"object": "list", "data": [{"id": model, "object": "model"}]})
            return self._send({"model_path": model})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
            seen.append(body.get("prompt", ""))
            time.sleep(delay_s)          # an engine's time per request: the router's load count builds up
            self._send({"id": "x", "object": "text_completion", "model": model,
                        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
    s = ThreadingHTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return s


def http(method: str, url: str, body: dict | None = None, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method,
                                 headers={"content-type": "application/json",
                                          **({"authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def one_policy(policy: str, n: int, prefixes: int, requests: int, conc: int, base_port: int, seed: int,
               delay_s: float = 0.0, extra: tuple[str, ...] = ()) -> dict:
    name = f"deployctl-bench-policy-{base_port}"
    seen: list[list] = [[] for _ in range(n)]
    servers = [worker(base_port + 10 + i, "m", seen[i], delay_s) for i in range(n)]
    port = base_port
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    subprocess.run(["docker", "run", "-d", "--name", name, "--network", "host", "--entrypoint", "python3", IMAGE,
                    "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), "--enable-igw",
                    "--policy", policy, "--control-plane-api-keys", f"b:b:admin:{ADMIN}",
                    "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                    "--health-success-threshold", "1", "--health-check-endpoint", "/health",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(port + 1), "--log-level", "warn", *extra],
                   check=True, capture_output=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while http("GET", url + "/health")[0] != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"the router ({policy}) did not answer")
            time.sleep(0.3)
        for i in range(n):
            http("POST", url + "/workers", {"url": f"http://127.0.0.1:{base_port + 10 + i}", "model_id": "m"}, ADMIN)
        while len(json.loads(http("GET", url + "/workers", key=ADMIN)[1] or b"{}").get("workers") or []) < n:
            time.sleep(0.3)
        models = [m["id"] for m in json.loads(http("GET", url + "/v1/models")[1]).get("data") or []]
        rng = random.Random(seed)
        heads = [f"system {p}: " + " ".join(f"rule{p}-{k}" for k in range(300)) for p in range(prefixes)]
        work = [f"{heads[rng.randrange(prefixes)]} question {i}" for i in range(requests)]
        fails = []

        def send(prompt: str) -> None:
            code, _ = http("POST", url + "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1})
            if code != 200:
                fails.append(code)
        with ThreadPoolExecutor(conc) as ex:
            list(ex.map(send, work))
        counts = [len(s) for s in seen]
        per = [{p.split(":")[0] for p in s} for s in seen]
        return {"policy": policy + (" " + " ".join(extra) if extra else ""), "requests_per_worker": counts,
                "spread_max_min": round(max(counts) / max(min(counts), 1), 2),
                "prefixes_per_worker": [len(p) for p in per], "cold_prefills": sum(len(p) for p in per),
                "failed": len(fails), "v1_models": models}
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        for s in servers:
            s.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--policies", default="round_robin,cache_aware,power_of_two,random")
    ap.add_argument("--port", type=int, default=18950)
    ap.add_argument("--seed", type=int, default=58)
    ap.add_argument("--worker-delay-ms", type=float, default=0.0, help="each stand-in's time per request")
    ap.add_argument("--balance-abs-threshold", type=int, default=None,
                    help="cache_aware's --balance-abs-threshold (the router's default: 64)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    extra = ("--balance-abs-threshold", str(a.balance_abs_threshold)) if a.balance_abs_threshold is not None else ()
    rows = [one_policy(p, a.workers, a.prefixes, a.requests, a.concurrency, a.port, a.seed,
                       a.worker_delay_ms / 1000, extra if p == "cache_aware" else ()) for p in a.policies.split(",")]
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{a.workers} workers, {a.prefixes} prefixes, {a.requests} requests, {a.concurrency} clients, "
          f"{a.worker_delay_ms:g} ms per request")
    print(f"{'policy':40} {'per worker':>16} {'max/min':>8} {'prefixes/worker':>16} {'cold prefills':>14} "
          f"{'failed':>7}  /v1/models")
    for r in rows:
        print(f"{r['policy']:40} {str(r['requests_per_worker']):>16} {r['spread_max_min']:>8} "
              f"{str(r['prefixes_per_worker']):>16} {r['cold_prefills']:>14} {r['failed']:>7}  {r['v1_models']}")


if __name__ == "__main__":
    main()
