"""Two deployments in one inventory, one endpoint in front of them, on the 4-host test cluster
(docs/deployments.md, docs/router.md): the engine double behind the real SGLang router
(sglang-router 0.3.2 in its image, dockerfiles/chains/router.yml). A command that does not say which
deployment is refused; `up` of each brings it up on its own host only and registers it; the router
routes by `model` (streaming too), lists exactly the healthy deployments, refuses an unknown model and
a missing key; the keys are in no argv or `docker inspect`; a deployment whose engine dies leaves
/v1/models; `status` without `--deployment` shows both and the router; `down` of one leaves the other
serving, untouched; `down` of the last stops the router. The real vLLM behind it, with a load while
one deployment is replaced and rolled back: tests/test_real_vllm.py."""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.hostside import httpcall
from orchestrator.inventory import InventoryRef
from tests import synth
from tests.cluster.cluster import as_several
from tests.test_launch import FAST, QWEN, QWEN_SMALL, _docker, containers, dctl, double_image, out, remove_all  # noqa: F401

pytestmark = pytest.mark.cluster
DEPS = {"rqa": ("node3", 18031, "qwen-a"), "rqb": ("node4", 18032, "qwen-b")}
ROUTER_PORT, ROUTER_METRICS = 18039, 18038
ROUTER_KEY = "sk-router-test-key-0123456789"
ENGINE_KEY = "sk-engine-a-key-9876543210"


def _inventory(cluster, d: Path) -> Path:
    doc = as_several(yaml.safe_load(cluster.inventory_path.read_text()))
    v = doc["all"]["vars"]
    (d / "router.key").write_text(ROUTER_KEY + "\n")
    (d / "engine-a.key").write_text(ENGINE_KEY + "\n")
    v.update(expect_gpus=False, run_dir=str(d / "runs"),
             router={"host": "node3", "port": ROUTER_PORT, "metrics_port": ROUTER_METRICS,
                     "api_key_file": "router.key", "check_interval_s": 1},
             deployments={name: {"hosts": [host], "recipe": QWEN, "api_port": port, "supervise": False,
                                 "recipe_overrides": {**FAST, **QWEN_SMALL, "engine.served_name": served},
                                 **({"api_key_file": "engine-a.key"} if name == "rqa" else {})}
                          for name, (host, port, served) in DEPS.items()})
    path = d / "routed.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def call(url: str, path: str, body: dict | None = None, key: str | None = ROUTER_KEY,
         timeout: float = 30) -> tuple[int, bytes]:
    try:
        return httpcall.call(url + path, key, body, timeout)
    except OSError as e:                  # not listening (a router restarting)
        return 0, str(e).encode()


def models(url: str) -> list[str]:
    code, raw = call(url, "/v1/models")
    return sorted(m["id"] for m in json.loads(raw)["data"]) if code == 200 else [f"HTTP {code}"]


def until(fn, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.5)


def listener_nodelay(docker_host: str, port: int) -> int:
    """TCP_NODELAY of the router's listening socket, read through its process (pidfd_getfd, as root here)."""
    from orchestrator.hostside.router_keeper import _listening_fd, borrowed_socket
    pids = _docker(docker_host, "top", "deployctl-router", "-eo", "pid,comm").stdout.split("\n")[1:]
    for line in pids:
        f = line.split()
        if len(f) >= 2 and f[1].startswith("sglang"):
            pid = int(f[0])
            fd = _listening_fd(pid, port)
            assert fd is not None, f"no listening socket on {port} in {pid}"
            with borrowed_socket(pid, fd) as s:
                return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    raise AssertionError(f"no sglang::router process in deployctl-router: {pids}")


def routed_requests_scraped(inv: Path, d: Path, url: str) -> None:
    """`deployctl monitor config` lists the router's metrics port (job deployctl-router, labelled with
    its host); Debian's Prometheus scrapes it and reads the router's per-model request counter."""
    from tests.prometheus_server import Prometheus
    p = dctl("monitor", "config", "-i", str(inv), "-d", "rqa", "--out", str(d / "config"), "--scrape-interval", "1s",
             "--evaluation-interval", "1s", "--json", timeout=120)
    assert p.returncode == 0, out(p)
    host = url.split("//")[1].split(":")[0]
    with Prometheus(d / "config" / "prometheus.yml", d / "data") as prom:
        t = prom.wait("the router's target up", lambda: [x for x in prom.targets()
                                                          if x["labels"]["job"] == "deployctl-router" and x["health"] == "up"], 60)
        assert t[0]["labels"]["router"] == "node3" and t[0]["scrapeUrl"] == f"http://{host}:{ROUTER_METRICS}/metrics", t
        n = prom.wait("the router's request counter for qwen-a", lambda: prom.value(
            'sum(smg_router_requests_total{model="qwen-a"})'), 30)
        assert n >= 3, n                      # the chat and the bench's requests to qwen-a at least


@pytest.fixture(scope="module")
def router_image(cluster, tmp_path_factory):
    from tests.router_image import preload
    return preload(cluster, "node3", tmp_path_factory.mktemp("router-image"))


def test_two_deployments_behind_one_router(cluster, double_image, router_image, tmp_path):
    inv = _inventory(cluster, tmp_path)
    for name in DEPS:
        dep = load_deployment(InventoryRef.of(inv, name))
        synth.write_checkpoint(Path(dep.checkpoint_dir(dep.cluster.head_host)),
                               [t for t in synth.recipe_tensors(dep.recipe) if ".ple." in t.name], files=2,
                               config=synth.recipe_config(dep.recipe))
    url = f"http://{cluster.host('node3').address}:{ROUTER_PORT}"
    node3 = cluster.host("node3").docker_host
    try:
        p = dctl("up", "-i", str(inv), "--only", "launch")
        assert p.returncode == 2 and "pick one with --deployment NAME" in p.stderr, out(p)
        p = dctl("plan", "-i", str(inv), "-d", "rqa", "--only", "route")
        assert p.returncode == 0 and "registered once its /health answers" in p.stdout, out(p)
        for name in DEPS:
            p = dctl("up", "-i", str(inv), "-d", name, "--only", "write-ple", "--only", "launch", "--only",
                     "health", "--only", "route", timeout=300)
            assert p.returncode == 0, out(p)
            assert f"served at {url}" in p.stdout + p.stderr, out(p)
        for name, (host, _, _) in DEPS.items():
            assert len(containers(cluster, host, name)) == 1
            other = next(h for n, (h, _, _) in DEPS.items() if n != name)
            assert containers(cluster, other, name) == []          # each only on its own host
        assert models(url) == ["qwen-a", "qwen-b"]
        # each model reaches its own deployment (the answer names the model the engine serves)
        for served in ("qwen-a", "qwen-b"):
            code, raw = call(url, "/v1/chat/completions", {"model": served, "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "hi"}]})
            assert code == 200 and json.loads(raw)["model"] == served, raw
        # streaming: the engine's SSE events, relayed, ending with [DONE]
        code, raw = call(url, "/v1/chat/completions", {"model": "qwen-b", "max_tokens": 6, "stream": True,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        events = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
        assert code == 200 and events[-1] == "data: [DONE]" and len(events) >= 3, raw
        # the router's errors: a model not deployed, no key, a wrong key
        code, raw = call(url, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        assert code == 503 and b"no_available_workers" in raw, (code, raw)
        for key in (None, "sk-wrong-key-000000"):
            code, _ = call(url, "/v1/chat/completions", {"model": "qwen-a", "messages": [{"role": "user", "content": "x"}]},
                           key=key)
            assert code == 401, (key, code)
        # #59: /v1/models needs the key too, as vLLM's does (sglang-router 0.3.2 leaves it open: deployctl's
        # front in the router's container checks it, hostside/router_front.py); /health stays open
        assert [call(url, "/v1/models", key=k)[0] for k in (None, "sk-wrong-key-000000", ROUTER_KEY)] == [401, 401, 200]
        assert call(url, "/health", key=None)[0] == 200
        # no key in the container's definition (argv, environment) nor in its processes' argv
        inspect = _docker(node3, "inspect", "deployctl-router").stdout
        assert ROUTER_KEY not in inspect and ENGINE_KEY not in inspect and "api_key" not in json.loads(inspect)[0]["Args"]
        ps = _docker(node3, "exec", "deployctl-router", "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
        assert "sglang::router" in ps and "router keep" in ps, ps          # the router (its title), the keeper
        assert ROUTER_KEY not in ps and ENGINE_KEY not in ps
        # TCP_NODELAY on the router's listening socket (its clients' connections inherit it): said in its
        # log, and read back from this machine on the socket itself (ss -i: no "nodelay" field; the kernel's
        # own view through the router's process). With a client key the router listens on 127.0.0.1 at
        # port + 1, behind the front on the router's address and port
        logs = _docker(node3, "logs", "deployctl-router")
        assert f"TCP_NODELAY set on the router's listening socket (port {ROUTER_PORT + 1})" in logs.stdout + logs.stderr
        assert "the clients' key is checked on every /v1/ path" in logs.stdout + logs.stderr
        assert listener_nodelay(node3, ROUTER_PORT + 1) == 1
        # status without --deployment: both, healthy, each with its own model and host, and the router's
        # row with both deployments routed
        p = dctl("status", "-i", str(inv), "--json")
        assert p.returncode == 0, out(p)
        docs = {d["deployment"]: d for d in json.loads(p.stdout)["deployments"]}
        assert sorted(docs) == ["rqa", "rqb"]
        for name, (host, port, served) in DEPS.items():
            d = docs[name]
            assert d["api"]["healthy"] and d["model"] == served and d["api"]["url"].endswith(f":{port}"), d
            assert [h["host"] for h in d["hosts"]] == [host]
            assert d["in_flight"] == {"running": 0, "waiting": 0}, d        # the engine's own gauges
        r = json.loads(p.stdout)["router"]
        assert r["health"]["healthy"] and sorted(r["health"]["models"]) == ["qwen-a", "qwen-b"], r
        assert r["release"]["n"] == 1 and r["container"]["state"] == "running", r
        assert {x["deployment"]: x["registered"] for x in r["registry"]["deployments"]} == {"rqa": True, "rqb": True}
        p = dctl("status", "-i", str(inv))
        assert p.returncode == 0 and "2 deployments" in p.stdout and "qwen-b" in p.stdout, out(p)
        assert "0 running, 0 waiting" in p.stdout, out(p)
        # health checks the router like an engine: it answers and routes this deployment (read-only)
        p = dctl("health", "-i", str(inv), "-d", "rqb")
        assert p.returncode == 0 and f"router at {url} healthy, routes model qwen-b (release 1)" in out(p), out(p)
        # bench through the endpoint: the router's URL and key, rqa's model
        p = dctl("bench", "-i", str(inv), "-d", "rqa", "--via-router", "--concurrency", "1", "--rounds", "2",
                 "--max-tokens", "4", "--no-warmup", "--json", timeout=120)
        assert p.returncode == 0, out(p)
        doc = json.loads(p.stdout)
        assert doc["config"]["url"] == url and doc["levels"][0]["errors"] == 0 and doc["levels"][0]["completed"] == 2, doc
        assert ROUTER_KEY not in p.stdout + p.stderr
        # a real Prometheus reads the router's own metrics through `deployctl monitor config`
        routed_requests_scraped(inv, tmp_path / "prometheus", url)
        # a second up of rqa changes nothing at the router (same container, same release)
        cid = r["container"]["id"]
        p = dctl("up", "-i", str(inv), "-d", "rqa", "--only", "health", "--only", "route", timeout=300)
        assert p.returncode == 0, out(p)
        p = dctl("status", "-i", str(inv), "-d", "rqa", "--json")
        r = json.loads(p.stdout)["router"]
        assert r["container"]["id"] == cid and r["release"]["n"] == 1, r
        # an engine that dies leaves /v1/models (the keeper's /health round), and comes back with it
        (eng,) = containers(cluster, "node4", "rqb")
        _docker(cluster.host("node4").docker_host, "stop", "-t", "1", eng)
        until(lambda: models(url) == ["qwen-a"], 20, "a dead engine's model leaves /v1/models")
        _docker(cluster.host("node4").docker_host, "start", eng)
        until(lambda: models(url) == ["qwen-a", "qwen-b"], 60, "a restarted engine's model comes back")
        # a router restarted (its registry is in memory only) gets both back from its keeper
        _docker(node3, "restart", "-t", "2", "deployctl-router")
        until(lambda: call(url, "/health", key=None)[0] == 200 and models(url) == ["qwen-a", "qwen-b"], 60,
              "a restarted router lists both again")
        # down of one: out of the router first, the other still routed, its container untouched; down of
        # the last stops the router
        (kept,) = containers(cluster, "node3", "rqa")
        p = dctl("down", "-i", str(inv), "-d", "rqb")
        assert p.returncode == 0 and "removed from the router" in p.stderr, out(p)
        assert containers(cluster, "node4", "rqb") == [] and containers(cluster, "node3", "rqa") == [kept]
        assert models(url) == ["qwen-a"]
        code, raw = call(url, "/v1/chat/completions", {"model": "qwen-a", "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert code == 200, raw
        p = dctl("down", "-i", str(inv), "-d", "rqa")
        assert p.returncode == 0 and "router stopped and removed" in p.stderr, out(p)
        assert _docker(node3, "ps", "-aq", "--filter", "name=^deployctl-router$").stdout.strip() == ""
    finally:
        for name in DEPS:
            dctl("down", "-i", str(inv), "-d", name)
            remove_all(cluster, name)
        _docker(node3, "rm", "-f", "deployctl-router")
