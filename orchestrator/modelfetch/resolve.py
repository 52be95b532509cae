"""Before a run is planned: the commit it uses and the files at that commit.

A recipe's model.revision may be a commit (pinned) or a branch or tag ("main"): then it is resolved
ONCE per run, so every stage (fetch, sync, staging, the engine's mount) uses the same snapshot even if
the branch moves meanwhile. A run that fetches asks the Hub (on the head: its network, its token),
a run that does not reads refs/<revision> in the head's cache, which the last fetch wrote. Either way
one SSH round trip to the head runs hostside/hubfetch.py `resolve`, which also checks the head's
snapshot against its state file, so a complete one is known before planning (the no-op) and a head
without room for what is missing is refused before anything is written (exit 2).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..errors import DeployctlError, InputError
from ..hostside.hubfetch import BOOTSTRAP
from ..modelsync.remote import error_line
from .access import load_access
from .resolved import COMMIT, Resolved

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host

HOSTSIDE = Path(__file__).resolve().parent.parent / "hostside" / "hubfetch.py"
MARGIN_BYTES = 2_000_000_000         # kept free on the head's model disk beyond the download
USES_CHECKPOINT = frozenset({"fetch-model", "sync-model", "stage-engram", "write-ple", "launch"})
RESOLVE_TIMEOUT_S = 90


def state_file(dep: "Deployment", host: "Host") -> str:
    """fetch-model's record of what it verified, in the head's nvme_dir (ours), not in the HF cache."""
    key = dep.recipe.model.repo.replace("/", "--")
    return str(PurePosixPath(host.nvme_dir) / ".deployctl" / "fetch" / f"models--{key}.json")


def job_base(dep: "Deployment", rehash: bool = False) -> dict[str, Any]:
    """The job fields every hubfetch op reads (no token: the caller adds it where needed)."""
    m, head = dep.recipe.model, dep.cluster.head_host
    return {"endpoint": dep.cluster.hf_endpoint, "repo": m.repo, "revision": m.revision,
            "allow": list(m.allow_patterns), "model_cache": head.model_cache, "state": state_file(dep, head),
            "rehash": rehash, "margin_bytes": MARGIN_BYTES}


def fetches(dep: "Deployment", stages: tuple[str, ...]) -> bool:
    return "fetch-model" in stages and dep.cluster.model_fetch == "hub" and not dep.recipe.model.checkpoint_dir


def for_run(dep: "Deployment", stages: tuple[str, ...], rehash: bool = False) -> "Deployment":
    """DEP with the run's checkpoint resolved (dep.checkpoint), or DEP as it is when no stage of the
    run uses the checkpoint or the recipe names a plain folder; a pinned revision with model_fetch: none
    is taken as written (nothing to ask the head)."""
    m = dep.recipe.model
    if m.checkpoint_dir or not set(stages) & USES_CHECKPOINT:
        return dep
    fetch = fetches(dep, stages)
    if not fetch and COMMIT.match(m.revision) and dep.cluster.model_fetch == "none":
        return dataclasses.replace(dep, checkpoint=Resolved(m.revision, m.revision, "pinned"))
    r = run_resolve(dep, ask_hub=fetch, rehash=rehash)
    if not r.commit:
        return dep                               # nothing fetched here yet: snapshots/<revision> as named
    if fetch and r.check and not r.check.get("fits", True):
        c = r.check
        need = c["need_bytes"] + c["margin_bytes"]
        raise InputError(
            f"fetch-model: {dep.cluster.head} has {c['free_bytes'] / 1e9:.1f} GB free at {c['free_path']}, "
            f"{m.repo}@{r.commit[:12]} needs {need / 1e9:.1f} GB ({c['missing_count']} files, "
            f"{c['margin_bytes'] / 1e9:.0f} GB margin): short by {(need - c['free_bytes']) / 1e9:.1f} GB; free "
            f"space there or point model_cache at a larger disk. Nothing was downloaded.",
            file=str(dep.cluster.file), key=f"all.hosts.{dep.cluster.head}.model_cache")
    return dataclasses.replace(dep, checkpoint=r)


@functools.cache
def script() -> bytes:
    """hostside/hubfetch.py as sent to the head (read once per process)."""
    return HOSTSIDE.read_bytes()


def resolve_argv() -> tuple[str, ...]:
    """What runs on the head (the script and the job on stdin)."""
    return ("python3", "-c", BOOTSTRAP, str(len(script())), "resolve")


def run_resolve(dep: "Deployment", ask_hub: bool, rehash: bool = False) -> Resolved:
    from ..executors.ssh import SSHError, SSHTarget
    head = dep.cluster.head_host
    job = job_base(dep, rehash)
    job["ask_hub"] = ask_hub
    if ask_hub:
        job["token"] = load_access(dep.cluster).token
    try:
        r = SSHTarget.for_host(head, dep.cluster).run(
            list(resolve_argv()), timeout=RESOLVE_TIMEOUT_S, stdin=script() + json.dumps(job).encode())
    except SSHError as e:
        raise DeployctlError(f"cannot resolve model.revision {dep.recipe.model.revision!r} on the head: {e}") from None
    err = error_line(r.stderr.splitlines())
    if r.rc == 2:
        raise InputError(f"fetch-model on {head.name}: {err}")
    if r.rc != 0:
        raise DeployctlError(f"fetch-model on {head.name}: resolving {dep.recipe.model.repo}@"
                             f"{dep.recipe.model.revision} failed (exit {r.rc}): {err or r.stderr[-300:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    # source as the head answered (hub, or cache when it fell back): the fetch stage plans from either;
    # whether the revision is pinned is Resolved.pinned, from the revision itself
    return Resolved(doc["commit"], dep.recipe.model.revision, doc["source"], tuple(doc["files"]),
                    doc.get("offline", ""), doc.get("check") or {}, doc.get("uid", 0), doc.get("gid", 0))
