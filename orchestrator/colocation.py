"""Several deployments on one cluster: what cannot work together, found before any host is touched (pure).

An inventory with `all.vars.deployments` (inventory.py) holds several deployments, each on a subset of
the hosts. Each is planned and sized alone (sizing.py); together they must also not:
- use more GPUs on a host than it has (each rank takes `parallelism.gpus_per_node` of its host's);
- listen on one port of one host twice (API, vLLM's rendezvous, the supervisor: all on the head);
- need more of a shared host's memory than it has (the sum of every deployment's per-node budget,
  per resource: unified memory on a Spark, GPU memory and host RAM on a discrete-GPU host);
- stage tables into the same folder of a host (the Engram folder, the PLE folder).
Every problem names both deployments, the host and the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import sizing
from .errors import InputError

Deployment = Any      # orchestrator.deployment.Deployment, which imports this module (no import back)


@dataclass(frozen=True)
class Clash:
    host: str
    what: str               # gpu | port | memory | folder
    deployments: tuple[str, ...]
    message: str


def ports(dep: Deployment) -> dict[str, dict[int, str]]:
    """host -> port -> what listens there, for one deployment."""
    head = dep.cluster.head
    out: dict[int, str] = {dep.api_port: "the API"}
    if len(dep.cluster.hosts) > 1:
        out.setdefault(dep.recipe.engine.master_port, "vLLM's rendezvous (engine.master_port)")
    sv = dep.supervisor_port
    if sv is not None:
        out.setdefault(sv, "the supervisor (supervise.port)")
        if dep.recipe.supervise.page_at is not None:
            out.setdefault(dep.recipe.supervise.page_at, "the status page (supervise.page_port)")
    return {head: out}


def folders(dep: Deployment) -> dict[str, dict[str, str]]:
    """host -> folder -> what is staged there, for one deployment."""
    out: dict[str, dict[str, str]] = {}
    r = dep.recipe
    for h in dep.cluster.hosts:
        if r.engram is not None and r.engram.placement == "nvme":
            out.setdefault(h.name, {})[dep.engram_dir(h)] = "its Engram rows"
        if r.ple is not None and r.ple.placement == "nvme":
            out.setdefault(h.name, {})[dep.ple_dir(h)] = "its PLE table"
    return out


def clashes(deps: list[Deployment]) -> list[Clash]:
    out: list[Clash] = []
    hosts = sorted({h.name for d in deps for h in d.cluster.hosts})
    on = {h: [d for d in deps if any(x.name == h for x in d.cluster.hosts)] for h in hosts}
    for h, ds in on.items():
        if len(ds) < 2:
            continue
        host = ds[0].cluster.host(h)
        want = {d.name: d.recipe.parallelism.gpus_per_node for d in ds}
        if host.gpus and sum(want.values()) > host.gpus:
            out.append(Clash(h, "gpu", tuple(want), f"{h}: deployments {_names(want)} need "
                             f"{' + '.join(str(v) for v in want.values())} = {sum(want.values())} GPU(s) there; "
                             f"the host has {host.gpus} (two deployments on one GPU)"))
        out += _twice(h, ds, ports, "port", lambda port, a, wa, b, wb: (
            f"{h}: port {port} is {wa} of deployment {a} and {wb} of deployment {b}: give one another port"))
        out += _twice(h, ds, folders, "folder", lambda folder, a, wa, b, wb: (
            f"{h}: deployment {a} stages {wa} and deployment {b} {wb} into the same folder {folder}: give one "
            f"another subdir (engram.subdir / ple.subdir)"))
        out.extend(_memory(h, ds))
    return out


def _twice(h: str, ds: list[Deployment], places, what: str, say) -> list[Clash]:
    """Two deployments claiming one place (a port, a folder) of host H: PLACES(dep) -> host -> place -> role."""
    seen: dict = {}
    out = []
    for d in ds:
        for place, role in places(d).get(h, {}).items():
            if place in seen:
                other, orole = seen[place]
                out.append(Clash(h, what, (other, d.name), say(place, other, orole, d.name, role)))
            else:
                seen[place] = (d.name, role)
    return out


def _memory(h: str, ds: list[Deployment]) -> list[Clash]:
    """The sum of the deployments' per-node budgets on host H against its capacity, per resource."""
    need: dict[str, dict[str, float]] = {}
    capacity: dict[str, float] = {}
    for d in ds:
        node = sizing.size(d).node(h)
        for res in (sizing.UNIFIED, sizing.GPU, sizing.HOST_RAM):
            b = node.budget(res)
            if b is None:
                continue
            need.setdefault(res, {})[d.name] = b.total_gb
            if b.capacity_gb is not None:
                capacity[res] = b.capacity_gb
    out = []
    for res, per in need.items():
        cap = capacity.get(res)
        if cap is None or len(per) < 2 or sum(per.values()) <= cap:
            continue
        parts = " + ".join(f"{v:.1f} GB ({k})" for k, v in per.items())
        out.append(Clash(h, "memory", tuple(per), f"{h}: deployments {_names(per)} together need {parts} = "
                         f"{sum(per.values()):.1f} GB of {res}; the host has {cap:.1f} GB: short by "
                         f"{sum(per.values()) - cap:.1f} GB (move one, or shrink its budget)"))
    return out


def router_clashes(dep: Deployment) -> list[Clash]:
    """The inventory's router (all.vars.router) listening on a port DEP's head listens on."""
    r = dep.cluster.router
    if r is None:
        return []
    mine = ports(dep).get(r.host.name, {})
    return [Clash(r.host.name, "port", (dep.name, "router"),
                  f"{r.host.name}: port {port} is {mine[port]} of deployment {dep.name} and the router's {role} "
                  f"(all.vars.router.{key}): give one another port")
            for port, role, key in ((r.port, "API", "port"), (r.metrics_port, "metrics", "metrics_port"),
                                    (r.backend, "backend (behind its key check, on 127.0.0.1)", "backend_port"))
            if port in mine]


def _names(d: dict) -> str:
    names = list(d)
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def refuse(dep: Deployment, peers: list[Deployment]) -> None:
    """InputError (exit 2) naming every clash between DEP and the inventory's other deployments."""
    order = dep.cluster.deployments                                                   # the inventory's order
    every = sorted([dep, *peers], key=lambda d: order.index(d.name) if d.name in order else 0)
    found = [c for c in clashes(every) if dep.name in c.deployments] + router_clashes(dep)
    if found:
        raise InputError("deployments that cannot run together:\n  " + "\n  ".join(c.message for c in found),
                         file=str(dep.cluster.file), key=f"all.vars.deployments.{dep.name}")
