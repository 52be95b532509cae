"""Several commands on a host in one round trip: hostside/host_read.py's batch form.

    results = run_batch(session, [["uname", "-m"], docker_argv(h, "info", "--format", "{{json .}}")])

Each argv is answered in turn on the host and comes back as its own Result, as if it had run alone:
a `docker -H unix://...` argv of a form whose output the CLI defines (host_read.py cli_form) through
the Engine API, any other as the process it names (no shell). The point is cost, not semantics: one
agent request (executors/command_agent.py: a fork, no interpreter start) instead of a request and a
Go process per docker command, which at 8 hosts was most of what a no-op `up` cost the hosts.
Plans keep showing the argv lists themselves: they are what is answered.

An item may be {"argv": [...], "ids_from": K}: the words item K printed appended to the argv (none:
the item is skipped with rc 0), for `inspect $(ls -q)` shapes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from .ssh import Result

# plans show commands built with this source (launch/commands.py): planning must not import paramiko
HOST_READ = (Path(__file__).resolve().parent.parent / "hostside" / "host_read.py").read_text()


def batch_argv(items: Sequence[Any], timeout: float = 60.0) -> list[str]:
    """The argv that answers ITEMS on a host (each item: an argv list, or {"argv", "ids_from"})."""
    return ["python3", "-c", HOST_READ, json.dumps({"batch": [list(i) if isinstance(i, (list, tuple)) else i
                                                              for i in items], "timeout": timeout})]


def run_batch(runner: Any, items: Sequence[Any], timeout: float = 60.0) -> "list[Result]":
    """ITEMS answered on the host of RUNNER (anything with run(argv, timeout=)): one Result each.
    SSHError when the host's program itself fails (no python3, output cut): named with its output."""
    from .ssh import Result, SSHError
    r = runner.run(batch_argv(items, timeout), timeout=timeout * max(len(items), 1))
    try:
        docs = json.loads(r.stdout) if r.rc == 0 else None
    except ValueError:
        docs = None
    if not isinstance(docs, list) or len(docs) != len(items):
        host = runner.host.name if hasattr(runner, "host") else runner.target.host   # HostShell or SSHSession
        raise SSHError(host, f"the host's command batch (python3 -c host_read.py) exited {r.rc}: "
                             f"{(r.stderr.strip() or r.stdout.strip())[-300:] or 'no output'}")
    return [Result(int(d["rc"]), d["out"], d["err"]) for d in docs]
