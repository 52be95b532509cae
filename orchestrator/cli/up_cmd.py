"""deployctl up: the whole pipeline."""
from __future__ import annotations

import sys

import click

from ..deployment import load_deployment
from ..runoptions import RunOptions
from ..stages import build_plan
from .common import deployment_options, emit_json, handle_errors
from .launch_cmd import keep_option
from .pipeline import run_stages
from .plan_text import print_plan


@click.command("up")
@deployment_options
@click.option("--dry-run", is_flag=True, help="Show the plan (each host's exact commands) and stop.")
@click.option("--only", multiple=True, metavar="STAGE", help="Run only these stages (repeatable).")
@click.option("--skip", multiple=True, metavar="STAGE", help="Skip these stages (repeatable).")
@keep_option
@click.option("--rollback-on-failure/--no-rollback-on-failure", default=None,
              help="When launch or health of a new image or spec fails, bring the current release back, "
                   "verify its health, and exit 1 reporting both (default: on with --ci, else off).")
@click.option("--ci", is_flag=True,
              help="Non-interactive CI run: --rollback-on-failure unless --no-rollback-on-failure; the build "
                   "stage writes its GitHub Actions job summary.")
@handle_errors
def up_command(inventory, recipe, sets, as_json, verbose, quiet, dry_run, only, skip, keep_on_failure,
               rollback_on_failure, ci):
    """Deploy: preflight, build, ship, sync-model, stage-engram, write-ple, launch, health.

    Each stage skips what is already done, so a re-run on a healthy cluster only checks. Writes a
    run record under runs/. Unless it only reads (--only preflight/health), holds the deployment's
    lock on the head for the whole run: a second `up` of the same deployment fails at once, naming
    the head and the lock. Ctrl-C removes the containers this run started.

    A healthy run with a new image or spec is recorded as a release (`deployctl history`); with
    --rollback-on-failure a failed one brings the current release back (`deployctl rollback`).

    A deployment with replicas (`-d NAME`, or the inventory's only deployment): each replica's `up` in
    turn, one at a time, a replica being replaced out of the router and drained first; the first that
    fails stops the roll (its previous release back, the others untouched) and exits 1 naming it.
    """
    from .roll_flow import replicas_to_roll, roll
    if (rolling := replicas_to_roll(inventory)) is not None:
        base, names = rolling
        if dry_run:
            for n in names:
                from ..inventory import InventoryRef
                dep = load_deployment(InventoryRef.of(inventory, n), recipe, tuple(sets))
                plan = build_plan(dep, tuple(only), tuple(skip))
                emit_json(plan.to_json()) if as_json else print_plan(plan, verbose=verbose)
            return
        sys.exit(roll(inventory, base, names, recipe=recipe, sets=tuple(sets), only=tuple(only),
                      skip=tuple(skip), as_json=as_json, verbose=verbose, quiet=quiet,
                      options=RunOptions(keep_on_failure=keep_on_failure, ci=ci)))
    if dry_run:
        dep = load_deployment(inventory, recipe, tuple(sets))
        plan = build_plan(dep, tuple(only), tuple(skip))
        if as_json:
            emit_json(plan.to_json())
        else:
            print_plan(plan, verbose=verbose)
        return
    # Only runs that change something take the lock (pipeline.changes_hosts): preflight and health only read.
    run_stages(command="up", inventory=inventory, recipe=recipe, sets=tuple(sets), only=tuple(only),
               skip=tuple(skip), as_json=as_json, verbose=verbose, quiet=quiet,
               options=RunOptions(keep_on_failure=keep_on_failure, ci=ci),
               rollback_on_failure=ci if rollback_on_failure is None else rollback_on_failure)
