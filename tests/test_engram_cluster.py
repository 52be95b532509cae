"""`deployctl stage` on the 4-host test cluster: each host stages its rank's rows from its own checkpoint
copy through Ansible (playbooks/stage-engram.yml); a host whose NVMe is full fails alone; then the
engine double, launched by `deployctl up` in every host's container, reads its rank's rows from the
staged folder (DSV41_ENGRAM_DIR=/engram) exactly as the patched vLLM engram.py does."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from tests.engram_synth import SCALE, WEIGHT, Synth, read_rows
from tests.test_launch import _docker, containers, dctl, double_image, remove_all, write_inventory  # noqa: F401

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engram_cluster(cluster, tmp_path_factory):
    """The cluster with a synthetic checkpoint (scaled deepseek-v41-flash-tp4) in every host's model cache."""
    s = Synth(tmp_path_factory.mktemp("engram-cluster"), [1, 14], [300, 300, 300], 8, 32, 1, seed=11)
    s.cluster_sets = s.sets() + ["engram.free_margin_gb=5"]     # the real recipe's margin
    dep = load_deployment(cluster.inventory_path, "deepseek-v41-flash-tp4", tuple(s.cluster_sets))
    for h in dep.cluster.hosts:
        folder = Path(dep.checkpoint_dir(h))
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(s.ckpt, folder)
    return cluster, s, dep


def deployctl_stage(inventory: Path, sets: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    argv = [sys.executable, "-m", "orchestrator", "stage", "-i", str(inventory), "-r", "deepseek-v41-flash-tp4",
            *[x for v in sets for x in ("--set", v)], "--json"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    return p, json.loads(p.stdout) if p.stdout.strip() else {}


def results(doc: dict) -> dict[str, dict]:
    (st,) = [s for s in doc["stages"] if s["name"] == "stage-engram"]
    return {r["host"]: r for r in st["results"]}


@pytest.fixture(scope="module")
def staged(engram_cluster):
    """One `deployctl stage` of every host (sparse layout), as ops run it."""
    cluster, s, dep = engram_cluster
    return deployctl_stage(cluster.inventory_path, s.cluster_sets)


def test_chain_gives_each_worker_only_its_ranks_engram_rows(engram_cluster):
    """sync-model through the chain (the cluster's default: every host has a fabric address) to workers
    that hold nothing: each keeps of the Engram shards only its rank's rows (the other ranks' rows are
    holes: not stored, though every byte passed through it and the whole stream was checked against
    the head's sha256), every other byte and file whole; a re-run sends and hashes nothing; then
    stage-engram (staging auto) links those shards: nothing to copy. The tests after this one stage
    and launch from these partial copies (the engine double loads every other tensor from them and
    reads its rank's rows byte-exact)."""
    cluster, s, dep = engram_cluster
    workers = [h for h in dep.cluster.hosts if h.name != dep.cluster.head]
    for h in workers:
        shutil.rmtree(dep.checkpoint_dir(h))
    argv = [sys.executable, "-m", "orchestrator", "sync-model", "-i", str(cluster.inventory_path),
            "-r", "deepseek-v41-flash-tp4", *[x for v in s.cluster_sets for x in ("--set", v)], "--json"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads(p.stdout)
    res = {r["host"]: r for r in doc["stages"][0]["results"]}
    shards = sorted({t.file.name for n, t in s.tensors.items() if ".engram." in n})
    ckpt_files = sorted(f.name for f in s.ckpt.iterdir())
    for h in workers:
        r, d = res[h.name], res[h.name]["data"]
        assert r["status"] == "ok" and d["distribution"] == "chain" and d["network"] == "fabric", r
        rows = d["engram_rows"]
        assert rows["rank"] == h.rank and rows["tp"] == 4 and rows["files_in_part"] == shards, rows
        assert f"it keeps only rank {h.rank}'s rows" in r["message"], r["message"]
        folder = Path(dep.checkpoint_dir(h))
        assert sorted(f.name for f in folder.iterdir() if not f.name.startswith(".deployctl")) == ckpt_files
        kept = 0
        for name in ckpt_files:
            data = (folder / name).read_bytes()
            if name in shards:
                assert data == s.partial_bytes(name, 4, h.rank), (h.name, name)   # other ranks' rows: zeros
                kept += rows["kept_bytes"][name]
            else:
                assert data == (s.ckpt / name).read_bytes(), (h.name, name)
        # the bytes written are the kept ones; the holes take no disk (the two big weight shards)
        assert d["bytes_sent"] == kept + sum((s.ckpt / n).stat().st_size for n in ckpt_files if n not in shards)
        for name in shards:
            st = (folder / name).stat()
            if st.st_size > 64 * 4096:
                assert st.st_blocks * 512 <= rows["kept_bytes"][name] + 4 * 4096 < st.st_size, (h.name, name)
        # every byte passed through it: it received the whole checkpoint, the middle ones forwarded it
        whole = sum((s.ckpt / n).stat().st_size for n in ckpt_files)
        assert d["bytes_received"] >= whole, d
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    res = {r["host"]: r for r in json.loads(p.stdout)["stages"][0]["results"]}
    for h in workers:
        assert res[h.name]["status"] == "skipped" and res[h.name]["data"]["hashed_bytes"] == 0, res[h.name]
        assert res[h.name]["data"]["engram_rows"]["files_in_part"] == shards
    auto = [x for x in s.cluster_sets if not x.startswith("engram.staging=")] + ["engram.staging=auto"]
    p, doc = deployctl_stage(cluster.inventory_path, auto)
    assert p.returncode == 0, p.stderr
    for h in workers:
        r = results(doc)[h.name]
        assert r["data"]["mode"] == "link" and r["data"]["bytes_written"] == 0, r
        for name in shards:
            a, b = (Path(dep.engram_dir(h)) / name).stat(), (Path(dep.checkpoint_dir(h)) / name).stat()
            assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        lo_hi = json.loads((Path(dep.engram_dir(h)) / "engram-local.json").read_text())["layers"]
        assert lo_hi == {str(layer): list(s.expected_range(layer, 4, h.rank)) for layer in s.layers}


def test_stage_every_host_through_ansible(engram_cluster, staged):
    cluster, s, dep = engram_cluster
    p, doc = staged
    assert p.returncode == 0, p.stderr
    res = results(doc)
    assert sorted(res) == ["node1", "node2", "node3", "node4"]
    for h in dep.cluster.hosts:
        r = res[h.name]
        assert r["status"] == "ok", r
        assert r["data"]["rank"] == h.rank and r["data"]["tp"] == 4
        dest = Path(dep.engram_dir(h))
        s.check_dest(dest, 4, h.rank, "sparse")                 # every byte, from the host's own copy
        m = json.loads((dest / "engram-manifest.json").read_text())
        assert m["source"]["checkpoint"] == dep.checkpoint_dir(h)
        assert Path(r["log"]).read_text().count("TASK [") >= 5  # the host's Ansible output in its log
    run_dir = Path(doc["run_dir"])
    assert (run_dir / "stage-engram-vars.json").exists()
    assert (run_dir / "ansible" / "stage-engram" / "artifacts").is_dir()


def test_full_nvme_fails_alone_others_skip(engram_cluster, staged):
    """node3's NVMe folder becomes a 1 MB tmpfs (its staged files hidden): it must stage again and has no
    room; it fails alone, before writing, naming host, path, need and free GB. The others have nothing
    to do and say why."""
    cluster, s, dep = engram_cluster
    assert staged[0].returncode == 0
    node3 = dep.cluster.host("node3")
    rel = os.path.relpath(dep.engram_dir(node3), cluster.host("node3").dir)
    small = cluster.small_fs("node3", rel, 1)
    try:
        p, doc = deployctl_stage(cluster.inventory_path, s.cluster_sets)
        assert p.returncode == 1, p.stderr
        res = results(doc)
        msg = res["node3"]["message"]
        assert res["node3"]["status"] == "failed"
        assert msg.startswith(f"node3: not enough free space on {small}: need 0.000") and "free 0.00" in msg, msg
        assert "margin 5.0 GB" in msg                                   # the recipe's free_margin_gb
        assert os.listdir(small) == []                                  # nothing written there
        assert "node3: stage stage-engram failed" in p.stderr and "not enough free space" in p.stderr
        for h in ("node1", "node2", "node4"):
            assert res[h]["status"] == "skipped", res[h]
            assert res[h]["message"].startswith("already staged: rank"), res[h]
    finally:
        cluster.unmount_small_fs("node3", rel)


def test_restage_of_a_staged_cluster_asks_over_ssh_without_ansible(engram_cluster, staged):
    """A re-run where every rank is current: one SSH round trip per host, no playbook run; a host whose
    manifest is gone (an interrupted staging) goes through Ansible alone."""
    cluster, s, dep = engram_cluster
    assert staged[0].returncode == 0
    p, doc = deployctl_stage(cluster.inventory_path, s.cluster_sets)
    assert p.returncode == 0, p.stderr
    assert all(r["status"] == "skipped" for r in results(doc).values())
    assert not (Path(doc["run_dir"]) / "ansible").exists(), "no playbook ran"

    (Path(dep.engram_dir(dep.cluster.host("node2"))) / "engram-manifest.json").unlink()
    p, doc = deployctl_stage(cluster.inventory_path, s.cluster_sets)
    assert p.returncode == 0, p.stderr
    res = results(doc)
    assert res["node2"]["status"] == "ok" and "TASK [" in Path(res["node2"]["log"]).read_text()
    assert [res[h]["status"] for h in ("node1", "node3", "node4")] == ["skipped"] * 3
    s.check_dest(Path(dep.engram_dir(dep.cluster.host("node2"))), 4, 1, "sparse")


LAUNCH_DEP, LAUNCH_PORT, RECORD = "le4", 18002, "/tmp/dctl-record"


def LOADED(s) -> dict:
    """What the double's weights iterator loads from the whole checkpoint (the head's)."""
    from tests.test_engram_engine_read import D
    return D.engram_weights_loaded(str(s.ckpt))


def launch_inventory(cluster, s, dep, path: Path, **more) -> Path:
    """deployment LAUNCH_DEP on the 4 hosts over the module's checkpoint copies and staged folders,
    with the engine double recording the Engram rows it reads (MORE: further recipe overrides)."""
    sets = dict(x.split("=", 1) for x in s.cluster_sets)
    overrides = {"model.repo": dep.recipe.model.repo, "model.checkpoint_gb": dep.recipe.model.checkpoint_gb,
                 **{k: yaml.safe_load(v) for k, v in sets.items()},
                 "engine.master_port": 29621, "engine.env.DOUBLE_RECORD_DIR": RECORD,
                 "engine.env.DOUBLE_ENGRAM_SAMPLES": "32", **more}
    # the test hosts are small: no host-memory gate, no page-cache drop before the start (where the
    # recipe has them)
    engine_fields = {f.name for f in dataclasses.fields(type(dep.recipe.engine))}
    overrides.update({f"engine.{k}": v for k, v in (("min_mem_available_gib", 0), ("drop_caches", False))
                      if k in engine_fields})
    return write_inventory(cluster, path, LAUNCH_DEP, "deepseek-v41-flash-tp4", [h.name for h in cluster.hosts],
                           LAUNCH_PORT, overrides)


def test_engine_reads_the_staged_rows_in_every_container(engram_cluster, staged, double_image, tmp_path):
    """`deployctl up --only launch --only health` with the engine double as vLLM: every container gets
    DSV41_ENGRAM_DIR=/engram (its host's staged folder, mounted read-only); the double finds its rank's
    rows covered by engram-local.json, reads them through the folder's index and shard headers, and
    finds them equal to the model folder's; its record of the rows it read matches the checkpoint."""
    cluster, s, dep = engram_cluster
    p, _ = deployctl_stage(cluster.inventory_path, s.cluster_sets)      # current (earlier tests restage)
    assert p.returncode == 0, p.stderr
    inv = launch_inventory(cluster, s, dep, tmp_path / "inventory.yml")
    launch_dep = load_deployment(inv)
    for h in launch_dep.cluster.hosts:      # the same checkpoint copies and staged folders as above
        assert launch_dep.checkpoint_dir(h) == dep.checkpoint_dir(h)
        assert launch_dep.engram_dir(h) == dep.engram_dir(h)
    remove_all(cluster, LAUNCH_DEP)
    try:
        p = dctl("up", "-i", str(inv), "--only", "launch", "--only", "health", timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        loaded = LOADED(s)
        for h in launch_dep.cluster.hosts:
            (cid,) = containers(cluster, h.name, LAUNCH_DEP)
            env = json.loads(_docker(h.docker_host, "inspect", cid).stdout)[0]["Config"]["Env"]
            assert "DSV41_ENGRAM_DIR=/engram" in env and "DSV41_ENGRAM_DISK=1" in env
            logs = _docker(h.docker_host, "logs", cid)
            text = logs.stdout + logs.stderr
            rec = _docker(h.docker_host, "exec", cid, "cat", f"{RECORD}/engram-rows-rank{h.rank}.json")
            assert rec.returncode == 0, rec.stderr
            doc = json.loads(rec.stdout)
            for layer in s.layers:
                lo, hi = s.expected_range(layer, 4, h.rank)
                assert f"Engram rows from local dir /engram: layer {layer} rows [{lo}, {hi})" in text, text
                assert f"Engram layer {layer}: " in text and "identical to the model folder's" in text
                got = doc["layers"][str(layer)]
                assert (got["source"], got["dir"], got["row_start"], got["num_rows"]) == ("local", "/engram", lo, hi - lo)
                assert got["compared"] and str(lo) in got["rows"] and str(hi - 1) in got["rows"]
                # the weights iterator loaded every other tensor of the (partial) model folder, exact
                assert doc["loaded"] == loaded, doc["loaded"]
                for row, (w, sc) in got["rows"].items():
                    r = int(row)
                    want_w = read_rows(s.tensors[WEIGHT.format(layer=layer)], r, r + 1)
                    want_s = read_rows(s.tensors[SCALE.format(layer=layer)], r, r + 1)
                    assert (w, sc) == (hashlib.sha256(want_w).hexdigest(), hashlib.sha256(want_s).hexdigest())
            assert "Engram rows from model folder" not in text
    finally:
        dctl("down", "-i", str(inv), timeout=180)
        remove_all(cluster, LAUNCH_DEP)


def test_auto_staging_links_a_nodes_own_checkpoint(engram_cluster, staged):
    """engram.staging auto (the recipes' default) with each node's own checkpoint copy (sync-model source
    head) on the same filesystem as its NVMe folder: every host links the Engram shards instead of
    copying (nothing written), and says so; switching back to copy restages real sparse copies."""
    cluster, s, dep = engram_cluster
    auto = [x for x in s.cluster_sets if not x.startswith("engram.staging=")] + ["engram.staging=auto"]
    try:
        p, doc = deployctl_stage(cluster.inventory_path, auto)
        assert p.returncode == 0, p.stderr
        for h in dep.cluster.hosts:
            r = results(doc)[h.name]
            assert r["status"] == "ok" and r["data"]["mode"] == "link" and r["data"]["bytes_written"] == 0, r
            assert r["message"].startswith("linked the checkpoint's Engram shards"), r["message"]
            dest, ckpt = Path(dep.engram_dir(h)), Path(dep.checkpoint_dir(h))
            for name in r["data"]["files"]:
                a, b = (dest / name).stat(), (ckpt / name).stat()
                assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    finally:
        p, doc = deployctl_stage(cluster.inventory_path, s.cluster_sets)
        assert p.returncode == 0, p.stderr
    for h in dep.cluster.hosts:
        s.check_dest(Path(dep.engram_dir(h)), 4, h.rank)


UP_STAGES = ("--only", "sync-model", "--only", "stage-engram", "--only", "launch", "--only", "health")


def test_a_rewritten_linked_shard_is_repaired_and_its_engine_restarted(engram_cluster, staged, double_image, tmp_path):
    """#59, as an operator found it: `up` with engram.staging copy (the tests above), then `up` with
    auto (each rank's Engram shards become hard links to its own checkpoint's, which the chain gave it
    in part), then one byte of node3's rows of layer 1 flipped in the staged shard (the file the engine
    reads), its mtime put back. The next `up` must not serve it: sync-model re-hashes the shard (its
    ctime moved) and sends node3 the shard again, stage-engram relinks the new file, launch restarts
    node3's engine on it; the staged byte, read here, equals the head's checkpoint's, and the restarted
    engine's record of that row is the checkpoint's."""
    cluster, s, dep = engram_cluster
    inv = launch_inventory(cluster, s, dep, tmp_path / "inventory.yml", **{"engram.staging": "auto"})
    node3, head = dep.cluster.host("node3"), dep.cluster.head_host
    t = s.tensors[WEIGHT.format(layer=1)]
    lo, _ = s.expected_range(1, 4, node3.rank)
    at = t.offset + lo * t.row_bytes                       # the first byte of node3's first row of layer 1
    staged = Path(dep.engram_dir(node3)) / t.file.name
    theirs = Path(dep.checkpoint_dir(head)) / t.file.name

    def read_byte(path: Path) -> bytes:
        with open(path, "rb") as fh:
            return os.pread(fh.fileno(), 1, at)
    remove_all(cluster, LAUNCH_DEP)
    try:
        p = dctl("up", "-i", str(inv), *UP_STAGES, "--json", timeout=400)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        res = {(r["stage"], r["host"]): r for st in json.loads(p.stdout)["stages"] for r in st["results"]}
        assert res[("stage-engram", "node3")]["data"]["mode"] == "link", res[("stage-engram", "node3")]
        a, b = staged.stat(), (Path(dep.checkpoint_dir(node3)) / t.file.name).stat()
        assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino), "node3's staged shard is its checkpoint's own file"
        (before,) = containers(cluster, "node3", LAUNCH_DEP)
        good = read_byte(theirs)
        assert read_byte(staged) == good
        st = staged.stat()
        with open(staged, "r+b") as fh:                    # a careless tool: one byte, the mtime put back
            os.pwrite(fh.fileno(), bytes([good[0] ^ 0xFF]), at)
        os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert read_byte(staged) != good and staged.stat().st_mtime_ns == st.st_mtime_ns

        p = dctl("up", "-i", str(inv), *UP_STAGES, "--json", timeout=400)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        res = {(r["stage"], r["host"]): r for st in json.loads(p.stdout)["stages"] for r in st["results"]}
        sync, stg = res[("sync-model", "node3")], res[("stage-engram", "node3")]
        assert sync["status"] == "ok" and t.file.name in sync["data"]["to_send"], sync
        assert stg["status"] == "ok" and stg["data"]["mode"] == "link", stg
        assert read_byte(staged) == read_byte(theirs) == good, "node3 serves the head's byte again"
        (after,) = containers(cluster, "node3", LAUNCH_DEP)
        assert after != before, "node3's engine restarted on the repaired rows"
        rec = _docker(node3.docker_host, "exec", after, "cat", f"{RECORD}/engram-rows-rank{node3.rank}.json")
        assert rec.returncode == 0, rec.stderr
        got = json.loads(rec.stdout)["layers"]["1"]
        assert got["source"] == "local" and str(lo) in got["rows"], got
        assert got["rows"][str(lo)][0] == hashlib.sha256(read_rows(t, lo, lo + 1)).hexdigest()
        for h in ("node2", "node4"):                       # the other workers had nothing to repair
            assert res[("sync-model", h)]["status"] == "skipped", res[("sync-model", h)]
        for h in ("node1", "node2", "node4"):
            assert res[("stage-engram", h)]["status"] == "skipped", res[("stage-engram", h)]
    finally:
        dctl("down", "-i", str(inv), timeout=180)
        remove_all(cluster, LAUNCH_DEP)
        p, _ = deployctl_stage(cluster.inventory_path, s.cluster_sets)    # back to copies, as the module left it
        assert p.returncode == 0, p.stderr
