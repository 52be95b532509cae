"""`deployctl build` on the head node's own Docker engine over SSH (the test cluster): the image is
built there and nowhere else, a rebuild is a no-op, and an unknown host key is refused."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cluster

IMAGE = "dctl-engine:test"
STEPS = ["nightly", "c-ext", "overlay1", "overlay3", "overlay4", "overlay5", "patch", "engine-double"]


def tags(cluster, host: str) -> set[str]:
    r = cluster.nsexec(host, ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"])
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def deployctl_build(inventory: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", "build", "-i", str(inventory), "--json", *extra],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def report_of(p: subprocess.CompletedProcess) -> dict:
    (res,) = json.loads(p.stdout)["stages"][0]["results"]
    return res


def test_build_runs_on_the_head_engine_over_ssh(cluster, base_images, tmp_path):
    cluster.load_image("node1", "dctl-debian:bookworm")          # what the chain starts from
    before = {h: tags(cluster, h) for h in ("node1", "node2")}
    inv = cluster.inventory_path
    try:
        p = deployctl_build(inv, tmp_path)
        assert p.returncode == 0, p.stderr
        res = report_of(p)
        rep = res["data"]["report"]
        assert res["host"] == "node1" and rep["engine"].startswith(f"node1 (ssh://root@{cluster.hosts[0].address}:22)")
        assert [s["name"] for s in rep["steps"]] == STEPS
        assert all(s["status"] in ("built", "reused") for s in rep["steps"])
        on1, on2 = tags(cluster, "node1"), tags(cluster, "node2")
        assert IMAGE in on1, on1
        assert IMAGE not in on2 and not any(t.startswith("deployctl-cache/") for t in on2), on2
        r = cluster.nsexec("node1", ["docker", "image", "inspect", "-f", "{{.Id}}", IMAGE])
        assert r.stdout.strip() == rep["image_id"]
        r = cluster.nsexec("node1", ["docker", "run", "--rm", IMAGE, "vllm", "--version"])
        assert "engine-double" in r.stdout, r.stderr

        t0 = time.monotonic()
        p = deployctl_build(inv, tmp_path)
        took = time.monotonic() - t0
        assert p.returncode == 0, p.stderr
        res = report_of(p)
        assert res["status"] == "skipped"
        assert [s["status"] for s in res["data"]["report"]["steps"]] == ["reused"] * len(STEPS)
        assert took < 15, f"no-op build over SSH took {took:.1f}s"

        # the same inventory with a known_hosts file that lacks node1's key: refused, nothing built
        data = yaml.safe_load(inv.read_text())
        empty = tmp_path / "known_hosts"
        empty.write_text("")
        data["all"]["vars"]["known_hosts_file"] = str(empty)
        other = tmp_path / "inv-unknown-key.yml"
        other.write_text(yaml.safe_dump(data))
        p = deployctl_build(other, tmp_path)
        assert p.returncode == 1
        # the build changes the head's engine, so it takes the deployment's lock there first: the
        # host key is refused when that SSH connection is made, before anything is built
        assert "unknown SSH host key" in p.stderr and "cannot take the deployment lock" in p.stderr, p.stderr
        assert "node1" in p.stderr and str(empty) in p.stderr
    finally:
        made = tags(cluster, "node1") - before["node1"] - {"dctl-debian:bookworm"}
        if made:     # leave the head as we found it (other tests check for a clean engine)
            cluster.nsexec("node1", ["docker", "rmi", *sorted(made)])
