"""Running one or more pipeline stages from a command: load, plan, apply, report."""
from __future__ import annotations

import sys
from pathlib import Path

from ..deployment import load_deployment
from ..plan import build_plan
from ..runner import describe_failure, run
from ..runrecord import RunContext, new_run_dir
from .common import STDERR, emit_json


def run_stages(*, command: str, inventory: str | None, recipe: str | None, sets: tuple[str, ...],
               only: tuple[str, ...] = (), skip: tuple[str, ...] = (), as_json: bool = False,
               verbose: int = 0, quiet: bool = False, options: dict | None = None) -> None:
    dep = load_deployment(inventory, recipe, sets)
    plan = build_plan(dep, only=only, skip=skip)
    run_root = Path(dep.cluster.run_dir)
    if not run_root.is_absolute():
        run_root = Path.cwd() / run_root
    ctx = RunContext(new_run_dir(run_root, dep.name, command), verbose=verbose, quiet=quiet,
                     options=dict(options or {}), console=None if as_json else STDERR)
    ctx.say(f"deployctl {command}: {dep.name} ({dep.recipe.name}), run record {ctx.run_dir}")
    try:
        outcome = run(plan, ctx, command)
    finally:
        ctx.close()
    if as_json:
        emit_json(outcome.to_json())
    if outcome.error:
        STDERR.print(f"[red]error:[/red] {outcome.error}", markup=True, highlight=False)
    for r in outcome.failures:
        STDERR.print(describe_failure(r), markup=False, highlight=False)
    if outcome.exit_code == 0:
        ctx.say(f"[green]{command}: ok[/green] (run record {ctx.run_dir})")
    sys.exit(outcome.exit_code)
