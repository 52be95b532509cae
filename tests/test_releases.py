"""#17 and #38 on the test cluster: releases, rollback, rollback on failure, pinned images, a history
that lives on the head, and the checkpoint commit each release served. Four hosts, the TP=4 DeepSeek
recipe on the engine double (scaled like test_hardening_cluster.py's hk4), its checkpoint fetched from
the cluster's own Hub endpoint as in the README demo (fetch-model onto the head, sync-model to the
workers, stage-engram per rank): no folder is put on a host by hand. Images A, B, D are the double
with a different label each (different image IDs); C also has DOUBLE_FAIL=crash-at-start baked in.
They are loaded into the head's engine only: `up` ships them to the workers. The tests run in order
and share the cluster's state (the release history grows: 1 A, 2 B, 3 rollback of 2 after C crashed,
4 rollback of 1, ...). The pure decisions: tests/test_releases_units.py."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from orchestrator import releases as rel
from orchestrator.deployment import load_deployment
from tests.hub_endpoint import publish
from tests.test_launch import (IMAGE, TP4, _docker, containers, dctl, double_image, engram_overrides,  # noqa: F401
                               engram_synth, out, remove_all, unwrap, write_inventory)

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]
DEP, PORT = "rl4", 18006
HUB_PORT = 18090                  # this module's own Hub endpoint (test_fetch_model's is on 18088)
STAGES = ("--only", "ship", "--only", "fetch-model", "--only", "sync-model", "--only", "stage-engram",
          "--only", "launch", "--only", "health")
LOCAL = "unix:///var/run/docker.sock"
TAGS = {"a": "dctl-rel:a", "b": "dctl-rel:b", "c": "dctl-rel:c", "d": "dctl-rel:d"}


def _build_images() -> dict[str, str]:
    """dctl-rel:a/b/c/d from the double's image in the local engine: {name: image ID}."""
    ids = {}
    for k, tag in TAGS.items():
        env = "ENV DOUBLE_FAIL=crash-at-start\n" if k == "c" else ""
        dockerfile = f"FROM {IMAGE}\nLABEL dctl-rel-test={k}\n{env}"
        p = subprocess.run(["docker", "-H", LOCAL, "build", "-q", "-t", tag, "-"], input=dockerfile,
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        ids[k] = _docker(LOCAL, "image", "inspect", "--format", "{{.Id}}", tag).stdout.strip()
    assert len(set(ids.values())) == 4, ids
    return ids


@pytest.fixture(scope="module")
def rl4(cluster, double_image, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("rl4")
    synth = engram_synth(d)
    # engram.staging auto (the recipes' default): every node links its own checkpoint's Engram shards
    overrides = {"engine.master_port": 29641, **engram_overrides(synth), "engram.staging": "auto"}
    hub_root, hub_host = d / "hub", cluster.hosts[-1]
    commit = publish(hub_root, overrides["model.repo"], synth.ckpt)
    url = cluster.start_hub(hub_host, hub_root, port=HUB_PORT)
    inv = write_inventory(cluster, d / "inventory.yml", DEP, TP4, [h.name for h in cluster.hosts], PORT, overrides)
    doc = yaml.safe_load(inv.read_text())
    doc["all"]["vars"].update(model_fetch="hub", hf_endpoint=url)
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    dep = load_deployment(inv)
    remove_all(cluster, DEP)
    _forget_releases(cluster, dep)
    for h in dep.cluster.hosts:                   # nothing of the model on any node: fetch-model and sync-model
        shutil.rmtree(Path(h.model_cache) / f"models--{dep.recipe.model.repo.replace('/', '--')}", ignore_errors=True)
    ids = _build_images()
    for k in TAGS:
        cluster.load_image("node1", TAGS[k])          # the head only: ship sends them on
    yield {"inv": inv, "dep": dep, "ids": ids, "dir": d, "synth": synth, "hub": hub_root, "commit": commit}
    cluster.stop_hub(hub_host)
    remove_all(cluster, DEP)
    _forget_releases(cluster, dep)


def _forget_releases(cluster, dep) -> None:
    """A clean start: no history file on the head, no pins (holders, tags) of this deployment anywhere."""
    Path(rel.history_path(dep.cluster.head_host.nvme_dir, DEP)).unlink(missing_ok=True)
    for h in cluster.hosts:
        holders = _docker(h.docker_host, "ps", "-aq", "--filter", f"label=deployctl.pin={DEP}").stdout.split()
        if holders:
            _docker(h.docker_host, "rm", "-f", *holders)
        tags = _docker(h.docker_host, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}",
                       f"{rel.PIN_REPO}/{DEP}").stdout.split()
        if tags:
            _docker(h.docker_host, "rmi", *tags)


def _up(inv, image: str, *extra: str):
    return dctl("up", "-i", str(inv), *STAGES, "--set", f"engine.image={image}", *extra, timeout=400)


def _history(inv) -> dict:
    p = dctl("history", "-i", str(inv), "--json")
    assert p.returncode == 0, out(p)
    return json.loads(p.stdout)


def _running(cluster) -> dict[str, str]:
    """host -> the image ID of its one running container of the deployment."""
    found = {}
    for h in cluster.hosts:
        (cid,) = containers(cluster, h.name, DEP)
        doc = json.loads(_docker(h.docker_host, "inspect", cid).stdout)[0]
        assert doc["State"]["Running"], (h.name, doc["State"])
        found[h.name] = doc["Image"]
    return found


def _healthy(inv) -> bool:
    p = dctl("status", "-i", str(inv), "--json")
    return json.loads(p.stdout)["api"]["healthy"] is True


def _answers(cluster) -> str:
    """A real chat completion from the head's API (not only container state)."""
    req = urllib.request.Request(f"http://{cluster.hosts[0].address}:{PORT}/v1/chat/completions", method="POST",
                                 data=json.dumps({"model": "deepseek-v4.1-flash", "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": "Count from 1 to 10."}]}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return json.loads(r.read())["choices"][0]["message"]["content"]


def _mounted_snapshot(cluster) -> set[str]:
    """The snapshots/<commit> every rank's engine was started on (its model argument)."""
    found = set()
    for h in cluster.hosts:
        (cid,) = containers(cluster, h.name, DEP)
        args = json.loads(_docker(h.docker_host, "inspect", cid).stdout)[0]["Args"]
        found |= {a.rsplit("/snapshots/", 1)[1] for a in args if "/snapshots/" in a}
    return found


def _on(cluster, inv, image_id: str) -> None:
    assert set(_running(cluster).values()) == {image_id}
    assert _healthy(inv)
    assert _answers(cluster)


def test_ups_record_releases_and_a_no_op_adds_none(cluster, rl4):
    inv, ids = rl4["inv"], rl4["ids"]
    p = _up(inv, TAGS["a"])
    assert p.returncode == 0, out(p)
    assert "recorded release 1" in unwrap(out(p)), out(p)
    p = _up(inv, TAGS["a"], "--json")
    assert p.returncode == 0, out(p)
    doc = json.loads(p.stdout)
    assert doc["release"]["recorded"] is False and doc["release"]["current"] == 1, doc["release"]
    # #33: the first no-op after the cold up hashes nothing, though stage-engram hard-linked the
    # Engram shards' blobs (ctime and link count moved, not a byte) on every node
    res = {(r["stage"], r["host"]): r for s in doc["stages"] for r in s["results"]}
    head = cluster.hosts[0].name
    assert res[("fetch-model", head)]["status"] == "skipped" and "up to date" in res[("fetch-model", head)]["message"]
    for h in cluster.hosts:
        assert "shard links" in res[("stage-engram", h.name)]["message"], res[("stage-engram", h.name)]
        assert res[("sync-model", h.name)]["data"]["hashed_bytes"] == 0, res[("sync-model", h.name)]
    p = _up(inv, TAGS["b"], "--json")
    assert p.returncode == 0, out(p)
    doc = json.loads(p.stdout)
    assert doc["release"]["number"] == 2 and doc["release"]["image_id"] == ids["b"]
    _on(cluster, inv, ids["b"])
    h = _history(inv)
    assert [(r["number"], r["image_id"], r["command"]) for r in h["releases"]] == [(1, ids["a"], "up"),
                                                                                  (2, ids["b"], "up")]
    assert h["current"] == 2 and h["keep"] == 3
    r1 = h["releases"][0]
    assert "engine.image=dctl-rel:a" in r1["overrides"] and r1["recipe"] == TP4
    ck = r1["checkpoint"]                            # #38: the commit fetch-model resolved main to
    assert (ck["repo"], ck["revision"], ck["commit"]) == (rl4["dep"].recipe.model.repo, "main", rl4["commit"]), ck
    assert re.fullmatch(r"[0-9a-f]{16}", ck["manifest"]), "the manifest digest sync-model verified the workers against"
    assert _mounted_snapshot(cluster) == {rl4["commit"]}
    assert sorted(r1["specs"]) == [x.name for x in cluster.hosts] and all(r1["specs"].values())
    assert all(t.get("engram") for t in r1["tables"].values()) and len(r1["tables"]) == 4
    # the run record that made it holds the same release
    assert json.loads((Path(r1["run_dir"]) / "release.json").read_text())["image_id"] == ids["a"]
    for x in cluster.hosts:                          # pinned on every node, by image ID
        for n, k in ((1, "a"), (2, "b")):
            got = _docker(x.docker_host, "image", "inspect", "--format", "{{.Id}}", rel.pin_tag(DEP, n)).stdout.strip()
            assert got == ids[k], (x.name, n)


def test_a_crashing_image_rolls_back_to_the_last_good_release(cluster, rl4):
    """The acceptance scenario: A, B, then C that crashes at start, with --rollback-on-failure: exit 1
    naming both outcomes, the cluster ends on B, healthy; then `rollback --to 1` brings A back."""
    inv, ids = rl4["inv"], rl4["ids"]
    p = _up(inv, TAGS["c"], "--rollback-on-failure")
    text = unwrap(out(p))
    assert p.returncode == 1, out(p)
    assert "stage launch failed" in text or "stage health failed" in text, text
    assert "rolled back: release 2" in text and "passed the health check" in text, text
    _on(cluster, inv, ids["b"])                       # #38: on a Hub-fetched checkpoint, B answers again
    assert _mounted_snapshot(cluster) == {rl4["commit"]}
    h = _history(inv)
    last = h["releases"][-1]
    assert (last["number"], last["rollback_of"], last["image_id"]) == (3, 2, ids["b"])
    assert ids["c"] not in {r["image_id"] for r in h["releases"]}, "the failed image is never a release"

    p = dctl("rollback", "-i", str(inv), "--to", "1", timeout=400)
    assert p.returncode == 0, out(p)
    _on(cluster, inv, ids["a"])
    last = _history(inv)["releases"][-1]
    assert (last["number"], last["rollback_of"], last["image_id"], last["command"]) == (4, 1, ids["a"], "rollback")


def test_ci_turns_rollback_on_and_it_can_be_turned_off(cluster, rl4):
    inv, ids = rl4["inv"], rl4["ids"]
    p = _up(inv, TAGS["c"], "--ci", "--no-rollback-on-failure")
    assert p.returncode == 1, out(p)
    assert "rolled back" not in out(p)
    assert not any(containers(cluster, h.name, DEP) for h in cluster.hosts), "the failed run's containers are gone"
    assert _history(inv)["current"] == 4, "a failed run is no release"
    p = _up(inv, TAGS["c"], "--ci")
    assert p.returncode == 1, out(p)
    # nothing ran any more (the previous run removed it): the current release, 4 (A), is brought back
    assert "rolled back: release 4" in unwrap(out(p)), out(p)
    _on(cluster, inv, ids["a"])


def test_rollback_to_each_kept_release_and_not_to_a_released_one(cluster, rl4):
    inv, ids = rl4["inv"], rl4["ids"]
    p = _up(inv, TAGS["d"])
    assert p.returncode == 0, out(p)
    h = _history(inv)
    d_number = h["current"]
    kept = [r for r in h["releases"] if r["pinned"]]
    assert [r["number"] for r in kept] == [d_number - 2, d_number - 1, d_number]
    p = dctl("rollback", "-i", str(inv), "--dry-run")
    assert p.returncode == 0, out(p)
    assert f"to release {d_number - 1}" in unwrap(p.stdout) and rel.pin_tag(DEP, d_number - 1) in p.stdout
    assert _running(cluster) and set(_running(cluster).values()) == {ids["d"]}, "a dry run changes nothing"
    for r in kept:                                  # each kept release, oldest first, by number
        h = _history(inv)
        target = next(x for x in h["releases"] if x["number"] == r["number"])
        if not target["pinned"]:
            continue                                # pushed out of the window by the rollbacks before it
        p = dctl("rollback", "-i", str(inv), "--to", str(r["number"]), timeout=400)
        assert p.returncode == 0, out(p)
        _on(cluster, inv, r["image_id"])
    p = dctl("rollback", "-i", str(inv), "--to", "1", timeout=120)     # release 1 fell out of the window
    assert p.returncode == 1, out(p)
    assert "no longer kept" in unwrap(out(p)), out(p)


def test_pruning_never_removes_a_kept_image(cluster, rl4):
    """The tags everyone moves (here dctl-rel:a/b/d, like a rebuilt :latest) go elsewhere, then
    `docker image prune` and `docker image prune -a` on every node: every kept release's image is still
    there by ID. (-a is limited to this test's images by their label: the other modules of a session
    still need the double's image on the nodes.)"""
    inv = rl4["inv"]
    h = _history(inv)
    kept = {r["image_id"] for r in h["releases"] if r["pinned"]}
    other = _docker(LOCAL, "image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    for x in cluster.hosts:
        for tag in (TAGS["a"], TAGS["b"], TAGS["c"], TAGS["d"]):
            _docker(x.docker_host, "tag", other, tag)        # the tag moves to another image
        p = _docker(x.docker_host, "image", "prune", "-f")
        assert p.returncode == 0, p.stderr
        p = _docker(x.docker_host, "image", "prune", "-a", "-f", "--filter", "label=dctl-rel-test")
        assert p.returncode == 0, p.stderr
        have = set(_docker(x.docker_host, "image", "ls", "-q", "--no-trunc").stdout.split())
        assert kept <= have, (x.name, kept - have)
        holders = _docker(x.docker_host, "ps", "-a", "--filter", f"label=deployctl.pin={DEP}",
                          "--format", "{{.Names}} {{.State}}").stdout.split("\n")
        assert sorted(n.split()[0] for n in holders if n) == sorted(
            rel.holder_name(DEP, r["number"]) for r in h["releases"] if r["pinned"]), (x.name, holders)
        assert all(n.endswith(" created") for n in holders if n), "never started"
    c_id = rl4["ids"]["c"]
    assert c_id not in set(_docker(cluster.hosts[0].docker_host, "image", "ls", "-q", "--no-trunc").stdout.split()), \
        "an image no release keeps is pruned (the crashing one)"
    p = dctl("rollback", "-i", str(inv), timeout=400)         # and a kept one still comes back
    assert p.returncode == 0, out(p)
    assert _healthy(inv)


def test_rollback_after_the_branch_moved_restores_the_commit_the_release_served(cluster, rl4, tmp_path):
    """#38: main moves on the Hub (a new config.json), `up` serves the new commit as a new release; the
    rollback brings back the previous release's commit (pinned, not main resolved again), with its
    manifest, healthy; and a release whose commit is gone from the head and from the Hub is refused
    before anything runs, naming the release and the commit."""
    inv = rl4["inv"]
    moved = tmp_path / "moved"
    shutil.copytree(rl4["synth"].ckpt, moved, copy_function=os.link)
    (moved / "config.json").unlink(missing_ok=True)
    (moved / "config.json").write_text(json.dumps({"model_type": "deepseek_v4_1", "moved": True}))
    new_commit = publish(rl4["hub"], rl4["dep"].recipe.model.repo, moved)
    assert new_commit != rl4["commit"]
    before = _history(inv)
    prev = before["releases"][-1]
    p = _up(inv, TAGS["a"])             # (test_pruning moved the tag: the double's own image, a new release)
    assert p.returncode == 0, out(p)
    h = _history(inv)
    assert h["releases"][-1]["checkpoint"]["commit"] == new_commit, "the new release serves main's new commit"
    assert _mounted_snapshot(cluster) == {new_commit}
    p = dctl("rollback", "-i", str(inv), timeout=400)
    assert p.returncode == 0, out(p)
    last = _history(inv)["releases"][-1]
    assert last["rollback_of"] == prev["number"] and last["checkpoint"]["commit"] == rl4["commit"], last
    assert last["checkpoint"]["manifest"] == prev["checkpoint"]["manifest"]
    assert _mounted_snapshot(cluster) == {rl4["commit"]} and _answers(cluster)
    # a release whose commit neither the head nor the Hub has: refused, nothing touched
    hist_file = Path(rel.history_path(rl4["dep"].cluster.head_host.nvme_dir, DEP))
    doc = json.loads(hist_file.read_text())
    gone = "f" * 40
    doc["releases"][-2]["checkpoint"]["commit"] = gone      # the release before the current one
    hist_file.write_text(json.dumps(doc))
    running = _running(cluster)
    p = dctl("rollback", "-i", str(inv), timeout=120)
    text = unwrap(out(p))
    assert p.returncode == 2, out(p)
    assert f"release {doc['releases'][-2]['number']}" in text and "cannot be brought back" in text and gone[:12] in text, text
    assert _running(cluster) == running and _answers(cluster)
    doc["releases"][-2]["checkpoint"]["commit"] = new_commit
    hist_file.write_text(json.dumps(doc))


def test_history_survives_a_controller_change(cluster, rl4, tmp_path):
    """A second checkout with its own inventory copy and an empty runs/: the same history, from the head."""
    inv = rl4["inv"]
    mine = _history(inv)
    other = tmp_path / "checkout"
    p = subprocess.run(["git", "clone", "-q", str(REPO), str(other)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for sub in ("orchestrator", "recipes"):             # this checkout's working tree (maybe not committed yet)
        shutil.rmtree(other / sub)
        shutil.copytree(REPO / sub, other / sub, ignore=shutil.ignore_patterns("__pycache__"))
    inv2 = tmp_path / "ctl2" / "inventory.yml"
    inv2.parent.mkdir()
    inv2.write_text(inv.read_text().replace(str(inv.parent / "runs"), str(inv2.parent / "runs")))
    p = subprocess.run([sys.executable, "-m", "orchestrator", "history", "-i", str(inv2), "--json"],
                       capture_output=True, text=True, timeout=120, cwd=other,
                       env={**os.environ, "PYTHONPATH": str(other)})
    assert p.returncode == 0, out(p)
    assert json.loads(p.stdout)["releases"] == mine["releases"]
    assert not (inv2.parent / "runs").exists() or not any((inv2.parent / "runs").iterdir())
    p = subprocess.run([sys.executable, "-m", "orchestrator", "history", "-i", str(inv2)],
                       capture_output=True, text=True, timeout=120, cwd=other,
                       env={**os.environ, "PYTHONPATH": str(other), "COLUMNS": "200"})
    assert p.returncode == 0 and "(current)" in p.stdout, out(p)
