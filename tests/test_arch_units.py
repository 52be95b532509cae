"""The cluster's architecture, never the controller's (issue 57, item 1): pure parts.

- a host's architecture comes from the inventory (hardware kind or expect_arch), which preflight checks
  against the host's own `uname -m`; the plan names it per host;
- a deployment whose hosts differ in architecture is refused, naming them (exit 2, before any host);
- ship refuses an image whose config platform is not a worker's.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from orchestrator import platforms
from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.ship.transfer import HeadImage


def _spark4(tmp_path, **host_vars) -> str:
    """inventories/spark4.yml with HOST_VARS set on the named hosts ({host: {key: value}})."""
    doc = yaml.safe_load((INVENTORIES_DIR / "spark4.yml").read_text())
    for host, kv in host_vars.items():
        doc["all"]["hosts"][host].update(kv)
    p = tmp_path / "spark4.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(p)


def test_machine_names_map_to_image_platforms():
    assert platforms.for_machine("aarch64").docker == "linux/arm64"
    assert str(platforms.for_machine("aarch64")) == "linux/arm64/v8"
    assert platforms.for_machine("x86_64").docker == "linux/amd64"
    # what `docker image inspect` says of arm64 images: variant v8 or none at all
    assert platforms.runs_on("arm64", "v8", "aarch64") and platforms.runs_on("arm64", "", "aarch64")
    assert not platforms.runs_on("amd64", "", "aarch64")
    assert not platforms.runs_on("arm64", "v7", "aarch64")
    assert platforms.runs_on("amd64", "", "x86_64") and not platforms.runs_on("arm64", "v8", "x86_64")
    with pytest.raises(ValueError, match="riscv64"):
        platforms.for_machine("riscv64")


def test_a_sparks_architecture_is_aarch64_whatever_the_controller_runs():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    assert {h.arch for h in dep.cluster.hosts} == {"aarch64"}      # this controller is x86_64
    p = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "-i", str(INVENTORIES_DIR / "spark4.yml"),
                        "--json"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    pre = next(s for s in json.loads(p.stdout)["stages"] if s["name"] == "preflight")
    assert {a["host"]: a["details"]["arch"] for a in pre["actions"]} == {f"spark{i}": "aarch64" for i in range(1, 5)}
    assert all(", aarch64," in a["summary"] for a in pre["actions"])


def test_a_deployment_whose_hosts_differ_in_architecture_is_refused_naming_them(tmp_path):
    inv = _spark4(tmp_path, spark3={"expect_arch": "x86_64"})
    with pytest.raises(InputError) as e:
        load_deployment(inv)
    msg = str(e.value)
    assert "spark3 x86_64" in msg and "spark1 aarch64" in msg and "differ in architecture" in msg
    p = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "-i", inv], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "spark3 x86_64" in p.stderr, p.stderr


def test_ship_refuses_an_image_whose_platform_is_not_the_workers():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    worker = dep.cluster.host("spark2")
    amd = HeadImage("vllm-dsv41:latest", "sha256:" + "ab" * 32, ("sha256:x",), 1, arch="amd64")
    why = amd.refusal_for(worker)
    assert why and "linux/amd64" in why and "spark2 is aarch64" in why and "vllm-dsv41:latest" in why
    assert HeadImage("i", "sha256:" + "cd" * 32, ("sha256:x",), 1, arch="arm64", variant="v8").refusal_for(worker) is None
    assert HeadImage("i", "sha256:" + "cd" * 32, ("sha256:x",), 1, arch="arm64").refusal_for(worker) is None
