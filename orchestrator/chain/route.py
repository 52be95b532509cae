"""The chain's order and the address of every hop (pure: nothing here touches a host).

Order: switch (and direct): the source, then the targets in rank order: every hop crosses the switch
once, so any order costs the same and rank order is the one an operator predicts. mesh (a ring is a
mesh with fewer cables): from each node to a cabled neighbour not yet in the chain (the lowest rank
first), so every hop is one cable; a target no cable reaches next is appended over the management
network, and the plan says so.

Repair (`repair_source`): a pass that leaves nodes unfinished is followed by one from a complete node
next to the first of them along this route (on a mesh, one cabled to it), never by rank order.

Address: a node listens on, and its upstream connects to, the node's fabric address (on a mesh, its
end of the cable from the upstream); a host without one is reached over its management address.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..inventory import Cluster, Host

FABRIC, MANAGEMENT = "fabric", "management"


@dataclass(frozen=True)
class Hop:
    host: str
    upstream: str          # "" for the source
    address: str           # where the upstream connects (the node binds there); the source: ""
    network: str           # FABRIC | MANAGEMENT ("" for the source)
    downstream: str = ""   # the next hop's host; "" for the chain's tail


def _bare(address: str) -> str:
    return address.split("/", 1)[0]


def hop_address(cluster: "Cluster", upstream: "Host", host: "Host") -> tuple[str, str]:
    """Where UPSTREAM reaches HOST for data, and over which network."""
    if cluster.fabric_topology == "mesh":
        link = next((lk for lk in host.fabric_links if lk.peer == upstream.name), None)
        return (_bare(link.address), FABRIC) if link else (host.address, MANAGEMENT)
    return (_bare(host.fabric_address), FABRIC) if host.fabric_address else (host.address, MANAGEMENT)


def order(cluster: "Cluster", source: str, targets: list[str]) -> list[str]:
    rank = {h.name: h.rank for h in cluster.hosts}
    left = sorted((t for t in targets if t != source), key=lambda n: rank[n])
    if cluster.fabric_topology != "mesh":
        return [source] + left
    out = [source]
    while left:
        here = cluster.host(out[-1])
        cabled = {lk.peer for lk in here.fabric_links}
        nxt = next((n for n in left if n in cabled), left[0])
        out.append(nxt)
        left.remove(nxt)
    return out


def route(cluster: "Cluster", source: str, targets: list[str]) -> list[Hop]:
    names = order(cluster, source, targets)
    hops = [Hop(source, "", "", "", names[1] if len(names) > 1 else "")]
    for i, (up, name) in enumerate(zip(names, names[1:]), start=2):
        addr, net = hop_address(cluster, cluster.host(up), cluster.host(name))
        hops.append(Hop(name, up, addr, net, names[i] if i < len(names) else ""))
    return hops


def repair_source(cluster: "Cluster", hops: list[Hop], complete: set[str], left: list[str]) -> str:
    """Where a repair pass starts after HOPS (the pass that left LEFT unfinished): from a node that
    holds the whole checkpoint (COMPLETE, the head always) next to the first unfinished node of the
    route, not of rank order. That is its upstream in HOPS when complete, else the nearest complete
    node before it along the route; on a mesh, first of all one with a cable to it (its upstream, or
    any complete node it is cabled to: the head, a finished worker), so the repair is one cable too;
    the head when none is."""
    order = [h.host for h in hops]
    first = next((n for n in order if n in left), None)
    if first is None:
        return cluster.head
    before = [n for n in reversed(order[:order.index(first)]) if n in complete]
    if cluster.fabric_topology == "mesh":
        cabled = {lk.peer for lk in cluster.host(first).fabric_links}
        rank = {h.name: h.rank for h in cluster.hosts}
        near = [n for n in before if n in cabled] + sorted((n for n in complete if n in cabled and n not in before),
                                                            key=lambda n: rank[n])
        if near:
            return near[0]
    return before[0] if before else cluster.head


def networks_note(hops: list[Hop]) -> str:
    """One line for the plan: which network carries the data."""
    mgmt = [h.host for h in hops[1:] if h.network == MANAGEMENT]
    chain = " -> ".join(h.host for h in hops)
    if not mgmt:
        return f"chain {chain}, every hop over the fabric"
    return (f"chain {chain}; over the MANAGEMENT network to {', '.join(mgmt)} (no fabric address in the "
            f"inventory{' or no cable from the previous node' if len(mgmt) < len(hops) - 1 else ''})")
