"""sync-model without the cluster: the host script (run the way it runs on hosts), rsync argv and
output parsing, shared-storage verdicts, the plan, progress."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.modelsync import rsync
from orchestrator.hostside.modelsync import BOOTSTRAP
from orchestrator.modelsync.manifest import Manifest, Verdict
from orchestrator.modelsync.progress import Progress
from orchestrator.modelsync.shared import problems
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.stages import build_plan

HOSTSIDE = Path(__file__).resolve().parents[1] / "orchestrator" / "hostside" / "modelsync.py"


def hostside(op: str, *args: str, data: bytes = b"") -> tuple[int, dict, str]:
    """Run hostside.py exactly as remote.hostside does over SSH: `python3 -c BOOTSTRAP N ...`."""
    script = HOSTSIDE.read_bytes()
    p = subprocess.run(["python3", "-c", BOOTSTRAP, str(len(script)), op, *args], input=script + data,
                       capture_output=True, timeout=60)
    out = json.loads(p.stdout.decode().splitlines()[-1]) if p.returncode == 0 else {}
    return p.returncode, out, p.stderr.decode()


def hf_repo(base: Path, files: dict[str, bytes], rev: str = "c0ffee" * 6 + "abcd") -> Path:
    """An HF cache repo: blobs named by sha256, snapshots/REV/name -> ../../blobs/sha."""
    import hashlib
    (base / "blobs").mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)
    snap = base / "snapshots" / rev
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (base / "blobs" / sha).write_bytes(data)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(base / "blobs" / sha, link.parent))
    return snap


FILES = {"config.json": b'{"a": 1}', "model-00001-of-00002.safetensors": os.urandom(300_000),
         "model-00002-of-00002.safetensors": os.urandom(200_000), "sub/tokenizer.json": b"{}"}


def test_manifest_follows_links_and_caches(tmp_path):
    snap = hf_repo(tmp_path / "models--o--m", FILES)
    cache = tmp_path / "nvme" / "c.json"
    rc, m, err = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    assert rc == 0, err
    import hashlib
    assert m["files"] == [[k, len(v), hashlib.sha256(v).hexdigest()] for k, v in sorted(FILES.items())]
    assert m["hashed_bytes"] == sum(map(len, FILES.values()))
    rc, again, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    assert again["files"] == m["files"] and again["hashed_bytes"] == 0       # all from the cache
    rc, forced, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache), "--rehash")
    assert forced["hashed_bytes"] == m["hashed_bytes"]


def test_a_hard_link_is_no_change_only_when_its_maker_restamps_and_a_write_always_is(tmp_path):
    """#33, #59: stage-engram hard-links the Engram shards' blobs; link(2) and unlink(2) move their
    ctime and link count, not a byte. The head's manifest and fetch-model's check hash nothing for a
    link whose maker restamped their records (what engram_stage.py does around its own links), and
    catch every write, above all one that put the mtime back after the link count moved (#59: the
    stamp was taken before the link, so a moved link count once excused the write too)."""
    from orchestrator.hostside import hubfetch
    from orchestrator.hostside import modelsync as M
    snap = hf_repo(tmp_path / "models--o--m", FILES)
    cache = tmp_path / "nvme" / "c.json"
    shard = snap / "model-00001-of-00002.safetensors"
    staged = tmp_path / "staged" / shard.name
    staged.parent.mkdir()
    _, m, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    job = {"model_cache": str(tmp_path), "repo": "o/m", "commit": snap.name, "state": str(tmp_path / "state.json"),
           "files": [{"name": n, "size": len(d), "sha256": "x" * 64, "blob_id": ""} for n, d in FILES.items()]}

    def stamp_state() -> None:
        hubfetch.write_json(job["state"], {"version": hubfetch.STATE_VERSION, "repo": "o/m", "commits": {snap.name: {
            "files": {f["name"]: {"etag": "x" * 64, "stat": hubfetch.stat_key((snap / f["name"]).stat()),
                                  "nlink": (snap / f["name"]).stat().st_nlink} for f in job["files"]}}}})

    def linked(step) -> None:
        """STEP (a link or unlink of the shard's blob), restamped by its maker as engram_stage does."""
        before = shard.stat()
        step()
        move = M.link_move(before, shard.stat())
        assert move is not None
        assert M.restamp(str(cache), str(snap), {shard.name: [move]}) == [shard.name]
        assert hubfetch.restamp(job["state"], [move]) == 1

    def write_keeping_mtime() -> None:
        st = shard.stat()
        with open(shard, "r+b") as fh:
            fh.write(os.urandom(8))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))

    # a link nobody restamped: taken for a write (one re-hash of that file, never a missed write)
    stamp_state()
    os.link(os.path.realpath(shard), staged)
    _, again, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    assert again["files"] == m["files"] and again["hashed_bytes"] == len(FILES[shard.name])
    assert [f["name"] for f in hubfetch.plan_files(job)[1]] == [shard.name]
    # #59: linked (the stamp taken before), then written with the mtime put back: the link count
    # moved as well, and the write must still show, on the head's manifest and in fetch-model's check
    staged.unlink()
    _, m, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    stamp_state()
    os.link(os.path.realpath(shard), staged)
    write_keeping_mtime()
    _, third, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    assert third["hashed_bytes"] == len(FILES[shard.name]) and third["files"] != m["files"]
    assert [f["name"] for f in hubfetch.plan_files(job)[1]] == [shard.name]
    # the linker restamps: its link and its unlink cost nothing, on the head or in fetch-model's check
    staged.unlink()
    m = hostside("manifest", "--root", str(snap), "--cache", str(cache))[1]
    stamp_state()
    linked(lambda: os.link(os.path.realpath(shard), staged))
    _, again, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    assert again["files"] == m["files"] and again["hashed_bytes"] == 0
    done, todo, _ = hubfetch.plan_files(job)
    assert len(done) == len(FILES) and todo == []
    linked(staged.unlink)
    assert hostside("manifest", "--root", str(snap), "--cache", str(cache))[1]["hashed_bytes"] == 0
    assert hubfetch.plan_files(job)[1] == []
    # ... and a write after a restamped link (the link count unchanged since) is a write
    linked(lambda: os.link(os.path.realpath(shard), staged))
    write_keeping_mtime()
    _, fourth, _ = hostside("manifest", "--root", str(snap), "--cache", str(cache))
    assert fourth["hashed_bytes"] == len(FILES[shard.name]) and fourth["files"] != m["files"]
    assert [f["name"] for f in hubfetch.plan_files(job)[1]] == [shard.name]
    # a restamp never excuses what happened before it: an entry not current at the link stays stale
    write_keeping_mtime()
    before = shard.stat()
    staged.unlink()
    assert M.restamp(str(cache), str(snap), {shard.name: [M.link_move(before, shard.stat())]}) == []


def test_manifest_errors_name_the_fix(tmp_path):
    snap = hf_repo(tmp_path / "models--o--m", {"a.safetensors": b"x"})
    rc, _, err = hostside("manifest", "--root", str(snap.parent / "main"), "--cache", str(tmp_path / "c"))
    assert rc == 3 and "no checkpoint folder" in err and f"main -> {snap.name}" in err
    (snap / "b.safetensors").symlink_to("../../blobs/missing")
    rc, _, err = hostside("manifest", "--root", str(snap), "--cache", str(tmp_path / "c"))
    assert rc == 3 and "broken links" in err and "b.safetensors" in err


def test_verify_finds_missing_differing_extra_and_corruption_with_mtime_kept(tmp_path):
    snap = hf_repo(tmp_path / "head", FILES)
    _, m, _ = hostside("manifest", "--root", str(snap), "--cache", str(tmp_path / "h.json"))
    dst = tmp_path / "worker"
    cache = str(tmp_path / "w.json")
    rc, v, _ = hostside("verify", "--root", str(dst), "--cache", cache, data=json.dumps(m).encode())
    assert rc == 0 and v["exists"] is False and len(v["missing"]) == len(FILES) and v["avail_bytes"] > 0
    assert v["avail_path"] == str(tmp_path)                      # nearest existing parent
    subprocess.run(["cp", "-rL", str(snap), str(dst)], check=True)
    (dst / "notes.txt").write_text("mine")
    rc, v, _ = hostside("verify", "--root", str(dst), "--cache", cache, data=json.dumps(m).encode())
    assert (v["ok"], v["missing"], v["differ"], v["extra"]) == (len(FILES), [], [], ["notes.txt"])
    rc, v, _ = hostside("verify", "--root", str(dst), "--cache", cache, data=json.dumps(m).encode())
    assert v["hashed_bytes"] == 0                                # the worker's cache
    # bit flip that keeps size and mtime: the ctime in the cache key still sees it
    f = dst / "model-00001-of-00002.safetensors"
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\xff" * 16)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, v, _ = hostside("verify", "--root", str(dst), "--cache", cache, data=json.dumps(m).encode())
    assert [p for p, _ in v["differ"]] == [f.name] and "sha256" in v["differ"][0][1]
    verdict = Verdict.from_json(v)
    man = Manifest.from_json(m)
    assert verdict.to_send(man) == [f.name] and verdict.bytes_to_send(man) == 300_000
    # after a complete copy, --clean drops rsync's leftovers and nothing else
    f.write_bytes(FILES[f.name])
    (dst / ".deployctl-rsync-partial").mkdir()
    (dst / ".deployctl-rsync-partial" / "config.json").write_text("{")
    (dst / ".config.json.Ab12Cd").write_text("{")
    rc, v, _ = hostside("verify", "--root", str(dst), "--cache", cache, "--clean", data=json.dumps(m).encode())
    assert v["cleaned"] == [".deployctl-rsync-partial", ".config.json.Ab12Cd"] and v["extra"] == ["notes.txt"]
    assert sorted(p.name for p in dst.iterdir() if p.name.startswith(".")) == []
    # sizes-only (shared mode) sees sizes, not bytes
    rc, v, _ = hostside("verify", "--root", str(dst), "--cache", cache, "--sizes-only",
                        data=json.dumps(m).encode())
    assert v["ok"] == len(FILES) and v["hashed_bytes"] == 0


def test_marker_roundtrip_and_mount_facts(tmp_path):
    snap = hf_repo(tmp_path / "r", {"a": b"1"})
    rc, m, err = hostside("manifest", "--root", str(snap), "--cache", str(tmp_path / "c"),
                          "--marker", ".deployctl-shared-marker=n0nce")
    assert rc == 0, err
    assert m["mount"]["target"] and m["mount"]["fstype"] and m["files"] == [["a", 1, m["files"][0][2]]]
    rc, v, _ = hostside("verify", "--root", str(snap), "--cache", str(tmp_path / "c"), "--sizes-only",
                        "--marker", ".deployctl-shared-marker", data=json.dumps(m).encode())
    assert v["marker"] == "n0nce" and v["extra"] == []           # our marker is never listed
    rc, _, _ = hostside("unmark", "--root", str(snap), "--marker", ".deployctl-shared-marker")
    assert rc == 0 and not (snap / ".deployctl-shared-marker").exists()
    rc, _, err = hostside("unmark", "--root", str(snap), "--marker", "../etc/passwd")
    assert rc == 3 and "bad marker" in err


def test_rsync_argv_and_ssh_options():
    o = rsync.SshOptions("/k ey", "/kh", True, 7)
    argv = rsync.rsync_argv("/src", "root", "10.0.0.2", "/dst", 2222, o, io_timeout=30, total_timeout=900,
                            bwlimit_mbps=50)
    assert argv[:4] == ["timeout", "-k", "10", "900"] and argv[4] == "rsync"
    for flag in ("--files-from=-", "--from0", "--ignore-times", "--copy-links", "--mkpath", "--timeout=30",
                 "--partial-dir=.deployctl-rsync-partial", "--bwlimit=50000k"):
        assert flag in argv
    e = argv[argv.index("-e") + 1]
    assert e.startswith("ssh -p 2222 -i '/k ey' -o IdentitiesOnly=yes -o UserKnownHostsFile=/kh "
                        "-o StrictHostKeyChecking=yes -o BatchMode=yes -o ConnectTimeout=7")
    assert argv[-2:] == ["/src/", "root@10.0.0.2:/dst/"]
    off = rsync.ssh_command(22, rsync.SshOptions(None, "/kh", False))
    assert "StrictHostKeyChecking=no" in off and "UserKnownHostsFile=/dev/null" in off and "-i" not in off


def test_rsync_output_parsing_and_errors():
    assert rsync.parse_progress("     50,000,000  62%   72.75MB/s    0:00:00 (xfr#1, to-chk=2/3)") == (50_000_000, 62)
    assert rsync.parse_progress("Number of files: 3 (reg: 3)") is None
    stats = rsync.parse_stats("Number of regular files transferred: 1\nTotal transferred file size: 40,000,000 bytes\n"
                              "Literal data: 4,096 bytes\nMatched data: 39,995,904 bytes\n")
    assert stats == {"files_sent": 1, "bytes_sent": 40_000_000, "literal_bytes": 4096, "matched_bytes": 39_995_904}
    msg = rsync.explain(30, "[sender] io timeout after 8 seconds -- exiting", "node3", "10.0.0.3", "/d", 8, 900)
    assert "node3" in msg and "8s" in msg and "resume" in msg
    assert "out of space on node3:/d" in rsync.explain(11, "write failed: No space left on device (28)",
                                                       "node3", "a", "/d", 8, 9)
    assert "host key" in rsync.explain(255, "Host key verification failed.", "node3", "a", "/d", 8, 9)


def _verdict(**kw) -> Verdict:
    base = dict(root="/m/x", exists=True, missing=(), differ=(), ok=2, extra=(), avail_path="/m",
                avail_bytes=10, mount={"target": "/mnt/models", "fstype": "nfs4", "source": "nas:/m"},
                marker="N")
    base.update(kw)
    return Verdict(**base)


def test_shared_verdicts():
    assert problems("node2", _verdict(), "N", "/mnt/models") == []
    local = problems("node2", _verdict(mount={"target": "/", "fstype": "ext4", "source": "/dev/sda1"}, marker=None),
                     "N", "/mnt/models")
    assert len(local) == 2 and "not on the shared mount /mnt/models" in local[0] and "not visible" in local[1]
    assert "does not exist" in problems("node2", _verdict(exists=False), "N", "")[0]
    assert "incomplete" in problems("node2", _verdict(missing=("a",)), "N", "")[0]


def test_plan_head_and_shared_and_single_host(tmp_path):
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("model.revision=" + "a" * 40,))
    sp = build_plan(dep, only=("sync-model",)).stage("sync-model")
    # spark4 gives every host a fabric address: the chain is its default, every hop over the fabric
    assert [(a.host, a.op) for a in sp.actions] == [(dep.cluster.head, "manifest")] + [
        (h.name, "chain") for h in dep.cluster.workers]
    assert "every hop over the fabric" in sp.note and sp.actions[2].details["upstream"] == sp.actions[1].host
    assert sp.actions[1].details["listen"] == dep.cluster.workers[0].fabric_address.split("/")[0]
    doc = yaml.safe_load((INVENTORIES_DIR / "spark4.yml").read_text())
    doc["all"]["vars"]["distribution"] = "direct"
    (tmp_path / "spark4.yml").write_text(yaml.safe_dump(doc))
    dep = load_deployment(tmp_path / "spark4.yml", None, ("model.revision=" + "a" * 40,))
    sp = build_plan(dep, only=("sync-model",)).stage("sync-model")
    assert [(a.host, a.op) for a in sp.actions] == [(dep.cluster.head, "manifest")] + [
        (h.name, "rsync") for h in dep.cluster.workers]
    head, w = sp.actions[0], sp.actions[1]
    assert "pinned commit" in head.summary and w.command[0] == "ssh"
    assert dep.cluster.head_host.address in w.command[1] and "rsync" in w.command
    assert w.command[-1].endswith(dep.checkpoint_dir(dep.cluster.host(w.host)) + "/")
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("model.source=shared",
                                                                 "model.shared_path=/mnt/models"))
    sp = build_plan(dep, only=("sync-model",)).stage("sync-model")
    assert {a.op for a in sp.actions} == {"verify-shared"} and len(sp.actions) == len(dep.cluster.hosts)
    assert "NOT pinned" in sp.actions[0].summary
    dep = load_deployment(INVENTORIES_DIR / "spark1.yml")
    sp = build_plan(dep, only=("sync-model",)).stage("sync-model")
    assert sp.actions == () and "single host" in sp.note


class _Ctx:
    def __init__(self):
        self.said = []

    def say(self, text):
        self.said.append(text)


class _Log:
    def __init__(self):
        self.lines = []

    def write(self, text):
        self.lines.append(text)


def test_progress_lines_are_throttled_with_rate_and_eta():
    t = [0.0]
    ctx, log = _Ctx(), _Log()
    p = Progress("node2", 1_000_000_000, ctx, log, clock=lambda: t[0])
    for i in range(1, 101):
        t[0] = i * 0.1
        p.line(f"  {i * 10_000_000:,} {i}%  100.00MB/s  0:00:01 (xfr#1, to-chk=1/2)")
    p.line("sent 1 bytes")
    assert len(ctx.said) == 11 and "node2" in ctx.said[0] and "ETA" in ctx.said[0]   # first, then every 10 %
    assert "100 MB/s" in ctx.said[4].replace(".0 MB/s", " MB/s")
    assert log.lines[-1] == "sent 1 bytes" and len(log.lines) < 10


def test_cli_help_lists_options():
    p = subprocess.run([sys.executable, "-m", "orchestrator", "sync-model", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0 and "--bwlimit" in p.stdout and "--head-key" in p.stdout


@pytest.mark.parametrize("bad", ["model.shared_path=rel/path", "model.source=nfs"])
def test_recipe_rejects_bad_shared_settings(bad):
    from orchestrator.errors import InputError
    with pytest.raises(InputError):
        load_deployment(INVENTORIES_DIR / "spark4.yml", None, (bad, "model.source=shared")
                        if "path" in bad else (bad,))
