"""source: head with `distribution: chain`: the head sends each checkpoint byte once.

1. The head's manifest, once (as push.py).
2. Per worker, in parallel: verify against it; exact -> skipped; else check free space for what it
   lacks. The workers that lack something meet (chain/gather.py).
3. One chain (chain/route.py, chain/run.py): the head streams the union of the missing files, in
   manifest order, to the first worker over the fabric; every worker forwards each chunk to the next
   as it arrives and writes the files it lacks (sha256 checked against the manifest before a file
   takes its real name).
4. A node that dies mid-chain is cut out: the nodes after it are finished by a second pass whose
   source is a complete node next to the first of them along the route (on a mesh, one cabled to it;
   chain/route.py repair_source), or the head, with only what each still lacks.
   With Engram on NVMe a worker keeps of the Engram shards only its rank's rows (rows.py): such a
   worker is never a repair source.
5. Per worker: verify again (sha256, hash cache), dropping the chain's partial folder.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..chain import route
from ..chain.gather import Gather
from ..chain.run import NodeOutcome, Timeouts, run_pass, slowest_note
from ..hostside.engram_spec import spec_for
from ..outcomes import HostFailure, HostResult
from . import rows
from .manifest import Manifest, gb
from .progress import Progress
from .push import (STAGE_NAME, exact_result, extras_note, head_first, head_manifest, head_result, hub_mismatch,
                   job_of, report, verify)
from .settings import MARGIN_BYTES, MIN_RATE, Settings

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..plan import Action
    from ..runrecord import HostLog, RunContext

MAX_PASSES = 3


@dataclass
class Wanted:
    files: list[str]
    log: "HostLog"
    keep: dict = field(default_factory=dict)    # rel -> the byte ranges this host keeps of it (rows.py)


@dataclass
class Delivery:
    """What the chain did for one worker."""
    ok: bool
    message: str = ""
    rc: int | None = None
    tail: list[str] = field(default_factory=list)
    upstream: str = ""
    network: str = ""
    recv: int = 0
    fwd: int = 0
    rate: float = 0.0
    passes: int = 1
    order: list[str] = field(default_factory=list)
    cut: list[str] = field(default_factory=list)      # dead nodes this host's chain went around
    seen: dict = field(default_factory=dict)          # rel -> hash-cache entry, from the node's own sha256


def timeouts(st: Settings, nbytes: int) -> Timeouts:
    return Timeouts(connect_s=st.connect_timeout, stall_s=st.io_timeout,
                    deadline_s=st.timeout or 300.0 + nbytes / MIN_RATE)


def distribute(dep: "Deployment", m: Manifest, wants: dict[str, Wanted], st: Settings, ctx: "RunContext",
               cancel: threading.Event | None = None) -> dict[str, Delivery]:
    c = dep.cluster
    sizes = {rel: (size, sha) for rel, size, sha in m.files}
    need = {h: list(w.files) for h, w in wants.items()}
    results: dict[str, Delivery] = {}
    dead: dict[str, str] = {}
    complete = {c.head}                      # nodes that hold the whole checkpoint (sources for a repair)
    source = c.head
    seen: dict[str, dict] = {h: {} for h in wants}
    for n in range(1, MAX_PASSES + 1):
        targets = [h for h in need if need[h]]
        if not targets:
            break
        hops = route.route(c, source, targets)
        union = sorted({f for h in targets for f in need[h]})
        files = [[rel, *sizes[rel]] for rel in union]
        nbytes = sum(sizes[rel][0] for rel in union)
        order_text = route.networks_note(hops)
        ctx.say(f"  sync-model pass {n}: {len(files)} file(s), {gb(nbytes)}; {order_text}")
        for h in targets:
            wants[h].log.write(f"pass {n}: {order_text}; receiving {len(files)} file(s), {gb(nbytes)}, "
                               f"writing the {len(need[h])} this host lacks")
        prog = {h: Progress(h, nbytes, ctx, wants[h].log) for h in targets}

        def on_event(host: str, doc: dict) -> None:
            if host in prog and doc.get("ev") == "p":
                prog[host].update(int(doc.get("recv") or 0),
                                  f"forwarded {gb(int(doc.get('fwd') or 0))}" if doc.get("fwd") else "")
            elif host in wants and doc.get("ev") == "file":
                seen[host][doc["path"]] = doc.get("cache")
                wants[host].log.write(f"received {doc['path']} ({doc['bytes']} bytes), sha256 matches the manifest")

        specs = {h.host: {"mode": "files", "root": dep.checkpoint_dir(c.host(h.host)), "need": need.get(h.host, []),
                          **({"keep": wants[h.host].keep} if h.host in wants and wants[h.host].keep else {}),
                          **({"files": files, "rate_bps": (st.bwlimit_mbps or 0) * 1e6} if h.host == source else {})}
                 for h in hops}
        outs = run_pass(c, hops, specs, timeouts(st, nbytes), on_event, cancel)
        src = outs[source]
        ctx.say(f"  sync-model pass {n} done{slowest_note(outs, hops)}")
        for h in targets:
            o: NodeOutcome = outs[h]
            written = set(o.written)
            need[h] = [f for f in need[h] if f not in written]
            if src.error:
                o.error = o.error or f"the source {source} failed: {src.error}"
            d = Delivery(o.ok, upstream=o.upstream, network=o.network, recv=o.recv, fwd=o.fwd, rate=o.rate(),
                         passes=n, order=[x.host for x in hops], rc=o.rc, tail=o.tail)
            if not o.ok:
                d.message = o.why()
            if o.ok:
                need[h] = []
                if not wants[h].keep:        # a host holding some files in part is no repair source
                    complete.add(h)
            elif o.dead:
                dead[h] = d.message
                need[h] = []                 # cut out: no further pass for it
            wants[h].log.write(f"pass {n}: {'complete' if o.ok else 'NOT complete: ' + o.why()}; received "
                               f"{gb(o.recv)}, forwarded {gb(o.fwd)} at {o.rate() / 1e6:.1f} MB/s from {o.upstream}")
            results[h] = d
        if src.error:
            if source == c.head:
                break
            dead[source] = src.error
            complete.discard(source)
        order = [x.host for x in hops] + [h.name for h in c.hosts if h.name not in {x.host for x in hops}]
        left = [h for h in order if need.get(h)]
        if not left:
            break
        # a repair: from a complete node next to the first unfinished one along this pass's route (on a
        # mesh, cabled to it), not by rank order (chain/route.py repair_source)
        source = route.repair_source(c, hops, complete, left)
        cut = ", ".join(f"{h} ({why})" for h, why in dead.items()) or "none"
        ctx.say(f"  sync-model: {', '.join(left)} not complete; cut out: {cut}; pass {n + 1} from {source}")
    for h, d in results.items():
        d.seen = {k: v for k, v in seen.get(h, {}).items() if v}
        if h not in dead:
            d.cut = sorted(dead)
            if not d.ok and dead:
                d.message += f" (cut out of the chain: {', '.join(sorted(dead))})"
    return results


def rows_note(dep: "Deployment", rank: int, keep: dict) -> str:
    """What a worker holding the Engram shards in part holds, for its result line."""
    if not keep:
        return ""
    f = rows.figures(dep, rank)
    return (f"; of the {len(keep)} Engram shard(s) it keeps only rank {rank}'s rows: {gb(f['rank_row_bytes'])} "
            f"of the {gb(f['engram_bytes'])} of Engram rows (the rest are holes)")


def rows_data(dep: "Deployment", rank: int, keep: dict) -> dict:
    return {"engram_rows": {**rows.figures(dep, rank), "files_in_part": sorted(keep),
                            "kept_bytes": {p: rows.kept_bytes(k) for p, k in keep.items()}}} if keep else {}


def apply(dep: "Deployment", actions: "list[Action]", ctx: "RunContext") -> list[HostResult]:
    st = Settings.from_options(ctx.options)
    head = dep.cluster.head_host
    got: dict = {}                      # the head's manifest ("m") and its Engram tensors' places
    workers = {a.host for a in actions if a.host != head.name}
    gather: Gather[Delivery] | None = None

    def head_fn(action: "Action", log: "HostLog") -> HostResult:
        m, doc = head_manifest(dep, job_of(action).check, st, log)
        hub_mismatch(dep, m)
        got["m"] = m
        got["tensors"] = doc.get("tensors") or {}
        whole = rows.unlocated(dep, got["tensors"]) if rows.applies(dep) else ""
        if whole:
            log.write(f"Engram rows per rank: {whole}")
            ctx.say(f"  sync-model: {whole}")
        got["in_part"] = rows.applies(dep) and not whole
        return head_result(head.name, m, distribution="chain")

    def run(wants: dict) -> dict[str, Delivery]:
        return distribute(dep, got["m"], wants, st, ctx, ctx.cancel)

    def worker_fn(action: "Action", log: "HostLog") -> HostResult:
        assert gather is not None
        m = got["m"]
        job = job_of(action)
        assert job.after is not None
        w = dep.cluster.host(action.host)
        t0 = time.monotonic()
        joined = False
        try:
            keep = (rows.keep_spans(spec_for(dep.recipe, w.rank), got["tensors"], {p: n for p, n, _ in m.files})
                    if got["in_part"] else {})
            v = verify(dep, w, job.check, m, st, log, partial=keep)
            if v.complete:
                r = exact_result(w.name, m, v, t0)
                r.message += rows_note(dep, w.rank, keep)
                r.data.update(rows_data(dep, w.rank, keep))
                return r
            files = v.to_send(m)
            need = sum(rows.kept_bytes(keep[p]) if p in keep else m.size_of(p) for p in files)
            if need + MARGIN_BYTES > v.avail_bytes:
                raise HostFailure(f"not enough space on {w.name} at {v.avail_path} for {dep.checkpoint_dir(w)}: "
                                  f"{gb(need)} to receive + {gb(MARGIN_BYTES)} kept free, {gb(v.avail_bytes)} "
                                  f"free: short by {gb(need + MARGIN_BYTES - v.avail_bytes)}; nothing was copied "
                                  f"(it is left out of the chain)")
            log.write(f"to receive: {v.problems(limit=10)}; {len(files)} files, {gb(need)}")
            joined = True
            t_copy = time.monotonic()
            d = gather.join(w.name, Wanted(files, log, {p: keep[p] for p in files if p in keep}),
                            timeout=timeouts(st, m.total_bytes).deadline_s * MAX_PASSES + 300)
            copy_s = time.monotonic() - t_copy
            if not d.ok:
                raise HostFailure(f"{d.message}; re-run to finish (completed files are kept)", rc=d.rc,
                                  tail=d.tail[-10:])
            after = verify(dep, w, job.after, m, st, log, seen=d.seen, partial=keep)
            if not after.complete:
                raise HostFailure(f"after the chain {w.name} still differs from the head: {after.problems()} "
                                  f"(did the head's files change during the sync? re-run)")
            msg = (f"received {len(files)} file(s), {gb(need)} from {d.upstream} over the {d.network} "
                   f"in {copy_s:.1f}s ({d.rate / 1e6:.0f} MB/s), forwarded {gb(d.fwd)}"
                   + (f" (pass {d.passes}, after {', '.join(d.cut)} was cut out of the chain)" if d.cut else "")
                   + f"; now exact: {m.describe()}" + rows_note(dep, w.rank, keep))
            return HostResult(w.name, STAGE_NAME, "ok", msg + extras_note(after),
                              data=report(m, v, to_send=files[:50], bytes_to_send=need, files_sent=len(files),
                                          bytes_sent=need, bytes_received=d.recv, bytes_forwarded=d.fwd,
                                          upstream=d.upstream, network=d.network, chain=d.order, passes=d.passes, cut=d.cut,
                                          distribution="chain", copy_s=round(copy_s, 3),
                                          **rows_data(dep, w.rank, keep),
                                          hashed_after=after.hashed_bytes,
                                          duration_s=round(time.monotonic() - t0, 3)))
        finally:
            if not joined:
                gather.leave(w.name)

    gather = Gather(workers, run, lambda name, e: Delivery(False, message=f"the chain failed: {e}"))
    return head_first(dep, actions, ctx, head_fn, worker_fn, "not synced")
