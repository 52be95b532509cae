"""write-ple: Qwen's memory-mapped n-gram ("PLE") table file, written once and kept across restarts.

Per host, through Ansible (playbooks/write-ple.yml): copy the stdlib-only table-ops zipapp and a
JSON spec (from the recipe, `spec_for`) into <nvme_dir>/.deployctl/ and run

    python3 deployctl-tables.pyz ple-write --spec ple-spec.json --checkpoint CK --dest NVME/ple --host H

(orchestrator/tables/ple_write.py). A table file that is still valid (same checkpoint identity and
geometry, per the manifest, nothing read) is kept: the host's result is "skipped" with the reason.
Placement `pinned` (RTX PRO 6000) writes no file: the same op only checks the host's MemAvailable
against ple.min_host_ram_gb and fails the host when it is too low.
"""
from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from ..plan import Action
from ..recipe import Recipe, digest_of
from ..tables.ple_write import SPEC_FORMAT, parse_spec
from ..tables.geometry import total_rows
from .base import HostFailure, HostResult, Stage, run_per_host

STAGE_NAME = "write-ple"
PLAYBOOK = "write-ple.yml"
WORK_SUBDIR = ".deployctl"               # below the host's nvme_dir: zipapp and spec
TIMEOUT_S = 4 * 3600                     # 51.2 GB even at 10 MB/s would not finish; 4 h bounds it
RAM_CHECK_TIMEOUT_S = 120


def spec_for(recipe: Recipe) -> dict[str, Any]:
    """The plain JSON spec the host-side op reads (format: orchestrator/tables/ple_write.py)."""
    p = recipe.ple
    if p is None:
        raise ValueError(f"recipe {recipe.name} has no ple section")
    g = p.geometry
    doc = {"format": SPEC_FORMAT, "placement": p.placement,
           "geometry": {"layers": list(g.layers), "orders": list(g.orders),
                        "heads_per_order": g.heads_per_order, "vocab_per_order": list(g.vocab_per_order),
                        "row_values": g.row_values, "dtype": g.dtype},
           "shard_tensor": p.shard_tensor, "shards": p.shards, "file_pattern": p.file_pattern,
           "min_host_ram_gb": p.min_host_ram_gb,
           "recipe": {"name": recipe.name, "digest": recipe.digest}}
    parse_spec(doc, f"recipe {recipe.name}: ple")      # the op's own checks, at plan time
    return doc


def work_dir(dep, host) -> str:
    return str(PurePosixPath(host.nvme_dir) / WORK_SUBDIR)


def host_job(dep, host, spec: dict[str, Any], verify: bool = False) -> dict[str, Any]:
    """What the playbook does on one host: paths, the spec and the op's argv."""
    wd = PurePosixPath(work_dir(dep, host))
    pyz, spec_path = str(wd / "deployctl-tables.pyz"), str(wd / "ple-spec.json")
    argv = ["python3", pyz, "ple-write", "--spec", spec_path, "--host", host.name]
    if spec["placement"] == "nvme":
        argv += ["--checkpoint", dep.checkpoint_dir(host), "--dest", dep.ple_dir(host)]
    if verify:
        argv.append("--verify")
    return {"work_dir": str(wd), "pyz": pyz, "spec_path": spec_path, "spec": spec, "argv": argv,
            "timeout_s": TIMEOUT_S if spec["placement"] == "nvme" else RAM_CHECK_TIMEOUT_S}


def playbook_vars(dep, pyz: str | Path, hosts=None, verify: bool = False) -> dict[str, Any]:
    """-e @vars.json for playbooks/write-ple.yml (also `deployctl ple vars`)."""
    spec = spec_for(dep.recipe)
    return {"tables_pyz": str(Path(pyz).absolute()),
            "ple_hosts": {h.name: host_job(dep, h, spec, verify) for h in (hosts or dep.cluster.hosts)}}


def plan(dep):
    p = dep.recipe.ple
    if p is None:
        return [], "recipe has no PLE table"
    if p.placement not in ("nvme", "pinned"):
        return [], f"PLE placement is {p.placement}: the engine loads it from the checkpoint, no file"
    spec = spec_for(dep.recipe)
    table = parse_spec(spec)
    acts = []
    for h in dep.cluster.hosts:
        job = host_job(dep, h, spec)
        if p.placement == "pinned":
            summary = (f"placement pinned: no table file is written; refuse {h.name} unless its "
                       f"MemAvailable >= {p.min_host_ram_gb:g} GB (ple.min_host_ram_gb)")
            details = {"placement": "pinned", "min_host_ram_gb": p.min_host_ram_gb}
        else:
            rows = total_rows(p.geometry)
            name = table.file_name(rows)
            summary = (f"write {name} ({rows * table.row_bytes / 1e9:.1f} GB) to {dep.ple_dir(h)} "
                       "unless the one there is still valid")
            details = {"placement": "nvme", "file": str(PurePosixPath(dep.ple_dir(h)) / name),
                       "rows": rows, "row_bytes": table.row_bytes,
                       "checkpoint": dep.checkpoint_dir(h), "dest": dep.ple_dir(h)}
        acts.append(Action(STAGE_NAME, h.name, "ansible-playbook", summary, command=tuple(job["argv"]),
                           details={**details, "playbook": f"playbooks/{PLAYBOOK}"},
                           digest=digest_of({"spec": spec, "argv": job["argv"]})))
    return acts, ""


def result_from(host: str, res: Any) -> HostResult | str:
    """A playbook host result (executors.ansible.PlaybookHostResult) -> this stage's HostResult."""
    doc = res.result_json or {}
    if not res.ok:
        msg = doc.get("error") or res.msg
        raise HostFailure(f"{msg}" + (f" (task: {res.failed_task})" if res.failed_task else ""),
                          rc=res.rc, tail=res.stdout_tail)
    status = doc.get("status")
    if status == "kept":
        return HostResult(host, STAGE_NAME, "skipped", f"kept: {doc.get('reason')}", data=doc)
    if status in ("written", "rewritten", "no-file"):
        msg = doc.get("reason", "")
        if status != "no-file":
            msg = (f"{status} {doc.get('file')} ({doc.get('bytes', 0) / 1e9:.2f} GB in "
                   f"{doc.get('seconds')} s, {doc.get('mb_per_s')} MB/s): {msg}")
        return HostResult(host, STAGE_NAME, "ok", msg, data=doc)
    raise HostFailure(f"ple-write printed no result (status {status!r}); see the log",
                      rc=res.rc, tail=res.stdout_tail)


def apply(dep, actions, ctx):
    from ..executors.ansible import run_playbook
    from ..paths import PLAYBOOKS_DIR
    from ..tables import bundle

    pyz = bundle.build(ctx.run_dir)
    verify = bool(ctx.options.get("verify"))
    hosts = [dep.cluster.host(a.host) for a in actions]
    extravars = playbook_vars(dep, pyz, hosts, verify)
    ctx.write_json(f"{STAGE_NAME}-vars.json", extravars)     # ops can re-run it by hand with -e @
    timeout = max(j["timeout_s"] for j in extravars["ple_hosts"].values()) + 300

    def one(action, log):
        log.write(f"$ {' '.join(extravars['ple_hosts'][action.host]['argv'])}")
        results = run_playbook(PLAYBOOKS_DIR / PLAYBOOK, dep.cluster.file, limit=[action.host],
                               extravars=extravars,
                               artifact_dir=ctx.run_dir / "ansible" / STAGE_NAME / action.host,
                               timeout_s=timeout, host_key_checking=dep.cluster.host_key_checking,
                               known_hosts_file=dep.cluster.known_hosts_file,
                               on_output=lambda _h, line: log.write(line), cancel=ctx.cancel)
        res = results[action.host]
        if res.result_json:
            log.write("result: " + json.dumps(res.result_json))
        return result_from(action.host, res)

    return run_per_host(actions, ctx, one)


STAGE = Stage(STAGE_NAME, plan, apply, "write the memory-mapped PLE table file once (or check RAM "
              "for the pinned placement)")
