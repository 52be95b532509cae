"""The fabric check's verdicts (pure): what makes a link or host unfit for NCCL, and why.

  link-down    the fabric netdev is not up, or no fabric netdev could be chosen
  management   NCCL would run over the netdev that carries SSH (the management network) or a wireless one
  mtu          a fabric netdev's MTU is not the recipe's fabric.mtu, the two ends of a link differ, or a
               don't-fragment ping of that size does not cross the path (a switch port or peer at 1500)
  subnet       a host's fabric address is on another subnet than its peers' (switch), or a cable's ends
               are not on the subnet the inventory gives it (mesh)
  unreachable  no ping reply over the fabric addresses, in either direction
  slow-link    iperf3 measured under fabric.min_fraction of the expected rate (fabric.expected_gbps, else
               the slower end's negotiated speed)
  unmeasured   the rate could not be measured (iperf3 missing or failing): the link is not proven
Each stops the run unless the recipe's fabric.warn names its kind.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .model import Finding, HostFabric, LinkResult
from .topology import Link

if TYPE_CHECKING:
    from ..recipe import FabricSpec


def expected_gbps(spec: "FabricSpec", a: HostFabric | None, b: HostFabric | None) -> float | None:
    if spec.expected_gbps:
        return spec.expected_gbps
    speeds = [h.speed_mbps for h in (a, b) if h is not None and h.speed_mbps and h.speed_mbps > 0]
    return min(speeds) / 1000 if len(speeds) == 2 else None


def judge(hosts: list[HostFabric], links: list[LinkResult], spec: "FabricSpec", topology: str) -> list[Finding]:
    out: list[Finding] = []

    def add(kind: str, subject: "str | Link", message: str) -> None:
        """A finding on a host (its name) or on a link (both its ends)."""
        where, hosts = (subject, (subject,)) if isinstance(subject, str) else (subject.name, (subject.a, subject.b))
        out.append(Finding(kind, where, message, stop=kind not in spec.warn, hosts=hosts))

    for h in hosts:
        f = h.fabric
        if f is None:
            add("link-down", h.name, f"no fabric netdev: {h.error}")
            continue
        if h.operstate not in ("up", "unknown"):
            add("link-down", h.name, f"fabric netdev {f.iface} is {h.operstate or 'missing'}: check the cable "
                                     "and the switch port")
        if h.wireless:
            add("management", h.name, f"fabric netdev {f.iface} is a wireless interface")
        elif topology != "mesh" and h.management and f.iface == h.management:
            add("management", h.name, f"NCCL would run over {f.iface}, the management interface (it holds "
                                      f"the SSH address): give the host its ConnectX-7 address as "
                                      "fabric_address, or fabric_iface")
        ifaces = h.link_ifaces or {f.iface: {"mtu": h.mtu}}
        for name, facts in sorted(ifaces.items()):
            mtu = facts.get("mtu")
            if spec.mtu and mtu is not None and mtu != spec.mtu:
                add("mtu", h.name, f"{name} has MTU {mtu}, the fabric needs {spec.mtu} (fabric.mtu): set it "
                                   "on the host (`deployctl fabric plan` writes the netplan file)")
        if topology == "mesh":
            for name, facts in sorted(h.link_ifaces.items()):
                if facts.get("missing"):
                    add("subnet", h.name, f"{name} does not hold {facts.get('address')} (the inventory's "
                                          f"fabric_links): {facts['missing']}")
    if topology != "mesh":
        nets = Counter(h.fabric.network for h in hosts if h.fabric and h.fabric.network)
        if len(nets) > 1:
            common, _ = nets.most_common(1)[0]
            for h in hosts:
                if h.fabric and h.fabric.network and h.fabric.network != common:
                    add("subnet", h.name, f"fabric address {h.fabric.address} ({h.fabric.iface}) is in "
                                          f"{h.fabric.network}, its peers' in {common}: NCCL cannot reach it "
                                          "there; fix the address (or the inventory's fabric_address)")
    by_name = {h.name: h for h in hosts}
    for r in links:
        lk = r.link
        a, b = by_name.get(lk.a), by_name.get(lk.b)
        way = {"a>b": f"{lk.a} -> {lk.b}", "b>a": f"{lk.b} -> {lk.a}"}
        lost = [d for d, ok in r.reach.items() if not ok]
        if lost:
            why = "; ".join(f"{way[d]}: {r.detail[d]}" for d in lost if r.detail.get(d))
            add("unreachable", lk, f"{lk.a_addr} <-> {lk.b_addr}: no reply "
                                        f"{' and '.join(way[d] for d in lost)}" + (f" ({why})" if why else ""))
            continue
        ma = a.mtu_of(lk.a_iface) if a else None
        mb = b.mtu_of(lk.b_iface) if b else None
        blocked = [d for d, ok in r.df.items() if ok is False]
        why = "; ".join(f"{way[d]}: {r.detail[f'df {d}']}" for d in blocked if r.detail.get(f"df {d}"))
        if ma is not None and mb is not None and ma != mb:
            add("mtu", lk, f"MTU mismatch on the path: {lk.a} {lk.a_iface} {ma}, {lk.b} {lk.b_iface} {mb}"
                                + (f" (don't-fragment ping of {r.df_size}: {why})" if why else ""))
        elif blocked:
            add("mtu", lk, f"path MTU below {r.df_size}: a don't-fragment ping of {r.df_size} bytes does "
                                f"not cross {' and '.join(way[d] for d in blocked)}" + (f" ({why})" if why else "")
                                + ": a switch port or an interface on the path has a smaller MTU")
        rd = r.rdma
        if rd is not None and rd.gbps is None:
            add("unmeasured", lk, f"RDMA bandwidth not measured: {rd.error}")
        elif rd is not None and r.expected_gbps and rd.gbps is not None and rd.gbps < spec.min_fraction * r.expected_gbps:
            add("slow-link", lk, f"RDMA {rd.gbps:.2f} Gb/s (ib_write_bw) {lk.a} -> {lk.b}, under "
                                      f"{spec.min_fraction:g} x the expected {r.expected_gbps:g} Gb/s")
        t = r.throughput
        if t is None:
            continue
        if t.gbps is None:
            add("unmeasured", lk, f"throughput not measured: {t.error}")
        elif r.expected_gbps and t.gbps < spec.min_fraction * r.expected_gbps:
            add("slow-link", lk, f"{t.gbps:.2f} Gb/s measured {lk.a} -> {lk.b}, under "
                                      f"{spec.min_fraction:g} x the expected {r.expected_gbps:g} Gb/s "
                                      f"(retransmits {t.retransmits if t.retransmits is not None else '?'}): "
                                      "check the cable, the transceiver and the port's negotiated mode")
    return out
