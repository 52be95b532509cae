"""deployctl launch / health / down: start, check and stop the deployment (status and logs: status_cmd.py)."""
from __future__ import annotations

import shlex
import sys

import click
from rich.console import Console
from rich.markup import escape

from ..deployment import load_deployment
from ..errors import InputError
from ..inventory import InventoryRef, deployment_names
from ..runoptions import RunOptions
from ..secrets import mask_argv
from ..stages import build_plan
from .common import deployment_options, emit_json, handle_errors
from .pipeline import run_host_command, run_stages
from .plan_text import print_plan

keep_option = click.option(
    "--keep-on-failure", is_flag=True,
    help="When launch or health fails, leave the containers running for debugging (default: remove "
         "them; their logs are saved in the run record either way).")
dry_run_option = click.option("--dry-run", is_flag=True,
                              help="Show what would be done (the exact commands) and contact no host.")


def _dry_run(inventory, recipe, sets, as_json, verbose, only: tuple[str, ...]) -> None:
    dep = load_deployment(inventory, recipe, tuple(sets))
    plan = build_plan(dep, only)
    if as_json:
        emit_json(plan.to_json())
    else:
        print_plan(plan, verbose=verbose)


@click.command("launch")
@deployment_options
@keep_option
@dry_run_option
@handle_errors
def launch_command(inventory, recipe, sets, as_json, verbose, quiet, keep_on_failure, dry_run):
    """Start the engine containers on every host.

    Reads every host first (network, staged tables, image) and refuses before touching anything
    when one is not ready; then stops and removes this deployment's containers on EVERY host,
    starts the head, then the workers. A cluster already running the same spec and image with a
    healthy API is left alone (skipped). Holds the deployment's lock on the head.
    """
    if dry_run:
        return _dry_run(inventory, recipe, sets, as_json, verbose, ("launch",))
    run_stages(command="launch", inventory=inventory, recipe=recipe, sets=tuple(sets), only=("launch",),
               as_json=as_json, verbose=verbose, quiet=quiet,
               options=RunOptions(keep_on_failure=keep_on_failure))


@click.command("health")
@deployment_options
@handle_errors
def health_command(inventory, recipe, sets, as_json, verbose, quiet):
    """Check that the deployment really answers: every container up, /health, /v1/models, a chat;
    with a router (all.vars.router), that the router answers and routes to the deployment too.

    Waits up to the recipe's health.startup_timeout_s, showing the head's start-up progress; an
    exited or restarted container fails naming its host, with its last log lines. Read-only.
    """
    from ..inventory import load_inventory
    routed = load_inventory(inventory).router is not None
    run_stages(command="health", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("health", "route") if routed else ("health",), as_json=as_json, verbose=verbose,
               quiet=quiet, options=RunOptions(route_check_only=True))


# ---------------------------------------------------------------------------------------------------
# down

@click.command("down")
@deployment_options
@dry_run_option
@click.option("--all", "every", is_flag=True,
              help="Every deployment of the inventory, one after the other (asks first; --yes to not ask).")
@click.option("--yes", is_flag=True, help="With --all: do not ask for confirmation.")
@handle_errors
def down_command(inventory, recipe, sets, as_json, verbose, quiet, dry_run, every, yes):
    """Stop and remove this deployment's containers on every host, and verify they are gone; then
    remove the deployment's firewall chain (orchestrator/launch/firewall.py) there.

    A host is reported clear only after listing it again shows no container of the deployment;
    a host where one remains, or that cannot be reached, fails (exit 1) by name. Holds the
    deployment's lock on the head. --all: every deployment of the inventory (all.vars.deployments),
    after a confirmation (--yes in scripts); the exit code is the worst of them.
    """
    if every:
        if getattr(inventory, "deployment", None) or recipe or sets:
            raise InputError("--all acts on every deployment of the inventory: drop --deployment, --recipe "
                             "and --set", file=str(inventory or ""), key="all.vars.deployments")
        names = deployment_names(inventory)
        if not (yes or dry_run):
            if not sys.stdin.isatty():
                raise InputError(f"down --all stops {len(names)} deployment(s) ({', '.join(names)}): confirm "
                                 f"with --yes", file=str(inventory or ""), key="all.vars.deployments")
            click.confirm(f"stop and remove {len(names)} deployment(s): {', '.join(names)}?", abort=True)
        codes = []
        for name in names:
            try:
                _down(InventoryRef.of(inventory, name), (), as_json, verbose, quiet, dry_run)
                codes.append(0)
            except SystemExit as e:
                codes.append(int(e.code or 0))
        sys.exit(max(codes, default=0))
    _down(inventory, tuple(sets), as_json, verbose, quiet, dry_run, recipe)


def _leave_router(dep, quiet: bool) -> None:
    """DEP out of the router before its engines stop. A router host that cannot be reached does not
    keep the engines running: said on stderr, and down goes on (the router's keeper drops an engine
    that no longer answers /health within a few seconds anyway)."""
    from ..executors.shells import HostShell
    from ..router.control import leave
    sh = HostShell(dep.cluster, dep.cluster.router.host)
    try:
        msg = leave(dep, sh)
        if not quiet:
            Console(stderr=True, highlight=False).print(f"router: {escape(msg)}")
    except Exception as e:  # noqa: BLE001 - said, never blocking down
        Console(stderr=True, highlight=False).print(f"[yellow]router: {escape(str(e))}[/yellow]")
    finally:
        sh.close()


def _down(inventory, sets: tuple[str, ...], as_json: bool, verbose: int, quiet: bool, dry_run: bool,
          recipe: str | None = None) -> None:
    from ..launch.firewall import chain_name
    from ..launch.lifecycle import down_host, down_preview, remove_supervisors
    dep = load_deployment(inventory, recipe, tuple(sets), together=False)
    if dry_run:
        out = Console(highlight=False, soft_wrap=True)
        out.print(f"[bold]{escape(dep.name)}[/bold]: down on {len(dep.cluster.hosts)} host(s)")
        for host, argv in down_preview(dep):
            out.print(f"  [cyan]{host}[/cyan]: stop (docker stop -t 10) and remove (docker rm -f) every "
                      f"container listed by, then list again:")
            out.print(f"      $ {escape(shlex.join(mask_argv(argv)))}")
            out.print(f"    then remove the firewall chain {chain_name(dep.name)} and its INPUT jump "
                      f"(iptables, ip6tables), if there")
        out.print(f"  before all of that, on every host: remove the supervisor's container "
                  f"(label deployctl.supervisor={escape(dep.name)}), so nothing restarts what down stops")
        if dep.cluster.router:
            out.print(f"  first of all: take {escape(dep.name)} out of the router at {dep.cluster.router.url} "
                      f"({dep.cluster.router.host.name}); the router stops with the last deployment behind it")
        return
    if dep.cluster.router:           # first: no client is routed to an engine being stopped
        _leave_router(dep, quiet)
    remove_supervisors(dep)          # first, without the lock: a supervisor restarting the group holds it
    run_host_command(command="down", dep=dep, fn=lambda action, log: down_host(dep, action.host, log),
                     summary=f"stop and remove the containers of {dep.name}",
                     as_json=as_json, verbose=verbose, quiet=quiet, lock=True)
