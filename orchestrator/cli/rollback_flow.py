"""The release steps of a run (cli/pipeline.py runs them under the deployment's lock): record the
release a healthy run made, decide whether a failed run must be rolled back, and report both outcomes.
The decisions are orchestrator/releases.py's; the remote side is launch/release_store.py."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.markup import escape

from ..errors import DeployctlError
from ..modelfetch.resolved import COMMIT
from ..releases import Release, checkpoint_of, current, pin_tag, short_id
from .common import STDERR

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..runner import RunOutcome
    from ..runrecord import RunContext


def served_checkpoint(dep: "Deployment", outcome: "RunOutcome") -> dict[str, str]:
    """The checkpoint the run served: the commit it resolved (a revision never resolved, e.g. nothing
    fetched yet, is no commit: "") and the manifest digest its sync-model verified every node against
    (one per run: the head's)."""
    m = dep.recipe.model
    commit = dep.snapshot if (dep.checkpoint and dep.checkpoint.commit) or COMMIT.match(m.revision) else ""
    digests = {r.data.get("manifest_digest") for s in outcome.stages if s.name == "sync-model"
               for r in s.results if r.status != "failed" and r.data.get("manifest_digest")}
    manifest = digests.pop() if len(digests) == 1 else ""
    return checkpoint_of(m.repo, m.revision, commit, m.checkpoint_dir, manifest)


def record_release(dep: "Deployment", ctx: "RunContext", command: str, recipe_ref: str | None,
                   sets: tuple[str, ...], rollback_of: int | None, outcome: "RunOutcome") -> dict[str, Any]:
    """After a successful run: the new release (also written to the run record as release.json), or
    which release still runs. A history that cannot be written is said, not fatal: the deployment is
    up and healthy, and the next successful run records it."""
    # Imported here: release_store reaches paramiko, and the CLI's planning paths must not.
    from ..executors.shells import run_shells
    from ..launch import release_store
    shells = run_shells(dep.cluster, ctx.state)
    try:
        new, cur, notes = release_store.record(dep, shells, command=command, run_dir=str(ctx.run_dir),
                                               recipe_ref=recipe_ref, overrides=tuple(sets), rollback_of=rollback_of,
                                               checkpoint=served_checkpoint(dep, outcome))
    except Exception as e:  # noqa: BLE001 - reported, never hides the run's own outcome
        why = f"no release recorded: {e}"
        ctx.say(f"[yellow]{escape(why)}[/yellow]")
        ctx.event("release-error", error=str(e))
        return {"recorded": False, "error": why}
    for note in notes:
        ctx.say(f"  [yellow]{escape(note)}[/yellow]")
    if new is None:
        assert cur is not None
        ctx.say(f"  release {cur.number} still runs (same image and specs): no new release")
        return {"recorded": False, "current": cur.number, "pin_notes": notes}
    doc = {**new.to_json(), "pin": pin_tag(dep.name, new.number), "pin_notes": notes, "recorded": True}
    ctx.write_json("release.json", doc)
    ctx.event("release", number=new.number, image_id=new.image_id)
    ctx.say(f"  [green]recorded {escape(new.describe())}[/green]; image pinned as {pin_tag(dep.name, new.number)}")
    return doc


def target_after_failure(dep: "Deployment", failed: "RunOutcome") -> tuple[Release | None, str]:
    """The release to bring back after FAILED, or None and why not: only a failure of launch or
    health, only when launch replaced what ran (a refused launch keeps the running release), and only
    when the cluster no longer runs the current release."""
    from ..executors.shells import Shells
    from ..launch import release_store
    bad = next((s for s in failed.stages if s.status == "failed"), None)
    if bad is None or bad.name not in ("launch", "health"):
        return None, f"the run failed in {bad.name if bad else 'no stage'}, not in launch or health"
    launch = next((s for s in failed.stages if s.name == "launch"), None)
    if launch is None or launch.status == "skipped":
        return None, "this run launched nothing new (the failing deployment is the one already running)"
    with Shells(dep.cluster) as shells:
        try:
            target = current(release_store.read_history(dep, shells[dep.cluster.head]))
        except DeployctlError as e:
            return None, str(e)
        if target is None:
            return None, "no earlier release of this deployment to roll back to"
        try:
            if release_store.matches(target, release_store.read_running(dep, shells)):
                return None, f"release {target.number} still runs unchanged (launch replaced nothing)"
        except Exception:  # noqa: BLE001 - a host without its container: it does not run the release
            pass
    return target, ""


def report(rolled: dict[str, Any]) -> None:
    """Both outcomes at the end of a failed run: what failed was said above; this says the rollback's."""
    if not rolled.get("attempted"):
        STDERR.print(f"rollback: not attempted ({rolled.get('reason')})", markup=False)
        return
    n, img = rolled["to"], short_id(rolled.get("image_id", ""))
    if rolled.get("exit_code") == 0:
        STDERR.print(f"[green]rolled back[/green]: release {n} (image {img}) runs again and passed the health "
                     f"check (run record {escape(rolled['run_dir'])})", markup=True)
    else:
        STDERR.print(f"[red]rollback FAILED[/red]: release {n} (image {img}) did not come back "
                     f"({escape(rolled.get('error') or rolled.get('status', ''))}; run record "
                     f"{escape(rolled['run_dir'])})", markup=True)
        from ..runner import describe_failure
        from ..outcomes import HostResult
        for st in rolled.get("stages", []):
            for r in st.get("results", []):
                if r.get("status") == "failed":
                    STDERR.print(describe_failure(HostResult(r["host"], r["stage"], "failed", r.get("message", ""),
                                                             rc=r.get("rc"), log_path=r.get("log"),
                                                             tail=r.get("tail") or [])), markup=False)
