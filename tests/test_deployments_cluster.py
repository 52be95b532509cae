"""Two deployments in one inventory on the 4-host test cluster (docs/deployments.md): each comes up on
its own host through `--deployment`, `status` without it shows both, `down` of one leaves the other
serving, untouched; a command that does not say which is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.inventory import InventoryRef
from tests import synth
from tests.cluster.cluster import as_several
from tests.test_launch import FAST, QWEN, QWEN_SMALL, containers, dctl, double_image, out, remove_all  # noqa: F401

pytestmark = pytest.mark.cluster
DEPS = {"mqa": ("node3", 18021, "qwen-a"), "mqb": ("node4", 18022, "qwen-b")}


def _inventory(cluster, path: Path) -> Path:
    """The cluster's hosts, no ranks, two deployments of the Qwen recipe (engine double) on node3 and node4."""
    doc = as_several(yaml.safe_load(cluster.inventory_path.read_text()))
    v = doc["all"]["vars"]
    v.update(expect_gpus=False, run_dir=str(path.parent / "runs"), deployments={
        name: {"hosts": [host], "recipe": QWEN, "api_port": port, "supervise": False,
               "recipe_overrides": {**FAST, **QWEN_SMALL, "engine.served_name": served}}
        for name, (host, port, served) in DEPS.items()})
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_two_deployments_side_by_side(cluster, double_image, tmp_path):
    inv = _inventory(cluster, tmp_path / "two.yml")
    for name in DEPS:
        dep = load_deployment(InventoryRef.of(inv, name))
        synth.write_checkpoint(Path(dep.checkpoint_dir(dep.cluster.head_host)),
                               [t for t in synth.recipe_tensors(dep.recipe) if ".ple." in t.name], files=2,
                               config=synth.recipe_config(dep.recipe))
    try:
        p = dctl("up", "-i", str(inv), "--only", "launch")
        assert p.returncode == 2 and "pick one with --deployment NAME" in p.stderr, out(p)
        for name in DEPS:
            p = dctl("up", "-i", str(inv), "-d", name, "--only", "write-ple", "--only", "launch", "--only",
                     "health", timeout=240)
            assert p.returncode == 0, out(p)
        for name, (host, _, _) in DEPS.items():
            assert len(containers(cluster, host, name)) == 1
            other = next(h for n, (h, _, _) in DEPS.items() if n != name)
            assert containers(cluster, other, name) == []          # each only on its own host
        # status without --deployment: both, healthy, each with its own model and host
        p = dctl("status", "-i", str(inv), "--json")
        assert p.returncode == 0, out(p)
        docs = {d["deployment"]: d for d in json.loads(p.stdout)["deployments"]}
        assert sorted(docs) == ["mqa", "mqb"]
        for name, (host, port, served) in DEPS.items():
            d = docs[name]
            assert d["api"]["healthy"] and d["model"] == served and d["api"]["url"].endswith(f":{port}"), d
            assert [h["host"] for h in d["hosts"]] == [host]
            assert d["in_flight"] == {"running": 0, "waiting": 0}, d        # the engine's own gauges
        p = dctl("status", "-i", str(inv))
        assert p.returncode == 0 and "2 deployments" in p.stdout and "qwen-b" in p.stdout, out(p)
        assert "0 running, 0 waiting" in p.stdout, out(p)
        # down of one: the other keeps serving, its container untouched
        (kept,) = containers(cluster, "node3", "mqa")
        p = dctl("down", "-i", str(inv), "-d", "mqb")
        assert p.returncode == 0, out(p)
        assert containers(cluster, "node4", "mqb") == [] and containers(cluster, "node3", "mqa") == [kept]
        p = dctl("health", "-i", str(inv), "-d", "mqa")
        assert p.returncode == 0, out(p)
    finally:
        for name in DEPS:
            dctl("down", "-i", str(inv), "-d", name)
            remove_all(cluster, name)
