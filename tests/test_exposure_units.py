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
