"""`deployctl fabric plan`: per host the netplan file that gives its ConnectX-7 ports their static fabric
addresses and MTU, validated with `netplan generate` against a scratch root. deployctl never applies it.

What the NVIDIA guides set up by hand (dgx-spark-playbooks connect-two-sparks / connect-three-sparks:
/etc/netplan/40-cx7.yaml, static addresses, `dhcp4: no`, then `netplan apply`) with the MTU the peer
tools add (sparkrun scripts/cx7_configure.sh: mtu 9000, dhcp6 off, no link-local addresses). Our file
has its own name, so it never overwrites theirs; netplan merges files in name order.
"""
from __future__ import annotations

import ipaddress
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..errors import InputError
from .detect import active_roce, holder

if TYPE_CHECKING:
    from ..inventory import Cluster, Host

FILE_NAME = "45-deployctl-fabric.yaml"
DEFAULT_MTU = 9000


@dataclass(frozen=True)
class Port:
    iface: str
    cidr: str                  # address/prefix


def ports(cluster: "Cluster", host: "Host", facts: dict[str, Any] | None) -> list[Port]:
    """HOST's fabric ports and addresses from the inventory (mesh: fabric_links; else fabric_address
    with its prefix on fabric_iface, or on the netdev FACTS show holding it, or the active RoCE netdev)."""
    key = f"all.hosts.{host.name}"
    if cluster.fabric_topology == "mesh":
        return [Port(lk.iface, f"{lk.address}/{ipaddress.ip_network(lk.network).prefixlen}")
                for lk in host.fabric_links]
    if not host.fabric_address or not host.fabric_network:
        raise InputError(f"host {host.name}: `fabric plan` needs its fabric address with the prefix, e.g. "
                         "fabric_address: 192.168.100.11/24", file=str(cluster.file), key=f"{key}.fabric_address")
    cidr = f"{host.fabric_address}/{ipaddress.ip_network(host.fabric_network).prefixlen}"
    iface = host.fabric_iface or _iface_from(facts or {}, host.fabric_address)
    if not iface:
        raise InputError(f"host {host.name}: which port gets {cidr}? no netdev holds it and no active RoCE "
                         "port was found: set fabric_iface (e.g. enp1s0f0np0)", file=str(cluster.file),
                         key=f"{key}.fabric_iface")
    return [Port(iface, cidr)]


def _iface_from(facts: dict[str, Any], address: str) -> str:
    roce = sorted({n for r in active_roce(facts) for n in r.get("netdevs", [])})
    return holder(facts, address) or (roce[0] if roce else "")


def render(host: str, cluster_name: str, topology: str, host_ports: list[Port], mtu: int) -> str:
    eths = {p.iface: {"dhcp4": False, "dhcp6": False, "link-local": [], "addresses": [p.cidr], "mtu": mtu}
            for p in host_ports}
    head = (f"# deployctl fabric plan: {host} of {cluster_name} ({topology} fabric).\n"
            f"# Static fabric addresses and MTU {mtu} on the ConnectX-7 ports. Apply on {host}:\n"
            f"#   install -m 600 {FILE_NAME} /etc/netplan/ && netplan try --timeout 120\n")
    return head + yaml.safe_dump({"network": {"version": 2, "renderer": "networkd", "ethernets": eths}},
                                 sort_keys=False)


def validate(files: dict[str, str], host_ports: dict[str, list[Port]], mtu: int) -> None:
    """`netplan generate --root-dir` on each file in a scratch root, and the generated networkd units
    say what we meant (address, MTU). Raises InputError naming the host."""
    exe = shutil.which("netplan")
    if not exe:
        raise InputError("netplan is not installed on this machine, so the files cannot be validated: "
                         "apt install netplan.io (or run `fabric plan` where it is)")
    with tempfile.TemporaryDirectory(prefix="deployctl-netplan-") as tmp:
        for host, text in files.items():
            root = Path(tmp) / host
            d = root / "etc" / "netplan"
            d.mkdir(parents=True)
            f = d / FILE_NAME
            f.write_text(text)
            f.chmod(0o600)
            p = subprocess.run([exe, "generate", "--root-dir", str(root)], capture_output=True, text=True,
                               timeout=60)
            if p.returncode != 0:
                raise InputError(f"host {host}: `netplan generate` rejects the file: "
                                 f"{(p.stderr.strip() or p.stdout.strip())[-400:]}")
            units = root / "run" / "systemd" / "network"
            for port in host_ports[host]:
                net = (units / f"10-netplan-{port.iface}.network")
                link = (units / f"10-netplan-{port.iface}.link")
                text_net = net.read_text() if net.exists() else ""
                text_link = link.read_text() if link.exists() else ""
                if f"Address={port.cidr}" not in text_net or f"MTUBytes={mtu}" not in text_link + text_net:
                    raise InputError(f"host {host}: netplan generated no unit giving {port.iface} {port.cidr} "
                                     f"and MTU {mtu} (in {units})")


def apply_commands(host: "Host", path: Path) -> list[str]:
    """How an operator applies PATH on HOST: copied, then `netplan try` (it rolls back unless confirmed)."""
    target = f"{host.user}@{host.address}"
    ssh = ["ssh"] + (["-p", str(host.port)] if host.port != 22 else [])
    scp = ["scp"] + (["-P", str(host.port)] if host.port != 22 else [])
    return [shlex.join(scp + [str(path), f"{target}:/tmp/{FILE_NAME}"]),
            shlex.join(ssh + ["-t", target, f"install -m 600 /tmp/{FILE_NAME} /etc/netplan/{FILE_NAME} && "
                              "netplan try --timeout 120"])]
