"""#14 replayed on the test cluster: a corrupted staged table is never served (restaged, or launch
refuses it), a replaced table restarts its engine, a value Docker refuses never takes a healthy
deployment down (prepare before destroy), and commands that change hosts take the deployment lock.
The validation, message and masking cases that need no cluster: tests/test_hardening_validation.py,
tests/test_hardening_secrets.py; the host-side proof itself: tests/test_table_proof.py."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.hostside.engram_spec import MANIFEST_NAME
from orchestrator.launch.lock import HeadLock
from tests.test_launch import (QWEN, QWEN_SMALL, TP4, _docker, containers, dctl, double_image,  # noqa: F401
                               engram_synth, out, remove_all, engram_overrides, stage_for_real, unwrap,
                               write_inventory)

DEP, PORT = "hk4", 18004
STAGES = ("--only", "stage-engram", "--only", "launch", "--only", "health")


@pytest.fixture(scope="module")
def hk4(cluster, double_image, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("hk4")
    synth = engram_synth(d)
    inv = write_inventory(cluster, d / "inventory.yml", DEP, TP4, [h.name for h in cluster.hosts], PORT,
                          {"engine.master_port": 29631, **engram_overrides(synth)})
    stage_for_real(inv, synth)
    remove_all(cluster, DEP)
    p = dctl("up", "-i", str(inv), *STAGES, timeout=300)
    assert p.returncode == 0, out(p)
    yield {"inv": inv, "dep": load_deployment(inv)}
    remove_all(cluster, DEP)


def _ids(cluster) -> dict[str, list[str]]:
    return {h.name: containers(cluster, h.name, DEP) for h in cluster.hosts}


def _flip(dep, host: str, keep_mtime: bool) -> tuple[Path, int, bytes]:
    """Flip one byte in the middle of HOST's largest staged row range; returns (file, offset, the
    checkpoint's byte there: a sparse copy keeps every row at its checkpoint offset)."""
    h = dep.cluster.host(host)
    folder = Path(dep.engram_dir(h))
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    fe, piece = max(((f, p) for f in manifest["files"] for p in f["pieces"]), key=lambda fp: fp[1]["length"])
    at = piece["offset"] + piece["length"] // 2
    path = folder / fe["name"]
    want = (Path(dep.checkpoint_dir(h)) / fe["name"]).read_bytes()[at:at + 1]
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([want[0] ^ 0x5A]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return path, at, want


def _byte(path: Path, at: int) -> bytes:
    return path.read_bytes()[at:at + 1]


def _stage_results(p) -> dict[str, dict]:
    doc = json.loads(p.stdout)
    return {r["host"]: r for st in doc["stages"] for r in st["results"] if st["name"] == "stage-engram"}


def test_a_flipped_staged_byte_is_restaged_before_it_is_served(cluster, hk4):
    """down && up after one byte of node2's staged rows changed (mtime kept): the run finds it,
    restages node2 only, and the engine starts on the right bytes."""
    inv, dep = hk4["inv"], hk4["dep"]
    path, at, want = _flip(dep, "node2", keep_mtime=True)
    assert _byte(path, at) != want
    assert dctl("down", "-i", str(inv)).returncode == 0
    p = dctl("up", "-i", str(inv), *STAGES, "--json", timeout=300)
    assert p.returncode == 0, out(p)
    res = _stage_results(p)
    assert res["node2"]["status"] == "ok" and "corrupt staged data" in res["node2"]["message"], res["node2"]
    assert path.name in res["node2"]["message"]
    assert {n: r["status"] for n, r in res.items() if n != "node2"} == {"node1": "skipped", "node3": "skipped",
                                                                        "node4": "skipped"}
    assert all("proven: " in r["message"] for n, r in res.items() if n != "node2")
    assert _byte(path, at) == want, "restaged: the checkpoint's byte is back"


def test_a_replaced_table_restarts_the_engine_that_maps_it(cluster, hk4):
    inv, dep = hk4["inv"], hk4["dep"]
    p = dctl("up", "-i", str(inv), *STAGES, timeout=300)
    assert p.returncode == 0, out(p)
    before = _ids(cluster)
    path, at, want = _flip(dep, "node3", keep_mtime=False)
    p = dctl("up", "-i", str(inv), *STAGES, timeout=300)
    assert p.returncode == 0, out(p)
    assert "the staged tables changed since it started" in unwrap(out(p)), out(p)
    after = _ids(cluster)
    assert all(len(after[n]) == 1 and after[n] != before[n] for n in after), (before, after)
    assert _byte(path, at) == want


def test_launch_alone_refuses_corrupt_tables_and_keeps_what_runs(cluster, hk4):
    """`deployctl launch` (no staging stage in the run) proves the tables itself: node4's corrupt
    rows refuse the launch before any container is touched, and name the repair."""
    inv, dep = hk4["inv"], hk4["dep"]
    p = dctl("up", "-i", str(inv), *STAGES, timeout=300)
    assert p.returncode == 0, out(p)
    before = _ids(cluster)
    path, at, want = _flip(dep, "node4", keep_mtime=True)
    p = dctl("launch", "-i", str(inv), timeout=300)
    text = unwrap(out(p))
    assert p.returncode == 1, out(p)
    assert re.search(r"node4: stage launch failed", p.stderr), p.stderr
    assert "the stage-engram tables are not current: corrupt staged data" in text and path.name in text
    assert f"deployctl stage -i {inv}" in text
    assert _ids(cluster) == before, "nothing was touched"
    p = dctl("up", "-i", str(inv), *STAGES, timeout=300)       # the repair: restage, then relaunch
    assert p.returncode == 0, out(p)
    assert _byte(path, at) == want


def test_a_value_docker_refuses_leaves_the_deployment_running(cluster, hk4):
    """Prepare before destroy: a memory limit under Docker's minimum passes deployctl's checks (a
    valid size) but `docker create` refuses it; the running containers stay, none is left half-made."""
    inv = hk4["inv"]
    p = dctl("up", "-i", str(inv), *STAGES, timeout=300)
    assert p.returncode == 0, out(p)
    before = _ids(cluster)
    p = dctl("up", "-i", str(inv), "--only", "launch", "--set", "engine.memory_limit=1m", timeout=300)
    assert p.returncode == 1, out(p)
    text = unwrap(out(p))
    assert "docker create" in text and "Minimum memory limit" in text, text
    assert "the running containers are kept" in text
    assert _ids(cluster) == before
    for h in cluster.hosts:
        names = _docker(h.docker_host, "ps", "-a", "--format", "{{.Names}}").stdout.split()
        assert not [n for n in names if n.endswith("-next")], (h.name, names)
        (cid,) = before[h.name]
        assert _docker(h.docker_host, "inspect", "-f", "{{.State.Running}}", cid).stdout.strip() == "true"
    p = dctl("status", "-i", str(inv), "--json")
    assert json.loads(p.stdout)["api"]["healthy"] is True


def test_secret_values_never_reach_what_deployctl_writes(cluster, hk4):
    """A secret-named env value with spaces, set on the command line, reaches the engine whole and
    appears nowhere deployctl writes: console, run record (plan, events, logs, status), status."""
    inv = hk4["inv"]
    secret = "s3cr3t value with spaces"
    p = dctl("up", "-i", str(inv), "--only", "launch", "--only", "health",
             "--set", f"engine.env.MY_SECRET={secret}", timeout=300)
    assert p.returncode == 0, out(p)
    seen = [out(p)]
    run_dir = Path(re.search(r"run record (\S+)", unwrap(out(p))).group(1))
    seen += [f.read_text(errors="replace") for f in run_dir.rglob("*") if f.is_file()]
    st = dctl("status", "-i", str(inv), "--json", "--set", f"engine.env.MY_SECRET={secret}")
    seen.append(out(st))
    leaked = [t[:200] for t in seen if secret in t or "s3cr3t" in t]
    assert not leaked, leaked
    h = cluster.hosts[0]
    (cid,) = containers(cluster, h.name, DEP)
    doc = json.loads(_docker(h.docker_host, "inspect", cid).stdout)[0]
    assert f"MY_SECRET={secret}" in doc["Config"]["Env"], "the engine gets the whole value"
    p = dctl("up", "-i", str(inv), *STAGES, timeout=300)          # back to the fixture's spec
    assert p.returncode == 0, out(p)


def test_a_bad_value_is_refused_before_anything_is_touched(cluster, hk4):
    inv = hk4["inv"]
    before = _ids(cluster)
    p = dctl("up", "-i", str(inv), "--only", "launch", "--set", "engine.shm_size=abc", timeout=120)
    assert p.returncode == 2, out(p)
    assert "engine.shm_size" in out(p) and "--set" in out(p)
    assert _ids(cluster) == before


@pytest.mark.parametrize("command", [("stage",), ("ship",), ("sync-model",), ("launch",), ("down",)])
def test_commands_that_change_hosts_take_the_lock(cluster, hk4, command):
    inv, dep = hk4["inv"], hk4["dep"]
    with HeadLock(dep, "test holds it"):
        p = dctl(*command, "-i", str(inv), timeout=120)
        assert p.returncode == 1, out(p)
        assert "test holds it" in out(p) and "lock" in out(p), out(p)
        p = dctl("status", "-i", str(inv), "--json")          # read-only: no lock
        assert p.returncode == 0, out(p)


def test_a_flipped_ple_byte_with_its_mtime_kept_is_rewritten(cluster, double_image, tmp_path):
    """Qwen on one host: after a healthy up, one byte of the PLE table changes with its mtime put back;
    down && up rewrites the table (the engine maps the right bytes)."""
    from tests import synth
    inv = write_inventory(cluster, tmp_path / "inventory.yml", "hq1", QWEN, ["node1"], 18005, QWEN_SMALL)
    dep = load_deployment(inv)
    h = dep.cluster.host("node1")
    synth.write_checkpoint(Path(dep.checkpoint_dir(h)), [t for t in synth.recipe_tensors(dep.recipe)
                                                         if ".ple." in t.name], files=2,
                           config=synth.recipe_config(dep.recipe))
    only = ("--only", "write-ple", "--only", "launch", "--only", "health")
    try:
        p = dctl("up", "-i", str(inv), *only, timeout=240)
        assert p.returncode == 0, out(p)
        (table,) = Path(dep.ple_dir(h)).glob("ple_table_*.bin")
        good = table.read_bytes()
        st = table.stat()
        at = len(good) // 2
        with open(table, "r+b") as fh:
            fh.seek(at)
            fh.write(bytes([good[at] ^ 0x33]))
        os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert dctl("down", "-i", str(inv)).returncode == 0
        p = dctl("up", "-i", str(inv), *only, timeout=240)
        assert p.returncode == 0, out(p)
        assert "corrupt table" in unwrap(out(p)), out(p)
        assert table.read_bytes() == good
    finally:
        dctl("down", "-i", str(inv))
