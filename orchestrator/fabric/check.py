"""The fabric check: every host's fabric netdev, then every link proven (reachability, path MTU, TCP rate).

1. facts from every host at once (probe.read_facts) and the netdev launch would use (detect.for_host);
2. the links (topology.links) and, per host at once, a ping and a don't-fragment ping to every peer;
3. iperf3 per link, in rounds where no host is in two pairs (topology.rounds), each pair's a -> b;
4. the verdicts (verdicts.judge).
A passing report is kept (cache.py) and `up` reuses it for fabric.cache_s while the facts it was
measured on have not changed; `deployctl fabric` always measures.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from ..errors import InputError
from ..executors.ssh import short_reason
from ..outcomes import parallel
from . import cache, detect, probe, topology, verdicts
from .model import FabricReport, HostFabric, LinkResult
from .probe import ICMP_IP_HEADER, Throughput

if TYPE_CHECKING:
    from ..deployment import Deployment


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def host_view(dep: "Deployment", name: str, facts: dict[str, Any]) -> HostFabric:
    c, h = dep.cluster, dep.cluster.host(name)
    net = facts.get("net", {})
    mgmt = detect.holder(facts, h.address)
    rdma = tuple(facts.get("rdma", []))
    tools = facts.get("tools", {})
    try:
        f = detect.for_host(c, h, dep.recipe.engine.ib_hca, facts)
    except InputError as e:
        return HostFabric(name, None, e.detail, management=mgmt, rdma=rdma, tools=tools)
    links: dict[str, dict[str, Any]] = {}
    for lk in h.fabric_links:              # mesh: each cable's netdev as the host has it
        i = net.get(lk.iface)
        if i is None:
            links[lk.iface] = {"address": lk.address, "missing": f"no netdev {lk.iface} on {name}"}
            continue
        links[lk.iface] = {"address": lk.address, "mtu": _int(i.get("mtu")), "operstate": i.get("operstate"),
                           "speed_mbps": _int(i.get("speed"))}
        if lk.address not in i.get("addrs", []):
            links[lk.iface]["missing"] = f"it holds {', '.join(i.get('cidrs', [])) or 'no IPv4 address'}"
    i = net.get(f.iface, {})
    speed = _int(i.get("speed"))
    if h.fabric_links:
        speeds = [x["speed_mbps"] for x in links.values() if x.get("speed_mbps")]
        speed = min(speeds) if speeds else None
    return HostFabric(name, f, operstate=i.get("operstate", ""), mtu=_int(i.get("mtu")),
                      speed_mbps=speed if speed and speed > 0 else None, management=mgmt,
                      wireless=bool(i.get("wireless")), rdma=rdma, tools=tools, link_ifaces=links)


def _hca(h: HostFabric, facts: dict[str, Any], iface: str) -> str:
    """The active RoCE device backing IFACE on the host (the pinned one for a switch), or ""."""
    backing = sorted(r["dev"] for r in detect.active_roce(facts) if iface in r.get("netdevs", []))
    if backing:
        return backing[0]
    return h.fabric.hca if h.fabric and h.fabric.topology not in ("mesh", "ring") else ""


def _df_size(spec, a: HostFabric | None, b: HostFabric | None, lk: topology.Link) -> int:
    if spec.mtu:
        return spec.mtu
    mtus = [m for m in (a and a.mtu_of(lk.a_iface), b and b.mtu_of(lk.b_iface)) if m]
    return min(mtus) if mtus else 1500


def run(dep: "Deployment", shells: Any, fresh: bool = False, cache_root: str | None = None,
        say: Callable[[str], None] = lambda m: None) -> FabricReport:
    """Check the fabric of DEP's cluster through SHELLS (executors/shells.py). FRESH: never reuse a
    cached report. CACHE_ROOT: where passing reports are kept (None: nowhere)."""
    t0 = time.monotonic()
    c, spec = dep.cluster, dep.recipe.fabric
    names = [h.name for h in c.hosts]
    head = detect.head_address(c)
    got = parallel(names, lambda n: probe.read_facts(shells[n], head))
    facts = dict(got.ok)
    # a host that cannot be read is a finding (its links are not measured), never the end of the check
    hosts = [host_view(dep, n, facts[n]) if n in facts else
             HostFabric(n, None, f"cannot read its network facts: {short_reason(got.failed[n])}") for n in names]
    views = {h.name: h for h in hosts}
    links = topology.links(c, {h.name: h.fabric for h in hosts if h.fabric})
    key = cache.fingerprint(dep, facts, links)
    if not fresh and cache_root and spec.cache_s > 0:
        hit = cache.load(cache_root, dep.name, key, spec.cache_s)
        if hit is not None:
            return hit
    # pings: every host to every peer at once, then the DF ping at the MTU the path must carry
    jobs = {n: [(p, src, dst, max(_df_size(spec, views[n], views[p], lk) - ICMP_IP_HEADER, 0))
                for lk in links for p, src, dst in topology.peers([lk], n)] for n in names}
    say(f"fabric: {len(links)} link(s) ({c.fabric_topology}): reachability and path MTU")
    seen = parallel([n for n in names if n in facts], lambda n: probe.pings(shells[n], jobs[n]))
    for n, e in seen.failed.items():
        seen[n] = {}
        views[n] = HostFabric(n, None, f"pings failed: {e}", management=views[n].management)
    results: dict[str, LinkResult] = {}
    for lk in links:
        ab = seen.get(lk.a, {}).get(lk.b, {})
        ba = seen.get(lk.b, {}).get(lk.a, {})
        detail = {d: r.get("detail", "") for d, r in (("a>b", ab), ("b>a", ba)) if r.get("detail")}
        detail.update({f"df {d}": r["df_detail"] for d, r in (("a>b", ab), ("b>a", ba)) if r.get("df_detail")})
        results[lk.name] = LinkResult(
            lk, {"a>b": bool(ab.get("reach")), "b>a": bool(ba.get("reach"))},
            {"a>b": ab.get("df"), "b>a": ba.get("df")}, _df_size(spec, views.get(lk.a), views.get(lk.b), lk),
            ab.get("rtt_ms"), None, verdicts.expected_gbps(spec, views.get(lk.a), views.get(lk.b)), detail)
    # throughput, in rounds of disjoint pairs
    gid = dep.recipe.engine.nccl_roce_env.get("NCCL_IB_GID_INDEX", detect.ROCE_ENV["NCCL_IB_GID_INDEX"])
    measurable = [lk for lk in links if all(results[lk.name].reach.values())]
    plan = topology.rounds(measurable)
    for i, rnd in enumerate(plan, 1):
        say(f"fabric: iperf3 round {i}/{len(plan)}: " + ", ".join(lk.name for lk in rnd))

        def measure(lk: topology.Link) -> tuple[Throughput, Throughput | None]:
            missing = [n for n in (lk.a, lk.b) if not views[n].tools.get("iperf3")]
            tcp = (Throughput(None, error=f"iperf3 is not installed on {', '.join(missing)} (apt install iperf3)")
                   if missing else probe.iperf(shells, lk, spec))
            hcas = (_hca(views[lk.a], facts.get(lk.a, {}), lk.a_iface), _hca(views[lk.b], facts.get(lk.b, {}), lk.b_iface))
            if all(hcas) and all(views[n].tools.get("ib_write_bw") for n in (lk.a, lk.b)):
                return tcp, probe.rdma(shells, lk, hcas[0], hcas[1], gid, spec)
            return tcp, None
        done = parallel(rnd, measure)
        for lk in rnd:
            pair = done[lk]
            tcp, rd = (pair if not isinstance(pair, BaseException) else (Throughput(None, error=str(pair)[:200]), None))
            results[lk.name] = replace(results[lk.name], throughput=tcp, rdma=rd)
    linked = [results[lk.name] for lk in links]
    hosts = [views[n] for n in names]
    report = FabricReport(c.fabric_topology, tuple(hosts), tuple(linked),
                          tuple(verdicts.judge(hosts, linked, spec, c.fabric_topology)), time.monotonic() - t0)
    if cache_root:
        cache.store(cache_root, dep.name, key, report)
    return report
