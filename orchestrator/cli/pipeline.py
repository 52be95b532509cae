"""Running one or more pipeline stages from a command: load, plan, apply, report."""
from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Callable

from ..deployment import Deployment, load_deployment
from ..outcomes import HostResult, run_per_host
from ..plan import Action
from ..runner import describe_failure, run, say_results
from ..runoptions import RunOptions
from ..runrecord import HostLog, RunContext, new_run_dir
from ..stages import build_plan, select
from .common import STDERR, emit_json


def _context(dep: Deployment, command: str, as_json: bool, verbose: int, quiet: bool,
             options: RunOptions | None) -> RunContext:
    run_root = Path(dep.cluster.run_dir)
    if not run_root.is_absolute():
        run_root = Path.cwd() / run_root
    return RunContext(new_run_dir(run_root, dep.name, command), verbose=verbose, quiet=quiet,
                      options=options or RunOptions(), console=None if as_json else STDERR)


def _head_lock(dep: Deployment, command: str, lock: bool):
    """The deployment's lock on the head (orchestrator/launch/lock.py), or nothing."""
    if not lock:
        return contextlib.nullcontext()
    from ..launch.lock import HeadLock
    return HeadLock(dep, command)


READ_ONLY = frozenset({"preflight", "health"})      # stages that only read hosts: no lock


def changes_hosts(stages: tuple[str, ...], options: RunOptions) -> bool:
    """Whether a run of STAGES changes a host, so it must hold the deployment's lock: every stage
    but the read-only ones; a build with --local builds on the controller only."""
    changing = set(stages) - READ_ONLY
    if options.local:
        changing.discard("build")
    return bool(changing)


def run_stages(*, command: str, inventory: str | None, recipe: str | None, sets: tuple[str, ...],
               only: tuple[str, ...] = (), skip: tuple[str, ...] = (), as_json: bool = False,
               verbose: int = 0, quiet: bool = False, options: RunOptions | None = None,
               lock: bool | None = None) -> None:
    """LOCK: hold the deployment's lock on the head for the whole run (a second run fails fast).
    None (the default): when a stage of the run changes hosts (changes_hosts)."""
    dep = load_deployment(inventory, recipe, sets)
    plan = build_plan(dep, only=only, skip=skip, options=options)
    if lock is None:
        lock = changes_hosts(select(only, skip), options or RunOptions())
    with _head_lock(dep, command, lock):
        ctx = _context(dep, command, as_json, verbose, quiet, options)
        ctx.say(f"deployctl {command}: {dep.name} ({dep.recipe.name}), run record {ctx.run_dir}")
        try:
            outcome = run(plan, ctx, command)
        finally:
            shells, ctx.state.shells = ctx.state.shells, None
            if shells is not None:
                shells.close()     # the stages' shared SSH sessions
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


def run_host_command(*, command: str, dep: Deployment, fn: Callable[[Action, HostLog], "HostResult | str | None"],
                     summary: str, as_json: bool = False, verbose: int = 0, quiet: bool = False,
                     lock: bool = False) -> None:
    """A command that is not a pipeline stage (e.g. down): FN on every host in parallel, with a run
    record, results as values, failures described; exit 1 when a host failed."""
    actions = [Action(command, h.name, command, summary) for h in dep.cluster.hosts]
    with _head_lock(dep, command, lock):
        ctx = _context(dep, command, as_json, verbose, quiet, None)
        ctx.say(f"deployctl {command}: {dep.name}, run record {ctx.run_dir}")
        t0 = time.time()
        try:
            results = run_per_host(actions, ctx, fn)
            say_results(ctx, results)
            failed = [r for r in results if r.status == "failed"]
            code = 1 if failed else 0
            doc = {"command": command, "started": t0, "finished": time.time(), "run_dir": str(ctx.run_dir),
                   "status": "failed" if failed else "ok", "exit_code": code,
                   "results": [r.to_json() for r in results]}
            ctx.write_json("status.json", doc)
            ctx.event("run-end", status=doc["status"], exit_code=code)
        finally:
            ctx.close()
    if as_json:
        emit_json(doc)
    for r in failed:
        STDERR.print(describe_failure(r), markup=False, highlight=False)
    if not failed:
        ctx.say(f"[green]{command}: ok[/green] (run record {ctx.run_dir})")
    sys.exit(code)
