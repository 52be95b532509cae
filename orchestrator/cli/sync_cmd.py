"""deployctl sync-model: give every node the exact checkpoint (rsync from the head, or verify a shared mount) (placeholder until its issue lands)."""
from __future__ import annotations

import click

from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.command("sync-model")
@deployment_options
@handle_errors
def command(inventory, recipe, sets, as_json, verbose, quiet):
    """Give every node the exact checkpoint (rsync from the head, or verify a shared mount)."""
    run_stages(command="sync-model", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("sync-model",), as_json=as_json, verbose=verbose, quiet=quiet)


def register(cli: click.Group) -> None:
    cli.add_command(command)
