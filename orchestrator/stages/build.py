"""build: the serving image, built from its chain (dockerfiles/chains/<engine.chain>.yml) on the head
node's Docker engine (a Spark builds natively for aarch64), for the head's platform, cached per step.

plan() reads the chain and lock definitions (repo data, like the recipe) for the head's architecture
(Host.arch: what preflight checks the head reports) to list the steps; a chain whose lock pins nothing
for that architecture is refused here (exit 2, naming the chain, the head, its architecture and the
lock's reason), before anything is built or contacted. It never contacts an engine nor hashes inputs,
so step digests are not known at plan time.
apply() checks the inputs on this machine (bad input: exit 2, before any engine is contacted), then on
the head: resolves the base, reuses or builds every step, tags engine.image, writes build-report.json
to the run record. Options (ctx.options, a RunOptions, from `deployctl build`): local, update_lock, prune,
no_cache, ci, inputs_dir, input_roots, chain_vars.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..executors.docker_cli import docker_sh
from ..imagechain import lock as locks
from ..imagechain.spec import LoadedChain, chain_for, ready_chain
from ..outcomes import HostResult, run_per_host
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..runrecord import HostLog, RunContext

REPORT_FILE = "build-report.json"


def plan(dep: "Deployment", options: RunOptions) -> tuple[list[Action], str]:
    e, head = dep.recipe.engine, dep.cluster.head_host
    if not e.chain:
        return [], dep.loaded.chain_skipped or f"engine.chain is not set: image {e.image} is used as it is"
    chain = chain_for(e.chain, head, f"recipe {dep.recipe.name}")
    steps = [{"name": s.name, "kind": s.kind, "parent": chain.parent_of(s), "uses": list(s.uses),
              "description": s.description,
              **({"verify": s.verify.expect} if s.verify else {}),
              **({"patches": len(s.patches)} if s.kind == "patch" else {})} for s in chain.steps]
    act = Action(
        "build", head.name, "docker-build",
        f"build {e.image} for {chain.platform} ({head.name} is {head.arch}) from chain {chain.name} "
        f"({len(steps)} steps, cached per step) on {head.name}'s engine",
        api=(f"Docker SDK at {head.ssh_url} ({docker_sh(head, 'system', 'dial-stdio')}): check the base is "
             f"{chain.platform}; per step, inspect deployctl-cache/{chain.name}:<step>-<digest>, build the missing "
             f"ones with platform {chain.platform}, check each image is {chain.platform}, tag {e.image}"),
        details={"image": e.image, "chain": chain.name, "arch": chain.arch, "platform": chain.platform,
                 "chain_file": str(chain.chain_file), "lock_file": str(chain.lock_file),
                 "base": chain.lock.base.image, "base_digest": chain.lock.base.digest,
                 "inputs_dir": str(chain.roots["inputs"]),
                 **({"wheelhouse": wheelhouse_details(chain)} if chain.wheelhouse else {}),
                 "steps": steps})
    return [act], ""


def wheelhouse_details(chain: LoadedChain) -> dict[str, Any]:
    """What the plan says of a chain's wheelhouse: the lock, the architecture and its wheel count."""
    w = chain.wheelhouse
    assert w is not None
    return {"lock": str(w.lock_file), "arch": w.arch, "wheels": len(w.pins), "debs": len(w.debs),
            "folder": str(w.folder)}


def apply(dep: "Deployment", actions: list[Action], ctx: "RunContext") -> list[HostResult]:
    opts = ctx.options
    e = dep.recipe.engine
    assert e.chain
    chain, notes = chain_for(e.chain, dep.cluster.head_host, f"recipe {dep.recipe.name}", ready_chain, say=ctx.say,
                             inputs_dir=opts.inputs_dir, input_roots=opts.input_roots, var_overrides=opts.chain_vars)

    def one(action: Action, log: "HostLog") -> HostResult:
        return _build_on(dep, action, log, ctx, chain, notes)
    return run_per_host(actions, ctx, one)


def _build_on(dep, action, log, ctx, chain, notes) -> HostResult:
    from ..executors import docker_engine as de
    from ..imagechain.builder import ChainBuilder, ChainFailed

    opts, e = ctx.options, dep.recipe.engine
    head = dep.cluster.host(action.host)
    where = "local engine" if opts.local else f"{head.name} ({head.ssh_url})"
    for n in notes:
        log.write(n)
    client = de.engine_client(dep.cluster, head, local=opts.local)
    try:
        engine = f"{where}: {de.engine_name(client)}"
        log.write(f"engine {engine}")
        if opts.update_lock:
            base, msg = locks.resolve_base(client, chain.lock.base)
            changed = locks.pin_changed(chain.lock.base, base)
            chain = locks.write_lock(chain, base)
            msg += f"; lock {chain.lock_file} {'updated' if changed else 'unchanged'}"
            log.write(msg)
            ctx.say(f"  {msg}")
        log.write(f"building for {chain.platform}: {head.name} is {head.arch}")
        builder = ChainBuilder(client, chain, final_tag=e.image, where=engine, host=head.name,
                               log_for=lambda step: ctx.host_log(head.name, f"build-{step}"),
                               say=ctx.say, cancel=ctx.cancel, no_cache=opts.no_cache)
        try:
            report = builder.build()
        except ChainFailed as f:
            _record(ctx, f.report, log)
            step_log = next((s.log for s in f.report.steps if s.name == f.step), None)
            return HostResult(head.name, "build", "failed", str(f), tail=f.tail, log_path=step_log,
                              data={"report": f.report.to_json()})
        if opts.prune:
            report.pruned = builder.prune()
            ctx.say(f"  prune: removed {len(report.pruned)} stale image(s)/tag(s) of chain {chain.name}")
        report.notes.extend(notes)
    finally:
        client.close()
    _record(ctx, report, log)
    msg = (f"{e.image} = {report.image_id[:19]} ({report.platform}): {len(report.built)} step(s) built, "
           f"{len(report.reused)} reused in {report.seconds:.1f}s")
    status = "skipped" if not report.built and not report.tag_changed else "ok"
    if status == "skipped":
        msg = (f"{e.image} is up to date ({report.image_id[:19]}, {report.platform}, all {len(report.reused)} "
               "steps reused)")
    return HostResult(head.name, "build", status, msg, data={"report": report.to_json()})


def _record(ctx: "RunContext", report: Any, log: "HostLog") -> None:
    """The JSON report into the run record; with --ci also a table in the GitHub job summary."""
    path = ctx.write_json(REPORT_FILE, report.to_json())
    log.write(f"report: {path}")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if ctx.options.ci and summary:
        rows = [f"| {s.name} | {s.kind} | {s.status} | `{s.digest.split(':')[-1][:12]}` | "
                f"`{s.image_id.split(':')[-1][:12]}` | {s.seconds:.1f}s |" for s in report.steps]
        with open(summary, "a") as fh:
            fh.write(f"### deployctl build: {report.image} ({report.status})\n\n"
                     "| step | kind | status | digest | image | time |\n|---|---|---|---|---|---|\n"
                     + "\n".join(rows) + "\n\n")


STAGE = Stage("build", plan, apply, "build the serving image, cached per layer, on the head node")
