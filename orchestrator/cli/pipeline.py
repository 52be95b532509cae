"""Running one or more pipeline stages from a command: load, plan, apply, report."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..deployment import Deployment, load_deployment
from ..errors import DeployctlError, InputError
from ..executors.ssh import SSHTarget
from ..executors.ssh_pool import connections_opened, warm_up
from ..outcomes import HostResult, run_per_host
from ..plan import Action, Plan
from ..modelfetch.resolve import for_run as resolve_checkpoint
from ..releases import Release, rollback_sets, short_id
from ..runner import RunOutcome, describe_failure, run, say_results, served
from ..runoptions import RunOptions
from ..secrets import mask_override
from ..runrecord import HostLog, RunContext, new_run_dir
from ..stages import build_plan, select
from .rollback_flow import record_release, report, target_after_failure
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


READ_ONLY = frozenset({"preflight", "fabric", "health"})      # stages that only read hosts: no lock


def changes_hosts(stages: tuple[str, ...], options: RunOptions) -> bool:
    """Whether a run of STAGES changes a host, so it must hold the deployment's lock: every stage
    but the read-only ones; a build with --local builds on the controller only."""
    changing = set(stages) - READ_ONLY
    if options.local:
        changing.discard("build")
    if options.route_check_only:
        changing.discard("route")
    return bool(changing)


def hosts_touched(plan, options: RunOptions, lock: bool) -> list[str]:
    """The hosts a run of PLAN talks to (the head too when it takes the lock), the head first (the
    lock, the checkpoint's revision and the build are asked of it before any stage), then in
    inventory order; a --local build talks to none."""
    names = {a.host for sp in plan.stages for a in sp.actions if not (sp.name == "build" and options.local)}
    head = plan.deployment.cluster.head_host.name
    if lock:
        names.add(head)
    return sorted((h.name for h in plan.deployment.cluster.hosts if h.name in names), key=lambda n: n != head)


RECORDS = frozenset({"up", "launch", "rollback"})    # commands whose healthy launch is a release
# What brings a release back: its checkpoint commit (fetched again if the head lost it, synced where a
# node lacks it), its image (only missing layers shipped), the tables staged from that checkpoint
# (each stage skips what is current), then launch and health.
ROLLBACK_STAGES = ("ship", "fetch-model", "sync-model", "stage-engram", "write-ple", "launch", "health", "supervise",
                   "route")


def cannot_bring_back(target: Release) -> str:
    """The prefix of an error that stops a rollback before any host is changed."""
    return f"release {target.number} ({target.served() or 'image ' + short_id(target.image_id)}) cannot be brought back"


@dataclass(frozen=True)
class Prepared:
    """A run ready to apply: its deployment (checkpoint resolved), plan, stages and whether it locks."""
    dep: Deployment
    plan: Plan
    stages: tuple[str, ...]
    lock: bool


def prepare(*, inventory: str | None, recipe: str | None, sets: tuple[str, ...], only: tuple[str, ...] = (),
            skip: tuple[str, ...] = (), options: RunOptions | None = None, lock: bool | None = None,
            what: str = "") -> Prepared:
    """The one planning path of every run (up, the stage commands, rollback, the rollback after a
    failed up): load, plan (bad input is refused before any host), open the SSH connections the plan
    needs, resolve the checkpoint's commit once (a branch that moves mid-run changes nothing), plan
    again with it. LOCK None: the run locks when a stage changes hosts (changes_hosts). WHAT: said
    before an error (e.g. which release a rollback could not plan)."""
    opts = options or RunOptions()
    try:
        dep = load_deployment(inventory, recipe, sets)
        stages = select(only, skip)
        plan = build_plan(dep, only=only, skip=skip, options=options)
        if lock is None:
            lock = changes_hosts(stages, opts)
        warm_up([SSHTarget.for_host(dep.cluster.host(h), dep.cluster) for h in hosts_touched(plan, opts, lock)])
        resolved = resolve_checkpoint(dep, stages, rehash=opts.fetch_rehash)
        if resolved is not dep:
            dep, plan = resolved, build_plan(resolved, only=only, skip=skip, options=options)
    except InputError as e:
        raise (InputError(f"{what}: {e.detail}", file=e.file, key=e.key, line=e.line) if what else e) from None
    except DeployctlError as e:
        raise (type(e)(f"{what}: {e}") if what else e) from None
    return Prepared(dep, plan, stages, lock)


def run_stages(*, command: str, inventory: str | None, recipe: str | None, sets: tuple[str, ...],
               only: tuple[str, ...] = (), skip: tuple[str, ...] = (), as_json: bool = False,
               verbose: int = 0, quiet: bool = False, options: RunOptions | None = None,
               lock: bool | None = None, rollback_on_failure: bool = False,
               rollback_of: int | None = None, what: str = "") -> None:
    """LOCK: hold the deployment's lock on the head for the whole run (a second run fails fast).
    None (the default): when a stage of the run changes hosts (changes_hosts).
    A successful up/launch/rollback that ran launch records a release (orchestrator/releases.py).
    ROLLBACK_ON_FAILURE: when launch or health of a new release fails, the current release is brought
    back under the same lock, with its own run record; the command still exits 1."""
    prep = prepare(inventory=inventory, recipe=recipe, sets=sets, only=only, skip=skip, options=options,
                   lock=lock, what=what)
    dep = prep.dep
    out = dict(as_json=as_json, verbose=verbose, quiet=quiet)
    rolled = None
    with _head_lock(dep, command, prep.lock):
        outcome, doc, ctx = _apply(dep, prep.plan, command, options=options,
                                   record=command in RECORDS and "launch" in prep.stages,
                                   recipe_ref=recipe, sets=sets, rollback_of=rollback_of, **out)
        if rollback_on_failure and outcome.exit_code == 1:
            rolled = _roll_back(dep, outcome, inventory, sets, ctx, **out)
            doc["rollback"] = rolled
    doc["ssh_connections"] = connections_opened()      # one per host the run touched (executors/ssh_pool.py)
    if as_json:
        emit_json(doc)
    if outcome.error:
        STDERR.print(f"[red]error:[/red] {outcome.error}", markup=True, highlight=False)
    for r in outcome.failures:
        STDERR.print(describe_failure(r), markup=False, highlight=False)
    if rolled is not None:
        report(rolled)
    if outcome.exit_code == 0:
        ctx.say(f"[green]{command}: ok[/green] (run record {ctx.run_dir})")
    sys.exit(outcome.exit_code)


def _apply(dep: Deployment, plan, command: str, *, as_json: bool, verbose: int, quiet: bool,
           options: RunOptions | None, record: bool, recipe_ref: str | None, sets: tuple[str, ...],
           rollback_of: int | None) -> tuple[RunOutcome, dict, RunContext]:
    """One run of PLAN with its own run record; then (RECORD, and it succeeded) its release."""
    ctx = _context(dep, command, as_json, verbose, quiet, options)
    ctx.say(f"deployctl {command}: {dep.name} ({dep.recipe.name}), run record {ctx.run_dir}")
    try:
        outcome = run(plan, ctx, command)
        doc = outcome.to_json()
        if record and served(outcome):         # a later stage's failure (supervise) still made a release
            doc["release"] = record_release(dep, ctx, command, recipe_ref, sets, rollback_of, outcome)
    finally:
        shells, ctx.state.shells = ctx.state.shells, None
        if shells is not None:
            shells.close()     # the stages' shared SSH sessions
        ctx.close()
    return outcome, doc, ctx


def _roll_back(dep: Deployment, failed: RunOutcome, inventory: str | None, given: tuple[str, ...],
               ctx: RunContext, *,
               as_json: bool, verbose: int, quiet: bool) -> dict:
    """After FAILED (up --rollback-on-failure): relaunch the current release when the failed run
    replaced it. Returns what happened, for the report and --json."""
    target, why = target_after_failure(dep, failed)
    if target is None:
        ctx.say(f"[yellow]no rollback: {why}[/yellow]")
        return {"attempted": False, "reason": why}
    ctx.say(f"[yellow]rolling back to {target.describe()}[/yellow]")
    # the failed command's secret-named --set values (never recorded in the history) are given again
    sets = rollback_sets(dep.name, target, tuple(s for s in given if mask_override(s) != s))
    try:       # the same planning path as every run: the release's commit resolved on the head
        r = prepare(inventory=inventory, recipe=target.recipe_ref, sets=sets, only=ROLLBACK_STAGES, lock=False,
                    what=cannot_bring_back(target))
    except DeployctlError as e:     # e.g. the recipe changed since: said, never hiding the first failure
        return {"attempted": True, "to": target.number, "image_id": target.image_id, "status": "error",
                "exit_code": e.exit_code, "error": str(e), "run_dir": ""}
    outcome, doc, _ = _apply(r.dep, r.plan, "rollback", options=None, record=True, recipe_ref=target.recipe_ref,
                             sets=sets, rollback_of=target.number, as_json=as_json, verbose=verbose, quiet=quiet)
    return {"attempted": True, "to": target.number, "image_id": target.image_id, **doc}


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
