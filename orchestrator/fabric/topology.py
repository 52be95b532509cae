"""Which host pairs the fabric check measures, over which addresses, and in which order (pure).

switch / direct: every pair of hosts, over the fabric each host's launch would use (detect.py).
mesh: the cables the inventory's fabric_links describe (a ring is a mesh with fewer cables); each
cable has its own subnet and netdevs, and a pair without a cable is not a link.

`rounds` schedules the links so that no host runs two measurements at once (the circle method of a
round-robin tournament: n-1 rounds of n/2 pairs for n hosts), which is what makes a per-pair rate a
property of the cable rather than of the neighbours' traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..inventory import Cluster
    from .detect import Fabric


@dataclass(frozen=True)
class Link:
    a: str                     # host names, a before b in rank order
    b: str
    a_addr: str
    b_addr: str
    a_iface: str
    b_iface: str
    network: str = ""          # the subnet both ends must share ("" : from the hosts' own, see verdicts)

    @property
    def name(self) -> str:
        return f"{self.a}-{self.b}"

    def to_json(self) -> dict[str, str]:
        return {"a": self.a, "b": self.b, "a_addr": self.a_addr, "b_addr": self.b_addr,
                "a_iface": self.a_iface, "b_iface": self.b_iface, "network": self.network}


def links(cluster: "Cluster", fabrics: "dict[str, Fabric]") -> list[Link]:
    """The links to measure. FABRICS: each host's detected fabric (switch/direct; hosts missing from it
    are left out: their detection failed and is reported on its own)."""
    hosts = [h for h in cluster.hosts]
    if cluster.fabric_topology == "mesh":
        out = []
        for h in hosts:
            for link in h.fabric_links:
                peer = cluster.host(link.peer)
                if peer.rank < h.rank:
                    continue                      # each cable once, from its lower-ranked end
                back = next(x for x in peer.fabric_links if x.peer == h.name)
                out.append(Link(h.name, peer.name, link.address, back.address, link.iface, back.iface,
                                link.network))
        return sorted(out, key=lambda lk: (cluster.host(lk.a).rank, cluster.host(lk.b).rank))
    present = [h for h in hosts if h.name in fabrics]
    return [Link(x.name, y.name, fabrics[x.name].address, fabrics[y.name].address,
                 fabrics[x.name].iface, fabrics[y.name].iface)
            for x, y in combinations(present, 2)]


def rounds(items: list[Link]) -> list[list[Link]]:
    """LINKS in rounds of disjoint pairs: every link exactly once, no host twice in a round."""
    names: list[str] = []
    for lk in items:
        for n in (lk.a, lk.b):
            if n not in names:
                names.append(n)
    by_pair = {frozenset((lk.a, lk.b)): lk for lk in items}
    ring = names + ([""] if len(names) % 2 else [])      # "" = a bye for odd counts
    n = len(ring)
    out: list[list[Link]] = []
    for _ in range(max(n - 1, 0)):
        this = [by_pair[frozenset((ring[i], ring[n - 1 - i]))] for i in range(n // 2)
                if frozenset((ring[i], ring[n - 1 - i])) in by_pair]
        if this:
            out.append(this)
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return out


def peers(items: list[Link], host: str) -> list[tuple[str, str, str]]:
    """(peer, this host's address, the peer's address) for every link of HOST."""
    out = []
    for lk in items:
        if lk.a == host:
            out.append((lk.b, lk.a_addr, lk.b_addr))
        elif lk.b == host:
            out.append((lk.a, lk.b_addr, lk.a_addr))
    return out
