"""The fabric check on the test cluster's fabric network (its own bridge, MTU 9000, tests/cluster/):
real pings, real don't-fragment pings and real iperf3 between the hosts' namespaces.

A healthy 4-host matrix (and `up` reusing it); one link shaped with tc (named, measured at the shaping
rate, `up` stops before launch, a recipe that only warns goes on); a host at MTU 1500; a host whose
fabric address is on another subnet; a switchless mesh of 3 hosts with a subnet per cable; the netplan
files `fabric plan` writes, validated by the real `netplan generate`."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cluster


def dctl(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout)


def inventory(cluster, tmp: Path, edit=None, **extra) -> Path:
    doc = yaml.safe_load(cluster.inventory_path.read_text())
    doc["all"]["vars"].update({"run_dir": str(tmp / "runs"), **extra})
    if edit:
        edit(doc)
    tmp.mkdir(parents=True, exist_ok=True)
    p = tmp / "inventory.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def report(p: subprocess.CompletedProcess) -> dict:
    doc = json.loads(p.stdout)
    fabric = [r for s in doc["stages"] for r in s["results"] if r.get("data", {}).get("fabric")]
    assert len(fabric) == 1, p.stderr[-2000:]
    return fabric[0]["data"]["fabric"]


def findings(rep: dict) -> dict[tuple[str, str], dict]:
    return {(f["kind"], f["where"]): f for f in rep["findings"]}


def test_healthy_matrix_every_pair_measured_then_up_reuses_it(cluster, tmp_path):
    inv = inventory(cluster, tmp_path)
    p = dctl("fabric", "-i", str(inv), "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = report(p)
    assert rep["ok"] and rep["topology"] == "switch" and not rep["findings"]
    assert {h["host"]: (h["iface"], h["address"], h["mtu"]) for h in rep["hosts"]} == {
        h.name: ("fab0", h.fabric_address, 9000) for h in cluster.hosts}
    assert sorted((x["a"], x["b"]) for x in rep["links"]) == [
        (a.name, b.name) for i, a in enumerate(cluster.hosts) for b in cluster.hosts[i + 1:]]
    for x in rep["links"]:
        assert x["reach"] == {"a>b": True, "b>a": True} and x["df"] == {"a>b": True, "b>a": True}, x
        assert x["mtu"] == 9000 and x["throughput"]["gbps"] > 1.0, x
    assert rep["seconds"] < 30
    print(f"4-host matrix in {rep['seconds']:.1f} s, slowest {rep['slowest']}")
    # the table people read names the slowest link
    p = dctl("fabric", "-i", str(inv))
    assert p.returncode == 0 and "slowest link: node" in p.stderr and "fabric ok" in p.stderr, p.stderr[-2000:]
    # up's stage reuses a passing check of the same facts (deployctl fabric's too), measures without one
    reused = dctl("up", "-i", str(inv), "--only", "fabric")
    assert reused.returncode == 0 and "cached from" in reused.stderr, reused.stderr[-2000:]
    shutil.rmtree(tmp_path / "runs" / "fabric-cache")
    first = dctl("up", "-i", str(inv), "--only", "fabric")
    again = dctl("up", "-i", str(inv), "--only", "fabric")
    assert first.returncode == 0 and again.returncode == 0, again.stderr[-2000:]
    assert "cached from" in again.stderr and "cached from" not in first.stderr


def test_a_throttled_link_is_named_and_stops_up_before_launch(cluster, tmp_path):
    inv = inventory(cluster, tmp_path)
    cluster.throttle_link("node2", "node3", 100)
    try:
        p = dctl("fabric", "-i", str(inv), "--json")
        assert p.returncode == 1, p.stderr[-2000:]
        rep = report(p)
        slow = findings(rep)[("slow-link", "node2-node3")]
        assert slow["severity"] == "stop" and "node2 -> node3" in slow["message"]
        assert rep["slowest"] == "node2-node3"
        rate = next(x for x in rep["links"] if x["a"] == "node2" and x["b"] == "node3")["throughput"]["gbps"]
        assert abs(rate - 0.1) <= 0.01, f"measured {rate} Gb/s on a link shaped to 100 Mbit/s"
        assert [f["where"] for f in rep["findings"]] == ["node2-node3"], "no other link is blamed"

        up = dctl("up", "-i", str(inv), "--json", timeout=300)
        assert up.returncode == 1
        doc = json.loads(up.stdout)
        ran = {s["name"]: s for s in doc["stages"] if s["results"]}
        assert set(ran) == {"preflight", "fabric"}, f"nothing after the fabric stage ran: {sorted(ran)}"
        failed = sorted(r["host"] for r in ran["fabric"]["results"] if r["status"] == "failed")
        assert failed == ["node2", "node3"]
        assert "slow-link node2-node3" in up.stderr and "fabric.log" in up.stderr
        for h in cluster.hosts:      # no container was started anywhere
            ps = cluster.nsexec(h, ["docker", "ps", "-aq", "--filter", "label=deployctl.deployment"])
            assert ps.returncode == 0 and not ps.stdout.strip(), (h.name, ps.stdout)

        # a recipe that only warns on slow links goes on
        w = dctl("fabric", "-i", str(inv), "--set", 'fabric.warn=["slow-link"]')
        assert w.returncode == 0, w.stderr[-2000:]
        assert "WARN slow-link node2-node3" in w.stderr
    finally:
        cluster.unthrottle_link("node2", "node3")


def test_a_host_at_mtu_1500_is_a_path_mtu_mismatch(cluster, tmp_path):
    inv = inventory(cluster, tmp_path)
    cluster.set_fabric_mtu("node3", 1500)
    try:
        p = dctl("fabric", "-i", str(inv), "--json")
        assert p.returncode == 1
        found = findings(report(p))
        assert "MTU 1500" in found[("mtu", "node3")]["message"]
        for pair in ("node1-node3", "node2-node3", "node3-node4"):
            msg = found[("mtu", pair)]["message"]
            assert "MTU mismatch on the path" in msg and "1500" in msg and "too long" in msg, msg
        assert ("mtu", "node1-node2") not in found
    finally:
        cluster.set_fabric_mtu("node3", 9000)


def test_a_host_on_another_subnet_is_named(cluster, tmp_path):
    i = cluster.hosts[0].fabric_address.split(".")[2]
    wrong = f"10.99.{i}.14/24"

    def edit(doc):
        doc["all"]["hosts"]["node4"]["fabric_address"] = wrong     # the operator's (wrong) address
    inv = inventory(cluster, tmp_path, edit)
    cluster.set_fabric_address("node4", wrong)
    try:
        p = dctl("fabric", "-i", str(inv), "--json")
        assert p.returncode == 1
        found = findings(report(p))
        sub = found[("subnet", "node4")]["message"]
        assert f"10.99.{i}.0/24" in sub and f"10.214.{i}.0/24" in sub, sub
        assert {w for k, w in found if k == "unreachable"} == {"node1-node4", "node2-node4", "node3-node4"}
    finally:
        cluster.set_fabric_address("node4", cluster.host("node4").fabric_cidr)


def test_a_host_without_ssh_is_named_and_the_other_links_are_still_measured(cluster, tmp_path):
    inv = inventory(cluster, tmp_path)
    cluster.stop_sshd("node4")
    try:
        p = dctl("fabric", "-i", str(inv), "--json")
        assert p.returncode == 1
        rep = report(p)
        down = findings(rep)[("link-down", "node4")]
        assert "cannot read its network facts" in down["message"], down
        assert sorted(x["a"] + "-" + x["b"] for x in rep["links"]) == ["node1-node2", "node1-node3", "node2-node3"]
        assert all(x["throughput"]["gbps"] > 1.0 for x in rep["links"])
    finally:
        cluster.start_sshd("node4")


def test_a_switchless_mesh_of_three_with_a_subnet_per_cable(cluster, tmp_path):
    cables = [("node1", "node2", "10.216.1.1/30", "10.216.1.2/30"), ("node2", "node3", "10.216.2.1/30", "10.216.2.2/30"),
              ("node1", "node3", "10.216.3.1/30", "10.216.3.2/30")]
    ifaces = {}
    try:
        for a, b, ca, cb in cables:
            ifaces[(a, b)] = cluster.mesh_link(a, b, ca, cb)

        def edit(doc):
            hosts = doc["all"]["hosts"]
            del hosts["node4"]
            doc["all"]["vars"]["fabric_topology"] = "mesh"
            doc["all"]["vars"]["recipe_overrides"].update({"parallelism.nodes": 3, "parallelism.tensor_parallel": 3})
            for h in hosts.values():
                h.pop("fabric_address")
                h["fabric_links"] = {}
            for a, b, ca, cb in cables:
                ia, ib = ifaces[(a, b)]
                hosts[a]["fabric_links"][b] = {"iface": ia, "address": ca}
                hosts[b]["fabric_links"][a] = {"iface": ib, "address": cb}
        inv = inventory(cluster, tmp_path, edit)
        p = dctl("fabric", "-i", str(inv), "--json")
        assert p.returncode == 0, p.stderr[-3000:]
        rep = report(p)
        assert rep["topology"] == "mesh" and rep["ok"]
        got = {(x["a"], x["b"]): (x["a_addr"], x["b_addr"], x["a_iface"], x["b_iface"]) for x in rep["links"]}
        assert got == {(a, b): (ca.split("/")[0], cb.split("/")[0], *ifaces[(a, b)]) for a, b, ca, cb in cables}
        assert all(x["throughput"]["gbps"] > 1.0 and x["df"]["a>b"] for x in rep["links"])
        # NCCL bootstraps on the management network in a mesh (the peer tools' way): not a verdict
        assert {h["host"]: h["iface"] for h in rep["hosts"]} == {"node1": "eth0", "node2": "eth0", "node3": "eth0"}

        # one end of one cable at MTU 1500: that cable is named
        ia, ib = ifaces[("node2", "node3")]
        assert cluster.nsexec("node3", ["ip", "link", "set", ib, "mtu", "1500"]).returncode == 0
        p = dctl("fabric", "-i", str(inv), "--json")
        assert p.returncode == 1
        found = findings(report(p))
        assert ("mtu", "node2-node3") in found and ("mtu", "node1-node2") not in found
        assert f"{ib} has MTU 1500" in found[("mtu", "node3")]["message"]
    finally:
        for a, b, *_ in cables:
            cluster.remove_mesh_link(a, b)


def test_fabric_plan_writes_netplan_files_that_netplan_generate_accepts(cluster, tmp_path):
    inv = inventory(cluster, tmp_path)
    out = tmp_path / "plan"
    p = dctl("fabric", "plan", "-i", str(inv), "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout)
    assert doc["mtu"] == 9000 and len(doc["hosts"]) == 4
    for h, d in zip(cluster.hosts, doc["hosts"]):
        f = Path(d["file"])
        assert f == out / h.name / "45-deployctl-fabric.yaml"
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600        # netplan warns about wider modes
        eth = yaml.safe_load(f.read_text())["network"]["ethernets"]
        assert eth == {"fab0": {"dhcp4": False, "dhcp6": False, "link-local": [],
                                "addresses": [h.fabric_cidr], "mtu": 9000}}
        assert any("netplan try" in c for c in d["apply"])
    # an address without its prefix cannot be planned: exit 2 naming the key, nothing written
    def edit(doc):
        doc["all"]["hosts"]["node2"]["fabric_address"] = cluster.host("node2").fabric_address
    bad = dctl("fabric", "plan", "-i", str(inventory(cluster, tmp_path / "bad", edit)), "--out", str(tmp_path / "none"))
    assert bad.returncode == 2 and "all.hosts.node2.fabric_address" in bad.stderr, bad.stderr
    assert not (tmp_path / "none").exists()
