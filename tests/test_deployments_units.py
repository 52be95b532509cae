"""Several deployments in one inventory (all.vars.deployments): each command's view of one of them, and
what cannot work together refused before any host is touched (orchestrator/inventory.py,
orchestrator/colocation.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.inventory import InventoryRef, deployment_names, load_inventory

REPO = Path(__file__).resolve().parents[1]


def _hosts(n: int, hardware: str = "cpu", gpus: int | None = None) -> dict:
    return {f"node{i}": {"ansible_host": f"10.0.0.{i}", "hardware": hardware, "nvme_dir": "/nvme",
                         "model_cache": "/models", **({"gpus": gpus} if gpus is not None else {})}
            for i in range(1, n + 1)}


def _write(tmp_path: Path, deployments: dict, hosts: dict | None = None, **cvars) -> Path:
    doc = {"all": {"vars": {"deployments": deployments, **cvars}, "hosts": hosts or _hosts(4)}}
    p = tmp_path / "multi.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


TP2 = {"parallelism.tensor_parallel": 2, "parallelism.nodes": 2}
THREE = {
    "big": {"hosts": ["node1", "node2"], "recipe": "vllm-cpu", "api_port": 18010, "recipe_overrides": TP2},
    "small": {"hosts": ["node3"], "recipe": "vllm-cpu", "api_port": 18011},
    "double": {"hosts": ["node4"], "recipe": "vllm-cpu", "api_port": 18012},
}


def test_each_deployment_is_a_view_of_its_hosts(tmp_path):
    inv = _write(tmp_path, THREE)
    assert deployment_names(inv) == ["big", "small", "double"]
    big = load_inventory(inv, "big")
    assert big.name == "big" and big.head == "node1" and big.api_port == 18010
    assert [(h.name, h.rank) for h in big.hosts] == [("node1", 0), ("node2", 1)]
    assert big.peers == ("small", "double")
    small = load_inventory(InventoryRef.of(inv, "small"))          # what --deployment hands a command
    assert [(h.name, h.rank) for h in small.hosts] == [("node3", 0)] and small.head == "node3"
    dep = load_deployment(InventoryRef.of(inv, "big"))
    assert dep.recipe.parallelism.tensor_parallel == 2 and dep.api_port == 18010
    assert load_deployment(InventoryRef.of(inv, "double")).recipe.parallelism.tensor_parallel == 1


def test_the_head_is_rank_zero_wherever_it_is_listed(tmp_path):
    inv = _write(tmp_path, {"big": {**THREE["big"], "head": "node2"}, "small": THREE["small"]})
    big = load_inventory(inv, "big")
    assert big.head == "node2" and [(h.name, h.rank) for h in big.hosts] == [("node2", 0), ("node1", 1)]


@pytest.mark.parametrize("deps, name, key, words", [
    (THREE, None, "all.vars.deployments", "holds 3 deployments (big, small, double): pick one with --deployment"),
    (THREE, "nope", "all.vars.deployments", "no deployment 'nope' here (deployments: big, small, double)"),
    ({"a": {"hosts": ["node9"], "recipe": "vllm-cpu"}}, None, "all.vars.deployments.a.hosts",
     "'node9' is not a host of this inventory"),
    ({"a": {"hosts": "node1", "recipe": "vllm-cpu"}}, None, "all.vars.deployments.a.hosts",
     "expected a list of this inventory's host names"),
    ({"a": {"hosts": ["node1"], "recipe": "vllm-cpu", "fabric_topology": "mesh"}}, None,
     "all.vars.deployments.a.fabric_topology", "unknown key 'fabric_topology' (a deployment sets: hosts"),
    ({"a": {"hosts": ["node1"], "head": "node2", "recipe": "vllm-cpu"}}, None, "all.vars.deployments.a.head",
     "head 'node2' is not one of this deployment's hosts"),
])
def test_bad_deployments_name_the_key(tmp_path, deps, name, key, words):
    with pytest.raises(InputError) as e:
        load_inventory(_write(tmp_path, deps), name)
    assert e.value.key == key and words in str(e.value), str(e.value)
    assert e.value.exit_code == 2


@pytest.mark.parametrize("entry, key, words", [
    ({"hosts": ["node1", "node2"], "recipe": "vllm-cpu"}, "all.vars.deployments.a.hosts",
     "recipe vllm-cpu needs 1 node(s)"),
    ({"hosts": ["node1"], "recipe": "no-such-recipe"}, "all.vars.deployments.a.recipe", "no-such-recipe"),
    ({"hosts": ["node1"], "recipe": "recipes/nope.yml"}, "all.vars.deployments.a.recipe", "no recipe file"),
    ({"hosts": ["node1"]}, "all.vars.deployments.a.recipe", "set all.vars.deployments.a.recipe"),
])
def test_a_deployments_recipe_errors_name_its_own_keys(tmp_path, entry, key, words):
    """What does not fit between a deployment's recipe and its hosts names that deployment's entry,
    not all.vars.recipe or all.hosts (where a one-deployment inventory has them)."""
    with pytest.raises(InputError) as e:
        load_deployment(InventoryRef.of(_write(tmp_path, {"a": entry}), "a"))
    assert e.value.key == key and words in str(e.value), (e.value.key, str(e.value))
    assert e.value.exit_code == 2


def test_a_rank_or_a_cluster_wide_head_is_refused_beside_deployments(tmp_path):
    hosts = _hosts(4)
    hosts["node2"]["rank"] = 1
    with pytest.raises(InputError, match="a host's rank is its place in each deployment's hosts list"):
        load_inventory(_write(tmp_path, THREE, hosts), "big")
    with pytest.raises(InputError, match="head belongs to each deployment"):
        load_inventory(_write(tmp_path, THREE, head="node1"), "big")


def test_a_one_deployment_inventory_is_unchanged(tmp_path):
    inv = REPO / "inventories" / "spark4.yml"
    c = load_inventory(inv)
    assert c.peers == () and load_inventory(InventoryRef.of(inv, c.name)) == c
    with pytest.raises(InputError, match="this inventory describes one deployment"):
        load_inventory(InventoryRef.of(inv, "other"))


def _refusal(inv: Path, name: str) -> str:
    with pytest.raises(InputError) as e:
        load_deployment(InventoryRef.of(inv, name))
    assert e.value.exit_code == 2 and e.value.key == f"all.vars.deployments.{name}"
    return str(e.value)


def test_port_clashes_on_a_shared_head_are_refused_naming_both(tmp_path):
    deps = {"a": {"hosts": ["node1"], "recipe": "vllm-cpu", "api_port": 18010},
            "b": {"hosts": ["node1"], "recipe": "vllm-cpu", "api_port": 18010}}
    msg = _refusal(_write(tmp_path, deps, hosts=_hosts(1)), "b")
    assert "node1: port 18010 is the API of deployment a and the API of deployment b" in msg, msg
    # another API port: the supervisors still share supervise.port on the head
    deps["b"]["api_port"] = 18011
    msg = _refusal(_write(tmp_path, deps, hosts=_hosts(1)), "a")
    assert "port 8790 is the supervisor (supervise.port) of deployment a and the supervisor" in msg, msg
    deps["b"]["recipe_overrides"] = {"supervise.port": 8791}
    assert load_deployment(InventoryRef.of(_write(tmp_path, deps, hosts=_hosts(1)), "a")).name == "a"


def test_two_deployments_on_one_gpu_are_refused(tmp_path):
    hosts = _hosts(2, "dgx-spark", gpus=1)
    deps = {"a": {"hosts": ["node1"], "recipe": "qwen38-flash-next-spark", "api_port": 18010},
            "b": {"hosts": ["node1"], "recipe": "qwen38-flash-next-spark", "api_port": 18011,
                  "recipe_overrides": {"supervise.port": 8791, "ple.subdir": "ple-b"}}}
    msg = _refusal(_write(tmp_path, deps, hosts=hosts), "a")
    assert "node1: deployments a and b need 1 + 1 = 2 GPU(s) there; the host has 1" in msg, msg


def test_summed_memory_beyond_a_shared_node_is_refused_naming_both(tmp_path):
    """Two Qwen deployments on one 2-GPU Spark-like host: each fits alone, together they need twice
    the unified memory the host has."""
    hosts = _hosts(1, "dgx-spark", gpus=2)
    deps = {"a": {"hosts": ["node1"], "recipe": "qwen38-flash-next-spark", "api_port": 18010},
            "b": {"hosts": ["node1"], "recipe": "qwen38-flash-next-spark", "api_port": 18011,
                  "recipe_overrides": {"supervise.port": 8791, "ple.subdir": "ple-b"}}}
    msg = _refusal(_write(tmp_path, deps, hosts=hosts), "b")
    assert "node1: deployments a and b together need" in msg and "of unified memory; the host has" in msg, msg
    assert "short by" in msg


def test_two_deployments_staging_into_one_folder_are_refused(tmp_path):
    hosts = _hosts(1, "dgx-spark", gpus=2)
    deps = {"a": {"hosts": ["node1"], "recipe": "qwen38-flash-next-spark", "api_port": 18010},
            "b": {"hosts": ["node1"], "recipe": "qwen38-flash-next-spark", "api_port": 18011,
                  "recipe_overrides": {"supervise.port": 8791}}}
    msg = _refusal(_write(tmp_path, deps, hosts=hosts), "a")
    assert "deployment a stages its PLE table and deployment b its PLE table into the same folder /nvme/" in msg, msg


def test_the_cli_takes_deployment(tmp_path):
    inv = _write(tmp_path, THREE)
    p = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "-i", str(inv), "-d", "small", "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([sys.executable, "-m", "orchestrator", "health", "-i", str(inv)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode == 2 and "pick one with --deployment NAME" in p.stderr, p.stderr


def _dctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_plan_without_deployment_plans_every_one(tmp_path):
    import json
    inv = _write(tmp_path, THREE)
    p = _dctl("plan", "-i", str(inv), "--json")
    assert p.returncode == 0, p.stderr
    plans = json.loads(p.stdout)["deployments"]
    assert [d["deployment"] for d in plans] == ["big", "small", "double"]
    p = _dctl("plan", "-i", str(inv), "--check")
    assert p.returncode == 2 and "--check acts on one deployment: add --deployment NAME" in p.stderr, p.stderr


def test_down_all_asks_first_and_down_works_beside_a_clash(tmp_path):
    inv = _write(tmp_path, THREE)
    p = _dctl("down", "-i", str(inv), "--all")                  # no terminal to ask on: refused, nothing done
    assert p.returncode == 2 and "confirm with --yes" in p.stderr, p.stderr
    p = _dctl("down", "-i", str(inv), "--all", "--dry-run")
    assert p.returncode == 0 and all(f"label deployctl.supervisor={n}" in p.stdout for n in THREE), p.stdout
    # deployments that clash are refused by plan and up, never by down: it must stop what runs
    deps = {"a": {"hosts": ["node1"], "recipe": "vllm-cpu", "api_port": 18010},
            "b": {"hosts": ["node1"], "recipe": "vllm-cpu", "api_port": 18010}}
    clash = _write(tmp_path, deps, hosts=_hosts(1))
    assert _dctl("plan", "-i", str(clash), "-d", "a").returncode == 2
    p = _dctl("down", "-i", str(clash), "-d", "a", "--dry-run")
    assert p.returncode == 0 and "down on 1 host(s)" in p.stdout, p.stdout + p.stderr
