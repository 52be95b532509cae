"""ship on the 4-host test cluster: head (node1) to node2..node4, real engines, real SSH.

Images are built on node1's engine from dctl-busybox; each worker's engine is checked directly
(its own socket), independently of what `deployctl ship` reports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cluster import BUSYBOX_IMAGE, ensure_base_images

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]
SMALL, BIG = "dctl-ship-small:1", "dctl-ship-big:1"
WORKERS = ("node2", "node3", "node4")


def docker(cluster, host: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", cluster.host(host).docker_host, *args], capture_output=True,
                          text=True, timeout=timeout)


def image_id(cluster, host: str, image: str) -> str | None:
    r = docker(cluster, host, "image", "inspect", "--format", "{{.Id}}", image)
    return r.stdout.strip() if r.returncode == 0 else None


def build(cluster, tmp: Path, tag: str, dockerfile: str, files: dict[str, bytes] | None = None) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "Dockerfile").write_text(dockerfile)
    for name, data in (files or {}).items():
        (tmp / name).write_bytes(data)
    r = subprocess.run(["docker", "-H", cluster.host("node1").docker_host, "build", "-q", "-t", tag, str(tmp)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    assert r.returncode == 0, r.stderr
    return image_id(cluster, "node1", tag)


def ship(cluster, image: str, *extra: str, timeout: float = 180) -> tuple[int, dict, str, float]:
    t0 = time.monotonic()
    # distribution: direct, this module's subject (the chain: tests/test_chain.py)
    p = subprocess.run([sys.executable, "-m", "orchestrator", "ship", "-i", str(cluster.inventory_with(distribution="direct")),
                        "--image", image, "--json", *extra], capture_output=True, text=True, timeout=timeout,
                       cwd=REPO)
    doc = json.loads(p.stdout) if p.stdout.strip() else {}
    return p.returncode, doc, p.stderr, time.monotonic() - t0


def results(doc: dict) -> dict[str, dict]:
    return {r["host"]: r for s in doc.get("stages", []) for r in s["results"]}


@pytest.fixture(scope="module")
def small(cluster, tmp_path_factory):
    """A 4-layer image on node1: busybox, 3 MB, 1 MB, and a 10 KB patch layer on top."""
    ensure_base_images(debian=False)
    cluster.load_image("node1", BUSYBOX_IMAGE)
    for w in WORKERS:                       # a fresh start for this module's images
        docker(cluster, w, "image", "rm", "-f", SMALL, BIG)
    d = tmp_path_factory.mktemp("small")
    df = ("FROM dctl-busybox:latest\nRUN head -c 3000000 /dev/urandom > /a\n"
          "RUN head -c 1000000 /dev/urandom > /b\nCOPY patch.bin /patch.bin\n")
    return lambda patch: build(cluster, d, SMALL, df, {"patch.bin": patch})


def test_fresh_ship_reship_and_patch(cluster, small):
    head_id = small(b"p" * 10_000)
    rc, doc, err, _ = ship(cluster, SMALL, "--stall-timeout", "45")
    assert rc == 0, err
    res = results(doc)
    assert sorted(res) == list(WORKERS)
    # The plan is what ran: the head loaded each worker with its planned command (--stall-timeout in it).
    run_dir = Path(doc["run_dir"])
    planned = {a["host"]: a["command"][-1].rsplit(" | ", 1)[1]
               for st in json.loads((run_dir / "plan.json").read_text())["stages"] for a in st["actions"]}
    for w in WORKERS:
        assert "<hostside/ship_relay.py> 45 docker -H" in planned[w], planned[w]
        log = (run_dir / "logs" / w / "ship.log").read_text()
        assert f"the head loads it with the planned command: {planned[w]}" in log
    for w in WORKERS:
        d = res[w]["data"]
        assert res[w]["status"] == "ok" and d["image_id"] == head_id, res[w]
        # 4 layers, or 3 where another test left dctl-busybox (the base layer) on that worker
        assert d["layers_total"] == 4 and d["layers_sent"] in (3, 4) and d["layers_unidentified"] == 0
        assert d["layers_sent"] + d["layers_skipped"] == 4
        assert 4_000_000 < d["bytes_sent"] < 7_000_000, d
        assert image_id(cluster, w, SMALL) == head_id          # checked on the worker's own engine
    full = min(res[w]["data"]["bytes_sent"] for w in WORKERS)

    # unchanged: nothing travels
    rc, doc, err, _ = ship(cluster, SMALL)
    assert rc == 0, err
    for w, r in results(doc).items():
        assert r["status"] == "skipped" and "already has" in r["message"], r
        assert r["data"]["bytes_sent"] == 0 and r["data"]["layers_sent"] == 0

    # a new patch layer: only it travels (plus config and manifest, a few KB)
    new_id = small(os.urandom(10_000))
    assert new_id != head_id
    rc, doc, err, _ = ship(cluster, SMALL, "-v")
    assert rc == 0, err
    for w, r in results(doc).items():
        d = r["data"]
        assert r["status"] == "ok" and d["layers_sent"] == 1 and d["layers_skipped"] == 3, r
        # the layer plus the metadata: config, manifest, index (Docker 25+ also writes a legacy json
        # blob per layer): 17.6 KB measured on Docker 26, 4 KB on 20.10
        assert 10_000 < d["bytes_sent"] < 10_000 + 24_576, d
        assert d["bytes_sent"] < full / 20
        assert image_id(cluster, w, SMALL) == new_id


def test_workers_hold_only_the_heads_image(cluster, small, docker_client):
    """A same-named image elsewhere (the controller's engine) never reaches the workers."""
    decoy = docker_client.images.get(BUSYBOX_IMAGE)
    decoy.tag(SMALL)
    try:
        rc, doc, err, _ = ship(cluster, SMALL)
        assert rc == 0, err
        head_ids = set(docker(cluster, "node1", "image", "ls", "-aq", "--no-trunc").stdout.split())
        for w in WORKERS:
            assert image_id(cluster, w, SMALL) == image_id(cluster, "node1", SMALL) != decoy.id
            r = docker(cluster, w, "image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}")
            ours = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("dctl-ship")]
            assert ours and all(i in head_ids for _, i in ours), (w, ours, head_ids)
    finally:
        docker_client.images.remove(SMALL, noprune=True)


def test_unreachable_worker_fails_alone(cluster, small):
    small(b"q" * 10_000)
    cluster.link_down("node4")
    try:
        rc, doc, err, secs = ship(cluster, SMALL)
    finally:
        cluster.link_up("node4")
    res = results(doc)
    assert rc == 1 and res["node4"]["status"] == "failed", res
    assert "node4" in res["node4"]["message"] and "connect" in res["node4"]["message"], res["node4"]
    assert {res[w]["status"] for w in ("node2", "node3")} == {"ok"}
    assert "node4: stage ship failed" in err
    assert secs < 60


def test_cut_and_full_disk_fail_alone_then_rerun_resumes(cluster, small, tmp_path):
    """node3's link is cut mid-stream and node4's Docker temp folder is full: both fail alone, with
    clear reasons and in bounded time; node2 completes; a re-run sends node3 and node4 what is missing."""
    small(b"p" * 10_000)
    head_id = build(cluster, tmp_path / "big", BIG, "FROM dctl-busybox:latest\n"
                    "RUN head -c 64000000 /dev/urandom > /big\nRUN echo v1 > /patch\n")
    n3 = cluster.host("node3")
    tx = Path(f"/sys/class/net/{n3.veth}/statistics/tx_bytes")
    subprocess.run(["tc", "qdisc", "add", "dev", n3.veth, "root", "tbf", "rate", "40mbit", "burst", "64kb",
                    "latency", "500ms"], check=True)
    cut = threading.Event()

    def cutter() -> None:
        start = int(tx.read_text())
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if int(tx.read_text()) - start > 12_000_000:
                cluster.link_down("node3")
                cut.set()
                return
            time.sleep(0.1)

    cluster.small_fs("node4", "docker/tmp", 20)
    th = threading.Thread(target=cutter, daemon=True)
    try:
        th.start()
        rc, doc, err, secs = ship(cluster, BIG, "--stall-timeout", "8")
        th.join()
    finally:
        cluster.link_up("node3")
        subprocess.run(["tc", "qdisc", "del", "dev", n3.veth, "root"], check=False)
        cluster.unmount_small_fs("node4", "docker/tmp")
    assert cut.is_set(), "the stream never reached node3"
    res = results(doc)
    assert rc == 1, err
    assert res["node2"]["status"] == "ok" and image_id(cluster, "node2", BIG) == head_id
    m3, m4 = res["node3"]["message"], res["node4"]["message"]
    assert res["node3"]["status"] == "failed" and "node3" in m3 and "no bytes for 8s" in m3, m3
    assert res["node4"]["status"] == "failed" and "disk is full" in m4 and "no space left on device" in m4, m4
    assert "node3: stage ship failed" in err and "node4: stage ship failed" in err
    assert secs < 90
    assert image_id(cluster, "node3", BIG) is None and image_id(cluster, "node4", BIG) is None

    rc, doc, err, _ = ship(cluster, BIG)
    assert rc == 0, err
    res = results(doc)
    assert res["node2"]["status"] == "skipped"
    for w in ("node3", "node4"):
        d = res[w]["data"]
        # what is still missing: the 64 MB layer and the patch (and the base, had it never reached w)
        assert res[w]["status"] == "ok" and d["layers_sent"] in (2, 3), res[w]
        assert 64_000_000 < d["bytes_sent"] < 67_000_000
        assert image_id(cluster, w, BIG) == head_id
