"""The launch stage's apply: read every host, refuse early, stop the old containers everywhere, then
start the head and the workers.

1. probe every host (in parallel): network facts (multi-node), staged tables, the image ID, the
   deployment's containers. A host that cannot be reached, lacks the image, or holds Engram rows
   of another rank fails here, and nothing is touched anywhere;
2. choose each host's own fabric and render each host's ContainerSpec (the head's fabric address
   is the master address); install the deployment's firewall chain (firewall.py: the rendezvous
   store and the fabric listeners only from the deployment's fabric addresses), idempotently;
3. every host already runs this spec on this image and the API answers: nothing to do (skipped);
4. stop and remove the deployment's containers on EVERY host and verify they are gone (a new worker
   could join a stale head's rendezvous and hang);
5. the memory gate on every host (engine.drop_caches, engine.min_mem_available_gib): drop the page
   cache, read MemAvailable; a host below the threshold fails with its numbers and nothing starts;
   a vLLM group over several nodes: the head's rendezvous port is free and every worker reaches it
   over the fabric (rendezvous.py), else the host concerned fails, named, and nothing starts;
6. start in render.start_sequence order: head-first (the head, then the workers in parallel) or
   workers-first (boot 10: the workers, engine.start_wait_s, then the head).
   From here on a Ctrl-C (or, unless --keep-on-failure, a failure of launch or health) removes this
   deployment's containers again.
"""
from __future__ import annotations

import os
import shlex
import time
from dataclasses import replace
from typing import Any, Callable

from rich.markup import escape

from .. import apikey
from ..deployment import Deployment
from ..errors import DeployctlError, InputError
from ..outcomes import HostFailure, HostResult
from ..plan import Action
from ..runrecord import HostLog, RunContext
from ..secrets import mask_argv, register_named
from . import api, firewall, probe, rendezvous, supervision
from .containers import (PREVIOUS_SUFFIX, Container, create, discard, is_previous, keep_as_previous,
                         list_containers, memory_gate, prepared_name, remove_all, run_argv, start,
                         write_secret_file)
from ..fabric import detect
from ..fabric.detect import Fabric
from .lifecycle import remove_everywhere
from ..executors.shells import HostShell, Shells, run_shells
from ..outcomes import parallel
from .results import failure, record
from .containerspec import TABLES_LABEL, ContainerSpec, bind_fabric, bind_tables, expand_env, start_sequence

STAGE_NAME = "launch"


# proves a host's staged tables (stages/prove_tables.py), given what the probe read there
Prover = Callable[[HostShell, dict[str, Any]], list[str]]


def apply(dep: Deployment, actions: list[Action], ctx: RunContext, prove: Prover | None = None) -> list[HostResult]:
    """PROVE: called per host before anything is touched; raises HostFailure to refuse the host."""
    environ = dict(os.environ)
    if dep.api_key is not None:      # ${DEPLOYCTL_API_KEY} in the engine env (orchestrator/apikey.py)
        environ[apikey.ENV_NAME] = dep.api_key.value
    # A ${VAR} the operator has not set is bad input: say so before any host is touched. What a
    # secret-named variable expands to is masked from here on, in the logs and records of this run.
    register_named(expand_env(dep.recipe.engine.env, environ, str(dep.loaded.path)))
    names = [a.host for a in actions]
    logs = {n: ctx.host_log(n, STAGE_NAME) for n in names}
    try:
        planned = {a.host: a.job for a in actions}
        missing = [n for n, j in planned.items() if not isinstance(j, ContainerSpec)]
        if missing:
            raise DeployctlError(f"internal error: the launch actions of {', '.join(missing)} carry no "
                                 "ContainerSpec (build plans with orchestrator.stages.build_plan)")
        return _Launch(dep, ctx, run_shells(dep.cluster, ctx.state), planned, logs, environ, prove).run()
    finally:
        for log in logs.values():
            log.close()


class _Launch:
    def __init__(self, dep: Deployment, ctx: RunContext, shells: Shells, planned: dict[str, ContainerSpec],
                 logs: dict[str, HostLog], environ: dict[str, str], prove: Prover | None = None):
        self.dep, self.ctx, self.shells, self.logs = dep, ctx, shells, logs
        self.prove = prove
        self.prepared: dict[str, str] = {}     # host -> the created, not yet started container
        # supervise.rollback: an up keeps the generation it replaces for the supervisor (docs/supervisor.md)
        self.rollback = supervision.enabled(dep) and dep.recipe.supervise.rollback
        self.keep_previous = False             # ... when that generation was serving (run() decides)
        self.planned, self.names = planned, list(planned)
        self.environ = environ
        self.head = dep.cluster.head
        self.image = dep.recipe.engine.image

    # -- results -----------------------------------------------------------------------------
    def result(self, host: str, status: str, message: str, *, rc: int | None = None,
               tail: list[str] | None = None, data: dict[str, Any] | None = None) -> HostResult:
        return record(self.ctx, self.logs[host], STAGE_NAME, host, status, message, rc=rc, tail=tail, data=data)

    def abort(self, failed: dict[str, BaseException], others: str,
              done: dict[str, str] | None = None) -> list[HostResult]:
        """Failed hosts with their reasons, hosts in DONE ok with its message, every other host
        skipped with OTHERS (why nothing happened there)."""
        out = []
        for n in self.names:
            if n in failed:
                f = failure(failed[n])
                out.append(self.result(n, "failed", str(f), rc=f.rc, tail=f.tail or None))
            elif done and n in done:
                out.append(self.result(n, "ok", done[n]))
            else:
                out.append(self.result(n, "skipped", others))
        return out

    def phase(self, what: str, names: list[str], fn: Callable[[str], Any]) -> tuple[dict[str, Any],
                                                                                    dict[str, BaseException]]:
        for n in names:
            self.ctx.event("action-start", host=n, stage=STAGE_NAME, op=what)
        res = parallel(names, fn)
        return res.ok, res.failed

    # -- steps -------------------------------------------------------------------------------
    def probe_host(self, name: str) -> probe.HostRead:
        sh, log = self.shells[name], self.logs[name]
        multi = self.dep.recipe.parallelism.nodes > 1
        read = probe.read_host(self.dep, sh, detect.head_address(self.dep.cluster) if multi else "")
        log.write(f"image {self.image}: {read.image_id or 'absent'}; containers of {self.dep.name}: "
                  + (", ".join(c.describe() for c in read.containers) or "none"))
        if not read.image_id:
            raise HostFailure(f"image {self.image} is not in the Docker engine {sh.host.docker_host} "
                              f"(ship it first: `deployctl ship -i {self.dep.cluster.file}`)")
        problem = probe.engram_problem(self.dep, sh.host, read.staged)
        if problem:
            raise HostFailure(f"refused: {problem}")
        return read

    def prove_tables(self, name: str, staged: dict[str, Any]) -> None:
        for line in self.prove(self.shells[name], staged) if self.prove else []:
            self.logs[name].write(f"proven: {line}")

    def fabrics(self, info: dict[str, probe.HostRead]) -> tuple[dict[str, Fabric | None],
                                                                 dict[str, BaseException]]:
        out: dict[str, Fabric | None] = {n: None for n in self.names}
        bad: dict[str, BaseException] = {}
        if self.dep.recipe.parallelism.nodes == 1:
            return out, bad
        for n in self.names:
            try:
                out[n] = detect.for_host(self.dep.cluster, self.dep.cluster.host(n), self.dep.recipe.engine.ib_hca,
                                         info[n].facts or {})
                self.logs[n].write(f"fabric: {out[n].iface} {out[n].address} ({out[n].reason})")
            except InputError as e:
                bad[n] = e
        return out, bad

    def unchanged(self, specs: dict[str, ContainerSpec], info: dict[str, probe.HostRead]) -> str | None:
        """None when every host runs exactly this spec on this image and the API answers; else why not."""
        for n in self.names:
            cs = info[n].containers
            if not cs:
                return f"{n} runs no container of {self.dep.name}"
            c = cs[0]
            if len(cs) > 1:
                return f"{n} has {len(cs)} containers of {self.dep.name}"
            if not c.running:
                return f"{n}: {c.describe()}"
            if c.spec != specs[n].digest and not renamed_only(c, specs[n], info[n].image_id):
                was, now = c.labels.get(apikey.LABEL, ""), specs[n].api_key_id
                key = (f" (the API key changed: id {was or 'none'} -> {now or 'none'})" if was != now else "")
                if c.labels.get(TABLES_LABEL, "") != specs[n].labels.get(TABLES_LABEL, ""):
                    key += " (the staged tables changed since it started)"
                return f"{n} runs spec {c.spec or '(none)'}, the new spec is {specs[n].digest}{key}"
            if c.image_id != info[n].image_id:
                return f"{n} runs image {c.image_id[7:19]}, {self.image} is now {(info[n].image_id or '')[7:19]}"
        r = self.dep.recipe
        with api.http_client(self.dep.api_key) as client:
            chk = api.check(client, self.dep.api_url, r.engine.served_name, None, 1, r.health.request_timeout_s,
                            self.dep.api_key)
        return None if chk.ok else f"the API does not answer ({chk.detail})"

    # -- the whole stage ---------------------------------------------------------------------
    def run(self) -> list[HostResult]:
        dep, ctx = self.dep, self.ctx
        info, bad = self.phase("probe", self.names, self.probe_host)
        if bad:
            return self.abort(bad, f"nothing changed: launch refused before touching any container "
                                   f"({', '.join(sorted(bad))} failed the checks)")
        if self.prove is not None:
            _, bad = self.phase("prove-tables", self.names, lambda n: self.prove_tables(n, info[n].staged))
            if bad:
                return self.abort(bad, f"nothing changed: launch refused before touching any container "
                                       f"({', '.join(sorted(bad))}: staged tables not current)")
        fabrics, bad = self.fabrics(info)
        if bad:
            return self.abort(bad, f"nothing changed: no fabric for {', '.join(sorted(bad))}")
        # What runs is what was planned (the action's ContainerSpec), bound to the detected fabric.
        head_fabric = fabrics[self.head]
        master = head_fabric.address if head_fabric else None
        # ... and to the staged tables' content digests: a restaged table restarts its engine.
        specs = {n: bind_tables(bind_fabric(self.planned[n], fabrics[n], master, dep.recipe.engine.nccl_roce_env),
                                probe.table_digests(info[n].staged))
                 for n in self.names}
        envs = {n: expand_env(s.env, self.environ, str(dep.loaded.path)) for n, s in specs.items()}
        # The deployment's firewall chain before anything could listen (and again on a no-op run,
        # idempotently): the rendezvous store admits only the fabric addresses (firewall.py).
        detected = {n: (f.address, f.network) for n, f in fabrics.items() if f}
        _, bad = self.phase("firewall", self.names, lambda n: self.guard(n, detected))
        if bad:
            return self.abort(bad, f"nothing changed: the firewall rules could not be installed on "
                                   f"{', '.join(sorted(bad))}")

        why = self.unchanged(specs, info)
        if why is None:
            return [self.result(n, "skipped", f"already running: {info[n].containers[0].describe()}, "
                                              f"spec {specs[n].digest}, image {(info[n].image_id or '')[7:19]}"
                                              + ("; API healthy" if n == self.head else ""),
                                data={"container": info[n].containers[0].id, "spec": specs[n].digest})
                    for n in self.names]
        ctx.say(f"  launching: {escape(why)}")
        for n in self.names:
            self.logs[n].write(f"launching ({why}): "
                               f"{shlex.join(mask_argv(run_argv(specs[n], self.dep.cluster.host(n).docker_host)))}")

        # Prepare before destroy: every new container is created beside the running one first; what
        # Docker refuses leaves the running deployment as it is.
        self.prepared, bad = self.phase("prepare", self.names, lambda n: self.create(n, specs[n], envs[n]))
        if bad or ctx.cancel.is_set():
            parallel(list(self.prepared), lambda n: discard(self.shells[n], self.prepared[n]))
            bad = bad or {n: HostFailure("cancelled (Ctrl-C) before starting") for n in self.names}
            kept = ("nothing changed: the running containers are kept (the new ones could not be created on "
                    f"{', '.join(sorted(bad))}; the prepared ones were removed)")
            ctx.say(f"  [yellow]{escape(kept)}[/yellow]")
            return self.abort(bad, kept)
        # A replica (#58) leaves the router and finishes its in-flight requests before its engine goes
        # (orchestrator/rolling.py); its route stage puts it back once healthy.
        if dep.cluster.replica and dep.cluster.router:
            from ..rolling import step_out_and_drain
            step_out_and_drain(dep, lambda m: ctx.say(f"  {escape(m)}"))
        # Every node is cleared before any starts. Ctrl-C from here on removes what was started.
        cleanup = _cleanup(dep, ctx, self.names)
        ctx.state.cleanups.append(cleanup)
        if not ctx.options.keep_on_failure:
            ctx.state.failure_cleanups.append(cleanup)
        # supervise.rollback: the generation being replaced is kept, stopped, for the supervisor to bring
        # back if the new one fails for good; only a group that was serving (every rank running)
        self.keep_previous = self.rollback and all(
            info[n].containers and all(c.running for c in info[n].containers) for n in self.names)
        removed, bad = self.phase("stop", self.names, lambda n: self.stop(n))
        if bad:
            return self.abort(bad, f"earlier containers removed here; nothing started because "
                                   f"{', '.join(sorted(bad))} could not be cleared")

        e = dep.recipe.engine
        if e.drop_caches or e.min_mem_available_gib or e.cache_dir:
            _, bad = self.phase("memory-gate", self.names, self.gate)
            if bad:
                return self.abort(bad, f"earlier containers removed here; nothing started because "
                                       f"{', '.join(sorted(bad))} failed the memory gate")
        if rendezvous.needed(dep) and master:
            bad = rendezvous.check(dep, self.shells, master)
            for n in self.names:
                self.logs[n].write(f"rendezvous {master}:{e.master_port}: "
                                   + (str(failure(bad[n])) if n in bad else "ok"))
            if bad:
                return self.abort(bad, f"earlier containers removed here; nothing started because "
                                       f"{', '.join(sorted(bad))} failed the rendezvous check")

        started: dict[str, str] = {}
        bad = {}
        for group in start_sequence(dep):
            group = [n for n in group if n in self.names]
            if not group:
                continue
            wait = specs[group[0]].start.get("wait_before_s", 0) if group == [self.head] else 0
            if wait:
                self.logs[self.head].write(f"waiting {wait:g}s after the workers before starting the head")
                if ctx.cancel.wait(wait):
                    bad = {self.head: HostFailure("cancelled (Ctrl-C) before starting")}
                    break
            what = "start-head" if group == [self.head] else "start-workers"
            ok, bad = self.phase(what, group, lambda n: self.start(n, specs[n]))
            started.update(ok)
            if bad:
                break
        ctx.state.launched = set(started)
        if bad:
            return self.abort(bad, f"not started: {', '.join(sorted(bad))} failed to start before it",
                              {n: f"started {cid[:12]}" for n, cid in started.items()})
        out = []
        for n in self.names:
            s, f = specs[n], fabrics[n]
            role = "head" if n == self.head else "worker"
            fab = f"; fabric {f.iface} {f.address}" if f else ""
            prev = f"; replaced {', '.join(c.short_id for c in removed[n])}" if removed[n] else ""
            out.append(self.result(n, "ok", f"started {s.name} ({started[n][:12]}) rank {s.rank} ({role}), "
                                            f"spec {s.digest}{fab}{prev}",
                                   data={"container": started[n], "spec": s.digest, "image": s.image,
                                         "argv": list(s.argv),
                                         "fabric": None if f is None else {"iface": f.iface, "address": f.address,
                                                                           "hcas": list(f.hcas),
                                                                           "reason": f.reason}}))
        return out

    def guard(self, name: str, detected: dict[str, tuple[str, str]]) -> str:
        msg, clash = firewall.apply_host(self.shells[name],
                                         firewall.ruleset(self.dep, self.dep.cluster.host(name), detected))
        self.logs[name].write(msg)
        for c in clash:
            self.logs[name].write(f"WARNING: {c}")
            self.ctx.say(f"  [yellow]{name}: {escape(c)}[/yellow]")
        return msg

    def create(self, name: str, spec: ContainerSpec, env: dict[str, str]) -> str:
        cid = create(self.shells[name], spec, env)
        self.logs[name].write(f"prepared {prepared_name(spec)} {cid[:12]} (created, not started)")
        return cid

    def stop(self, name: str) -> list[Container]:
        sh, keep, kept = self.shells[name], {self.prepared[name]}, ""
        if self.rollback:
            found = list_containers(sh, self.dep.name, previous=True)
            now = [c for c in found if c.name == self.planned[name].name]       # the current generation
            if self.keep_previous and now:
                keep_as_previous(sh, now[0])
                keep.add(now[0].id)
                kept = f"; kept {now[0].name} ({now[0].short_id}) stopped as {now[0].name}{PREVIOUS_SUFFIX}"
            else:        # a group that was not serving: the generation kept before stays the one to go back to
                keep |= {c.id for c in found if is_previous(c)}
        gone = remove_all(sh, self.dep.name, keep=frozenset(keep))
        self.logs[name].write("removed: " + (", ".join(c.describe() for c in gone) or "nothing to remove")
                              + kept + f"; verified: no other container of {self.dep.name} left")
        return gone

    def gate(self, name: str) -> str:
        e = self.dep.recipe.engine
        notes, msg = memory_gate(self.shells[name], e.drop_caches, e.min_mem_available_gib, e.cache_dir)
        self.logs[name].write("memory gate: " + "; ".join([*notes, msg]))
        for note in notes:
            if "skipped" in note:
                self.ctx.say(f"  {name}: page-cache {escape(note)}")
        return msg

    def start(self, name: str, spec: ContainerSpec) -> str:
        if self.ctx.cancel.is_set():
            raise HostFailure("cancelled (Ctrl-C) before starting")
        t0 = time.monotonic()
        for path, _what in spec.secret_files:     # SGLang's key file (orchestrator/apikey.py), before it starts
            assert self.dep.api_key is not None
            write_secret_file(self.shells[name], path, apikey.sglang_config(self.dep.api_key))
        cid = start(self.shells[name], spec, self.prepared[name])
        self.logs[name].write(f"started {spec.name} {cid[:12]} in {time.monotonic() - t0:.1f}s")
        return cid


def renamed_only(c: Container, spec: ContainerSpec, image_id: str | None) -> bool:
    """C runs SPEC but for the image's name: the image SPEC names is the one C runs (by ID) and C's
    spec is SPEC's under C's own image reference. A rollback launches a release's pin tag
    (releases.pin_tag); an `up` naming the same image by the inventory's tag is no change."""
    return bool(c.image_ref) and c.image_ref != spec.image and c.image_id == image_id \
        and replace(spec, image=c.image_ref).digest == c.spec


def _cleanup(dep: Deployment, ctx: RunContext, names: list[str]) -> Callable[[], None]:
    """Remove this deployment's containers everywhere (their logs saved to the run record first). With
    supervise.rollback the stopped previous generation (`-prev`, kept by this launch or an earlier one)
    stays: it is what the supervisor's rollback brings back when this up failed."""
    done: list[bool] = []
    keep_previous = supervision.enabled(dep) and dep.recipe.supervise.rollback

    def cleanup() -> None:
        if done:
            return
        done.append(True)
        ctx.say(f"removing the containers of {dep.name} on {len(names)} host(s) "
                f"(engine logs saved under {ctx.run_dir}/logs/<host>/engine.log)"
                + ("; the previous generation (-prev) is kept for the supervisor's rollback" if keep_previous else ""))
        for name, outcome in remove_everywhere(dep, names, ctx, keep_previous=keep_previous).items():
            if isinstance(outcome, BaseException):
                ctx.say(f"  {name}: [red]NOT removed[/red]: {escape(str(failure(outcome)))}")
            else:
                ctx.say(f"  {name}: " + (f"removed {', '.join(c.name for c in outcome)}" if outcome
                                         else "nothing to remove") + " (verified)")
    return cleanup
