"""The alert rules deployctl ships (rules/deployctl-alerts.yml), the same for every deployment: their
thresholds are series (orchestrator/monitor/thresholds.py), so one rule file serves every recipe.

Metric names are the released engines': vLLM's vllm/v1/metrics/loggers.py (PrometheusStatLogger:
vllm:num_requests_waiting, vllm:kv_cache_usage_perc, labels model_name and engine), SGLang's
sglang/srt/observability/metrics_collector.py (sglang:num_queue_reqs, sglang:token_usage), the
standard node exporter's (node_memory_MemAvailable_bytes, node_network_speed_bytes) and the
supervisor's (orchestrator/hostside/supervisor.py Supervisor.metrics)."""
from __future__ import annotations

from typing import Any

RUNBOOKS = "docs/runbooks"
GROUP = "deployctl"
KV_FULL = 0.95                 # the share of the KV cache in use that leaves no room for a burst
OVER_PLAN = 1.10               # used host memory this far above sizing's plan: the plan is wrong


def _rule(name: str, expr: str, for_: str, severity: str, summary: str, runbook: str) -> dict[str, Any]:
    r: dict[str, Any] = {"alert": name, "expr": expr}
    if for_:
        r["for"] = for_
    r["labels"] = {"severity": severity}
    r["annotations"] = {"summary": summary, "runbook": f"{RUNBOOKS}/{runbook}"}
    return r


RULES: tuple[dict[str, Any], ...] = (
    _rule("DeployctlEngineDown", 'up{job="deployctl-engine"} == 0', "1m", "critical",
          "{{ $labels.deployment }}: the engine on {{ $labels.host }} does not answer /metrics",
          "model-went-down-at-night.md"),
    _rule("DeployctlEngineNotReady", 'deployctl_probe_ok{probe="health"} == 0', "3m", "critical",
          "{{ $labels.deployment }}: /health fails or a rank is not running (the supervisor's probe)",
          "model-went-down-at-night.md"),
    _rule("DeployctlEngineWedged",
          '(deployctl_probe_ok{probe="completion"} == 0) and on(deployment) (deployctl_probe_ok{probe="health"} == 1)',
          "2m", "critical",
          "{{ $labels.deployment }}: /health answers but a small completion does not (a wedged engine)",
          "model-went-down-at-night.md"),
    _rule("DeployctlRestartsInWindow", "increase(deployctl_restarts_total[1h]) >= 2", "", "warning",
          "{{ $labels.deployment }}: the supervisor restarted the group twice or more in an hour",
          "model-went-down-at-night.md"),
    _rule("DeployctlSupervisorGaveUp", 'deployctl_supervisor_state{state="failed"} == 1', "", "critical",
          "{{ $labels.deployment }}: the supervisor gave up restarting it; `deployctl up` starts it again",
          "model-went-down-at-night.md"),
    _rule("DeployctlSupervisorDown", 'up{job="deployctl-supervisor"} == 0', "2m", "warning",
          "{{ $labels.deployment }}: its supervisor's /metrics does not answer: nothing restarts it",
          "model-went-down-at-night.md"),
    _rule("DeployctlRouterDown", 'up{job="deployctl-router"} == 0', "1m", "critical",
          "the router on {{ $labels.router }} does not answer /metrics: the one endpoint is down for every model",
          "model-went-down-at-night.md"),
    _rule("DeployctlRequestsQueued",
          "sum by (deployment) (vllm:num_requests_waiting or sglang:num_queue_reqs) "
          "> on(deployment) group_left() deployctl:queue_bound", "5m", "warning",
          "{{ $labels.deployment }}: more requests waiting than a full batch, for 5 minutes",
          "model-went-down-at-night.md"),
    _rule("DeployctlKVCacheNearFull",
          f"max by (deployment) (vllm:kv_cache_usage_perc or sglang:token_usage) > {KV_FULL}", "5m", "warning",
          f"{{{{ $labels.deployment }}}}: the KV cache is more than {KV_FULL:.0%} full",
          "model-went-down-at-night.md"),
    _rule("DeployctlNodeMemoryLow",
          "node_memory_MemAvailable_bytes < on(deployment, host) group_left() deployctl:mem_floor_bytes", "1m",
          "critical", "{{ $labels.host }}: MemAvailable is below "
          "{{ $labels.deployment }}'s floor (GPU and host share one pool on a DGX Spark)",
          "model-went-down-at-night.md"),
    _rule("DeployctlMemoryAbovePlan",
          "(node_memory_MemTotal_bytes - node_memory_MemAvailable_bytes) "
          f"> on(deployment, host) group_left() (deployctl:planned_memory_bytes * {OVER_PLAN})", "10m", "warning",
          f"{{{{ $labels.host }}}}: host memory in use more than {OVER_PLAN - 1:.0%} above what sizing planned for "
          "{{ $labels.deployment }}", "bring-up-4-node.md"),
    _rule("DeployctlNVMeLow",
          "deployctl_host_disk_avail_bytes < on(deployment, host) group_left() deployctl:staging_need_bytes", "5m",
          "warning", "{{ $labels.host }}: less free space on the NVMe folder than "
          "{{ $labels.deployment }}'s staging needs", "restage-after-checkpoint-update.md"),
    _rule("DeployctlFabricSlower",
          "node_network_speed_bytes < on(deployment, host, device) group_left() deployctl:fabric_speed_bytes", "1m",
          "warning", "{{ $labels.host }}: {{ $labels.device }} negotiated a slower speed "
          "than at the last fabric check", "debug-hung-nccl-start.md"),
)


def document() -> dict[str, Any]:
    return {"groups": [{"name": GROUP, "rules": [dict(r) for r in RULES]}]}
