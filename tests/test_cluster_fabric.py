"""The test cluster's fabric: a second network (bridge dctl<i>fb, fab0 in every host, MTU 9000) apart from
the management one SSH uses, and its fault/shaping helpers, checked with real traffic (ping, iperf3)."""
from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster import TestCluster, cleanup, cluster_lock, plan_hosts, subnet_index
from tests.cluster.cluster import (MAX_HOSTS, State, fabric_address, fabric_bridge_name, inventory_data,
                                   mesh_iface)

REPO = Path(__file__).resolve().parents[1]
NAME = "fabtest"             # this module's own cluster (never the session's or a person's)
LOST = "fabtest-lost"        # brought up briefly to lose its state record
cluster_test = pytest.mark.cluster
_ports = itertools.count(5301)


# ---------------------------------------------------------------------------------------------------
# pure

def test_plan_gives_each_host_a_fabric_address_with_its_management_octet():
    i = subnet_index(NAME)
    hosts = plan_hosts(NAME, 3)
    assert [h.fabric_address for h in hosts] == [f"10.214.{i}.11", f"10.214.{i}.12", f"10.214.{i}.13"]
    for k, h in enumerate(hosts, 1):
        assert h.fabric_iface == "fab0" and h.fabric_cidr == f"{h.fabric_address}/24"
        assert h.fabric_address.split(".")[3] == h.address.split(".")[3]
        assert h.fabric_address == fabric_address(NAME, k) and h.fabric_veth == f"dctl{i}f{k}"
    assert fabric_bridge_name(NAME) == f"dctl{i}fb"
    assert plan_hosts("local", 1)[0].fabric_address == "10.214.0.11"


def test_interface_names_fit_the_kernel_limit():
    name = next(f"n{j}" for j in itertools.count() if subnet_index(f"n{j}") == 254)   # the longest index
    hosts = plan_hosts(name, MAX_HOSTS)
    names = [fabric_bridge_name(name)] + [n for h in hosts for n in (h.veth, h.fabric_veth, mesh_iface(h))]
    assert max(len(n) for n in names) <= 15, max(names, key=len)
    assert len({h.fabric_veth for h in hosts}) == MAX_HOSTS


def test_inventory_gives_every_host_its_fabric_address_in_cidr_form():
    hosts = plan_hosts(NAME, 3)
    inv = inventory_data(NAME, hosts)
    for h in hosts:
        hv = inv["all"]["hosts"][h.name]
        assert hv["fabric_address"] == f"{h.fabric_address}/24"
        assert "fabric_iface" not in hv          # only the address is new in the inventory


# ---------------------------------------------------------------------------------------------------
# the cluster

@pytest.fixture(scope="module")
def fab():
    with cluster_lock(NAME, log=print):
        c = TestCluster.up(NAME, 3)
        try:
            yield c
        finally:
            c.down()


def ping(c: TestCluster, src: str, addr: str, *opts: str) -> bool:
    return c.nsexec(src, ["ping", "-c1", "-W1", *opts, addr], timeout=10).returncode == 0


def df_ping(c: TestCluster, src: str, addr: str, size: int = 8972) -> bool:
    """A don't-fragment ping of SIZE bytes (8972 + 28 header bytes = a 9000-byte packet)."""
    return ping(c, src, addr, "-M", "do", "-s", str(size))


def iperf(c: TestCluster, src: str, dst: str, seconds: int = 3) -> float:
    """Mbit/s of one iperf3 TCP run from SRC to DST's fabric address (as DST received it)."""
    d = c.host(dst)
    port = next(_ports)
    server = subprocess.Popen(["nsenter", f"--net={d.netns_path}", "iperf3", "-s", "-1", "-B", d.fabric_address,
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while f":{port}" not in c.nsexec(dst, ["ss", "-Hltn", f"sport = :{port}"]).stdout:
            assert server.poll() is None and time.monotonic() < deadline, f"iperf3 server on {dst}: {server.stderr}"
            time.sleep(0.05)
        r = c.nsexec(src, ["iperf3", "-c", d.fabric_address, "-p", str(port), "-t", str(seconds), "-J"],
                     timeout=seconds + 30)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr
        mbit = json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"] / 1e6
        print(f"iperf3 {src} -> {dst}: {mbit:.1f} Mbit/s", file=sys.stderr)
        return mbit
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def fab0(c: TestCluster, host: str) -> dict:
    r = c.nsexec(host, ["ip", "-j", "addr", "show", "dev", "fab0"])
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)[0]


@cluster_test
def test_fab0_exists_with_jumbo_mtu_and_its_address(fab):
    fb = fab.fabric_bridge
    br = json.loads(subprocess.run(["ip", "-j", "addr", "show", "dev", fb], capture_output=True, text=True,
                                   check=True).stdout)[0]
    assert br["mtu"] == 9000 and "UP" in br["flags"]
    assert [f"{a['local']}/{a['prefixlen']}" for a in br["addr_info"] if a["family"] == "inet"] == \
        [f"{fab.fabric_bridge_address}/24"]
    for h in fab.hosts:
        info = fab0(fab, h.name)
        assert info["mtu"] == 9000 and "UP" in info["flags"] and "LOWER_UP" in info["flags"], info
        assert [f"{a['local']}/{a['prefixlen']}" for a in info["addr_info"] if a["family"] == "inet"] == \
            [h.fabric_cidr]
        peer = json.loads(subprocess.run(["ip", "-j", "link", "show", "dev", h.fabric_veth], capture_output=True,
                                         text=True, check=True).stdout)[0]
        assert peer["master"] == fb and peer["mtu"] == 9000 and "UP" in peer["flags"], peer
        # the management network is apart: eth0 keeps its own address and the usual MTU
        eth0 = json.loads(fab.nsexec(h, ["ip", "-j", "addr", "show", "dev", "eth0"]).stdout)[0]
        assert eth0["mtu"] == 1500 and [a["local"] for a in eth0["addr_info"] if a["family"] == "inet"] == [h.address]
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True, check=True).stdout
    assert f"-A FORWARD -i {fb} -o {fb} -m comment --comment dctl-testcluster-{NAME}-fabric -j ACCEPT" in rules
    assert State.load(NAME).fabric_bridge == fb


@cluster_test
def test_hosts_reach_each_other_over_the_fabric_and_management(fab):
    for a, b in itertools.permutations(fab.hosts, 2):
        assert ping(fab, a.name, b.fabric_address), f"{a.name} -> {b.name} {b.fabric_address} (fabric)"
        assert ping(fab, a.name, b.address), f"{a.name} -> {b.name} {b.address} (management)"
    for h in fab.hosts:                                      # SSH goes over the management network
        r = fab.ssh_target(h).run(["sh", "-c", "ip -4 -o addr show fab0"], timeout=20)
        assert r.rc == 0 and f"inet {h.fabric_cidr}" in r.stdout, r


@cluster_test
def test_jumbo_frames_pass_until_a_hosts_mtu_drops(fab):
    n1, n3 = fab.host("node1"), fab.host("node3")
    assert df_ping(fab, "node1", n3.fabric_address) and df_ping(fab, "node3", n1.fabric_address)
    fab.set_fabric_mtu("node3", 1500)
    fab.set_fabric_mtu("node3", 1500)                        # idempotent
    try:
        assert fab0(fab, "node3")["mtu"] == 1500
        assert not df_ping(fab, "node1", n3.fabric_address), "a 9000-byte packet reached a 1500-MTU fab0"
        assert df_ping(fab, "node1", n3.fabric_address, 1472)          # a 1500-byte one still does
        assert df_ping(fab, "node1", fab.host("node2").fabric_address)   # other hosts keep jumbo frames
    finally:
        fab.set_fabric_mtu("node3", 9000)
    assert fab0(fab, "node3")["mtu"] == 9000 and df_ping(fab, "node1", n3.fabric_address)


@cluster_test
def test_throttle_shapes_only_that_link_both_ways(fab):
    fab.throttle_link("node1", "node2", 200)
    fab.throttle_link("node1", "node2", 200)                  # idempotent
    try:
        assert fab.throttled("node1") == {"node2": 200.0} and fab.throttled("node2") == {"node1": 200.0}
        assert fab.throttled("node3") == {}
        assert 180 <= iperf(fab, "node1", "node2") <= 220
        assert 180 <= iperf(fab, "node2", "node1") <= 220
        assert iperf(fab, "node1", "node3") > 1000            # node1's other traffic: full speed
        assert ping(fab, "node1", fab.host("node2").address)   # management untouched
    finally:
        fab.unthrottle_link("node2", "node1")                   # either order
    fab.unthrottle_link("node1", "node2")                       # idempotent
    assert fab.throttled("node1") == {} and fab.throttled("node2") == {}
    for h in ("node1", "node2"):
        qd = subprocess.run(["tc", "-n", fab.host(h).netns, "qdisc", "show", "dev", "fab0"], capture_output=True,
                            text=True).stdout
        assert "htb" not in qd, qd                             # back to fab0 as made
    assert iperf(fab, "node1", "node2") > 1000


@cluster_test
def test_two_throttled_links_on_one_host_come_off_one_at_a_time(fab):
    fab.throttle_link("node1", "node2", 200)
    fab.throttle_link("node3", "node1", 100)
    try:
        assert fab.throttled("node1") == {"node2": 200.0, "node3": 100.0}
        fab.unthrottle_link("node1", "node2")
        assert fab.throttled("node1") == {"node3": 100.0} and fab.throttled("node2") == {}
        assert 90 <= iperf(fab, "node1", "node3") <= 110         # the other link stays shaped
        assert iperf(fab, "node1", "node2") > 1000
    finally:
        fab.unthrottle_link("node1", "node3")
        fab.unthrottle_link("node1", "node2")
    assert fab.throttled("node1") == {} and fab.throttled("node3") == {}


@cluster_test
def test_set_fabric_address_moves_a_host_off_the_subnet(fab):
    n2 = fab.host("node2")
    other = f"10.214.{(subnet_index(NAME) + 1) % 256}.12/24"
    fab.set_fabric_address(n2, other)
    fab.set_fabric_address(n2, other)                         # idempotent
    try:
        assert fab.fabric_addresses(n2) == [other]
        assert not ping(fab, "node1", n2.fabric_address)
        assert ping(fab, "node1", n2.address)                  # management untouched
        st = {s["host"]: s for s in fab.status()}["node2"]
        assert st["fabric_address"] == other and st["fabric_planned"] == n2.fabric_cidr
    finally:
        fab.set_fabric_address(n2, n2.fabric_cidr)
    assert fab.fabric_addresses(n2) == [n2.fabric_cidr] and ping(fab, "node1", n2.fabric_address)


@cluster_test
def test_mesh_link_is_a_direct_cable(fab):
    x = subnet_index(NAME)
    a_cidr, b_cidr = f"10.215.{x}.1/30", f"10.215.{x}.2/30"
    assert fab.mesh_link("node1", "node3", a_cidr, b_cidr) == ("mesh3", "mesh1")
    assert fab.mesh_link("node1", "node3", a_cidr, b_cidr) == ("mesh3", "mesh1")     # idempotent
    rec = State.load(NAME).mesh_links
    assert rec == [{"hosts": ["node1", "node3"], "ifaces": {"node1": "mesh3", "node3": "mesh1"},
                    "netns": {"node1": fab.host("node1").netns, "node3": fab.host("node3").netns}}]
    assert ping(fab, "node1", b_cidr.split("/")[0]) and ping(fab, "node3", a_cidr.split("/")[0])
    assert df_ping(fab, "node3", a_cidr.split("/")[0])
    assert not ping(fab, "node2", b_cidr.split("/")[0])        # no bridge: only the two ends
    fab.remove_mesh_link("node3", "node1")                      # either order
    fab.remove_mesh_link("node1", "node3")                      # idempotent
    assert State.load(NAME).mesh_links == []
    for h, iface in (("node1", "mesh3"), ("node3", "mesh1")):
        assert fab.nsexec(h, ["ip", "link", "show", "dev", iface]).returncode != 0
    assert ping(fab, "node1", fab.host("node3").fabric_address)
    fab.mesh_link("node1", "node3", a_cidr, b_cidr)             # left for the cleanup test
    assert ping(fab, "node1", b_cidr.split("/")[0])


@cluster_test
def test_status_shows_the_fabric(fab):
    for s in fab.status():
        h = fab.host(s["host"])
        assert (s["fabric_address"], s["fabric_link"], s["fabric_mtu"]) == (h.fabric_cidr, "up", 9000), s
    fab.link_down("node2", "fab0")
    try:
        assert {s["host"]: s for s in fab.status()}["node2"]["fabric_link"] == "down"
    finally:
        fab.link_up("node2", "fab0")
    r = subprocess.run([sys.executable, "-m", "tests.cluster", "status", "--name", NAME], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert fab.fabric_bridge in r.stdout
    for h in fab.hosts:
        line = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == [h.name])
        assert h.fabric_cidr in line and re.search(r"fab0 up\s+mtu 9000", line), line


@cluster_test
def test_inventory_file_has_the_fabric_addresses(fab):
    inv = yaml.safe_load(fab.inventory_path.read_text())
    assert {n: hv["fabric_address"] for n, hv in inv["all"]["hosts"].items()} == \
        {h.name: h.fabric_cidr for h in fab.hosts}


def leftovers(name: str) -> list[str]:
    """Whatever of cluster NAME is still on this machine: links, namespaces, iptables rules, folder."""
    i = subnet_index(name)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left = [m.group(1) for m in re.finditer(rf"^\d+: (dctl{i}(?:br|fb|n\d+|f\d+))[@:]", links, re.M)]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left += [ln.split()[0] for ln in netns.splitlines() if re.match(rf"dctl-{re.escape(name)}-node\d+\b", ln)]
    rules = subprocess.run(["iptables", "-S", "FORWARD"], capture_output=True, text=True).stdout
    left += [ln for ln in rules.splitlines() if re.search(rf"dctl-testcluster-{re.escape(name)}(-fabric)?\s", ln)]
    if State.path(name).parent.exists():
        left.append(str(State.path(name).parent))
    return left


@cluster_test
def test_down_leaves_nothing_of_the_cluster(fab):
    # as the earlier tests left it (a mesh link), plus a throttled link and a lowered MTU
    fab.throttle_link("node2", "node3", 50)
    fab.set_fabric_mtu("node2", 1500)
    assert len(leftovers(NAME)) >= 2 + 2 * 3 + 3 + 2 + 1
    removed = fab.down()
    assert "mesh node1-node3" in removed and f"bridge {fab.fabric_bridge}" in removed
    assert leftovers(NAME) == []


@cluster_test
def test_cleanup_without_the_state_record_still_removes_the_fabric():
    with cluster_lock(LOST, log=print):
        c = TestCluster.up(LOST, 2)
        try:
            c.mesh_link("node1", "node2", "10.215.250.1/30", "10.215.250.2/30")
            c.throttle_link("node1", "node2", 100)
            assert ping(c, "node1", c.host("node2").fabric_address)
            State.path(LOST).unlink()                             # a lost record: only the names are left
            cleanup(LOST)
            assert leftovers(LOST) == []
        finally:
            cleanup(LOST)
