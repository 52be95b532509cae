"""ship: move the image from the head's engine to every worker's, sending only the layers each lacks.

Path of the bytes: head -> worker. The controller SSHes to the head and runs the ship agent there
(orchestrator/hostside/ship_agent.py): one `docker save <image id>` whose stream is parsed once and fanned out
to all workers in parallel, each over the head's own `ssh worker docker load`, each reduced to the
layer folders that worker lacks. The controller probes the workers, reads progress, verifies.
The head's SSH to the workers uses the inventory's key and known_hosts paths, which must exist on
the head too (or `deployctl ship --head-ssh-key/--head-known-hosts`).
"""
from __future__ import annotations

import threading
import time


from ..errors import DeployctlError
from ..executors.docker_cli import docker_sh
from ..outcomes import HostFailure, HostResult, run_per_host
from ..plan import Action
from ..runoptions import RunOptions
from ..chain import route
from ..chain.gather import Gather
from ..ship import chained
from ..ship import transfer as tr
from ..ship.progress import ShipProgress
from ..ship.transfer import Timeouts
from .base import Stage



def plan(dep, options: RunOptions):
    """One action per worker carrying its ShipJob (the head's load command for it), which apply runs."""
    e, c, head = dep.recipe.engine, dep.cluster, dep.cluster.head_host
    t = _timeouts(options)
    if c.distribution == "chain":
        return _chain_plan(dep, t)
    acts = []
    for w in c.workers:
        job = tr.ship_job(w, c, options.ship_head_ssh_key or w.key_file,
                          options.ship_head_known_hosts or c.known_hosts_file, t)
        acts.append(Action(
            "ship", w.name, "image-ship",
            f"send the layers of {e.image} that {w.name} lacks, from {head.name}'s engine, head to worker",
            command=("ssh", f"{head.user}@{head.address}",
                     f"{docker_sh(head, 'save', e.image)} "
                     f"| <deployctl ship agent: only the layers {w.name} lacks> | {job.shown()}"),
            details={"image": e.image, "from": head.name, "to": w.name, "timeouts": vars(t)}, job=job))
    return acts, "" if acts else "single host: nothing to ship"


def _chain_plan(dep, t: Timeouts):
    """`distribution: chain`: the head's save streams once through every worker that lacks layers."""
    e, c, head = dep.recipe.engine, dep.cluster, dep.cluster.head_host
    hops = route.route(c, head.name, [w.name for w in c.workers])
    note = route.networks_note(hops)
    acts = []
    for hop in hops[1:]:
        w = c.host(hop.host)
        nxt = hop.downstream or None
        job = tr.ship_job(w, c, None, None, t)
        acts.append(Action(
            "ship", w.name, "image-chain",
            f"receive the layers of {e.image} that the workers lack, from {hop.upstream} over the {hop.network} at "
            f"{hop.address}" + (f", forwarding every byte to {nxt} as it arrives" if nxt else " (the chain's tail)")
            + f"; load those {w.name} lacks into its engine; verify the config digest and diff_ids",
            command=("ssh", f"{head.user}@{head.address}",
                     f"{docker_sh(head, 'save', e.image)} | <deployctl ship agent: the layers any worker lacks> "
                     f"| <chain source>", "->", f"<chain {' -> '.join(h.host for h in hops)}>", "->",
                     "ssh", f"{w.user}@{w.address}", job.shown()),
            details={"image": e.image, "from": head.name, "to": w.name, "timeouts": vars(t), "distribution": "chain",
                     "chain": note, "upstream": hop.upstream, "listen": hop.address, "network": hop.network,
                     "downstream": nxt}, job=job))
    return acts, note if acts else "single host: nothing to ship"


def _timeouts(options: RunOptions):
    d = Timeouts()
    stall = float(options.ship_stall_s or d.stall_s)
    deadline = float(options.ship_timeout_s or d.deadline_s)
    return Timeouts(connect_s=d.connect_s, stall_s=stall, deadline_s=deadline, load_s=min(d.load_s, deadline),
                    head_silence_s=max(d.head_silence_s, stall))


def apply(dep, actions, ctx):
    from ..executors.ssh import SSHError, SSHTarget

    cluster, head_host = dep.cluster, dep.cluster.head_host
    image = dep.recipe.engine.image
    jobs: dict[str, tr.ShipJob] = {a.host: a.job for a in actions}
    if not all(isinstance(j, tr.ShipJob) for j in jobs.values()):
        raise DeployctlError("internal error: ship actions carry no ShipJob (build plans with "
                             "orchestrator.stages.build_plan)")
    t = next(iter(jobs.values())).timeouts if jobs else _timeouts(ctx.options)
    workers = {w.name: w for w in cluster.workers}
    logs: dict = {}
    layer_events: list[dict] = []

    head: tr.HeadImage | None = None
    head_error = ""
    cache_root = str(ctx.run_dir.parent)     # <runs>/image-manifests/: what a manifest digest names
    try:
        with SSHTarget.for_host(head_host, cluster, t.connect_s).connect() as s:
            head = tr.inspect_head(s, image, head_host.docker_host)
            head = tr.with_manifest(s, head, head_host.docker_host, cache_root)
    except (SSHError, tr.ShipError) as e:
        head_error = f"head {head_host.name}: {e}"

    progress = ShipProgress(ctx)

    def on_event(ev: dict) -> None:
        kind = ev.get("ev")
        if kind == "p":
            phase = {"save": f"docker save on {head_host.name}", "stream": "sending", "load": "docker load"}
            for name, n in ev.get("b", {}).items():
                dead = name in ev.get("dead", ())
                progress.update(name, completed=n, status="failing" if dead else phase.get(ev.get("phase"), ""))
        elif kind == "layer":
            layer_events.append(ev)
            where = f"layer {ev['index']}" if ev["index"] is not None else "an unidentified layer (sent)"
            for name, log in logs.items():
                sent = name in ev.get("to", ())
                log.write(f"{where} (folder {ev['folder'][:12]}): {'sending' if sent else 'present, not sent'}")

    def transfer(sends: dict[str, list[int]]) -> dict[str, tr.WorkerOutcome]:
        assert head is not None
        argvs = {n: list(jobs[n].load_argv) for n in sends}
        need = {p for n in sends for p in jobs[n].need_files}
        spec = tr.agent_spec(head, head_host, sends, argvs, sorted(need), t)
        with SSHTarget.for_host(head_host, cluster, t.connect_s).connect() as s:
            ctx.state.cleanups.append(s.close)
            try:
                done = tr.run_agent(s, spec, on_event, ctx.cancel, t)
            except SSHError as e:
                raise tr.ShipError(f"the connection to the head failed during the transfer: {e}") from None
        return tr.outcomes_from(done, layer_events)

    def on_node(name: str, doc: dict) -> None:
        if doc.get("ev") == "p" and name in logs:
            fwd = int(doc.get("fwd") or 0)
            progress.update(name, completed=int(doc.get("recv") or 0),
                            status=f"receiving, forwarded {_mb(fwd)}" if fwd else "receiving")

    def transfer_chain(sends: dict[str, list[int]]) -> dict[str, tr.WorkerOutcome]:
        assert head is not None
        return chained.transfer(cluster, head_host, head, sends, t, on_event, on_node, ctx.say, ctx.cancel)

    chain = cluster.distribution == "chain"
    fan = Gather({a.host for a in actions}, transfer_chain if chain else transfer, tr.failed_outcome)

    def config_reader(s, w):
        """The config digest of an image ID in worker W's engine (its manifest, on a containerd store)."""
        assert head is not None
        return lambda image_id: tr.manifest_of(s, w.docker_host, image_id, head.arch, cache_root).config

    def one(action: Action, log) -> HostResult:
        t0 = time.monotonic()
        name = action.host
        w = workers[name]
        joined = False
        try:
            if head is None:
                raise HostFailure(head_error or "the head's image is unknown")
            refusal = head.refusal_for(w)
            if refusal:                # nothing is sent: a worker of another architecture cannot run it
                raise HostFailure(refusal)
            log.write(f"{head.name} on {head_host.name} is {head.id} ({len(head.diff_ids)} layers; "
                      f"{head.engine.describe()}" + (f"; config {head.config}" if head.config != head.id else "")
                      + ")")
            try:
                with SSHTarget.for_host(w, cluster, t.connect_s).connect() as s:
                    have = tr.probe_worker(s, w.docker_host)
                    log.write(f"{name}: {have.engine.describe()}")
                    wid = tr.find_image(head, have, config_reader(s, w))
                    if wid:
                        fan.leave(name)
                        joined = True
                        if not have.tagged(head, wid):
                            tr.tag_and_verify(s, w.docker_host, head, wid)
                        progress.update(name, completed=0, status="has it", finished=True)
                        return HostResult(name, "ship", "skipped",
                                          f"already has {image} ({tr.short(wid)}): nothing sent",
                                          data=_data(head, [], 0, time.monotonic() - t0, 0.0))
            except tr.ShipError as e:
                raise HostFailure(f"before the transfer: {e}", rc=e.rc) from None
            send = tr.plan_sends(head, have)
            whole = tr.whole_image_reason(head, have)
            if whole:
                log.write(whole)
            log.write(f"lacks {len(send)} of {len(head.diff_ids)} layers: {send}; "
                      f"{len(head.diff_ids) - len(send)} present")
            log.write(("loaded on it by its chain node with" if chain else "the head loads it with")
                      + f" the planned command: {jobs[name].shown()}")
            progress.add(name, head.estimate(send), "waiting")
            if not cluster.host_key_checking and not chain:
                log.write(f"WARNING: host_key_checking is false: the head accepts any SSH host key from {name}")
            logs[name] = log           # the transfer writes its layer decisions here
            joined = True
            out = fan.join(name, send, timeout=t.deadline_s + t.load_s + 300)
            for line in out.tail:
                log.write(f"[docker load] {line}")
            if not out.ok:
                progress.update(name, status="[red]failed[/red]")
                raise HostFailure(f"transfer from {head_host.name} failed: {out.message}", rc=out.rc,
                                  tail=out.tail[-10:])
            try:
                with SSHTarget.for_host(w, cluster, t.connect_s).connect() as s:
                    wid = head.id              # both graph-driver stores: an image is named by its config
                    if have.engine.containerd_store or head.engine.containerd_store:
                        # the ID the worker's store gave it: asked, not assumed
                        wid = tr.find_image(head, tr.probe_worker(s, w.docker_host), config_reader(s, w))
                        if wid is None:
                            raise tr.ShipError(f"verification failed: after the load no image on this worker "
                                               f"has the head's config {head.config}")
                    tr.tag_and_verify(s, w.docker_host, head, wid)
            except tr.ShipError as e:
                raise HostFailure(str(e), rc=e.rc) from None
            secs = time.monotonic() - t0
            data = _data(head, out.layers_sent, out.bytes, secs, out.stream_s, out.unidentified)
            if out.chain:
                data.update(distribution="chain", **out.chain)
            progress.update(name, completed=out.bytes, status="[green]verified[/green]", finished=True)
            how = (f" from {out.chain['upstream']} over the {out.chain['network']}"
                   + (f" (pass {out.chain['passes']}, after {', '.join(out.chain['cut'])} was cut out of the chain)"
                      if out.chain.get("cut") else "") if out.chain else "")
            return HostResult(name, "ship", "ok",
                              f"sent {len(out.layers_sent)} of {len(head.diff_ids)} layers{how}, "
                              f"{_mb(out.bytes)} in {secs:.1f}s ({data['rate_mb_s']} MB/s), "
                              f"{data['layers_skipped']} present; image {tr.short(wid)} verified"
                              + (" (whole image: a legacy archive to a containerd store)" if whole else ""),
                              data={**data, "whole_image_reason": whole} if whole else data)
        except SSHError as e:
            progress.update(name, status="[red]failed[/red]")
            raise HostFailure(f"SSH from the controller: {e}") from None
        finally:
            if not joined:
                fan.leave(name)

    with progress:
        return _interruptible(lambda: run_per_host(actions, ctx, one), ctx)


def _interruptible(fn, ctx) -> list[HostResult]:
    """Run FN in a thread so that Ctrl-C here cancels the transfer (the agent on the head then stops
    what it started) instead of waiting for the workers' threads to end on their own."""
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    try:
        while th.is_alive():
            th.join(0.2)
    except KeyboardInterrupt:
        ctx.cancel.set()
        th.join(30)
        raise
    return out[0]


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 10_000 else f"{n} bytes"


def _data(head, sent: list[int], nbytes: int, seconds: float, stream_s: float, unidentified: int = 0) -> dict:
    rate = nbytes / stream_s / 1e6 if stream_s > 0 else 0.0
    return {"image": head.name, "image_id": head.id, "bytes_sent": nbytes, "layers_total": len(head.diff_ids),
            "layers_sent": len(sent), "layers_skipped": len(head.diff_ids) - len(sent),
            "layers_unidentified": unidentified, "seconds": round(seconds, 3),
            "stream_seconds": round(stream_s, 3), "rate_mb_s": round(rate, 2)}


STAGE = Stage("ship", plan, apply, "ship the image to every worker, only the layers it lacks")
