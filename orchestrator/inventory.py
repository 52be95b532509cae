"""Inventories: Ansible YAML inventories with deployctl's host and cluster variables.

The same file works with `ansible-playbook -i`. Keys starting with `ansible_`
are Ansible's and pass through; every other key must be one deployctl knows,
so a typo is an error instead of a silent default.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import checks, yamlfile
from .errors import InputError
from .hardware import KINDS
from .overrides import Override
from .paths import INVENTORIES_DIR

if TYPE_CHECKING:
    from .router.config import RouterConf

HOST_KEYS = {
    "rank": "this host's rank (0 = head), an integer",
    "hardware": f"the hardware kind ({', '.join(KINDS)})",
    "gpus": "GPU count, an integer",
    "nvme_dir": "folder on local NVMe for staged tables (Engram rows, PLE file)",
    "model_cache": "folder holding the checkpoint (HF cache layout or plain)",
    "fabric_iface": "override: the fabric netdev for NCCL/GLOO/UCX",
    "fabric_address": "this host's address on the fabric, optionally with its prefix (192.168.100.11/24): "
                      "launch and the fabric check use it; `fabric plan` writes it",
    "fabric_links": "switchless mesh/ring: per peer host, the link's netdev and this end's address, "
                    "{PEER: {iface: NETDEV, address: A.B.C.D/NN}} (fabric_topology: mesh)",
    "docker_host": "the Docker engine socket on this host (default unix:///var/run/docker.sock)",
    "expect_gpus": "preflight opt-out: false skips the GPU checks (NVIDIA runtime, nvidia-smi) on hosts "
                   "without GPUs, e.g. the test cluster (default true)",
    "expect_arch": "preflight override: the `uname -m` the host must report (default: the hardware "
                   "kind's, aarch64 for dgx-spark)",
    "host_ram_gb": "system RAM of a discrete-GPU host in GB: lets `plan` check pinned tables before "
                   "preflight measures MemAvailable (a cpu host: the engine's whole memory)",
    "compute_cpus": "the CPUs the engine's compute threads are bound to on this host (0-3 or 0,2), through the "
                    "variable the recipe names in engine.cpu_bind_env (vLLM's CPU build: VLLM_CPU_OMP_THREADS_BIND); "
                    "its other processes (API server, engine core) keep every CPU",
}
CLUSTER_KEYS = {
    "deployment": "deployment name (container labels, run records)",
    "recipe": "recipe name in recipes/ or a path",
    "head": "the head host's name (rank 0; serves the API)",
    "api_port": "API port on the head",
    "api_listen": "the address the API listens on (default: the head's management address, ansible_host); "
                  "0.0.0.0 or :: listens on every interface, the fabric included (said in the plan)",
    "api_allow": "the sources (addresses or networks) the API admits; default: whoever reaches api_listen. "
                 "Enforced by the deployment's firewall chain on the head: list the controller too",
    "metrics_allow": "the sources (addresses or networks), besides the deployment's hosts, the head's supervisor "
                     "port admits on a multi-node deployment: the Prometheus that scrapes its /metrics "
                     "(docs/monitoring.md)",
    "firewall": "rules (default): the deployment's own iptables chain confines the ports the engine cannot "
                "bind to the fabric (vLLM's rendezvous store) to the deployment's fabric addresses; none: no rule",
    "supervise": "true (default): `up` installs the deployment's supervisor, which restarts the group after a "
                 "crash, a wedge or a reboot (docs/supervisor.md); false: nothing watches it",
    "known_hosts_file": "known_hosts file for SSH host key checks",
    "host_key_checking": "check SSH host keys (default true; false is an explicit opt-out)",
    "recipe_overrides": "mapping of recipe key.path: value applied before --set",
    "run_dir": "where run records go (default ./runs)",
    "api_key_file": "file on the controller holding the serving API key (relative: to this inventory); "
                    "the engines require it, every probe sends it, it is never shown",
    "api_key_env": "or: the name of an environment variable on the controller holding the API key",
    "model_fetch": "how the head gets the checkpoint: hub (default: fetch-model downloads the recipe's "
                   "model.repo into the head's model_cache) or none (it is put there by other means)",
    "hf_endpoint": "the Hugging Face Hub (or mirror) fetch-model downloads from (default https://huggingface.co)",
    "fabric_topology": "how the hosts' fabric ports are cabled: switch (default), direct (two hosts, one "
                       "cable) or mesh (every linked pair its own cable and subnet; a ring is a mesh with "
                       "fewer links; needs fabric_links)",
    "distribution": "how image and checkpoint reach the workers: chain (the default where every host has a "
                    "fabric address, or on a mesh its cables: the head sends each byte once, every node forwards "
                    "to the next while it receives, over the fabric; docs/distribution.md) or direct (the default "
                    "otherwise: the head sends to each worker over SSH)",
    "hf_token_file": "file on the controller holding a Hub token for gated or private repos (relative: to "
                     "this inventory); default: the HF_TOKEN environment variable, if set",
    "deployments": "several deployments on these hosts: {NAME: {hosts: [...], recipe, head, api_port, "
                   "recipe_overrides, ...}}; each deployment's keys overlay all.vars, its hosts list gives "
                   "the ranks (the first is the head unless `head` says otherwise); commands take "
                   "--deployment NAME (docs/deployments.md)",
    "router": "one OpenAI endpoint in front of every deployment, routed by the request's model: {host, port, "
              "api_key_file, ...} (docs/router.md)",
    "replicas": "how many copies of the deployment serve its model (default 1): its hosts split, in order, into "
                "that many groups of the recipe's node count, each its own deployment NAME.r1, NAME.r2 ... behind "
                "the router under the one model name; `up` changes them one at a time (docs/deployments.md)",
    "groups": "or, with replicas: the groups explicitly, [[h1, h2], [h3, h4]] (each group's first host is its head)",
}
# What one entry of all.vars.deployments may set: its hosts, and the cluster variables that belong to
# one deployment (the rest: SSH, the fabric, the run records, are the cluster's).
DEPLOYMENT_KEYS = ("hosts", "recipe", "head", "api_port", "api_listen", "api_allow", "metrics_allow",
                   "recipe_overrides", "supervise", "distribution", "model_fetch", "api_key_file",
                   "api_key_env", "replicas", "groups")
REPLICA = "__replica"        # the (set, index, count) an expanded replica entry carries (expand_replicas)


def replica_name(base: str, i: int) -> str:
    """The deployment name of replica I (1-based) of BASE: its containers, run records and releases."""
    return f"{base}.r{i}"


def split_groups(hosts: list[str], replicas: int) -> list[list[str]]:
    """HOSTS (in order) into REPLICAS groups of equal size, in order (pure). ValueError when they do not divide."""
    if replicas < 1 or len(hosts) % replicas:
        raise ValueError(f"{len(hosts)} host(s) do not split into {replicas} groups of one size")
    n = len(hosts) // replicas
    return [hosts[i * n:(i + 1) * n] for i in range(replicas)]


def expand_replicas(deps: dict, err) -> dict:
    """all.vars.deployments with `replicas`/`groups` -> the same mapping where each replicated deployment NAME
    is replaced, in place, by NAME.r1 .. NAME.rN, each an ordinary deployment on its group's hosts (its first
    host the head) carrying REPLICA = (NAME, i, N). Replicas: 1 without groups is the deployment unchanged. Pure."""
    out: dict = {}
    for name, d in deps.items():
        dkey = f"all.vars.deployments.{name}"
        if not isinstance(d, dict) or ("replicas" not in d and "groups" not in d):
            out[name] = d
            continue
        n, groups = d.get("replicas"), d.get("groups")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise err(f"expected a count of copies (1, 2, ...), got {n!r}", f"{dkey}.replicas")
        hosts = d.get("hosts")
        if groups is not None:
            if (not isinstance(groups, list) or not groups or not all(
                    isinstance(g, list) and g and all(isinstance(h, str) for h in g) for g in groups)):
                raise err("expected a list of host lists, [[h1, h2], [h3, h4]]", f"{dkey}.groups")
            if n is not None and n != len(groups):
                raise err(f"replicas {n} but {len(groups)} groups", f"{dkey}.replicas")
            flat = [h for g in groups for h in g]
            if len(set(flat)) != len(flat):
                raise err("a host is in two groups: each replica has hosts of its own", f"{dkey}.groups")
            if hosts is not None and (not isinstance(hosts, list) or sorted(map(str, hosts)) != sorted(flat)):
                raise err("the groups must hold exactly the deployment's hosts (or leave hosts out)", f"{dkey}.groups")
            if len({len(g) for g in groups}) > 1:
                raise err("every group needs the recipe's node count: the groups differ in size", f"{dkey}.groups")
            n = len(groups)
        else:
            if not isinstance(hosts, list) or not hosts:
                raise err("expected a list of this inventory's host names, in rank order", f"{dkey}.hosts")
            try:
                groups = split_groups([str(h) for h in hosts], n)
            except ValueError as e:
                raise err(f"{e}: give a multiple of {n} hosts, or the groups explicitly", f"{dkey}.replicas") from None
        if n == 1:
            out[name] = {k: v for k, v in d.items() if k not in ("replicas", "groups")} | {"hosts": groups[0]}
            continue
        if "head" in d:
            raise err("with replicas each group's head is its first host: remove head (or order the groups)",
                      f"{dkey}.head")
        for i, g in enumerate(groups, 1):
            rn = replica_name(str(name), i)
            if rn in deps:
                raise err(f"replica {rn} of {name} has the name of another deployment", dkey)
            out[rn] = {**{k: v for k, v in d.items() if k not in ("replicas", "groups", "hosts")},
                       "hosts": list(g), REPLICA: (str(name), i, n)}
    return out


def _single_as_deployments(cvars: dict, hosts_raw: dict, stem: str) -> tuple[dict, dict]:
    """A single-deployment inventory with all.vars.replicas/groups, as the all.vars.deployments form
    (its hosts in rank order, their ranks dropped): each replica then is an ordinary deployment."""
    name = str(cvars.get("deployment") or stem)
    order = sorted(hosts_raw, key=lambda h: (hosts_raw[h][0].get("rank", 0) if isinstance(
        hosts_raw[h][0].get("rank", 0), int) else 0))
    entry = {k: cvars[k] for k in ("recipe", "api_port", "replicas", "groups") if k in cvars}
    entry["hosts"] = order
    out = {k: v for k, v in cvars.items() if k not in ("deployment", "head", "recipe", "api_port", "replicas", "groups")}
    out["deployments"] = {name: entry}
    return out, {h: ({k: v for k, v in hv.items() if k != "rank"}, key) for h, (hv, key) in hosts_raw.items()}


class InventoryRef(str):
    """An inventory path that also names one of its deployments (--deployment): it is a str (the path),
    so every command passes it on unchanged; load_inventory reads the name."""
    deployment: str | None = None

    @classmethod
    def of(cls, path: "str | Path | None", deployment: str | None) -> "InventoryRef":
        ref = cls(str(path) if path else os.environ.get("DEPLOYCTL_INVENTORY", str(DEFAULT_INVENTORY)))
        ref.deployment = deployment
        return ref
DEFAULT_INVENTORY = INVENTORIES_DIR / "local4.yml"


TOPOLOGIES = ("switch", "direct", "mesh")
DISTRIBUTIONS = ("direct", "chain")


@dataclass(frozen=True)
class FabricLink:
    """One end of a direct cable (fabric_topology: mesh): this host's netdev and address towards PEER."""
    peer: str
    iface: str
    address: str                         # without the prefix
    network: str                         # the link's subnet, e.g. 192.168.10.0/30


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    rank: int
    hardware: str
    gpus: int
    nvme_dir: str
    model_cache: str
    port: int = 22
    user: str = "root"
    key_file: str | None = None
    fabric_iface: str | None = None
    fabric_address: str | None = None
    fabric_network: str | None = None    # the fabric address's subnet when the inventory gave a prefix
    fabric_links: tuple[FabricLink, ...] = ()
    docker_host: str = "unix:///var/run/docker.sock"
    expect_gpus: bool = True             # false: preflight skips the GPU checks (documented opt-out)
    expect_arch: str | None = None       # preflight: the `uname -m` expected instead of the kind's
    host_ram_gb: float | None = None     # declared system RAM (discrete GPUs), checked by sizing
    compute_cpus: str = ""               # the engine's compute threads' CPUs (engine.cpu_bind_env); "": the engine's default
    ansible_vars: dict[str, Any] = field(default_factory=dict)

    @property
    def ssh_url(self) -> str:
        return f"ssh://{self.user}@{self.address}:{self.port}"

    @property
    def arch(self) -> str:
        """The host's machine architecture as `uname -m` names it (aarch64, x86_64): the inventory's
        expect_arch, else its hardware kind's. The cluster's, never the controller's: preflight checks
        that the host reports exactly this, so every later stage may plan with it."""
        return self.expect_arch or KINDS[self.hardware].arch


@dataclass(frozen=True)
class Cluster:
    name: str
    file: Path
    recipe: str | None
    head: str
    api_port: int | None                 # None: the recipe's engine.port
    hosts: tuple[Host, ...]              # sorted by rank
    known_hosts_file: str | None = None
    host_key_checking: bool = True
    recipe_overrides: tuple[Override, ...] = ()   # each knows its key in this file
    run_dir: str = "runs"
    api_key_file: str | None = None      # where the serving API key is (orchestrator/apikey.py) ...
    api_key_env: str | None = None       # ... or the environment variable holding it
    model_fetch: str = "hub"             # fetch-model: "hub" downloads the checkpoint, "none" does not
    hf_endpoint: str = "https://huggingface.co"
    hf_token_file: str | None = None     # a Hub token (orchestrator/modelfetch/access.py); else $HF_TOKEN
    fabric_topology: str = "switch"      # switch | direct | mesh (orchestrator/fabric/topology.py)
    api_listen: str | None = None        # None: the head's management address (docs/exposure.md)
    api_allow: tuple[str, ...] | None = None   # None: no API rule; else the admitted sources
    metrics_allow: tuple[str, ...] = ()  # who else may reach the head's supervisor port (Prometheus)
    firewall: str = "rules"              # rules | none (orchestrator/launch/firewall.py)
    supervise: bool = True               # orchestrator/launch/supervision.py
    distribution: str = "direct"         # direct | chain (orchestrator/chain/); load_inventory picks the default
    deployments: tuple[str, ...] = ()    # every deployment of the inventory, in its order (all.vars.deployments)
    router: "RouterConf | None" = None   # all.vars.router (orchestrator/router/)
    replica: tuple[str, int, int] | None = None   # (the replicated deployment, this one's index 1.., count)

    @property
    def replica_set(self) -> str:
        """The deployment this one is a replica of (its own name when it is not one)."""
        return self.replica[0] if self.replica else self.name

    @property
    def siblings(self) -> tuple[str, ...]:
        """The other replicas of its set (none when it is not a replica)."""
        if not self.replica:
            return ()
        return tuple(replica_name(self.replica[0], i) for i in range(1, self.replica[2] + 1) if i != self.replica[1])

    @property
    def head_host(self) -> Host:
        return next(h for h in self.hosts if h.name == self.head)

    @property
    def workers(self) -> tuple[Host, ...]:
        return tuple(h for h in self.hosts if h.name != self.head)

    @property
    def vars_key(self) -> str:
        """Where this deployment's variables are written: all.vars, or its entry of all.vars.deployments
        (for error messages)."""
        return f"all.vars.deployments.{self.name}" if self.deployments else "all.vars"

    @property
    def hosts_key(self) -> str:
        """Where this deployment's hosts are listed: all.hosts, or its entry's hosts list."""
        return f"{self.vars_key}.hosts" if self.deployments else "all.hosts"

    @property
    def peers(self) -> tuple[str, ...]:
        """The inventory's other deployments."""
        return tuple(n for n in self.deployments if n != self.name)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise InputError(f"no host named {name!r} (hosts: {', '.join(h.name for h in self.hosts)})",
                         file=str(self.file))


def _one_deployment(cvars: dict, hosts_raw: dict, name: str | None, err) -> tuple[dict, dict]:
    """all.vars.deployments -> the variables and hosts of deployment NAME, as if its inventory held
    only it: its keys over all.vars, its hosts in its order with ranks 0..n-1."""
    deps = cvars["deployments"]
    key = "all.vars.deployments"
    if not isinstance(deps, dict) or not deps:
        raise err("expected a mapping of deployment name: {hosts: [...], recipe: ...}", key)
    raw_deps, deps = deps, expand_replicas(deps, err)
    for k in ("deployment", "head", "recipe", "api_port"):
        if k in cvars:
            raise err(f"{k} belongs to each deployment when all.vars.deployments is set: move it under "
                      f"{key}.<name>", f"all.vars.{k}")
    if name is None:
        if len(deps) > 1 and len(raw_deps) == 1 and len(deps) > len(raw_deps):
            raise err(f"deployment {next(iter(raw_deps))} runs as {len(deps)} replicas ({', '.join(map(str, deps))}): "
                      f"pick one with --deployment NAME", key)
        if len(deps) > 1:
            raise err(f"this inventory holds {len(deps)} deployments ({', '.join(map(str, deps))}): pick one "
                      f"with --deployment NAME", key)
        name = str(next(iter(deps)))
    if name not in deps:
        if name in raw_deps:
            reps = [n for n in deps if isinstance(deps[n], dict) and deps[n].get(REPLICA, ("",))[0] == name]
            raise err(f"deployment {name!r} runs as {len(reps)} replicas ({', '.join(reps)}): `up -d {name}` changes "
                      f"them one at a time, `status`/`plan -d {name}` show each; other commands take one, "
                      f"-d {reps[0]}", key)
        raise err(f"no deployment {name!r} here (deployments: {', '.join(map(str, deps))})", key)
    d = dict(deps[name])
    replica = d.pop(REPLICA, None)
    dkey = f"{key}.{name}"
    if not isinstance(d, dict):
        raise err("expected a mapping (hosts, recipe, head, api_port, ...)", dkey)
    for k in d:
        if k not in DEPLOYMENT_KEYS:
            raise err(f"unknown key {k!r} (a deployment sets: {', '.join(DEPLOYMENT_KEYS)})", f"{dkey}.{k}")
    hosts = d.get("hosts")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise err("expected a list of this inventory's host names, in rank order", f"{dkey}.hosts")
    for h in hosts:
        if h not in hosts_raw:
            raise err(f"{h!r} is not a host of this inventory (hosts: {', '.join(hosts_raw)})", f"{dkey}.hosts")
        if "rank" in hosts_raw[h][0]:
            raise err("with all.vars.deployments a host's rank is its place in each deployment's hosts list: "
                      "remove it here", f"all.hosts.{h}.rank")
    if len(set(hosts)) != len(hosts):
        raise err("a host is listed twice", f"{dkey}.hosts")
    head = d.get("head", hosts[0])
    if head not in hosts:
        raise err(f"head {head!r} is not one of this deployment's hosts ({', '.join(hosts)})", f"{dkey}.head")
    hosts = [head] + [h for h in hosts if h != head]            # the head is rank 0
    out = {k: v for k, v in cvars.items() if k != "deployments"}
    out.update({k: v for k, v in d.items() if k != "hosts"})
    out["deployment"], out["head"] = name, head
    if replica:
        out[REPLICA] = replica
    return out, {h: ({**hosts_raw[h][0], "rank": i}, hosts_raw[h][1]) for i, h in enumerate(hosts)}


def _collect(group: dict, path: str, inherited: dict, file: str, out: dict, group_vars: dict) -> None:
    """Walk Ansible's group tree; host vars = group vars (outer to inner) + host's own."""
    if not isinstance(group, dict):
        raise InputError("expected a mapping (hosts, vars, children)", file=file, key=path)
    unknown = set(group) - {"hosts", "vars", "children"}
    if unknown:
        raise InputError(f"unknown key {sorted(unknown)[0]!r} (a group holds hosts, vars, children)",
                         file=file, key=f"{path}.{sorted(unknown)[0]}")
    gvars = group.get("vars") or {}
    if not isinstance(gvars, dict):
        raise InputError("expected a mapping", file=file, key=f"{path}.vars")
    merged = {**inherited, **gvars}
    group_vars[path] = gvars
    for name, hvars in (group.get("hosts") or {}).items():
        hvars = hvars or {}
        if not isinstance(hvars, dict):
            raise InputError("expected a mapping of host variables", file=file,
                             key=f"{path}.hosts.{name}")
        prev = out.get(str(name), ({}, ""))[0]
        out[str(name)] = ({**merged, **prev, **hvars}, f"{path}.hosts.{name}")
    for cname, child in (group.get("children") or {}).items():
        _collect(child or {}, f"{path}.children.{cname}", merged, file, out, group_vars)


def deployment_names(path: str | Path | None = None) -> list[str]:
    """The deployments an inventory holds: all.vars.deployments' names, or the one it describes."""
    p = Path(path) if path else Path(os.environ.get("DEPLOYCTL_INVENTORY", DEFAULT_INVENTORY))
    raw = yamlfile.load(p)
    cvars = ((raw.get("all") or {}).get("vars") or {}) if isinstance(raw.get("all"), dict) else {}
    deps = cvars.get("deployments") if isinstance(cvars, dict) else None
    if isinstance(deps, dict) and deps:
        def err(msg: str, key: str) -> InputError:
            return InputError(msg, file=str(p), key=key, line=raw.lines.get(key))
        return [str(k) for k in expand_replicas(deps, err)]
    if isinstance(cvars, dict) and ("replicas" in cvars or "groups" in cvars):
        n = len(cvars["groups"]) if isinstance(cvars.get("groups"), list) else cvars.get("replicas")
        base = str(cvars.get("deployment") or p.stem)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return [replica_name(base, i) for i in range(1, n + 1)]
        return [base]
    return [load_inventory(p).name]


def replica_names(path: "str | Path | None", base: str | None) -> list[str] | None:
    """The replicas (NAME.r1 ...) of deployment BASE in the inventory, or None when BASE is not replicated."""
    if not base:
        return None
    reps = [n for n in deployment_names(path) if n.startswith(base + ".r") and n[len(base) + 2:].isdigit()]
    return reps or None


def load_inventory(path: str | Path | None = None, deployment: str | None = None) -> Cluster:
    """The cluster one deployment runs on. An inventory with all.vars.deployments holds several: DEPLOYMENT
    (or the path's InventoryRef name) picks one, and its view has only its hosts, ranked by its list."""
    deployment = deployment or getattr(path, "deployment", None)
    p = Path(path) if path else Path(os.environ.get("DEPLOYCTL_INVENTORY", DEFAULT_INVENTORY))
    raw = yamlfile.load(p)
    file = str(p)

    def err(msg: str, key: str) -> InputError:
        return InputError(msg, file=file, key=key, line=raw.lines.get(key))

    def check(rule: checks.Check, value: Any, key: str) -> None:
        try:
            rule(value, file, key)
        except InputError as e:
            raise err(e.detail, key) from None

    if set(raw) != {"all"}:
        extra = sorted(set(raw) - {"all"})
        raise err(f"expected one top-level group 'all' (got {extra or 'nothing'})",
                  extra[0] if extra else "all")
    hosts_raw: dict[str, tuple[dict, str]] = {}
    group_vars: dict[str, dict] = {}
    _collect(raw["all"] or {}, "all", {}, file, hosts_raw, group_vars)
    cvars = group_vars.get("all", {})
    deployments: tuple[str, ...] = ()
    if ("replicas" in cvars or "groups" in cvars) and "deployments" not in cvars:
        cvars, hosts_raw = _single_as_deployments(cvars, hosts_raw, p.stem)
    all_hosts_raw = hosts_raw
    replica = None
    if "deployments" in cvars:
        cvars, hosts_raw = _one_deployment(cvars, hosts_raw, deployment, err)    # checks it is a mapping
        replica = cvars.pop(REPLICA, None)
        deployments = tuple(str(n) for n in expand_replicas(group_vars["all"]["deployments"], err)) \
            if "deployments" in group_vars["all"] else tuple(deployment_names(p))
    elif deployment and deployment != str(cvars.get("deployment") or p.stem):
        raise err(f"--deployment {deployment}: this inventory describes one deployment, "
                  f"{cvars.get('deployment') or p.stem!r} (several go under all.vars.deployments)", "all.vars")
    for k in cvars:
        if not k.startswith("ansible_") and k not in CLUSTER_KEYS and k not in HOST_KEYS:
            raise err(f"unknown variable {k!r} (cluster variables: {', '.join(CLUSTER_KEYS)}; "
                      f"host variables: {', '.join(HOST_KEYS)})", f"all.vars.{k}")
    if not hosts_raw:
        raise err("the inventory lists no hosts", "all")

    hosts = [_host(name, hv, key, file, raw.lines) for name, (hv, key) in hosts_raw.items()]
    hosts.sort(key=lambda h: h.rank)

    seen_ranks: dict[int, str] = {}
    seen_addr: dict[tuple[str, int], str] = {}
    for h in hosts:
        if h.rank in seen_ranks:
            raise err(f"duplicate rank {h.rank}: hosts {seen_ranks[h.rank]!r} and {h.name!r}; "
                      "give every host its own rank 0..N-1", f"all.hosts.{h.name}.rank")
        seen_ranks[h.rank] = h.name
        if (h.address, h.port) in seen_addr:
            raise err(f"duplicate address {h.address}:{h.port}: hosts {seen_addr[(h.address, h.port)]!r} "
                      f"and {h.name!r}", f"all.hosts.{h.name}.ansible_host")
        seen_addr[(h.address, h.port)] = h.name
    ranks = sorted(seen_ranks)
    if ranks != list(range(len(hosts))):
        raise err(f"ranks must be 0..{len(hosts) - 1} without gaps (got {ranks})", "all.hosts")

    head = cvars.get("head")
    if not head:
        raise err("missing head: set all.vars.head to the name of the rank-0 host", "all.vars.head")
    names = [h.name for h in hosts]
    if head not in names:
        raise err(f"head {head!r} is not a host of this inventory (hosts: {', '.join(names)})",
                  "all.vars.head")
    if seen_ranks[0] != head:
        raise err(f"head {head!r} has rank {next(h.rank for h in hosts if h.name == head)}; "
                  f"the head must be rank 0 ({seen_ranks[0]!r} is)", "all.vars.head")

    overrides = cvars.get("recipe_overrides") or {}
    if not isinstance(overrides, dict):
        raise err("expected a mapping of recipe key.path: value", "all.vars.recipe_overrides")
    # The deployment name goes into container names and run-record folders (runs/<stamp>-<name>-...)
    deployment = str(cvars.get("deployment") or p.stem)
    try:
        checks.name(deployment, file, "all.vars.deployment")
    except InputError as e:
        why = "" if cvars.get("deployment") else " (all.vars.deployment is unset: the name is this file's stem)"
        raise err(e.detail + why, "all.vars.deployment") from None
    for k in ("recipe", "known_hosts_file", "run_dir", "api_key_file", "hf_token_file"):
        check(checks.path, cvars.get(k), f"all.vars.{k}")
    api_port = cvars.get("api_port")
    if api_port is not None and (not isinstance(api_port, int) or not 0 < api_port < 65536):
        raise err(f"expected a TCP port number, got {api_port!r}", "all.vars.api_port")
    api_listen = cvars.get("api_listen")
    if api_listen is not None and not _listen_address(api_listen):
        raise err(f"expected an IP address on the head (or 0.0.0.0 / :: for every interface) or its host "
                  f"name, got {api_listen!r}", "all.vars.api_listen")
    api_allow = _sources(cvars, "api_allow", err)
    metrics_allow = _sources(cvars, "metrics_allow", err) or ()
    firewall = cvars.get("firewall", "rules")
    if firewall not in ("rules", "none"):
        raise err(f"expected rules or none, got {firewall!r}", "all.vars.firewall")
    supervise = cvars.get("supervise", True)
    if not isinstance(supervise, bool):
        raise err(f"expected true or false, got {supervise!r}", "all.vars.supervise")
    hkc = cvars.get("host_key_checking", True)
    if not isinstance(hkc, bool):
        raise err(f"expected true or false, got {hkc!r}", "all.vars.host_key_checking")
    key_file, key_env = cvars.get("api_key_file"), cvars.get("api_key_env")
    if key_file is not None and key_env is not None:
        raise err("set api_key_file or api_key_env, not both", "all.vars.api_key_env")
    if key_file is not None and (not isinstance(key_file, str) or not key_file.strip()):
        raise err(f"expected a file path, got {key_file!r}", "all.vars.api_key_file")
    if key_env is not None and not (isinstance(key_env, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env)):
        raise err(f"expected an environment variable name, got {key_env!r}", "all.vars.api_key_env")
    if key_file is not None:
        kf = Path(_expand(key_file) or "")
        key_file = str(kf if kf.is_absolute() else p.parent / kf)
    model_fetch = cvars.get("model_fetch", "hub")
    if model_fetch not in ("hub", "none"):
        raise err(f"expected hub or none, got {model_fetch!r}", "all.vars.model_fetch")
    hf_endpoint = cvars.get("hf_endpoint", "https://huggingface.co")
    if not (isinstance(hf_endpoint, str) and re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", hf_endpoint)):
        raise err(f"expected an http(s) URL such as https://huggingface.co, got {hf_endpoint!r}",
                  "all.vars.hf_endpoint")
    token_file = cvars.get("hf_token_file")
    if token_file is not None:
        tf = Path(_expand(str(token_file)) or "")
        token_file = str(tf if tf.is_absolute() else p.parent / tf)
    topology = cvars.get("fabric_topology", "switch")
    if topology not in TOPOLOGIES:
        raise err(f"expected one of {', '.join(TOPOLOGIES)}, got {topology!r}", "all.vars.fabric_topology")
    distribution = cvars.get("distribution", _default_distribution(hosts, topology))
    if distribution not in DISTRIBUTIONS:
        raise err(f"expected one of {', '.join(DISTRIBUTIONS)}, got {distribution!r}", "all.vars.distribution")
    _check_links(hosts, topology, err)
    router = None
    if cvars.get("router") not in (None, False):
        router = _router(cvars["router"], all_hosts_raw, raw, str(head), file, p, err)
    return Cluster(
        name=deployment,
        file=p,
        recipe=cvars.get("recipe"),
        head=str(head),
        api_port=api_port,
        hosts=tuple(hosts),
        known_hosts_file=_expand(cvars.get("known_hosts_file")),
        host_key_checking=hkc,
        recipe_overrides=tuple(_override(k, v, file, raw.lines) for k, v in overrides.items()),
        run_dir=str(cvars.get("run_dir", "runs")),
        api_key_file=key_file,
        api_key_env=key_env,
        model_fetch=model_fetch,
        hf_endpoint=hf_endpoint.rstrip("/"),
        hf_token_file=token_file,
        fabric_topology=topology,
        api_listen=api_listen,
        api_allow=api_allow,
        metrics_allow=metrics_allow,
        router=router,
        firewall=firewall,
        supervise=supervise,
        distribution=distribution,
        deployments=deployments,
        replica=replica,
    )


def _default_distribution(hosts: list, topology: str) -> str:
    """chain where the inventory declares the fabric (every host's fabric_address, or on a mesh its
    cables): image and checkpoint then travel over it, each byte out of the head once; else direct."""
    if len(hosts) < 2:
        return "direct"
    declared = all(h.fabric_links for h in hosts) if topology == "mesh" else all(h.fabric_address for h in hosts)
    return "chain" if declared else "direct"


def _sources(cvars: dict, key: str, err) -> tuple[str, ...] | None:
    """all.vars.KEY: a list of addresses or networks, normalised (None when absent)."""
    v = cvars.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not v:
        raise err(f"expected a list of addresses or networks (10.0.0.5, 10.0.0.0/24), got {v!r}", f"all.vars.{key}")
    for i, src in enumerate(v):
        try:
            ipaddress.ip_network(str(src), strict=False)
        except ValueError:
            raise err(f"expected an address or a network such as 10.0.0.0/24, got {src!r}",
                      f"all.vars.{key}[{i}]") from None
    return tuple(str(ipaddress.ip_network(str(x), strict=False)) for x in v)


def _listen_address(v: Any) -> bool:
    """An IP literal or a DNS host name: what vLLM's and SGLang's --host accept (uvicorn binds it)."""
    if not isinstance(v, str):
        return False
    try:
        ipaddress.ip_address(v)
        return True
    except ValueError:
        return bool(re.fullmatch(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?"
                                 r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*", v))


def _check_links(hosts: list[Host], topology: str, err) -> None:
    """Mesh links name hosts of this inventory, and both ends of a cable agree on its subnet."""
    by_name = {h.name: h for h in hosts}
    if topology == "direct" and len(hosts) != 2:
        raise err(f"fabric_topology direct is one cable between two hosts; this inventory has {len(hosts)} "
                  "(use switch or mesh)", "all.vars.fabric_topology")
    if topology != "mesh":
        linked = next((h for h in hosts if h.fabric_links), None)
        if linked:
            raise err(f"fabric_links is for fabric_topology: mesh (this inventory's topology is {topology})",
                      f"all.hosts.{linked.name}.fabric_links")
        return
    for h in hosts:
        if not h.fabric_links and len(hosts) > 1:
            raise err(f"host {h.name}: fabric_topology mesh needs fabric_links (its cable to each peer)",
                      f"all.hosts.{h.name}.fabric_links")
        for link in h.fabric_links:
            key = f"all.hosts.{h.name}.fabric_links.{link.peer}"
            peer = by_name.get(link.peer)
            if peer is None or peer.name == h.name:
                raise err(f"host {h.name}: fabric_links names {link.peer!r}, not another host of this "
                          f"inventory (hosts: {', '.join(by_name)})", key)
            back = next((x for x in peer.fabric_links if x.peer == h.name), None)
            if back is None:
                raise err(f"host {h.name} has a link to {peer.name}, but {peer.name}'s fabric_links has "
                          f"none back to {h.name}: describe both ends of the cable", key)
            if back.network != link.network:
                raise err(f"the cable {h.name}-{peer.name} has two subnets: {link.address} is in "
                          f"{link.network}, {back.address} in {back.network}; both ends need one subnet", key)


def _router(raw_conf: Any, hosts_raw: dict, raw: Any, head: str, file: str, p: Path, err) -> "RouterConf":
    """all.vars.router; its host is any host of the inventory (by default the first deployment's head)."""
    from .router.config import parse
    cvars = raw["all"].get("vars") or {}
    deps = cvars.get("deployments")
    default = head
    if isinstance(deps, dict) and deps:
        first = next(iter(deps.values())) or {}
        default = str(first.get("head") or (first.get("hosts") or [head])[0])

    def host_of(name: str) -> Host:
        if name not in hosts_raw:
            raise err(f"{name!r} is not a host of this inventory (hosts: {', '.join(hosts_raw)})",
                      "all.vars.router.host")
        hv, key = hosts_raw[name]
        return _host(name, {**hv, "rank": hv.get("rank", 0)}, key, file, raw.lines)

    def resolve(path: str) -> str:
        f = Path(_expand(path) or "")
        return str(f if f.is_absolute() else p.parent / f)
    return parse(raw_conf, default, host_of, err, resolve)


def _host(name: str, hv: dict, key: str, file: str, lines: dict[str, int]) -> Host:
    def err(msg: str, sub: str) -> InputError:
        k = f"{key}.{sub}" if sub else key
        return InputError(f"host {name}: {msg}", file=file, key=k, line=lines.get(k) or lines.get(key))

    def check(rule: checks.Check, sub: str) -> None:
        try:
            rule(hv.get(sub), file, sub)
        except InputError as e:
            raise err(e.detail, sub) from None

    try:        # the host's name is part of its container's name and of its log folder
        checks.name(name, file, key)
    except InputError as e:
        raise err(e.detail, "") from None

    for k in hv:
        if not k.startswith("ansible_") and k not in HOST_KEYS and k not in CLUSTER_KEYS:
            raise err(f"unknown variable {k!r} (host variables: {', '.join(HOST_KEYS)})", k)
    address = hv.get("ansible_host")
    if not address:
        raise err("missing ansible_host (the host's address)", "ansible_host")
    for req in ("rank", "hardware", "nvme_dir", "model_cache"):
        if req not in hv:
            raise err(f"missing {req} ({HOST_KEYS[req]})", req)
    rank = hv["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise err(f"rank must be a non-negative integer, got {rank!r}", "rank")
    hardware = hv["hardware"]
    if hardware not in KINDS:
        raise err(f"unknown hardware {hardware!r} (known: {', '.join(KINDS)})", "hardware")
    gpus = hv.get("gpus", KINDS[hardware].default_gpus)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise err(f"gpus must be a non-negative integer, got {gpus!r}", "gpus")
    port = hv.get("ansible_port", 22)
    if "ansible_port" in hv:
        check(checks.port, "ansible_port")
    for sub in ("nvme_dir", "model_cache"):
        if not isinstance(hv[sub], str) or not hv[sub].strip():
            raise err(f"{sub} must be a folder path, got {hv[sub]!r}", sub)
    for sub in ("nvme_dir", "model_cache", "docker_host", "ansible_ssh_private_key_file", "fabric_iface",
                "fabric_address", "expect_arch"):
        check(checks.path, sub)
    expect_gpus = hv.get("expect_gpus", True)
    if not isinstance(expect_gpus, bool):
        raise err(f"expect_gpus must be true or false, got {expect_gpus!r}", "expect_gpus")
    expect_arch = hv.get("expect_arch")
    if expect_arch is not None and (not isinstance(expect_arch, str) or not expect_arch.strip()):
        raise err(f"expect_arch must be a machine name such as x86_64 or aarch64, got {expect_arch!r}",
                  "expect_arch")
    host_ram = hv.get("host_ram_gb")
    if host_ram is not None and (isinstance(host_ram, bool) or not isinstance(host_ram, (int, float))
                                 or host_ram <= 0):
        raise err(f"host_ram_gb must be a positive number of GB, got {host_ram!r}", "host_ram_gb")
    cpus = hv.get("compute_cpus", "")
    if isinstance(cpus, int) and not isinstance(cpus, bool):
        cpus = str(cpus)                     # `compute_cpus: 0` in YAML
    if not isinstance(cpus, str) or (cpus and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", cpus)):
        raise err(f"compute_cpus must be CPU numbers and ranges (0-3 or 0,2), got {cpus!r}", "compute_cpus")
    fabric_address, fabric_network = _cidr(hv.get("fabric_address"), "fabric_address", err)
    links = hv.get("fabric_links") or {}
    if not isinstance(links, dict):
        raise err("fabric_links must map each peer host to {iface: NETDEV, address: A.B.C.D/NN}", "fabric_links")
    fabric_links = []
    for peer, spec in links.items():
        sub = f"fabric_links.{peer}"
        if not isinstance(spec, dict) or set(spec) != {"iface", "address"}:
            raise err(f"expected {{iface: NETDEV, address: A.B.C.D/NN}}, got {spec!r}", sub)
        if not (isinstance(spec["iface"], str) and re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", spec["iface"])):
            raise err(f"iface must be a network interface name, got {spec['iface']!r}", f"{sub}.iface")
        addr, net = _cidr(spec["address"], f"{sub}.address", err, need_prefix=True)
        fabric_links.append(FabricLink(str(peer), spec["iface"], str(addr), str(net)))
    return Host(
        name=name, address=str(address), rank=rank, hardware=hardware, gpus=gpus,
        nvme_dir=str(hv["nvme_dir"]), model_cache=str(hv["model_cache"]), port=port,
        user=str(hv.get("ansible_user", "root")),
        key_file=_expand(hv.get("ansible_ssh_private_key_file")),
        fabric_iface=hv.get("fabric_iface"), fabric_address=fabric_address, fabric_network=fabric_network,
        fabric_links=tuple(fabric_links),
        docker_host=str(hv.get("docker_host", "unix:///var/run/docker.sock")),
        expect_gpus=expect_gpus, expect_arch=expect_arch,
        host_ram_gb=float(host_ram) if host_ram is not None else None, compute_cpus=cpus,
        ansible_vars={k: v for k, v in hv.items() if k.startswith("ansible_")},
    )


def _cidr(value: Any, sub: str, err, need_prefix: bool = False) -> tuple[str | None, str | None]:
    """'A.B.C.D' or 'A.B.C.D/NN' -> (address, network or None)."""
    if value is None:
        return None, None
    try:
        itf = ipaddress.IPv4Interface(str(value))
    except ValueError:
        raise err(f"{sub.split('.')[-1]} must be an IPv4 address, optionally with its prefix "
                  f"(192.168.100.11/24), got {value!r}", sub) from None
    has_prefix = "/" in str(value)
    if need_prefix and not has_prefix:
        raise err(f"give the address with its prefix (e.g. {value}/30): the link's subnet", sub)
    return str(itf.ip), (str(itf.network) if has_prefix else None)


def _expand(p: Any) -> str | None:
    return os.path.expanduser(str(p)) if p else None


def _override(path: Any, value: Any, file: str, lines: dict[str, int]) -> Override:
    # JSON is valid YAML: the value round-trips through parse_set unchanged (a string stays a string).
    key = f"all.vars.recipe_overrides.{path}"
    return Override(f"{path}={json.dumps(value)}", file, key, lines.get(key))
