"""Host-side table operations through Ansible: what stage-engram and write-ple share.

Both stages run one op of the stdlib-only tables zipapp (orchestrator/hostside/bundle.py) on every
host, under coreutils `timeout` there:

    timeout -k 30 <s> python3 <nvme_dir>/.deployctl/deployctl-tables.pyz OP --spec <spec file> ...

A stage's `plan` builds one `TableJob` per host (`make_job`) and puts it into its Action
(`command` = the job's argv, `details["job"]` = the job); `run_jobs` executes exactly those jobs:

1. build the zipapp and write `<stage>-vars.json` into the run record (the playbook's `-e @` file:
   `{"tables_pyz": ..., "<hosts_key>": {host: job vars}}`, usable by hand);
2. ask each host over SSH whether it is already done (hostcheck: the op's `--check`, spec on stdin);
3. run the stage's playbook ONCE, limited to the hosts with work (ansible-runner, hosts in parallel);
4. map each host's playbook result to a HostResult (`host_result`), log and report it the same way.

A stage keeps only its spec, its op's arguments and how it words a successful result (`Describe`).
"""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable

from ..outcomes import HostResult, HostResults, Status
from ..hostside import bundle
from ..signals import describe_exit
from .hostcheck import Probe, already_done, with_stdin_spec

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host
    from ..plan import Action
    from ..runrecord import RunContext

WORK_SUBDIR = ".deployctl"              # below the host's nvme_dir: the zipapp and the specs
PYZ_NAME = "deployctl-tables.pyz"
KILL_GRACE_S = 30                       # `timeout -k`: KILL this long after TERM
BASE_TIMEOUT_S = 600                    # python start, checks, the no-op, read-back
MIN_RATE = 20e6                         # bytes/s assumed when sizing the per-host timeout
PLAYBOOK_SLACK_S = 300                  # the whole playbook run: the longest host's timeout + this


def host_python(host: "Host") -> str:
    """The interpreter the op runs with: the inventory's ansible_python_interpreter, else python3."""
    py = str(host.ansible_vars.get("ansible_python_interpreter") or "")
    return py if py and not py.startswith("auto") and "{{" not in py else "python3"


def timeout_for(nbytes: int, passes: int = 1) -> int:
    """Seconds the op may take on the host for `nbytes` read or written `passes` times."""
    return int(BASE_TIMEOUT_S + nbytes * passes / MIN_RATE)


@dataclass(frozen=True)
class TableJob:
    """One host's run of one table op: what the plan shows and what apply executes."""
    host: str
    op_name: str                        # engram-stage, ple-write
    work_dir: str
    pyz: str
    spec_path: str
    spec: dict[str, Any]
    op: tuple[str, ...]                 # the op's argv on the host, without the `timeout` wrapper
    bytes: int                          # what the timeout is sized from
    timeout_s: int
    extra: dict[str, Any] = field(default_factory=dict)   # stage-specific playbook variables

    @property
    def argv(self) -> tuple[str, ...]:
        return ("timeout", "-k", str(KILL_GRACE_S), str(self.timeout_s), *self.op)

    @property
    def check_argv(self) -> tuple[str, ...]:
        """The op's read-only `--check` (hostcheck's fast path; stage-engram's space check)."""
        return (*self.op, "--check")

    def with_flag(self, flag: str, passes: int = 1) -> "TableJob":
        """The same job with one more op flag, its timeout sized for `passes` over the bytes."""
        return replace(self, op=(*self.op, flag), timeout_s=timeout_for(self.bytes, passes))

    def to_vars(self) -> dict[str, Any]:
        """This host's entry in the playbook variables."""
        return {**self.extra, "work_dir": self.work_dir, "pyz": self.pyz, "spec_path": self.spec_path,
                "spec": self.spec, "argv": list(self.argv), "check_argv": list(self.check_argv),
                "timeout_s": self.timeout_s}

    def to_json(self) -> dict[str, Any]:
        """What an Action carries in details["job"] (`from_json` reads it back)."""
        return {"host": self.host, "op_name": self.op_name, "work_dir": self.work_dir, "pyz": self.pyz,
                "spec_path": self.spec_path, "spec": self.spec, "op": list(self.op), "bytes": self.bytes,
                "timeout_s": self.timeout_s, "extra": self.extra}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TableJob":
        return cls(d["host"], d["op_name"], d["work_dir"], d["pyz"], d["spec_path"], d["spec"],
                   tuple(d["op"]), int(d["bytes"]), int(d["timeout_s"]), dict(d.get("extra") or {}))

    @classmethod
    def of(cls, action: "Action") -> "TableJob":
        """The job a plan's Action carries (action.job; its JSON in details["job"] for plan files);
        its argv must be the Action's command."""
        job = action.job if isinstance(action.job, cls) else cls.from_json(action.details["job"])
        if action.command and tuple(action.command) != job.argv:
            raise ValueError(f"{action.host}: the action's command and its job's argv differ")
        return job


def make_job(host: "Host", op_name: str, spec_name: str, spec: dict[str, Any], args: list[str] | tuple[str, ...],
             nbytes: int, extra: dict[str, Any] | None = None) -> TableJob:
    """`python3 <pyz> OP --spec <work>/<spec_name> ARGS...` on `host`, the timeout sized from nbytes."""
    work = PurePosixPath(host.nvme_dir) / WORK_SUBDIR
    pyz, spec_path = str(work / PYZ_NAME), str(work / spec_name)
    op = (host_python(host), pyz, op_name, "--spec", spec_path, *args)
    return TableJob(host.name, op_name, str(work), pyz, spec_path, spec, op, nbytes, timeout_for(nbytes),
                    dict(extra or {}))


def table_vars(hosts_key: str, jobs: list[TableJob], pyz: str | Path) -> dict[str, Any]:
    """The variables the stage's playbook takes (`-e @file` by hand)."""
    return {"tables_pyz": str(Path(pyz).absolute()), hosts_key: {j.host: j.to_vars() for j in jobs}}


# A successful playbook run's op result -> (status, message), or None: the op printed no result.
Describe = Callable[[TableJob, dict[str, Any]], "tuple[Status, str] | None"]


def host_result(stage: str, job: TableJob, res: Any, describe: Describe) -> HostResult:
    """A playbook host result (executors.ansible.PlaybookHostResult) -> the stage's HostResult."""
    doc = res.result_json or {}
    if not res.ok:
        msg = doc.get("error") or res.msg
        killed = describe_exit(res.rc, time_limit_s=job.timeout_s)    # the op runs under `timeout -k`
        if killed and not doc.get("error"):
            msg = f"{job.op_name} {killed}"
        if res.failed_task:
            msg = f"{msg} (task: {res.failed_task})"
        return HostResult(job.host, stage, "failed", msg, rc=res.rc, tail=res.stdout_tail, data=doc)
    out = describe(job, doc)
    if out is None:
        return HostResult(job.host, stage, "failed",
                          f"{job.op_name} printed no result (status {doc.get('status')!r}); see the log",
                          rc=res.rc, tail=res.stdout_tail, data=doc)
    status, msg = out
    return HostResult(job.host, stage, status, msg, data=doc)


def run_jobs(dep: "Deployment", actions: "list[Action]", ctx: "RunContext", *, stage: str, playbook: Path,
        hosts_key: str, describe: Describe, jobs: list[TableJob] | None = None,
        probe: bool = True) -> HostResults:
    """Run the jobs the actions carry (or `jobs`, one per action, in action order); see the module doc."""
    from ..executors.ansible import run_playbook

    jobs = jobs if jobs is not None else [TableJob.of(a) for a in actions]
    pyz = bundle.build(ctx.run_dir / "bundle")
    extravars = table_vars(hosts_key, jobs, pyz)
    vars_path = ctx.write_json(f"{stage}-vars.json", extravars)   # ops can re-run it with -e @
    # Most re-runs find every host done already: one SSH round trip per host (manifests and stats
    # only) instead of Ansible's seconds of start-up.
    why_not: dict[str, str] = {}
    current = already_done(dep, [Probe(j.host, j.pyz, with_stdin_spec(j.check_argv, j.spec_path), j.spec)
                                 for j in jobs], pyz, why_not) if probe else {}
    logs = {}
    results: dict[str, HostResult] = {}
    for j in jobs:
        ctx.event("action-start", host=j.host, stage=stage, op="ansible-playbook")
        logs[j.host] = log = ctx.host_log(j.host, stage)
        if j.host in current:
            log.write(f"checked over SSH: {current[j.host]}")
            results[j.host] = HostResult(j.host, stage, "skipped", current[j.host])
        else:
            if j.host in why_not:
                log.write(f"checked over SSH: not current: {why_not[j.host]}")
            log.write(f"$ {shlex.join(j.argv)}")
            log.write(f"(ansible-playbook -i {dep.cluster.file} {playbook} -e @{vars_path} --limit {j.host})")
    todo = [j for j in jobs if j.host not in current]
    if todo:
        try:
            res = run_playbook(playbook, dep.cluster.file, limit=[j.host for j in todo], extravars=extravars,
                               artifact_dir=ctx.run_dir / "ansible" / stage,
                               timeout_s=max(j.timeout_s for j in todo) + PLAYBOOK_SLACK_S,
                               host_key_checking=dep.cluster.host_key_checking,
                               known_hosts_file=dep.cluster.known_hosts_file,
                               on_output=lambda host, line: logs[host].write(line), cancel=ctx.cancel)
            for j in todo:
                if res[j.host].result_json:
                    logs[j.host].write("result: " + json.dumps(res[j.host].result_json))
                results[j.host] = host_result(stage, j, res[j.host], describe)
                if j.host in why_not and results[j.host].status == "ok":   # say why it was redone
                    results[j.host].message += f" (the check found: {why_not[j.host]})"
        except Exception as e:  # the playbook could not run at all: every such host fails with the reason
            for j in todo:
                results[j.host] = HostResult(j.host, stage, "failed",
                                             f"ansible-playbook did not run: {type(e).__name__}: {e}")
    out = HostResults()
    for j in jobs:
        r, log = results[j.host], logs[j.host]
        if r.status in ("ok", "skipped"):      # written and read back, or proven current: launch trusts it
            ctx.state.proven.setdefault(j.host, set()).add(stage)
        if r.status == "failed":
            log.write(f"FAILED: {r.message}")
            r.tail = r.tail or log.tail()
        r.log_path = str(log.path)
        log.close()
        ctx.event("action-end", **r.to_json())
        out.append(r)
    return out
