"""Before launch starts an engine on a host: prove the staged tables it will serve (#14).

The table stages prove a host's tables when they find them current (their `--check`, which re-hashes
a sample and every chunk of a touched file: hostside/tableproof.py) and record that in the run
(`RunState.proven`). A launch without them in the same run (`deployctl launch`, `up --only launch`)
asks each host the same question here, through the same op and `--check` (the zipapp copied to the
host when it lacks this version). A host whose tables are not current is refused before any
container is touched, with the op's reason and the command that repairs it; a corrupt table also
loses its manifest there, so the repair restages it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from ..hostside import bundle
from ..outcomes import HostFailure
from .hostcheck import with_stdin_spec
from .stage_engram import STAGE_NAME as ENGRAM_STAGE, host_job as engram_job
from .write_ple import STAGE_NAME as PLE_STAGE, host_job as ple_job, spec_for as ple_spec
from .tableop import TableJob, timeout_for

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..executors.shells import HostShell
    from ..inventory import Host
    from ..runrecord import RunContext

CHECK_TIMEOUT_S = 300          # headers, the index and a 1 GiB sample; a touched 47.7 GB table is read in full


def jobs_for(dep: "Deployment", host: "Host") -> dict[str, TableJob]:
    """{stage name: that stage's job on HOST} for the tables the engine reads from the host's NVMe."""
    r, out = dep.recipe, {}
    if r.engram and r.engram.placement == "nvme":
        out[ENGRAM_STAGE] = engram_job(dep, host)
    if r.ple and r.ple.placement == "nvme":
        out[PLE_STAGE] = ple_job(dep, host, ple_spec(r))
    return out


def repair_command(stage: str, inventory: Path) -> str:
    cmd = {"stage-engram": "stage", "write-ple": "ple"}.get(stage, "up")
    return f"deployctl {cmd} -i {inventory}"


def prove_host(dep: "Deployment", sh: "HostShell", ctx: "RunContext", staged: dict[str, Any]) -> list[str]:
    """Prove HOST's tables unless this run's table stages already did; returns what was proven (for
    the log). STAGED: what launch's probe read there (launch/probe.py). A host without any PLE table
    file is left to SGLang, which writes the table itself at boot (the upstream path). Raises
    HostFailure naming the table, the reason and the repair command."""
    done = ctx.state.proven.get(sh.host.name, set())
    stages = [s for s in jobs_for(dep, sh.host) if s not in done]
    said = []
    if "write-ple" in stages and not (staged.get("ple") or {}).get("tables"):
        stages.remove("write-ple")
        said.append("write-ple: no table file on the host: SGLang writes it at boot")
    for stage, doc in check_host(dep, sh, bundle.build(ctx.run_dir / "bundle"), stages).items():
        if doc.get("up_to_date") is not True:
            raise HostFailure(f"refused: the {stage} tables are not current: {doc.get('reason')}; "
                              f"repair with `{repair_command(stage, dep.cluster.file)}` (or `deployctl up`)",
                              rc=doc.get("rc") or 1)
        ctx.state.proven.setdefault(sh.host.name, set()).add(stage)
        said.append(f"{stage}: {doc.get('reason')}")
    return said


def check_host(dep: "Deployment", sh: "HostShell", pyz: Path, stages: list[str] | None = None,
               full: bool = False) -> dict[str, dict[str, Any]]:
    """{stage: the op's --check result} on HOST (with FULL: --check --verify, every chunk re-hashed),
    the zipapp PYZ installed there first when it lacks this version. A check that printed no
    result raises HostFailure with its output."""
    out = {}
    for stage, job in jobs_for(dep, sh.host).items():
        if stages is not None and stage not in stages:
            continue
        _ensure_pyz(sh, pyz, job.pyz)
        argv = [*with_stdin_spec(job.check_argv, job.spec_path), *(["--verify"] if full else [])]
        r = sh.run(argv, timeout=CHECK_TIMEOUT_S if not full else timeout_for(job.bytes),
                   stdin=json.dumps(job.spec))
        try:
            doc = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise HostFailure(f"{stage} check printed no result (exit {r.rc}): "
                              f"{(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc) from None
        if r.rc != 0 and doc.get("up_to_date") is not False:
            doc = {**doc, "up_to_date": False, "reason": doc.get("error") or f"exit {r.rc}"}
        out[stage] = {**doc, "rc": r.rc}
    return out


def verify_cluster(dep: "Deployment", pyz: Path) -> dict[str, Any]:
    """`status --verify`: every host's tables re-hashed in full, in parallel. {host: {stage: result}}
    or {host: error}; each result has up_to_date, reason and the proof's bytes and seconds."""
    from ..executors.shells import Shells
    from ..outcomes import parallel
    names = [h.name for h in dep.cluster.hosts]
    with Shells(dep.cluster) as shells:
        res = parallel(names, lambda n: check_host(dep, shells[n], pyz, full=True))
    return {n: res.ok[n] if n in res.ok else {"error": str(res.failed[n])} for n in names}


def _ensure_pyz(sh: "HostShell", local: Path, remote: str) -> None:
    """The tables zipapp at REMOTE on the host, this exact version (copied when it differs)."""
    want = hashlib.sha256(local.read_bytes()).hexdigest()
    got = sh.run(["sh", "-c", 'sha256sum "$1" 2>/dev/null | cut -d" " -f1', "sh", remote], timeout=30)
    if got.stdout.strip() == want:
        return
    tmp = f"{remote}.{want[:12]}.tmp"
    sh.run(["mkdir", "-p", str(PurePosixPath(remote).parent)], timeout=30)
    sh.target.put_file(local, tmp, mode=0o644, timeout=120)
    r = sh.run(["mv", "-f", tmp, remote], timeout=30)
    if r.rc != 0:
        raise HostFailure(f"cannot install the tables zipapp at {remote}: {(r.stderr or r.stdout).strip()[-300:]}",
                          rc=r.rc)
