"""Run records and per-host failures as values (runner + RunContext), with real subprocesses."""
from __future__ import annotations

import json
import subprocess

from orchestrator import runner
from orchestrator.deployment import load_deployment
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.outcomes import HostFailure, HostResult, HostResults, run_per_host
from orchestrator.plan import Action, Plan, StagePlan
from orchestrator.runrecord import RunContext
from orchestrator.stages.base import Stage

SECRET = "hf_abcdefghijklmnop0123"


def _apply(dep, actions, ctx):
    def one(action, log):
        p = subprocess.run(["sh", "-c", action.command[0]], capture_output=True, text=True, timeout=10)
        log.write(p.stdout)
        if p.returncode:
            raise HostFailure(f"command exited {p.returncode}", rc=p.returncode)
        return "ran"
    return run_per_host(actions, ctx, one)


def test_run_record_and_failure_report(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    ok = "echo hello; echo fine"
    bad = f"echo loading; echo token {SECRET}; echo 'CUDA error: out of memory'; exit 3"
    launch = Stage("launch", lambda d, o: ([], ""), _apply)
    health = Stage("health", lambda d, o: ([], ""), _apply)
    plan = Plan(dep, (      # each StagePlan carries the Stage that applies it: no lookup by name
        StagePlan("launch", tuple(Action("launch", h.name, "sh", "test", command=(bad if h.rank == 2 else ok,))
                                  for h in dep.cluster.hosts), stage=launch),
        StagePlan("health", (Action("health", "spark1", "sh", "never runs", command=(ok,)),), stage=health),
    ))
    ctx = RunContext(tmp_path / "run")
    out = runner.run(plan, ctx, "up")
    ctx.close()

    assert out.status == "failed" and out.exit_code == 1
    assert [s.name for s in out.stages] == ["launch"], "no stage runs after a failed one"
    results = {r.host: r for r in out.stages[0].results}
    assert {h for h, r in results.items() if r.ok} == {"spark1", "spark2", "spark4"}, \
        "the other hosts' results are kept"
    failed = results["spark3"]
    assert failed.rc == 3 and failed.stage == "launch"
    text = runner.describe_failure(failed)
    assert "spark3: stage launch failed (exit code 3)" in text
    assert "CUDA error: out of memory" in text and failed.log_path in text
    assert SECRET not in text and SECRET not in (tmp_path / "run" / "logs" / "spark3" / "launch.log").read_text()

    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and status["exit_code"] == 1
    plan_doc = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan_doc["deployment"] == "spark4"
    events = [json.loads(l) for l in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "stage-start" and kinds[-1] == "run-end"
    assert sum(1 for e in events if e["event"] == "action-end") == 4
    for h in ("spark1", "spark2", "spark3", "spark4"):
        assert (tmp_path / "run" / "logs" / h / "launch.log").exists()
    assert SECRET not in (tmp_path / "run" / "events.jsonl").read_text()


def test_run_per_host_returns_a_result_set(tmp_path):
    """One runner for every per-host step: a list of HostResult with .succeeded and .failed."""
    acts = [Action("launch", h, "sh", "x") for h in ("a", "b", "c")]

    def one(action, log):
        if action.host == "b":
            raise HostFailure("no", rc=2)
        return HostResult(action.host, "launch", "skipped", "done already") if action.host == "c" else None
    ctx = RunContext(tmp_path / "run")
    res = run_per_host(acts, ctx, one)
    ctx.close()
    assert isinstance(res, list) and isinstance(res, HostResults)
    assert [r.host for r in res] == ["a", "b", "c"]
    assert [r.host for r in res.succeeded] == ["a", "c"] and [r.host for r in res.failed] == ["b"]
    assert res.failed[0].rc == 2 and not res.ok
    both = res + [HostResult("d", "launch", "ok")]
    assert isinstance(both, HostResults) and [r.host for r in both.succeeded] == ["a", "c", "d"]
    assert run_per_host([], ctx, one) == [] and run_per_host([], ctx, one).ok


def test_a_stage_plan_without_its_stage_is_an_internal_error(tmp_path):
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    plan = Plan(dep, (StagePlan("launch", (Action("launch", "spark1", "sh", "x"),)),))
    ctx = RunContext(tmp_path / "run")
    out = runner.run(plan, ctx, "up")
    ctx.close()
    assert out.status == "error" and out.exit_code == 1 and "carries no Stage" in out.error


def test_a_failure_after_health_leaves_the_served_deployment_running(tmp_path):
    """launch registers a failure cleanup (it removes what it started); once health passes, the new
    engines serve: a later stage's failure (supervise) is reported, exit 1, but nothing is removed and
    the run counts as served (it makes a release). A failure in health still runs the cleanup."""
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    removed: list[str] = []

    def launch_apply(d, actions, ctx):
        ctx.state.failure_cleanups.append(lambda: removed.append("engines"))
        return _apply(d, actions, ctx)

    def plan_of(health_cmd: str, supervise_cmd: str) -> Plan:
        def sp(name, cmd, apply=_apply):
            return StagePlan(name, (Action(name, "spark1", "sh", name, command=(cmd,)),),
                             stage=Stage(name, lambda d, o: ([], ""), apply))
        return Plan(dep, (sp("launch", "true", launch_apply), sp("health", health_cmd), sp("supervise", supervise_cmd)))

    ctx = RunContext(tmp_path / "a")
    out = runner.run(plan_of("true", "exit 4"), ctx, "up")
    ctx.close()
    assert out.exit_code == 1 and [s.status for s in out.stages] == ["ok", "ok", "failed"]
    assert removed == [] and runner.served(out), "the served engines stay; the run made a release"
    ctx = RunContext(tmp_path / "b")
    out = runner.run(plan_of("exit 5", "true"), ctx, "up")
    ctx.close()
    assert out.exit_code == 1 and removed == ["engines"] and not runner.served(out)
