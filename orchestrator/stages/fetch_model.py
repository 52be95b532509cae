"""fetch-model: the recipe's checkpoint from the Hugging Face Hub into the head's HF cache.

Runs on the head (its disk and uplink), before sync-model copies the head's snapshot to the workers.
What it fetches was resolved before planning (modelfetch/resolve.py: the commit, the files the allow
patterns select, and whether the head already holds them verified). The download is one container run
of the serving image (modelfetch/job.py, hostside/hubfetch.py), resumable, every file verified against
the Hub's sha256 before it appears in the snapshot. A no-op is decided without a byte read.
"""
from __future__ import annotations

import json
import time

from ..executors.docker_cli import docker_argv
from ..modelfetch.access import load_access
from ..modelfetch.job import FetchProgress, container_name, job_stdin, make_job
from ..modelfetch.resolve import resolve_argv
from ..modelfetch.resolved import COMMIT
from ..modelsync.manifest import gb
from ..modelsync.remote import connect, error_line, stream
from ..outcomes import HostFailure, HostResult, run_per_host
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage

NAME = "fetch-model"
IDLE_TIMEOUT_S = 600           # no line for this long (progress comes every second): the head is gone


def plan(dep, options: RunOptions):
    m, head, r = dep.recipe.model, dep.cluster.head_host, dep.checkpoint
    if dep.cluster.model_fetch == "none":
        return [], "model_fetch: none in the inventory: the head's copy is put there by other means"
    if m.checkpoint_dir:
        return [], f"model.checkpoint_dir {m.checkpoint_dir!r} is a plain folder, not the HF cache: not fetched"
    access = load_access(dep.cluster)
    where = f"{head.name}:{head.model_cache}/models--{m.repo.replace('/', '--')}"
    if r is None or r.source not in ("hub", "cache") or not r.files:
        # `deployctl plan` contacts no host: the run resolves the revision on the head when it starts
        return [Action(NAME, head.name, "fetch",
                       f"resolve {m.repo}@{m.revision} on {access.endpoint} from {head.name} when the run starts "
                       f"({'pinned commit' if COMMIT.match(m.revision) else 'NOT pinned: a branch or tag'}; "
                       f"`plan --check` resolves it now), then download what {where} lacks, verified against "
                       f"the Hub's sha256", command=resolve_argv(),
                       details={"repo": m.repo, "revision": m.revision,
                                "then": f"hostside/hubfetch.py fetch in a container of the serving image on "
                                        f"{head.name}'s engine ({head.docker_host})",
                                                     "endpoint": access.endpoint,
                                                     "token": access.token_source or "none",
                                                     "allow_patterns": list(m.allow_patterns)})], ""
    pin = (f"{r.commit[:12]} (pinned)" if r.pinned else
           f"{r.commit[:12]} = {r.revision!r} resolved now (NOT pinned: pin model.revision to {r.commit})")
    details = {"repo": m.repo, "revision": r.revision, "commit": r.commit, "endpoint": access.endpoint,
               "token": access.token_source or "none", "files": len(r.files), "bytes": r.total,
               "allow_patterns": list(m.allow_patterns), "source": r.source}
    if r.offline:
        details["offline"] = r.offline
    if r.up_to_date and not options.fetch_rehash:
        offline = (f"; the Hub did not answer ({r.offline}): the snapshot this head verified is used"
                   if r.offline else "")
        return [Action(NAME, head.name, "verified", f"{m.repo}@{pin}: all {len(r.files)} files "
                       f"({gb(r.total)}) in {where}, verified (decided by size, mtime, ctime, inode){offline}",
                       details=details)], ""
    fj = make_job(dep, r, rehash=options.fetch_rehash)
    c = r.check
    todo = f"{c.get('missing_count', len(r.files))} of {len(r.files)} files, {gb(c.get('need_bytes', r.total))}"
    if c.get("partial_bytes"):
        todo += f" ({gb(c['partial_bytes'])} already in partial files: resumed)"
    return [Action(NAME, head.name, "fetch",
                   f"download {m.repo}@{pin} from {access.endpoint}: {todo} into {where}; each file's "
                   f"sha256 checked against the Hub's before it enters the snapshot",
                   command=fj.argv, details={**details, "stdin": "hostside/hubfetch.py and the job (token inside)",
                                               "timeout_s": fj.timeout_s}, job=fj)], ""


def apply(dep, actions, ctx):
    r = dep.checkpoint
    token = load_access(dep.cluster).token

    def one(action: Action, log) -> HostResult | str:
        if action.op == "verified":
            return HostResult(action.host, NAME, "skipped", f"up to date: {len(r.files)} files at "
                              f"{r.commit[:12]} verified", data={"commit": r.commit})
        fj = action.job
        if fj is None:
            raise HostFailure("the checkpoint was not resolved before planning (modelfetch/resolve.py for_run)")
        head = dep.cluster.head_host
        session = connect(head, dep.cluster)
        t0 = time.monotonic()
        try:
            _prepare(session, dep, fj)
            prog = FetchProgress(head.name, r.total, ctx, log)
            rc, out, err = stream(session, list(fj.argv), job_stdin(fj, token), fj.timeout_s + 60, prog.line,
                                  idle_timeout=IDLE_TIMEOUT_S, cancel=ctx.cancel)
        except BaseException:
            _remove(session, dep)                  # Ctrl-C, a lost link: no download left running
            raise
        finally:
            session.close()
        if rc != 0:
            lines = [x for x in err.splitlines() if not x.startswith("progress ")]
            raise HostFailure(error_line(lines) or f"the download exited with {rc}", rc=rc, tail=lines[-10:])
        doc = json.loads(out.strip().splitlines()[-1])
        secs = max(time.monotonic() - t0, 1e-3)
        doc.update(revision=r.revision, endpoint=dep.cluster.hf_endpoint, wall_s=round(secs, 3))
        ctx.write_json("fetch-model.json", doc)
        rate = doc["downloaded_bytes"] / secs / 1e6
        resumed = f", resumed {gb(doc['resumed_bytes'])}" if doc.get("resumed_bytes") else ""
        if doc.get("reverified"):
            resumed += f", {doc['reverified']} present files hashed again and kept"
        return HostResult(action.host, NAME, "ok",
                          f"fetched {doc['fetched']} files of {doc['files']} at {r.commit[:12]}: "
                          f"{gb(doc['downloaded_bytes'])} in {secs:.1f}s ({rate:.0f} MB/s){resumed}, "
                          f"all verified against the Hub's hashes", data=doc)

    return run_per_host(list(actions), ctx, one)


def _prepare(session, dep, fj) -> None:
    """The image is there; no download of an earlier run is still going; the mounted folders exist."""
    head = dep.cluster.head_host
    r = session.run(docker_argv(head, "image", "inspect", "--format", "{{.Id}}", fj.image), timeout=60)
    if r.rc != 0:
        raise HostFailure(f"the serving image {fj.image} is not on {head.name} (fetch-model runs the Hub's "
                          f"client from it): run `deployctl build -i {dep.cluster.file}` first", rc=r.rc)
    _remove(session, dep)
    mk = session.run(["mkdir", "-p", head.model_cache, f"{head.nvme_dir}/.deployctl/fetch"], timeout=60)
    if mk.rc != 0:
        raise HostFailure(f"cannot create {head.model_cache} on {head.name}: {mk.stderr.strip()}", rc=mk.rc)


def _remove(session, dep) -> None:
    try:
        session.run(docker_argv(dep.cluster.head_host, "rm", "-f", container_name(dep)), timeout=60)
    except Exception:  # noqa: BLE001 - best effort: the next run removes it first anyway
        pass


STAGE = Stage(NAME, plan, apply, "download the checkpoint from the Hub onto the head (pinned, resumable, verified)")
