"""Build, ship, launch, status, logs and down on the Docker engines users run, and across them.

The rest of the suite runs on Docker 26 with the graph-driver store (tests/cluster/engines.py
DEFAULT). Here the same pipeline runs on Debian's Docker 20.10, on Docker 26 with the containerd
image store, and on mixed clusters, one 4-host cluster at a time:

  20.10           every host on 20.10 (legacy `docker save` layout, IDs = config digests)
  26-containerd   every host on the containerd store (IDs = manifest digests, compressed layers)
  mixed-cd-head   head on the containerd store; workers on 20.10, 26 and the containerd store
  mixed-old-head  head on 20.10; workers on the containerd store (no delta possible: whole image),
                  26 and the containerd store

Per cluster: the ship byte figures (fresh, re-ship, a patch-only change) checked on each worker's
own engine. On the two single-engine clusters also `deployctl up` of the scaled TP=4 recipe from a
fresh cluster (build with its step cache, ship, fetch, sync, staging, launch of the engine double,
health), a no-op `up`, `build --ci --prune`, `status`, `logs`, `down` (the mixed clusters are about
ship; the whole pipeline on Docker 26's graph-driver store is the rest of the suite).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import BUSYBOX_IMAGE, TestCluster, ensure_base_images

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]
SMALL = "dctl-ship-small:1"
CONFIGS = {
    "20.10": "20.10",
    "26-containerd": "26-containerd",
    "mixed-cd-head": "26-containerd,20.10,26,26-containerd",
    "mixed-old-head": "20.10,26-containerd,26,26-containerd",
}
FIGURES: list[str] = []          # printed at the end of the module: the byte figures per engine


def dctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "COLUMNS": "200"})


def docker(c: TestCluster, host: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", c.host(host).docker_host, *args], capture_output=True, text=True,
                          timeout=timeout)


def inspect(c: TestCluster, host: str, ref: str) -> dict | None:
    r = docker(c, host, "image", "inspect", ref)
    return json.loads(r.stdout)[0] if r.returncode == 0 else None


def config_digest(c: TestCluster, host: str, ref: str) -> str:
    """The image's config digest, read out of `docker save` (the identity every store keeps)."""
    import io
    import tarfile
    r = subprocess.run(["docker", "-H", c.host(host).docker_host, "save", ref], capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tf:
        manifest = json.load(tf.extractfile("manifest.json"))
    path = manifest[0]["Config"]                 # "<hex>.json" (legacy) or "blobs/sha256/<hex>" (OCI)
    return "sha256:" + path.rsplit("/", 1)[-1].removesuffix(".json")


def results(p: subprocess.CompletedProcess) -> dict[str, dict]:
    doc = json.loads(p.stdout)
    return {f"{s['name']}:{r['host']}": r for s in doc.get("stages", []) for r in s["results"]}


@pytest.fixture(scope="module")
def engines(request):
    """A 4-host cluster on one engine configuration, ready for `deployctl up` (tests/cluster/demo.py)."""
    from tests.cluster.demo import prepare
    key = request.param
    name = f"eng-{key.replace('.', '')}"[:24]
    c = prepare(name, 4, log=print, engine=CONFIGS[key])      # takes the cluster's lock while it makes it
    try:
        yield key, c
    finally:
        c.down()


@pytest.mark.parametrize("engines", list(CONFIGS), indirect=True)
def test_ship_bytes_on_every_engine(engines, tmp_path):
    key, c = engines
    ensure_base_images(debian=False)
    c.load_image("node1", BUSYBOX_IMAGE)
    workers = [h.name for h in c.hosts[1:]]

    def build(patch: bytes) -> dict:
        (tmp_path / "Dockerfile").write_text("FROM dctl-busybox:latest\nRUN head -c 3000000 /dev/urandom > /a\n"
                                             "RUN head -c 1000000 /dev/urandom > /b\nCOPY patch.bin /patch.bin\n")
        (tmp_path / "patch.bin").write_bytes(patch)
        r = docker(c, "node1", "build", "-q", "-t", SMALL, str(tmp_path), timeout=300)
        assert r.returncode == 0, r.stderr
        return inspect(c, "node1", SMALL)

    def ship() -> dict[str, dict]:
        # direct: each worker gets exactly the layers it lacks (a chain sends the union of them; its
        # ship on these engines runs in test_up_noop_status_logs_down_on_every_engine)
        p = dctl("ship", "-i", str(c.inventory_with(distribution="direct")), "--image", SMALL, "--json")
        assert p.returncode == 0, p.stderr
        return {k.split(":", 1)[1]: r for k, r in results(p).items()}

    def same_image_everywhere(head: dict) -> None:
        cfg = config_digest(c, "node1", SMALL)
        for w in workers:
            got = inspect(c, w, SMALL)
            assert got and got["RootFS"]["Layers"] == head["RootFS"]["Layers"], w
            assert config_digest(c, w, SMALL) == cfg, w          # the same image, whatever the store

    head = build(b"p" * 10_000)
    fresh = ship()
    same_image_everywhere(head)
    full = {w: fresh[w]["data"]["bytes_sent"] for w in workers}
    assert all(3_000_000 < n < 8_000_000 for n in full.values()), full
    again = ship()
    assert {w: (r["status"], r["data"]["bytes_sent"]) for w, r in again.items()} == {w: ("skipped", 0) for w in workers}

    head = build(os.urandom(10_000))
    patched = ship()
    same_image_everywhere(head)
    engine_of = {h.name: c.engine_of(h).name for h in c.hosts}
    for w in workers:
        d = patched[w]["data"]
        whole = engine_of["node1"] == "20.10" and engine_of[w] == "26-containerd"
        if whole:        # a legacy archive cannot go to a containerd store with layers left out
            assert d["layers_sent"] == 4 and "legacy archive" in d["whole_image_reason"], d
            assert "whole image" in patched[w]["message"]
        else:
            assert d["layers_sent"] == 1 and d["bytes_sent"] <= 0.05 * full[w], (w, d, full[w])
        FIGURES.append(f"{key:<15} {engine_of['node1']:>13} -> {w} {engine_of[w]:<13}  fresh {full[w]:>9,} B  "
                       f"re-ship 0 B  patch {d['bytes_sent']:>9,} B ({d['bytes_sent'] / full[w]:.2%})"
                       + ("  whole image" if whole else ""))
    print("\n" + "\n".join(f for f in FIGURES if f.startswith(key)))
    for h in c.hosts:
        api_answers_as_the_cli(h.docker_host, SMALL)
    if key.startswith("mixed"):
        one_image_under_several_ids(c, tmp_path)


def api_answers_as_the_cli(engine: str, image: str) -> None:
    """hostside/host_read.py's CLI forms (preflight, ship, releases ask them through the Engine API)
    print what the docker CLI prints for them, on this engine (20.10, 26, 26 with the containerd store)."""
    from orchestrator.hostside import host_read as hr
    from orchestrator.ship.stores import INFO_FORMAT

    def both(*args: str) -> tuple[tuple[int, str], tuple[int, str]]:
        argv = ["docker", "-H", engine, *args]
        assert hr.cli_form(hr.EngineAPI(engine, 30), list(args)) is not None, args   # a known form
        rc, out, _ = hr.answer(argv, 30)
        cli = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return (rc, out), (cli.returncode, cli.stdout)

    label = f"deployctl.test-forms={os.getpid()}"
    name = f"dctl-forms-{os.getpid()}"
    r = subprocess.run(["docker", "-H", engine, "create", "--name", name, "--label", label, image, "true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    try:
        for args in (("info", "--format", INFO_FORMAT),
                     ("image", "inspect", "--format", "{{.Id}}", image),
                     ("image", "inspect", "--format", "{{.Id}} {{json .RepoTags}} {{json .RootFS.Layers}}", image),
                     ("image", "inspect", "--format", "{{.Id}} {{json .RootFS.Layers}}", image),
                     ("container", "inspect", "--format", "{{.Image}}", name),
                     ("ps", "-aq", "--no-trunc", "--filter", f"label={label}"),
                     ("ps", "-aq", "--filter", f"label={label}"),
                     ("ps", "-q", "--filter", f"label={label}")):          # not running: none
            api, cli = both(*args)
            assert api == cli, (engine, args, api, cli)
        api, cli = both("image", "ls", "-aq", "--no-trunc")              # the CLI repeats an ID per tag
        assert api[0] == cli[0] == 0 and sorted(set(api[1].split())) == sorted(set(cli[1].split())), (engine, api, cli)
        api, cli = both("info", "--format", "{{json .}}")                 # the CLI adds its client's fields
        a, b = json.loads(api[1]), json.loads(cli[1])
        for k in ("ServerVersion", "Driver", "DriverStatus", "Runtimes", "Architecture"):
            assert a[k] == b[k], (engine, k)
        api, cli = both("image", "inspect", "--format", "{{json .}}", image)   # ship's inspect_head reads these
        a, b = json.loads(api[1]), json.loads(cli[1])
        assert api[0] == cli[0] == 0 and all(a[k] == b[k] for k in ("Id", "RootFS", "Size", "Architecture")), engine
        for args in (("image", "inspect", "--format", "{{.Id}}", "dctl-no-such:image"),
                     ("container", "inspect", "--format", "{{.Image}}", "dctl-no-such-container")):
            api, cli = both(*args)
            assert api[0] == cli[0] == 1 and api[1] == cli[1], (engine, args, api, cli)
        tag = f"dctl-forms-tag:{os.getpid()}"
        assert both("tag", image, tag)[0][0] == 0                        # (tagged twice: idempotent)
        assert inspect_id(engine, tag) == inspect_id(engine, image)
        subprocess.run(["docker", "-H", engine, "rmi", tag], capture_output=True, timeout=60)
        api, cli = both("tag", "dctl-no-such:image", tag)
        assert api[0] == cli[0] == 1, (engine, api, cli)
    finally:
        subprocess.run(["docker", "-H", engine, "rm", "-f", name], capture_output=True, timeout=60)


def inspect_id(engine: str, ref: str) -> str:
    return subprocess.run(["docker", "-H", engine, "image", "inspect", "--format", "{{.Id}}", ref],
                          capture_output=True, text=True, timeout=60).stdout.strip()


def one_image_under_several_ids(c: TestCluster, tmp_path: Path) -> None:
    """What releases rely on in a cluster mixing image stores: the hosts' IDs of the shipped image
    differ, and release_store.same_image tells one image (same config) from two."""
    from orchestrator.deployment import load_deployment
    from orchestrator.executors.shells import Shells
    from orchestrator.launch.release_store import same_image
    dep = load_deployment(c.inventory_path)
    ids = {h.name: inspect(c, h.name, SMALL)["Id"] for h in c.hosts}
    assert len(set(ids.values())) > 1, ids
    with Shells(dep.cluster) as shells:
        assert same_image(dep, shells, ids, str(tmp_path))
        for h in c.hosts[1:]:        # another image on one host, whatever its store: not the same image
            others = [i for i in docker(c, h.name, "image", "ls", "-aq", "--no-trunc").stdout.split()
                      if i != ids[h.name]]
            assert others, h.name
            assert not same_image(dep, shells, {**ids, h.name: others[0]}, str(tmp_path)), h.name


@pytest.mark.parametrize("engines", ["20.10", "26-containerd"], indirect=True)
def test_up_noop_status_logs_down_on_every_engine(engines):
    key, c = engines
    inv = str(c.inventory_path)
    t0 = time.monotonic()
    p = dctl("up", "-i", inv, "--json", timeout=900)
    cold = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(p)
    build = res["build:node1"]["data"]["report"]
    assert all(s["status"] in ("built", "reused") for s in build["steps"]), build
    assert all(res[f"ship:{h.name}"]["status"] in ("ok", "skipped") for h in c.hosts[1:])
    assert all(res[f"launch:{h.name}"]["status"] == "ok" for h in c.hosts)
    for h in c.hosts:                                   # the engine double runs from the shipped image
        r = docker(c, h.name, "ps", "--filter", "label=deployctl.deployment=" + c.deployment,
                   "--format", "{{.Image}} {{.State}}")
        assert r.stdout.split() == ["dctl-engine:test", "running"], (h.name, r.stdout, r.stderr)

    t0 = time.monotonic()
    p = dctl("up", "-i", inv, "--json")
    noop = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    res = results(p)
    assert [s["status"] for s in res["build:node1"]["data"]["report"]["steps"]] == \
        ["reused"] * len(build["steps"])                 # the step cache holds on this store
    assert all(res[f"ship:{h.name}"]["status"] == "skipped" for h in c.hosts[1:])
    print(f"\n{key}: cold up {cold:.1f} s, no-op up {noop:.1f} s")

    p = dctl("build", "-i", inv, "--ci", "--prune", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    (r,) = json.loads(p.stdout)["stages"][0]["results"]
    assert r["status"] == "skipped" and all(s["status"] == "reused" for s in r["data"]["report"]["steps"])
    assert inspect(c, "node1", "dctl-engine:test") is not None

    p = dctl("status", "-i", inv)
    assert p.returncode == 0, p.stdout + p.stderr
    for h in c.hosts:
        assert h.name in p.stdout
    p = dctl("logs", "-i", inv, "--tail", "50")
    assert p.returncode == 0, p.stderr
    assert all(f"==> {h.name} (" in p.stdout for h in c.hosts) and "head reports the engine is ready" in p.stdout
    p = dctl("down", "-i", inv)
    assert p.returncode == 0, p.stderr
    for h in c.hosts:
        r = docker(c, h.name, "ps", "-aq", "--filter", "label=deployctl.deployment=" + c.deployment)
        assert r.returncode == 0 and r.stdout.split() == [], (h.name, r.stdout)


def test_engine_per_host_from_the_command_line():
    from tests.cluster import engines as e
    assert e.per_host("26-containerd,20.10", 4) == ["26-containerd", "20.10", "20.10", "20.10"]
    assert e.per_host("20.10", 2) == ["20.10", "20.10"]
    assert e.per_host(None, 1) == [e.default_name()]
    with pytest.raises(e.EngineError, match="unknown engine '27'"):
        e.per_host("26,27", 3)
    cd = e.get("26-containerd")
    assert '"containerd-snapshotter": true' in cd.daemon_json() and e.get("26").daemon_json() == "{}\n"
    assert cd.path_env().startswith(str(e.CACHE / "docker-26" / "bin") + ":")
    assert e.get("20.10").path_env().startswith("/usr/local/sbin:")
