"""Sizing: the memory budget per node reproduces the reports' verdicts; plan shows it; up refuses."""
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
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.stages import build_plan
from orchestrator.sizing import GIB, size

INV = {n: INVENTORIES_DIR / f"{n}.yml" for n in ("spark1", "spark4", "spark8", "rtx1")}


def sizing(inv: str, recipe: str | None = None, *sets: str):
    return size(load_deployment(INV[inv] if inv in INV else inv, recipe, tuple(sets)))


def mem(s, host: str | None = None):
    n = s.node(host) if host else s.nodes[0]
    return n.budget("unified memory") or n.budget("GPU memory")


def line(budget, key: str) -> float:
    return budget.line_gb(key)


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env={**os.environ, "PYTHONPATH": str(root)})


# -- the reports' verdicts -----------------------------------------------------------------------

def test_deepseek_4_sparks_fits_with_engram_on_nvme():
    s = sizing("spark4")
    assert s.fits, s.refusal()
    for n in s.nodes:
        b = n.budget("unified memory")
        assert round(line(b, "weights"), 1) == 76.9          # (510.3 - 202.8) / 4
        assert line(b, "engram") == 0                        # not in memory
        assert line(b, "kv") >= b.kv_required_gb + 4         # a real margin over >= 4 GB
        assert 10 <= b.headroom_gb <= 25
        nvme = n.budget("NVMe")
        assert round(line(nvme, "engram"), 1) == 50.7        # 6 of 24 heads x 2 layers, rows + scales
        assert n.nvme_needs() == [("/mnt/nvme/deployctl/engram", pytest.approx(55.69, abs=0.01))]


def test_deepseek_4_sparks_engram_in_memory_is_refused_with_the_fix():
    s = sizing("spark4", None, "engram.placement=memory")
    assert not s.fits
    assert sorted(p.host for p in s.problems) == ["spark1", "spark2", "spark3", "spark4"]
    p = s.problems[0]
    assert p.resource == "unified memory" and p.shortfall_gb > 15
    assert p.fix == "put the Engram tables on NVMe: --set engram.placement=nvme"
    assert p.key == "engram.placement"
    assert f"short by {p.shortfall_gb:.1f} GB" in p.message


def test_deepseek_8_sparks_in_memory_fits_with_the_reports_figures():
    s = sizing("spark8", "deepseek-v41-flash-tp8-mem")
    assert s.fits, s.refusal()
    b = mem(s)
    engram = line(b, "engram")
    assert round(engram * 1e9 / GIB, 1) == 23.6               # the report's "23.6 GB per node"
    kv = next(x for x in b.lines if x.key == "kv")
    assert kv.gb >= b.kv_required_gb and "8.7" in kv.report   # the report's KV printed beside ours
    assert "report: ~8.7 GB" in s.to_json()["text"]


def test_deepseek_8_sparks_on_nvme_fits_with_more_kv_for_1m_context():
    s = sizing("spark8", "deepseek-v41-flash-tp8-nvme")
    assert s.fits, s.refusal()
    b = mem(s)
    assert round(b.kv_required_gb, 1) == 7.5                  # 890 B x 1,048,576 x 8
    kv_nvme = line(b, "kv")
    kv_mem = line(mem(sizing("spark8", "deepseek-v41-flash-tp8-mem")), "kv")
    # the reports: ~30 GB vs ~8.7 GB: the Engram share (25.3) minus the staging buffers (4.0)
    assert kv_nvme - kv_mem == pytest.approx(30 - 8.7, abs=0.1)
    assert "30 GB" in next(x for x in b.lines if x.key == "kv").report


def test_qwen_one_spark_fits_only_with_the_table_on_nvme():
    s = sizing("spark1")
    assert s.fits, s.refusal()
    b = mem(s)
    assert round(line(b, "weights"), 1) == 81.5               # 132.7 - 51.2
    assert line(b, "page_cache") == pytest.approx(8 * GIB / 1e9)
    assert 12 <= line(b, "kv") + line(b, "recurrent") <= 19   # the report: ~12-18 GB
    assert s.node("spark1").nvme_needs()[0][1] == pytest.approx(51.2 + 5.0, abs=0.01)
    bad = sizing("spark1", None, "ple.placement=memory")
    assert not bad.fits
    p = bad.problems[0]
    assert p.host == "spark1" and p.fix.endswith("--set ple.placement=nvme")
    assert p.shortfall_gb > 10


def test_qwen_one_rtx_fits_only_with_the_table_in_pinned_ram():
    s = sizing("rtx1")
    assert s.fits, s.refusal()
    n = s.node("rtx1")
    gpu = n.budget("GPU memory")
    assert gpu.capacity_gb == 96.0 and gpu.headroom_gb > 1
    assert 7 <= line(gpu, "kv") + line(gpu, "recurrent") <= 10     # the report: 8.3 GiB
    assert n.host_ram_need_gb() == pytest.approx(64.0)              # table + pinning headroom
    assert n.budget("host RAM").capacity_gb is None                 # measured by preflight
    bad = sizing("rtx1", None, "ple.placement=gpu")
    assert not bad.fits
    assert bad.problems[0].fix == "put the PLE table in pinned host RAM: --set ple.placement=pinned"


def _rtx_inventory(tmp_path: Path, ram_gb: float) -> Path:
    doc = yaml.safe_load(INV["rtx1"].read_text())
    doc["all"]["hosts"]["rtx1"]["host_ram_gb"] = ram_gb
    p = tmp_path / "rtx-ram.yml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_qwen_rtx_needs_64_gb_available_host_ram(tmp_path):
    small = sizing(str(_rtx_inventory(tmp_path, 48)))
    assert not small.fits
    p = small.problems[0]
    assert p.resource == "host RAM" and p.shortfall_gb == pytest.approx(64 - (48 - 8))
    assert "needs >= 64.0 GB available host RAM for the pinned table" in p.fix
    assert sizing(str(_rtx_inventory(tmp_path, 128))).fits


def test_fraction_fixes():
    # The RTX at 0.80: 76.8 GB cannot hold 81.5 GB of weights -> raise the fraction to what the
    # engine needs (81.5 weights + 1 buffers + 3 state + 4 KV = 89.5 of 96 GB).
    s = sizing("rtx1", None, "engine.args.mem-fraction-static=0.8")
    assert not s.fits
    assert s.problems[0].fix == "raise the engine's memory fraction: --set engine.args.mem-fraction-static=0.94"
    assert "gives the engine 76.8 GB, it needs 89.5 GB" in s.problems[0].message
    # A Spark whose engine takes 99%: nothing left for the OS and the page cache -> lower it.
    s = sizing("spark1", None, "engine.args.mem-fraction-static=0.99")
    assert not s.fits and "lower the engine's memory fraction" in s.problems[0].fix
    # Nothing to offload and no fraction to tune: a context that cannot fit.
    s = sizing("spark4", None, "engine.args.max-model-len=1048576", "sizing.concurrency=64")
    assert not s.fits and "more nodes" in s.problems[0].fix


# -- plan shows it, up refuses ---------------------------------------------------------------------

def test_plan_json_carries_the_budget():
    p = cli("plan", "-i", str(INV["spark4"]), "--json")
    assert p.returncode == 0, p.stderr
    sz = json.loads(p.stdout)["sizing"]
    assert sz["verdict"] == "fits" and sz["fits"] is True and sz["problems"] == []
    assert [n["host"] for n in sz["nodes"]] == ["spark1", "spark2", "spark3", "spark4"]
    node = sz["nodes"][0]
    assert [b["resource"] for b in node["budgets"]] == ["unified memory", "NVMe"]
    um = node["budgets"][0]
    assert um["capacity_gb"] == 128.0 and um["engine_gb"] == 102.4
    assert um["total_gb"] + um["headroom_gb"] == pytest.approx(128.0)
    for ln in um["lines"]:
        assert set(ln) >= {"key", "name", "gb", "source"} and ln["source"]
    assert {"weights", "buffers", "activations", "kv", "os"} <= {ln["key"] for ln in um["lines"]}
    assert sz["totals"]["unified memory"]["capacity_gb"] == 512.0
    assert sz["totals"]["NVMe"]["capacity_gb"] is None
    assert "weights share" in sz["text"]


def test_plan_prints_the_table_then_exits_2_naming_node_shortfall_and_fix():
    p = cli("plan", "-i", str(INV["spark4"]), "--set", "engram.placement=memory")
    assert p.returncode == 2
    assert "weights share" in p.stdout and "DOES NOT FIT" in p.stdout        # the full table first
    assert "spark1, spark2, spark3, spark4: unified memory needs" in p.stderr
    assert "short by 23.6 GB" in p.stderr
    assert "fix: put the Engram tables on NVMe: --set engram.placement=nvme" in p.stderr


def test_up_refuses_before_anything_runs(tmp_path):
    p = cli("up", "-i", str(INV["spark1"]), "--set", "ple.placement=memory", cwd=tmp_path)
    assert p.returncode == 2
    assert "spark1: unified memory needs" in p.stderr and "--set ple.placement=nvme" in p.stderr
    assert not (tmp_path / "runs").exists()                 # no run started, no host contacted
    with pytest.raises(InputError) as e:
        build_plan(load_deployment(INV["rtx1"], None, ("ple.placement=gpu",)))
    assert e.value.key == "ple.placement" and "rtx1" in str(e.value)


def test_only_stages_that_need_the_fit_refuse():
    dep = load_deployment(INV["spark4"], None, ("engram.placement=memory",))
    assert build_plan(dep, only=("build",)).stage("build").actions      # building an image is fine
    assert build_plan(dep, require_fit=False).extra["sizing"]["fits"] is False
    with pytest.raises(InputError):
        build_plan(dep, skip=("preflight",))                              # launch still needs it


# -- bad inputs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("sets, key", [
    (("sizing.os_reserve_gb=-1",), "sizing.os_reserve_gb"),
    (("sizing.activations_gb=-0.5",), "sizing.activations_gb"),
    (("sizing.concurrency=0",), "sizing.concurrency"),
    (("sizing.reference.bogus=x",), "sizing.reference.bogus"),
    (("engine.args.gpu-memory-utilization=1.5",), "engine.args.gpu-memory-utilization"),
    (("engine.args.gpu-memory-utilization=lots",), "engine.args.gpu-memory-utilization"),
    (("model.checkpoint_gb=100",), "model.checkpoint_gb"),          # smaller than its own tables
    (("engram.geometry.dtype=F7",), "engram.geometry.dtype"),
])
def test_bad_inputs_name_the_key(sets, key):
    with pytest.raises(InputError) as e:
        size(load_deployment(INV["spark4"], None, sets))
    assert e.value.key == key


def test_bad_input_through_the_cli_exits_2():
    p = cli("plan", "-i", str(INV["spark4"]), "--set", "sizing.os_reserve_gb=-1")
    assert p.returncode == 2 and "sizing.os_reserve_gb" in p.stderr and ">= 0" in p.stderr


def test_bad_inventory_opt_outs(tmp_path):
    doc = yaml.safe_load(INV["rtx1"].read_text())
    doc["all"]["hosts"]["rtx1"]["host_ram_gb"] = -4
    p = tmp_path / "bad.yml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError) as e:
        load_deployment(p)
    assert e.value.key.endswith("host_ram_gb")
