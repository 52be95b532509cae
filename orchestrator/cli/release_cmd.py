"""deployctl history / rollback: the deployment's releases (orchestrator/releases.py), read from the head."""
from __future__ import annotations

import sys
import time
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import releases as rel
from ..deployment import Deployment, load_deployment
from ..errors import InputError, StageFailed
from ..runoptions import RunOptions
from ..secrets import mask_override
from ..stages import build_plan
from .common import emit_json, handle_errors, inventory_option, output_options
from .launch_cmd import keep_option
from .pipeline import ROLLBACK_STAGES, cannot_bring_back, prepare, run_stages
from .plan_text import print_plan


def _read(dep: Deployment, connect_timeout: float = 10.0) -> list[rel.Release]:
    from ..executors.shells import Shells
    from ..launch import release_store
    with Shells(dep.cluster, connect_timeout) as shells:
        return release_store.read_history(dep, shells[dep.cluster.head])


def _history_doc(dep: Deployment, history: list[rel.Release]) -> dict[str, Any]:
    keep = dep.recipe.releases.keep
    pinned = {r.number for r in rel.kept(history, keep)}
    cur = rel.current(history)
    return {"deployment": dep.name, "keep": keep, "current": cur.number if cur else None,
            "releases": [{**r.to_json(), "pinned": r.number in pinned,
                          "pin": rel.pin_tag(dep.name, r.number) if r.number in pinned else None}
                         for r in history]}


@click.command("history")
@inventory_option
@output_options
@handle_errors
def history_command(inventory, as_json, verbose, quiet):
    """The deployment's releases, newest last, as recorded on the head (any controller sees the same).

    A release is every `up`, `launch` or `rollback` that came up healthy with a new image or spec:
    its number, time, image ID, recipe and overrides, and the run record that made it. The last
    `releases.keep` (recipe, default 3) keep their image pinned on every node; `deployctl rollback`
    brings one back. Read-only.
    """
    dep = load_deployment(inventory, together=False)
    doc = _history_doc(dep, _read(dep))
    if as_json:
        emit_json(doc)
        return
    out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    if not doc["releases"]:
        out.print(f"{escape(dep.name)}: no releases recorded yet (the first healthy `deployctl up` records one)")
        return
    t = Table(title=f"{dep.name}: releases (the last {doc['keep']} pinned)", title_justify="left")
    for col in ("#", "time (UTC)", "image ID", "image", "checkpoint", "recipe", "made by", "pinned", "run record"):
        t.add_column(col)
    for r in doc["releases"]:
        mark = " (current)" if r["number"] == doc["current"] else ""
        made = f"rollback of {r['rollback_of']}" if r["rollback_of"] is not None else r["command"]
        t.add_row(f"{r['number']}{mark}", time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["time"])),
                  rel.short_id(r["image_id"]), escape(r["image"]), escape(rel.Release.from_json(r).served() or "-"),
                  escape(r["recipe"]), escape(made),
                  escape(r["pin"] or "no (may be pruned)"), escape(r["run_dir"]))
    out.print(t)


@click.command("rollback")
@inventory_option
@output_options
@click.option("--to", "to", type=click.IntRange(min=1), default=None, metavar="N",
              help="The release to bring back (default: the one before the current one).")
@click.option("--set", "sets", multiple=True, metavar="KEY.PATH=VALUE",
              help="Add to the release's recorded overrides (after them; e.g. a secret-named value, "
                   "which the history records masked). The image stays the release's.")
@keep_option
@click.option("--dry-run", is_flag=True,
              help="Show the release and the plan (ship, fetch-model, sync-model, the table stages, launch, "
                   "health, supervise, route) it would run, and stop.")
@handle_errors
def rollback_command(inventory, as_json, verbose, quiet, to, sets, keep_on_failure, dry_run):
    """Relaunch release N (`deployctl history`) by its image ID, then the full health check.

    Runs ship (only the layers a worker lacks), fetch-model and sync-model (the checkpoint commit the
    release served, fetched again only if the head lost it), the table stages (skipped when current),
    launch, health, supervise and route (behind a router: its entry only, the others untouched), with
    the release's recorded overrides, `model.revision` set to that commit and `engine.image` to its pin
    tag (`deployctl-release/<deployment>:<N>`, the exact image ID on every node). Holds the deployment's
    lock. Success is a new release ("rollback of N"). Exit 1 with the reason when it does not come up
    healthy; a commit that is neither on the head nor on the Hub is refused before anything runs (before
    launch touches what runs, with model_fetch: none).
    """
    dep = load_deployment(inventory)
    try:
        history = _read(dep, connect_timeout=5.0 if dry_run else 10.0)
    except StageFailed as e:
        if not dry_run:
            raise
        return _dry_run_unread(dep, inventory, to, tuple(sets), as_json, verbose, str(e))
    if not history:
        raise StageFailed(f"{dep.name}: no releases recorded on the head {dep.cluster.head}: nothing to roll back to")
    target = rel.find(history, to) if to else rel.previous(history)
    if target is None:
        if to:
            raise InputError(f"no release {to} (recorded: {', '.join(str(r.number) for r in history)})", key="--to")
        raise StageFailed(f"{dep.name} has only one release ({history[0].number}): nothing before it")
    missing = [o for o in rel.masked_overrides(target) if not any(s.startswith(o[:-3]) for s in sets)]
    if missing:
        raise InputError(f"release {target.number} was made with secret-named overrides recorded without their "
                         f"values: pass them again with --set ({', '.join(missing)})", key="--set")
    sets = rel.rollback_sets(dep.name, target, tuple(sets))
    what = cannot_bring_back(target)
    if dry_run:
        plan = prepare(inventory=inventory, recipe=target.recipe_ref, sets=sets, only=ROLLBACK_STAGES, lock=False,
                       what=what).plan
        if as_json:
            emit_json({"release": target.to_json(), "sets": list(sets), "plan": plan.to_json()})
        else:
            click.echo(f"would roll back {dep.name} to {target.describe()} with --set "
                       + " --set ".join(mask_override(s) for s in sets))
            print_plan(plan, verbose=verbose)
        return
    if target.number not in {r.number for r in rel.kept(history, dep.recipe.releases.keep)}:
        _require_pin(dep, target)
    run_stages(command="rollback", inventory=inventory, recipe=target.recipe_ref, sets=sets, only=ROLLBACK_STAGES,
               as_json=as_json, verbose=verbose, quiet=quiet, options=RunOptions(keep_on_failure=keep_on_failure),
               rollback_of=target.number, what=what)


def _require_pin(dep: Deployment, target: rel.Release) -> None:
    """A release older than the last releases.keep lost its pin: its image may be gone."""
    from ..executors.shells import Shells
    from ..launch import release_store
    tag = rel.pin_tag(dep.name, target.number)
    with Shells(dep.cluster) as shells:
        if not release_store.image_present(shells[dep.cluster.head], tag):
            raise StageFailed(f"release {target.number}'s image {rel.short_id(target.image_id)} is no longer kept "
                              f"(only the last {dep.recipe.releases.keep} releases stay pinned; {tag} is not on "
                              f"the head {dep.cluster.head})")


def _dry_run_unread(dep: Deployment, inventory, to: int | None, extra: tuple[str, ...], as_json: bool,
                    verbose: int, why: str) -> None:
    """--dry-run without the head's history (it cannot be reached from here): say so, and show the
    plan with release N's pin tag (its recorded overrides are not known here)."""
    note = f"the release history could not be read ({why})"
    if to is None:
        if as_json:
            emit_json({"release": None, "note": note})
        else:
            click.echo(f"would roll back {dep.name} to the release before the current one; {note}")
        return
    sets = (*extra, f"engine.image={rel.pin_tag(dep.name, to)}")
    plan = build_plan(load_deployment(inventory, None, sets), only=ROLLBACK_STAGES)
    if as_json:
        emit_json({"release": to, "sets": list(sets), "note": note, "plan": plan.to_json()})
        return
    click.echo(f"would roll back {dep.name} to release {to} with --set {sets[-1]} (plus its recorded "
               f"overrides); {note}")
    print_plan(plan, verbose=verbose)
