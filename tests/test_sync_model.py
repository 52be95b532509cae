"""sync-model on the 4-host test cluster: a synthetic HF-cache checkpoint on node1 pushed to the three
workers by rsync run on the head; re-sync no-op, one changed file, corruption, space refusal, a link
cut mid-copy and its resume, and the shared-storage mode (pass and refusals)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]
SHARDS = 3
SHARD_BYTES = 40_000_000                # 3 x 40 MB + config + index: ~120 MB
FIGURES: dict[str, float] = {}


def write_checkpoint(model_cache: Path, repo: str, shard_bytes: int = SHARD_BYTES) -> tuple[str, Path]:
    """HF cache layout: blobs/<sha256>, snapshots/<rev>/<name> -> ../../blobs/<sha256>, refs/main."""
    base = model_cache / f"models--{repo.replace('/', '--')}"
    rev = hashlib.sha1(f"{repo}{time.time()}".encode()).hexdigest()
    snap = base / "snapshots" / rev
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(rev)
    names = [f"model-{i:05d}-of-{SHARDS:05d}.safetensors" for i in range(1, SHARDS + 1)]
    files = {n: os.urandom(shard_bytes) for n in names}
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": shard_bytes * SHARDS}, "weight_map": {f"w{i}": n for i, n in enumerate(names)}}
    ).encode()
    files["config.json"] = b'{"architectures": ["Synthetic"], "model_type": "synthetic"}'
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (base / "blobs" / sha).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{sha}")
    return rev, snap


def sync(cluster, cwd: Path, repo: str, rev: str, *extra: str, inventory: Path | None = None,
         timeout: float = 180) -> tuple[int, dict, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(cli_argv(cluster, repo, rev, *extra, inventory=inventory), cwd=cwd, capture_output=True,
                       text=True, timeout=timeout)
    secs = time.monotonic() - t0
    doc = json.loads(p.stdout) if p.stdout.strip() else {}
    return p.returncode, doc, p.stderr, secs


def cli_argv(cluster, repo: str, rev: str, *extra: str, inventory: Path | None = None) -> list[str]:
    # distribution: direct, this module's subject (the chain: tests/test_chain.py)
    inv = str(inventory or cluster.inventory_with(distribution="direct"))
    return [sys.executable, "-m", "orchestrator", "sync-model", "-i", inv,
            "--set", f"model.repo={repo}", "--set", f"model.revision={rev}", "--json", *extra]


def by_host(doc: dict) -> dict[str, dict]:
    return {r["host"]: r for r in doc["stages"][0]["results"]}


def worker_snap(host, repo: str, rev: str) -> Path:
    return host.model_cache / f"models--{repo.replace('/', '--')}" / "snapshots" / rev


def assert_exact(cluster, repo: str, rev: str, hosts=None) -> None:
    head = worker_snap(cluster.hosts[0], repo, rev)
    for h in hosts or cluster.hosts[1:]:
        snap = worker_snap(h, repo, rev)
        for f in head.iterdir():
            w = snap / f.name
            assert w.is_file() and not w.is_symlink(), (h.name, f.name)   # dereferenced: regular files
            assert hashlib.sha256(w.read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest(), (h.name, f.name)


@pytest.fixture(scope="module")
def synced(cluster, tmp_path_factory):
    """The synthetic checkpoint on node1, pushed once to node2..node4."""
    repo = "dctl-test/synthetic-sync"
    rev, snap = write_checkpoint(cluster.hosts[0].model_cache, repo)
    cwd = tmp_path_factory.mktemp("runs")
    rc, doc, err, secs = sync(cluster, cwd, repo, rev)
    FIGURES["first_sync_s"] = round(secs, 2)
    return {"repo": repo, "rev": rev, "snap": snap, "cwd": cwd, "first": (rc, doc, err, secs)}


def test_first_sync_makes_every_worker_exact(cluster, synced):
    rc, doc, err, secs = synced["first"]
    assert rc == 0, err
    res = by_host(doc)
    assert res["node1"]["status"] == "ok" and res["node1"]["data"]["files_total"] == SHARDS + 2
    for w in ("node2", "node3", "node4"):
        d = res[w]["data"]
        assert res[w]["status"] == "ok", res[w]
        assert d["files_sent"] == SHARDS + 2 and d["bytes_sent"] == d["bytes_total"] > SHARDS * SHARD_BYTES
        assert d["duration_s"] > 0 and d["copy_s"] > 0
    assert_exact(cluster, synced["repo"], synced["rev"])
    # The plan is what ran: each worker's rsync is its planned job's argv; only the whole-transfer
    # timeout (planned for the recipe's checkpoint_gb) is set from the bytes actually sent.
    run_dir = Path(doc["run_dir"])
    plan = json.loads((run_dir / "plan.json").read_text())
    planned = {a["host"]: a["command"] for st in plan["stages"] for a in st["actions"]}
    for w in ("node2", "node3", "node4"):
        ran = next(line.split("on node1: ", 1)[1] for line in (run_dir / "logs" / w / "sync-model.log").read_text().splitlines()
                   if line.startswith("on node1: "))
        want = planned[w][2:]                  # without `ssh root@<head>`
        assert want[:3] == ["timeout", "-k", "10"] and "--files-from=-" in want
        got = ran.split(" ")
        assert got[:3] == want[:3] and got[4:10] == want[4:10] and ran.endswith(want[-1]), (ran, want)
    # the worker's hash cache is in its nvme_dir, never in the HF snapshots/ folder
    snaps = worker_snap(cluster.hosts[1], synced["repo"], synced["rev"]).parent
    assert [p.name for p in snaps.iterdir()] == [synced["rev"]]


def test_resync_is_a_fast_noop(cluster, synced):
    rc, doc, err, secs = sync(cluster, synced["cwd"], synced["repo"], synced["rev"])
    FIGURES["noop_resync_s"] = round(secs, 2)
    assert rc == 0, err
    res = by_host(doc)
    assert doc["stages"][0]["status"] == "skipped"
    assert res["node1"]["data"]["hashed_bytes"] == 0                       # manifest from the cache
    for w in ("node2", "node3", "node4"):
        assert res[w]["status"] == "skipped" and "already exact" in res[w]["message"], res[w]
        assert res[w]["data"]["files_sent"] == 0 and res[w]["data"]["skipped_reason"]
    assert secs < 30


def test_head_without_its_key_says_so(cluster, synced):
    rc, doc, err, secs = sync(cluster, synced["cwd"], synced["repo"], synced["rev"],
                              "--head-key", "/nonexistent/id_ed25519")
    assert rc == 1
    res = by_host(doc)
    assert res["node1"]["status"] == "failed" and "/nonexistent/id_ed25519" in res["node1"]["message"]
    assert "--head-key" in res["node1"]["message"]
    assert all(res[w]["status"] == "failed" and "not synced: the head node1 failed" in res[w]["message"]
               for w in ("node2", "node3", "node4"))


def test_one_changed_file_is_sent_alone(cluster, synced):
    changed = synced["snap"] / "model-00002-of-00003.safetensors"
    blob = changed.resolve()
    blob.write_bytes(os.urandom(SHARD_BYTES))              # same size, new bytes, new mtime
    rc, doc, err, secs = sync(cluster, synced["cwd"], synced["repo"], synced["rev"])
    assert rc == 0, err
    res = by_host(doc)
    assert res["node1"]["data"]["hashed_bytes"] == SHARD_BYTES               # only it was re-hashed
    for w in ("node2", "node3", "node4"):
        d = res[w]["data"]
        assert d["files_sent"] == 1 and d["to_send"] == [changed.name] and d["bytes_sent"] == SHARD_BYTES, d
    assert_exact(cluster, synced["repo"], synced["rev"])


def test_corruption_on_a_worker_is_found_and_repaired(cluster, synced):
    f = worker_snap(cluster.hosts[1], synced["repo"], synced["rev"]) / "model-00001-of-00003.safetensors"
    st = f.stat()
    with open(f, "r+b") as fh:                             # flip bytes in the middle ...
        fh.seek(SHARD_BYTES // 2)
        fh.write(b"\x00" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))       # ... and put the mtime back: silent bit rot
    rc, doc, err, secs = sync(cluster, synced["cwd"], synced["repo"], synced["rev"])
    assert rc == 0, err
    res = by_host(doc)
    d = res["node2"]["data"]
    assert res["node2"]["status"] == "ok" and d["files_sent"] == 1 and d["to_send"] == [f.name], d
    assert d["literal_bytes"] < 1_000_000                  # rsync's delta: only the bad blocks travelled
    assert res["node3"]["status"] == res["node4"]["status"] == "skipped"
    assert_exact(cluster, synced["repo"], synced["rev"])


def test_space_refusal_names_host_and_shortfall(cluster, synced):
    node3 = cluster.hosts[2]
    small = cluster.small_fs(node3, "models", 60)          # hides node3's copy: it needs all ~120 MB
    try:
        rc, doc, err, secs = sync(cluster, synced["cwd"], synced["repo"], synced["rev"])
        assert rc == 1, err
        res = by_host(doc)
        msg = res["node3"]["message"]
        assert res["node3"]["status"] == "failed"
        assert "not enough space on node3" in msg and str(small) in msg and "short by" in msg and " GB" in msg
        assert "nothing was copied" in msg
        assert res["node2"]["status"] == res["node4"]["status"] == "skipped"
        assert list(small.iterdir()) == []                 # not a byte sent to the host that cannot fit
        assert "node3" in err and "stage sync-model failed" in err
    finally:
        cluster.unmount_small_fs(node3, "models")


def _largest_file_below(path: Path) -> int:
    sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()] if path.exists() else []
    return max(sizes, default=0)


def test_link_cut_mid_copy_fails_alone_then_resumes(cluster, synced):
    node3 = cluster.hosts[2]
    repo_dir = worker_snap(node3, synced["repo"], synced["rev"]).parent.parent
    shutil.rmtree(worker_snap(node3, synced["repo"], synced["rev"]))
    argv = cli_argv(cluster, synced["repo"], synced["rev"], "--bwlimit", "8", "--io-timeout", "5")
    p = subprocess.Popen(argv, cwd=synced["cwd"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while _largest_file_below(repo_dir) < 8_000_000:   # node3 is receiving its first shard
            assert p.poll() is None and time.monotonic() < deadline, "the copy to node3 never started"
            time.sleep(0.1)
        cluster.link_down(node3)
        t_cut = time.monotonic()
        out, err = p.communicate(timeout=90)
        FIGURES["cut_to_failure_s"] = round(time.monotonic() - t_cut, 2)
    finally:
        if p.poll() is None:
            p.kill()
        cluster.link_up(node3)
    assert p.returncode == 1, err
    res = by_host(json.loads(out))
    assert res["node3"]["status"] == "failed" and res["node3"]["rc"] in (30, 12, 255), res["node3"]
    assert "node3" in res["node3"]["message"] and "re-run to resume" in res["node3"]["message"]
    assert res["node2"]["status"] == res["node4"]["status"] == "skipped"
    assert FIGURES["cut_to_failure_s"] < 40                # rsync --timeout 5 + ssh keepalive, no hang
    # node3's receiver keeps what it got in the partial dir once it notices the dead connection
    partial = worker_snap(node3, synced["repo"], synced["rev"]) / ".deployctl-rsync-partial"
    deadline = time.monotonic() + 60
    while _largest_file_below(partial) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    kept = _largest_file_below(partial)
    rc, doc, err, secs = sync(cluster, synced["cwd"], synced["repo"], synced["rev"])
    assert rc == 0, err
    d = by_host(doc)["node3"]["data"]
    assert by_host(doc)["node3"]["status"] == "ok" and 1 <= d["files_sent"] <= SHARDS + 2
    assert kept > 0 and d["matched_bytes"] > 0, (kept, d)  # resumed: the partial file was the basis
    assert not partial.exists()                            # and rsync's leftovers are gone
    assert_exact(cluster, synced["repo"], synced["rev"], [node3])


# -- source: shared --------------------------------------------------------------------------------

@pytest.fixture()
def shared_mount(cluster):
    """One folder bind-mounted at S/shared-mnt: what every test host sees as its NFS mount."""
    export, mnt = cluster.state_dir / "shared-export", cluster.state_dir / "shared-mnt"
    export.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "--bind", str(export), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(export, ignore_errors=True)


def inventory_with(cluster, tmp_path: Path, model_cache: dict[str, Path]) -> Path:
    inv = yaml.safe_load(cluster.inventory_with(distribution="direct").read_text())
    for name, path in model_cache.items():
        inv["all"]["hosts"][name]["model_cache"] = str(path)
    out = tmp_path / "inventory.yml"
    out.write_text(yaml.safe_dump(inv, sort_keys=False))
    return out


def test_shared_mode_verifies_the_same_mount_and_refuses_a_local_copy(cluster, shared_mount, tmp_path):
    repo = "dctl-test/synthetic-shared"
    rev, snap = write_checkpoint(shared_mount, repo, shard_bytes=2_000_000)
    shared = ("--set", "model.source=shared", "--set", f"model.shared_path={shared_mount}")
    everyone = inventory_with(cluster, tmp_path, {h.name: shared_mount for h in cluster.hosts})
    rc, doc, err, secs = sync(cluster, tmp_path, repo, rev, *shared, inventory=everyone)
    assert rc == 0, err
    res = by_host(doc)
    assert res["node1"]["status"] == "ok" and str(shared_mount) in res["node1"]["message"]
    for w in ("node2", "node3", "node4"):
        assert res[w]["status"] == "skipped" and "shared storage verified" in res[w]["message"], res[w]
        assert res[w]["data"]["mount"]["target"] == str(shared_mount) and res[w]["data"]["same_mount_as_head"]
    assert not (snap / ".deployctl-shared-marker").exists()         # the marker is removed

    # node4 has a complete local copy (same files, same sizes) but not the shared mount: refused
    local = cluster.hosts[3].dir / "models-local"
    shutil.copytree(snap, local / snap.relative_to(shared_mount), symlinks=False)   # links followed
    mixed = inventory_with(cluster, tmp_path, {**{h.name: shared_mount for h in cluster.hosts[:3]},
                                               "node4": local})
    try:
        rc, doc, err, secs = sync(cluster, tmp_path, repo, rev, *shared, inventory=mixed)
        assert rc == 1, err
        res = by_host(doc)
        msg = res["node4"]["message"]
        assert res["node4"]["status"] == "failed"
        assert f"not on the shared mount {shared_mount}" in msg and "marker" in msg and "not visible" in msg
        assert res["node2"]["status"] == res["node3"]["status"] == "skipped"
        # without shared_path, the marker alone still tells the local copy from the shared storage
        rc, doc, err, secs = sync(cluster, tmp_path, repo, rev, "--set", "model.source=shared",
                                  inventory=mixed)
        assert rc == 1 and by_host(doc)["node4"]["status"] == "failed"
        assert "not the head's storage" in by_host(doc)["node4"]["message"]
    finally:
        shutil.rmtree(local, ignore_errors=True)


def test_report_figures(synced):
    """Not a check: prints the measured times (pytest -s)."""
    print("\nsync-model figures:", json.dumps(FIGURES))
