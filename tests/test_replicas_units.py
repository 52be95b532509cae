"""Replicas (#58): one deployment as N groups behind the router, changed one at a time (pure parts):
group splitting, each replica an ordinary deployment (its own head, ranks, ports, sizing, colocation),
the plan shows each group, the rolling order and the drain's reading of the engine's /metrics."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.inventory import InventoryRef, deployment_names, load_inventory, replica_names, split_groups

from tests.test_deployments_units import TP2, _hosts, _write


def test_hosts_split_into_groups_in_order():
    assert split_groups(["a", "b", "c", "d"], 2) == [["a", "b"], ["c", "d"]]
    assert split_groups(["a", "b", "c", "d"], 4) == [["a"], ["b"], ["c"], ["d"]]
    with pytest.raises(ValueError):
        split_groups(["a", "b", "c"], 2)


def test_replicas_are_ordinary_deployments_named_by_index(tmp_path):
    inv = _write(tmp_path, {"llm": {"hosts": ["node1", "node2", "node3", "node4"], "replicas": 2,
                                    "recipe": "vllm-cpu", "api_port": 18010, "recipe_overrides": TP2}})
    assert deployment_names(inv) == ["llm.r1", "llm.r2"]
    assert replica_names(inv, "llm") == ["llm.r1", "llm.r2"] and replica_names(inv, "llm.r1") is None
    r1, r2 = load_inventory(inv, "llm.r1"), load_inventory(inv, "llm.r2")
    assert [(h.name, h.rank) for h in r1.hosts] == [("node1", 0), ("node2", 1)] and r1.head == "node1"
    assert [(h.name, h.rank) for h in r2.hosts] == [("node3", 0), ("node4", 1)] and r2.head == "node3"
    assert r1.replica == ("llm", 1, 2) and r2.siblings == ("llm.r1",) and r2.replica_set == "llm"
    d1, d2 = load_deployment(InventoryRef.of(inv, "llm.r1")), load_deployment(InventoryRef.of(inv, "llm.r2"))
    assert d1.recipe.engine.served_name == d2.recipe.engine.served_name      # one model behind the router
    assert d1.recipe.parallelism.tensor_parallel == 2 and d1.api_url != d2.api_url


def test_explicit_groups_and_the_single_deployment_form(tmp_path):
    inv = _write(tmp_path, {"llm": {"groups": [["node4"], ["node2"]], "recipe": "vllm-cpu", "api_port": 18010},
                            "other": {"hosts": ["node1"], "recipe": "vllm-cpu", "api_port": 18011}})
    assert deployment_names(inv) == ["llm.r1", "llm.r2", "other"]
    assert load_inventory(inv, "llm.r1").head == "node4" and load_inventory(inv, "llm.r2").head == "node2"
    assert load_inventory(inv, "other").peers == ("llm.r1", "llm.r2")
    hosts = {n: {**h, "rank": i} for i, (n, h) in enumerate(_hosts(2).items())}
    p = tmp_path / "single.yml"
    p.write_text(yaml.safe_dump({"all": {"vars": {"deployment": "one", "head": "node1", "recipe": "vllm-cpu",
                                                  "replicas": 2}, "hosts": hosts}}))
    assert deployment_names(p) == ["one.r1", "one.r2"]
    c = load_inventory(InventoryRef.of(p, "one.r2"))
    assert c.name == "one.r2" and c.head == "node2" and [h.rank for h in c.hosts] == [0]
    assert load_deployment(InventoryRef.of(p, "one.r1")).name == "one.r1"


def test_one_replica_is_the_deployment_unchanged(tmp_path):
    inv = _write(tmp_path, {"llm": {"hosts": ["node1"], "replicas": 1, "recipe": "vllm-cpu", "api_port": 18010}})
    assert deployment_names(inv) == ["llm"] and load_inventory(inv, "llm").replica is None


@pytest.mark.parametrize("entry,key,words", [
    ({"hosts": ["node1", "node2", "node3"], "replicas": 2}, "replicas", "do not split"),
    ({"hosts": ["node1", "node2"], "replicas": 0}, "replicas", "count of copies"),
    ({"groups": [["node1"], ["node1"]]}, "groups", "two groups"),
    ({"groups": [["node1", "node2"], ["node3"]]}, "groups", "differ in size"),
    ({"hosts": ["node1", "node2"], "replicas": 2, "head": "node2"}, "head", "first host"),
    ({"hosts": ["node1", "node2"], "groups": [["node1"], ["node3"]]}, "groups", "exactly"),
])
def test_bad_replicas_name_their_key(tmp_path, entry, key, words):
    inv = _write(tmp_path, {"llm": {"recipe": "vllm-cpu", **entry}})
    with pytest.raises(InputError) as e:
        load_inventory(inv, "llm.r1")
    assert e.value.key == f"all.vars.deployments.llm.{key}" and words in str(e.value), str(e.value)


def test_the_set_name_points_at_its_replicas_and_sizing_checks_each_group(tmp_path):
    inv = _write(tmp_path, {"llm": {"hosts": ["node1", "node2"], "replicas": 2, "recipe": "vllm-cpu",
                                    "api_port": 18010}})
    with pytest.raises(InputError, match=r"runs as 2 replicas \(llm.r1, llm.r2\)"):
        load_inventory(inv, "llm")
    # a group of one host for a TP=2 recipe: the recipe's node count is checked per group
    with pytest.raises(InputError, match="needs 2 node"):
        load_deployment(InventoryRef.of(inv, "llm.r1"), sets=("parallelism.tensor_parallel=2", "parallelism.nodes=2"))


def test_the_plan_shows_each_group(tmp_path):
    import subprocess
    import sys
    from orchestrator.stages import build_plan
    inv = _write(tmp_path, {"llm": {"hosts": ["node1", "node2"], "replicas": 2, "recipe": "vllm-cpu",
                                    "api_port": 18010}})
    doc = build_plan(load_deployment(InventoryRef.of(inv, "llm.r2"))).to_json()
    assert doc["replica"] == {"of": "llm", "index": 2, "count": 2} and [h["name"] for h in doc["hosts"]] == ["node2"]
    p = subprocess.run([sys.executable, "-m", "orchestrator", "plan", "-i", str(inv), "-d", "llm"],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr
    assert "replica 1 of 2 of llm: group node1" in p.stdout and "replica 2 of 2 of llm: group node2" in p.stdout


# -- the router: every replica one worker of the model, cache_aware for it (docs/router.md) -------------

def test_each_replica_is_a_worker_of_the_one_model_with_its_policy(tmp_path):
    from orchestrator.hostside import router_keeper as rk
    from orchestrator.router import layout
    inv = _write(tmp_path, {"llm": {"hosts": ["node1", "node2"], "replicas": 2, "recipe": "vllm-cpu",
                                    "api_port": 18010}, "solo": {"hosts": ["node3"], "recipe": "vllm-cpu",
                                                                 "api_port": 18011}},
                 router={"host": "node3", "port": 18030})
    w1, w2 = (layout.worker(load_deployment(InventoryRef.of(inv, n))) for n in ("llm.r1", "llm.r2"))
    solo = layout.worker(load_deployment(InventoryRef.of(inv, "solo")))
    assert w1["model"] == w2["model"] and w1["url"] != w2["url"]
    assert w1["policy"] == "cache_aware" and w1["replica_of"] == "llm" and "policy" not in solo
    assert rk.registration(w1) == {"url": w1["url"], "model_id": w1["model"], "labels": {"policy": "cache_aware"}}
    assert rk.registration(solo) == {"url": solo["url"], "model_id": solo["model"]}
    # both registered while healthy; one unhealthy (its supervisor restarting it): deleted, back when healthy
    reg = [{"id": "1", "url": w1["url"], "model_id": w1["model"]}, {"id": "2", "url": w2["url"], "model_id": w2["model"]}]
    posted = {w1["url"]: rk.fingerprint(w1), w2["url"]: rk.fingerprint(w2)}
    assert rk.changes([w1, w2], {w1["url"]: True, w2["url"]: True}, reg, posted) == ([], [])
    assert rk.changes([w1, w2], {w1["url"]: True, w2["url"]: False}, reg, posted) == (["2"], [])
    assert rk.changes([w1, w2], {w1["url"]: True, w2["url"]: True}, reg[:1], posted) == ([], [w2])
    assert rk.fingerprint(w1) != rk.fingerprint({k: v for k, v in w1.items() if k != "policy"})


# -- the roll: order, the drain's reading of the engine's own gauge ------------------------------------

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-llama"} 5.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-llama"} 7.0
"""


def test_in_flight_and_served_come_from_the_engines_own_metrics():
    from orchestrator.rolling import requests_in_flight, requests_served
    assert requests_in_flight(VLLM_METRICS) == 4.0 and requests_served(VLLM_METRICS) == 12.0
    assert requests_in_flight("sglang:num_running_reqs{x=\"1\"} 2\nsglang:num_queue_reqs 0\n") == 2.0
    assert requests_in_flight("# nothing here\nother 3\n") is None and requests_served("") is None


def test_the_drain_waits_for_zero_within_its_bound():
    from orchestrator.rolling import drain
    t = [0.0]
    readings = iter([3, 2, 0])
    ok, what = drain(lambda: next(readings), bound_s=10, poll_s=1, clock=lambda: t[0],
                     sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert ok and "drained in 2.0s (3 request(s) in flight at first)" == what
    t[0] = 0.0
    ok, what = drain(lambda: 1, bound_s=5, poll_s=1, clock=lambda: t[0], sleep=lambda s: t.__setitem__(0, t[0] + s))
    assert not ok and "still in flight after 5s" in what
    assert drain(lambda: None) == (True, "no in-flight gauge could be read: not waited")
    assert drain(lambda: 0) == (True, "nothing in flight")


def test_the_roll_goes_by_index_and_up_rolls_a_replicated_deployment(tmp_path):
    from orchestrator.cli.roll_flow import replicas_to_roll
    from orchestrator.rolling import roll_order
    assert roll_order(["m.r10", "m.r2", "m.r1"]) == ["m.r1", "m.r2", "m.r10"]
    inv = _write(tmp_path, {"llm": {"hosts": ["node1", "node2"], "replicas": 2, "recipe": "vllm-cpu",
                                    "api_port": 18010}})
    assert replicas_to_roll(InventoryRef.of(inv, "llm")) == ("llm", ["llm.r1", "llm.r2"])
    assert replicas_to_roll(InventoryRef.of(inv, None)) == ("llm", ["llm.r1", "llm.r2"])
    assert replicas_to_roll(InventoryRef.of(inv, "llm.r2")) is None          # one replica's own up
    two = _write(tmp_path, {"a": {"hosts": ["node1"], "recipe": "vllm-cpu"}, "b": {"hosts": ["node2"], "recipe": "vllm-cpu"}})
    assert replicas_to_roll(InventoryRef.of(two, None)) is None


def test_requests_per_replica_between_two_readings():
    from orchestrator.rolling import per_replica
    assert per_replica({"m.r1": 10.0, "m.r2": 4.0}, {"m.r1": 30.0, "m.r2": 25.0}) == {"m.r1": 20.0, "m.r2": 21.0}
    # unreadable, or restarted in between (its counter went back): unknown, never a negative count
    assert per_replica({"m.r1": None, "m.r2": 40.0}, {"m.r1": 3.0, "m.r2": 2.0}) == {"m.r1": None, "m.r2": None}


def test_the_demo_writes_a_two_replica_inventory(tmp_path):
    """`python -m tests.cluster demo --routed` also writes replicas.yml (README): it loads as 2 replicas."""
    from types import SimpleNamespace
    from tests.cluster.demo import replicas_data
    hosts = [SimpleNamespace(name=f"node{i}", number=i, rank=i - 1, address=f"10.9.9.{i}", ssh_port=22,
                             fabric_cidr=f"10.8.8.{i}/24", nvme_dir=f"/n{i}", model_cache=f"/m{i}",
                             docker_host="unix:///var/run/docker.sock", emulated=False) for i in (1, 2, 3)]
    (tmp_path / "router.key").write_text("sk-demo-router-0123456789\n")
    p = tmp_path / "replicas.yml"
    p.write_text(yaml.safe_dump(replicas_data("demo", hosts, "http://10.9.9.3:8088", str(tmp_path / "router.key"))))
    assert deployment_names(p) == ["llm.r1", "llm.r2"]
    r2 = load_deployment(InventoryRef.of(p, "llm.r2"))
    assert r2.cluster.head == "node3" and r2.recipe.parallelism.tensor_parallel == 1 and r2.cluster.router
