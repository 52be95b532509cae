"""deployctl plan: what `up` would do, per stage and host, and the memory budget per node.

Contacts no host, unless --check: then the preflight checks run on every host (read-only).
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..deployment import load_deployment
from ..inventory import InventoryRef
from ..stages import build_plan
from .common import STDERR, deployment_options, emit_json, every_deployment, handle_errors
from .plan_text import print_plan


@click.command("plan")
@deployment_options
@click.option("--only", multiple=True, metavar="STAGE", help="Plan only these stages.")
@click.option("--skip", multiple=True, metavar="STAGE", help="Leave these stages out.")
@click.option("--check", is_flag=True,
              help="Also run the preflight checks on the hosts (SSH, read-only; writes a run record). "
                   "Exit 1 if any fails.")
@handle_errors
def plan_command(inventory, recipe, sets, as_json, verbose, quiet, only, skip, check):
    """Show the ordered stages with one action per host and the exact command each runs, and the
    memory budget per node with its verdict.

    Pure: reads the inventory and recipe, contacts no host (unless --check).
    Exit 2 when the recipe cannot fit (the message names the node, the shortfall and the fix).
    On an inventory with several deployments and no --deployment: every deployment's plan, after
    checking they can run together (GPUs, ports, summed memory, staging folders; docs/deployments.md).
    """
    if names := every_deployment(inventory, recipe=recipe, set=sets, check=check):
        sys.exit(_every_deployment(inventory, names, as_json, verbose, tuple(only), tuple(skip)))
    dep = load_deployment(inventory, recipe, tuple(sets))
    plan = build_plan(dep, tuple(only), tuple(skip), require_fit=False)
    sizing = plan.extra["sizing"]
    outcome = None
    if not as_json:
        print_plan(plan, verbose=verbose)
    rotation = checkpoint = None
    if check and sizing["fits"]:
        outcome = _preflight(dep, as_json, verbose, quiet)
        if outcome.exit_code == 0:     # the hosts answer: ask their engines which key they run with
            rotation = _key_rotation(dep, as_json)
            checkpoint = _checkpoint(dep, as_json, tuple(only), tuple(skip))
    if as_json:
        doc = plan.to_json()
        if outcome is not None:
            doc["preflight"] = outcome.to_json()
            doc["api_key_rotation"] = rotation
            doc["checkpoint"] = checkpoint
        emit_json(doc)
    if not sizing["fits"]:
        from ..sizing import refusal
        STDERR.print(f"error: recipe {dep.recipe.name} does not fit:\n{refusal(sizing['problems'])}",
                     markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    if outcome is not None:
        from ..runner import describe_failure
        for r in outcome.failures:
            STDERR.print(describe_failure(r), markup=False, highlight=False, soft_wrap=True)
        if outcome.error:
            STDERR.print(f"error: {outcome.error}", markup=False, highlight=False, soft_wrap=True)
        if not quiet and not as_json:
            STDERR.print(f"preflight: {outcome.status} (run record {outcome.run_dir})", markup=False,
                         highlight=False)
        sys.exit(outcome.exit_code)


def _every_deployment(inventory, names: list[str], as_json: bool, verbose: int, only: tuple[str, ...],
                      skip: tuple[str, ...]) -> int:
    plans = [build_plan(load_deployment(InventoryRef.of(inventory, n)), only, skip, require_fit=False)
             for n in names]
    if as_json:
        emit_json({"deployments": [p.to_json() for p in plans]})
    else:
        for p in plans:
            print_plan(p, verbose=verbose)
    bad = [(n, p.extra["sizing"]) for n, p in zip(names, plans) if not p.extra["sizing"]["fits"]]
    for n, sizing in bad:
        from ..sizing import refusal
        STDERR.print(f"error: deployment {n} does not fit:\n{refusal(sizing['problems'])}", markup=False,
                     highlight=False, soft_wrap=True)
    return 2 if bad else 0


def _preflight(dep, as_json: bool, verbose: int, quiet: bool):
    """Run the preflight stage alone, with a run record (runs/<id>/: logs per host)."""
    from ..runner import run
    from ..runrecord import RunContext, new_run_dir
    root = Path(dep.cluster.run_dir)
    ctx = RunContext(new_run_dir(root if root.is_absolute() else Path.cwd() / root, dep.name, "plan-check"),
                     verbose=verbose, quiet=quiet, console=None if as_json else STDERR)
    try:
        return run(build_plan(dep, only=("preflight",)), ctx, "plan --check")
    finally:
        ctx.close()


def _key_rotation(dep, as_json: bool) -> str | None:
    """Whether launch will relaunch the engines for a changed API key (read from the running engines'
    key-id labels; names key ids, never keys)."""
    from ..launch.lifecycle import key_rotation
    change = key_rotation(dep)
    if change and not as_json:
        STDERR.print(f"launch: {change}", markup=False, highlight=False, soft_wrap=True)
    return change


def _checkpoint(dep, as_json: bool, only: tuple[str, ...], skip: tuple[str, ...]) -> dict | None:
    """What fetch-model would fetch, asked now (the Hub, from the head): the commit a branch resolves
    to, the files and bytes, what the head already holds. Exit 2 for what the run would refuse."""
    from ..modelfetch.resolve import fetches, run_resolve
    from ..modelsync.manifest import gb
    from ..modelsync.settings import revision_note
    from ..stages import select
    if not fetches(dep, select(only, skip)):
        return None
    r = run_resolve(dep, ask_hub=True)
    c = r.check
    have = ("all of them verified on the head" if r.up_to_date else
            f"{c.get('missing_count', len(r.files))} to fetch, {gb(c.get('need_bytes', r.total))}; "
            f"{gb(c.get('free_bytes', 0))} free at {c.get('free_path', '?')}"
            + ("" if c.get("fits", True) else " (NOT enough: up refuses it)"))
    if not as_json:
        STDERR.print(f"fetch-model: {dep.recipe.model.repo} {revision_note(r.revision, '', r.commit)}: "
                     f"{len(r.files)} files, {gb(r.total)}; {have}", markup=False, highlight=False, soft_wrap=True)
    return r.to_json()
