"""The chain's pure route (order, addresses, which network) and its host-side node, run here as local
processes over 127.0.0.1: pipelined forwarding, sha256 checked before a file takes its name, a stranger
without the run's secret refused while the real upstream still gets through."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.chain import route
from orchestrator.chain.run import BOOTSTRAP, SCRIPT
from orchestrator.errors import InputError
from orchestrator.hostside import chain_node, modelsync
from orchestrator.inventory import load_inventory
from tests.test_fabric_units import _inventory


def test_switch_chain_is_rank_order_over_the_fabric_addresses(tmp_path):
    c = load_inventory(_inventory(tmp_path, "switch", {f"n{k}": {"fabric_address": f"192.168.100.1{k}/24"}
                                                       for k in (1, 2, 3, 4)}, distribution="chain"))
    assert c.distribution == "chain"
    hops = route.route(c, "n1", ["n4", "n2", "n3"])
    assert [(h.upstream, h.host, h.address, h.network) for h in hops[1:]] == [
        ("n1", "n2", "192.168.100.12", "fabric"), ("n2", "n3", "192.168.100.13", "fabric"),
        ("n3", "n4", "192.168.100.14", "fabric")]
    assert route.networks_note(hops) == "chain n1 -> n2 -> n3 -> n4, every hop over the fabric"


def test_a_host_without_a_fabric_address_is_reached_over_management_and_the_plan_says_so(tmp_path):
    c = load_inventory(_inventory(tmp_path, "switch", {"n1": {"fabric_address": "192.168.100.11"}, "n2": {},
                                                       "n3": {"fabric_address": "192.168.100.13"}}))
    assert c.distribution == "direct"                     # the default
    hops = route.route(c, "n1", ["n2", "n3"])
    assert (hops[1].address, hops[1].network) == ("10.0.0.2", "management")
    assert "MANAGEMENT network to n2" in route.networks_note(hops)


RING = {  # n1-n2, n2-n4, n4-n3, n3-n1: rank order would cross a missing cable (n2-n3)
    "n1": {"fabric_links": {"n2": {"iface": "a", "address": "10.1.12.1/30"}, "n3": {"iface": "b", "address": "10.1.13.1/30"}}},
    "n2": {"fabric_links": {"n1": {"iface": "a", "address": "10.1.12.2/30"}, "n4": {"iface": "b", "address": "10.1.24.1/30"}}},
    "n3": {"fabric_links": {"n4": {"iface": "a", "address": "10.1.34.2/30"}, "n1": {"iface": "b", "address": "10.1.13.2/30"}}},
    "n4": {"fabric_links": {"n2": {"iface": "a", "address": "10.1.24.2/30"}, "n3": {"iface": "b", "address": "10.1.34.1/30"}}},
}


def test_ring_chain_follows_the_cables(tmp_path):
    c = load_inventory(_inventory(tmp_path, "mesh", RING))
    hops = route.route(c, "n1", ["n2", "n3", "n4"])
    assert [h.host for h in hops] == ["n1", "n2", "n4", "n3"]
    assert [h.address for h in hops[1:]] == ["10.1.12.2", "10.1.24.2", "10.1.34.2"]   # each its end of the cable
    assert all(h.network == "fabric" for h in hops[1:])


def test_a_repair_on_a_mesh_starts_from_a_node_cabled_to_the_first_unfinished_one(tmp_path):
    """#59 item 4: the ring's chain is n1 -> n2 -> n4 -> n3. n4 dies mid-chain: n3 is left unfinished.
    By rank order the repair came from n2, the last complete node before n3 (rank 2), which has no cable
    to n3, so the pass ran over the management network; along the route, the complete node next to n3
    with a cable to it is the head n1, and the repair pass is one cable."""
    c = load_inventory(_inventory(tmp_path, "mesh", RING))
    hops = route.route(c, "n1", ["n2", "n3", "n4"])
    assert route.repair_source(c, hops, {"n1", "n2"}, ["n3"]) == "n1"
    again = route.route(c, "n1", ["n3"])
    assert [(h.host, h.network) for h in again[1:]] == [("n3", "fabric")]
    # n2 dies: n4 and n3 left; the first, n4, has cables to n2 (dead) and n3 (unfinished) only: the
    # nearest complete node along the route (the head) repairs
    assert route.repair_source(c, hops, {"n1"}, ["n4", "n3"]) == "n1"
    # n3's upstream n4 complete (a whole copy) and alive: the route's neighbour, its cable
    assert route.repair_source(c, hops, {"n1", "n2", "n4"}, ["n3"]) == "n4"
    # a switch: the last complete node before the first unfinished one along the route
    (tmp_path / "sw").mkdir()
    sw = load_inventory(_inventory(tmp_path / "sw", "switch", {f"n{k}": {"fabric_address": f"192.168.100.1{k}/24"}
                                                                for k in (1, 2, 3, 4)}, distribution="chain"))
    hops = route.route(sw, "n1", ["n2", "n3", "n4"])
    assert route.repair_source(sw, hops, {"n1", "n2"}, ["n4"]) == "n2"


def test_sync_model_s_repair_pass_on_the_ring_takes_the_route_s_neighbour(tmp_path, monkeypatch):
    """#59 item 4, through sync-model's chain (modelsync/chained.py distribute, the passes faked): on
    the ring n1 -> n2 -> n4 -> n3, n4 dies in pass 1 and cuts n3 off. Pass 2 must start from the head
    n1, which has a cable to n3, over the fabric; it started from n2 (rank order), which has none."""
    from types import SimpleNamespace
    from orchestrator.chain.run import NodeOutcome
    from orchestrator.deployment import load_deployment
    from orchestrator.modelsync import chained
    from orchestrator.modelsync.settings import Settings
    from orchestrator.runrecord import RunContext
    dep = load_deployment(_inventory(tmp_path, "mesh", RING, distribution="chain"))
    passes = []

    def fake_pass(cluster, hops, specs, timeouts, on_event, cancel):
        passes.append([(h.host, h.upstream, h.network) for h in hops])
        outs = {h.host: NodeOutcome(h.host, h.upstream, h.network, done={"ok": True}, written=["a.bin"])
                for h in hops}
        if len(passes) == 1:
            outs["n4"] = NodeOutcome("n4", "n2", "fabric", error="killed")            # dies mid-chain
            outs["n3"] = NodeOutcome("n3", "n4", "fabric", done={"ok": False})        # cut off behind it
        return outs
    monkeypatch.setattr(chained, "run_pass", fake_pass)
    ctx = RunContext(tmp_path / "run")
    wants = {h: chained.Wanted(["a.bin"], ctx.host_log(h, "sync-model")) for h in ("n2", "n3", "n4")}
    m = SimpleNamespace(files=[("a.bin", 10, "0" * 64)])
    got = chained.distribute(dep, m, wants, Settings(), ctx)
    ctx.close()
    assert passes[0] == [("n1", "", ""), ("n2", "n1", "fabric"), ("n4", "n2", "fabric"), ("n3", "n4", "fabric")]
    assert passes[1] == [("n1", "", ""), ("n3", "n1", "fabric")], passes[1]
    assert got["n3"].ok and got["n3"].passes == 2 and not got["n4"].ok


def test_bad_distribution_names_the_key(tmp_path):
    with pytest.raises(InputError, match="all.vars.distribution"):
        load_inventory(_inventory(tmp_path, "switch", {"n1": {}}, distribution="torrent"))


def test_the_partial_folder_has_one_name():
    assert modelsync.CHAIN_PARTIAL == chain_node.PARTIAL


# -- the node, as local processes ------------------------------------------------------------------

def _start(spec: dict) -> subprocess.Popen:
    script = SCRIPT.read_bytes()
    p = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, str(len(script))], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write(script + json.dumps(spec).encode() + b"\n")
    p.stdin.flush()
    return p


def _first(p: subprocess.Popen) -> dict:
    return json.loads(p.stdout.readline())


def _wire(p: subprocess.Popen, nxt) -> None:
    p.stdin.write(json.dumps({"next": nxt}).encode() + b"\n")
    p.stdin.flush()


def _done(p: subprocess.Popen) -> tuple[int, dict, str]:
    """Read to the node's last report and its exit; only then close its stdin (which stops a running
    node at once, exit 4: the controller gone)."""
    for line in p.stdout:
        doc = json.loads(line)
        if doc["ev"] == "done":
            break
    p.wait(timeout=60)
    out, err = p.communicate(timeout=60)
    return p.returncode, doc, err.decode()


def _spec(role: str, root: Path, secret: str, **more) -> dict:
    return {"role": role, "run": "r1", "secret": secret, "bind": "127.0.0.1", "root": str(root),
            "stall_s": 10, "deadline_s": 60, "accept_s": 20, **more}


def test_nodes_forward_verify_and_refuse_a_stranger(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    data = {"a.bin": os.urandom(3_000_000), "sub/b.json": b'{"x": 1}', "c.bin": os.urandom(1_500_000)}
    for rel, b in data.items():
        (src / rel).write_bytes(b)
    files = [[rel, len(b), hashlib.sha256(b).hexdigest()] for rel, b in sorted(data.items())]
    next(f for f in files if f[0] == "c.bin")[2] = "0" * 64   # the manifest disagrees with c.bin's bytes
    secret = os.urandom(32).hex()
    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    n1 = _start(_spec("relay", r1, secret, need=["a.bin", "sub/b.json", "c.bin"]))
    n2 = _start(_spec("relay", r2, secret, need=["sub/b.json"]))
    p1, p2 = _first(n1)["port"], _first(n2)["port"]
    _wire(n2, None)
    _wire(n1, ["127.0.0.1", p2])
    # a stranger connects first with a wrong proof: refused, the node keeps listening
    with socket.create_connection(("127.0.0.1", p1), timeout=5) as s:
        nonce = s.recv(chain_node.NONCE)
        s.sendall(chain_node.proof(b"wrong", "r1", "up", nonce) + os.urandom(chain_node.NONCE))
        assert s.recv(64) == b""                      # closed without the node's own proof
    source = _start(_spec("source", src, secret, files=files))
    assert _first(source) == {"ev": "ready"}
    _wire(source, ["127.0.0.1", p1])
    rc_s, done_s, _ = _done(source)
    rc1, done1, err1 = _done(n1)
    rc2, done2, _ = _done(n2)
    assert rc_s == 0 and done_s["ok"] and done_s["fwd"] > 4_500_000
    assert "refused 127.0.0.1" in err1
    # the middle node forwarded every byte it received, wrote a.bin and sub/b.json, refused c.bin
    assert done1["recv"] == done1["fwd"] == done_s["fwd"]
    assert (r1 / "a.bin").read_bytes() == data["a.bin"] and (r1 / "sub/b.json").read_bytes() == data["sub/b.json"]
    assert not (r1 / "c.bin").exists() and not (r1 / chain_node.PARTIAL / "c.bin").exists()
    assert rc1 == 1 and not done1["ok"] and "c.bin" in done1["bad"][0] and done1["missing"] == ["c.bin"]
    # the tail wrote only what it lacks, forwarded nothing
    assert rc2 == 0 and done2["ok"] and done2["fwd"] == 0 and done2["recv"] == done1["fwd"]
    assert sorted(p.name for p in r2.rglob("*") if p.is_file()) == ["b.json"]


def test_a_path_out_of_the_folder_is_refused(tmp_path):
    secret = os.urandom(32).hex()
    n = _start(_spec("relay", tmp_path / "r", secret, need=["../evil"]))
    port = _first(n)["port"]
    _wire(n, None)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        chain_node.handshake_connecting(s, bytes.fromhex(secret), "r1")
        head = json.dumps({"path": "../evil", "size": 1, "sha256": "0" * 64}).encode()
        s.sendall(chain_node.HDR.pack(b"H", len(head)) + head)
        rc, done, _ = _done(n)
    assert rc == 1 and "outside the checkpoint folder" in done["up_lost"]
    assert not (tmp_path / "evil").exists()


def test_the_source_paces_the_chain_at_the_bwlimit(tmp_path):
    """sync-model --bwlimit through a chain: the source sends at that rate, so every hop does."""
    import time
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(4_000_000)
    (src / "w.bin").write_bytes(data)
    secret = os.urandom(32).hex()
    n = _start(_spec("relay", tmp_path / "r", secret, need=["w.bin"]))
    port = _first(n)["port"]
    _wire(n, None)
    source = _start(_spec("source", src, secret, files=[["w.bin", len(data), hashlib.sha256(data).hexdigest()]],
                          rate_bps=8e6))
    _first(source)
    t0 = time.monotonic()
    _wire(source, ["127.0.0.1", port])
    rc_s, done_s, _ = _done(source)
    secs = time.monotonic() - t0
    rc, done, _ = _done(n)
    assert rc_s == 0 and rc == 0 and (tmp_path / "r" / "w.bin").read_bytes() == data
    assert 0.45 <= secs < 5, secs                      # 4 MB at 8 MB/s: half a second, not a burst


def test_a_node_that_cannot_write_still_forwards(tmp_path):
    """A node whose folder cannot be written (here: a file where its folder should be; a full disk
    fails the same way) fails itself, named, and the node after it still gets every file."""
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(2_500_000)
    (src / "w.bin").write_bytes(data)
    files = [["w.bin", len(data), hashlib.sha256(data).hexdigest()]]
    (tmp_path / "blocked").write_text("not a folder")
    secret = os.urandom(32).hex()
    n1 = _start(_spec("relay", tmp_path / "blocked", secret, need=["w.bin"]))
    n2 = _start(_spec("relay", tmp_path / "r2", secret, need=["w.bin"]))
    p1, p2 = _first(n1)["port"], _first(n2)["port"]
    _wire(n2, None)
    _wire(n1, ["127.0.0.1", p2])
    source = _start(_spec("source", src, secret, files=files))
    _first(source)
    _wire(source, ["127.0.0.1", p1])
    rc_s, _, _ = _done(source)
    rc1, done1, _ = _done(n1)
    rc2, done2, _ = _done(n2)
    assert rc_s == 0 and rc2 == 0 and (tmp_path / "r2" / "w.bin").read_bytes() == data
    assert rc1 == 1 and not done1["ok"] and "writing w.bin under" in done1["local_error"], done1
    assert done1["fwd"] == done1["recv"] > len(data)
