"""The fabric check's pure parts: scheduling, links per topology, verdicts, iperf3's real JSON, the
mesh NCCL settings, the netplan files (validated by the real `netplan generate`), inventory errors."""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.fabric import netplan, report, topology, verdicts
from orchestrator.fabric.detect import Fabric, fabric_env, mesh_fabric
from orchestrator.fabric.model import FabricReport, HostFabric, LinkResult
from orchestrator.fabric.probe import Throughput, parse_iperf
from orchestrator.inventory import load_inventory
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.recipe import FabricSpec


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_rounds_cover_every_pair_once_and_no_host_twice(n):
    links = [topology.Link(f"h{i}", f"h{j}", "", "", "", "") for i in range(n) for j in range(i + 1, n)]
    plan = topology.rounds(links)
    flat = [lk for r in plan for lk in r]
    assert sorted(lk.name for lk in flat) == sorted(lk.name for lk in links)
    for r in plan:
        hosts = [h for lk in r for h in (lk.a, lk.b)]
        assert len(hosts) == len(set(hosts))
    assert len(plan) == (n - 1 if n % 2 == 0 else n)     # 8 hosts: 7 rounds of 4 pairs


def _inventory(tmp_path: Path, topology_: str, hosts: dict, **cvars) -> Path:
    """An inventory of HOSTS (name -> extra host vars), n1 the head, at 10.0.0.<i+1>; CVARS: more all.vars."""
    inv = {"all": {"vars": {"deployment": "fab", "recipe": "deepseek-v41-flash-tp4", "head": "n1",
                            "fabric_topology": topology_, **cvars},
                   "hosts": {name: {"ansible_host": f"10.0.0.{i + 1}", "rank": i, "hardware": "dgx-spark",
                                    "nvme_dir": "/nvme", "model_cache": "/models", **extra}
                             for i, (name, extra) in enumerate(hosts.items())}}}
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(inv))
    return p


MESH3 = {
    "n1": {"fabric_links": {"n2": {"iface": "enp1s0f0np0", "address": "192.168.10.1/30"},
                            "n3": {"iface": "enp1s0f1np1", "address": "192.168.12.2/30"}}},
    "n2": {"fabric_links": {"n1": {"iface": "enp1s0f1np1", "address": "192.168.10.2/30"},
                            "n3": {"iface": "enp1s0f0np0", "address": "192.168.11.1/30"}}},
    "n3": {"fabric_links": {"n2": {"iface": "enp1s0f1np1", "address": "192.168.11.2/30"},
                            "n1": {"iface": "enp1s0f0np0", "address": "192.168.12.1/30"}}},
}


def test_mesh_links_come_from_the_inventory_each_cable_once(tmp_path):
    c = load_inventory(_inventory(tmp_path, "mesh", MESH3))
    links = topology.links(c, {})
    assert [(lk.name, lk.a_addr, lk.b_addr, lk.network) for lk in links] == [
        ("n1-n2", "192.168.10.1", "192.168.10.2", "192.168.10.0/30"),
        ("n1-n3", "192.168.12.2", "192.168.12.1", "192.168.12.0/30"),
        ("n2-n3", "192.168.11.1", "192.168.11.2", "192.168.11.0/30")]


@pytest.mark.parametrize("change,key,words", [
    (("n2", "n3", "address", "192.168.99.1/30"), "fabric_links.n3", "two subnets"),
    (("n2", "n3", "address", "192.168.11.1"), "fabric_links.n3.address", "prefix"),
    (("n2", "n3", "iface", "bad name!"), "fabric_links.n3.iface", "interface name"),
])
def test_mesh_inventory_errors_name_the_key(tmp_path, change, key, words):
    hosts = yaml.safe_load(yaml.safe_dump(MESH3))
    h, peer, field, value = change
    hosts[h]["fabric_links"][peer][field] = value
    with pytest.raises(InputError) as e:
        load_inventory(_inventory(tmp_path, "mesh", hosts))
    assert key in (e.value.key or "") and words in str(e.value)
    assert e.value.exit_code == 2


def test_mesh_needs_both_ends_and_direct_needs_two_hosts(tmp_path):
    hosts = yaml.safe_load(yaml.safe_dump(MESH3))
    del hosts["n3"]["fabric_links"]["n1"]
    with pytest.raises(InputError, match="none back to n1"):
        load_inventory(_inventory(tmp_path, "mesh", hosts))
    with pytest.raises(InputError, match="two hosts"):
        load_inventory(_inventory(tmp_path, "direct", {k: {} for k in MESH3}))
    with pytest.raises(InputError, match="fabric_topology"):
        load_inventory(_inventory(tmp_path, "star", {k: {} for k in MESH3}))
    with pytest.raises(InputError, match="IPv4 address"):
        load_inventory(_inventory(tmp_path, "switch", {"n1": {"fabric_address": "10.0.0.300/24"}, "n2": {}}))


def _host(name, iface="fab0", addr="10.1.0.1", network="10.1.0.0/24", mtu=9000, speed=200000, mgmt="eth0",
          state="up") -> HostFabric:
    return HostFabric(name, Fabric(iface, addr, (), "t", "", network), operstate=state, mtu=mtu,
                      speed_mbps=speed, management=mgmt, tools={"iperf3": True})


def _link(a, b, gbps, reach=True, df=True, expected=200.0):
    lk = topology.Link(a, b, "x", "y", "fab0", "fab0")
    return LinkResult(lk, {"a>b": reach, "b>a": True}, {"a>b": df, "b>a": df}, 9000, 0.1,
                      Throughput(gbps, 0), expected)


def test_verdicts_name_the_pair_and_the_reason():
    spec = FabricSpec(warn=("mtu",))
    hosts = [_host("n1"), _host("n2", addr="10.1.0.2"), _host("n3", addr="10.9.0.3", network="10.9.0.0/24"),
             _host("n4", addr="10.1.0.4", mtu=1500), _host("n5", iface="eth0", addr="10.1.0.5")]
    links = [_link("n1", "n2", 13.0), _link("n1", "n4", None, df=False), _link("n2", "n4", 150.0),
             _link("n1", "n3", None, reach=False), _link("n2", "n5", 150.0, df=False)]
    found = {(f.kind, f.where): f for f in verdicts.judge(hosts, links, spec, "switch")}
    assert found[("slow-link", "n1-n2")].stop and "13.00 Gb/s" in found[("slow-link", "n1-n2")].message
    assert ("slow-link", "n2-n4") not in found                   # 150 >= 0.25 x 200
    assert found[("subnet", "n3")].stop and "10.9.0.0/24" in found[("subnet", "n3")].message
    assert not found[("mtu", "n4")].stop                          # fabric.warn lists mtu
    assert "MTU mismatch on the path: n1 fab0 9000, n4 fab0 1500" in found[("mtu", "n1-n4")].message
    # equal MTUs at both ends, yet a full-size frame does not cross: a switch port in between
    assert "path MTU below 9000" in found[("mtu", "n2-n5")].message
    assert "n1 -> n3" in found[("unreachable", "n1-n3")].message
    assert found[("unreachable", "n1-n3")].stop
    assert found[("management", "n5")].stop
    assert ("slow-link", "n1-n4") not in found and found[("unmeasured", "n1-n4")]


def test_expected_rate_is_the_recipes_or_the_slower_negotiated_speed():
    assert verdicts.expected_gbps(FabricSpec(expected_gbps=100), _host("a"), _host("b")) == 100
    assert verdicts.expected_gbps(FabricSpec(), _host("a"), _host("b", speed=100000)) == 100
    assert verdicts.expected_gbps(FabricSpec(), _host("a"), _host("b", speed=None)) is None


def test_parse_iperf_reads_what_the_real_iperf3_prints():
    """A real iperf3 run on loopback (Debian's iperf3): the receiver's rate comes out, and a refused
    connection comes out as the error iperf3 reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            out = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "1", "-J"],
                                 capture_output=True, text=True, timeout=30).stdout
            if "refused" not in out:
                break
            time.sleep(0.1)
    finally:
        srv.wait(timeout=30)
    t = parse_iperf(out)
    assert t.gbps is not None and t.gbps > 0.1 and not t.error
    refused = subprocess.run(["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", "1", "-J"],
                             capture_output=True, text=True, timeout=30).stdout
    bad = parse_iperf(refused)
    assert bad.gbps is None and "refused" in bad.error.lower()
    assert parse_iperf("sh: iperf3: not found").error == "sh: iperf3: not found"


def test_mesh_nccl_settings_bootstrap_on_management_and_list_every_hca():
    facts = {"net": {"enP7s7": {"operstate": "up", "addrs": ["10.0.0.1"]},
                     "enp1s0f0np0": {"operstate": "up", "addrs": ["192.168.10.1"]}},
             "rdma": [{"dev": "rocep1s0f0", "state": "4: ACTIVE", "link_layer": "Ethernet", "netdevs": []},
                      {"dev": "rocep1s0f1", "state": "4: ACTIVE", "link_layer": "Ethernet", "netdevs": []}]}
    f = mesh_fabric("n1", facts, "10.0.0.1")
    env = fabric_env(f)
    assert env["NCCL_SOCKET_IFNAME"] == "enP7s7" and env["VLLM_HOST_IP"] == "10.0.0.1"
    assert env["NCCL_IB_HCA"] == "rocep1s0f0,rocep1s0f1"
    assert env["NCCL_IB_MERGE_NICS"] == "0" and env["NCCL_NET_PLUGIN"] == "none"
    assert env["NCCL_IB_SUBNET_AWARE_ROUTING"] == "1" and "NCCL_IB_GID_INDEX" not in env
    assert "NCCL_IB_ADDR_RANGE" not in env


def _ring4() -> dict:
    """4 hosts in a ring: n1-n2, n2-n3, n3-n4, n4-n1, each cable its own /30."""
    cables = [("n1", "n2"), ("n2", "n3"), ("n3", "n4"), ("n4", "n1")]
    hosts: dict = {n: {"fabric_links": {}} for n in ("n1", "n2", "n3", "n4")}
    for i, (a, b) in enumerate(cables):
        hosts[a]["fabric_links"][b] = {"iface": "enp1s0f0np0", "address": f"192.168.{20 + i}.1/30"}
        hosts[b]["fabric_links"][a] = {"iface": "enp1s0f1np1", "address": f"192.168.{20 + i}.2/30"}
    return hosts


def test_planned_mesh_launch_says_its_nccl_settings_and_masters_on_management(tmp_path):
    from orchestrator.launch.containerspec import planned_spec
    dep = load_deployment(_inventory(tmp_path, "mesh", _ring4()))
    links = topology.links(dep.cluster, {})
    assert [lk.name for lk in links] == ["n1-n2", "n1-n4", "n2-n3", "n3-n4"]    # a ring: no n1-n3
    spec = planned_spec(dep, dep.cluster.host("n3"))
    assert "10.0.0.1" in " ".join(spec.argv)          # the head's management address is the master
    assert "mesh: NCCL bootstrap" in spec.fabric_note and "NCCL_IB_SUBNET_AWARE_ROUTING=1" in spec.fabric_note
    assert "NCCL_ALGO=Ring" in spec.fabric_note          # a ring: not every pair cabled
    from dataclasses import replace
    facts = {"net": {"eno1": {"operstate": "up", "addrs": ["10.0.0.3"]}},
             "rdma": [{"dev": "rocep1s0f0", "state": "4: ACTIVE", "link_layer": "Ethernet", "netdevs": []}]}
    from orchestrator.fabric import detect
    f = detect.for_host(dep.cluster, dep.cluster.host("n3"), {}, facts)
    assert f.topology == "ring" and fabric_env(f)["NCCL_ALGO"] == "Ring"
    assert "NCCL_ALGO" not in fabric_env(replace(f, topology="mesh"))


def test_checked_in_ring_inventory_plans_every_cable(tmp_path):
    dep = load_deployment(INVENTORIES_DIR / "spark4-ring.yml")
    links = topology.links(dep.cluster, {})
    assert [(lk.name, lk.a_iface, lk.b_iface) for lk in links] == [
        ("spark1-spark2", "enp1s0f0np0", "enp1s0f1np1"), ("spark1-spark4", "enp1s0f1np1", "enp1s0f0np0"),
        ("spark2-spark3", "enp1s0f0np0", "enp1s0f1np1"), ("spark3-spark4", "enp1s0f0np0", "enp1s0f1np1")]
    ports = {h.name: netplan.ports(dep.cluster, h, None) for h in dep.cluster.hosts}
    files = {n: netplan.render(n, "spark4-ring", "mesh", p, 9000) for n, p in ports.items()}
    netplan.validate(files, ports, 9000)


def test_netplan_files_pass_the_real_netplan_generate(tmp_path):
    c = load_inventory(_inventory(tmp_path, "mesh", MESH3))
    ports = {h.name: netplan.ports(c, h, None) for h in c.hosts}
    files = {h.name: netplan.render(h.name, c.name, "mesh", ports[h.name], 9000) for h in c.hosts}
    netplan.validate(files, ports, 9000)
    doc = yaml.safe_load(files["n1"])["network"]["ethernets"]
    assert doc["enp1s0f0np0"]["addresses"] == ["192.168.10.1/30"] and doc["enp1s0f0np0"]["mtu"] == 9000
    # a broken file is refused, naming the host
    ports["n2"] = [netplan.Port("enp1s0f0np0", "192.168.11.1/30")]
    with pytest.raises(InputError, match="host n2"):
        netplan.validate({"n2": files["n2"].replace("addresses:", "addresses: 5\n      x:")}, ports, 9000)


def test_switch_netplan_needs_the_prefix_and_a_port(tmp_path):
    c = load_inventory(_inventory(tmp_path, "switch", {"n1": {"fabric_address": "192.168.100.11"},
                                                         "n2": {"fabric_address": "192.168.100.12/24",
                                                                "fabric_iface": "enp1s0f1np1"}}))
    with pytest.raises(InputError, match="prefix") as e:
        netplan.ports(c, c.host("n1"), None)
    assert e.value.key == "all.hosts.n1.fabric_address"
    assert netplan.ports(c, c.host("n2"), None) == [netplan.Port("enp1s0f1np1", "192.168.100.12/24")]
    facts = {"net": {}, "rdma": [{"dev": "rocep1s0f0", "state": "4: ACTIVE", "netdevs": ["enp1s0f0np0"]}]}
    c2 = load_inventory(_inventory(tmp_path, "switch", {"n1": {"fabric_address": "192.168.100.11/24"}, "n2": {}}))
    assert netplan.ports(c2, c2.host("n1"), facts) == [netplan.Port("enp1s0f0np0", "192.168.100.11/24")]


def test_report_names_the_slowest_link_and_every_stop():
    spec = FabricSpec()
    hosts = [_host("n1"), _host("n2", addr="10.1.0.2"), _host("n3", addr="10.1.0.3")]
    links = [_link("n1", "n2", 180.0), _link("n1", "n3", 12.9), _link("n2", "n3", 170.0)]
    r = FabricReport("switch", tuple(hosts), tuple(links), tuple(verdicts.judge(hosts, links, spec, "switch")), 3.0)
    text = "\n".join(report.lines(r))
    assert "slowest link: n1-n3 12.90 Gb/s" in text
    assert "STOP slow-link n1-n3" in text and not r.ok
    assert r.to_json()["slowest"] == "n1-n3"


def test_fabric_recipe_settings_are_checked():
    from orchestrator.recipe import load_recipe
    for bad, key in (("fabric.min_fraction=0", "min_fraction"), ("fabric.mtu=100", "mtu"),
                     ("fabric.warn=[\"slow\"]", "warn[0]")):
        with pytest.raises(InputError) as e:
            load_recipe("deepseek-v41-flash-tp4", [bad])
        assert key in str(e.value)
    assert INVENTORIES_DIR.exists()


PERFTEST_OUT = """\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF          Device         : rocep1s0f0
 Number of qps   : 4            Transport type : IB
 Link type       : Ethernet
 GID index       : 3
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
Conflicting CPU frequency values detected: 1500.000000 != 3300.016000. CPU Frequency is not max.
 65536      560845           0.00               92.57                0.176562
---------------------------------------------------------------------------------------
"""


def test_parse_perftest_reads_the_average_column_past_warnings():
    """ib_write_bw --report_gbits's table as perftest prints it (the layout of NVIDIA dgx-spark-playbooks
    performance_benchmarking_guide.md's run, 92.57 Gb/s on one Spark port); a warning line may sit
    between the header and the row."""
    from orchestrator.fabric.probe import parse_perftest
    assert parse_perftest(PERFTEST_OUT).gbps == 92.57
    bad = parse_perftest(" Couldn't connect to 10.0.0.2:5202\nUnable to init the socket connection")
    assert bad.gbps is None and "socket" in bad.error


def test_a_link_finding_reaches_both_ends_even_when_host_names_hold_a_dash():
    """Findings carry the hosts they concern: a host's log and result never parse "a-b" apart."""
    hosts = [_host("spark-1"), _host("spark-2", addr="10.1.0.2"), _host("spark-3", addr="10.1.0.3")]
    links = [_link("spark-1", "spark-2", 12.0), _link("spark-1", "spark-3", 150.0)]
    found = verdicts.judge(hosts, links, FabricSpec(), "switch")
    assert [(f.where, f.hosts) for f in found] == [("spark-1-spark-2", ("spark-1", "spark-2"))]
    r = FabricReport("switch", tuple(hosts), tuple(links), tuple(found), 1.0)
    assert any("STOP slow-link spark-1-spark-2" in x for x in report.lines(r, "spark-2"))
    assert not any("STOP" in x for x in report.lines(r, "spark-3"))
    rows = [x.split()[0] for x in report.lines(r, "spark-3") if x.startswith("  spark-")]
    assert rows == ["spark-3", "spark-1-spark-3"]          # its host row and its one link
