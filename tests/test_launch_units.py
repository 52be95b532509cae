"""Launch / health / lifecycle pieces that need no cluster: argv, staged-row checks, log progress,
docker inspect parsing, Ctrl-C handling in the runner, the API checks against a local engine double."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import runner
from orchestrator.deployment import load_deployment
from orchestrator.launch import api, probe
from orchestrator.launch.containers import _parse_time, parse_list, run_argv
from orchestrator.launch.lock import lock_path
from orchestrator.launch.containerspec import SPEC_LABEL, bind_fabric, container_spec
from orchestrator.fabric.detect import Fabric
from orchestrator.runoptions import RunOptions
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.outcomes import HostFailure, run_per_host
from orchestrator.plan import Action, Plan, StagePlan
from orchestrator.runrecord import RunContext
from orchestrator.stages import build_plan
from orchestrator.stages.base import Stage

DOUBLE = Path(__file__).resolve().parent / "engine_double" / "engine_double.py"


def spark4():
    return load_deployment(INVENTORIES_DIR / "spark4.yml")


def test_run_argv_passes_secrets_on_stdin_and_the_engine_with_h():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("engine.env.HF_TOKEN=${HF_TOKEN}",))
    h = dep.cluster.host("spark2")
    spec = container_spec(dep, h, None, None)
    argv = run_argv(spec, "unix:///run/x.sock")
    assert argv[:6] == ["docker", "-H", "unix:///run/x.sock", "run", "-d", "--env-file"]
    assert argv[6] == "/dev/stdin"
    assert not any("HF_TOKEN" in a for a in argv), "a ${VAR} value never reaches the command line"
    assert f"{SPEC_LABEL}={spec.digest}" in argv, "the spec digest is a label"
    plain = spec.docker_run_argv()
    i = plain.index("HF_TOKEN=${HF_TOKEN}")
    assert argv[7:] == plain[3:i - 1] + plain[i + 1:], "otherwise the plan's exact command"
    # No ${VAR}: exactly the plan's command, with -H.
    spec2 = replace(spec, env={"OMP_NUM_THREADS": "1"})
    assert run_argv(spec2, "unix:///e")[5:] == spec2.docker_run_argv()[3:]


def test_plan_shows_the_spec_label_and_health_watches_every_host():
    plan = build_plan(spark4(), ("launch", "health"))
    for a in plan.stage("launch").actions:
        assert f"{SPEC_LABEL}={a.job.digest}" in a.command
    health = plan.stage("health").actions
    assert [a.host for a in health] == ["spark1", "spark2", "spark3", "spark4"]
    assert "/v1/chat/completions" in health[0].api and "Count from 1 to 10." in health[0].api
    # every host's containers listed by the deployment's label (list_argv: hostside/host_read.py's list form)
    assert all(json.loads(a.command[3])["label"] == "deployctl.deployment=spark4" for a in health[1:])


def staged_texts(folder: str, layers: dict | None, rank: int, manifest: bool = True) -> dict:
    """What the host sends back for its Engram folder: the two files' texts (None: missing)."""
    local = json.dumps({"layers": layers}) if layers is not None else None
    man = json.dumps({"rank": rank, "tp": 4, "layers": {k: {"row_start": v[0], "row_end": v[1]}
                                                        for k, v in layers.items()}}) if layers and manifest else None
    return {"engram": {"dir": folder, "texts": {"engram-local.json": local, "engram-manifest.json": man}}}


def test_engram_rows_of_another_rank_are_named():
    dep = spark4()
    h = dep.cluster.host("spark3")
    folder = dep.engram_dir(h)
    mine, other = probe.expected_engram(dep, 2), probe.expected_engram(dep, 1)
    assert mine != other and set(mine) == {"1", "14"}
    assert probe.engram_problem(dep, h, staged_texts(folder, mine, 2)) is None
    msg = probe.engram_problem(dep, h, staged_texts(folder, other, 1))
    assert msg.startswith("Engram rows of rank 2: ") and "those are rank 1's rows" in msg
    assert "staged for rank 1 of 4" in msg, "engram_stage.check_rank's own words"
    msg = probe.engram_problem(dep, h, staged_texts(folder, None, 2))
    assert "no complete Engram staging" in msg and "deployctl stage" in msg
    msg = probe.engram_problem(dep, h, staged_texts(folder, mine, 2, manifest=False))
    assert "engram-manifest.json missing" in msg
    # Placement memory: nothing staged on NVMe, nothing to check.
    mem = load_deployment(INVENTORIES_DIR / "spark8.yml", "deepseek-v41-flash-tp8-mem")
    assert probe.engram_problem(mem, mem.cluster.hosts[0], {}) is None


def test_progress_line_and_times():
    lines = ["INFO starting", "INFO Loading weights: 30% (14/48 shards)", "INFO Loading weights: 40% (19/48)",
             "DEBUG something else"]
    assert api.progress_line(lines) == "INFO Loading weights: 40% (19/48)"
    assert api.progress_line([]) == ""
    assert _parse_time("0001-01-01T00:00:00Z") is None
    assert _parse_time("2026-09-01T12:00:00.123456789Z") == pytest.approx(1788264000.123456, abs=1e-5)


def test_parse_list_uptime_from_the_host_clock():
    doc = [{"Id": "a" * 64, "Name": "/deployctl-x", "RestartCount": 0, "Image": "sha256:" + "b" * 64,
            "State": {"Status": "running", "ExitCode": 0, "StartedAt": "2026-09-01T12:00:00.5Z"},
            "Config": {"Labels": {SPEC_LABEL: "abc", "deployctl.rank": "1"}}},
           {"Id": "c" * 64, "Name": "/deployctl-y", "RestartCount": 2, "Image": "sha256:x",
            "State": {"Status": "exited", "ExitCode": 3, "StartedAt": "2026-09-01T12:00:00Z",
                      "Error": ""}, "Config": {"Labels": {}}}]
    now = 1788264000 + 90
    cs = parse_list(0, f"{now}\n{json.dumps(doc)}", "", "unix:///e")
    assert [c.name for c in cs] == ["deployctl-x", "deployctl-y"]
    assert cs[0].running and cs[0].uptime_s == pytest.approx(89.5) and cs[0].spec == "abc"
    assert not cs[1].running and cs[1].uptime_s is None
    assert "exited with exit code 3" in cs[1].describe() and "restarts 0" in cs[0].describe()
    assert parse_list(0, f"{now}\n", "", "e") == []
    with pytest.raises(HostFailure, match="does not answer"):
        parse_list(3, "", "Cannot connect to the Docker daemon", "unix:///e")


def test_the_previous_generation_is_listed_only_when_asked():
    doc = [{"Id": i * 64, "Name": f"/deployctl-x{suffix}", "Image": "sha256:" + "b" * 64,
            "State": {"Status": "exited"}, "Config": {"Labels": {}, "Image": "img:1"}}
           for i, suffix in (("a", ""), ("c", "-prev"))]
    text = f"1788264000\n{json.dumps(doc)}"
    assert [c.name for c in parse_list(0, text, "", "e")] == ["deployctl-x"]
    assert [c.name for c in parse_list(0, text, "", "e", previous=True)] == ["deployctl-x", "deployctl-x-prev"]
    assert parse_list(0, text, "", "e")[0].image_ref == "img:1"


class _DockerShell:
    """A host's Docker engine holding containers of deployment x: the current one, running, and the
    previous generation kept stopped (`-prev`); answers list_argv, docker stop, rm and logs."""

    def __init__(self, host, deployment: str = "x"):
        self.host, self.deployment, self.calls = host, deployment, []
        self.have = {f"deployctl-{deployment}": ("a" * 64, "running"),
                     f"deployctl-{deployment}-prev": ("c" * 64, "exited")}

    def docker(self, *args: str) -> list[str]:
        return ["docker", "-H", self.host.docker_host, *args]

    def run(self, argv, timeout=60.0, stdin=None):
        from orchestrator.executors.ssh import Result
        from orchestrator.launch.commands import list_argv
        argv = list(argv)
        self.calls.append(argv)
        if argv == list_argv(self.host.docker_host, self.deployment):
            doc = [{"Id": cid, "Name": f"/{name}", "Image": "sha256:" + "b" * 64, "State": {"Status": state},
                    "Config": {"Labels": {}, "Image": "img:1"}} for name, (cid, state) in self.have.items()]
            return Result(0, f"1788264000\n{json.dumps(doc)}", "")
        if "rm" in argv:
            self.have = {n: v for n, v in self.have.items() if v[0] not in argv}
        return Result(0, "", "")


def test_a_failed_up_with_rollback_keeps_the_previous_generation(tmp_path, monkeypatch):
    """#59 item 3: with supervise.rollback the failure cleanup of a failed `up` (launch's, also on
    Ctrl-C) removes the new generation and keeps the stopped previous one (`-prev`) on every host: it
    is what the supervisor's rollback returns to. Without rollback it removes both; `down` always does."""
    from contextlib import contextmanager
    from orchestrator.launch import launcher, lifecycle
    from orchestrator.launch.containers import remove_all
    for rollback in (True, False):
        dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, (f"supervise.rollback={str(rollback).lower()}",))
        shells = {h.name: _DockerShell(h, dep.name) for h in dep.cluster.hosts}

        @contextmanager
        def fake_shells(cluster, connect_timeout=None):
            yield shells
        monkeypatch.setattr(lifecycle, "Shells", fake_shells)
        ctx = RunContext(tmp_path / f"run-{rollback}")
        launcher._cleanup(dep, ctx, list(shells))()
        ctx.close()
        for name, sh in shells.items():
            want = [f"deployctl-{dep.name}-prev"] if rollback else []
            assert sorted(sh.have) == want, (rollback, name, sh.calls)
    sh = _DockerShell(spark4().cluster.hosts[0], "x")                   # `down`: everything goes
    assert sorted(c.name for c in remove_all(sh, "x")) == ["deployctl-x", "deployctl-x-prev"] and sh.have == {}


def test_the_same_image_under_another_name_is_no_change():
    """After a rollback the engines run the release's pin tag; an `up` whose tag names the same image
    (by ID) with the same spec otherwise does not relaunch; another image or another spec does."""
    from orchestrator.launch.containers import Container
    from orchestrator.launch.launcher import renamed_only
    spec = container_spec(spark4(), spark4().cluster.host("spark2"), None, None)
    pinned = replace(spec, image="deployctl-release/x:3")

    def running(s, image_id="sha256:1"):
        return Container("id", s.name, "running", 0, 0, image_id, {SPEC_LABEL: s.digest}, image_ref=s.image)
    assert renamed_only(running(pinned), spec, "sha256:1")
    assert not renamed_only(running(pinned), spec, "sha256:2"), "the tag moved to another image"
    assert not renamed_only(running(pinned), replace(spec, argv=spec.argv + ("--x",)), "sha256:1")
    assert not renamed_only(running(spec), spec, "sha256:1"), "same name: the digests decide as before"


def test_lock_path_is_safe():
    assert lock_path("spark4") == "/var/lock/deployctl-spark4.lock"
    assert lock_path("a b/../c") == "/var/lock/deployctl-a_b_.._c.lock"


def _fake_plan(dep, apply):
    stage = Stage("launch", lambda d, o: ([], ""), apply)
    plan = Plan(dep, (StagePlan("launch", tuple(Action("launch", h.name, "x", "x") for h in dep.cluster.hosts),
                                stage=stage),))
    return stage, plan


def test_ctrl_c_cancels_worker_threads_at_once_and_runs_the_cleanups(tmp_path, monkeypatch):
    dep = spark4()
    seen: dict[str, bool] = {}
    cleaned: list[str] = []

    def apply(d, actions, ctx):
        ctx.state.cleanups.append(lambda: cleaned.append("removed"))

        def one(action, log):
            seen[action.host] = ctx.cancel.wait(30)          # a long poll loop, waiting on cancel
            raise HostFailure("cancelled")
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        return run_per_host(actions, ctx, one)
    stage, plan = _fake_plan(dep, apply)
    ctx = RunContext(tmp_path / "run")
    before = signal.getsignal(signal.SIGINT)
    t0 = time.monotonic()
    out = runner.run(plan, ctx, "up")
    ctx.close()
    assert time.monotonic() - t0 < 10, "the threads saw ctx.cancel at once"
    assert out.status == "cancelled" and out.exit_code == 130
    assert seen and all(seen.values())
    assert cleaned == ["removed"]
    assert signal.getsignal(signal.SIGINT) is before, "the handler is restored"


def test_a_failed_stage_runs_the_failure_cleanups(tmp_path, monkeypatch):
    dep = spark4()
    cleaned: list[str] = []

    def apply(d, actions, ctx):
        ctx.state.failure_cleanups.append(lambda: cleaned.append("removed"))
        return run_per_host(actions, ctx, lambda a, log: (_ for _ in ()).throw(HostFailure("boom")))
    stage, plan = _fake_plan(dep, apply)
    ctx = RunContext(tmp_path / "run")
    out = runner.run(plan, ctx, "up")
    ctx.close()
    assert out.exit_code == 1 and cleaned == ["removed"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_api_checks_against_a_local_engine_double(tmp_path):
    port = _free_port()
    env = {**os.environ, "DOUBLE_LOAD_S": "0", "DOUBLE_TTFT_MS": "5", "DOUBLE_TOKENS_PER_S": "1000"}
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(DOUBLE), "vllm", "serve", "/m", "--served-model-name", "dsv",
                                 "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        with api.http_client() as client:
            deadline = time.monotonic() + 20
            chk = api.check(client, base, "dsv", "Count from 1 to 10.", 50, 5)
            while not chk.ok and time.monotonic() < deadline:
                assert chk.step == "health" and not chk.fatal, chk
                time.sleep(0.1)
                chk = api.check(client, base, "dsv", "Count from 1 to 10.", 50, 5)
            assert chk.ok and chk.step == "done" and "1, 2, 3" in chk.detail, chk
            wrong = api.check(client, base, "other-name", "Count from 1 to 10.", 50, 5)
            assert not wrong.ok and wrong.fatal and "other-name" in wrong.detail
    finally:
        proc.kill()
        proc.wait()
    with api.http_client() as client:
        down = api.check(client, base, "dsv", None, 1, 2)
    assert not down.ok and "connection refused" in down.detail


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_requests_in_flight_from_the_engines_own_metrics(tmp_path, engine):
    """`status` on several deployments shows what each engine counts as running and waiting: vLLM's
    vllm:num_requests_running/_waiting, SGLang's sglang:num_running_reqs/num_queue_reqs (the double
    writes them as the released engines do)."""
    import httpx
    port = _free_port()
    env = {**os.environ, "DOUBLE_LOAD_S": "0", "DOUBLE_TTFT_MS": "5", "DOUBLE_TOKENS_PER_S": "20"}
    argv = (["vllm", "serve", "/m", "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port)]
            if engine == "vllm" else
            ["sglang", "--model-path", "/m", "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port)])
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, str(DOUBLE), *argv], stdout=log, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        with api.http_client() as client:
            deadline = time.monotonic() + 20
            while api.in_flight(client, base) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert api.in_flight(client, base) == {"running": 0, "waiting": 0}
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
            t = threading.Thread(target=lambda: httpx.post(base + "/v1/chat/completions", json=body, timeout=30))
            t.start()
            seen = None
            while time.monotonic() < deadline + 10 and (seen or {}).get("running") != 1:
                seen = api.in_flight(client, base)
                time.sleep(0.05)
            assert seen == {"running": 1, "waiting": 0}, seen
            t.join(30)
    finally:
        proc.kill()
        proc.wait()
    with api.http_client() as client:
        assert api.in_flight(client, base, timeout=2) is None          # nothing answers: unknown, not 0


# -- boot 10: start order and the memory gate (orchestrator/launch/launcher.py) ----------------------

class _GateShell:
    """A host whose memory-gate command answers with a fixed MemAvailable (kB)."""

    def __init__(self, host, kib: int, drop_line: str = "drop: done"):
        self.host, self.kib, self.drop_line, self.calls = host, kib, drop_line, []

    def run(self, argv, timeout=60.0, stdin=None):
        from orchestrator.executors.ssh import Result
        self.calls.append(list(argv))
        return Result(0, f"{self.drop_line}\nMemAvailable:   {self.kib} kB\n", "")


def _launch(tmp_path, monkeypatch, kib: dict[str, int], *sets: str, rendezvous=None):
    """launcher._Launch.run on spark4 with every host step faked except the gate and the order
    (RENDEZVOUS: what the rendezvous check finds, host -> failure; default nothing)."""
    from orchestrator.launch import launcher
    from orchestrator.fabric.detect import Fabric
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("engine.start_wait_s=0.2", *sets))
    names = [h.name for h in dep.cluster.hosts]
    ctx = RunContext(tmp_path / "run")
    shells = {n: _GateShell(dep.cluster.host(n), kib[n]) for n in names}
    started: list[tuple[str, float]] = []
    monkeypatch.setattr(launcher.probe, "read_host", lambda *a, **k: probe.HostRead({}, {}, "sha256:" + "0" * 64, []))
    monkeypatch.setattr(launcher.probe, "engram_problem", lambda *a: None)
    monkeypatch.setattr(launcher.detect, "for_host", lambda *a, **k: Fabric("enp1s0f0np0", "10.0.0.1", (), "t"))
    monkeypatch.setattr(launcher, "remove_all", lambda sh, name, keep=frozenset(): [])
    monkeypatch.setattr(launcher, "create", lambda sh, spec, env: f"{sh.host.name}-cid")
    monkeypatch.setattr(launcher.rendezvous, "check", lambda dep, shells, master: dict(rendezvous or {}))
    monkeypatch.setattr(launcher, "start", lambda sh, spec, cid: started.append((sh.host.name, time.monotonic()))
                        or cid)
    logs = {n: ctx.host_log(n, "launch") for n in names}
    planned = {a.host: a.job for a in build_plan(dep, ("launch",)).stage("launch").actions}
    out = launcher._Launch(dep, ctx, shells, planned, logs, {}).run()
    for log in logs.values():
        log.close()
    ctx.close()
    return out, started, shells


def test_a_failed_rendezvous_check_starts_nothing(tmp_path, monkeypatch):
    from orchestrator.outcomes import HostFailure
    ok = {n: 120 << 20 for n in ("spark1", "spark2", "spark3", "spark4")}
    out, started, _ = _launch(tmp_path, monkeypatch, ok,
                              rendezvous={"spark3": HostFailure("cannot reach the head's rendezvous")})
    assert started == []
    by = {r.host: r for r in out}
    assert by["spark3"].status == "failed" and "rendezvous" in by["spark3"].message
    assert by["spark1"].status == "skipped" and "failed the rendezvous check" in by["spark1"].message


def test_workers_start_together_first_then_the_head(tmp_path, monkeypatch):
    from orchestrator.launch.containerspec import start_sequence
    dep = spark4()
    assert start_sequence(dep) == [("spark4", "spark3", "spark2"), ("spark1",)]
    head_first = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("engine.start_order=head-first",))
    assert start_sequence(head_first) == [("spark1",), ("spark2", "spark3", "spark4")]
    ok = {n: 120 << 20 for n in ("spark1", "spark2", "spark3", "spark4")}
    out, started, shells = _launch(tmp_path, monkeypatch, ok)
    assert all(r.status == "ok" for r in out), [r.message for r in out]
    assert {n for n, _ in started[:3]} == {"spark2", "spark3", "spark4"} and started[3][0] == "spark1"
    assert started[3][1] - max(t for _, t in started[:3]) >= 0.2, "engine.start_wait_s before the head"
    # every host: the deployment's firewall chain (the head's store and every host's fabric
    # listeners: only the fabric), then page cache dropped and the cache folder created, before any start
    from orchestrator.launch import firewall
    for name, sh in shells.items():
        fw, (argv,) = sh.calls[0], sh.calls[1:]
        assert fw[:3] == ["sh", "-c", firewall.APPLY_SH], fw
        assert ("--dport 29501 -s 10.0.0.1 -j RETURN" in fw[4]) is (name == "spark1"), "the detected address admitted"
        assert argv[-2:] == ["1", "/var/tmp/dsv41-vllm-cache"] and "drop_caches" in argv[2]


def test_memory_gate_refuses_before_any_container_starts(tmp_path, monkeypatch):
    kib = {"spark1": 120 << 20, "spark2": 120 << 20, "spark3": 42 << 20, "spark4": 120 << 20}
    out, started, _ = _launch(tmp_path, monkeypatch, kib)
    assert started == [], "no container starts anywhere"
    res = {r.host: r for r in out}
    assert res["spark3"].status == "failed"
    assert "spark3: MemAvailable 42.0 GiB < 100 GiB (engine.min_mem_available_gib)" in res["spark3"].message
    assert all(res[n].status == "skipped" and "memory gate" in res[n].message
               for n in ("spark1", "spark2", "spark4"))


def test_memory_gate_verdict_and_the_real_script(tmp_path):
    from orchestrator.launch.containers import mem_available_kib, memgate_argv, memgate_verdict
    assert memgate_verdict("a", 100 << 20, 100) == (True, "MemAvailable 100.0 GiB >= 100 GiB")
    ok, msg = memgate_verdict("a", (99 << 20) + 5, 100)
    assert not ok and msg.startswith("a: MemAvailable 99.0 GiB < 100 GiB")
    assert memgate_verdict("a", 1, 0)[0], "0 = no gate"
    # the script itself, here (no drop: that would empty this machine's page cache)
    folder = tmp_path / "c" / "d"
    p = subprocess.run(memgate_argv(False, str(folder)), capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and folder.is_dir() and mem_available_kib(p.stdout) > 0
    assert "drop:" not in p.stdout


def test_preflight_ram_check_holds_the_memory_gate():
    from orchestrator.stages import preflight as pf
    info = "MemTotal: 130000000 kB\nMemAvailable: 50000000 kB\n"
    c = pf.check_ram("spark2", info, 0, None, 100)
    assert c.status == "failed" and "spark2: MemAvailable 47.7 GiB < 100 GiB" in c.detail
    c = pf.check_ram("spark2", info, 0, None, 100, engine_running=True)
    assert c.status == "ok" and "judged at launch" in c.detail
    assert pf.check_ram("spark2", "MemAvailable: 110000000 kB\n", 0, None, 100).status == "ok"
    a = {x.host: x for x in pf.plan(spark4(), RunOptions())[0]}["spark2"]
    assert a.details["min_mem_available_gib"] == 100
    assert a.details["commands"]["ram"][1][-2:] == ["--filter", "label=deployctl.deployment=spark4"]


def test_launch_runs_the_planned_spec_bound_to_the_detected_fabric():
    """What launch starts is the plan's ContainerSpec (the action's job) with only the fabric bound:
    the head's fabric address as --master-addr, the host's NCCL/GLOO/UCX env, RDMA devices."""
    dep = spark4()
    (plan_launch,) = [s for s in build_plan(dep, ("launch",)).stages]
    fab = Fabric("enp1s0f1np1", "10.10.0.2", ("mlx5_1",), "ConnectX-7 port up")
    head_addr = "10.10.0.1"
    for a in plan_launch.actions:
        planned = a.job
        assert list(a.command)[-len(planned.argv):] == list(planned.argv), "the plan shows the job's argv"
        bound = bind_fabric(planned, fab, head_addr, dep.recipe.engine.nccl_roce_env)
        assert bound == container_spec(dep, dep.cluster.host(a.host), fab, Fabric("x", head_addr, (), "head")), \
            "binding the planned spec gives the full render"
        diff = [(x, y) for x, y in zip(planned.argv, bound.argv) if x != y]
        master = dict(zip(planned.argv, planned.argv[1:]))["--master-addr"]
        assert diff == [(master, head_addr)], diff
        assert (bound.mounts, bound.image, bound.shm_size, bound.options) == \
            (planned.mounts, planned.image, planned.shm_size, planned.options)
        assert {k: v for k, v in bound.env.items() if k in planned.env} == planned.env
        assert bound.env["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1" and bound.rdma_devices
        assert bound.labels[SPEC_LABEL] == bound.digest != planned.digest


def test_launch_apply_refuses_actions_without_their_planned_spec(tmp_path):
    """apply executes the job the plan carries; an action without one is an internal error before any
    host is touched (it never re-renders the container on its own)."""
    from orchestrator.errors import DeployctlError
    from orchestrator.launch import launcher
    dep = spark4()
    acts = [replace(a, job=None) for a in build_plan(dep, ("launch",)).stage("launch").actions]
    ctx = RunContext(tmp_path / "run")
    with pytest.raises(DeployctlError, match="carry no ContainerSpec"):
        launcher.apply(dep, acts, ctx)
