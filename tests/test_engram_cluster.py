"""`deployctl stage` on the 4-host test cluster: each host stages its rank's rows from its own checkpoint
copy through Ansible (playbooks/stage-engram.yml); a host whose NVMe is full fails alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.deployment import load_deployment
from tests.engram_synth import Synth

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engram_cluster(cluster, tmp_path_factory):
    """The cluster with a synthetic checkpoint (scaled deepseek-v41-flash-tp4) in every host's model cache."""
    s = Synth(tmp_path_factory.mktemp("engram-cluster"), [1, 14], [300, 300, 300], 8, 32, 1, seed=11)
    s.cluster_sets = s.sets() + ["engram.free_margin_gb=5"]     # the real recipe's margin
    dep = load_deployment(cluster.inventory_path, "deepseek-v41-flash-tp4", tuple(s.cluster_sets))
    for h in dep.cluster.hosts:
        folder = Path(dep.checkpoint_dir(h))
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(s.ckpt, folder)
    return cluster, s, dep


def deployctl_stage(inventory: Path, sets: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    argv = [sys.executable, "-m", "orchestrator", "stage", "-i", str(inventory), "-r", "deepseek-v41-flash-tp4",
            *[x for v in sets for x in ("--set", v)], "--json"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    return p, json.loads(p.stdout) if p.stdout.strip() else {}


def results(doc: dict) -> dict[str, dict]:
    (st,) = [s for s in doc["stages"] if s["name"] == "stage-engram"]
    return {r["host"]: r for r in st["results"]}


@pytest.fixture(scope="module")
def staged(engram_cluster):
    """One `deployctl stage` of every host (sparse layout), as ops run it."""
    cluster, s, dep = engram_cluster
    return deployctl_stage(cluster.inventory_path, s.cluster_sets)


def test_stage_every_host_through_ansible(engram_cluster, staged):
    cluster, s, dep = engram_cluster
    p, doc = staged
    assert p.returncode == 0, p.stderr
    res = results(doc)
    assert sorted(res) == ["node1", "node2", "node3", "node4"]
    for h in dep.cluster.hosts:
        r = res[h.name]
        assert r["status"] == "ok", r
        assert r["data"]["rank"] == h.rank and r["data"]["tp"] == 4
        dest = Path(dep.engram_dir(h))
        s.check_dest(dest, 4, h.rank, "sparse")                 # every byte, from the host's own copy
        m = json.loads((dest / "engram-manifest.json").read_text())
        assert m["source"]["checkpoint"] == dep.checkpoint_dir(h)
        assert Path(r["log"]).read_text().count("TASK [") >= 5  # the host's Ansible output in its log
    run_dir = Path(doc["run_dir"])
    assert (run_dir / "stage-engram-vars.json").exists()
    assert (run_dir / "ansible" / "stage-engram" / "artifacts").is_dir()


def test_full_nvme_fails_alone_others_skip(engram_cluster, staged):
    """node3's NVMe folder becomes a 1 MB tmpfs (its staged files hidden): it must stage again and has no
    room; it fails alone, before writing, naming host, path, need and free GB. The others have nothing
    to do and say why."""
    cluster, s, dep = engram_cluster
    assert staged[0].returncode == 0
    node3 = dep.cluster.host("node3")
    rel = os.path.relpath(dep.engram_dir(node3), cluster.host("node3").dir)
    small = cluster.small_fs("node3", rel, 1)
    try:
        p, doc = deployctl_stage(cluster.inventory_path, s.cluster_sets)
        assert p.returncode == 1, p.stderr
        res = results(doc)
        msg = res["node3"]["message"]
        assert res["node3"]["status"] == "failed"
        assert msg.startswith(f"node3: not enough free space on {small}: need 0.000") and "free 0.00" in msg, msg
        assert "margin 5.0 GB" in msg                                   # the recipe's free_margin_gb
        assert os.listdir(small) == []                                  # nothing written there
        assert "node3: stage stage-engram failed" in p.stderr and "not enough free space" in p.stderr
        for h in ("node1", "node2", "node4"):
            assert res[h]["status"] == "skipped", res[h]
            assert res[h]["message"].startswith("already staged: rank"), res[h]
    finally:
        cluster.unmount_small_fs("node3", rel)


def test_restage_of_a_staged_cluster_asks_over_ssh_without_ansible(engram_cluster, staged):
    """A re-run where every rank is current: one SSH round trip per host, no playbook run; a host whose
    manifest is gone (an interrupted staging) goes through Ansible alone."""
    cluster, s, dep = engram_cluster
    assert staged[0].returncode == 0
    p, doc = deployctl_stage(cluster.inventory_path, s.cluster_sets)
    assert p.returncode == 0, p.stderr
    assert all(r["status"] == "skipped" for r in results(doc).values())
    assert not (Path(doc["run_dir"]) / "ansible").exists(), "no playbook ran"

    (Path(dep.engram_dir(dep.cluster.host("node2"))) / "engram-manifest.json").unlink()
    p, doc = deployctl_stage(cluster.inventory_path, s.cluster_sets)
    assert p.returncode == 0, p.stderr
    res = results(doc)
    assert res["node2"]["status"] == "ok" and "TASK [" in Path(res["node2"]["log"]).read_text()
    assert [res[h]["status"] for h in ("node1", "node3", "node4")] == ["skipped"] * 3
    s.check_dest(Path(dep.engram_dir(dep.cluster.host("node2"))), 4, 1, "sparse")
