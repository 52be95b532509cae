"""deployctl launch / health / status / logs / down (placeholders until the launch issue lands)."""
from __future__ import annotations

import click

from ..errors import NotImplementedStage
from .common import deployment_options, handle_errors
from .pipeline import run_stages


@click.command("launch")
@deployment_options
@handle_errors
def launch_command(inventory, recipe, sets, as_json, verbose, quiet):
    """Start the engine containers on every host (earlier ones of this deployment stopped first)."""
    run_stages(command="launch", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("launch",), as_json=as_json, verbose=verbose, quiet=quiet)


@click.command("health")
@deployment_options
@handle_errors
def health_command(inventory, recipe, sets, as_json, verbose, quiet):
    """Check that the deployment really answers: /health, /v1/models, a chat completion."""
    run_stages(command="health", inventory=inventory, recipe=recipe, sets=tuple(sets),
               only=("health",), as_json=as_json, verbose=verbose, quiet=quiet)


def _pending(name: str):
    @click.command(name)
    @deployment_options
    @handle_errors
    def cmd(inventory, recipe, sets, as_json, verbose, quiet):
        raise NotImplementedStage(f"{name} is not implemented yet (launch issue); nothing was done")
    return cmd


status_command = _pending("status")
status_command.help = "Per host: container state, image ID, uptime, staged data; API health."
logs_command = _pending("logs")
logs_command.help = "Show the engine logs of every host (or --host H)."
down_command = _pending("down")
down_command.help = "Stop and remove this deployment's containers on every host, and verify."


def register(cli: click.Group) -> None:
    for c in (launch_command, health_command, status_command, logs_command, down_command):
        cli.add_command(c)
