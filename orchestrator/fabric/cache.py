"""A passing fabric check, kept on the controller so `up` does not measure an unchanged fabric again.

Kept in <run root>/fabric-cache/<deployment>.json with the fingerprint of what it was measured on:
each host's netdevs (state, MTU, speed, MAC, addresses), RoCE ports, tools and boot id, the links,
the topology and the recipe's fabric settings. A reboot, a re-cabled or re-addressed port, a changed
MTU or recipe: a new fingerprint, a new measurement. A failing report is never kept.
"""
from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..fsutil import atomic_write_text
from ..schema import to_dict
from .detect import Fabric
from .model import FabricReport, Finding, HostFabric, LinkResult
from .probe import Throughput
from .topology import Link

if TYPE_CHECKING:
    from ..deployment import Deployment


def fingerprint(dep: "Deployment", facts: dict[str, dict[str, Any]], links: list[Link]) -> str:
    keep = {n: {"net": {i: {k: v for k, v in d.items() if k != "speed" or v}
                        for i, d in sorted(f.get("net", {}).items())},
                "rdma": f.get("rdma"), "tools": f.get("tools"), "boot_id": f.get("boot_id"),
                "route": f.get("route_to_head")} for n, f in sorted(facts.items())}
    doc = {"facts": keep, "links": [lk.to_json() for lk in links], "topology": dep.cluster.fabric_topology,
           "fabric": to_dict(dep.recipe.fabric), "hosts": [(h.name, h.address, h.fabric_address, h.fabric_iface)
                                                           for h in dep.cluster.hosts]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _path(root: str, deployment: str) -> Path:
    return Path(root) / "fabric-cache" / f"{deployment}.json"


def store(root: str, deployment: str, key: str, report: FabricReport) -> None:
    p = _path(root, deployment)
    if not report.ok:
        p.unlink(missing_ok=True)            # a failing fabric is measured again next time
        return
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps({"fingerprint": key, "at": time.time(), "report": report.to_json()}) + "\n")


def load(root: str, deployment: str, key: str, max_age_s: float) -> FabricReport | None:
    try:
        doc = json.loads(_path(root, deployment).read_text())
    except (OSError, ValueError):
        return None
    age = time.time() - float(doc.get("at", 0))
    if doc.get("fingerprint") != key or not 0 <= age <= max_age_s:
        return None
    try:
        return _report(doc["report"], datetime.fromtimestamp(doc["at"], timezone.utc).isoformat(timespec="seconds"))
    except (KeyError, TypeError, ValueError):
        return None


def last(root: str, deployment: str) -> dict[str, Any] | None:
    """The last passing check's raw record ({"fingerprint", "at", "report"}), whatever its age (monitor)."""
    try:
        doc = json.loads(_path(root, deployment).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("report"), dict) else None


def _throughput(t: dict[str, Any] | None) -> Throughput | None:
    return Throughput(t["gbps"], t["retransmits"], t["error"]) if t else None


def _report(d: dict[str, Any], at: str) -> FabricReport:
    hosts = []
    for h in d["hosts"]:
        f = None
        if h["iface"]:
            f = Fabric(h["iface"], h["address"], (), h["reason"], "", h.get("network") or "", d["topology"])
        hosts.append(HostFabric(h["host"], f, "" if f else h["reason"], h["operstate"], h["mtu"], h["speed_mbps"],
                                h["management_iface"], False, tuple(h["rdma"]), h["tools"], h["links"]))
    links = []
    for r in d["links"]:
        t = r["throughput"]
        links.append(LinkResult(Link(r["a"], r["b"], r["a_addr"], r["b_addr"], r["a_iface"], r["b_iface"],
                                     r["network"]), r["reach"], r["df"], r["mtu"], r["rtt_ms"],
                                _throughput(t),
                                r["expected_gbps"], r["detail"], _throughput(r.get("rdma"))))
    findings = [Finding(f["kind"], f["where"], f["message"], f["severity"] == "stop", tuple(f["hosts"]))
                for f in d["findings"]]
    return FabricReport(d["topology"], tuple(hosts), tuple(links), tuple(findings), d["seconds"], cached_from=at)
