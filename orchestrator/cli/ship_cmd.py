"""deployctl ship: ship the serving image from the head to every worker, only the layers each lacks (placeholder until its issue lands)."""
from __future__ import annotations

import click

from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.command("ship")
@deployment_options
@handle_errors
def command(inventory, recipe, sets, as_json, verbose, quiet):
    """Ship the serving image from the head to every worker, only the layers each lacks."""
    run_stages(command="ship", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("ship",), as_json=as_json, verbose=verbose, quiet=quiet)


def register(cli: click.Group) -> None:
    cli.add_command(command)
