"""deployctl's command line. Each command family lives in its own module, imported only when one of
its commands runs (or --help lists them): `deployctl status` starts without the pipeline's modules,
whose imports cost more than the command's own work on a small cluster."""
from __future__ import annotations

import importlib

import click

# command name -> (module under orchestrator.cli, the click command in it)
COMMANDS = {
    "plan": ("plan_cmd", "plan_command"),
    "up": ("up_cmd", "up_command"),
    "build": ("build_cmd", "command"),
    "ship": ("ship_cmd", "command"),
    "fabric": ("fabric_cmd", "group"),
    "fetch-model": ("fetch_cmd", "command"),
    "sync-model": ("sync_cmd", "command"),
    "engram": ("engram_cmd", "engram_group"),
    "stage": ("engram_cmd", "stage_command"),
    "ple": ("ple_cmd", "ple_group"),
    "launch": ("launch_cmd", "launch_command"),
    "health": ("launch_cmd", "health_command"),
    "status": ("status_cmd", "status_command"),
    "logs": ("status_cmd", "logs_command"),
    "incidents": ("incidents_cmd", "incidents_command"),
    "down": ("launch_cmd", "down_command"),
    "history": ("release_cmd", "history_command"),
    "rollback": ("release_cmd", "rollback_command"),
    "bench": ("bench_cmd", "bench_command"),
    "monitor": ("monitor_cmd", "group"),
}


class LazyGroup(click.Group):
    """click's lazily loading group (click docs, "Lazily Loading Subcommands"): COMMANDS names each
    command's module, imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module, attr = COMMANDS[cmd_name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="deployctl")
def cli() -> None:
    """Deploy very large LLMs onto small clusters of DGX Spark and RTX PRO 6000 hosts.

    An Ansible inventory and a recipe drive one pipeline: preflight, fabric, build, ship,
    fetch-model, sync-model, stage-engram, write-ple, launch, health, supervise. Start with `deployctl plan`.

    Exit codes: 0 ok, 1 a host or stage failed, 2 bad input.
    """


def main() -> None:
    cli(prog_name="deployctl")
