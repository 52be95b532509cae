"""deployctl bench (placeholder until the bench issue lands)."""
from __future__ import annotations

import click

from ..errors import NotImplementedStage
from .common import deployment_options, handle_errors


@click.command("bench")
@deployment_options
@handle_errors
def bench_command(inventory, recipe, sets, as_json, verbose, quiet):
    """Concurrency sweep against the deployment's API with SLO verdicts and reference comparison."""
    raise NotImplementedStage("bench is not implemented yet (bench issue); nothing was done")


def register(cli: click.Group) -> None:
    cli.add_command(bench_command)
