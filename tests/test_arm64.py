"""Issue 57 end to end on arm64 test hosts (tests/cluster/arm64.py: every program run over SSH is an arm64
binary under qemu-user, `uname -m` says aarch64; each host's dockerd is native and runs linux/arm64 images
through binfmt's F flag), beside an x86-64 host, one inventory (tests/cluster/demo.py `prepare_mixed`):

  ds   DeepSeek-V4.1-Flash scaled, TP=2 on node1-node2 (aarch64, hardware dgx-spark): preflight says
       aarch64; the engine double's chain built for linux/arm64 on node1; shipped over the fabric;
       fetch-model (the serving image's Hub client, arm64 Python), sync-model, stage-engram, launch,
       health, supervise (a killed rank is restarted), route (the router image built for linux/arm64
       on node1, a request routed through it), status, down. Every container on node1-node2, the
       supervisors' and the router's included, runs a linux/arm64 image and its `uname -m` says aarch64.
  qw   Qwen3.8-Flash-Next scaled on node3 (x86_64): its image built for linux/amd64 on node3, the router
       on node1 serves both models.

One 3-host cluster for the module; its time per phase is printed (the tier's figure in the closing note).
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.hostside import httpcall
from orchestrator.inventory import InventoryRef
from tests.test_router_cluster import until
from tests.test_tp8 import dctl, out, results

pytestmark = pytest.mark.cluster
NAME = os.environ.get("DCTL_ARM64_CLUSTER", "arm64")
ARM, X86 = ("node1", "node2"), "node3"
T0 = time.monotonic()


def phase(what: str, since: float) -> float:
    now = time.monotonic()
    print(f"\n[arm64] {what}: {now - since:.1f}s (tier so far {now - T0:.1f}s)", flush=True)
    return now


def docker(c, host: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", c.host(host).docker_host, *args], capture_output=True, text=True,
                          timeout=timeout)


def running(c, host: str) -> list[dict]:
    """Every running container on HOST, inspected."""
    ids = docker(c, host, "ps", "-q").stdout.split()
    return json.loads(docker(c, host, "inspect", *ids).stdout) if ids else []


def image_platform(c, host: str, image_id: str) -> str:
    r = docker(c, host, "image", "inspect", "--format", "{{.Architecture}}/{{.Variant}}", image_id)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().rstrip("/")


def call(url: str, path: str, key: str | None, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    try:
        return httpcall.call(url + path, key, body, timeout)
    except OSError as e:
        return 0, str(e).encode()


@pytest.fixture(scope="module")
def mixed():
    from tests.cluster.demo import prepare_mixed
    t = time.monotonic()
    c, inv = prepare_mixed(NAME, log=print)
    phase("cluster up (2 aarch64 + 1 x86_64 hosts), base images, checkpoints on the Hub", t)
    try:
        yield c, inv
    finally:
        for d in ("qw", "ds"):
            dctl("down", "-i", str(inv), "-d", d, timeout=300)
        c.down()


def test_arm64_pipeline_then_both_architectures_behind_one_router(mixed):
    c, inv = mixed
    ds = load_deployment(InventoryRef.of(inv, "ds"))
    qw = load_deployment(InventoryRef.of(inv, "qw"))
    router = ds.cluster.router
    assert router is not None and router.host.name == ARM[0]
    key = Path(router.api_key_file).read_text().strip()
    assert [h.arch for h in ds.cluster.hosts] == ["aarch64", "aarch64"] and qw.cluster.hosts[0].arch == "x86_64"

    # the controller is x86-64; the plan names each host's architecture, from the inventory
    p = dctl("plan", "-i", str(inv), "-d", "ds", "--json", timeout=120)
    assert p.returncode == 0, out(p)
    pre = next(s for s in json.loads(p.stdout)["stages"] if s["name"] == "preflight")
    assert {a["host"]: a["details"]["arch"] for a in pre["actions"]} == {h: "aarch64" for h in ARM}

    # 1. the whole pipeline on arm64
    t = time.monotonic()
    p = dctl("up", "-i", str(inv), "-d", "ds", "--json", timeout=1800)
    t = phase("up ds (arm64, cold: build, ship, fetch, sync, stage, launch, health, supervise, route)", t)
    assert p.returncode == 0, out(p)
    res = results(p)
    for h in ARM:
        assert res[f"preflight:{h}"]["status"] == "ok", res[f"preflight:{h}"]
        arch = [ck for ck in res[f"preflight:{h}"]["data"]["checks"] if ck["name"] == "arch"]
        assert arch and arch[0] == {"name": "arch", "status": "ok", "detail": "aarch64"}, arch
    assert res[f"build:{ARM[0]}"]["status"] == "ok", res[f"build:{ARM[0]}"]
    assert "linux/arm64" in json.dumps(res[f"build:{ARM[0]}"]["data"]), res[f"build:{ARM[0]}"]["data"]
    assert res[f"ship:{ARM[1]}"]["status"] == "ok", res[f"ship:{ARM[1]}"]
    for stage in ("fetch-model", "sync-model", "stage-engram", "launch", "health", "supervise"):
        assert any(k.startswith(stage + ":") for k in res), f"{stage} ran"
    for k, r in res.items():
        assert r["status"] in ("ok", "skipped"), (k, r)

    # every container on the arm64 hosts: a linux/arm64 image, `uname -m` aarch64 inside
    seen = {}
    for h in ARM:
        for ctr in running(c, h):
            name = ctr["Name"].lstrip("/")
            assert image_platform(c, h, ctr["Image"]) in ("arm64/v8", "arm64"), (h, name)
            u = docker(c, h, "exec", ctr["Id"], "uname", "-m")
            assert u.returncode == 0 and u.stdout.strip() == "aarch64", (h, name, u.stdout, u.stderr)
            seen.setdefault(h, []).append(name)
    names = " ".join(n for v in seen.values() for n in v)
    assert "supervisor" in names and "deployctl-router" in seen[ARM[0]], seen
    assert all(any("supervisor" not in n and "router" not in n for n in seen[h]) for h in ARM), seen
    print(f"\n[arm64] containers, all linux/arm64 and aarch64 inside: {seen}")

    # a request through the router (built for arm64 on node1) reaches the arm64 engines
    served = ds.recipe.engine.served_name
    url = router.url
    until(lambda: served in [m["id"] for m in json.loads(call(url, "/v1/models", key)[1] or b'{"data": []}')["data"]],
          120, f"{served} listed by the router")
    code, raw = call(url, "/v1/chat/completions", key,
                      {"model": served, "messages": [{"role": "user", "content": "Count from 1 to 10."}],
                       "max_tokens": 8})
    assert code == 200, raw[-500:]
    t = phase("containers checked and a request routed", t)

    # 2. the supervisor (arm64 Python) restarts a killed rank
    worker = ARM[1]
    engine = next(x for x in running(c, worker) if x["Config"]["Labels"].get("deployctl.deployment") == "ds"
                  and "deployctl.supervisor" not in x["Config"]["Labels"])
    docker(c, worker, "kill", engine["Id"])

    def recovered():
        q = dctl("incidents", "-i", str(inv), "-d", "ds", "--json", timeout=120)
        items = json.loads(q.stdout)["incidents"] if q.returncode == 0 else []
        return items and items[0]["outcome"] == "recovered" and items[0]
    inc = until(recovered, 420, "the killed rank restarted by the supervisor")
    assert inc["kind"] == "rank-exited" and inc["evidence"]["host"] == worker, inc
    assert until(lambda: call(ds.api_url, "/health", None)[0] == 200, 120, "health after the restart")
    t = phase(f"rank on {worker} killed -> recovered (incident {inc['recovery_s']}s)", t)

    # 3. the x86-64 deployment beside it: its image built for linux/amd64 on node3; the router serves both
    p = dctl("up", "-i", str(inv), "-d", "qw", "--json", timeout=900)
    t = phase("up qw (x86_64)", t)
    assert p.returncode == 0, out(p)
    for ctr in running(c, X86):
        assert image_platform(c, X86, ctr["Image"]) == "amd64", ctr["Name"]
        assert docker(c, X86, "exec", ctr["Id"], "uname", "-m").stdout.strip() == "x86_64", ctr["Name"]
    qserved = qw.recipe.engine.served_name
    listed = until(lambda: (lambda ids: {served, qserved} <= set(ids) and ids)(
        [m["id"] for m in json.loads(call(url, "/v1/models", key)[1] or b'{"data": []}')["data"]]),
        120, "both models listed by the router")
    assert sorted(listed) == sorted({served, qserved}), listed
    for model in (served, qserved):
        code, raw = call(url, "/v1/completions", key, {"model": model, "prompt": "one two", "max_tokens": 4})
        assert code == 200, (model, raw[-500:])

    p = dctl("status", "-i", str(inv), timeout=300)
    assert p.returncode == 0 and "ds" in p.stdout and "qw" in p.stdout, out(p)
    t = phase("both served through the router, status", t)

    # 4. down: nothing of either deployment left, the router stopped with the last one
    for d in ("qw", "ds"):
        p = dctl("down", "-i", str(inv), "-d", d, timeout=300)
        assert p.returncode == 0, out(p)
    for h in (*ARM, X86):
        left = [x["Name"] for x in running(c, h)]
        assert left == [], (h, left)
    phase("down both", t)
