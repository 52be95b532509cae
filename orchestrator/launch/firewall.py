"""Host firewall rules of the deployment's own, where binding cannot confine a port (#37).

What binding does not do: PyTorch's TCPStore (vLLM's rendezvous on the head's --master-port) listens
on every interface whatever --master-addr says (torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp,
`LibUVTCPServer::createServer` binds `::`, else `0.0.0.0`), and it is unauthenticated (vLLM's
security guide: inter-node traffic must stay on an isolated network). So on every host of a
multi-node deployment (and on the head when api_allow is set) deployctl installs, in the filter table, one chain of its own per deployment (`DCTL-<hash>`, IPv4 and
IPv6) and one jump to it at the top of INPUT, commented `deployctl <deployment>`:

- loopback and established connections: RETURN (the head's own ranks reach their store over lo);
- the head's rendezvous store (every interface): RETURN for the deployment's hosts' fabric addresses
  (the inventory's and the ones launch detects), REJECT (tcp-reset: refused at once, no hang) for
  every other source;
- every host's fabric addresses, on the host's ephemeral ports (ip_local_port_range, read there):
  RETURN for the fabric's subnets, REJECT for the rest. The engine's other listeners (gloo pairs,
  message queues) are bound to the fabric address (VLLM_HOST_IP, GLOO_SOCKET_IFNAME), but a Linux
  host accepts a packet for any of its addresses on any link, so a machine on the management
  network that routes to the fabric address reaches them;
- the API port, only when the inventory lists `api_allow`: RETURN for those sources, REJECT the
  rest; without api_allow the chain RETURNs the API port before anything else;
- the status page's port on the head (supervise.page_port) as the API's: with api_allow only from those;
- the head's supervisor port (workers' reports, its /metrics): RETURN for the deployment's
  management addresses and `metrics_allow` (the Prometheus host), REJECT the rest.

The chain only ever rejects: what it lets through RETURNs to INPUT, so the operator's own firewall
(ufw, firewalld, nftables) still decides, and nothing it blocks is opened. Docker's own rules live in
FORWARD, nat and DOCKER-USER, for bridged containers; the engines run with --network host, so their
traffic meets INPUT only and Docker's chains are untouched. Applying is `iptables-restore --noflush`
of the chain (atomic: an existing chain is flushed and refilled in one commit) and an `-I INPUT 1`
jump only when `-C` finds none: a re-run leaves exactly one jump and the same rules. `down` removes
the jump and the chain on every host of the inventory. Pure planning here; `apply_host` and
`remove_host` run it.
"""
from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from . import status_page, supervision

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..executors.shells import HostShell
    from ..inventory import Host

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Ruleset:
    host: str
    chain: str
    comment: str
    v4: str                 # iptables-restore input ("" = no rule for this family)
    v6: str
    summary: tuple[str, ...]   # one line per rule group, for plans and logs

    @property
    def empty(self) -> bool:
        return not (self.v4 or self.v6)

    def to_json(self) -> dict:
        return {"chain": self.chain, "comment": self.comment, "rules": list(self.summary),
                "iptables_restore": self.v4, "ip6tables_restore": self.v6}


def chain_name(deployment: str) -> str:
    """iptables chain names are at most 28 characters: a digest of the name, not the name."""
    return "DCTL-" + hashlib.sha256(deployment.encode()).hexdigest()[:12]


def jump_comment(deployment: str) -> str:
    """The comment on the INPUT jump: what `iptables -S` shows an operator, and what -C/-D match."""
    return f"deployctl {deployment}"


def internal_ports(dep: "Deployment", host: "Host") -> tuple[int, ...]:
    """The ports of HOST that listen on every interface and serve only the deployment's own nodes."""
    if dep.recipe.parallelism.nodes > 1 and host.name == dep.cluster.head:
        return (dep.recipe.engine.master_port,)
    return ()


def fabric_addresses(host: "Host", detected: dict[str, tuple[str, str]]) -> set[str]:
    """HOST's fabric addresses: the one launch detected, the inventory's, its mesh links'."""
    found = {detected[host.name][0]} if detected.get(host.name) else set()
    if host.fabric_address:
        found.add(host.fabric_address)
    found.update(link.address for link in host.fabric_links)
    return found


def peer_sources(dep: "Deployment", detected: dict[str, tuple[str, str]] | None = None) -> tuple[str, ...]:
    """The deployment's hosts' fabric addresses, sorted, no duplicates."""
    found = set().union(*(fabric_addresses(h, detected or {}) for h in dep.cluster.hosts))
    return tuple(sorted(found, key=_sort_key))


def fabric_networks(dep: "Deployment", detected: dict[str, tuple[str, str]] | None = None) -> tuple[str, ...]:
    """The fabric's subnets (detected, the inventory's prefixes, the mesh links'); a host whose subnet
    is not known counts with its address alone."""
    found: set[str] = set()
    for h in dep.cluster.hosts:
        addr, net = (detected or {}).get(h.name) or ("", "")
        net = net or h.fabric_network or ""
        found.add(net or addr or h.fabric_address or "")
        found.update(link.network or link.address for link in h.fabric_links)
    found.discard("")
    return tuple(sorted({str(ipaddress.ip_network(x, strict=False)) for x in found}, key=_sort_key))


def ruleset(dep: "Deployment", host: "Host", detected: dict[str, tuple[str, str]] | None = None) -> Ruleset:
    """HOST's rules; DETECTED: {host: (address, network) of the fabric launch detected there}.
    EPHEMERAL in the text stands for the host's own ip_local_port_range, filled in on the host
    (APPLY_SH). The store admits the deployment's fabric addresses only; the ephemeral ports admit
    the fabric's subnets, so that a chain left by one deployment never refuses another's peers on
    the same fabric."""
    chain, comment = chain_name(dep.name), jump_comment(dep.name)
    multi = dep.recipe.parallelism.nodes > 1
    ports = internal_ports(dep, host)
    head = host.name == dep.cluster.head
    allow = dep.cluster.api_allow if head else None
    if dep.cluster.firewall == "none" or not (multi or allow):
        return Ruleset(host.name, chain, comment, "", "", ())
    peers = peer_sources(dep, detected)
    own = sorted(fabric_addresses(host, detected or {}), key=_sort_key) if multi else []
    rules: dict[int, list[str]] = {4: [], 6: []}
    summary = []

    def guard(port: str, sources: Iterable[str], what: str, dest: str = "") -> None:
        srcs, d = list(sources), (f" -d {dest}" if dest else "")
        for fam, out in rules.items():
            if dest and _family(dest) != fam:
                continue
            out += [f"-A {chain}{d} -p tcp --dport {port} -s {s} -j RETURN" for s in srcs if _family(s) == fam]
            out.append(f"-A {chain}{d} -p tcp --dport {port} -j REJECT --reject-with tcp-reset")
        summary.append(f"tcp {port.replace('EPHEMERAL', 'ephemeral ports')}{' on ' + dest if dest else ''} "
                       f"({what}): only from {', '.join(srcs) or 'this host'} and loopback, new connections "
                       "from anywhere else refused")

    for port in ports:
        guard(str(port), peers, "the rendezvous store, on every interface: the deployment's fabric addresses")
    nets = fabric_networks(dep, detected)
    for addr in own:     # the engine's other listeners are bound here, on ephemeral ports (gloo, message queues)
        guard("EPHEMERAL", nets, "the engine's fabric listeners: the fabric", addr)
    page = status_page.port(dep) if head else None        # the status page: admitted like the API
    if allow:
        guard(str(dep.api_port), allow, "the API: all.vars.api_allow")
        if page:
            guard(str(page), allow, "the status page, like the API: all.vars.api_allow")
    control = supervision.head_port(dep) if head and multi else None
    if control:
        mgmt = management_sources(dep)
        if mgmt is not None:
            extra = list(dep.cluster.metrics_allow)
            guard(str(control), mgmt + extra, "the supervisor's control endpoint and /metrics: the deployment's "
                  "management addresses" + (" and all.vars.metrics_allow" if extra else ""))
        else:
            summary.append(f"tcp {control} (the supervisor's control endpoint): not confined, a host's "
                           "ansible_host is a name, not an address (its bearer token still guards it)")
    top = [f"-A {chain} -i lo -j RETURN", f"-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j RETURN"]
    if head and not allow:      # the API is never touched unless api_allow asks
        top.append(f"-A {chain} -p tcp --dport {dep.api_port} -j RETURN")
        if page:
            top.append(f"-A {chain} -p tcp --dport {page} -j RETURN")
    text = {fam: "".join(f"{line}\n" for line in ["*filter", f":{chain} - [0:0]", *top, *out, "COMMIT"])
            for fam, out in rules.items()}
    return Ruleset(host.name, chain, comment, text[4], text[6], tuple(summary))


def management_sources(dep: "Deployment") -> list[str] | None:
    """The deployment's hosts' management addresses, or None when one of them is a host name."""
    out = []
    for h in dep.cluster.hosts:
        try:
            out.append(str(ipaddress.ip_address(h.address)))
        except ValueError:
            return None
    return sorted(set(out), key=_sort_key)


# -- side effects ---------------------------------------------------------------------------------
# One round trip per host; every value is a positional argument of `sh -c` (never shell text).
# Root, or passwordless sudo; a host without IPv6 skips ip6tables.
_PRE = ('S=; [ "$(id -u)" = 0 ] || S="sudo -n"; '
        'v6() { [ -e /proc/net/if_inet6 ] && command -v ip6tables >/dev/null 2>&1; }; ')
APPLY_SH = (_PRE +
            'R=$(tr -s " \\t" : < /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null); '
            'case "$R" in *[!0-9:]*|"") R=32768:60999;; esac; '
            'printf %s "$1" | sed "s/EPHEMERAL/$R/g" | $S iptables-restore --noflush || exit 3; '
            '$S iptables -C INPUT -m comment --comment "$4" -j "$3" 2>/dev/null '
            '|| $S iptables -I INPUT 1 -m comment --comment "$4" -j "$3" || exit 4; '
            'if v6; then printf %s "$2" | sed "s/EPHEMERAL/$R/g" | $S ip6tables-restore --noflush || exit 5; '
            '$S ip6tables -C INPUT -m comment --comment "$4" -j "$3" 2>/dev/null '
            '|| $S ip6tables -I INPUT 1 -m comment --comment "$4" -j "$3" || exit 6; fi; '
            '$S iptables -S 2>/dev/null; true')      # what else guards this host (other_guards)
REMOVE_SH = (_PRE +
             'for t in iptables ip6tables; do [ $t = iptables ] || v6 || continue; '
             'command -v $t >/dev/null 2>&1 || continue; '
             'while $S $t -D INPUT -m comment --comment "$2" -j "$1" 2>/dev/null; do :; done; '
             'if $S $t -S "$1" >/dev/null 2>&1; then $S $t -F "$1" && $S $t -X "$1" || exit 7; '
             'echo "removed $t chain $1"; fi; done')
READ_SH = _PRE + '$S iptables -S "$1" 2>/dev/null; true'     # "" when the chain is not there


def apply_host(sh: "HostShell", rs: Ruleset) -> tuple[str, list[str]]:
    """Install RS on its host (idempotent), or remove the deployment's chain when RS is empty; returns
    what was done and what other deployments' chains refuse on RS's ports (other_guards)."""
    if rs.empty:
        return remove_host(sh, rs.chain, rs.comment), []
    r = sh.run(["sh", "-c", APPLY_SH, "sh", rs.v4, rs.v6, rs.chain, rs.comment], timeout=TIMEOUT_S)
    if r.rc != 0:
        step = {3: "iptables-restore", 4: "iptables -I INPUT", 5: "ip6tables-restore",
                6: "ip6tables -I INPUT"}.get(r.rc, "sh")
        raise RuntimeError(f"firewall rules of {rs.comment} not installed: {step} failed (exit {r.rc}): "
                           f"{(r.stderr or r.stdout).strip()[-300:]}; deployctl needs root or passwordless "
                           "sudo and iptables on the host (or set all.vars.firewall: none)")
    return f"firewall chain {rs.chain}: " + "; ".join(rs.summary), other_guards(r.stdout, rs)


_JUMP = re.compile(r'^-A INPUT -m comment --comment "deployctl (\S+)" -j (DCTL-[0-9a-f]+)\s*$')
_REJECT = re.compile(r'^-A (DCTL-[0-9a-f]+) .*--dport (\d+) .*-j REJECT')
_OWN_PORT = re.compile(r'--dport (\d+) .*-j REJECT')


def other_guards(rules: str, rs: Ruleset) -> list[str]:
    """What another deployment's chain on this host refuses on a port RS guards (RULES: `iptables -S`).
    A packet must pass every chain INPUT jumps to, so a chain left by a deployment that was never taken
    down keeps refusing on its ports whatever this deployment admits (its Prometheus host, say). Pure."""
    lines = rules.splitlines()
    owner = {m.group(2): m.group(1) for m in map(_JUMP.match, lines) if m and m.group(2) != rs.chain}
    mine = {int(m.group(1)) for m in map(_OWN_PORT.search, rs.v4.splitlines()) if m}
    seen: dict[tuple[str, int], None] = {}
    for m in map(_REJECT.match, lines):
        if m and m.group(1) in owner and int(m.group(2)) in mine:
            seen[(owner[m.group(1)], int(m.group(2)))] = None
    return [f"deployment {dep}'s firewall chain ({chain_name(dep)}) here also refuses tcp {port} to all but "
            f"its own sources: only what both admit gets through (a deployment never taken down? `deployctl "
            f"down` it, or give this one another port)" for dep, port in seen]


def remove_host(sh: "HostShell", chain: str, comment: str) -> str:
    r = sh.run(["sh", "-c", REMOVE_SH, "sh", chain, comment], timeout=TIMEOUT_S)
    if r.rc != 0:
        raise RuntimeError(f"firewall chain {chain} not removed (exit {r.rc}): "
                           f"{(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout.strip().replace("\n", "; ") or f"no firewall chain {chain}"


def read_chain(sh: "HostShell", chain: str) -> str:
    """`iptables -S CHAIN` on the host (status --exposure reads what the chain admits)."""
    return sh.run(["sh", "-c", READ_SH, "sh", chain], timeout=TIMEOUT_S).stdout


def _family(addr: str) -> int:
    return ipaddress.ip_network(addr, strict=False).version


def _sort_key(addr: str) -> tuple[int, int]:
    n = ipaddress.ip_network(addr, strict=False)
    return n.version, int(n.network_address)
