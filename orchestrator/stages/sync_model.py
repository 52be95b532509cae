"""sync-model: every node has the exact checkpoint (the head's, file by file, sha256) before staging.

model.source: head (default) pushes the head's copy to the workers with rsync run on the head;
model.source: shared verifies that every node sees the head's copy on one shared mount.
The logic lives in orchestrator/modelsync/ (jobs.py, push.py, shared.py; hostside/modelsync.py runs on the hosts).
"""
from __future__ import annotations

from ..chain import route
from ..modelsync import chained, jobs, push, rows, shared
from ..modelsync.manifest import gb
from ..modelsync.settings import Settings, cache_file, revision_note
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage

NAME = "sync-model"


def plan(dep, options: RunOptions):
    """One action per host carrying its `SyncJob` (modelsync/jobs.py), which apply runs as is."""
    m, c = dep.recipe.model, dep.cluster
    head = c.head_host
    st = Settings.from_options(options)
    src = dep.checkpoint_dir(head)
    what = f"{m.repo}@{dep.snapshot[:12]}"
    pinned = revision_note(m.revision, m.checkpoint_dir, dep.snapshot)
    details = {"repo": m.repo, "revision": m.revision, "commit": dep.snapshot, "source": m.source, "head": head.name,
               "checkpoint_dir": src}
    if not c.workers:
        return [], f"single host: the head's copy of {what} is the only one"
    if m.source == "shared":
        where = f" on the shared mount {m.shared_path}" if m.shared_path else ""
        hj = jobs.head_job(dep, st, marker=f"{jobs.MARKER}={jobs.NONCE}")
        acts = [Action(NAME, head.name, "verify-shared",
                       f"manifest of {m.repo} {pinned} at {head.name}:{src}{where}; write a marker for the workers",
                       command=hj.check.shown(head), details={**details, "shared_path": m.shared_path}, job=hj)]
        for w in c.workers:
            dst = dep.checkpoint_dir(w)
            wj = jobs.shared_job(dep, w, jobs.MARKER)
            acts.append(Action(
                NAME, w.name, "verify-shared",
                f"check that {w.name} sees the head's {what} at {dst}: same storage (marker), "
                f"{'mounted at ' + m.shared_path + ', ' if m.shared_path else ''}every file with its size; "
                f"copies nothing", command=wj.check.shown(w),
                details={**details, "checkpoint_dir": dst, "shared_path": m.shared_path}, job=wj))
        return acts, f"source shared: nothing is copied; {what}"
    if c.distribution == "chain":
        return _chain_plan(dep, st, what, pinned, details)
    est = int(m.checkpoint_gb * 1e9)
    hj = jobs.head_job(dep, st)
    acts = [Action(NAME, head.name, "manifest",
                   f"manifest of {m.repo} {pinned} at {head.name}:{src}: path, size, sha256 per file (links followed; "
                   f"hashes cached by size+mtime in {cache_file(head.nvme_dir, src)})",
                   command=hj.check.shown(head), details=details, job=hj)]
    for w in c.workers:
        dst = dep.checkpoint_dir(w)
        wj = jobs.push_job(dep, w, st)
        assert wj.transfer is not None
        acts.append(Action(
            NAME, w.name, "rsync",
            f"make {w.name}:{dst} exactly the head's {what}: verify by sha256 (cached), check free space, "
            f"then rsync only the files that differ from {head.name} to {w.address}, verify again",
            command=("ssh", f"{head.user}@{head.address}", *wj.transfer.argv(est)),
            details={**details, "checkpoint_dir": dst, "from": f"{head.name}:{src}", "to": w.address,
                     "stdin": "the differing files' relative paths, NUL-separated",
                     "verify": list(wj.check.shown(w)),
                     "timeout": f"the whole-transfer timeout shown is for the full {m.checkpoint_gb:g} GB; "
                                "the run bounds it by the bytes still to send"}, job=wj))
    return acts, ""


def _chain_plan(dep, st, what: str, pinned: str, details: dict):
    """`distribution: chain`: the head's manifest, then per worker: verify, receive from its upstream
    while forwarding to its downstream, verify again. The plan shows the chain with every worker in it;
    the run leaves out those already exact."""
    c, m = dep.cluster, dep.recipe.model
    head = c.head_host
    src = dep.checkpoint_dir(head)
    hops = route.route(c, head.name, [w.name for w in c.workers])
    note = route.networks_note(hops)
    hj = jobs.head_job(dep, st)
    acts = [Action(NAME, head.name, "manifest",
                   f"manifest of {m.repo} {pinned} at {head.name}:{src}: path, size, sha256 per file (links followed; "
                   f"hashes cached by size+mtime in {cache_file(head.nvme_dir, src)}); then the chain's source: "
                   f"it reads and sends each file the workers lack once",
                   command=hj.check.shown(head), details={**details, "distribution": "chain", "chain": note},
                   job=hj)]
    in_part = rows.applies(dep)
    for hop in hops[1:]:
        w = c.host(hop.host)
        nxt = hop.downstream or None
        wj = jobs.chain_job(dep, w, st)
        f = rows.figures(dep, w.rank) if in_part else {}
        part = (f"; of the Engram shards it keeps only rank {w.rank}'s rows ({gb(f['rank_row_bytes'])} of the "
                f"{gb(f['engram_bytes'])} of Engram rows, {gb(f['not_received_bytes'])} not stored: the "
                f"whole stream still passes through and is checked)" if f else "")
        acts.append(Action(
            NAME, w.name, "chain",
            f"make {w.name}:{dep.checkpoint_dir(w)} exactly the head's {what}: verify by sha256 (cached), check "
            f"free space, then receive from {hop.upstream} over the {hop.network} at {hop.address} "
            + (f"while forwarding every byte to {nxt}, " if nxt else "(the chain's tail), ")
            + "write only the files it lacks (sha256 checked before a file takes its name), verify again" + part,
            command=("ssh", f"{w.user}@{w.address}", "python3", "-c", "<bootstrap>", "<len(hostside/chain_node.py)>",
                     "<stdin: the node's spec; the per-run secret is not shown>"),
            details={**details, "checkpoint_dir": dep.checkpoint_dir(w), "distribution": "chain", "chain": note,
                     "upstream": hop.upstream, "listen": hop.address, "network": hop.network, "downstream": nxt,
                     "verify": list(wj.check.shown(w)), **({"engram_rows": f} if f else {})}, job=wj))
    return acts, note


def apply(dep, actions, ctx):
    if dep.recipe.model.source == "shared":
        return shared.apply(dep, actions, ctx)
    return (chained if dep.cluster.distribution == "chain" else push).apply(dep, actions, ctx)


STAGE = Stage(NAME, plan, apply, "give every node the exact checkpoint")
