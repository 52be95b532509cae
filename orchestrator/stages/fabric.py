"""fabric: prove every link between the hosts before a multi-node launch (orchestrator/fabric/).

Runs after preflight, before anything is built, shipped or staged: a bad cable or MTU stops `up` in
seconds instead of as an NCCL hang after an hour of staging. Read-only on the hosts. `up` reuses a
passing check for the recipe's fabric.cache_s while nothing it was measured on changed; `deployctl
fabric` always measures.
"""
from __future__ import annotations

from ..outcomes import HostResult
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage


def wanted(dep) -> bool:
    return dep.recipe.parallelism.nodes > 1 and len(dep.cluster.hosts) > 1


def plan(dep, options: RunOptions):
    if not wanted(dep):
        return [], "one host: no fabric to check"
    f, c = dep.recipe.fabric, dep.cluster
    n = len(c.hosts)
    pairs = (sum(len(h.fabric_links) for h in c.hosts) // 2) if c.fabric_topology == "mesh" else n * (n - 1) // 2
    mtu = f"MTU {f.mtu}" if f.mtu else "the smaller MTU of each pair"
    rate = (f"{f.expected_gbps:g} Gb/s" if f.expected_gbps else "the negotiated speed")
    reuse = ("measured now (deployctl fabric)" if options.fabric_fresh else
             f"a passing check of the same facts is reused for {f.cache_s:g} s" if f.cache_s else "measured every run")
    acts = []
    for h in c.hosts:
        peers = [x.peer for x in h.fabric_links] if c.fabric_topology == "mesh" else \
            [x.name for x in c.hosts if x.name != h.name]
        acts.append(Action("fabric", h.name, "fabric-check",
                           f"{c.fabric_topology} fabric of {h.name}: netdev, state, {mtu}, subnet; ping and "
                           f"don't-fragment ping to {', '.join(peers)}; iperf3 -P {f.iperf_streams} "
                           f"-t {f.iperf_seconds:g} per link (>= {f.min_fraction:g} x {rate})",
                           api=f"ssh {h.user}@{h.address}:{h.port}: python3 -c <fabric facts> ; python3 -c <ping, "
                               f"ping -M do -s MTU-28 per peer> ; iperf3 -s -1 -B <fabric address> -p "
                               f"{f.iperf_port} | iperf3 -c <peer> -B <fabric address> -t {f.iperf_seconds:g} "
                               f"-P {f.iperf_streams} -J ; ib_write_bw where installed",
                           details={"topology": c.fabric_topology, "peers": peers, "links": pairs,
                                    "mtu": f.mtu, "warn": list(f.warn)}))
    return acts, f"{pairs} link(s), {reuse}" + (f"; only warn on: {', '.join(f.warn)}" if f.warn else "")


def apply(dep, actions, ctx):
    # Imported here: the check reaches paramiko through the shells; planning stays pure.
    from ..executors.shells import run_shells
    from ..fabric import check, report
    if not actions:
        return []
    rep = check.run(dep, run_shells(dep.cluster, ctx.state), fresh=ctx.options.fabric_fresh,
                    cache_root=str(ctx.run_dir.parent), say=ctx.say)
    text = report.lines(rep)
    for line in text:
        ctx.say(line)
    doc = rep.to_json()
    ctx.write_json("fabric.json", doc)
    if rep.ok and not rep.cached_from:        # a new passing check: to the status page (launch/status_page.py)
        from ..fabric import cache
        from ..launch import status_page
        said = status_page.push_fabric(dep, cache.last(str(ctx.run_dir.parent), dep.name))
        if said and "not updated" in said:
            ctx.say(said)
    out = []
    for a in actions:
        log = ctx.host_log(a.host, "fabric")
        for line in report.lines(rep, a.host):
            log.write(line)
        mine = [f for f in rep.findings if a.host in f.hosts]
        stops = [f for f in mine if f.stop]
        data = {"fabric": doc} if a.host == dep.cluster.head else {}
        if stops:
            msg = "; ".join(f"{f.kind} {f.where}: {f.message}" for f in stops)
            res = HostResult(a.host, "fabric", "failed", f"fabric check failed: {msg}", tail=log.tail(), data=data)
        else:
            h = next(x for x in rep.hosts if x.name == a.host)
            where = (f"{len(h.link_ifaces)} cable(s) ({', '.join(sorted(h.link_ifaces))}), NCCL bootstrap on "
                     f"{h.fabric.iface}" if h.fabric and h.link_ifaces else
                     f"{h.fabric.iface} {h.fabric.address}" if h.fabric else "?")
            warn = "; ".join(f"WARN {f.kind} {f.where}: {f.message}" for f in mine)
            res = HostResult(a.host, "fabric", "ok", f"fabric ok on {where}"
                             + (f" (cached from {rep.cached_from})" if rep.cached_from else "")
                             + (f"; {warn}" if warn else ""), data=data)
        res.log_path = str(log.path)
        log.close()
        out.append(res)
    return out


STAGE = Stage("fabric", plan, apply, "prove every fabric link (reachability, path MTU, iperf3 rate) before launch")
