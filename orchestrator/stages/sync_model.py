"""sync-model: every node has the exact checkpoint (the head's, file by file, sha256) before staging.

model.source: head (default) pushes the head's copy to the workers with rsync run on the head;
model.source: shared verifies that every node sees the head's copy on one shared mount.
The logic lives in orchestrator/modelsync/ (push.py, shared.py; hostside.py runs on the hosts).
"""
from __future__ import annotations

from ..modelsync import push, shared
from ..hostside.modelsync import BOOTSTRAP
from ..modelsync.push import ssh_options
from ..modelsync.rsync import rsync_argv
from ..modelsync.settings import Settings, cache_file, revision_note
from ..plan import Action
from ..recipe import digest_of
from .base import Stage

NAME = "sync-model"


def _hostside(host, op: str, args: list[str]) -> tuple[str, ...]:
    # The script (orchestrator/hostside/modelsync.py) is sent on stdin; nothing is installed.
    return ("ssh", f"{host.user}@{host.address}", "python3", "-c", BOOTSTRAP, "<len(hostside.py)>", op, *args)


def plan(dep):
    m, c = dep.recipe.model, dep.cluster
    head = c.head_host
    src = dep.checkpoint_dir(head)
    what = f"{m.repo}@{m.revision[:12]}"
    pinned = revision_note(m.revision, m.checkpoint_dir)
    details = {"repo": m.repo, "revision": m.revision, "source": m.source, "head": head.name,
               "checkpoint_dir": src}
    if not c.workers:
        return [], f"single host: the head's copy of {what} is the only one"
    head_cache = cache_file(head.nvme_dir, src)
    if m.source == "shared":
        where = f" on the shared mount {m.shared_path}" if m.shared_path else ""
        acts = [Action(NAME, head.name, "verify-shared",
                       f"manifest of {m.repo} {pinned} at {head.name}:{src}{where}; write a marker for the workers",
                       command=_hostside(head, "manifest", ["--root", src, "--cache", head_cache,
                                                            "--marker", ".deployctl-shared-marker=NONCE"]),
                       details={**details, "shared_path": m.shared_path},
                       digest=digest_of([m.repo, m.revision, src, m.shared_path]))]
        for w in c.workers:
            dst = dep.checkpoint_dir(w)
            acts.append(Action(
                NAME, w.name, "verify-shared",
                f"check that {w.name} sees the head's {what} at {dst}: same storage (marker), "
                f"{'mounted at ' + m.shared_path + ', ' if m.shared_path else ''}every file with its size; "
                f"copies nothing", command=_hostside(w, "verify", ["--root", dst, "--cache",
                                                                    cache_file(w.nvme_dir, dst), "--sizes-only",
                                                                    "--marker", ".deployctl-shared-marker"]),
                details={**details, "checkpoint_dir": dst, "shared_path": m.shared_path},
                digest=digest_of([m.repo, m.revision, dst, m.shared_path])))
        return acts, f"source shared: nothing is copied; {what}"
    st = Settings()
    est = int(m.checkpoint_gb * 1e9)
    acts = [Action(NAME, head.name, "manifest",
                   f"manifest of {m.repo} {pinned} at {head.name}:{src}: path, size, sha256 per file (links followed; "
                   f"hashes cached by size+mtime in {head_cache})",
                   command=_hostside(head, "manifest", ["--root", src, "--cache", head_cache]),
                   details=details, digest=digest_of([m.repo, m.revision, src]))]
    for w in c.workers:
        dst = dep.checkpoint_dir(w)
        argv = rsync_argv(src, w.user, w.address, dst, w.port, ssh_options(dep, w, st),
                          io_timeout=st.io_timeout, total_timeout=st.transfer_timeout(est))
        acts.append(Action(
            NAME, w.name, "rsync",
            f"make {w.name}:{dst} exactly the head's {what}: verify by sha256 (cached), check free space, "
            f"then rsync only the files that differ from {head.name} to {w.address}, verify again",
            command=("ssh", f"{head.user}@{head.address}", *argv),
            details={**details, "checkpoint_dir": dst, "from": f"{head.name}:{src}", "to": w.address,
                     "stdin": "the differing files' relative paths, NUL-separated"},
            digest=digest_of([m.repo, m.revision, src, dst])))
    return acts, ""


def apply(dep, actions, ctx):
    return (shared if dep.recipe.model.source == "shared" else push).apply(dep, actions, ctx)


STAGE = Stage(NAME, plan, apply, "give every node the exact checkpoint")
