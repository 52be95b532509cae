"""stage-engram: each rank's Engram rows onto its host's NVMe, every host in parallel through Ansible.

plan (pure): per host the exact command it runs,
    timeout -k 30 <s> python3 <nvme_dir>/.deployctl/deployctl-tables.pyz engram-stage
            --spec <nvme_dir>/.deployctl/engram-spec.json --checkpoint <checkpoint dir> --dest <nvme_dir>/<engram.subdir>
apply: build the zipapp, write the playbook variables into the run record, run
playbooks/stage-engram.yml on all hosts at once (orchestrator/executors/ansible.py), and turn each
host's result into a HostResult: ok, skipped (already staged: the op's reason) or failed (the op's
error, naming the host's file; or the playbook's space check naming host, path, need and free GB).

What a host ends up with is what the patched vLLM reads through DSV41_ENGRAM_DIR (docs/engram-contract.md):
the index, the checkpoint's Engram shards as sparse copies holding the rank's rows (or, with
engram.staging auto on a node whose own checkpoint shares the filesystem, hard links to them),
engram-local.json and the manifest. Launch mounts the folder and points engram.local_dir_env at it.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..outcomes import HostResult
from ..paths import PLAYBOOKS_DIR
from ..plan import Action
from ..recipe import Recipe, digest_of
from ..tables import bundle
from ..tables.engram_stage import Spec, local_ranges
from ..tables.engram_stage import staged_bytes as _staged_bytes
from .base import Stage
from .hostcheck import Probe, already_done, with_stdin_spec

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host
    from ..runrecord import RunContext

STAGE_NAME = "stage-engram"
PLAYBOOK = PLAYBOOKS_DIR / "stage-engram.yml"
WORK_SUBDIR = ".deployctl"              # below the host's nvme_dir: the zipapp and specs
PYZ_NAME = "deployctl-tables.pyz"
SPEC_NAME = "engram-spec.json"
MIN_RATE = 20e6                         # bytes/s assumed when sizing the per-host timeout
BASE_TIMEOUT_S = 600


def engram_spec(recipe: Recipe, rank: int, tp: int | None = None) -> Spec:
    """The host-side op's spec for `rank` (of `tp`, default the recipe's tensor_parallel)."""
    eg = recipe.engram
    if eg is None:
        raise InputError(f"recipe {recipe.name} has no Engram tables", key="engram")
    spec = Spec(geometry=eg.geometry, weight_tensor=eg.weight_tensor, scale_tensor=eg.scale_tensor,
                scale_dtype=eg.scale_dtype, scale_values_per_row=eg.scale_values_per_row,
                layout=eg.layout, tp=tp or recipe.parallelism.tensor_parallel, rank=rank,
                recipe=recipe.name, recipe_digest=recipe.digest, free_margin_gb=eg.free_margin_gb,
                link=eg.staging == "auto" and recipe.model.source != "shared")
    spec.check(f"recipe {recipe.name}")
    return spec


def staged_bytes(spec: Spec) -> int:
    """Row bytes a rank's staging copies (the shard copies hold these, the rest is holes). Pure."""
    return _staged_bytes(spec)


@dataclass(frozen=True)
class HostJob:
    """Everything one host's run needs; also the playbook variables for that host."""
    host: str
    rank: int
    checkpoint: str
    dest: str
    work_dir: str
    pyz: str
    spec_path: str
    spec: dict[str, Any]
    ranges: dict[str, list[int]]        # engram-local.json's layers: {"1": [lo, hi], ...}
    argv: tuple[str, ...]
    check_argv: tuple[str, ...]
    bytes: int
    timeout_s: int

    def to_vars(self) -> dict[str, Any]:
        return {"rank": self.rank, "checkpoint": self.checkpoint, "dest": self.dest,
                "work_dir": self.work_dir, "pyz": self.pyz, "spec_path": self.spec_path, "spec": self.spec,
                "argv": list(self.argv), "check_argv": list(self.check_argv), "timeout_s": self.timeout_s}


def host_python(host: "Host") -> str:
    """The interpreter the op runs with: the inventory's ansible_python_interpreter, else python3."""
    py = str(host.ansible_vars.get("ansible_python_interpreter") or "")
    return py if py and not py.startswith("auto") and "{{" not in py else "python3"


def host_job(dep: "Deployment", host: "Host") -> HostJob:
    eg = dep.recipe.engram
    assert eg is not None
    par = dep.recipe.parallelism
    if par.gpus_per_node != 1:
        raise InputError(f"Engram staging on NVMe needs one rank per node; recipe {dep.recipe.name} has "
                         f"gpus_per_node {par.gpus_per_node}", key="parallelism.gpus_per_node")
    spec = engram_spec(dep.recipe, host.rank)
    work = PurePosixPath(host.nvme_dir) / WORK_SUBDIR
    pyz, spec_path = str(work / PYZ_NAME), str(work / SPEC_NAME)
    ckpt, dest = dep.checkpoint_dir(host), dep.engram_dir(host)
    op = (host_python(host), pyz, "engram-stage", "--spec", spec_path, "--checkpoint", ckpt, "--dest", dest)
    nbytes = staged_bytes(spec)
    timeout_s = int(BASE_TIMEOUT_S + nbytes / MIN_RATE)
    # coreutils timeout on the host: the op is killed there (TERM, then KILL 30 s later) when it overruns
    argv = ("timeout", "-k", "30", str(timeout_s)) + op
    return HostJob(host.name, host.rank, ckpt, dest, str(work), pyz, spec_path, spec.to_json(),
                   local_ranges(spec), argv, op + ("--check",), nbytes, timeout_s)


def playbook_vars(jobs: list[HostJob], pyz: str | Path) -> dict[str, Any]:
    """The variables stage-engram.yml takes (`-e @file` by hand)."""
    return {"tables_pyz": str(pyz), "engram_hosts": {j.host: j.to_vars() for j in jobs}}


def plan(dep: "Deployment") -> tuple[list[Action], str]:
    eg = dep.recipe.engram
    if eg is None:
        return [], "recipe has no Engram tables"
    if eg.placement != "nvme":
        return [], f"Engram placement is {eg.placement}: nothing to stage on NVMe"
    acts = []
    for h in dep.cluster.hosts:
        j = host_job(dep, h)
        ranges = ", ".join(f"L{k} [{lo}, {hi})" for k, (lo, hi) in j.ranges.items())
        acts.append(Action(
            STAGE_NAME, h.name, "ansible-playbook",
            f"stage rank {h.rank}'s Engram rows ({ranges}; {j.bytes / 1e9:.2f} GB, {eg.layout}, "
            f"{'linked if the checkpoint shares the filesystem, else copied' if j.spec.get('link') else 'copied'}) "
            f"to {j.dest}",
            command=j.argv,
            details={"playbook": str(PLAYBOOK.relative_to(PLAYBOOKS_DIR.parent)), "checkpoint": j.checkpoint,
                     "dest": j.dest, "rank": h.rank, "bytes": j.bytes, "layout": eg.layout,
                     "timeout_s": j.timeout_s, "free_margin_gb": eg.free_margin_gb,
                     "staging": eg.staging, "link": j.spec.get("link", False)},
            digest=digest_of({"spec": j.spec, "checkpoint": j.checkpoint, "dest": j.dest})))
    return acts, ""


def apply(dep: "Deployment", actions: list[Action], ctx: "RunContext") -> list[HostResult]:
    from ..executors.ansible import run_playbook

    pyz = bundle.build(ctx.run_dir / "bundle")
    all_jobs = [host_job(dep, dep.cluster.host(a.host)) for a in actions]
    # Most re-runs find every rank staged already: ask each host over SSH first (one round trip,
    # reads only the manifest) and start Ansible (seconds of start-up) only for hosts with work.
    current = already_done(dep, [Probe(j.host, j.pyz, with_stdin_spec(j.check_argv, j.spec_path), j.spec)
                                 for j in all_jobs], pyz)
    done = [HostResult(j.host, STAGE_NAME, "skipped", current[j.host], log_path=str(ctx.log_path(j.host, STAGE_NAME)))
            for j in all_jobs if j.host in current]
    for r in done:
        ctx.event("action-end", **r.to_json())
    jobs = [j for j in all_jobs if j.host not in current]
    if not jobs:
        return done
    hosts = [j.host for j in jobs]
    extravars = playbook_vars(jobs, pyz)
    vars_path = ctx.write_json(f"{STAGE_NAME}-vars.json", extravars)
    logs = {h: ctx.host_log(h, STAGE_NAME) for h in hosts}
    for j in jobs:
        ctx.event("action-start", host=j.host, stage=STAGE_NAME, op="ansible-playbook")
        logs[j.host].write(f"$ {shlex.join(j.argv)}")
        logs[j.host].write(f"(ansible-playbook -i {dep.cluster.file} {PLAYBOOK} -e @{vars_path} --limit {j.host})")
    try:
        res = run_playbook(PLAYBOOK, dep.cluster.file, limit=hosts, extravars=extravars,
                           artifact_dir=ctx.run_dir / "ansible" / STAGE_NAME,
                           timeout_s=max(j.timeout_s for j in jobs) + 300,
                           host_key_checking=dep.cluster.host_key_checking,
                           known_hosts_file=dep.cluster.known_hosts_file,
                           on_output=lambda host, line: logs[host].write(line), cancel=ctx.cancel)
        results = [_host_result(j, res[j.host]) for j in jobs]
    except Exception as e:  # the playbook could not run at all: every host fails with the reason
        results = [HostResult(j.host, STAGE_NAME, "failed", f"ansible-playbook did not run: "
                              f"{type(e).__name__}: {e}") for j in jobs]
    for r in results:
        log = logs[r.host]
        if r.status == "failed":
            log.write(f"FAILED: {r.message}")
            r.tail = r.tail or log.tail()
        r.log_path = str(log.path)
        log.close()
        ctx.event("action-end", **r.to_json())
    order = {a.host: i for i, a in enumerate(actions)}
    return sorted(done + results, key=lambda r: order[r.host])


def _host_result(job: HostJob, r: Any) -> HostResult:
    doc = r.result_json or {}
    if not r.ok:
        msg = r.msg
        if r.rc in (124, 137) and doc.get("status") != "failed":
            msg = f"engram-stage did not finish within {job.timeout_s} s on the host and was killed"
        return HostResult(job.host, STAGE_NAME, "failed", msg, rc=r.rc, tail=r.stdout_tail, data=doc)
    status = doc.get("status")
    if status == "skipped":
        return HostResult(job.host, STAGE_NAME, "skipped", doc.get("reason", "already staged"), data=doc)
    if status == "ok" and doc.get("mode") == "link":
        msg = (f"linked the checkpoint's Engram shards into {job.dest} ({doc.get('bytes', 0) / 1e9:.2f} GB of "
               f"this rank's rows, nothing copied) in {doc.get('seconds', 0):.1f} s, "
               f"{doc.get('fidelity_rows', 0)} rows checked the engine's way")
        return HostResult(job.host, STAGE_NAME, "ok", msg, data=doc)
    if status == "ok":
        msg = (f"staged {doc.get('bytes', 0) / 1e9:.2f} GB to {job.dest} in {doc.get('seconds', 0):.1f} s "
               f"({doc.get('mb_per_s', 0):.0f} MB/s), {doc.get('fidelity_rows', 0)} rows checked "
               "against the checkpoint")
        return HostResult(job.host, STAGE_NAME, "ok", msg, data=doc)
    return HostResult(job.host, STAGE_NAME, "failed",
                      f"the playbook finished without engram-stage's result (got {status!r})",
                      tail=r.stdout_tail, data=doc)


STAGE = Stage(STAGE_NAME, plan, apply, "extract each rank's Engram rows onto its NVMe")
