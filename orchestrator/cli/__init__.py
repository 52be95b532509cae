"""deployctl's command line. Each command family lives in its own module."""
from __future__ import annotations

import click

from . import (bench_cmd, build_cmd, engram_cmd, fabric_cmd, fetch_cmd, launch_cmd, plan_cmd, ple_cmd,
               release_cmd, ship_cmd, sync_cmd, up_cmd)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="deployctl")
def cli() -> None:
    """Deploy very large LLMs onto small clusters of DGX Spark and RTX PRO 6000 hosts.

    An Ansible inventory and a recipe drive one pipeline: preflight, fabric, build, ship,
    fetch-model, sync-model, stage-engram, write-ple, launch, health. Start with `deployctl plan`.

    Exit codes: 0 ok, 1 a host or stage failed, 2 bad input.
    """


for module in (plan_cmd, up_cmd, build_cmd, ship_cmd, fabric_cmd, fetch_cmd, sync_cmd, engram_cmd, ple_cmd, launch_cmd,
               release_cmd, bench_cmd):
    module.register(cli)


def main() -> None:
    cli(prog_name="deployctl")
