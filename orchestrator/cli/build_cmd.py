"""deployctl build: build the serving image chain on the head node's docker engine, cached per layer (placeholder until its issue lands)."""
from __future__ import annotations

import click

from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.command("build")
@deployment_options
@handle_errors
def command(inventory, recipe, sets, as_json, verbose, quiet):
    """Build the serving image chain on the head node's Docker engine, cached per layer."""
    run_stages(command="build", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("build",), as_json=as_json, verbose=verbose, quiet=quiet)


def register(cli: click.Group) -> None:
    cli.add_command(command)
