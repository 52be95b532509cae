"""deployctl engram ... and deployctl stage (placeholder until the Engram issue lands)."""
from __future__ import annotations

import click

from ..errors import NotImplementedStage
from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.group("engram")
def engram_group() -> None:
    """DeepSeek-V4.1-Flash Engram tables: per-rank row ranges and local staging."""


@engram_group.command("ranges")
@click.option("--recipe", "-r", required=True, help="Recipe name or path.")
@click.option("--ranks", type=int, default=None, help="Tensor-parallel ranks (default: the recipe's).")
@click.option("--json", "as_json", is_flag=True)
@handle_errors
def ranges(recipe, ranks, as_json):
    """Per rank and layer: [row_start, row_end), rows and bytes."""
    raise NotImplementedStage("engram ranges is not implemented yet (Engram issue)")


@click.command("stage")
@deployment_options
@handle_errors
def stage_command(inventory, recipe, sets, as_json, verbose, quiet):
    """Stage every host's Engram rows onto its NVMe, in parallel, through Ansible."""
    run_stages(command="stage", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("stage-engram",), as_json=as_json, verbose=verbose, quiet=quiet)


def register(cli: click.Group) -> None:
    cli.add_command(engram_group)
    cli.add_command(stage_command)
