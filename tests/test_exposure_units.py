"""orchestrator/launch/exposure.py without a cluster: ss, ip and docker top output as iproute2 and
Docker print them, and the scope and concern given to each socket. The real engine's sockets are
read on the test cluster in tests/test_real_vllm.py."""
from __future__ import annotations

import json

from orchestrator.inventory import Host
from orchestrator.launch import exposure as E

SS = """\
tcp   LISTEN 0      4096         0.0.0.0:18110      0.0.0.0:*    users:(("vllm",pid=4101,fd=22))
tcp   LISTEN 0      128                *:29611            *:*    users:(("VLLM::EngineCor",pid=4190,fd=9),("python3",pid=4188,fd=9))
tcp   LISTEN 0      128     10.214.215.11:41234   0.0.0.0:*    users:(("pt_main_thread",pid=4190,fd=30))
tcp   LISTEN 0      128        127.0.0.1:35555    0.0.0.0:*    users:(("vllm",pid=4101,fd=40))
tcp   LISTEN 0      128     10.213.215.11:2222    0.0.0.0:*    users:(("python3",pid=4101,fd=41))
udp   UNCONN 0      0      127.0.0.53%lo:53         0.0.0.0:*    users:(("systemd-resolve",pid=1,fd=13))
tcp   LISTEN 0      128             [::]:22             [::]:*    users:(("sshd",pid=10,fd=4))
tcp   LISTEN 0      128                *:9999             *:*
"""
IP = json.dumps([{"ifname": "lo", "addr_info": [{"local": "127.0.0.1"}, {"local": "::1"}]},
                 {"ifname": "eth0", "addr_info": [{"local": "10.213.215.11"}]},
                 {"ifname": "fab0", "addr_info": [{"local": "10.214.215.11"}]}])
HOST = Host("node1", "10.213.215.11", 0, "cpu", 0, "/nvme", "/cache", fabric_iface="fab0")


def test_ss_lines_become_one_socket_per_process():
    got = [(s.proto, s.address, s.port, s.process, s.pid) for s in E.parse_ss(SS)]
    assert got == [("tcp", "0.0.0.0", 18110, "vllm", 4101),
                   ("tcp", "*", 29611, "VLLM::EngineCor", 4190), ("tcp", "*", 29611, "python3", 4188),
                   ("tcp", "10.214.215.11", 41234, "pt_main_thread", 4190),
                   ("tcp", "127.0.0.1", 35555, "vllm", 4101),
                   ("tcp", "10.213.215.11", 2222, "python3", 4101),
                   ("udp", "127.0.0.53", 53, "systemd-resolve", 1),
                   ("tcp", "::", 22, "sshd", 10)], "no process: not ours to list"
    assert E.parse_top("PID\n4101\n4188\n4190\n") == {4101, 4188, 4190}
    assert E.parse_addresses(IP) == {"127.0.0.1": "lo", "::1": "lo", "10.213.215.11": "eth0",
                                     "10.214.215.11": "fab0"}
    assert E.parse_addresses("not json") == {}


def test_scope_reach_and_concern():
    addrs = E.parse_addresses(IP)
    by = {(s.address, s.port): E.classify(s, HOST, addrs, api_port=18110) for s in E.parse_ss(SS)}
    api, store = by[("0.0.0.0", 18110)], by[("*", 29611)]
    assert api.scope == "every interface" and not api.concern, "the API is meant to be reached"
    assert "10.213.215.11 (eth0, management)" in api.reachable_from
    assert "10.214.215.11 (fab0, fabric)" in api.reachable_from
    assert store.scope == "every interface" and "management network" in store.concern
    gloo = by[("10.214.215.11", 41234)]
    assert (gloo.scope, gloo.concern) == ("fabric", "") and "fab0" in gloo.reachable_from
    assert by[("127.0.0.1", 35555)].scope == "loopback" and not by[("127.0.0.1", 35555)].concern
    mgmt = by[("10.213.215.11", 2222)]
    assert mgmt.scope == "management" and mgmt.concern
    sup = E.classify(E.Socket("tcp", "10.213.215.11", 8790, "python3", 1), HOST, addrs, api_port=18110, served=(8790,))
    assert sup.scope == "management" and not sup.concern, "the supervisor's port is meant for the management network"
    assert E.classify(E.Socket("tcp", "0.0.0.0", 8790, "python3", 1), HOST, addrs, api_port=18110,
                      served=(8790,)).concern, "... bound to it, not to every interface"
    # on a worker no port is the API: its wildcard listeners are all internal
    assert E.classify(E.parse_ss(SS)[0], HOST, addrs, api_port=-1).concern


INV = """\
all:
  vars:
    recipe: deepseek-v41-flash-tp4
    head: s1
{extra}  hosts:
    s1: {{ansible_host: 192.0.2.1, rank: 0, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}}
    s2: {{ansible_host: 192.0.2.2, rank: 1, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}}
    s3: {{ansible_host: 192.0.2.3, rank: 2, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}}
    s4: {{ansible_host: 192.0.2.4, rank: 3, hardware: dgx-spark, gpus: 1, nvme_dir: /n, model_cache: /m}}
"""


def _plan(tmp_path, extra: str = ""):
    import subprocess
    import sys
    inv = tmp_path / "inv.yml"
    inv.write_text(INV.format(extra=extra))
    p = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "-i", str(inv), "--json"],
                       capture_output=True, text=True, timeout=120)
    return p, (json.loads(p.stdout) if p.returncode == 0 else None)


def _argv_hosts(doc) -> dict[str, str]:
    launch = next(s for s in doc["stages"] if s["name"] == "launch")
    out = {}
    for a in launch["actions"]:
        argv = a.get("command") or []
        if a.get("op") == "docker-run" and "--host" in argv:
            out[a["host"]] = argv[argv.index("--host") + 1]
    return out


def test_the_api_listens_on_the_heads_management_address_unless_the_inventory_widens_it(tmp_path):
    p, doc = _plan(tmp_path)
    assert p.returncode == 0, p.stderr
    assert doc["api_listen"] == {"address": "192.0.2.1", "scope": "the head's management address"}
    assert doc["api"] == "http://192.0.2.1:8000"
    assert _argv_hosts(doc) == {"s1": "192.0.2.1", "s2": "192.0.2.2", "s3": "192.0.2.3", "s4": "192.0.2.4"}

    p, doc = _plan(tmp_path, "    api_listen: 0.0.0.0\n")
    assert p.returncode == 0, p.stderr
    assert doc["api_listen"]["scope"].startswith("every interface"), "an explicit widening is said in the plan"
    assert doc["api"] == "http://192.0.2.1:8000", "probes still go to the management address"
    assert set(_argv_hosts(doc).values()) == {"0.0.0.0"}

    p, doc = _plan(tmp_path, "    api_listen: 198.51.100.7\n")     # a service address of the head's
    assert doc["api"] == "http://198.51.100.7:8000" and _argv_hosts(doc)["s1"] == "198.51.100.7"

    p, _ = _plan(tmp_path, "    api_listen: '1.2.3.4; rm -rf /'\n")
    assert p.returncode == 2 and "all.vars.api_listen" in p.stderr and "inv.yml" in p.stderr, p.stderr


# ------------------------------------------------------------------------ the firewall chain (#37)

def _dep(tmp_path, extra: str = "", name: str = "fw"):
    from orchestrator.deployment import load_deployment
    inv = tmp_path / f"{name}.yml"
    inv.write_text(INV.format(extra=extra).replace("192.0.2.1, rank: 0", "192.0.2.1, fabric_address: 198.18.0.1/24, rank: 0")
                   .replace("192.0.2.2, rank: 1", "192.0.2.2, fabric_address: 198.18.0.2/24, rank: 1"))
    return load_deployment(inv)


def test_the_rendezvous_store_is_confined_to_the_fabric_and_the_api_to_api_allow(tmp_path):
    from orchestrator.launch import firewall as F
    dep = _dep(tmp_path)
    head, worker = dep.cluster.hosts[0], dep.cluster.hosts[1]
    detected = {"s1": ("198.18.0.1", "198.18.0.0/24"), "s3": ("198.18.0.3", "198.18.0.0/24"),
                "s4": ("198.18.1.4", "")}
    rs = F.ruleset(dep, head, detected)
    port, ch = dep.recipe.engine.master_port, F.chain_name(dep.name)
    assert rs.chain == ch and len(ch) <= 28
    v4 = rs.v4.splitlines()
    assert v4[:5] == ["*filter", f":{ch} - [0:0]", f"-A {ch} -i lo -j RETURN",
                      f"-A {ch} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN",
                      f"-A {ch} -p tcp --dport {dep.api_port} -j RETURN"], "the API untouched without api_allow"
    assert v4[-1] == "COMMIT"
    store = [ln for ln in v4 if f"--dport {port} " in ln]
    assert [ln.split(" -s ")[1].split()[0] for ln in store[:-1]] == [
        "198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.1.4"], "the fabric addresses, inventory and detected"
    assert store[-1] == f"-A {ch} -p tcp --dport {port} -j REJECT --reject-with tcp-reset"
    eph = [ln for ln in v4 if "EPHEMERAL" in ln]
    assert eph == [f"-A {ch} -d 198.18.0.1 -p tcp --dport EPHEMERAL -s 198.18.0.0/24 -j RETURN",
                   f"-A {ch} -d 198.18.0.1 -p tcp --dport EPHEMERAL -s 198.18.1.4/32 -j RETURN",
                   f"-A {ch} -d 198.18.0.1 -p tcp --dport EPHEMERAL -j REJECT --reject-with tcp-reset"], \
        "the fabric listeners: the fabric's subnets (an address where the subnet is unknown)"
    sup = dep.recipe.supervise.port
    control = [ln for ln in v4 if f"--dport {sup} " in ln]
    assert control == [*(f"-A {ch} -p tcp --dport {sup} -s {h.address} -j RETURN" for h in dep.cluster.hosts),
                       f"-A {ch} -p tcp --dport {sup} -j REJECT --reject-with tcp-reset"], \
        "the supervisor's control port: the deployment's management addresses only"
    assert "192.0.2." not in "".join(ln for ln in v4 if ln not in control), \
        "no management address is admitted elsewhere"
    assert " -s " not in rs.v6 and f"--dport {port} -j REJECT" in rs.v6, "IPv6: only loopback"
    w = F.ruleset(dep, worker, detected)
    assert f"--dport {port}" not in w.v4 and "-d 198.18.0.2 -p tcp --dport EPHEMERAL" in w.v4, \
        "a worker: no store, its own fabric listeners"

    dep = _dep(tmp_path, "    api_allow: [192.0.2.200, 203.0.113.0/24]\n")
    rs = F.ruleset(dep, dep.cluster.hosts[0])
    assert f"--dport {dep.api_port} -s 192.0.2.200/32 -j RETURN" in rs.v4
    assert f"--dport {dep.api_port} -s 203.0.113.0/24 -j RETURN" in rs.v4
    assert f"--dport {dep.api_port} -j REJECT" in rs.v4 and f"--dport {dep.api_port} -j RETURN" not in rs.v4
    assert F.ruleset(_dep(tmp_path, "    firewall: none\n"), head).empty
    dep = _dep(tmp_path, "    metrics_allow: [198.51.100.7]\n")         # the Prometheus host
    v4 = F.ruleset(dep, dep.cluster.hosts[0]).v4.splitlines()
    assert [ln for ln in v4 if f"--dport {sup} " in ln] == [
        *(f"-A {ch} -p tcp --dport {sup} -s {h.address} -j RETURN" for h in dep.cluster.hosts),
        f"-A {ch} -p tcp --dport {sup} -s 198.51.100.7/32 -j RETURN",
        f"-A {ch} -p tcp --dport {sup} -j REJECT --reject-with tcp-reset"], "the supervisor's port: + metrics_allow"
    assert "198.51.100.7" not in "".join(ln for ln in v4 if f"--dport {sup} " not in ln), "nothing else"

    p, doc = _plan(tmp_path)
    head_act = next(a for s in doc["stages"] if s["name"] == "launch" for a in s["actions"] if a["host"] == "s1")
    assert head_act["details"]["firewall"]["chain"].startswith("DCTL-") and "firewall: tcp" in head_act["summary"]
    for extra, key in (("    api_allow: [not-an-address]\n", "all.vars.api_allow[0]"),
                       ("    api_allow: 10.0.0.1\n", "all.vars.api_allow"),
                       ("    metrics_allow: [10.0.0.300]\n", "all.vars.metrics_allow[0]"),
                       ("    firewall: off\n", "all.vars.firewall")):
        p, _ = _plan(tmp_path, extra)
        assert p.returncode == 2 and key in p.stderr, (extra, p.stderr)


class _NetnsShell:
    """HostShell's run() in a scratch network namespace of this machine: the real iptables."""
    def __init__(self, ns):
        self.ns = ns

    def run(self, argv, timeout=60.0, stdin=None):
        import subprocess
        from orchestrator.executors.ssh import Result
        p = subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True, timeout=timeout)
        return Result(p.returncode, p.stdout, p.stderr)


def test_rules_apply_idempotently_are_read_back_and_removed_with_the_real_iptables(tmp_path):
    import subprocess
    from orchestrator.launch import firewall as F
    dep = _dep(tmp_path, "    api_allow: [192.0.2.200]\n")
    rs = F.ruleset(dep, dep.cluster.hosts[0])
    ns = f"dctl-fwunit-{tmp_path.name[-8:]}"
    subprocess.run(["ip", "netns", "add", ns], check=True, timeout=30)
    try:
        sh = _NetnsShell(ns)
        for _ in range(2):                       # a re-run: one jump, the same rules
            assert "firewall chain DCTL-" in F.apply_host(sh, rs)[0]
        for tool in ("iptables", "ip6tables"):
            s = sh.run([tool, "-S"]).stdout
            assert s.count(f"-j {rs.chain}") == 1 and f'--comment "deployctl {dep.name}"' in s, s
        sh.run(["sh", "-c", "echo 40000 50000 > /proc/sys/net/ipv4/ip_local_port_range"])
        F.apply_host(sh, rs)                     # the host's own ephemeral range, read there
        got = E.parse_chain(sh.run(["iptables", "-S", rs.chain]).stdout)
        mp = dep.recipe.engine.master_port
        assert got == [E.Guard("", mp, mp, ("198.18.0.1", "198.18.0.2")),
                       E.Guard("198.18.0.1", 40000, 50000, ("198.18.0.0/24",)),
                       E.Guard("", dep.api_port, dep.api_port, ("192.0.2.200",)),
                       E.Guard("", dep.recipe.supervise.page_at, dep.recipe.supervise.page_at, ("192.0.2.200",)),
                       E.Guard("", dep.recipe.supervise.port, dep.recipe.supervise.port,
                               tuple(h.address for h in dep.cluster.hosts))], got
        c = E.classify(E.Socket("tcp", "*", mp, "VLLM::Worker_TP", 1), dep.cluster.hosts[0], {}, dep.api_port,
                       got, rs.chain)
        assert not c.concern and c.reachable_from.startswith("only 198.18.0.1, 198.18.0.2 and loopback")
        gloo = E.classify(E.Socket("tcp", "198.18.0.1", 41234, "pt_main_thread", 1), dep.cluster.hosts[0],
                          {"198.18.0.1": "fab0"}, dep.api_port, got, rs.chain)
        assert gloo.reachable_from.startswith("only 198.18.0.0/24 and loopback"), gloo
        # a narrower ruleset replaces the chain's rules in one commit
        F.apply_host(sh, F.ruleset(_dep(tmp_path), dep.cluster.hosts[0]))
        assert all(g.low != dep.api_port for g in E.parse_chain(sh.run(["iptables", "-S", rs.chain]).stdout))
        # another deployment's chain left on this host guards the same supervisor port: said, by name
        other = F.ruleset(_dep(tmp_path, name="old1"), dep.cluster.hosts[0])
        port = dep.recipe.supervise.port
        for a, b, b_name in ((other, rs, dep.name), (rs, other, "old1")):     # each is told of the other
            clash = F.apply_host(sh, a)[1]
            assert any(c.startswith(f"deployment {b_name}'s firewall chain ({b.chain}) here also refuses "
                                    f"tcp {port} ") for c in clash), clash
        assert "removed iptables chain" in F.remove_host(sh, other.chain, "deployctl old1")
        assert F.apply_host(sh, rs)[1] == []
        assert "removed iptables chain" in F.remove_host(sh, rs.chain, f"deployctl {dep.name}")
        assert F.remove_host(sh, rs.chain, f"deployctl {dep.name}") == f"no firewall chain {rs.chain}"
        for tool in ("iptables", "ip6tables"):
            assert "DCTL-" not in sh.run([tool, "-S"]).stdout
    finally:
        subprocess.run(["ip", "netns", "del", ns], timeout=30)
