"""deployctl ple [write] (placeholder until the PLE issue lands)."""
from __future__ import annotations

import click

from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.group("ple", invoke_without_command=True)
@deployment_options
@click.pass_context
@handle_errors
def ple_group(ctx, inventory, recipe, sets, as_json, verbose, quiet):
    """Write Qwen's memory-mapped PLE table file on the target host (pipeline stage write-ple).

    `deployctl ple write` is the local operation a host runs.
    """
    if ctx.invoked_subcommand is None:
        run_stages(command="ple", inventory=inventory, recipe=recipe, sets=tuple(sets),
                   only=("write-ple",), as_json=as_json, verbose=verbose, quiet=quiet)


def register(cli: click.Group) -> None:
    cli.add_command(ple_group)
