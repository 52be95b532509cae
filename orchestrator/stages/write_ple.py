"""write-ple: Qwen's memory-mapped n-gram ("PLE") table file, written once and kept across restarts.

Per host, through Ansible (playbooks/write-ple.yml, run by orchestrator/stages/tableop.py like
stage-engram's): copy the stdlib-only table-ops zipapp and a JSON spec (from the recipe, `spec_for`)
into <nvme_dir>/.deployctl/ and run

    python3 deployctl-tables.pyz ple-write --spec ple-spec.json --host H --checkpoint CK --dest NVME/ple

(orchestrator/hostside/ple_write.py) under the host's `timeout`. A table file that is still valid (same checkpoint identity and
geometry, per the manifest, nothing read) is kept: the host's result is "skipped" with the reason
(asked over SSH first; `--verify` always runs the op, which then re-hashes the kept file).
Placement `pinned` (RTX PRO 6000) writes no file: the same op only checks the host's MemAvailable
against ple.min_host_ram_gb and fails the host when it is too low.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from ..outcomes import Status
from ..paths import PLAYBOOKS_DIR
from ..plan import Action
from ..runoptions import RunOptions
from ..recipe import Recipe
from ..hostside.ple_spec import SPEC_FORMAT, parse_spec
from .base import Stage
from .tableop import TableJob, make_job, run_jobs, table_vars

STAGE_NAME = "write-ple"
PLAYBOOK = PLAYBOOKS_DIR / "write-ple.yml"
HOSTS_KEY = "ple_hosts"                  # the playbook's per-host variables
OP = "ple-write"
SPEC_NAME = "ple-spec.json"


def spec_for(recipe: Recipe) -> dict[str, Any]:
    """The plain JSON spec the host-side op reads (format: orchestrator/hostside/ple_write.py)."""
    p = recipe.ple
    if p is None:
        raise ValueError(f"recipe {recipe.name} has no ple section")
    g = p.geometry
    doc = {"format": SPEC_FORMAT, "placement": p.placement,
           "geometry": {"layers": list(g.layers), "orders": list(g.orders),
                        "heads_per_order": g.heads_per_order, "vocab_per_order": list(g.vocab_per_order),
                        "row_values": g.row_values, "dtype": g.dtype},
           "shard_tensor": p.shard_tensor, "shards": p.shards,
           # SGLang TP runs on one host: every rank's file is on it (ple_layout.rank_table)
           "tp": recipe.parallelism.tensor_parallel,
           "ranks": list(range(recipe.parallelism.tensor_parallel)),
           "engine_config": {"make_ngram_vocab_size_divisible_by": p.make_ngram_vocab_size_divisible_by,
                             "split_ngram_parts": p.split_ngram_parts},
           "min_host_ram_gb": p.min_host_ram_gb,
           "recipe": {"name": recipe.name, "digest": recipe.digest}}
    parse_spec(doc, f"recipe {recipe.name}: ple")      # the op's own checks, at plan time
    return doc


def host_job(dep, host, spec: dict[str, Any], verify: bool = False) -> TableJob:
    """`ple-write --spec ... --host H [--checkpoint CK --dest DEST] [--verify]` on one host; the
    timeout is sized from the table bytes (twice with --verify: the kept file is re-hashed)."""
    args = ["--host", host.name]
    nbytes = 0
    if spec["placement"] == "nvme":
        args += ["--checkpoint", dep.checkpoint_dir(host), "--dest", dep.ple_dir(host)]
        nbytes = sum(t.nbytes for t in parse_spec(spec).tables())
    job = make_job(host, OP, SPEC_NAME, spec, args, nbytes)
    return with_verify(job) if verify else job


def with_verify(job: TableJob) -> TableJob:
    return job.with_flag("--verify", passes=2)


def playbook_vars(dep, pyz: str | Path, hosts=None, verify: bool = False) -> dict[str, Any]:
    """-e @vars.json for playbooks/write-ple.yml (also `deployctl ple vars`)."""
    spec = spec_for(dep.recipe)
    return table_vars(HOSTS_KEY, [host_job(dep, h, spec, verify) for h in (hosts or dep.cluster.hosts)],
                                 pyz)


def plan(dep, options: RunOptions):
    p = dep.recipe.ple
    if p is None:
        return [], "recipe has no PLE table"
    if p.placement not in ("nvme", "pinned"):
        return [], f"PLE placement is {p.placement}: the engine loads it from the checkpoint, no file"
    spec = spec_for(dep.recipe)
    table = parse_spec(spec)
    tables = table.tables() if p.placement == "nvme" else []     # the same files on every host
    acts = []
    for h in dep.cluster.hosts:
        job = host_job(dep, h, spec)
        if p.placement == "pinned":
            summary = (f"placement pinned: no table file is written; refuse {h.name} unless its "
                       f"MemAvailable >= {p.min_host_ram_gb:g} GB (ple.min_host_ram_gb)")
            details = {"placement": "pinned", "min_host_ram_gb": p.min_host_ram_gb}
        else:
            names = ", ".join(t.file_name for t in tables)
            summary = (f"write {names} ({sum(t.nbytes for t in tables) / 1e9:.1f} GB, the file SGLang "
                       f"maps) to {dep.ple_dir(h)} unless the one there is still valid")
            details = {"placement": "nvme", "file": str(PurePosixPath(dep.ple_dir(h)) / tables[0].file_name),
                       "files": [str(PurePosixPath(dep.ple_dir(h)) / t.file_name) for t in tables],
                       "layout": [t.to_json() for t in tables], "row_bytes": table.row_bytes,
                       "checkpoint": dep.checkpoint_dir(h), "dest": dep.ple_dir(h)}
        acts.append(Action(STAGE_NAME, h.name, "ansible-playbook", summary, command=job.argv,
                           details={**details, "playbook": f"playbooks/{PLAYBOOK.name}", "job": job.to_json()},
                           job=job))
    return acts, ""


def describe(job: TableJob, doc: dict[str, Any]) -> "tuple[Status, str] | None":
    """ple-write's result -> (status, message); None when it printed none."""
    status = doc.get("status")
    if status == "kept":
        return "skipped", f"kept: {doc.get('reason')}"
    if status == "no-file":
        return "ok", doc.get("reason", "")
    if status in ("written", "rewritten"):
        return "ok", (f"{status} {doc.get('file')} ({doc.get('bytes', 0) / 1e9:.2f} GB in "
                      f"{doc.get('seconds')} s, {doc.get('mb_per_s')} MB/s): {doc.get('reason', '')}")
    return None


def apply(dep, actions, ctx):
    jobs = [TableJob.of(a) for a in actions]
    verify = ctx.options.verify
    if verify:      # a run option, not part of the plan: the planned op plus --verify
        jobs = [with_verify(j) for j in jobs]
    return run_jobs(dep, actions, ctx, stage=STAGE_NAME, playbook=PLAYBOOK, hosts_key=HOSTS_KEY,
                       describe=describe, jobs=jobs, probe=not verify)


STAGE = Stage(STAGE_NAME, plan, apply, "write the memory-mapped PLE table file once (or check RAM "
              "for the pinned placement)")
