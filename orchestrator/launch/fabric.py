"""Which network carries NCCL/GLOO/UCX traffic on each host, decided per host from its facts.

Cabling can differ between nodes, so every host is detected on its own (the head's
interface names are never pushed to workers). A fabric netdev backs an ACTIVE RoCE
port (/sys/class/infiniband/*/ports/*/state); a wireless interface is never chosen.
Without RDMA (e.g. the test cluster) the interface that routes to the head is used
and NCCL is told to use sockets.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError

# Run on each host (python3 is there; Ansible needs it too). Prints one JSON object.
FACTS_SCRIPT = r"""
import glob, json, os, subprocess, sys
head = sys.argv[1]
def rd(p):
    try:
        return open(p).read().strip()
    except OSError:
        return ""
net = {}
for d in sorted(glob.glob("/sys/class/net/*")):
    n = os.path.basename(d)
    net[n] = {"operstate": rd(d + "/operstate"), "wireless": os.path.exists(d + "/wireless"),
              "addrs": []}
try:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True,
                         timeout=10).stdout
    for line in out.splitlines():
        f = line.split()
        if len(f) > 3 and f[1] in net:
            net[f[1]]["addrs"].append(f[3].split("/")[0])
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
print(json.dumps({"net": net, "rdma": rdma, "route_to_head": route}))
"""


@dataclass(frozen=True)
class Fabric:
    iface: str
    address: str
    hcas: tuple[str, ...]        # active RoCE devices, e.g. ("mlx5_0", "mlx5_1")
    reason: str                  # why this interface: shown in plans and logs


def choose_fabric(host: str, facts: dict[str, Any], override_iface: str | None = None,
                  override_address: str | None = None, mgmt_address: str | None = None) -> Fabric:
    net: dict[str, dict] = facts.get("net", {})
    active = [r for r in facts.get("rdma", [])
              if "ACTIVE" in r.get("state", "") and r.get("link_layer", "Ethernet") == "Ethernet"]
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
    else:
        rdma_nets = sorted({n for r in active for n in r.get("netdevs", []) if usable(n)})
        route = facts.get("route_to_head", "")
        if rdma_nets:
            iface = route if route in rdma_nets else rdma_nets[0]
            reason = f"{iface}: backs active RoCE device(s) {', '.join(hcas)}"
        elif route and route != "lo" and usable(route):
            iface, reason = route, f"{route}: routes to the head; no active RoCE device, NCCL over sockets"
        else:
            holder = next((n for n, i in net.items() if mgmt_address in i.get("addrs", [])), "")
            if not holder or not usable(holder):
                raise InputError(f"host {host}: no usable fabric interface (no active RoCE port, no route "
                                 "to the head); set fabric_iface in the inventory",
                                 key=f"all.hosts.{host}.fabric_iface")
            iface, reason = holder, f"{holder}: holds the host's address; no active RoCE device"
    addrs = net.get(iface, {}).get("addrs", [])
    address = override_address or (addrs[0] if addrs else "")
    if not address:
        raise InputError(f"host {host}: fabric interface {iface} has no IPv4 address; set "
                         "fabric_address in the inventory", key=f"all.hosts.{host}.fabric_address")
    return Fabric(iface, address, hcas, reason)


def fabric_env(f: Fabric) -> dict[str, str]:
    """NCCL/GLOO/TP/UCX variables for one host (deployment-facts.md, "Multi-node NCCL")."""
    env = {"NCCL_SOCKET_IFNAME": f.iface, "GLOO_SOCKET_IFNAME": f.iface, "TP_SOCKET_IFNAME": f.iface,
           "UCX_NET_DEVICES": f.iface, "VLLM_HOST_IP": f.address,
           "NCCL_IB_DISABLE": "0" if f.hcas else "1"}
    if f.hcas:
        env["NCCL_IB_HCA"] = ",".join(f.hcas)
    return env
