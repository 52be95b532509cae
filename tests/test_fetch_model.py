"""fetch-model on the test cluster: the real huggingface_hub client (in the serving image on the head)
against a Hub endpoint served from another test host (tests/hub_endpoint.py), with HF_ENDPOINT.

A full fetch, its no-op and `plan --check`, then sync-model from what it fetched; a download
interrupted mid-file (Ctrl-C, its container killed) resumed from its partial file; a corrupted byte served (found, the blob deleted, nothing published); a gated
repo without a token (refused, nothing written) and with one (fetched, the token nowhere in records);
a head without room (refused before a byte); a revision and a repo that do not exist."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.images import DEBIAN_IMAGE
from tests.hub_endpoint import publish, set_faults

pytestmark = pytest.mark.cluster
FIGURES: dict[str, float] = {}
TOKEN = "hf_deployctl_test_token_0123456789"


@pytest.fixture(scope="module")
def hub(cluster, base_images, tmp_path_factory):
    """(endpoint URL, the hub's folder): served from the last host, as a mirror on the LAN would be."""
    root = tmp_path_factory.mktemp("hub")
    host = cluster.hosts[-1]
    url = cluster.start_hub(host, root)
    cluster.load_image(cluster.hosts[0], DEBIAN_IMAGE)      # the "serving image": it ships the client
    yield url, root
    cluster.stop_hub(host)


def make_repo(tmp: Path, name: str, shards: int = 3, shard_bytes: int = 40_000_000) -> Path:
    src = tmp / f"src-{name}"
    src.mkdir(parents=True)
    for i in range(1, shards + 1):
        with open(src / f"model-{i:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(os.urandom(shard_bytes))
    (src / "config.json").write_text(json.dumps({"model_type": "synthetic", "name": name}))
    (src / "README.md").write_text("not selected by the allow patterns\n")
    return src


def inventory(cluster, tmp: Path, url: str, **extra) -> Path:
    doc = yaml.safe_load(cluster.inventory_path.read_text())
    doc["all"]["vars"].update({"model_fetch": "hub", "hf_endpoint": url, "run_dir": str(tmp / "runs"), **extra})
    p = tmp / "inventory.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def dctl(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def fetch(inv: Path, repo: str, *extra: str, env: dict | None = None, stage: str = "fetch-model"):
    return dctl(stage, "-i", str(inv), "--set", f"model.repo={repo}", "--set", "model.revision=main",
                "--set", f"engine.image={DEBIAN_IMAGE}",
                "--set", 'model.allow_patterns=["*.safetensors", "*.json"]', "--json", *extra, env=env)


def results(doc: dict) -> list[dict]:
    return [r for s in doc["stages"] for r in s["results"]]


def repo_dir(cluster, repo: str) -> Path:
    return cluster.hosts[0].model_cache / f"models--{repo.replace('/', '--')}"


def test_fetch_then_noop_then_sync_from_it(cluster, hub, tmp_path):
    url, root = hub
    repo = "synthetic/fetch-full"
    src = make_repo(tmp_path, "full")
    commit = publish(root, repo, src)
    inv = inventory(cluster, tmp_path, url)

    t0 = time.monotonic()
    p = fetch(inv, repo)
    FIGURES["full_fetch_s"] = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    res = next(r for r in results(doc) if r["stage"] == "fetch-model")
    assert res["status"] == "ok" and res["data"]["commit"] == commit, res
    assert res["data"]["downloaded_bytes"] == 3 * 40_000_000 + len((src / "config.json").read_bytes())
    base = repo_dir(cluster, repo)
    snap = base / "snapshots" / commit
    assert (base / "refs" / "main").read_text() == commit
    assert sorted(x.name for x in snap.iterdir()) == sorted(
        ["config.json"] + [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)])   # no README.md
    for f in snap.iterdir():
        assert f.is_symlink() and os.readlink(f).startswith("../../blobs/")
        assert f.read_bytes() == (src / f.name).read_bytes()
        if f.suffix == ".safetensors":
            assert Path(os.path.realpath(f)).name == hashlib.sha256(f.read_bytes()).hexdigest()
    assert not list((base / "blobs").glob("*.incomplete"))
    run = Path(doc["run_dir"])
    plan = json.loads((run / "plan.json").read_text())
    assert plan["checkpoint"]["commit"] == commit and plan["checkpoint"]["pinned"] is False
    assert json.loads((run / "fetch-model.json").read_text())["commit"] == commit
    assert "NOT pinned" in " ".join(a["summary"] for s in plan["stages"] for a in s["actions"])

    t0 = time.monotonic()
    p = fetch(inv, repo)
    FIGURES["noop_fetch_s"] = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    res = next(r for r in results(json.loads(p.stdout)) if r["stage"] == "fetch-model")
    assert res["status"] == "skipped" and "up to date" in res["message"], res
    assert FIGURES["noop_fetch_s"] < 15, FIGURES

    # --rehash reads every blob again instead of trusting the stat: all verified, nothing downloaded
    p = fetch(inv, repo, "--rehash")
    assert p.returncode == 0, p.stderr[-3000:]
    res = next(r for r in results(json.loads(p.stdout)) if r["stage"] == "fetch-model")
    assert res["status"] == "ok" and res["data"]["downloaded_bytes"] == 0, res

    # plan --check asks the Hub now and says what main is and that the head holds it
    p = dctl("plan", "-i", str(inv), "--check", "--set", f"model.repo={repo}", "--set", "model.revision=main",
             "--set", 'model.allow_patterns=["*.safetensors", "*.json"]', "--set", f"engine.image={DEBIAN_IMAGE}")
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"= commit {commit[:12]}" in p.stderr and "NOT pinned" in p.stderr and "all of them verified" in p.stderr

    # sync-model resolves "main" from the head's refs (what the fetch wrote) and gets the Hub's
    # sha256 for every shard from the fetch (hashes only the small config.json itself)
    p = dctl("sync-model", "-i", str(inv), "--set", f"model.repo={repo}", "--set", "model.revision=main",
             "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for w in cluster.hosts[1:]:
        wsnap = w.model_cache / f"models--{repo.replace('/', '--')}" / "snapshots" / commit
        assert (wsnap / "model-00002-of-00003.safetensors").read_bytes() == (src / "model-00002-of-00003.safetensors").read_bytes()
    head_res = next(r for r in results(json.loads(p.stdout)) if r["host"] == cluster.hosts[0].name)
    assert head_res["data"]["hashed_bytes"] < 1_000_000, head_res      # the shards' hashes came from the Hub


@pytest.mark.parametrize("how", ["ctrl-c", "container-killed"])
def test_interrupted_download_resumes_from_its_partial_file(cluster, hub, tmp_path, how):
    url, root = hub
    repo = f"synthetic/fetch-resume-{how}"
    src = make_repo(tmp_path, "resume", shards=1, shard_bytes=120_000_000)
    commit = publish(root, repo, src)
    set_faults(root, repo, rate=30_000_000)                  # 4 s for the shard: time to interrupt it
    inv = inventory(cluster, tmp_path, url)
    name = f"deployctl-fetch-{yaml.safe_load(inv.read_text())['all']['vars']['deployment']}"
    blob_dir = repo_dir(cluster, repo) / "blobs"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", "fetch-model", "-i", str(inv),
                             "--set", f"model.repo={repo}", "--set", f"engine.image={DEBIAN_IMAGE}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        parts = list(blob_dir.glob("*.incomplete")) if blob_dir.exists() else []
        if parts and parts[0].stat().st_size >= 30_000_000:
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the download never got going")
    if how == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    else:
        k = cluster.nsexec(cluster.hosts[0], ["docker", "kill", name])
        assert k.returncode == 0, k.stderr
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == (130 if how == "ctrl-c" else 1), err[-2000:]
    ps = cluster.nsexec(cluster.hosts[0], ["docker", "ps", "-a", "--filter", f"name={name}", "-q"])
    assert ps.stdout.strip() == "", "no download left running or lying around"
    kept = list(blob_dir.glob("*.incomplete"))
    assert kept and kept[0].stat().st_size >= 30_000_000
    partial = kept[0].stat().st_size
    assert not (repo_dir(cluster, repo) / "snapshots" / commit / "model-00001-of-00001.safetensors").exists()

    set_faults(root, repo)
    p = fetch(inv, repo)
    assert p.returncode == 0, p.stderr[-3000:]
    res = next(r for r in results(json.loads(p.stdout)) if r["stage"] == "fetch-model")
    assert res["data"]["resumed_bytes"] >= partial and "resumed" in res["message"], res
    assert res["data"]["downloaded_bytes"] <= 120_000_000 - partial + 200
    ranges = [json.loads(x)["range"] for x in (root / "requests.log").read_text().splitlines()
              if repo in x and json.loads(x)["method"] == "GET" and "safetensors" in x]
    assert ranges[-1] == f"bytes={partial}-", ranges
    got = (repo_dir(cluster, repo) / "snapshots" / commit / "model-00001-of-00001.safetensors").read_bytes()
    assert got == (src / "model-00001-of-00001.safetensors").read_bytes()


def test_a_corrupted_byte_is_found_and_never_published(cluster, hub, tmp_path):
    url, root = hub
    repo = "synthetic/fetch-corrupt"
    src = make_repo(tmp_path, "corrupt", shards=2, shard_bytes=20_000_000)
    commit = publish(root, repo, src)
    set_faults(root, repo, corrupt={"model-00002-of-00002.safetensors": 12_345_678})
    inv = inventory(cluster, tmp_path, url)
    p = fetch(inv, repo)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "model-00002-of-00002.safetensors" in p.stderr and "did not match the Hub's hashes" in p.stderr
    base = repo_dir(cluster, repo)
    good = hashlib.sha256((src / "model-00002-of-00002.safetensors").read_bytes()).hexdigest()
    assert not (base / "blobs" / good).exists() and not list((base / "blobs").glob("*.incomplete"))
    assert not (base / "snapshots" / commit / "model-00002-of-00002.safetensors").exists()
    assert not (base / "refs" / "main").exists()             # nothing points at an incomplete snapshot

    set_faults(root, repo)
    p = fetch(inv, repo)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (base / "blobs" / good).read_bytes() == (src / "model-00002-of-00002.safetensors").read_bytes()


def test_gated_repo_needs_a_token_that_never_shows(cluster, hub, tmp_path):
    url, root = hub
    repo = "synthetic/fetch-gated"
    commit = publish(root, repo, make_repo(tmp_path, "gated", shards=1, shard_bytes=5_000_000), gated=True,
                     tokens=(TOKEN,))
    inv = inventory(cluster, tmp_path, url)
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    p = subprocess.run([sys.executable, "-m", "orchestrator", "fetch-model", "-i", str(inv),
                        "--set", f"model.repo={repo}", "--set", f"engine.image={DEBIAN_IMAGE}"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "gated" in p.stderr and "HF_TOKEN" in p.stderr
    assert not repo_dir(cluster, repo).exists()               # nothing written

    token_file = tmp_path / "hf-token"
    token_file.write_text(TOKEN + "\n")
    inv = inventory(cluster, tmp_path, url, hf_token_file=str(token_file))
    p = fetch(inv, repo, "-v")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (repo_dir(cluster, repo) / "snapshots" / commit).is_dir()
    run = Path(json.loads(p.stdout)["run_dir"])
    seen = p.stdout + p.stderr + "".join(f.read_text(errors="replace") for f in run.rglob("*") if f.is_file())
    assert TOKEN not in seen
    inspect = cluster.nsexec(cluster.hosts[0], ["docker", "ps", "-a", "--no-trunc"])
    assert TOKEN not in inspect.stdout


def test_no_room_on_the_head_is_refused_before_a_byte(cluster, hub, tmp_path):
    url, root = hub
    repo = "synthetic/fetch-nospace"
    publish(root, repo, make_repo(tmp_path, "nospace", shards=1, shard_bytes=60_000_000))
    small = cluster.small_fs(cluster.hosts[0], "small-model-cache", 40)
    try:
        doc = yaml.safe_load(cluster.inventory_path.read_text())
        doc["all"]["hosts"][cluster.hosts[0].name]["model_cache"] = str(small)
        (tmp_path / "base.yml").write_text(yaml.safe_dump(doc))
        inv = inventory(cluster, tmp_path, url)
        d = yaml.safe_load(inv.read_text())
        d["all"]["hosts"][cluster.hosts[0].name]["model_cache"] = str(small)
        inv.write_text(yaml.safe_dump(d))
        p = fetch(inv, repo)
        assert p.returncode == 2, p.stderr[-2000:]
        assert "short by" in p.stderr and f"all.hosts.{cluster.hosts[0].name}.model_cache" in p.stderr
        assert list(small.iterdir()) == []                       # not even the repo's folder
    finally:
        cluster.unmount_small_fs(cluster.hosts[0], "small-model-cache")


@pytest.mark.parametrize("what", ["revision", "repo"])
def test_missing_revision_or_repo_is_bad_input(cluster, hub, tmp_path, what):
    url, root = hub
    repo = "synthetic/fetch-exists"
    publish(root, repo, make_repo(tmp_path, "exists", shards=1, shard_bytes=1_000_000))
    inv = inventory(cluster, tmp_path, url)
    target = repo if what == "revision" else "synthetic/no-such-repo"
    p = dctl("fetch-model", "-i", str(inv), "--set", f"model.repo={target}",
             "--set", f"model.revision={'v9-no-such-tag' if what == 'revision' else 'main'}", timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert ("does not exist" if what == "revision" else "not found on the Hub") in p.stderr
    assert not repo_dir(cluster, "synthetic/no-such-repo").exists()


def test_hub_unreachable_a_verified_pinned_snapshot_still_serves(cluster, hub, tmp_path):
    """A commit this head fetched and verified (same allow_patterns) is taken from its cache without
    asking the Hub at all: a commit never changes, and a rollback to a release's commit must not fail
    on the Hub (down, a revoked token, a rewritten repository). A branch still asks, and falls back to
    the verified snapshot, saying so, when the Hub cannot be reached."""
    url, root = hub
    repo = "synthetic/fetch-offline"
    commit = publish(root, repo, make_repo(tmp_path, "offline", shards=1, shard_bytes=2_000_000))
    inv = inventory(cluster, tmp_path, url)

    def run(revision: str) -> dict:
        p = dctl("fetch-model", "-i", str(inv), "--set", f"model.repo={repo}", "--set", f"model.revision={revision}",
                 "--set", f"engine.image={DEBIAN_IMAGE}", "--set", 'model.allow_patterns=["*.safetensors", "*.json"]',
                 "--json")
        assert p.returncode == 0, p.stderr[-3000:]
        doc = json.loads(p.stdout)
        res = next(r for r in results(doc) if r["stage"] == "fetch-model")
        plan = json.loads((Path(doc["run_dir"]) / "plan.json").read_text())
        return {"result": res, "plan": plan, "summary": " ".join(a["summary"] for s in plan["stages"] for a in s["actions"])}

    def asked() -> int:
        log = root / "requests.log"
        return sum(1 for line in log.read_text().splitlines() if repo in line) if log.exists() else 0

    assert run("main")["result"]["status"] == "ok"
    before = asked()
    pinned = run(commit)
    assert pinned["result"]["status"] == "skipped" and "up to date" in pinned["result"]["message"], pinned
    assert pinned["plan"]["checkpoint"]["source"] == "cache" and asked() == before, "the Hub is not asked"
    cluster.stop_hub(cluster.hosts[-1])
    try:
        pinned = run(commit)
        assert pinned["result"]["status"] == "skipped" and "did not answer" not in pinned["summary"], pinned
        branch = run("main")
        assert branch["result"]["status"] == "skipped" and "the Hub did not answer" in branch["summary"], branch
        assert branch["plan"]["checkpoint"]["source"] == "cache" and branch["plan"]["checkpoint"]["commit"] == commit
    finally:
        cluster.start_hub(cluster.hosts[-1], root)


def test_zz_report_figures():
    print(f"\nfetch-model figures: {json.dumps({k: round(v, 2) for k, v in FIGURES.items()})}")
