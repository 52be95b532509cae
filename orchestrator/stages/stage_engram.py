"""stage-engram: each rank's Engram rows onto its host's NVMe, every host in parallel through Ansible.

plan (pure): per host the exact command it runs,
    timeout -k 30 <s> python3 <nvme_dir>/.deployctl/deployctl-tables.pyz engram-stage
            --spec <nvme_dir>/.deployctl/engram-spec.json --checkpoint <checkpoint dir> --dest <nvme_dir>/<engram.subdir>
            --hash-cache <sync-model's hash cache of that checkpoint> [--fetch-state <fetch-model's state>: the head]
apply: runs the jobs the plan's actions carry through orchestrator/stages/tableop.py (the zipapp,
the SSH fast path for hosts already staged, one playbooks/stage-engram.yml run for the others) and
turns each host's result into a HostResult: ok, skipped (already staged: the op's reason) or failed
(the op's error, naming the host's file; or the playbook's space check naming host, path, need and
free GB).

What a host ends up with is what the patched vLLM reads through DSV41_ENGRAM_DIR (docs/engram-contract.md):
the index, the checkpoint's Engram shards as sparse copies holding the rank's rows (or, with
engram.staging auto on a node whose own checkpoint shares the filesystem, hard links to them),
engram-local.json and the manifest. Launch mounts the folder and points engram.local_dir_env at it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..modelfetch.resolve import state_file
from ..modelsync.settings import cache_file
from ..outcomes import HostResult, Status
from ..paths import PLAYBOOKS_DIR
from ..plan import Action
from ..runoptions import RunOptions
from ..recipe import Recipe
from ..hostside.engram_spec import Spec, local_ranges, spec_for
from ..hostside.engram_spec import staged_bytes as _staged_bytes
from .base import Stage
from .tableop import TableJob, make_job, run_jobs, table_vars

if TYPE_CHECKING:
    from pathlib import Path

    from ..deployment import Deployment
    from ..inventory import Host
    from ..runrecord import RunContext

STAGE_NAME = "stage-engram"
PLAYBOOK = PLAYBOOKS_DIR / "stage-engram.yml"
HOSTS_KEY = "engram_hosts"              # the playbook's per-host variables
OP = "engram-stage"
SPEC_NAME = "engram-spec.json"


def engram_spec(recipe: Recipe, rank: int, tp: int | None = None) -> Spec:
    """The host-side op's spec for `rank` (of `tp`, default the recipe's tensor_parallel)."""
    return spec_for(recipe, rank, tp)


def staged_bytes(spec: Spec) -> int:
    """Row bytes a rank's staging copies (the shard copies hold these, the rest is holes). Pure."""
    return _staged_bytes(spec)


def host_job(dep: "Deployment", host: "Host") -> TableJob:
    """`engram-stage --spec ... --checkpoint CK --dest DEST` for the host's rank; the playbook
    variables add rank, checkpoint and dest (the job's `extra`)."""
    eg = dep.recipe.engram
    assert eg is not None
    par = dep.recipe.parallelism
    if par.gpus_per_node != 1:
        raise InputError(f"Engram staging on NVMe needs one rank per node; recipe {dep.recipe.name} has "
                         f"gpus_per_node {par.gpus_per_node}", key="parallelism.gpus_per_node")
    spec = engram_spec(dep.recipe, host.rank)
    ckpt, dest = dep.checkpoint_dir(host), dep.engram_dir(host)
    # the stamps other ops keep of this checkpoint: the op keeps them current across its hard links
    # (hostside/engram_stage.py _Restamps), and a linked shard's proof asks sync-model's hash cache
    stamps: tuple[str, ...] = ("--hash-cache", cache_file(host.nvme_dir, ckpt))
    if host.name == dep.cluster.head and dep.cluster.model_fetch == "hub":
        stamps += ("--fetch-state", state_file(dep, host))
    return make_job(host, OP, SPEC_NAME, spec.to_json(), ("--checkpoint", ckpt, "--dest", dest, *stamps),
                            staged_bytes(spec), {"rank": host.rank, "checkpoint": ckpt, "dest": dest})


def playbook_vars(jobs: list[TableJob], pyz: "str | Path") -> dict[str, Any]:
    """The variables stage-engram.yml takes (`-e @file` by hand; `deployctl engram vars`)."""
    return table_vars(HOSTS_KEY, jobs, pyz)


def plan(dep: "Deployment", options: RunOptions) -> tuple[list[Action], str]:
    eg = dep.recipe.engram
    if eg is None:
        return [], "recipe has no Engram tables"
    if eg.placement != "nvme":
        return [], f"Engram placement is {eg.placement}: nothing to stage on NVMe"
    acts = []
    for h in dep.cluster.hosts:
        j = host_job(dep, h)
        spec = engram_spec(dep.recipe, h.rank)
        ranges = ", ".join(f"L{k} [{lo}, {hi})" for k, (lo, hi) in local_ranges(spec).items())
        dest, link = j.extra["dest"], j.spec.get("link", False)
        acts.append(Action(
            STAGE_NAME, h.name, "ansible-playbook",
            f"stage rank {h.rank}'s Engram rows ({ranges}; {j.bytes / 1e9:.2f} GB, {eg.layout}, "
            f"{'linked if the checkpoint shares the filesystem, else copied' if link else 'copied'}) "
            f"to {dest}",
            command=j.argv,
            details={"playbook": str(PLAYBOOK.relative_to(PLAYBOOKS_DIR.parent)),
                     "checkpoint": j.extra["checkpoint"], "dest": dest, "rank": h.rank, "bytes": j.bytes,
                     "layout": eg.layout, "timeout_s": j.timeout_s, "free_margin_gb": eg.free_margin_gb,
                     "staging": eg.staging, "link": link, "job": j.to_json()}, job=j))
    return acts, ""


def describe(job: TableJob, doc: dict[str, Any]) -> "tuple[Status, str] | None":
    """engram-stage's result -> (status, message); None when it printed none."""
    status, dest = doc.get("status"), job.extra.get("dest")
    if status == "skipped":
        return "skipped", doc.get("reason", "already staged")
    if status == "ok" and doc.get("mode") == "link":
        return "ok", (f"linked the checkpoint's Engram shards into {dest} ({doc.get('bytes', 0) / 1e9:.2f} GB "
                      f"of this rank's rows, nothing copied) in {doc.get('seconds', 0):.1f} s, "
                      f"{doc.get('fidelity_rows', 0)} rows checked the engine's way")
    if status == "ok":
        return "ok", (f"staged {doc.get('bytes', 0) / 1e9:.2f} GB to {dest} in {doc.get('seconds', 0):.1f} s "
                      f"({doc.get('mb_per_s', 0):.0f} MB/s), {doc.get('fidelity_rows', 0)} rows checked "
                      "against the checkpoint")
    return None


def apply(dep: "Deployment", actions: list[Action], ctx: "RunContext") -> list[HostResult]:
    jobs = [TableJob.of(a) for a in actions]
    verify = ctx.options.verify
    if verify:      # a run option, not part of the plan: the planned op plus --verify (every chunk re-hashed)
        jobs = [j.with_flag("--verify", passes=2) for j in jobs]
    return run_jobs(dep, actions, ctx, stage=STAGE_NAME, playbook=PLAYBOOK, hosts_key=HOSTS_KEY,
                    describe=describe, jobs=jobs, probe=not verify)


STAGE = Stage(STAGE_NAME, plan, apply, "extract each rank's Engram rows onto its NVMe")
