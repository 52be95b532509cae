"""The plan is what runs: every stage's actions carry the typed job its apply executes, the command's
options reach the plan, and an apply handed actions without their job refuses instead of re-deriving
the commands on its own. (The cluster tests compare the executed commands with plan.json: launch in
test_launch.py, sync-model in test_sync_model.py, ship in test_ship.py, the table stages in
test_engram_cluster.py / test_ple_stage.py through tests/tableop_double.py.)"""
from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.errors import DeployctlError
from orchestrator.launch.containerspec import ContainerSpec
from orchestrator.modelsync.jobs import SyncJob
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.runoptions import RunOptions, SyncModelOptions
from orchestrator.runrecord import RunContext
from orchestrator.ship.transfer import ShipJob
from orchestrator.stages import build_plan
from orchestrator.stages.tableop import TableJob

JOBS = {"ship": ShipJob, "sync-model": SyncJob, "launch": ContainerSpec, "stage-engram": TableJob,
        "write-ple": TableJob}


def spark4(tmp_path=None, **cvars):
    """inventories/spark4.yml (its fabric addresses make distribution: chain its default), or a copy
    with CVARS set in all.vars (in TMP_PATH)."""
    if not cvars:
        return load_deployment(INVENTORIES_DIR / "spark4.yml")
    doc = yaml.safe_load((INVENTORIES_DIR / "spark4.yml").read_text())
    doc["all"]["vars"].update(cvars)
    p = tmp_path / "spark4.yml"
    p.write_text(yaml.safe_dump(doc))
    return load_deployment(p)


def test_every_executing_action_carries_its_job():
    plan = build_plan(spark4())
    for st in plan.stages:
        for a in st.actions:
            if st.name in JOBS:
                assert isinstance(a.job, JOBS[st.name]), (st.name, a.host)
            if st.name == "stage-engram":
                assert TableJob.of(a).argv == a.command


def test_command_options_reach_the_plan(tmp_path):
    opts = RunOptions(sync_model=SyncModelOptions(io_timeout=45, bwlimit_mbps=10, rehash=True,
                                                  head_key="/etc/deployctl/head_key"),
                      ship_stall_s=33, ship_head_known_hosts="/etc/deployctl/known_hosts")
    plan = build_plan(spark4(tmp_path, distribution="direct"), only=("ship", "sync-model"), options=opts)
    manifest, *rsyncs = plan.stage("sync-model").actions
    assert manifest.job.check.args.count("--require") == 2 and "/etc/deployctl/head_key" in manifest.job.check.args
    assert "--rehash" in manifest.job.check.args
    for a in rsyncs:
        argv = a.job.transfer.argv(10**9)
        assert "--timeout=45" in argv and "--bwlimit=10000k" in argv
        assert "-i /etc/deployctl/head_key" in argv[argv.index("-e") + 1]
        assert list(a.command[2:]) == a.job.transfer.argv(int(spark4().recipe.model.checkpoint_gb * 1e9))
        assert "--rehash" in a.job.check.args and "--clean" in a.job.after.args
    for a in plan.stage("ship").actions:
        assert a.job.timeouts.stall_s == 33 and "/etc/deployctl/known_hosts" in a.job.need_files
        assert a.command[-1].endswith(a.job.shown()) and "<hostside/ship_relay.py> 33 docker" in a.job.shown()
    # the chain (spark4's default): no head key anywhere, the same timeouts and hash options
    plan = build_plan(spark4(), only=("ship", "sync-model"), options=opts)
    manifest, *chain = plan.stage("sync-model").actions
    assert "--require" not in manifest.job.check.args and "--rehash" in manifest.job.check.args
    for a in chain:
        assert a.op == "chain" and a.job.transfer is None and a.details["network"] == "fabric"
        assert "--rehash" in a.job.check.args and "--clean" in a.job.after.args
    for a in plan.stage("ship").actions:
        assert a.job.chain and a.job.timeouts.stall_s == 33 and a.job.need_files == ()
        assert a.command[-1] == a.job.shown() and "<hostside/ship_relay.py> 33 docker" in a.job.shown()


def test_sync_model_apply_runs_only_planned_jobs(tmp_path):
    from orchestrator.stages import sync_model
    dep = spark4()
    acts = [replace(a, job=None) for a in build_plan(dep, only=("sync-model",)).stage("sync-model").actions]
    ctx = RunContext(tmp_path / "run")
    out = sync_model.apply(dep, acts, ctx)
    ctx.close()
    assert [r.status for r in out] == ["failed"] * 4
    assert "carries no SyncJob" in out[0].message and "the head spark1 failed" in out[1].message


def test_ship_apply_runs_only_planned_jobs(tmp_path):
    from orchestrator.stages import ship
    dep = spark4()
    acts = [replace(a, job=None) for a in build_plan(dep, only=("ship",)).stage("ship").actions]
    ctx = RunContext(tmp_path / "run")
    with pytest.raises(DeployctlError, match="carry no ShipJob"):
        ship.apply(dep, acts, ctx)
    ctx.close()
