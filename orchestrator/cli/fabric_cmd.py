"""deployctl fabric: prove the links between the hosts (read-only), and `fabric plan`: the netplan files."""
from __future__ import annotations

from pathlib import Path

import click

from ..deployment import load_deployment
from ..errors import DeployctlError
from ..fsutil import atomic_write_text
from ..runoptions import RunOptions
from .common import STDERR, deployment_options, emit_json, handle_errors, inventory_option, recipe_options
from .pipeline import run_stages


@click.group("fabric", invoke_without_command=True)
@deployment_options
@click.pass_context
@handle_errors
def group(cctx, inventory, recipe, sets, as_json, verbose, quiet):
    """Measure every fabric link now: per host the netdev NCCL would use (as launch detects it), its
    state, MTU, speed, addresses and RoCE ports; per pair reachability over the fabric addresses, a
    don't-fragment ping at the recipe's fabric.mtu and an iperf3 TCP rate (pairs in rounds, no host in
    two tests at once). Prints the matrix (--json: the document), names the slowest link and every
    problem. Changes nothing on the hosts.

    Exit 0 the fabric is fit, 1 a link or host fails a verdict (docs/fabric.md), 2 bad input.
    `up` runs the same check as its fabric stage (skip it with --skip fabric).
    """
    if cctx.invoked_subcommand:
        return
    run_stages(command="fabric", inventory=inventory, recipe=recipe, sets=tuple(sets), only=("fabric",),
               as_json=as_json, verbose=verbose, quiet=quiet, options=RunOptions(fabric_fresh=True))


@group.command("plan")
@inventory_option
@recipe_options
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Folder for the files (default: fabric-plan/<deployment>).")
@click.option("--json", "as_json", is_flag=True, help="Print the files and commands as JSON.")
@handle_errors
def plan_command(inventory, recipe, sets, out, as_json):
    """Write, for every host, the netplan file that gives its fabric ports their static addresses
    (inventory fabric_address with its prefix, or fabric_links in a mesh) and the recipe's fabric.mtu
    (9000), validated with `netplan generate` in a scratch root. Prints how to apply each with
    `netplan try` (it rolls back unless confirmed). deployctl never changes a host's network itself.
    """
    from ..executors.shells import Shells
    from ..fabric import detect, netplan, probe
    from ..outcomes import parallel
    dep = load_deployment(inventory, recipe, tuple(sets))
    c = dep.cluster
    mtu = dep.recipe.fabric.mtu or netplan.DEFAULT_MTU
    need_facts = [h.name for h in c.hosts
                  if c.fabric_topology != "mesh" and not h.fabric_iface and h.fabric_network]
    facts: dict = {}
    if need_facts:     # which netdev holds (or will hold) the address: asked of the host, read-only
        with Shells(c) as shells:
            got = parallel(need_facts, lambda n: probe.read_facts(shells[n], detect.head_address(c)))
        if got.failed:
            n, e = sorted(got.failed.items())[0]
            raise DeployctlError(f"host {n}: cannot read its netdevs: {e} (or set fabric_iface)")
        facts = dict(got.ok)
    ports = {h.name: netplan.ports(c, h, facts.get(h.name)) for h in c.hosts}
    files = {h.name: netplan.render(h.name, c.name, c.fabric_topology, ports[h.name], mtu) for h in c.hosts}
    netplan.validate(files, ports, mtu)                # every file valid before any is written
    root = Path(out) if out else Path("fabric-plan") / c.name
    doc = []
    for h in c.hosts:
        p = root / h.name / netplan.FILE_NAME
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, files[h.name], 0o600)
        doc.append({"host": h.name, "file": str(p), "ports": [vars(x) for x in ports[h.name]],
                    "apply": netplan.apply_commands(h, p)})
    if as_json:
        emit_json({"topology": c.fabric_topology, "mtu": mtu, "hosts": doc})
        return
    STDERR.print(f"netplan files for {len(doc)} host(s) ({c.fabric_topology}, MTU {mtu}), validated with "
                 f"`netplan generate`, in {root}", markup=False)
    for d in doc:
        click.echo(f"# {d['host']}: " + ", ".join(f"{x['iface']} {x['cidr']}" for x in d["ports"]))
        for line in d["apply"]:
            click.echo(f"  {line}")
