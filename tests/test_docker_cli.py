"""One `-H` rule: every docker command deployctl builds for a host is `docker -H <that host's engine>`.

The engine is the inventory's docker_host (default unix:///var/run/docker.sock), passed even when it
is the default, so preflight, build, ship, launch and health all target the same engine whatever
DOCKER_HOST the host's login sets (orchestrator/executors/docker_cli.py). Checked on the plans
(`deployctl up --dry-run --json`, each host's exact commands) of every recipe.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.executors.docker_cli import DEFAULT_ENGINE, docker_argv, docker_sh, engine
from orchestrator.inventory import Host
from orchestrator.executors.host_batch import HOST_READ
from orchestrator.launch.commands import list_argv, logs_argv, read_argv
from orchestrator.paths import INVENTORIES_DIR

ROOT = Path(__file__).resolve().parent.parent
# (inventory, recipe): every recipe in recipes/ with an inventory it fits
PAIRS = [("spark4.yml", "deepseek-v41-flash-tp4"), ("spark8.yml", "deepseek-v41-flash-tp8-mem"),
         ("spark8.yml", "deepseek-v41-flash-tp8-nvme"), ("rtx1.yml", "qwen38-flash-next-rtx"),
         ("spark1.yml", "qwen38-flash-next-spark"), ("local4.yml", None), ("local1.yml", None)]
DOCKER_WORD = re.compile(r"(?<![\w./-])docker(?=\s)")


def test_the_builder_always_passes_the_engine():
    assert Host.__dataclass_fields__["docker_host"].default == DEFAULT_ENGINE
    h = Host(name="n", address="10.0.0.1", rank=0, hardware="dgx-spark", gpus=1, nvme_dir="/n", model_cache="/m")
    assert docker_argv(h, "info") == ["docker", "-H", DEFAULT_ENGINE, "info"]      # the default too
    assert docker_argv("unix:///x y.sock", "ps") == ["docker", "-H", "unix:///x y.sock", "ps"]
    assert engine("") == DEFAULT_ENGINE
    assert docker_sh("unix:///a;b $(x).sock", "load") == "docker -H 'unix:///a;b $(x).sock' load"
    # launch's shell scripts: the engine is in the script quoted, every other value is "$N"
    bad = "unix:///a'b;$(touch /tmp/x).sock"
    for argv in (logs_argv(bad, "c", 5, follow=True),):
        assert argv[:2] == ["sh", "-c"] and bad not in argv
        assert all(m == shlex.quote(bad) for m in re.findall(r"docker -H ('[^']*'(?:\"'\"'[^']*')*)",
                                                              argv[2]))
        assert len(DOCKER_WORD.findall(argv[2])) == len(re.findall(r"docker -H ", argv[2])) > 0
    # what launch reads: no shell at all, the docker argv lists as JSON for hostside/host_read.py
    argv = read_argv(bad, "d", "img", "", "f", "s", "/e", "/p")
    assert argv[:2] == ["python3", "-c"] and len(argv) == 4
    spec = json.loads(argv[3])
    assert [spec[k][:3] for k in ("image_inspect", "ps", "inspect")] == [["docker", "-H", bad]] * 3
    assert spec["image_inspect"][-1] == "img" and spec["facts_args"] == [] and spec["staged_args"] == ["/e", "/p"]
    # the container list (health, status, down): the same program, its list form
    argv = list_argv(bad, "d")
    assert argv[:2] == ["python3", "-c"] and len(argv) == 4
    spec = json.loads(argv[3])
    assert spec["list"] is True and spec["engine"] == bad and spec["label"] == "deployctl.deployment=d"
    assert [spec[k][:3] for k in ("ps", "inspect")] == [["docker", "-H", bad]] * 2


def _dry_run(inv: Path, recipe: str | None) -> dict:
    p = subprocess.run([sys.executable, "-m", "orchestrator", "up", "-i", str(inv), *(["-r", recipe] if recipe else []),
                        "--dry-run", "--json"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _docker_calls(value, found: list[tuple[str, str]]) -> None:
    """Every docker invocation in VALUE (an argv list, a command line or a shell script, nested in
    lists and dicts): (the engine after -H or "" when there is none, where)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "container":             # the engine-independent container spec (its "docker_run")
                _docker_calls(v, found)
    elif isinstance(value, list):
        if value[:3] == ["python3", "-c", HOST_READ]:     # the host program: its docker argv lists are in SPEC
            _docker_calls(json.loads(value[3]), found)
        elif value and value[0] == "docker":
            found.append((value[2] if value[1:2] == ["-H"] else "", " ".join(value)[:120]))
        else:
            for v in value:
                _docker_calls(v, found)
    elif isinstance(value, str) and DOCKER_WORD.search(value):
        for m in DOCKER_WORD.finditer(value):
            rest = value[m.end():].lstrip()
            if not rest.startswith("-H "):
                found.append(("", value[m.start():m.start() + 120]))
                continue
            found.append((shlex.split(rest[3:], posix=True)[0] if rest[3:4] in "'\"" else rest[3:].split()[0],
                          value[m.start():m.start() + 120]))


def _check_plan(doc: dict, engines: dict[str, str], head: str) -> int:
    n = 0
    for stage in doc["stages"]:
        for a in stage["actions"]:
            found: list[tuple[str, str]] = []
            _docker_calls([a.get("command", []), a.get("api", ""), a.get("details", {})], found)
            allowed = {engines[a["host"]]} | ({engines[head]} if stage["name"] == "ship" else set())
            for eng, where in found:
                assert eng in allowed, f"{stage['name']} on {a['host']}: `{where}` does not target {allowed}"
            if stage["name"] == "ship":             # head's save, the worker's load
                assert [e for e, _ in found][-1] == engines[a["host"]] and engines[head] in [e for e, _ in found]
            n += len(found)
    return n


@pytest.mark.parametrize("inv,recipe", PAIRS)
def test_every_docker_command_of_every_recipe_carries_the_hosts_engine(inv, recipe):
    doc = _dry_run(INVENTORIES_DIR / inv, recipe)
    hosts = yaml.safe_load((INVENTORIES_DIR / inv).read_text())["all"]["hosts"]
    engines = {n: (v or {}).get("docker_host", DEFAULT_ENGINE) for n, v in hosts.items()}
    stages = {s["name"] for s in doc["stages"]}
    assert {"preflight", "launch"} <= stages
    assert _check_plan(doc, engines, doc["head"]) >= 2 * len(hosts)     # at least preflight + launch per host


def test_per_host_engines_including_the_default_and_unsafe_names(tmp_path):
    """spark4 with a different engine on each host (one the default, one needing quoting): each
    host's preflight, ship, launch and health commands name its own engine, quoted where shell."""
    doc = yaml.safe_load((INVENTORIES_DIR / "spark4.yml").read_text())
    names = list(doc["all"]["hosts"])
    odd = {names[1]: "unix:///run/e 2.sock", names[2]: "unix:///run/e'3;$(id).sock", names[3]: "tcp://10.9.9.4:2375"}
    for n, e in odd.items():
        doc["all"]["hosts"][n]["docker_host"] = e
    doc["all"]["hosts"][names[0]].pop("docker_host", None)            # the head keeps the default engine
    inv = tmp_path / "inv.yml"
    inv.write_text(yaml.safe_dump(doc))
    plan = _dry_run(inv, None)
    engines = {names[0]: DEFAULT_ENGINE, **odd}
    assert _check_plan(plan, engines, plan["head"]) > 0
    pre = {a["host"]: a for a in next(s for s in plan["stages"] if s["name"] == "preflight")["actions"]}
    assert pre[names[0]]["details"]["commands"]["docker"][0][:3] == ["docker", "-H", DEFAULT_ENGINE]
    assert shlex.quote(odd[names[2]]) in pre[names[2]]["api"]
    launch = {a["host"]: a for a in next(s for s in plan["stages"] if s["name"] == "launch")["actions"]}
    assert all(launch[n]["command"][:3] == ["docker", "-H", e] for n, e in engines.items())
