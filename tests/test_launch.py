"""launch + health end to end on the 4-host test cluster, with the engine double as vLLM / SGLang.

Each host's Docker engine gets the double's image (dctl-engine-double:test); the inventories are the
cluster fixture's, with recipe_overrides pointing the recipes at the double, expect_gpus false, a
tiny checkpoint folder and the staged data the engines check (Engram rows per rank, one PLE file).
`deployctl` runs as a subprocess, like an operator runs it. Every wait is bounded.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.fabric.detect import head_address
from orchestrator.launch.containerspec import engine_argv
from orchestrator.hostside.geometry import rank_ranges
from tests.cluster import ensure_base_images
from tests.double_image import build as double_image_build

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]
IMAGE = "dctl-engine-double:test"
TP4, TP4_DEP, TP4_PORT = "deepseek-v41-flash-tp4", "lt4", 18000
QWEN, QWEN_DEP, QWEN_PORT = "qwen38-flash-next-spark", "lt1", 18001
RECORD = "/tmp/dctl-record"          # inside the containers: the double's argv records
TOKEN = "hf_launchtestsecret0123456789"

# Fast settings for the double and the health loop (the real recipes wait up to 90 minutes).
FAST = {
    "engine.image": IMAGE,
    "engine.env.DOUBLE_LOAD_S": "1",
    "engine.env.DOUBLE_TTFT_MS": "20",
    "engine.env.DOUBLE_JOIN_TIMEOUT_S": "60",
    "engine.env.DOUBLE_RECORD_DIR": RECORD,
    "health.startup_timeout_s": 60,
    "health.poll_interval_s": 0.5,
    "health.request_timeout_s": 10,
    "health.stay_up_s": 2,
    "engine.min_mem_available_gib": 1,       # boot 10's 100 GiB gate: the test machine has far less
}


# ------------------------------------------------------------------------------------------ helpers

def _docker(engine: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", engine, *args], capture_output=True, text=True, timeout=timeout)


def _image_id(engine: str) -> str:
    return _docker(engine, "image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()


@pytest.fixture(scope="session")
def double_image(cluster) -> str:
    """The engine double's image in every test host's engine (built locally first if needed)."""
    ensure_base_images()
    local = "unix:///var/run/docker.sock"
    double_image_build(IMAGE)
    want = _image_id(local)
    errors: list[str] = []

    def load(h) -> None:
        if _image_id(h.docker_host) != want:
            try:
                cluster.load_image(h, IMAGE)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(f"{h.name}: {e}")
    threads = [threading.Thread(target=load, args=(h,)) for h in cluster.hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return want


def write_inventory(cluster, path: Path, deployment: str, recipe: str, hosts: list[str], port: int,
                    overrides: dict) -> Path:
    data = yaml.safe_load(cluster.inventory_path.read_text())
    v = data["all"]["vars"]
    v.update(deployment=deployment, recipe=recipe, api_port=port, expect_gpus=False,
             run_dir=str(path.parent / "runs"), recipe_overrides={**FAST, **overrides})
    data["all"]["hosts"] = {n: data["all"]["hosts"][n] for n in hosts}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def dctl(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=e)


def containers(cluster, host: str, deployment: str) -> list[str]:
    p = _docker(cluster.host(host).docker_host, "ps", "-aq", "--filter", f"label=deployctl.deployment={deployment}")
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def leftovers(cluster, deployment: str, hosts=None) -> dict[str, list[str]]:
    names = hosts or [h.name for h in cluster.hosts]
    return {n: c for n in names if (c := containers(cluster, n, deployment))}


def agents(cluster, host: str, deployment: str) -> list[str]:
    """The deployment's supervisor containers on HOST (orchestrator/launch/supervision.py)."""
    p = _docker(cluster.host(host).docker_host, "ps", "-aq", "--filter", f"label=deployctl.supervisor={deployment}")
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def remove_all(cluster, deployment: str) -> None:
    """The deployment's supervisors first (they would restart what is removed), then its engines, then
    its firewall chain on every host (a chain left behind keeps guarding its ports: the supervisor's
    8790 on node1 stayed closed to the next deployment's Prometheus, whose own chain admitted it)."""
    from orchestrator.launch import firewall
    for h in cluster.hosts:
        ids = agents(cluster, h.name, deployment)
        if ids:
            _docker(h.docker_host, "rm", "-f", *ids)
    for h in cluster.hosts:
        ids = containers(cluster, h.name, deployment)
        if ids:
            _docker(h.docker_host, "rm", "-f", *ids)
    for h in cluster.hosts:
        p = subprocess.run(["ip", "netns", "exec", h.netns, "sh", "-c", firewall.REMOVE_SH, "sh",
                            firewall.chain_name(deployment), firewall.jump_comment(deployment)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, (h.name, p.stdout, p.stderr)


def out(p: subprocess.CompletedProcess) -> str:
    return p.stdout + p.stderr


def unwrap(text: str) -> str:
    """Console output with line wrapping undone (words split across lines joined again)."""
    return re.sub(r"\s+", " ", text)


@pytest.fixture(scope="module")
def tp4(cluster, double_image, tmp_path_factory) -> Path:
    """A 4-host inventory for the TP=4 vLLM recipe on the double, with each rank's Engram rows staged."""
    d = tmp_path_factory.mktemp("tp4")
    synth = engram_synth(d)
    inv = write_inventory(cluster, d / "inventory.yml", TP4_DEP, TP4, [h.name for h in cluster.hosts], TP4_PORT,
                          {"engine.master_port": 29611, **engram_overrides(synth)})
    stage_for_real(inv, synth)
    remove_all(cluster, TP4_DEP)
    yield inv
    remove_all(cluster, TP4_DEP)


def engram_synth(folder: Path):
    """A small synthetic DeepSeek checkpoint (scaled Engram geometry: tests/engram_synth.py)."""
    from tests.engram_synth import Synth
    return Synth(folder / "engram-synth", [1, 14], [300, 300, 300], 8, 32, 1, seed=11)


def set_overrides(sets: list[str]) -> dict:
    """--set expressions -> the inventory's recipe_overrides mapping."""
    return {k: yaml.safe_load(v) for k, _, v in (x.partition("=") for x in sets)}


def engram_overrides(synth) -> dict:
    """The recipe scaled to the synthetic checkpoint: its Engram geometry, and a checkpoint size
    that leaves the memory budget as small as the checkpoint (tests/cluster SCALED_OVERRIDES)."""
    return {"model.repo": "deployctl-demo/DeepSeek-V4.1-Flash-scaled", "model.checkpoint_gb": 0.05,
            **set_overrides(synth.sets())}


def stage_for_real(inv: Path, synth) -> None:
    """Every host's checkpoint is the synthetic one, and `deployctl stage` stages each rank's rows
    (launch proves them before it starts an engine: a hand-made manifest would be refused)."""
    dep = load_deployment(inv)
    for h in dep.cluster.hosts:
        ck = Path(dep.checkpoint_dir(h))
        if ck.exists():
            shutil.rmtree(ck)
        shutil.copytree(synth.ckpt, ck)
    p = dctl("stage", "-i", str(inv), timeout=600)
    assert p.returncode == 0, out(p)


def stage_engram(folder: Path, geometry, rank: int) -> None:
    """What `deployctl stage` leaves for a rank, as far as launch and the engine read it: the manifest
    (rank, tp, row ranges per layer) and engram-local.json."""
    folder.mkdir(parents=True, exist_ok=True)
    ranges = rank_ranges(geometry, 4, rank)
    manifest = {"format": "deployctl-engram-manifest", "version": 1, "complete": True, "rank": rank, "tp": 4,
                "layers": {str(r.layer): {"row_start": r.row_start, "row_end": r.row_end} for r in ranges}}
    (folder / "engram-manifest.json").write_text(json.dumps(manifest))
    (folder / "engram-local.json").write_text(json.dumps({"layers": {str(r.layer): [r.row_start, r.row_end]
                                                                     for r in ranges}}))


def up(inv: Path, *extra: str, timeout: float = 240, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = dctl("up", "-i", str(inv), "--only", "launch", "--only", "health", *extra, timeout=timeout, env=env)
    return p, time.monotonic() - t0


def rendered_argv(inv: Path, host: str, *sets: str) -> list[str]:
    dep = load_deployment(inv, None, sets)
    return list(engine_argv(dep, dep.cluster.host(host), head_address(dep.cluster)))


# -------------------------------------------------------------------------------------------- tests

def test_tp4_up_healthy_then_noop_status_logs_down(cluster, tp4):
    env = {"DCTL_LAUNCH_TOKEN": TOKEN}
    secret = "engine.env.HF_TOKEN=${DCTL_LAUNCH_TOKEN}"
    p, took = up(tp4, "--set", secret, env=env)
    print(f"\nTP=4 up (launch + health) to healthy: {took:.1f}s")
    assert p.returncode == 0, out(p)
    text = unwrap(out(p))
    assert "API answered" in text and "chat answered" in text
    assert TOKEN not in out(p)
    run_dir = Path(re.search(r"run record (\S+)", text).group(1))
    assert TOKEN not in "".join(f.read_text(errors="replace") for f in run_dir.rglob("*") if f.is_file())

    # The plan is what runs: each container is the run's planned spec (plan.json), bound to the fabric.
    plan_doc = json.loads((run_dir / "plan.json").read_text())
    planned = {a["host"]: a["details"]["container"] for st in plan_doc["stages"] if st["name"] == "launch"
               for a in st["actions"]}
    assert sorted(planned) == sorted(h.name for h in cluster.hosts)
    for h in cluster.hosts:
        ids = containers(cluster, h.name, TP4_DEP)
        assert len(ids) == 1, (h.name, ids)
        doc = json.loads(_docker(h.docker_host, "inspect", ids[0]).stdout)[0]
        want = rendered_argv(tp4, h.name)
        assert doc["Config"]["Cmd"] == want == planned[h.name]["argv"], h.name
        assert sorted(doc["HostConfig"]["Binds"]) == sorted(":".join(m) for m in planned[h.name]["mounts"])
        assert doc["Config"]["Image"] == planned[h.name]["image"]
        assert doc["Config"]["Labels"]["deployctl.rank"] == str(h.rank)
        assert f"HF_TOKEN={TOKEN}" in doc["Config"]["Env"], "the ${VAR} was expanded at launch"
        rec = _docker(h.docker_host, "exec", ids[0], "cat", f"{RECORD}/argv-vllm-rank{h.rank}.json")
        assert rec.returncode == 0, rec.stderr
        assert json.loads(rec.stdout)["argv"] == want, "the engine received exactly the rendered argv"
        env_rec = json.loads(rec.stdout)["env"]
        # NCCL/GLOO run on the test bed's fabric (its own bridge, MTU 9000), not on the SSH network
        assert env_rec["VLLM_HOST_IP"] == h.fabric_address and env_rec["NCCL_SOCKET_IFNAME"] == "fab0"
    master = dict(zip(want, want[1:]))["--master-addr"]
    assert master == cluster.hosts[0].fabric_address, "workers join the head's fabric address"

    # A re-run on the healthy cluster: launch is skipped, health only checks.
    p, took = up(tp4, "--set", secret, env=env)
    print(f"no-op re-run: {took:.1f}s")
    assert p.returncode == 0, out(p)
    text = unwrap(out(p))
    assert text.count("skip already running") == 4, text
    assert "started deployctl" not in text
    assert took < 30

    p = dctl("health", "-i", str(tp4), "--json")
    assert p.returncode == 0, out(p)
    assert [s["status"] for s in json.loads(p.stdout)["stages"]] == ["ok"]

    p = dctl("status", "-i", str(tp4), "--json")
    assert p.returncode == 0, out(p)
    doc = json.loads(p.stdout)
    assert doc["api"]["healthy"] is True
    for row in doc["hosts"]:
        assert row["reachable"] and [c["status"] for c in row["containers"]] == ["running"], row
        assert row["staged"]["engram"]["rank_ok"] is True
        assert row["containers"][0]["image_id"] == row["image"]["id"]
    p = dctl("status", "-i", str(tp4))
    assert p.returncode == 0 and "running" in p.stdout and "engram ok" in p.stdout, out(p)

    p = dctl("logs", "-i", str(tp4), "--host", "node3", "--tail", "50")
    assert p.returncode == 0, out(p)
    assert "node3" in p.stdout and "rank2" in p.stdout and "rank0" not in p.stdout

    p = dctl("down", "-i", str(tp4))
    assert p.returncode == 0, out(p)
    assert unwrap(out(p)).count("stopped and removed deployctl-lt4") == 4
    assert leftovers(cluster, TP4_DEP) == {}, "down removed every container on all 4 engines"
    p = dctl("down", "-i", str(tp4))
    assert p.returncode == 0 and unwrap(out(p)).count("no container of lt4 here") == 4, out(p)


def _failed_host(p: subprocess.CompletedProcess) -> list[str]:
    return re.findall(r"^(\S+): stage (\S+) failed", p.stderr, re.M)


@pytest.mark.parametrize("sets, host, needles", [
    (("engine.env.DOUBLE_FAIL=crash-at-start", "engine.env.DOUBLE_FAIL_RANK=2"), "node3",
     ("exited with exit code 3", "simulated crash at start")),
    (("engine.env.DOUBLE_FAIL=never-ready", "health.startup_timeout_s=5"), "node1",
     ("did not answer within health.startup_timeout_s 5s", "stuck at 90%")),
], ids=["crash-at-start-rank2", "never-ready"])
def test_failure_mode_names_the_host_with_its_log(cluster, tp4, sets, host, needles):
    p, _ = up(tp4, *[a for s in sets for a in ("--set", s)])
    assert p.returncode == 1, out(p)
    assert _failed_host(p) == [(host, "health")], p.stderr
    text = unwrap(p.stderr)
    for needle in needles:
        assert needle in text, text
    assert leftovers(cluster, TP4_DEP) == {}, "a failed up removes the containers it started"


def test_crash_later_names_the_worker(cluster, tp4):
    p, _ = up(tp4, "--set", "engine.env.DOUBLE_FAIL=crash-later", "--set", "engine.env.DOUBLE_FAIL_RANK=3",
              "--set", "engine.env.DOUBLE_CRASH_AFTER_S=1", "--set", "health.stay_up_s=6", "--keep-on-failure")
    assert p.returncode == 1, out(p)
    assert _failed_host(p) == [("node4", "health")], p.stderr
    text = unwrap(p.stderr)
    assert "exited with exit code 4" in text and "crash 1 s after ready" in text
    assert set(leftovers(cluster, TP4_DEP)) == {"node1", "node2", "node3", "node4"}, \
        "--keep-on-failure leaves them for debugging"
    p = dctl("status", "-i", str(tp4), "--json")
    rows = {r["host"]: r for r in json.loads(p.stdout)["hosts"]}
    assert rows["node4"]["containers"][0]["status"] == "exited"
    assert rows["node4"]["containers"][0]["exit_code"] == 4
    assert dctl("down", "-i", str(tp4)).returncode == 0
    assert leftovers(cluster, TP4_DEP) == {}


def test_wrong_engram_rows_refused_before_anything_starts(cluster, tp4):
    dep = load_deployment(tp4)
    node3 = dep.cluster.host("node3")
    folder = Path(dep.engram_dir(node3))
    try:
        stage_engram(folder, dep.recipe.engram.geometry, 1)        # rank 1's rows on rank 2's host
        p, _ = up(tp4)
        assert p.returncode == 1, out(p)
        assert _failed_host(p) == [("node3", "launch")], p.stderr
        assert "those are rank 1's rows" in unwrap(p.stderr)
        assert leftovers(cluster, TP4_DEP) == {}, "refused before any host was touched"
        p = dctl("status", "-i", str(tp4), "--json")
        rows = {r["host"]: r for r in json.loads(p.stdout)["hosts"]}
        assert rows["node3"]["staged"]["engram"]["rank_ok"] is False
    finally:
        p = dctl("stage", "-i", str(tp4), timeout=600)          # restage node3's own rows
        assert p.returncode == 0, out(p)


@contextlib.contextmanager
def background_up(inv: Path, log: Path, *sets: str) -> Iterator[subprocess.Popen]:
    """`deployctl up --only launch --only health` in the background (output in LOG), yielded once
    health waits for the API; killed at the end if it still runs."""
    args = [sys.executable, "-m", "orchestrator", "up", "-i", str(inv), "--only", "launch", "--only", "health",
            *sets]
    with open(log, "w") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 120
        while "waiting for the API" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"health never started waiting:\n{log.read_text()}"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_stopped_docker_engine_is_named_and_nothing_is_touched(cluster, tp4):
    cluster.stop_dockerd("node2")
    try:
        p, _ = up(tp4)
        assert p.returncode == 1, out(p)
        assert _failed_host(p) == [("node2", "launch")], p.stderr
        assert "Cannot connect to the Docker daemon" in unwrap(p.stderr)
        assert "nothing changed" in unwrap(p.stdout + p.stderr)
        p = dctl("status", "-i", str(tp4), "--json")
        assert p.returncode == 1
        rows = {r["host"]: r for r in json.loads(p.stdout)["hosts"]}
        assert rows["node2"]["reachable"] is False and rows["node1"]["reachable"] is True
    finally:
        cluster.start_dockerd("node2")
    assert leftovers(cluster, TP4_DEP) == {}


def test_worker_cut_during_health_is_named_then_down_reports_it(cluster, tp4):
    log = tp4.parent / "cut.log"
    try:
        with background_up(tp4, log, "--set", "engine.env.DOUBLE_LOAD_S=60", "--keep-on-failure") as proc:
            cluster.link_down("node3")
            rc = proc.wait(timeout=120)
        text = log.read_text()
        assert rc == 1, text
        assert re.findall(r"^(\S+): stage (\S+) failed", text, re.M) == [("node3", "health")], text
        assert "node3: stage health failed: unreachable" in text
        # down while node3 is cut off: the others are cleared, node3 is named, exit 1.
        p = dctl("down", "-i", str(tp4))
        assert p.returncode == 1, out(p)
        assert _failed_host(p) == [("node3", "down")], p.stderr
        assert "could not reach the host" in unwrap(p.stderr)
        assert leftovers(cluster, TP4_DEP, ["node1", "node2", "node4"]) == {}
    finally:
        cluster.link_up("node3")
    p = dctl("down", "-i", str(tp4))
    assert p.returncode == 0, out(p)
    assert leftovers(cluster, TP4_DEP) == {}


def test_second_up_is_refused_by_the_lock_and_ctrl_c_leaves_no_container(cluster, tp4):
    log = tp4.parent / "first.log"
    with background_up(tp4, log, "--set", "engine.env.DOUBLE_LOAD_S=600") as first:
        assert set(leftovers(cluster, TP4_DEP)) == {"node1", "node2", "node3", "node4"}
        second, took = up(tp4, timeout=60)
        assert second.returncode == 1, out(second)
        assert took < 30, "refused at once, not after waiting"
        text = unwrap(second.stderr)
        assert "locked on the head node1" in text and "/var/lock/deployctl-lt4.lock" in text
        assert f"pid {first.pid}" in text, "names the holder"
        assert "> launch" not in second.stderr, "the second up touched nothing"

        first.send_signal(signal.SIGINT)        # Ctrl-C while the engines are still loading
        rc = first.wait(timeout=90)
    text = log.read_text()
    assert rc == 130, text
    assert "interrupted (Ctrl-C)" in text and text.count("(verified)") == 4, text
    assert leftovers(cluster, TP4_DEP) == {}, "Ctrl-C leaves no container behind"
    p = dctl("down", "-i", str(tp4))
    assert p.returncode == 0, "the lock was released with its run: " + out(p)


QWEN_SMALL = {"ple.geometry.vocab_per_order": [997, 1009], "ple.shards": 4, "ple.split_ngram_parts": 4,
              "model.checkpoint_gb": 0.2}


def engine_io(host, deployment: str) -> dict[str, int]:
    """/proc/PID/io of the engine container's main process (the test hosts share this kernel)."""
    (cid,) = containers_of(host, deployment)
    pid = _docker(host.docker_host, "inspect", "-f", "{{.State.Pid}}", cid).stdout.strip()
    return {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}


def containers_of(host, deployment: str) -> list[str]:
    return _docker(host.docker_host, "ps", "-q", "--filter", f"label=deployctl.deployment={deployment}").stdout.split()


def test_sglang_single_host(cluster, double_image, tmp_path):
    """Qwen on one host with the released SGLang's PLE contract: write-ple writes the file the engine
    maps; the engine (the double, with the image's patch package) keeps it: a restart writes 0 bytes
    to it; with the table gone, the engine's own loader writes it at boot."""
    from tests import synth
    inv = write_inventory(cluster, tmp_path / "inventory.yml", QWEN_DEP, QWEN, ["node1"], QWEN_PORT, QWEN_SMALL)
    dep = load_deployment(inv)
    h = dep.cluster.host("node1")
    ck = Path(dep.checkpoint_dir(h))
    synth.write_checkpoint(ck, [t for t in synth.recipe_tensors(dep.recipe) if ".ple." in t.name], files=2,
                           config=synth.recipe_config(dep.recipe))
    ple = Path(dep.ple_dir(h))
    for old in ple.glob("ple_table_*") if ple.exists() else []:
        old.unlink()
    try:
        p = dctl("up", "-i", str(inv), "--only", "write-ple", "--only", "launch", "--only", "health", timeout=240)
        assert p.returncode == 0, out(p)
        (table,) = ple.glob("ple_table_*.bin")
        assert table.name == "ple_table_16768x160_float8_e4m3fn_2682880B_rows0-16768.bin"
        st, data = table.stat(), table.read_bytes()
        ids = containers(cluster, "node1", QWEN_DEP)
        assert len(ids) == 1
        doc = json.loads(_docker(h.docker_host, "inspect", ids[0]).stdout)[0]
        want = rendered_argv(inv, "node1")
        assert doc["Config"]["Cmd"] == want
        assert want[:3] == ["python3", "-m", "sglang.launch_server"] and "--ple-offload-embedding" in want
        mount = next(m for m in doc["Mounts"] if m["Destination"] == "/ple")
        assert mount["Source"] == str(ple) and mount["RW"] is True
        assert "SGLANG_EXTERNAL_MODEL_PACKAGE=deployctl_sglang_ple" in doc["Config"]["Env"]
        logs = dctl("logs", "-i", str(inv), "--tail", "200")
        assert f"file-backed mmap /ple/{table.name}" in logs.stdout and "PLE table kept" in logs.stdout, out(logs)
        p = dctl("status", "-i", str(inv))
        assert p.returncode == 0 and "ple 1 table" in p.stdout, out(p)
        # --follow streams until Ctrl-C, then exits 0
        follow = subprocess.Popen([sys.executable, "-m", "orchestrator", "logs", "-i", str(inv), "--follow",
                                   "--tail", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  cwd=REPO)
        try:
            assert select.select([follow.stdout], [], [], 30)[0], "logs --follow printed nothing in 30 s"
            first = follow.stdout.readline()
            assert first.startswith("node1 | "), first
            dctl("health", "-i", str(inv))                # new requests -> new lines while following
            follow.send_signal(signal.SIGINT)
            rest, _ = follow.communicate(timeout=30)
        finally:
            if follow.poll() is None:
                follow.kill()
                follow.wait()
        assert follow.returncode == 0 and "POST /v1/chat/completions" in rest, rest
        p, took = up(inv)
        assert p.returncode == 0 and "skip already running" in p.stderr, out(p)

        # a restart with a valid table: nothing written to it, no table work
        assert dctl("down", "-i", str(inv)).returncode == 0
        t0 = time.monotonic()
        p = dctl("up", "-i", str(inv), "--only", "write-ple", "--only", "launch", "--only", "health", timeout=240)
        took = time.monotonic() - t0
        assert p.returncode == 0 and "kept: " in p.stderr + p.stdout, out(p)
        io = engine_io(h, QWEN_DEP)
        print(f"\nrestart with a valid table: healthy in {took:.1f}s; engine write_bytes {io['write_bytes']}, "
              f"wchar {io['wchar']}")
        # the table: same inode, mtime (an mmap write moves it) and bytes; the engine process wrote only
        # its argv record and logs (tens of KiB), not the table's 2.7 MB
        assert (table.stat().st_ino, table.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
        assert table.read_bytes() == data and io["write_bytes"] < len(data) // 8
        assert "0 bytes written" in dctl("logs", "-i", str(inv), "--tail", "200").stdout

        # the table removed: the engine's own loader writes it at boot (the upstream path)
        assert dctl("down", "-i", str(inv)).returncode == 0
        for f in ple.glob("ple_table_*"):
            f.unlink()
        p, took = up(inv)
        assert p.returncode == 0, out(p)
        io = engine_io(h, QWEN_DEP)
        logs = dctl("logs", "-i", str(inv), "--tail", "200").stdout
        print(f"table removed: the engine wrote it at boot; healthy in {took:.1f}s; engine write_bytes "
              f"{io['write_bytes']} for a {len(data)}-byte table")
        assert "PLE table written by the loader: no deployctl manifest" in logs, logs
        assert table.read_bytes() == data and io["write_bytes"] >= len(data) - 2 * 4096
    finally:
        p = dctl("down", "-i", str(inv))
        for f in ple.glob("ple_table_*") if ple.exists() else []:
            f.unlink()                            # the hosts are shared by later tests
        assert p.returncode == 0, out(p)
    assert leftovers(cluster, QWEN_DEP, ["node1"]) == {}
