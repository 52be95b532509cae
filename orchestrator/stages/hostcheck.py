"""Ask hosts over SSH whether a table stage has anything to do, before starting Ansible.

Most re-runs find every host current. Ansible costs seconds of start-up per run, while one SSH round
trip per host answers the question: the host's own copy of the tables zipapp is run with the op's
`--check` (the spec on stdin; IF_SAME_ZIPAPP), which reads manifests and stats and writes nothing. Only a host that
already holds this exact zipapp (same sha256) is asked; any doubt (unreachable, another zipapp, not
current, an unreadable answer) leaves the host to the playbook, which does the work and reports it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..outcomes import parallel

if TYPE_CHECKING:
    from ..deployment import Deployment


# `python3 -c IF_SAME_ZIPAPP PYZ SHA256 OP ARGS...`: run the zipapp's OP only if the host's copy is
# this exact zipapp, else exit 1 without output. One interpreter (none on a connection with a command
# agent, which runs `python3 -c` in a fork of itself), where `sha256sum ... && exec python3 PYZ` took
# a shell, sha256sum and an interpreter start. The op runs from a copy of the zipapp unpacked once
# per content next to it (PYZ.d/<sha>/), so that Python caches its bytecode there: modules imported
# from a zip are compiled from source on every run (~0.1 s of CPU per check, per host, per stage).
# Any trouble unpacking (read-only, no space) runs it from the zip as before.
IF_SAME_ZIPAPP = """
import hashlib, os, runpy, shutil, sys, tempfile, zipfile
pyz, want = sys.argv[1], sys.argv[2]
try:
    with open(pyz, "rb") as f:
        same = hashlib.sha256(f.read()).hexdigest() == want
except OSError:
    same = False
if not same:
    sys.exit(1)
root = pyz + ".d"
tree = os.path.join(root, want[:16])
if not os.path.isfile(os.path.join(tree, "__main__.py")):
    try:
        os.makedirs(root, exist_ok=True)
        for old in os.listdir(root):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        tmp = tempfile.mkdtemp(dir=root, prefix=".unpack-")
        with zipfile.ZipFile(pyz) as z:
            z.extractall(tmp)
        os.rename(tmp, tree)
    except OSError:
        tree = pyz
sys.argv = [pyz, *sys.argv[3:]]
runpy.run_path(tree, run_name="__main__")
"""


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
        python, pyz, *op_args = p.check_argv
        assert pyz == p.pyz, p.check_argv
        try:
            r = SSHTarget.for_host(dep.cluster.host(p.host), dep.cluster).run(
                [python, "-c", IF_SAME_ZIPAPP, p.pyz, want, *op_args], timeout=60, stdin=json.dumps(p.spec))
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
