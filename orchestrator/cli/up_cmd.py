"""deployctl up: the whole pipeline."""
from __future__ import annotations

import click

from ..deployment import load_deployment
from ..plan import build_plan
from .common import deployment_options, emit_json, handle_errors
from .pipeline import run_stages
from .render import print_plan


@click.command("up")
@deployment_options
@click.option("--dry-run", is_flag=True, help="Show the plan (each host's exact commands) and stop.")
@click.option("--only", multiple=True, metavar="STAGE", help="Run only these stages (repeatable).")
@click.option("--skip", multiple=True, metavar="STAGE", help="Skip these stages (repeatable).")
@handle_errors
def up_command(inventory, recipe, sets, as_json, verbose, quiet, dry_run, only, skip):
    """Deploy: preflight, build, ship, sync-model, stage-engram, write-ple, launch, health.

    Each stage skips what is already done. Writes a run record under runs/.
    """
    if dry_run:
        dep = load_deployment(inventory, recipe, tuple(sets))
        plan = build_plan(dep, tuple(only), tuple(skip))
        if as_json:
            emit_json(plan.to_json())
        else:
            print_plan(plan, verbose=verbose)
        return
    run_stages(command="up", inventory=inventory, recipe=recipe, sets=tuple(sets), only=tuple(only),
               skip=tuple(skip), as_json=as_json, verbose=verbose, quiet=quiet)


def register(cli: click.Group) -> None:
    cli.add_command(up_command)
