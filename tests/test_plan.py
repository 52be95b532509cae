"""plan / up --dry-run: ordered stages, one action per host, exact commands, pure, secrets masked."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.stages import build_plan

STAGE_ORDER = ["preflight", "fabric", "build", "ship", "fetch-model", "sync-model", "stage-engram", "write-ple", "launch",
               "health", "supervise", "route"]
CASES = [("spark4", "deepseek-v41-flash-tp4"), ("spark8", "deepseek-v41-flash-tp8-nvme"),
         ("spark8", "deepseek-v41-flash-tp8-mem"), ("spark1", "qwen38-flash-next-spark"),
         ("rtx1", "qwen38-flash-next-rtx")]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=60)


@pytest.mark.parametrize("inv, recipe", CASES)
def test_plan_json_for_every_recipe(inv, recipe):
    p = cli("plan", "-i", str(INVENTORIES_DIR / f"{inv}.yml"), "--recipe", recipe, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["version"] == 1 and doc["recipe"]["name"] == recipe
    assert [s["name"] for s in doc["stages"]] == STAGE_ORDER
    hosts = [h["name"] for h in doc["hosts"]]
    launch = next(s for s in doc["stages"] if s["name"] == "launch")
    assert sorted(a["host"] for a in launch["actions"]) == sorted(hosts)
    for st in doc["stages"]:
        for a in st["actions"]:
            assert a["host"] in hosts
            assert a.get("command") or a.get("api"), f"{st['name']} action says what it runs"
        if not st["actions"]:
            assert st.get("note"), f"{st['name']} says why it has nothing to do"


def test_dry_run_equals_plan():
    inv = str(INVENTORIES_DIR / "spark4.yml")
    a = cli("plan", "-i", inv, "--json")
    b = cli("up", "-i", inv, "--dry-run", "--json")
    assert a.returncode == b.returncode == 0
    assert json.loads(a.stdout) == json.loads(b.stdout)


def test_engram_staging_depends_on_placement():
    inv = INVENTORIES_DIR / "spark8.yml"
    nvme = build_plan(load_deployment(inv, "deepseek-v41-flash-tp8-nvme"))
    mem = build_plan(load_deployment(inv, "deepseek-v41-flash-tp8-mem"))
    assert len(nvme.stage("stage-engram").actions) == 8
    assert mem.stage("stage-engram").actions == ()
    assert "memory" in mem.stage("stage-engram").note


def test_rtx_writes_no_ple_file_but_checks_ram():
    plan = build_plan(load_deployment(INVENTORIES_DIR / "rtx1.yml"))
    (a,) = plan.stage("write-ple").actions
    assert a.details["placement"] == "pinned" and a.details["min_host_ram_gb"] == 64.0
    assert "no table file is written" in a.summary


def test_only_and_skip():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    assert [s.name for s in build_plan(dep, only=("build", "ship")).stages] == ["build", "ship"]
    assert "build" not in [s.name for s in build_plan(dep, skip=("build",)).stages]


def test_planning_is_pure():
    """Planning never imports the executors (Docker SDK, paramiko, ansible-runner)."""
    code = ("import sys; from orchestrator.deployment import load_deployment; "
            "from orchestrator.stages import build_plan; "
            f"build_plan(load_deployment({str(INVENTORIES_DIR / 'spark4.yml')!r})); "
            "bad = [m for m in ('docker', 'paramiko', 'ansible_runner') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_secrets_are_masked_in_plans():
    token = "hf_SuperSecretToken123456"
    inv = str(INVENTORIES_DIR / "spark4.yml")
    p = cli("plan", "-i", inv, "--json", "--set", f"engine.env.HF_TOKEN={token}",
            env={"HF_TOKEN": token})
    assert p.returncode == 0, p.stderr
    assert token not in p.stdout and token not in p.stderr
    p = cli("plan", "-i", inv, "--set", f"engine.env.HF_TOKEN={token}", env={"HF_TOKEN": token})
    assert token not in p.stdout
    # Not in the operator's environment: the secret-named key alone is enough to mask it.
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    p = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "-i", inv, "--json", "--set",
                        f"engine.env.HF_TOKEN={token}"], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and token not in p.stdout and "HF_TOKEN=***" in p.stdout


def test_help_for_every_command():
    for cmd in ("up", "plan", "build", "ship", "stage", "ple", "launch", "health", "status", "logs",
                "down", "bench", "engram", "sync-model"):
        p = cli(cmd, "--help")
        assert p.returncode == 0 and "Usage:" in p.stdout, cmd
        assert len(p.stdout.splitlines()) > 4, f"{cmd} --help says something useful"


def test_an_explicit_image_without_its_chain_is_served_as_it_is_and_the_plan_says_so(tmp_path):
    """#59 item 2: the recipe's (or an inventory's) engine.image + engine.chain pair names the tag its
    chain builds; an engine.image given more specifically than the chain (`--set` over the recipe's or
    the inventory's chain, an inventory's recipe_overrides over the recipe file's) is served as it is:
    the build stage builds nothing, instead of re-tagging that image to the chain's build, and the plan
    says why. Named together, in one place, the chain builds that tag (the test cluster's inventories)."""
    import yaml
    spark4 = INVENTORIES_DIR / "spark4.yml"

    def build_of(inv, *sets):
        dep = load_deployment(inv, None, sets)
        return dep, build_plan(dep, ("build",)).stage("build")
    dep, st = build_of(spark4, "engine.image=registry.example.com/team/vllm-dsv41:v2")
    assert not st.actions and dep.recipe.engine.chain is None
    assert dep.recipe.engine.image == "registry.example.com/team/vllm-dsv41:v2"
    assert st.note.startswith("engine.image registry.example.com/team/vllm-dsv41:v2 is given by --set "
                              "engine.image=registry.example.com/team/vllm-dsv41:v2 without engine.chain: "
                              "chain vllm-dsv41 ("), st.note
    assert "is not built, that image is served as it is" in st.note and "--set engine.chain=vllm-dsv41" in st.note
    p = cli("plan", "-i", str(spark4), "--only", "build", "--set", "engine.image=registry.example.com/team/vllm-dsv41:v2")
    assert p.returncode == 0, p.stderr
    assert "chain vllm-dsv41" in " ".join(p.stdout.split()) and "is not built" in " ".join(p.stdout.split()), p.stdout
    # both named on the command line: the chain builds that tag
    dep, st = build_of(spark4, "engine.chain=vllm-dsv41", "engine.image=vllm-dsv41:mine")
    assert [a.details["image"] for a in st.actions] == ["vllm-dsv41:mine"] and dep.loaded.chain_skipped == ""
    # an inventory naming both (as the test cluster's scaled recipes do): built and tagged so; a --set
    # image over that pair is served as it is
    doc = yaml.safe_load(spark4.read_text())
    doc["all"]["vars"]["recipe_overrides"] = {"engine.image": "dctl-engine:test", "engine.chain": "vllm-dsv41"}
    both = tmp_path / "both.yml"
    both.write_text(yaml.safe_dump(doc))
    dep, st = build_of(both)
    assert [a.details["image"] for a in st.actions] == ["dctl-engine:test"]
    dep, st = build_of(both, "engine.image=dctl-engine:other")
    assert not st.actions and "chain vllm-dsv41 (" in st.note and str(both) in st.note
    # an inventory naming only the image (the runbook's "make it stick" pin): served as it is
    doc["all"]["vars"]["recipe_overrides"] = {"engine.image": "deployctl-release/spark4:3"}
    pin = tmp_path / "pin.yml"
    pin.write_text(yaml.safe_dump(doc))
    dep, st = build_of(pin)
    assert not st.actions and f"is given by {pin}" in st.note and "all.vars.recipe_overrides.engine.image" in st.note
    # the recipe file's own pair, untouched
    dep, st = build_of(spark4)
    assert [a.details["image"] for a in st.actions] == [dep.recipe.engine.image] and dep.recipe.engine.chain
