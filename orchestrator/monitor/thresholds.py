"""What each deployment's alerts compare against, as recording rules (rules/thresholds-<deployment>.yml):
the values deployctl planned, so that one alert file (alerts.py) serves every recipe. Pure: from the
deployment, sizing and the controller's last fabric check (fabric/cache.py).

- deployctl:mem_floor_bytes{deployment,host}: the recipe's supervise.mem_floor_gib (absent when 0);
- deployctl:planned_memory_bytes{deployment,host}: sizing's memory budget of the node that lives in
  host memory (unified memory on a DGX Spark, else host RAM), GB = 10^9 bytes as sizing counts;
- deployctl:staging_need_bytes{deployment,host}: what the node's NVMe must hold (sizing's NVMe lines:
  the folders preflight checks with df);
- deployctl:queue_bound{deployment}: requests waiting beyond one full batch (engine max-num-seqs /
  SGLang max-running-requests; the engine's default when the recipe does not set it);
- deployctl:fabric_speed_bytes{deployment,host,device}: the fabric netdev's negotiated speed at the last
  passing fabric check, in bytes/s as node_network_speed_bytes counts it (when that check ran and what
  each link carried are the supervisor's: deployctl_fabric_*).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import sizing

if TYPE_CHECKING:
    from ..deployment import Deployment

GB, GiB = 10 ** 9, 1024 ** 3
# vLLM's EngineArgs.max_num_seqs default when unset; SGLang sizes its own (no fixed default)
DEFAULT_BATCH = {"vllm": 256, "sglang": 256}
BATCH_ARG = {"vllm": "max-num-seqs", "sglang": "max-running-requests"}


def _record(name: str, value: float, labels: dict[str, str]) -> dict[str, Any]:
    return {"record": name, "expr": f"vector({float(value)!r})", "labels": labels}


def queue_bound(dep: "Deployment") -> int:
    e = dep.recipe.engine
    v = e.args.get(BATCH_ARG[e.kind])
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else DEFAULT_BATCH[e.kind]


def fabric_speeds(dep: "Deployment", fabric_doc: dict[str, Any] | None) -> dict[str, tuple[str, int]]:
    """{host: (netdev, bytes/s)} from the last passing fabric check's report (None: never checked)."""
    out: dict[str, tuple[str, int]] = {}
    names = {h.name for h in dep.cluster.hosts}
    for h in ((fabric_doc or {}).get("report") or {}).get("hosts") or []:
        if h.get("host") in names and h.get("iface") and h.get("speed_mbps"):
            out[h["host"]] = (h["iface"], int(h["speed_mbps"]) * 10 ** 6 // 8)
    return out


def rules(dep: "Deployment", fabric_doc: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    d = dep.name
    out = [_record("deployctl:queue_bound", queue_bound(dep), {"deployment": d})]
    floor = dep.recipe.supervise.mem_floor_gib
    budget = sizing.size(dep)
    speeds = fabric_speeds(dep, fabric_doc)
    for h in dep.cluster.hosts:
        lab = {"deployment": d, "host": h.name}
        if floor > 0:
            out.append(_record("deployctl:mem_floor_bytes", round(floor * GiB), lab))
        node = budget.node(h.name)
        mem = node.budget(sizing.UNIFIED) or node.budget(sizing.HOST_RAM)
        if mem is not None and mem.total_gb > 0:
            out.append(_record("deployctl:planned_memory_bytes", round(mem.total_gb * GB), lab))
        need = sum(gb for _, gb in node.nvme_needs())
        if need > 0:
            out.append(_record("deployctl:staging_need_bytes", round(need * GB), lab))
        if h.name in speeds:
            dev, bps = speeds[h.name]
            out.append(_record("deployctl:fabric_speed_bytes", bps, {**lab, "device": dev}))
    return out


def document(dep: "Deployment", fabric_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"groups": [{"name": f"deployctl-thresholds-{dep.name}", "rules": rules(dep, fabric_doc)}]}
