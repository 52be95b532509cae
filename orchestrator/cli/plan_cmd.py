"""deployctl plan: what `up` would do, per stage and host. Contacts no host."""
from __future__ import annotations

import click

from ..deployment import load_deployment
from ..plan import build_plan
from .common import deployment_options, emit_json, handle_errors
from .render import print_plan


@click.command("plan")
@deployment_options
@click.option("--only", multiple=True, metavar="STAGE", help="Plan only these stages.")
@click.option("--skip", multiple=True, metavar="STAGE", help="Leave these stages out.")
@handle_errors
def plan_command(inventory, recipe, sets, as_json, verbose, quiet, only, skip):
    """Show the ordered stages with one action per host and the exact command each runs.

    Pure: reads the inventory and recipe, contacts no host.
    """
    dep = load_deployment(inventory, recipe, tuple(sets))
    plan = build_plan(dep, tuple(only), tuple(skip))
    if as_json:
        emit_json(plan.to_json())
    else:
        print_plan(plan, verbose=verbose)


def register(cli: click.Group) -> None:
    cli.add_command(plan_command)
