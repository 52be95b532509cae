"""TP=8 on eight hosts: the mission's two 8-node recipes end to end on one shared 8-host cluster
(tests/cluster/demo.py `prepare`, the scaled overrides of tests/cluster/cluster.py), the engine
double in every container.

  nvme    `up` from a fresh cluster: each rank staged with its 3 of the 24 sub-tables of every
          Engram layer, the double reading exactly those rows from /engram; a no-op `up` over one
          SSH connection per host; `status`; `down`.
  lost    a worker cut off while the engines load: named with its stage, the seven others cleaned
          up; `down` once it is back.
  memory  the -mem recipe: no staging at all, the engine told nothing about node-local rows
          (Engram kept in memory); `status`; `down`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.hostside.geometry import layer_tables, rank_ranges
from orchestrator.launch.probe import expected_engram

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]
NVME, MEM = "deepseek-v41-flash-tp8-nvme", "deepseek-v41-flash-tp8-mem"
LOST = "node6"


def dctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "COLUMNS": "200"})


def out(p: subprocess.CompletedProcess) -> str:
    return (p.stdout[-3000:] + "\n" + p.stderr[-3000:]).strip()


def results(p: subprocess.CompletedProcess) -> dict[str, dict]:
    doc = json.loads(p.stdout)
    return {f"{s['name']}:{r['host']}": r for s in doc.get("stages", []) for r in s["results"]}


def docker(c, host: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", c.host(host).docker_host, *args], capture_output=True, text=True,
                          timeout=120)


def containers(c, host: str) -> list[str]:
    r = docker(c, host, "ps", "-aq", "--filter", f"label=deployctl.deployment={c.deployment}")
    assert r.returncode == 0, (host, r.stderr)
    return r.stdout.split()


def leftovers(c, hosts=None) -> dict[str, list[str]]:
    names = hosts or [h.name for h in c.hosts]
    return {h: ids for h in names if (ids := containers(c, h))}


@pytest.fixture(scope="module")
def tp8():
    from tests.cluster.demo import prepare
    c = prepare("tp8", 8, log=print)          # 8 hosts, the scaled TP=8 checkpoint on the fake Hub
    try:
        yield c
    finally:
        c.down()


def test_nvme_every_rank_staged_with_its_rows_then_noop_status_down(tp8):
    inv = str(tp8.inventory_path)
    dep = load_deployment(inv)
    assert (dep.recipe.name, len(dep.cluster.hosts), dep.recipe.parallelism.tensor_parallel) == (NVME, 8, 8)
    assert dctl("down", "-i", inv).returncode == 0      # from scratch even on a kept cluster
    for h in dep.cluster.hosts:
        shutil.rmtree(dep.engram_dir(h), ignore_errors=True)
    t0 = time.monotonic()
    p = dctl("up", "-i", inv, "--json", timeout=900)
    cold = time.monotonic() - t0
    assert p.returncode == 0, out(p)
    res = results(p)
    assert all(res[f"{stage}:{h.name}"]["status"] == "ok" for h in tp8.hosts
               for stage in ("stage-engram", "launch")), res

    g = dep.recipe.engram.geometry
    for h in dep.cluster.hosts:
        per_layer = rank_ranges(g, 8, h.rank)
        assert [(len(t.subtables), r.head_end - r.head_start) for t, r in zip(layer_tables(g), per_layer)] == \
            [(24, 3)] * len(per_layer), "3 of 24 sub-tables per layer on every rank"
        local = json.loads(Path(dep.engram_dir(h), "engram-local.json").read_text())
        want = expected_engram(dep, h.rank)
        assert local["layers"] == want, (h.name, local, want)
        (cid,) = containers(tp8, h.name)
        env = json.loads(docker(tp8, h.name, "inspect", cid).stdout)[0]["Config"]["Env"]
        assert "DSV41_ENGRAM_DIR=/engram" in env and "DSV41_ENGRAM_DISK=1" in env, env
        logs = docker(tp8, h.name, "logs", cid)
        text = logs.stdout + logs.stderr
        for layer, (lo, hi) in want.items():   # the double read its own rank's rows, from /engram
            assert f"Engram rows from local dir /engram: layer {layer} rows [{lo}, {hi})" in text, (h.name, text[-2000:])
        assert f"rank{h.rank}]" in text
    layer = next(iter(expected_engram(dep, 0)))
    assert len({tuple(expected_engram(dep, r)[layer]) for r in range(8)}) == 8, "eight different row ranges"

    t0 = time.monotonic()
    p = dctl("up", "-i", inv, "--json")
    noop = time.monotonic() - t0
    assert p.returncode == 0, out(p)
    doc, res = json.loads(p.stdout), results(p)
    assert {k: r["status"] for k, r in res.items() if k.startswith(("build", "ship", "sync-model", "stage-engram",
                                                                      "launch"))} == \
        {k: "skipped" for k in res if k.startswith(("build", "ship", "sync-model", "stage-engram", "launch"))}
    assert doc["ssh_connections"] == 8, "one SSH connection per host for the whole run"
    print(f"\nTP=8 nvme: cold up {cold:.1f} s, no-op up {noop:.1f} s")

    p = dctl("status", "-i", inv, "--json")
    assert p.returncode == 0, out(p)
    rows = {r["host"]: r for r in json.loads(p.stdout)["hosts"]}
    assert sorted(rows) == sorted(h.name for h in tp8.hosts)
    assert all(r["reachable"] for r in rows.values()), rows

    p = dctl("down", "-i", inv)
    assert p.returncode == 0, out(p)
    assert leftovers(tp8) == {}


def test_a_worker_lost_while_loading_is_named_and_the_others_cleaned_up(tp8, tmp_path):
    inv = str(tp8.inventory_path)
    log = tmp_path / "lost.log"
    args = [sys.executable, "-m", "orchestrator", "up", "-i", inv, "--only", "launch", "--only", "health",
            "--set", "engine.env.DOUBLE_LOAD_S=60"]
    try:
        with open(log, "w") as fh:
            proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "COLUMNS": "200"})
        try:
            deadline = time.monotonic() + 180
            while "waiting for the API" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert len(leftovers(tp8)) == 8
            tp8.link_down(LOST)
            rc = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log.read_text()
        assert rc == 1, text
        assert re.findall(r"^(\S+): stage (\S+) failed", text, re.M) == [(LOST, "health")], text
        assert f"{LOST}: stage health failed: unreachable" in text
        assert leftovers(tp8, [h.name for h in tp8.hosts if h.name != LOST]) == {}, \
            "the seven reachable hosts are cleaned up"
    finally:
        tp8.link_up(LOST)
    assert containers(tp8, LOST), "the lost host's container stayed (it could not be reached)"
    p = dctl("down", "-i", inv)
    assert p.returncode == 0, out(p)
    assert leftovers(tp8) == {}


def test_memory_recipe_stages_nothing_and_keeps_engram_in_memory(tp8):
    inv = str(tp8.inventory_path)
    p = dctl("up", "-i", inv, "--recipe", MEM, "--json", timeout=600)
    assert p.returncode == 0, out(p)
    doc = json.loads(p.stdout)
    stages = {s["name"]: s for s in doc["stages"]}
    assert not stages.get("stage-engram", {}).get("results"), stages.get("stage-engram")
    for h in tp8.hosts:
        (cid,) = containers(tp8, h.name)
        env = json.loads(docker(tp8, h.name, "inspect", cid).stdout)[0]["Config"]["Env"]
        assert not [e for e in env if e.startswith(("DSV41_ENGRAM_DIR=", "DSV41_ENGRAM_DISK="))], (h.name, env)
    p = dctl("status", "-i", inv, "--recipe", MEM)
    assert p.returncode == 0, out(p)
    p = dctl("down", "-i", inv, "--recipe", MEM)
    assert p.returncode == 0, out(p)
    assert leftovers(tp8) == {}
