"""source: head — make every worker's checkpoint folder byte-identical to the head's.

1. The head's manifest (path, size, sha256 per file; hashes cached by size+mtime+ctime+inode in the
   head's nvme_dir), once.
2. Per worker, in parallel: verify against it (sizes, then sha256, cached the same way on the
   worker); nothing differs -> skipped. Otherwise check free space for the bytes still to send
   (nothing is copied to a host that cannot hold them), then rsync exactly the differing files
   from the head (rsync.py), then verify again: the result is exact or the host failed.
Every command is the one the plan's action carries (its `SyncJob`, jobs.py).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..outcomes import HostFailure, HostResult, run_per_host
from . import remote
from .jobs import HostsideOp, SyncJob
from .manifest import Manifest, Verdict, gb
from .progress import Progress
from .rsync import explain, parse_stats
from .settings import MARGIN_BYTES, Settings, verify_timeout

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host
    from ..plan import Action
    from ..runrecord import HostLog, RunContext

STAGE_NAME = "sync-model"


def job_of(action: "Action") -> SyncJob:
    """The planned job (orchestrator/stages/sync_model.py puts it there)."""
    if not isinstance(action.job, SyncJob):
        raise HostFailure(f"internal error: the {STAGE_NAME} action of {action.host} carries no SyncJob "
                          "(build plans with orchestrator.stages.build_plan)")
    return action.job


def head_manifest(dep: "Deployment", op: HostsideOp, st: Settings, log: "HostLog") -> tuple[Manifest, dict]:
    """The head's manifest (and the raw facts: mount, rsync, missing required files)."""
    head = dep.cluster.head_host
    log.write(f"manifest of {head.name}:{dep.checkpoint_dir(head)}: {op.op} {' '.join(op.args)}")
    with remote.connect(head, dep.cluster, st.connect_timeout) as s:
        # The checkpoint size is unknown until listed: allow hashing the recipe's checkpoint_gb.
        doc = remote.hostside(s, op,
                              timeout=verify_timeout(int(dep.recipe.model.checkpoint_gb * 1e9)))
    m = Manifest.from_json(doc)
    log.write(f"{m.describe()}, digest {m.digest}, hashed {gb(m.hashed_bytes)} in {m.seconds:.1f}s")
    return m, doc


def hub_mismatch(dep: "Deployment", m: Manifest) -> None:
    """The head's manifest is what the workers are verified against: when this run's checkpoint came
    from the Hub (modelfetch/resolve.py), its LFS files must still have the Hub's sha256 (a blob changed
    on the head since fetch-model verified it would otherwise be copied everywhere, verified)."""
    want = dep.checkpoint.hub_sha256() if dep.checkpoint is not None else {}
    bad = [f"{rel} (Hub {want[rel][:12]}, head {sha[:12]})" for rel, _, sha in m.files
           if rel in want and want[rel] != sha]
    if bad:
        raise HostFailure(f"the head's copy differs from the Hub's sha256 for {', '.join(bad[:5])}: nothing was "
                          f"pushed; run `deployctl fetch-model --rehash` to fetch those files again")


def verify(dep: "Deployment", host: "Host", op: HostsideOp, m: Manifest, st: Settings, log: "HostLog",
           seen: dict | None = None, partial: dict | None = None) -> Verdict:
    root = dep.checkpoint_dir(host)
    with remote.connect(host, dep.cluster, st.connect_timeout) as s:
        v = Verdict.from_json(remote.hostside(s, op, data=m.to_stdin(seen, partial),
                                              timeout=verify_timeout(m.total_bytes)))
    log.write(f"verify {host.name}:{root}: {v.ok} match, to send: {v.problems()}, {len(v.extra)} extra, "
              f"hashed {gb(v.hashed_bytes)} in {v.seconds:.1f}s; {gb(v.avail_bytes)} free at {v.avail_path}")
    return v


def report(m: Manifest, v: Verdict, **more) -> dict:
    """The per-host JSON report's common part."""
    d = {"files_total": len(m.files), "bytes_total": m.total_bytes, "manifest_digest": m.digest,
         "checkpoint_dir": v.root, "files_ok_before": v.ok, "extra_files": list(v.extra[:20]),
         "hashed_bytes": v.hashed_bytes}     # what the worker re-hashed to verify (0: all from its cache)
    d.update(more)
    return d


def exact_result(host: str, m: Manifest, v: Verdict, t0: float) -> HostResult:
    """A worker that already holds the head's exact checkpoint: skipped, nothing sent."""
    why = f"already exact: {m.describe()} match the head's sha256, nothing sent"
    return HostResult(host, STAGE_NAME, "skipped", why + extras_note(v),
                      data=report(m, v, files_sent=0, bytes_sent=0, skipped_reason=why,
                                  duration_s=round(time.monotonic() - t0, 3)))


def extras_note(v: Verdict) -> str:
    if not v.extra:
        return ""
    return (f"; note: {len(v.extra)} file(s) here that the head lacks, left alone "
            f"({', '.join(v.extra[:3])}{', ...' if len(v.extra) > 3 else ''})")


def push_one(dep: "Deployment", action: "Action", m: Manifest, st: Settings, ctx: "RunContext",
             log: "HostLog") -> HostResult:
    c = dep.cluster
    w, head = c.host(action.host), c.head_host
    job = job_of(action)
    assert job.transfer is not None and job.after is not None
    t0 = time.monotonic()
    v = verify(dep, w, job.check, m, st, log)
    if v.complete:
        return exact_result(w.name, m, v, t0)
    if not v.rsync:
        raise HostFailure(f"rsync is not installed on {w.name} (apt-get install rsync); nothing was copied")
    files, need = v.to_send(m), v.bytes_to_send(m)
    if need + MARGIN_BYTES > v.avail_bytes:
        short = need + MARGIN_BYTES - v.avail_bytes
        raise HostFailure(f"not enough space on {w.name} at {v.avail_path} for {dep.checkpoint_dir(w)}: "
                          f"{gb(need)} to send + {gb(MARGIN_BYTES)} kept free, {gb(v.avail_bytes)} free: "
                          f"short by {gb(short)}; nothing was copied")
    total_timeout = job.transfer.total_timeout(need)
    argv = job.transfer.argv(need)
    log.write(f"to send: {v.problems(limit=10)}; {len(files)} files, {gb(need)}")
    log.write(f"on {head.name}: {' '.join(argv)}")
    ctx.say(f"  [dim]{w.name}[/dim] sending {len(files)} file(s), {gb(need)} from {head.name}")
    prog = Progress(w.name, need, ctx, log)
    t_copy = time.monotonic()
    with remote.connect(head, c, st.connect_timeout) as s:
        rc, out, err = remote.stream(s, argv, b"".join(f.encode() + b"\0" for f in files),
                                     timeout=total_timeout + 30, on_line=prog.line)
    copy_s = time.monotonic() - t_copy
    if rc != 0:
        raise HostFailure(explain(rc, err, w.name, w.address, dep.checkpoint_dir(w), job.transfer.io_timeout,
                                  total_timeout) + f" ({gb(prog.done)} of {gb(need)} had arrived)",
                          rc=rc, tail=[x for x in err.splitlines() if x.strip()][-10:])
    stats = parse_stats(out)
    after = verify(dep, w, job.after, m, st, log)     # exact now? then drop rsync's leftovers
    if not after.complete:
        raise HostFailure(f"after the copy {w.name} still differs from the head: {after.problems()} "
                          f"(did the head's files change during the sync? re-run)")
    rate = stats.get("bytes_sent", need) / copy_s if copy_s > 0 else 0.0
    dur = time.monotonic() - t0
    msg = (f"sent {stats.get('files_sent', len(files))} file(s), {gb(stats.get('bytes_sent', need))} "
           f"in {copy_s:.1f}s ({rate / 1e6:.0f} MB/s); now exact: {m.describe()}")
    return HostResult(w.name, STAGE_NAME, "ok", msg + extras_note(after),
                      data=report(m, v, to_send=files[:50], bytes_to_send=need, **stats,
                                  copy_s=round(copy_s, 3), duration_s=round(dur, 3)))


def head_result(head: str, m: Manifest, **more) -> HostResult:
    """The head's result: its manifest, hashed now or all from the hash cache (then skipped)."""
    cached = m.hashed_bytes == 0
    msg = (f"manifest of {m.describe()} (digest {m.digest}), "
           + ("all hashes from cache" if cached else f"hashed {gb(m.hashed_bytes)} in {m.seconds:.1f}s"))
    return HostResult(head, STAGE_NAME, "skipped" if cached else "ok", msg,
                      data={"files_total": len(m.files), "bytes_total": m.total_bytes,
                            "manifest_digest": m.digest, "hashed_bytes": m.hashed_bytes,
                            "checkpoint_dir": m.root, "duration_s": m.seconds, **more,
                            **({"skipped_reason": "manifest unchanged (hash cache)"} if cached else {})})


def head_first(dep: "Deployment", actions: "list[Action]", ctx: "RunContext", head_fn, worker_fn,
               undone: str) -> list[HostResult]:
    """The head's action, then the workers' in parallel; if the head failed, every worker gets a
    failed result that says so (UNDONE: what did not happen to it)."""
    head = dep.cluster.head_host.name
    results = run_per_host([a for a in actions if a.host == head], ctx, head_fn)
    workers = [a for a in actions if a.host != head]
    if any(r.status == "failed" for r in results):
        return results + [HostResult(a.host, STAGE_NAME, "failed", f"{undone}: the head {head} failed (see its result)")
                          for a in workers]
    return results + run_per_host(workers, ctx, worker_fn)


def apply(dep: "Deployment", actions: "list[Action]", ctx: "RunContext") -> list[HostResult]:
    st = Settings.from_options(ctx.options)
    head = dep.cluster.head_host
    got: dict[str, Manifest] = {}

    def head_fn(action: "Action", log: "HostLog") -> HostResult:
        m, doc = head_manifest(dep, job_of(action).check, st, log)
        if not doc.get("rsync"):
            raise HostFailure(f"rsync is not installed on the head {head.name} (apt-get install rsync)")
        if doc.get("missing_required"):
            raise HostFailure(
                f"the head {head.name} cannot read {', '.join(doc['missing_required'])}: rsync runs on "
                f"the head and needs there a key authorized on the workers and a known_hosts file with "
                f"their host keys; pass --head-key/--head-known-hosts (paths on the head)")
        hub_mismatch(dep, m)
        got["m"] = m
        return head_result(head.name, m)

    return head_first(dep, actions, ctx, head_fn, lambda a, log: push_one(dep, a, got["m"], st, ctx, log),
                      "not synced")
