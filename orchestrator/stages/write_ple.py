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
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

from ..outcomes import HostFailure, HostResult, run_per_host
from ..paths import PLAYBOOKS_DIR
from ..plan import Action
from ..recipe import Recipe, digest_of
from ..tables import bundle
from ..tables.ple_write import SPEC_FORMAT, parse_spec
from .base import Stage
from .hostcheck import Probe, already_done, with_stdin_spec
from .stage_engram import PYZ_NAME, WORK_SUBDIR, host_python   # the same zipapp, folder, python

STAGE_NAME = "write-ple"
PLAYBOOK = "write-ple.yml"
SPEC_NAME = "ple-spec.json"
MIN_RATE = 20e6                          # bytes/s assumed when sizing the per-host timeout
BASE_TIMEOUT_S = 600                     # the no-op, the RAM check, python start, read-back
KILL_GRACE_S = 30


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


def host_job(dep, host, spec: dict[str, Any], verify: bool = False) -> dict[str, Any]:
    """What the playbook does on one host: paths, the spec and the op's argv. The op runs under
    coreutils `timeout` on the host, so an overrun is killed there, not only given up on here."""
    wd = PurePosixPath(host.nvme_dir) / WORK_SUBDIR
    pyz, spec_path = str(wd / PYZ_NAME), str(wd / SPEC_NAME)
    op = [host_python(host), pyz, "ple-write", "--spec", spec_path, "--host", host.name]
    nbytes = 0
    if spec["placement"] == "nvme":
        op += ["--checkpoint", dep.checkpoint_dir(host), "--dest", dep.ple_dir(host)]
        nbytes = sum(t.nbytes for t in parse_spec(spec).tables())
    if verify:
        op.append("--verify")
    timeout_s = int(BASE_TIMEOUT_S + nbytes * (2 if verify else 1) / MIN_RATE)
    argv = ["timeout", "-k", str(KILL_GRACE_S), str(timeout_s), *op]
    return {"work_dir": str(wd), "pyz": pyz, "spec_path": spec_path, "spec": spec, "argv": argv,
            "op": op, "timeout_s": timeout_s}


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
            tables = table.tables()
            names = ", ".join(t.file_name for t in tables)
            summary = (f"write {names} ({sum(t.nbytes for t in tables) / 1e9:.1f} GB, the file SGLang "
                       f"maps) to {dep.ple_dir(h)} unless the one there is still valid")
            details = {"placement": "nvme", "file": str(PurePosixPath(dep.ple_dir(h)) / tables[0].file_name),
                       "files": [str(PurePosixPath(dep.ple_dir(h)) / t.file_name) for t in tables],
                       "layout": [t.to_json() for t in tables], "row_bytes": table.row_bytes,
                       "checkpoint": dep.checkpoint_dir(h), "dest": dep.ple_dir(h)}
        acts.append(Action(STAGE_NAME, h.name, "ansible-playbook", summary, command=tuple(job["argv"]),
                           details={**details, "playbook": f"playbooks/{PLAYBOOK}"},
                           digest=digest_of({"spec": spec, "argv": job["argv"]})))
    return acts, ""


def result_from(host: str, res: Any, timeout_s: int) -> HostResult | str:
    """A playbook host result (executors.ansible.PlaybookHostResult) -> this stage's HostResult."""
    doc = res.result_json or {}
    if not res.ok:
        msg = doc.get("error") or res.msg
        if res.rc in (124, 137) and not doc.get("error"):
            msg = f"ple-write did not finish within {timeout_s} s on the host and was killed"
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

    pyz = bundle.build(ctx.run_dir / "bundle")
    verify = bool(ctx.options.get("verify"))
    hosts = [dep.cluster.host(a.host) for a in actions]
    extravars = playbook_vars(dep, pyz, hosts, verify)
    # A kept table is the usual case on a restart: ask over SSH first (nothing is read but the
    # manifest and stats) and run the playbook only for hosts that need it. --verify always runs it.
    current = {} if verify else already_done(dep, [
        Probe(h, j["pyz"], with_stdin_spec([*j["op"], "--check"], j["spec_path"]), j["spec"])
        for h, j in extravars["ple_hosts"].items()], pyz)
    vars_path = ctx.write_json(f"{STAGE_NAME}-vars.json", extravars)   # ops can re-run it with -e @
    timeout = max(j["timeout_s"] for j in extravars["ple_hosts"].values()) + 300

    def one(action, log):
        if action.host in current:
            log.write(f"checked over SSH: {current[action.host]}")
            return HostResult(action.host, STAGE_NAME, "skipped", current[action.host])
        job = extravars["ple_hosts"][action.host]
        log.write(f"$ {shlex.join(job['argv'])}")
        log.write(f"(ansible-playbook -i {dep.cluster.file} {PLAYBOOKS_DIR / PLAYBOOK} -e @{vars_path} "
                  f"--limit {action.host})")
        results = run_playbook(PLAYBOOKS_DIR / PLAYBOOK, dep.cluster.file, limit=[action.host],
                               extravars=extravars,
                               artifact_dir=ctx.run_dir / "ansible" / STAGE_NAME / action.host,
                               timeout_s=timeout, host_key_checking=dep.cluster.host_key_checking,
                               known_hosts_file=dep.cluster.known_hosts_file,
                               on_output=lambda _h, line: log.write(line), cancel=ctx.cancel)
        res = results[action.host]
        if res.result_json:
            log.write("result: " + json.dumps(res.result_json))
        return result_from(action.host, res, job["timeout_s"])

    return run_per_host(actions, ctx, one)


STAGE = Stage(STAGE_NAME, plan, apply, "write the memory-mapped PLE table file once (or check RAM "
              "for the pinned placement)")
