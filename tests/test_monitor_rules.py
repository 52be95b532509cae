"""#36: every alert rule deployctl ships, run by the real Prometheus rule engine (`promtool test rules`)
on synthetic series: each rule with a case where it fires (its labels and annotations exact) and one
where it does not. The thresholds are series as thresholds.py records them. Plus the pure parts of
`monitor config` (targets, thresholds, merge) and its refusal to write what promtool refuses."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator.monitor import alerts, promconfig, thresholds
from orchestrator.monitor.write import CONFIG, dump, write_folder

PROMTOOL = shutil.which("promtool") or "promtool"      # Debian's prometheus, installed by .ci/setup

D = 'deployment="a"'
ENG = f'{{job="deployctl-engine",instance="n1:8000",{D},host="n1"}}'
SUP = f'{{job="deployctl-supervisor",instance="n1:8790",{D},host="n1"}}'
NODE = f'{{job="node",instance="n1:9100",{D},host="n1"}}'
ROUTER = '{job="deployctl-router",instance="n1:29000",router="n1"}'
GIB = 1024 ** 3

# rule -> (input series, eval time, labels of the alert when it fires (besides alertname, severity))
# and the same rule's quiet case: (input series, eval time)
CASES: dict[str, tuple[list[tuple[str, str]], str, list[dict[str, str]], list[tuple[str, str]], str]] = {
    "DeployctlEngineDown": (
        [(f"up{ENG}", "1 1 0x8")], "2m", [{"job": "deployctl-engine", "instance": "n1:8000", "deployment": "a", "host": "n1"}],
        [(f"up{ENG}", "1 1 0 0 1x6")], "2m"),        # down for 30 s only: under the rule's for: 1m
    "DeployctlEngineNotReady": (
        [(f'deployctl_probe_ok{{{D},probe="health"}}', "0x20")], "4m", [{"deployment": "a", "probe": "health"}],
        [(f'deployctl_probe_ok{{{D},probe="health"}}', "0x8 1x12")], "4m"),
    "DeployctlEngineWedged": (
        [(f'deployctl_probe_ok{{{D},probe="health"}}', "1x12"), (f'deployctl_probe_ok{{{D},probe="completion"}}', "0x12")],
        "3m", [{"deployment": "a", "probe": "completion"}],
        [(f'deployctl_probe_ok{{{D},probe="health"}}', "0x12"), (f'deployctl_probe_ok{{{D},probe="completion"}}', "0x12")],
        "3m"),                                       # nothing answers: EngineNotReady's case, not a wedge
    "DeployctlRestartsInWindow": (
        [(f"deployctl_restarts_total{{{D}}}", "0 0 1 1 2 2")], "75s", [{"deployment": "a"}],
        [(f"deployctl_restarts_total{{{D}}}", "0 0 0 0 1 1")], "75s"),
    "DeployctlSupervisorGaveUp": (
        [(f'deployctl_supervisor_state{{{D},state="failed"}}', "0 1")], "15s", [{"deployment": "a", "state": "failed"}],
        [(f'deployctl_supervisor_state{{{D},state="failed"}}', "0 0")], "15s"),
    "DeployctlSupervisorDown": (
        [(f"up{SUP}", "0x10")], "2m", [{"job": "deployctl-supervisor", "instance": "n1:8790", "deployment": "a", "host": "n1"}],
        [(f"up{SUP}", "1x10")], "2m"),
    "DeployctlRouterDown": (
        [(f"up{ROUTER}", "1 1 0x8")], "2m", [{"job": "deployctl-router", "instance": "n1:29000", "router": "n1"}],
        [(f"up{ROUTER}", "1 1 0 0 1x6")], "2m"),
    "DeployctlRequestsQueued": (
        [(f'vllm:num_requests_waiting{{{D},engine="0",model_name="m"}}', "9x30"), (f"deployctl:queue_bound{{{D}}}", "8x30")],
        "6m", [{"deployment": "a"}],
        [(f'vllm:num_requests_waiting{{{D},engine="0",model_name="m"}}', "8x30"), (f"deployctl:queue_bound{{{D}}}", "8x30")],
        "6m"),
    "DeployctlKVCacheNearFull": (
        [(f'sglang:token_usage{{{D},model_name="m"}}', "0.97x30")], "6m", [{"deployment": "a"}],
        [(f'vllm:kv_cache_usage_perc{{{D},engine="0",model_name="m"}}', "0.9x30")], "6m"),
    "DeployctlNodeMemoryLow": (
        [(f"node_memory_MemAvailable_bytes{NODE}", f"{3 * GIB}x10"), (f'deployctl:mem_floor_bytes{{{D},host="n1"}}', f"{4 * GIB}x10")],
        "2m", [{"job": "node", "instance": "n1:9100", "deployment": "a", "host": "n1", "__name__": "node_memory_MemAvailable_bytes"}],
        [(f"node_memory_MemAvailable_bytes{NODE}", f"{5 * GIB}x10"), (f'deployctl:mem_floor_bytes{{{D},host="n1"}}', f"{4 * GIB}x10")],
        "2m"),
    "DeployctlMemoryAbovePlan": (
        [(f"node_memory_MemTotal_bytes{NODE}", "128e9x50"), (f"node_memory_MemAvailable_bytes{NODE}", "8e9x50"),
         (f'deployctl:planned_memory_bytes{{{D},host="n1"}}', "100e9x50")],
        "11m", [{"job": "node", "instance": "n1:9100", "deployment": "a", "host": "n1"}],
        [(f"node_memory_MemTotal_bytes{NODE}", "128e9x50"), (f"node_memory_MemAvailable_bytes{NODE}", "20e9x50"),
         (f'deployctl:planned_memory_bytes{{{D},host="n1"}}', "100e9x50")],
        "11m"),                                      # 108 GB used against 100 planned: within 10 %
    "DeployctlNVMeLow": (
        [(f'deployctl_host_disk_avail_bytes{{{D},host="n1",rank="0"}}', "1e9x30"), (f'deployctl:staging_need_bytes{{{D},host="n1"}}', "5e9x30")],
        "6m", [{"deployment": "a", "host": "n1", "rank": "0", "__name__": "deployctl_host_disk_avail_bytes"}],
        [(f'deployctl_host_disk_avail_bytes{{{D},host="n1",rank="0"}}', "6e9x30"), (f'deployctl:staging_need_bytes{{{D},host="n1"}}', "5e9x30")],
        "6m"),
    "DeployctlFabricSlower": (
        [(f'node_network_speed_bytes{{job="node",instance="n1:9100",{D},host="n1",device="enp1s0f0np0"}}', "12.5e9x10"),
         (f'deployctl:fabric_speed_bytes{{{D},host="n1",device="enp1s0f0np0"}}', "25e9x10")],
        "2m", [{"job": "node", "instance": "n1:9100", "deployment": "a", "host": "n1", "device": "enp1s0f0np0",
                "__name__": "node_network_speed_bytes"}],
        [(f'node_network_speed_bytes{{job="node",instance="n1:9100",{D},host="n1",device="enp1s0f0np0"}}', "25e9x10"),
         (f'node_network_speed_bytes{{job="node",instance="n1:9100",{D},host="n1",device="eth0"}}', "1.25e9x10"),
         (f'deployctl:fabric_speed_bytes{{{D},host="n1",device="enp1s0f0np0"}}', "25e9x10")],
        "2m"),                                       # the management port is slow, the fabric is not
}


def _expand(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


def _tests() -> list[dict]:
    rules = {r["alert"]: r for r in alerts.RULES}
    out = []
    for name, (series, at, firing, quiet, quiet_at) in CASES.items():
        r = rules[name]
        exp = []
        for lab in firing:
            lab = {k: v for k, v in lab.items() if k != "__name__"}     # an alert drops the metric name
            exp.append({"exp_labels": {**lab, "severity": r["labels"]["severity"]},
                        "exp_annotations": {k: _expand(v, lab) for k, v in r["annotations"].items()}})
        out.append({"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in series],
                    "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": exp}]})
        out.append({"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in quiet],
                    "alert_rule_test": [{"eval_time": quiet_at, "alertname": name, "exp_alerts": []}]})
    return out


def test_every_alert_rule_fires_and_stays_quiet_in_the_real_rule_engine(tmp_path):
    assert set(CASES) == {r["alert"] for r in alerts.RULES}, "every rule has its cases"
    (tmp_path / "alerts.yml").write_text(dump(alerts.document()))
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(
        {"rule_files": ["alerts.yml"], "evaluation_interval": "15s", "tests": _tests()}, sort_keys=False))
    p = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "alerts.yml")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    p = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "alerts_test.yml")], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "SUCCESS" in p.stdout + p.stderr


def test_a_wrong_expectation_fails_the_rule_test(tmp_path):
    """The harness can fail: a firing case expected quiet is reported by promtool."""
    t = _tests()
    t[0]["alert_rule_test"][0]["exp_alerts"] = []
    (tmp_path / "alerts.yml").write_text(dump(alerts.document()))
    (tmp_path / "t.yml").write_text(yaml.safe_dump({"rule_files": ["alerts.yml"], "tests": t[:1]}))
    p = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "t.yml")], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "DeployctlEngineDown" in p.stdout + p.stderr


# ---------------------------------------------------------------------------- the generated files

@pytest.fixture
def dep(tmp_path):
    from orchestrator.deployment import load_deployment
    return load_deployment(str(Path(__file__).resolve().parent.parent / "inventories" / "local4.yml"), None, ())


def test_targets_label_every_host_and_rank(dep):
    t = promconfig.targets(dep, 7)
    (eng,) = t["deployctl-engine"]
    head = dep.cluster.head_host
    assert eng["targets"] == [f"{head.address}:{dep.api_port}"]
    assert eng["labels"] == {"deployment": dep.name, "host": head.name, "rank": "0", "release": "7",
                             "model": dep.recipe.engine.served_name, "engine": "vllm"}
    assert [(g["targets"][0], g["labels"]["host"], g["labels"]["rank"]) for g in t["node"]] == \
        [(f"{h.address}:9100", h.name, str(h.rank)) for h in dep.cluster.hosts]
    assert t["deployctl-supervisor"][0]["targets"] == [f"{head.address}:{dep.recipe.supervise.port}"]
    assert "release" not in promconfig.targets(dep, None)["node"][0]["labels"]


def test_thresholds_come_from_the_plan(dep):
    from orchestrator import sizing
    recs = thresholds.rules(dep, {"report": {"hosts": [{"host": dep.cluster.hosts[1].name, "iface": "fab0",
                                                        "speed_mbps": 200000}]}})
    by = {}
    for r in recs:
        by.setdefault(r["record"], []).append(r)
    assert by["deployctl:queue_bound"][0]["expr"] == "vector(8.0)"        # the recipe's max-num-seqs
    s = sizing.size(dep)
    need = sum(gb for _, gb in s.node(dep.cluster.hosts[0].name).nvme_needs())
    assert by["deployctl:staging_need_bytes"][0]["expr"] == f"vector({float(round(need * 1e9))!r})" and need > 0
    assert len(by["deployctl:planned_memory_bytes"]) == len(dep.cluster.hosts)
    (f,) = by["deployctl:fabric_speed_bytes"]
    assert f["labels"] == {"deployment": dep.name, "host": dep.cluster.hosts[1].name, "device": "fab0"}
    assert f["expr"] == "vector(25000000000.0)"                            # 200 Gb/s in bytes/s
    assert "deployctl:mem_floor_bytes" not in by                           # supervise.mem_floor_gib is 0


def test_merge_keeps_the_operators_jobs_and_replaces_ours():
    mine = promconfig.document("15s", "15s")
    existing = {"global": {"scrape_interval": "1m"}, "rule_files": ["/etc/prometheus/mine.yml", "/x/rules/*.yml"],
                "scrape_configs": [{"job_name": "other", "static_configs": [{"targets": ["a:1"]}]},
                                   {"job_name": "node", "static_configs": [{"targets": ["old:9100"]}]}]}
    m = promconfig.merge(existing, mine, "/x")
    assert m["global"] == {"scrape_interval": "1m"}
    assert [j["job_name"] for j in m["scrape_configs"]] == ["other", *promconfig.JOBS]
    node = next(j for j in m["scrape_configs"] if j["job_name"] == "node")
    assert node["file_sd_configs"] == [{"files": ["/x/targets/node-*.json"]}]
    assert m["rule_files"] == ["/etc/prometheus/mine.yml", "/x/rules/*.yml"]


def test_a_config_promtool_refuses_writes_nothing(tmp_path):
    from orchestrator.errors import StageFailed
    out = tmp_path / "mon"
    good = {CONFIG: dump(promconfig.document("15s", "15s")), "rules/deployctl-alerts.yml": dump(alerts.document())}
    write_folder(out, good, PROMTOOL)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    bad = dict(good, **{"rules/thresholds-x.yml": dump({"groups": [{"name": "x", "rules": [
        {"record": "deployctl:x", "expr": "vector(1"}]}]})})
    with pytest.raises(StageFailed, match="promtool check config refused"):
        write_folder(out, bad, PROMTOOL)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "no scratch folder left"


def test_monitor_config_cli_without_promtool_is_a_clear_error(tmp_path):
    p = subprocess.run(["deployctl", "monitor", "config", "--promtool", "/nonexistent/promtool", "--out",
                        str(tmp_path / "m")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--promtool" in p.stderr and "apt install prometheus" in p.stderr
    assert not (tmp_path / "m").exists()
