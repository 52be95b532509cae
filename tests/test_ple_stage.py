"""Stage write-ple and `deployctl ple ...`: the plan, the spec, the CLI's local write, and (marked
`cluster`) the stage through Ansible on a test-cluster host, RTX RAM refusal included."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.deployment import load_deployment
from orchestrator.stages import build_plan
from orchestrator.recipe import load_recipe
from orchestrator.stages.write_ple import spec_for
from orchestrator.hostside import ple_spec
from orchestrator.hostside.geometry import total_rows
from tests import synth

REPO = Path(__file__).resolve().parents[1]
SMALL = ("ple.geometry.vocab_per_order=[97,101]", "ple.geometry.row_values=16", "ple.shards=4",
         "ple.split_ngram_parts=4")


def test_plan_spark_names_the_file_and_rtx_writes_none():
    st = build_plan(load_deployment(REPO / "inventories/spark1.yml"), only=("write-ple",)).stage("write-ple")
    (a,) = st.actions
    # the name the released SGLang maps (sglang/srt/models/qwen4_exp_ple_table.py ple_table_file_name)
    assert a.details["file"].endswith(
        "/ple/ple_table_320001536x160_float8_e4m3fn_51200245760B_rows0-320001536.bin")
    assert a.command[:4] == ("timeout", "-k", "30", str(600 + 51_200_245_760 // 20_000_000))
    assert a.command[6:8] == ("ple-write", "--spec") and "--checkpoint" in a.command
    assert a.details["playbook"] == "playbooks/write-ple.yml"
    st = build_plan(load_deployment(REPO / "inventories/rtx1.yml"), only=("write-ple",)).stage("write-ple")
    (a,) = st.actions
    assert "no table file is written" in a.summary and "64 GB" in a.summary
    assert "--checkpoint" not in a.command
    st = build_plan(load_deployment(REPO / "inventories/rtx1.yml", sets=("ple.placement=memory",)),
                    only=("write-ple",)).stage("write-ple")
    assert st.actions == () and "no file" in st.note


def test_spec_round_trips_through_the_op_parser():
    r = load_recipe("qwen38-flash-next-spark").recipe
    doc = spec_for(r)
    spec = ple_spec.parse_spec(json.loads(json.dumps(doc)))
    assert spec.to_json() == doc
    assert total_rows(spec.geometry) == 320_001_446


def small_checkpoint(folder: Path, sets=SMALL, recipe="qwen38-flash-next-spark") -> list[synth.TensorPlan]:
    r = load_recipe(recipe, sets).recipe
    plans = [t for t in synth.recipe_tensors(r) if ".ple." in t.name]
    synth.write_checkpoint(folder, plans, files=3, config=synth.recipe_config(r))
    return plans


def table_bytes(plans) -> bytes:
    """The tiled shards (synth.ple_shard_rows), then zero rows up to the padded row count."""
    rows = sum(t.rows for t in plans)
    padded = -(-(-(-rows // 128) * 128) // 64) * 64
    data = b"".join(synth.expected_row(t.name, i, t.width) for t in plans for i in range(t.rows))
    return data + bytes((padded - rows) * plans[0].width)


def test_cli_write_then_keep_json(tmp_path):
    plans = small_checkpoint(tmp_path / "ck")
    args = ["ple", "write", "--checkpoint", str(tmp_path / "ck"), "--dest", str(tmp_path / "ple"),
            *[x for s in SMALL for x in ("--set", s)], "--json"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["status"] == "written"
    assert Path(doc["file"]).read_bytes() == table_bytes(plans)
    r = CliRunner().invoke(cli, args[:-1] + ["--verify"])
    assert r.exit_code == 0 and r.output.startswith("kept ") and "equal" in r.output, r.output


def test_cli_write_bad_input_exits_2(tmp_path):
    small_checkpoint(tmp_path / "ck")
    r = CliRunner().invoke(cli, ["ple", "write", "--checkpoint", str(tmp_path / "ck"), "--dest",
                                 str(tmp_path / "ple"), "--set", "ple.geometry.vocab_per_order=[97,101]",
                                 "--set", "ple.geometry.row_values=16", "--set", "ple.shards=5",
                                 "--set", "ple.split_ngram_parts=4"])
    assert r.exit_code == 2
    assert "shard 4" in r.output and "missing" in r.output


def test_cli_spec_and_vars(tmp_path):
    r = CliRunner().invoke(cli, ["ple", "spec", "-r", "qwen38-flash-next-rtx"])
    assert r.exit_code == 0 and json.loads(r.output)["placement"] == "pinned"
    pyz = tmp_path / "t.pyz"
    pyz.write_bytes(b"")
    r = CliRunner().invoke(cli, ["ple", "vars", "-i", str(REPO / "inventories/spark1.yml"), "--pyz", str(pyz)])
    assert r.exit_code == 0, r.output
    v = json.loads(r.output)
    assert v["tables_pyz"] == str(pyz) and set(v["ple_hosts"]) == {"spark1"}
    job = v["ple_hosts"]["spark1"]
    assert job["argv"][4:7] == ["python3", job["pyz"], "ple-write"] and job["timeout_s"] == 600 + 51_200_245_760 // 20_000_000


# -- through Ansible on a test-cluster host ------------------------------------------------------

def one_host_inventory(cluster, tmp_path, hardware: str, recipe: str) -> Path:
    from tests.cluster.cluster import inventory_data
    data = inventory_data(cluster.name, cluster.hosts[:1], deployment="pletest", recipe=recipe)
    data["all"]["vars"]["run_dir"] = str(tmp_path / "runs")
    data["all"]["vars"].pop("recipe_overrides", None)
    (h,) = data["all"]["hosts"].values()
    h["hardware"] = hardware
    inv = tmp_path / f"inv-{hardware}.yml"
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    return inv


def deployctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


# Own folders on the host so other tests sharing the session's cluster are not touched.
CLUSTER_SETS = (*SMALL, "model.checkpoint_dir=ple-test-checkpoint", "ple.subdir=ple-test")


@pytest.mark.cluster
def test_stage_writes_then_keeps_through_ansible(cluster, tmp_path):
    inv = one_host_inventory(cluster, tmp_path, "dgx-spark", "qwen38-flash-next-spark")
    sets = [x for s in CLUSTER_SETS for x in ("--set", s)]
    dep = load_deployment(inv, sets=CLUSTER_SETS)
    host = dep.cluster.hosts[0]
    ck, dest = Path(dep.checkpoint_dir(host)), Path(dep.ple_dir(host))
    plans = small_checkpoint(ck, CLUSTER_SETS)
    for old in dest.glob("*") if dest.exists() else []:
        old.unlink()
    (dest.mkdir(parents=True, exist_ok=True))
    (dest / "ple_table_1x16_F8_E4M3_16B.bin").write_bytes(b"stale geometry..")

    p = deployctl("ple", "-i", str(inv), *sets, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    (res,) = json.loads(p.stdout)["stages"][0]["results"]
    assert res["status"] == "ok" and res["message"].startswith("written "), res
    f = Path(res["data"]["file"])
    assert f.parent == dest and f.read_bytes() == table_bytes(plans)
    assert [x.name for x in dest.glob("ple_table_*.bin")] == [f.name]       # the stale one is gone
    assert (dest / ple_spec.manifest_name(f.name)).exists()
    st = f.stat()

    p = deployctl("ple", "-i", str(inv), *sets, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    (res,) = json.loads(p.stdout)["stages"][0]["results"]
    assert res["status"] == "skipped" and res["message"].startswith("kept: "), res
    assert (f.stat().st_ino, f.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    run_dir = Path(json.loads(p.stdout)["run_dir"])
    assert (run_dir / "write-ple-vars.json").exists()
    assert not (run_dir / "ansible").exists(), "a kept table is decided over SSH, without a playbook run"

    p = deployctl("ple", "-i", str(inv), *sets, "--verify", "--json")   # --verify always runs the op
    assert p.returncode == 0, p.stdout + p.stderr
    (res,) = json.loads(p.stdout)["stages"][0]["results"]
    assert res["status"] == "skipped" and res["data"]["decided_in_s"] < 2, res
    assert (Path(json.loads(p.stdout)["run_dir"]) / "ansible").is_dir()
    assert (f.stat().st_ino, f.stat().st_mtime_ns) == (st.st_ino, st.st_mtime_ns)


@pytest.mark.cluster
def test_rtx_pinned_ram_check_refuses_on_the_host(cluster, tmp_path):
    inv = one_host_inventory(cluster, tmp_path, "rtx-pro-6000", "qwen38-flash-next-rtx")
    host = cluster.hosts[0].name
    p = deployctl("ple", "-i", str(inv), "--set", "ple.min_host_ram_gb=100000", "--set", "ple.subdir=ple-test")
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"{host}: refusing placement 'pinned'" in p.stderr and "needs 100000 GB" in p.stderr, p.stderr
    avail = next(int(x.split()[1]) * 1024 for x in open("/proc/meminfo") if x.startswith("MemAvailable"))
    assert f"has {avail / 1e9:.0f}" in p.stderr or "GB available (MemAvailable)" in p.stderr

    tables = lambda: sorted(Path(cluster.hosts[0].nvme_dir).rglob("ple_table_*.bin"))   # noqa: E731
    before = tables()
    p = deployctl("ple", "-i", str(inv), "--set", "ple.min_host_ram_gb=1", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    (res,) = json.loads(p.stdout)["stages"][0]["results"]
    assert res["status"] == "ok" and "no file is written" in res["message"], res
    assert tables() == before, "the pinned placement wrote a table file"


def test_apply_executes_the_planned_argv_and_verify_adds_to_it(tmp_path, monkeypatch):
    from dataclasses import replace

    from orchestrator.runoptions import RunOptions
    from orchestrator.runrecord import RunContext
    from orchestrator.stages import write_ple
    from orchestrator.stages.tableop import timeout_for
    from tests.tableop_double import Recorder, ok, with_op

    dep = load_deployment(REPO / "inventories/spark1.yml")
    (a,) = build_plan(dep, only=("write-ple",)).stage("write-ple").actions
    a = with_op(a, (*a.details["job"]["op"][:-1], "/planned/ple"))     # apply must not recompute it
    written = {"status": "written", "file": "/planned/ple/t.bin", "bytes": 1e9, "seconds": 1, "mb_per_s": 1000,
               "reason": "new"}
    rec = Recorder(monkeypatch, {"spark1": ok("spark1", written)})
    ctx = RunContext(tmp_path / "run")
    (r,) = write_ple.apply(dep, [a], ctx)
    assert r.status == "ok" and r.message.startswith("written /planned/ple/t.bin"), r
    (p,) = rec.probes
    assert p.check_argv[-3:] == ("--dest", "/planned/ple", "--check")
    (run,) = rec.runs
    assert run["limit"] == ["spark1"] and run["extravars"]["ple_hosts"]["spark1"]["argv"] == list(a.command)

    # --verify (a run option): the planned op plus --verify, the timeout for two passes, no SSH probe
    rec = Recorder(monkeypatch, {"spark1": ok("spark1", {"status": "kept", "reason": "equal"})})
    ctx = RunContext(tmp_path / "run2", options=RunOptions(verify=True))
    (r,) = write_ple.apply(dep, [a], ctx)
    assert r.status == "skipped" and r.message == "kept: equal"
    job = write_ple.TableJob.of(a)
    argv = rec.runs[0]["extravars"]["ple_hosts"]["spark1"]["argv"]
    assert argv == list(replace(job, op=(*job.op, "--verify"), timeout_s=timeout_for(job.bytes, 2)).argv)
    assert argv[4:] == [*a.command[4:], "--verify"] and not rec.probes

    # a result the op did not print is a failure saying so
    rec = Recorder(monkeypatch, {"spark1": ok("spark1", {})})
    (r,) = write_ple.apply(dep, [a], RunContext(tmp_path / "run3"))
    assert r.status == "failed" and r.message.startswith("ple-write printed no result"), r
