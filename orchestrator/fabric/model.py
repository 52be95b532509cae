"""The fabric check's values: what was seen on each host and link, and what was judged (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .detect import Fabric
from .probe import Throughput
from .topology import Link


@dataclass(frozen=True)
class HostFabric:
    name: str
    fabric: Fabric | None              # the netdev launch would use (None: detection failed, see error)
    error: str = ""
    operstate: str = ""
    mtu: int | None = None
    speed_mbps: int | None = None      # negotiated; None when the driver does not say (veth: 10000)
    management: str = ""               # the netdev holding the host's SSH address
    wireless: bool = False
    rdma: tuple[dict[str, Any], ...] = ()    # RoCE devices: dev, port, state, netdevs
    tools: dict[str, bool] = field(default_factory=dict)
    link_ifaces: dict[str, dict[str, Any]] = field(default_factory=dict)   # mesh: netdev -> its facts

    def mtu_of(self, iface: str) -> int | None:
        """The MTU of IFACE: a mesh cable's netdev, else the fabric netdev's."""
        return self.link_ifaces.get(iface, {}).get("mtu") if self.link_ifaces else self.mtu

    def to_json(self) -> dict[str, Any]:
        f = self.fabric
        return {"host": self.name, "iface": f.iface if f else None, "address": f.address if f else None,
                "network": f.network if f else None, "reason": f.reason if f else self.error,
                "operstate": self.operstate, "mtu": self.mtu, "speed_mbps": self.speed_mbps,
                "management_iface": self.management, "rdma": list(self.rdma), "tools": self.tools,
                "links": self.link_ifaces}


@dataclass(frozen=True)
class LinkResult:
    link: Link
    reach: dict[str, bool]             # "a>b", "b>a": a reply came back
    df: dict[str, bool | None]         # don't-fragment ping at the path MTU (None: not tried)
    df_size: int                       # the MTU that was tried
    rtt_ms: float | None
    throughput: Throughput | None      # a -> b (None: not measured, e.g. unreachable)
    expected_gbps: float | None        # what the link should carry (None: unknown)
    detail: dict[str, str] = field(default_factory=dict)
    rdma: Throughput | None = None     # ib_write_bw a -> b (None: no RoCE device or perftest on an end)

    def to_json(self) -> dict[str, Any]:
        return {**self.link.to_json(), "reach": self.reach, "df": self.df, "mtu": self.df_size,
                "rtt_ms": self.rtt_ms, "throughput": self.throughput.to_json() if self.throughput else None,
                "rdma": self.rdma.to_json() if self.rdma else None,
                "expected_gbps": self.expected_gbps, "detail": self.detail}


@dataclass(frozen=True)
class Finding:
    kind: str                          # one of recipe.VERDICTS
    where: str                         # a host name or a link "a-b"
    message: str
    stop: bool                         # False: the recipe's fabric.warn lists this kind
    hosts: tuple[str, ...] = ()        # the hosts it concerns: the host, or both ends of the link

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "where": self.where, "message": self.message,
                "severity": "stop" if self.stop else "warn", "hosts": list(self.hosts)}


@dataclass(frozen=True)
class FabricReport:
    topology: str
    hosts: tuple[HostFabric, ...]
    links: tuple[LinkResult, ...]
    findings: tuple[Finding, ...]
    seconds: float
    cached_from: str = ""              # when reused: the time of the measurement it reuses

    @property
    def ok(self) -> bool:
        return not any(f.stop for f in self.findings)

    def slowest(self) -> LinkResult | None:
        measured = [r for r in self.links if r.throughput and r.throughput.gbps is not None]
        return min(measured, key=lambda r: r.throughput.gbps) if measured else None  # type: ignore[union-attr]

    def to_json(self) -> dict[str, Any]:
        slow = self.slowest()
        return {"topology": self.topology, "ok": self.ok, "seconds": round(self.seconds, 2),
                "cached_from": self.cached_from or None,
                "hosts": [h.to_json() for h in self.hosts], "links": [r.to_json() for r in self.links],
                "slowest": slow.link.name if slow else None,
                "findings": [f.to_json() for f in self.findings]}
