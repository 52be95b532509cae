"""Which network carries NCCL/GLOO/UCX traffic on each host, decided per host from its facts.

Cabling can differ between nodes, so every host is detected on its own (the head's
interface names are never pushed to workers). A fabric netdev backs an ACTIVE RoCE
port (/sys/class/infiniband/*/ports/*/state); a wireless interface is never chosen.
Without RDMA (e.g. the test cluster) the interface that routes to the head is used
and NCCL is told to use sockets.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import InputError

if TYPE_CHECKING:
    from ..inventory import Cluster, Host

# Run on each host (python3 is there; Ansible needs it too). Prints one JSON object. Per netdev also
# its MTU, negotiated speed (Mb/s; -1 or "" when unknown) and MAC, the tools the fabric check uses,
# and the boot id (orchestrator/fabric/ reads them; a changed one invalidates its cache).
FACTS_SCRIPT = r"""
import glob, json, os, subprocess, sys
head = sys.argv[1]
def rd(p):
    try:
        return open(p).read().strip()
    except OSError:
        return ""
net = {}
def sysfs(n):
    d = "/sys/class/net/" + n
    return {"wireless": os.path.exists(d + "/wireless"), "speed": rd(d + "/speed")}
try:
    # the netdevs as netlink sees them in this network namespace (sysfs shows the namespace that
    # mounted /sys: not this one in a container or a test host)
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True,
                                      timeout=10).stdout)
    for l in links:
        n = l["ifname"]
        net[n] = {"operstate": str(l.get("operstate", "")).lower(), "mtu": str(l.get("mtu", "")),
                  "mac": l.get("address", ""), "addrs": [], **sysfs(n)}
except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError):
    for d in sorted(glob.glob("/sys/class/net/*")):
        n = os.path.basename(d)
        net[n] = {"operstate": rd(d + "/operstate"), "mtu": rd(d + "/mtu"), "mac": rd(d + "/address"),
                  "addrs": [], **sysfs(n)}
try:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=10).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) > 3 and f[1] in net:
            net[f[1]]["addrs"].append(f[3].split("/")[0])
            net[f[1]].setdefault("cidrs", []).append(f[3])
except (OSError, subprocess.SubprocessError):
    pass
rdma = []
for p in sorted(glob.glob("/sys/class/infiniband/*/ports/*")):
    dev = p.split("/")[4]
    rdma.append({"dev": dev, "port": os.path.basename(p), "state": rd(p + "/state"),
                 "link_layer": rd(p + "/link_layer"),
                 "netdevs": sorted(os.listdir("/sys/class/infiniband/%s/device/net" % dev))
                 if os.path.isdir("/sys/class/infiniband/%s/device/net" % dev) else []})
route = ""
try:
    out = subprocess.run(["ip", "-o", "route", "get", head], capture_output=True, text=True,
                         timeout=10).stdout.split()
    route = out[out.index("dev") + 1] if "dev" in out else ""
except (OSError, subprocess.SubprocessError, ValueError):
    pass
import shutil
tools = {t: bool(shutil.which(t)) for t in ("iperf3", "ping", "ib_write_bw")}
print(json.dumps({"net": net, "rdma": rdma, "route_to_head": route, "tools": tools,
                  "boot_id": rd("/proc/sys/kernel/random/boot_id")}))
"""


# NCCL over RoCE v2 on DGX Spark's ConnectX-7, as boot 10 ran it (tonyd2wild/DeepSeek-V4.1-Flash-
# vLLM-DGX-Spark launch/dsv41-tp4.sh @ca662ac; docs/deepseek-runtime-contract.md). A recipe's
# engine.nccl_roce_env overrides single values. Only added when the host has an active RoCE HCA.
ROCE_ENV = {
    "NCCL_NET": "IB",                      # the IB/RoCE transport, never a silent socket fallback
    "NCCL_IB_GID_INDEX": "3",              # the RoCE v2 IPv4 GID on the Spark's ports
    "NCCL_IB_ROCE_VERSION_NUM": "2",
    "NCCL_IB_ADDR_FAMILY": "AF_INET",
    "NCCL_CROSS_NIC": "0",                 # one NIC per node: no rail crossing
    "NCCL_IB_MERGE_NICS": "0",             # the two ports of a CX-7 stay two devices
}
# Always on multi-node vLLM (RoCE or sockets): the same script sets them on every rank.
NCCL_COMMON_ENV = {
    "NCCL_NVLS_ENABLE": "0",               # no NVLink SHARP between Spark nodes
    "NCCL_CUMEM_ENABLE": "0",              # cuMem allocations off (GB10 unified memory)
}


@dataclass(frozen=True)
class Fabric:
    iface: str
    address: str
    hcas: tuple[str, ...]        # active RoCE devices, e.g. ("mlx5_0", "mlx5_1")
    reason: str                  # why this interface: shown in plans and logs
    hca: str = ""                # the ONE RoCE device pinned for NCCL on this host ("" = no RoCE)
    network: str = ""            # the fabric address's IPv4 network (NCCL_IB_ADDR_RANGE), if known
    topology: str = "switch"     # the inventory's fabric_topology (fabric_env differs for mesh)


def for_host(cluster: "Cluster", host: "Host", ib_hca: dict[str, str], facts: dict[str, Any]) -> Fabric:
    """HOST's fabric as launch uses it and the fabric check measures it: by the inventory's topology,
    its overrides and the recipe's engine.ib_hca pin."""
    pin = ib_hca.get(host.name) or ib_hca.get("*", "")
    if cluster.fabric_topology == "mesh":
        f = mesh_fabric(host.name, facts, host.address, pin)
        return replace(f, topology="ring") if not full_mesh(cluster) else f
    f = choose_fabric(host.name, facts, host.fabric_iface, host.fabric_address, host.address, pin)
    return replace(f, topology=cluster.fabric_topology)


def full_mesh(cluster: "Cluster") -> bool:
    """Every pair of hosts cabled (else a ring, or a partial mesh: only neighbours are linked)."""
    n = len(cluster.hosts)
    return sum(len(h.fabric_links) for h in cluster.hosts) // 2 == n * (n - 1) // 2


def topology_note(cluster: "Cluster", host: "Host") -> str:
    """What the plan says about a host's NCCL settings before launch detects its fabric."""
    topology = cluster.fabric_topology
    if topology == "mesh":
        ring = "" if full_mesh(cluster) else f", {RING_ENV_NOTE}"
        return ("mesh: NCCL bootstrap (NCCL_SOCKET_IFNAME, GLOO, VLLM_HOST_IP, master address) over the "
                "management network; RDMA over every active HCA, NCCL_IB_HCA=<all>, "
                + ", ".join(f"{k}={v}" for k, v in MESH_ENV.items()) + ring + " (HCAs detected at launch)")
    where = (f"iface {host.fabric_iface}" if host.fabric_iface else
             f"the netdev holding {host.fabric_address}" if host.fabric_address else "detected")
    return (f"{topology}: NCCL/GLOO/UCX on one fabric netdev ({where}), one pinned RoCE HCA with "
            "NCCL_IB_ADDR_RANGE = its subnet (detected at launch)")


def head_address(cluster: "Cluster") -> str:
    """The address FACTS_SCRIPT routes towards: the head's fabric address (the management one in a mesh)."""
    head = cluster.head_host
    return head.address if cluster.fabric_topology == "mesh" else (head.fabric_address or head.address)


def holder(facts: dict[str, Any], address: str) -> str:
    """The netdev that holds ADDRESS in a host's FACTS ("" when none; the first in link order if several)."""
    return next((n for n, i in facts.get("net", {}).items() if address in i.get("addrs", [])), "")


def active_roce(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """The host's RoCE ports that NCCL can use: ACTIVE, Ethernet link layer."""
    return [r for r in facts.get("rdma", [])
            if "ACTIVE" in r.get("state", "") and r.get("link_layer", "Ethernet") == "Ethernet"]


def pin_hca(host: str, iface: str, active: list[dict[str, Any]], override: str = "") -> tuple[str, str]:
    """The one RoCE HCA NCCL uses on HOST and why: the override (must be active), else the active HCA
    backing the fabric interface, else the first active one by name (deterministic)."""
    devs = sorted({r["dev"] for r in active})
    if override:
        if override not in devs:
            raise InputError(f"host {host}: engine.ib_hca {override!r} is not an active RoCE device there "
                             f"(active: {', '.join(devs) or 'none'})", key=f"engine.ib_hca.{host}")
        return override, f"HCA {override} pinned (engine.ib_hca)"
    if not devs:
        return "", ""
    backing = sorted({r["dev"] for r in active if iface in r.get("netdevs", [])})
    if backing:
        return backing[0], f"HCA {backing[0]} backs {iface}"
    return devs[0], f"HCA {devs[0]} (first active of {', '.join(devs)})"


def choose_fabric(host: str, facts: dict[str, Any], override_iface: str | None = None,
                  override_address: str | None = None, mgmt_address: str | None = None,
                  override_hca: str = "") -> Fabric:
    net: dict[str, dict] = facts.get("net", {})
    active = active_roce(facts)
    hcas = tuple(sorted({r["dev"] for r in active}))

    def usable(n: str) -> bool:
        i = net.get(n)
        return bool(i) and not i.get("wireless") and i.get("operstate") in ("up", "unknown")

    if override_iface:
        if override_iface not in net:
            raise InputError(f"host {host}: fabric_iface {override_iface!r} does not exist there "
                             f"(interfaces: {', '.join(sorted(net))})", key=f"all.hosts.{host}.fabric_iface")
        if net[override_iface].get("wireless"):
            raise InputError(f"host {host}: fabric_iface {override_iface!r} is a wireless interface",
                             key=f"all.hosts.{host}.fabric_iface")
        if not usable(override_iface):
            raise InputError(f"host {host}: fabric_iface {override_iface!r} is "
                             f"{net[override_iface].get('operstate')}, not up",
                             key=f"all.hosts.{host}.fabric_iface")
        iface, reason = override_iface, f"{override_iface} (inventory override)"
    elif override_address and usable(holder(facts, override_address)):
        # the inventory's fabric address: the netdev holding it is the fabric, whatever routes elsewhere
        iface = holder(facts, override_address)
        reason = f"{iface}: holds the fabric address {override_address}" + (
            f"; backs active RoCE device(s) {', '.join(hcas)}" if any(iface in r.get("netdevs", []) for r in active)
            else "; no active RoCE device on it, NCCL over sockets")
    else:
        rdma_nets = sorted({n for r in active for n in r.get("netdevs", []) if usable(n)})
        route = facts.get("route_to_head", "")
        if rdma_nets:
            # the one routing to the head, else the first (by name) that has an IPv4 address
            iface = route if route in rdma_nets else next(
                (n for n in rdma_nets if net[n].get("addrs")), rdma_nets[0])
            reason = f"{iface}: backs active RoCE device(s) {', '.join(hcas)}"
        elif route and route != "lo" and usable(route):
            iface, reason = route, f"{route}: routes to the head; no active RoCE device, NCCL over sockets"
        else:
            holds = holder(facts, mgmt_address or "")
            if not holds or not usable(holds):
                raise InputError(f"host {host}: no usable fabric interface (no active RoCE port, no route "
                                 "to the head); set fabric_iface in the inventory",
                                 key=f"all.hosts.{host}.fabric_iface")
            iface, reason = holds, f"{holds}: holds the host's address; no active RoCE device"
    addrs = net.get(iface, {}).get("addrs", [])
    address = override_address or (addrs[0] if addrs else "")
    if not address:
        raise InputError(f"host {host}: fabric interface {iface} has no IPv4 address; set "
                         "fabric_address in the inventory", key=f"all.hosts.{host}.fabric_address")
    hca, why = pin_hca(host, iface, active, override_hca)
    if hca:
        reason = f"{reason}; {why}"
    network = ""
    for cidr in net.get(iface, {}).get("cidrs", []):
        try:
            itf = ipaddress.ip_interface(cidr)
        except ValueError:
            continue
        if str(itf.ip) == address:
            network = str(itf.network)
    return Fabric(iface, address, hcas, reason, hca, network)


# A switchless mesh or ring (every cable its own subnet, inventory fabric_topology: mesh), as the peer
# tools run it: NCCL bootstraps over the management network, and RDMA uses every active HCA, each
# reaching the peer on its cable by subnet (NVIDIA dgx-spark-playbooks multi-sparks-through-switch/
# assets/spark_cluster_setup/spark_cluster_setup.py run_nccl_test; sparkrun src/sparkrun/orchestration/
# infiniband.py generate_ring_nccl_overrides; eugr/spark-vllm-docker autodiscover.sh detect_interfaces).
MESH_ENV = {
    "NCCL_IB_MERGE_NICS": "0",             # each HCA its own device: they reach different peers
    "NCCL_NET_PLUGIN": "none",
    "NCCL_IB_SUBNET_AWARE_ROUTING": "1",   # pick the HCA on the peer's subnet
    "NCCL_CROSS_NIC": "1",                 # a ring crosses HCAs by construction
}


# Not every pair cabled (a ring of 4 or more): NCCL's own algorithm choice may open queue pairs to
# non-neighbours and time out; the ring algorithm talks to neighbours only (eugr/spark-vllm-docker
# docs/NETWORKING.md, 4-node ring).
RING_ENV = {"NCCL_ALGO": "Ring"}
RING_ENV_NOTE = "not every pair cabled: NCCL_ALGO=Ring"


def mesh_fabric(host: str, facts: dict[str, Any], mgmt_address: str, override_hca: str = "") -> Fabric:
    """A mesh host's NCCL settings: bootstrap on the netdev holding the management address, RDMA over
    every active HCA (the cables themselves are checked by orchestrator/fabric/, per link)."""
    mgmt = holder(facts, mgmt_address)
    if not mgmt:
        raise InputError(f"host {host}: no netdev holds its address {mgmt_address} (the NCCL bootstrap of a "
                         "mesh runs over the management network)", key=f"all.hosts.{host}.ansible_host")
    hcas = tuple(sorted({r["dev"] for r in active_roce(facts)}))
    if override_hca and override_hca not in hcas:
        raise InputError(f"host {host}: engine.ib_hca {override_hca!r} is not an active RoCE device there "
                         f"(active: {', '.join(hcas) or 'none'})", key=f"engine.ib_hca.{host}")
    reason = (f"mesh: NCCL bootstrap over {mgmt} (management); "
              + (f"RDMA over {', '.join(hcas)}" if hcas else "no active RoCE device, NCCL over sockets"))
    return Fabric(mgmt, mgmt_address, hcas, reason, override_hca, "", "mesh")


def fabric_env(f: Fabric, roce: dict[str, str] | None = None) -> dict[str, str]:
    """NCCL/GLOO/TP/UCX variables for one host (docs/deployment-facts.md, "Engines": multi-node NCCL). With an
    active RoCE HCA: ONE pinned HCA (f.hca) and the RoCE v2 block (ROCE_ENV, ROCE overriding values);
    without: NCCL over sockets."""
    env = {"NCCL_SOCKET_IFNAME": f.iface, "GLOO_SOCKET_IFNAME": f.iface, "TP_SOCKET_IFNAME": f.iface,
           "UCX_NET_DEVICES": f.iface, "MN_IF_NAME": f.iface, "VLLM_HOST_IP": f.address,
           "NCCL_IB_DISABLE": "0" if f.hcas else "1"}
    if f.topology in ("mesh", "ring") and f.hcas:
        env["NCCL_IB_HCA"] = f.hca or ",".join(f.hcas)      # every cable's HCA
        env.update(ROCE_ENV)
        env.update(MESH_ENV)
        if f.topology == "ring":
            env.update(RING_ENV)
        env.pop("NCCL_IB_GID_INDEX")    # per cable; the peer tools leave it to NCCL on rings
        env.update(roce or {})
    elif f.hcas:
        env["NCCL_IB_HCA"] = f.hca or f.hcas[0]
        env.update(ROCE_ENV)
        if f.network:
            env["NCCL_IB_ADDR_RANGE"] = f.network
        env.update(roce or {})
    else:
        env["NCCL_NET"] = "Socket"
    env.update(NCCL_COMMON_ENV)
    return env
