"""`distribution: chain` for sync-model on the 4-host test cluster: the head sends each checkpoint byte
once, over the fabric bridge (counted on the veths, not by deployctl), every worker ends exact; a node
killed mid-chain is named while the nodes after it complete from the one before; a re-run sends only
what is missing."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.cluster import _pids_in_netns
from tests.test_sync_model import SHARDS, assert_exact, by_host, cli_argv, sync, worker_snap, write_checkpoint

pytestmark = pytest.mark.cluster


def chain_inventory(cluster, path: Path) -> Path:
    """The cluster's own inventory: every host has a fabric address, so chain is its default."""
    from orchestrator.inventory import load_inventory
    assert load_inventory(cluster.inventory_path).distribution == "chain"
    doc = yaml.safe_load(cluster.inventory_path.read_text())
    assert "distribution" not in doc["all"]["vars"]
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def counters(cluster) -> dict[str, dict[str, int]]:
    """The kernel's byte counts on each host's veths (root-namespace ends: their rx is what the host
    sent): fabric = sent over the fabric; management = sent and received over the management network."""
    def n(dev: str, what: str) -> int:
        return int(Path(f"/sys/class/net/{dev}/statistics/{what}_bytes").read_text())
    return {h.name: {"fabric": n(h.fabric_veth, "rx"), "management": n(h.veth, "rx") + n(h.veth, "tx")}
            for h in cluster.hosts}


def delta(before: dict, after: dict) -> dict[str, dict[str, int]]:
    return {h: {k: after[h][k] - before[h][k] for k in before[h]} for h in before}


@pytest.fixture(scope="module")
def chained(cluster, tmp_path_factory):
    repo = "dctl-test/synthetic-chain"
    rev, snap = write_checkpoint(cluster.hosts[0].model_cache, repo)
    cwd = tmp_path_factory.mktemp("chain")
    inv = chain_inventory(cluster, cwd / "chain.yml")
    payload = sum(p.stat().st_size for p in snap.iterdir())
    before = counters(cluster)
    rc, doc, err, secs = sync(cluster, cwd, repo, rev, inventory=inv)
    sent = delta(before, counters(cluster))
    return {"repo": repo, "rev": rev, "snap": snap, "cwd": cwd, "inv": inv, "payload": payload,
            "first": (rc, doc, err, secs), "sent": sent}


def test_head_sends_each_byte_once_over_the_fabric(cluster, chained):
    rc, doc, err, secs = chained["first"]
    assert rc == 0, err
    res = by_host(doc)
    payload = chained["payload"]
    for w, up in (("node2", "node1"), ("node3", "node2"), ("node4", "node3")):
        d = res[w]["data"]
        assert res[w]["status"] == "ok", res[w]
        assert d["distribution"] == "chain" and d["network"] == "fabric" and d["upstream"] == up, d
        assert d["chain"] == ["node1", "node2", "node3", "node4"] and d["files_sent"] == SHARDS + 2
        assert d["hashed_after"] == 0      # the node hashed each file as it wrote it: not read again
    assert_exact(cluster, chained["repo"], chained["rev"])
    sent = chained["sent"]
    # the head's fabric port carried the payload once (frames and TCP/IP headers: under 5 %) ...
    assert payload <= sent["node1"]["fabric"] <= 1.05 * payload, sent
    # ... each middle node forwarded it once, the tail nothing
    for w in ("node2", "node3"):
        assert payload <= sent[w]["fabric"] <= 1.05 * payload, sent
    assert sent["node4"]["fabric"] < 0.01 * payload, sent
    # the management network carried control traffic only (SSH: scripts, manifests, progress)
    mgmt = sum(v["management"] for v in sent.values())
    assert mgmt < 0.01 * payload, sent
    # the plan said which network carries the data
    plan = json.loads((Path(doc["run_dir"]) / "plan.json").read_text())
    acts = {a["host"]: a for st in plan["stages"] for a in st["actions"]}
    assert "every hop over the fabric" in acts["node2"]["details"]["chain"]
    assert acts["node3"]["details"]["upstream"] == "node2" and acts["node3"]["details"]["network"] == "fabric"
    # nothing of the run is left: no node process, nothing listening, no partial folder
    for h in cluster.hosts:
        assert not _chain_pids(h), h.name
        assert not (worker_snap(h, chained["repo"], chained["rev"]) / ".deployctl-chain-partial").exists()


def test_chain_rerun_is_a_noop(cluster, chained):
    rc, doc, err, secs = sync(cluster, chained["cwd"], chained["repo"], chained["rev"], inventory=chained["inv"])
    assert rc == 0, err
    res = by_host(doc)
    assert all(res[w]["status"] == "skipped" for w in ("node2", "node3", "node4")), res
    assert all(res[w]["data"]["hashed_bytes"] == 0 for w in ("node2", "node3", "node4")), res   # all cached


def _chain_pids(host) -> list[int]:
    out = []
    for pid in _pids_in_netns(host.netns):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(cmd) >= 3 and cmd[0].endswith(b"python3") and b"deployctl-chain-node" in cmd[2]:
            out.append(pid)
    return out


def _kill_mid_chain(cluster, argv: list[str], cwd: Path, host: str, ready, what: str) -> tuple[int, str, str]:
    """Run ARGV with the fabric link node1-node2 slowed; once READY() holds, SIGKILL HOST's chain node.
    The command's (exit code, stdout, stderr)."""
    cluster.throttle_link("node1", "node2", 160)           # ~5-8 s for the payload: time to kill mid-way
    p = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert p.poll() is None and time.monotonic() < deadline, f"{host} never {what}"
            time.sleep(0.05)
        pids = _chain_pids(cluster.host(host))
        assert pids, f"no chain node on {host}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
        cluster.unthrottle_link("node1", "node2")
    return p.returncode, out, err


def test_node_killed_mid_chain_is_named_and_the_rest_complete(cluster, chained):
    repo, rev = chained["repo"], chained["rev"]
    for h in cluster.hosts[1:]:
        subprocess.run(["rm", "-rf", str(worker_snap(h, repo, rev))], check=True)
    node3 = cluster.hosts[2]
    first = worker_snap(node3, repo, rev) / "model-00001-of-00003.safetensors"
    partial = worker_snap(node3, repo, rev) / ".deployctl-chain-partial"
    rc, out, err = _kill_mid_chain(
        cluster, cli_argv(cluster, repo, rev, "--io-timeout", "10", inventory=chained["inv"]), chained["cwd"],
        "node3", lambda: first.exists() and any(f.stat().st_size > 2_000_000 for f in partial.rglob("*.safetensors")
                                                if f.is_file()), "received its second shard")
    assert rc == 1, err
    res = by_host(json.loads(out))
    assert res["node3"]["status"] == "failed" and "ended without a result" in res["node3"]["message"], res["node3"]
    assert res["node2"]["status"] == "ok", res["node2"]
    d4 = res["node4"]
    assert d4["status"] == "ok" and d4["data"]["cut"] == ["node3"] and d4["data"]["passes"] == 2, d4
    assert "node3 was cut out" in d4["message"] and d4["data"]["upstream"] == "node2"
    assert_exact(cluster, repo, rev, hosts=[cluster.hosts[1], cluster.hosts[3]])
    assert first.is_file()                                 # what node3 completed before it died is kept
    # a re-run finishes only what is missing: node3's remaining files, nothing to the others
    rc, doc, err, secs = sync(cluster, chained["cwd"], repo, rev, inventory=chained["inv"])
    assert rc == 0, err
    res = by_host(doc)
    assert res["node2"]["status"] == res["node4"]["status"] == "skipped"
    assert res["node3"]["status"] == "ok" and 0 < res["node3"]["data"]["files_sent"] < SHARDS + 2, res["node3"]
    assert_exact(cluster, repo, rev)
    assert not _chain_pids(node3)


# -- the image ---------------------------------------------------------------------------------------

IMAGE = "dctl-chain-img:1"


def _docker(cluster, host: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", cluster.host(host).docker_host, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DOCKER_BUILDKIT": "0"})


def _config(cluster, host: str) -> str | None:
    r = _docker(cluster, host, "image", "inspect", "--format", "{{.Id}} {{json .RootFS.Layers}}", IMAGE)
    return r.stdout.strip() if r.returncode == 0 else None


def test_image_crosses_the_fabric_once_and_every_worker_verifies_it(cluster, chained, tmp_path):
    from tests.cluster import BUSYBOX_IMAGE, ensure_base_images
    ensure_base_images(debian=False)
    cluster.load_image("node1", BUSYBOX_IMAGE)
    for h in ("node2", "node3", "node4"):
        _docker(cluster, h, "image", "rm", "-f", IMAGE)
    (tmp_path / "Dockerfile").write_text("FROM dctl-busybox:latest\nRUN head -c 100000000 /dev/urandom > /weights\n")
    assert _docker(cluster, "node1", "build", "-q", "-t", IMAGE, str(tmp_path)).returncode == 0
    want = _config(cluster, "node1")
    before = counters(cluster)
    p = subprocess.run([sys.executable, "-m", "orchestrator", "ship", "-i", str(chained["inv"]), "--image", IMAGE,
                        "--json"], capture_output=True, text=True, timeout=300, cwd=chained["cwd"])
    sent = delta(before, counters(cluster))
    assert p.returncode == 0, p.stderr
    res = {r["host"]: r for s in json.loads(p.stdout)["stages"] for r in s["results"]}
    for w, up in (("node2", "node1"), ("node3", "node2"), ("node4", "node3")):
        d = res[w]["data"]
        assert res[w]["status"] == "ok" and d["distribution"] == "chain" and d["upstream"] == up, res[w]
        assert d["network"] == "fabric" and f"from {up} over the fabric" in res[w]["message"]
        assert _config(cluster, w) == want                  # the worker's own engine: same config and layers
    stream = res["node2"]["data"]["bytes_sent"]             # what the first hop received: the filtered save
    assert stream > 100_000_000
    assert stream <= sent["node1"]["fabric"] <= 1.05 * stream, sent
    for w in ("node2", "node3"):
        assert stream <= sent[w]["fabric"] <= 1.05 * stream, sent
    assert sent["node4"]["fabric"] < 0.01 * stream
    assert sum(v["management"] for v in sent.values()) < 0.01 * stream, sent
    for h in cluster.hosts:
        assert not _chain_pids(h), h.name


def _received(host) -> int:
    """The most bytes any TCP connection in HOST's namespace has received (the kernel's count, `ss -ti`)."""
    out = subprocess.run(["ip", "netns", "exec", host.netns, "ss", "-tinH", "state", "established"],
                         capture_output=True, text=True, timeout=10).stdout
    return max((int(x) for x in re.findall(r"bytes_received:(\d+)", out)), default=0)


def test_image_chain_node_killed_is_named_and_the_rest_load_it(cluster, chained):
    for h in ("node2", "node3", "node4"):
        _docker(cluster, h, "image", "rm", "-f", IMAGE)
    want = _config(cluster, "node1")
    assert want, "the image test before builds it"
    argv = [sys.executable, "-m", "orchestrator", "ship", "-i", str(chained["inv"]), "--image", IMAGE, "--json"]
    rc, out, err = _kill_mid_chain(cluster, argv, chained["cwd"], "node3",
                                   lambda: _received(cluster.host("node3")) > 30_000_000, "received 30 MB")
    assert rc == 1, err
    res = {r["host"]: r for s in json.loads(out)["stages"] for r in s["results"]}
    assert res["node3"]["status"] == "failed" and "ended without a result" in res["node3"]["message"], res["node3"]
    assert res["node2"]["status"] == "ok" and _config(cluster, "node2") == want
    d4 = res["node4"]["data"]
    assert res["node4"]["status"] == "ok" and d4["passes"] == 2 and d4["cut"] == ["node3"], res["node4"]
    assert "node3 was cut out" in res["node4"]["message"] and _config(cluster, "node4") == want
    assert _config(cluster, "node3") is None              # no half image under its name
    assert "node3" in err
