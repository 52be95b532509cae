"""Ask hosts over SSH whether a table stage has anything to do, before starting Ansible.

Most re-runs find every host current. Ansible costs seconds of start-up per run, while one SSH round
trip per host answers the question: the host's own copy of the tables zipapp is run with the op's
`--check` (the spec on stdin), which reads manifests and stats and writes nothing. Only a host that
already holds this exact zipapp (same sha256) is asked; any doubt (unreachable, another zipapp, not
current, an unreadable answer) leaves the host to the playbook, which does the work and reports it.
"""
from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..outcomes import parallel

if TYPE_CHECKING:
    from ..deployment import Deployment


@dataclass(frozen=True)
class Probe:
    host: str
    pyz: str                       # the zipapp's path on the host (where the playbook puts it)
    check_argv: tuple[str, ...]    # the op's argv with --check and `--spec /dev/stdin`
    spec: dict[str, Any]


def already_done(dep: "Deployment", probes: list[Probe], pyz: Path,
                 why_not: dict[str, str] | None = None) -> dict[str, str]:
    """{host: reason} for the hosts whose op reports `up_to_date`, asked in parallel. WHY_NOT, when
    given, receives the op's reason for each host it answered as not current (e.g. a table its
    proof found corrupt: the run's result then says why that host was restaged)."""
    from ..executors.ssh import SSHError, SSHTarget

    want = hashlib.sha256(pyz.read_bytes()).hexdigest()

    def ask(p: Probe) -> tuple[str, str | None]:
        script = (f"[ \"$(sha256sum {shlex.quote(p.pyz)} 2>/dev/null | cut -d' ' -f1)\" = {want} ] "
                  f"&& exec {shlex.join(p.check_argv)}")
        try:
            r = SSHTarget.for_host(dep.cluster.host(p.host), dep.cluster).run(
                ["sh", "-c", script], timeout=60, stdin=json.dumps(p.spec))
            doc = json.loads(r.stdout.strip().splitlines()[-1]) if r.rc == 0 and r.stdout.strip() else {}
        except (SSHError, ValueError):
            return p.host, None
        if doc.get("up_to_date") is False and why_not is not None and doc.get("reason"):
            why_not[p.host] = str(doc["reason"])
        return p.host, (doc.get("reason") or "already done") if doc.get("up_to_date") is True else None

    by_host = {p.host: p for p in probes}
    return {h: why for h, why in parallel(by_host, lambda h: ask(by_host[h])[1]).ok.items() if why}


def with_stdin_spec(argv: list[str] | tuple[str, ...], spec_path: str) -> tuple[str, ...]:
    """The argv with the spec read from stdin instead of the host's spec file (which may be stale)."""
    return tuple("/dev/stdin" if a == spec_path else a for a in argv)
