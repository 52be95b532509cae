"""What a deployment listens on, read from each host itself (`deployctl status --exposure`).

Per host: every TCP and UDP socket that a process of the deployment's containers holds open for
listening, with its address, port and process, and who can reach it given the address it is bound
to. Read with the host's own tools, nothing installed:
- `ss -H -l -n -p -t -u` (iproute2): the listening sockets and the processes holding them (the
  engine containers run with --network host, so their sockets are the host's);
- `docker top <container> -eo pid`: the host PIDs of each container's processes;
- `ip -j addr show`: which interface holds which address.
- `iptables -S <the deployment's chain>` (firewall.py): the ports it confines and to whom.
Who can reach a socket follows from its address, and for a port the deployment's chain guards, from
the sources the chain admits: a wildcard address (0.0.0.0, ::, *) is reachable over every network
the host is on, the management network included. vLLM's own security guide says the inter-node
ports (torch.distributed's TCPStore, gloo/NCCL) are unauthenticated; an internal port reachable from
the management network, unguarded, is flagged.
"""
from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from ..deployment import WILDCARD_ADDRESSES, Deployment
from ..executors.shells import HostShell, Shells
from ..outcomes import parallel
from .containers import list_containers
from .firewall import chain_name, read_chain
from . import status_page, supervision

SS_ARGV = ("ss", "-H", "-l", "-n", "-p", "-t", "-u")
ADDR_ARGV = ("ip", "-j", "addr", "show")
TIMEOUT_S = 30.0
WILDCARDS = WILDCARD_ADDRESSES | {"*"}          # ss prints a dual-stack wildcard as *
_RULE = re.compile(r"^-A \S+ (?=.*--dport (\d+(?::\d+)?))(?=.*-j (RETURN|REJECT|DROP))")
_USER = re.compile(r'\("((?:[^"\\]|\\.)*)",pid=(\d+),fd=\d+\)')


@dataclass(frozen=True)
class Socket:
    proto: str          # tcp | udp
    address: str        # as bound: 0.0.0.0, ::, *, or one address
    port: int
    process: str        # the process name ss shows
    pid: int
    container: str = ""  # short id of the deployment's container holding it
    scope: str = ""      # every interface | loopback | management | fabric | interface <name>
    reachable_from: str = ""
    concern: str = ""    # why this one is exposed beyond where it belongs ("" = fine)
    serves: str = ""     # what deployctl serves there, where known (the API, the supervisor, the status page)


def parse_ss(text: str) -> list[Socket]:
    """`ss -H -l -n -p -t -u` lines -> one Socket per (socket, process) pair."""
    out = []
    for line in text.splitlines():
        f = line.split(None, 6)
        if len(f) < 6 or f[0] not in ("tcp", "udp"):
            continue
        host, _, port = f[4].rpartition(":")
        host = host.split("%")[0].strip("[]")       # 127.0.0.53%lo:53, [::]:8000
        if not port.isdigit():
            continue
        for name, pid in _USER.findall(f[6] if len(f) > 6 else ""):
            out.append(Socket(f[0], host, int(port), name, int(pid)))
    return out


def parse_addresses(text: str) -> dict[str, str]:
    """`ip -j addr show` -> {address: interface}."""
    try:
        links = json.loads(text or "[]")
    except ValueError:
        return {}
    return {a["local"]: link.get("ifname", "?") for link in links if isinstance(link, dict)
            for a in link.get("addr_info") or () if isinstance(a, dict) and a.get("local")}


def parse_top(text: str) -> set[int]:
    """`docker top <id> -eo pid` -> the PIDs (the first line is the header)."""
    return {int(x) for x in text.split()[1:] if x.isdigit()}


@dataclass(frozen=True)
class Guard:
    """A port range the deployment's chain refuses new connections on, except from SOURCES."""
    dest: str           # "" = every address of the host
    low: int
    high: int
    sources: tuple[str, ...]

    def covers(self, address: str, port: int) -> bool:
        return self.low <= port <= self.high and (not self.dest or self.dest == address)


def parse_chain(text: str) -> list[Guard]:
    """`iptables -S <chain>` -> the guards: each (destination, port range) with a REJECT or DROP for
    every other source, and the sources RETURNed before it."""
    admitted: dict[tuple[str, str], list[str]] = {}
    out = []
    for line in text.splitlines():
        m = _RULE.match(line.strip())
        if not m:
            continue
        ports, verdict = m.group(1), m.group(2)
        d, src = re.search(r" -d (\S+)", line), re.search(r" -s (\S+)", line)
        src = src.group(1) if src else None
        key = ((d.group(1) if d else "").removesuffix("/32"), ports)
        if verdict == "RETURN" and src:
            admitted.setdefault(key, []).append(src.removesuffix("/32").removesuffix("/128"))
        elif verdict in ("REJECT", "DROP") and not src:
            low, _, high = ports.partition(":")
            out.append(Guard(key[0], int(low), int(high or low), tuple(admitted.get(key, ()))))
    return out


def classify(s: Socket, host, addresses: dict[str, str], api_port: int,
             guards: list[Guard] | None = None, chain: str = "", served: tuple[int, ...] = (),
             api_like: tuple[int, ...] = ()) -> Socket:
    """Scope, who can reach it, and a concern when an internal port is reachable beyond the fabric
    (GUARDS: the ports the deployment's firewall chain confines, and to whom; SERVED: ports meant for
    the management network when bound to its address: the supervisor's, token-guarded reports and a
    read-only /metrics; API_LIKE: ports bound and admitted like the API, the status page's)."""
    mgmt, fabric_addr, fabric_iface = host.address, host.fabric_address, host.fabric_iface
    nets = [f"{a} ({i}{', management' if a == mgmt else ''}"
            f"{', fabric' if a == fabric_addr or (fabric_iface and i == fabric_iface) else ''})"
            for a, i in sorted(addresses.items()) if not _loopback(a) and ":" not in a]
    iface = addresses.get(s.address, "")
    if s.address in WILDCARDS:
        scope, reach = "every interface", "every network of this host: " + (", ".join(nets) or "?")
    elif _loopback(s.address):
        scope, reach = "loopback", "this host only"
    elif s.address == mgmt:
        scope, reach = "management", f"the management network ({mgmt})"
    elif s.address == fabric_addr or (fabric_iface and iface == fabric_iface):
        scope, reach = "fabric", f"the fabric ({s.address} on {iface or fabric_iface})"
    else:
        scope, reach = f"interface {iface or '?'}", f"the network of {s.address} ({iface or 'unknown interface'})"
    concern = ""
    guard = next((g for g in guards or () if g.covers(s.address, s.port)), None)
    if guard and scope != "loopback" and (s.address not in WILDCARDS or not guard.dest):
        reach = (f"only {', '.join(guard.sources) or 'this host'} and loopback (firewall chain {chain}; "
                 f"bound to {reach})")
    elif s.port != api_port and s.port not in api_like and scope in ("every interface", "management") and \
            not (s.port in served and scope == "management"):
        concern = ("an internal port reachable from the management network (unauthenticated inter-node "
                   "traffic: bind it to the fabric or firewall it)")
    return Socket(**{**asdict(s), "scope": scope, "reachable_from": reach, "concern": concern})


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def read_host(dep: Deployment, sh: HostShell) -> dict[str, Any]:
    """One host's listening sockets of the deployment's containers, classified."""
    cs = [c.short_id for c in list_containers(sh, dep.name, timeout=TIMEOUT_S) if c.running]
    cs += [a[0][:12] for a in supervision.agents(sh, dep) if a[1] == "running"]     # its control endpoint
    pids: dict[int, str] = {}
    for cid in cs:
        r = sh.run(sh.docker("top", cid, "-eo", "pid"), timeout=TIMEOUT_S)
        if r.rc != 0:
            raise RuntimeError(f"docker top {cid} failed (exit {r.rc}): {r.stderr.strip()[-300:]}")
        pids.update({p: cid for p in parse_top(r.stdout)})
    ss = sh.run(list(SS_ARGV), timeout=TIMEOUT_S)
    if ss.rc != 0:
        raise RuntimeError(f"{' '.join(SS_ARGV)} failed (exit {ss.rc}): {ss.stderr.strip()[-300:]}")
    addrs = parse_addresses(sh.run(list(ADDR_ARGV), timeout=TIMEOUT_S).stdout)
    chain = chain_name(dep.name)
    guards = parse_chain(read_chain(sh, chain))
    head = sh.host.name == dep.cluster.head
    api_port = dep.api_port if head else -1
    served = (supervision.head_port(dep),) if head and supervision.head_port(dep) else ()
    page = (status_page.port(dep),) if head and status_page.port(dep) else ()
    roles = {dep.api_port: "the API", **{p: "the supervisor (agents' reports, /metrics)" for p in served},
             **{p: "the status page (docs/status-page.md)" for p in page}} if head else {}
    seen, out = set(), []
    for s in parse_ss(ss.stdout):
        key = (s.proto, s.address, s.port)
        if s.pid not in pids or key in seen:
            continue
        seen.add(key)
        out.append(classify(Socket(**{**asdict(s), "container": pids[s.pid], "serves": roles.get(s.port, "")}),
                            sh.host, addrs, api_port, guards, chain, served, page))
    out.sort(key=lambda s: (s.proto, s.port, s.address))
    return {"containers": cs, "sockets": [asdict(s) for s in out],
            "firewall": {"chain": chain, "guards": [asdict(g) for g in guards]}}


def collect(dep: Deployment) -> dict[str, dict[str, Any]]:
    """{host: {"containers": [...], "sockets": [...]} or {"error": ...}} for every host, in parallel."""
    with Shells(dep.cluster) as shells:
        res = parallel([h.name for h in dep.cluster.hosts], lambda n: read_host(dep, shells[n]))
    return {n: ({"error": f"{type(v).__name__}: {v}"} if isinstance(v, BaseException) else v)
            for n, v in res.items()}
