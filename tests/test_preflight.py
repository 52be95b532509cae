"""Preflight: every check of every host, all reported at once; honest GPU checks; nothing runs after it.

The pure parts (the plan, reading each command's answer) run anywhere; the rest runs on the test
cluster (tests/conftest.py `cluster`: 4 hosts with sshd and dockerd, no GPUs, this machine's arch).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.runoptions import RunOptions
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.stages import preflight as pf

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def actions(inv: str | Path, *sets: str):
    return {a.host: a for a in pf.plan(load_deployment(inv, None, tuple(sets)), RunOptions())[0]}


# -- the plan (pure) ------------------------------------------------------------------------------

def test_plan_states_every_command_and_the_sizing_needs():
    a = actions(INVENTORIES_DIR / "rtx1.yml")["rtx1"]
    d = a.details
    assert d["arch"] == "x86_64" and d["host_ram_need_gb"] == 64.0 and d["nvme"] == []
    assert d["commands"]["gpus"] == [["nvidia-smi", "-L"]]
    assert d["commands"]["docker"] == [["docker", "-H", "unix:///var/run/docker.sock", "info", "--format",
                                        "{{json .}}"]]            # the default engine, named (one -H rule)
    assert "nvidia-smi -L" in a.api and "'{{json .}}'" in a.api                      # quoted as run
    s = actions(INVENTORIES_DIR / "spark4.yml")["spark3"].details
    assert s["arch"] == "aarch64" and s["host_ram_need_gb"] == 0
    assert s["nvme"] == [{"path": "/mnt/nvme/deployctl/engram", "need_gb": 55.69}]
    assert s["commands"]["nvme"][0][-1] == "/mnt/nvme/deployctl/engram"             # an argument, not code


def test_plan_honours_the_opt_outs_and_docker_host(tmp_path):
    doc = yaml.safe_load((INVENTORIES_DIR / "spark1.yml").read_text())
    doc["all"]["vars"].update({"expect_gpus": False, "expect_arch": "x86_64"})
    doc["all"]["hosts"]["spark1"].update({"docker_host": "unix:///run/x y.sock", "fabric_iface": "enp1s0f1np1"})
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump(doc))
    d = actions(inv)["spark1"].details
    assert "gpus" not in d["commands"] and d["expect_gpus"] is False and d["arch"] == "x86_64"
    assert d["commands"]["docker"][0][:3] == ["docker", "-H", "unix:///run/x y.sock"]
    assert d["commands"]["fabric"] == [["cat", "/sys/class/net/enp1s0f1np1/operstate"]]
    doc["all"]["hosts"]["spark1"]["fabric_iface"] = "../../etc"
    inv.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError) as e:
        actions(inv)
    assert e.value.key == "all.hosts.spark1.fabric_iface"


# -- reading the answers (pure) ---------------------------------------------------------------------

def test_docker_and_gpu_checks_are_honest():
    info = json.dumps({"ServerVersion": "27.1", "Runtimes": {"runc": {}, "io.containerd.runc.v2": {}}})
    c, runtimes = pf.docker_runtimes(0, info, "")
    assert c.status == "ok" and runtimes == ["io.containerd.runc.v2", "runc"]
    g = pf.check_gpus(runtimes, (127, "", "sh: nvidia-smi: not found"), 1)
    assert g.status == "failed" and "no nvidia runtime" in g.detail and "nvidia-smi -L` exited 127" in g.detail
    assert "expect_gpus: false" in g.detail                       # the documented opt-out is named
    ok = pf.check_gpus(runtimes + ["nvidia"], (0, "GPU 0: NVIDIA GB10 (UUID: GPU-1)\n", ""), 1)
    assert ok.status == "ok"
    assert pf.check_gpus(["nvidia"], (0, "GPU 0: x\n", ""), 2).status == "failed"       # fewer than declared
    down, rt = pf.docker_runtimes(1, "", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock")
    assert down.status == "failed" and "Cannot connect" in down.detail and rt is None
    assert pf.check_gpus(rt, (0, "GPU 0: x\n", ""), 1).status == "failed"
    errs, _ = pf.docker_runtimes(0, json.dumps({"ServerErrors": ["permission denied"]}), "")
    assert errs.status == "failed" and "permission denied" in errs.detail


def test_docker_check_reports_version_and_store_and_refuses_an_engine_too_old():
    containerd = {"ServerVersion": "26.1.5+dfsg1", "Driver": "overlayfs", "Runtimes": {"runc": {}},
                  "DriverStatus": [["driver-type", "io.containerd.snapshotter.v1"]]}
    c, _ = pf.docker_runtimes(0, json.dumps(containerd), "")
    assert c.status == "ok" and "Docker 26.1.5+dfsg1, containerd image store" in c.detail
    graph = {"ServerVersion": "20.10.24+dfsg1", "Driver": "overlay2", "Runtimes": {"runc": {}},
             "DriverStatus": [["Backing Filesystem", "extfs"], ["Supports d_type", "true"]]}
    c, _ = pf.docker_runtimes(0, json.dumps(graph), "")
    assert c.status == "ok" and "Docker 20.10.24+dfsg1, graph-driver store (overlay2)" in c.detail
    old, runtimes = pf.docker_runtimes(0, json.dumps({**graph, "ServerVersion": "19.03.15"}), "")
    assert old.status == "failed" and runtimes == ["runc"]
    assert "19.03.15 is too old" in old.detail and "20.10 or newer" in old.detail


def test_space_needs_on_one_filesystem_add_up_and_staged_bytes_count():
    assert pf.parse_space("70000000000 /mnt/nvme\n0\n") == (70_000_000_000, "/mnt/nvme", 0)
    two = [("/mnt/nvme/a", 40.0, (70_000_000_000, "/mnt/nvme", 0)),
           ("/mnt/nvme/b", 40.0, (70_000_000_000, "/mnt/nvme", 0))]
    c = pf.check_nvme("spark1", two)
    assert c.status == "failed" and "short by 10.0 GB" in c.detail and "needs 80.0 GB free on" in c.detail
    staged = [("/mnt/nvme/a", 40.0, (30_000_000_000, "/mnt/nvme", 35_000_000_000))]    # a re-run
    assert pf.check_nvme("spark1", staged).status == "ok"


def test_ram_arch_fabric_and_clock():
    meminfo = "MemTotal:       131072000 kB\nMemAvailable:    40000000 kB\n"
    r = pf.check_ram("rtx1", meminfo, 64.0)
    assert r.status == "failed" and "needs >= 64.0 GB available host RAM for the pinned table" in r.detail
    assert pf.check_ram("spark1", meminfo, 0).status == "ok"
    pinned = actions(INVENTORIES_DIR / "rtx1.yml")["rtx1"].details["pinned_table"]
    assert pinned == {"min_host_ram_gb": 64.0}
    r = pf.check_ram("rtx1", meminfo, 64.0, pinned)                # the PLE writer's own rule
    assert r.status == "failed" and "needs 64 GB available" in r.detail and "short by 23.0 GB" in r.detail     # 40,000,000 kB = 41.0 GB
    assert pf.check_ram("rtx1", meminfo.replace("40000000", "70000000"), 64.0, pinned).status == "ok"
    assert pf.check_arch("x86_64\n", "aarch64").status == "failed"
    assert pf.check_fabric("enp1", 0, "down\n").status == "failed"
    assert pf.check_fabric("enp1", 0, "up\n").status == "ok"
    assert pf.check_clock("1003.5", 1000.0, 1000.2).status == "failed"       # 3.4 s ahead
    assert pf.check_clock("1001.5", 1000.0, 1000.2).status == "ok"


# -- on the test cluster -------------------------------------------------------------------------------

def _inventory(cluster, tmp_path: Path, **cvars) -> Path:
    doc = yaml.safe_load(Path(cluster.inventory_path).read_text())
    doc["all"]["vars"]["run_dir"] = str(tmp_path / "runs")
    doc["all"]["vars"].update(cvars)
    for k in [k for k, v in cvars.items() if v is None]:
        del doc["all"]["vars"][k]
    p = tmp_path / "inventory.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def _records(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "runs").iterdir())


@pytest.mark.cluster
def test_plan_check_passes_on_healthy_hosts(cluster, tmp_path):
    inv = _inventory(cluster, tmp_path)
    p = cli("plan", "-i", str(inv), "--check", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)["preflight"]["stages"][0]["results"]
    assert sorted(r["host"] for r in results) == ["node1", "node2", "node3", "node4"]
    for r in results:
        checks = {c["name"]: c["status"] for c in r["data"]["checks"]}
        assert checks == {"ssh": "ok", "arch": "ok", "docker": "ok", "gpus": "skipped", "nvme": "ok",
                          "ram": "ok", "clock": "ok"}, r


@pytest.mark.cluster
def test_gpu_and_arch_checks_fail_without_the_opt_outs(cluster, tmp_path):
    inv = _inventory(cluster, tmp_path, expect_gpus=True, expect_arch=None)
    p = cli("plan", "-i", str(inv), "--check", cwd=tmp_path)
    assert p.returncode == 1
    for host in ("node1", "node2", "node3", "node4"):
        assert f"{host}: stage preflight failed: 2 check(s) failed" in p.stderr
    assert "no nvidia runtime in docker info" in p.stderr and "`uname -m` is " in p.stderr


@pytest.mark.cluster
def test_up_reports_every_host_problem_at_once_and_builds_nothing(cluster, tmp_path):
    inv = _inventory(cluster, tmp_path)
    # ~0.37 GB of Engram rows + margin per node: fits the real disk, not node2's 64 MB filesystem
    sets = ["--set", "engram.geometry.vocab_per_order=[100000, 100000, 100000]",
            "--set", "engram.free_margin_gb=0.05", "--set", "model.checkpoint_gb=2"]
    cluster.small_fs("node2", "nvme", 64)
    cluster.stop_sshd("node3")
    try:
        p = cli("up", "-i", str(inv), *sets, cwd=tmp_path)
    finally:
        cluster.start_sshd("node3")
        cluster.unmount_small_fs("node2", "nvme")
    assert p.returncode == 1, p.stderr
    said = " ".join(p.stderr.split())                     # the console wraps long lines
    assert "node2: stage preflight failed" in said and "node3: stage preflight failed" in said
    assert "node1: stage preflight failed" not in said and "node4: stage preflight failed" not in said
    (run,) = _records(tmp_path)
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["exit_code"] == 1
    assert [s["name"] for s in status["stages"]] == ["preflight"]       # nothing after it ran
    msg = {r["host"]: r["message"] for r in status["stages"][0]["results"] if r["status"] == "failed"}
    assert sorted(msg) == ["node2", "node3"]
    assert "nvme: NVMe:" in msg["node2"] and "short by" in msg["node2"]
    assert f"needs 0.4 GB free on {cluster.host('node2').nvme_dir}/engram" in msg["node2"]
    assert msg["node3"].startswith("1 check(s) failed: ssh: node3: cannot connect to")
    for m in msg.values():
        assert m in said                                   # every problem of every host, in one report
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert {e["stage"] for e in events if e["event"] == "stage-start"} == {"preflight"}
    for n in ("node1", "node2", "node3", "node4"):
        assert cli_images_absent(cluster, n)


def cli_images_absent(cluster, host: str) -> bool:
    """Nothing was built or loaded on the host: its engine has no deployctl image."""
    r = cluster.nsexec(host, ["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"])
    return "dctl-engine:test" not in r.stdout


@pytest.mark.cluster
def test_docker_checks_target_the_inventory_engine_not_the_login_docker_host(cluster, base_images, tmp_path):
    """One -H rule: node2 keeps the default engine in the inventory (no docker_host) while its SSH
    login sets DOCKER_HOST to its own test engine (sshd SetEnv). Preflight must ask the default engine
    (`docker -H unix:///var/run/docker.sock`, as launch and ship do), not the login's. Seen through the
    memory gate's `docker ps`: a running container of the deployment exists on the default engine only."""
    default = "unix:///var/run/docker.sock"
    dep = f"onerule-{os.getpid()}"
    inv = _inventory(cluster, tmp_path, deployment=dep)
    doc = yaml.safe_load(inv.read_text())
    del doc["all"]["hosts"]["node2"]["docker_host"]
    inv.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = subprocess.run(["docker", "-H", default, "run", "-d", "--rm", "--network", "none", "--label",
                        f"deployctl.deployment={dep}", base_images[0], "sleep", "300"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    try:
        p = cli("plan", "-i", str(inv), "--check", "--json", "--set", "engine.min_mem_available_gib=0.5",
                cwd=tmp_path)
    finally:
        subprocess.run(["docker", "-H", default, "rm", "-f", r.stdout.strip()], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)["preflight"]["stages"][0]["results"]
    ram = {x["host"]: next(c for c in x["data"]["checks"] if c["name"] == "ram")["detail"] for x in results}
    assert "the deployment's engine runs here" in ram["node2"], ram          # asked the default engine
    for n in ("node1", "node3", "node4"):                                     # their own engines: none there
        assert "the deployment's engine runs here" not in ram[n] and "(memory gate)" in ram[n], ram
