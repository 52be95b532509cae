"""Running sync-model's pieces on hosts, through deployctl's SSH executor (executors/ssh.py).

- `hostside(session, op, data)`: runs one planned op (jobs.HostsideOp) of hostside/modelsync.py with the host's python3. Nothing is
  installed on the host: `python3 -c BOOTSTRAP N ...` reads the first N bytes of stdin as the
  script, the rest of stdin is the operation's input.
- `stream(session, argv, stdin, timeout, on_line)`: a long command (rsync) whose output lines are
  handed over as they come (progress), with an overall deadline.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..outcomes import HostFailure
from ..signals import exit_text
from ..hostside.modelsync import BOOTSTRAP

if TYPE_CHECKING:
    from ..executors.ssh import Result, SSHSession
    from ..inventory import Cluster, Host
    from .jobs import HostsideOp

HOSTSIDE = Path(__file__).resolve().parent.parent / "hostside" / "modelsync.py"
KEEP_TAIL = 256 * 1024          # bytes of a streamed command's output kept for stats and errors


def connect(host: "Host", cluster: "Cluster", connect_timeout: float = 10.0) -> "SSHSession":
    """An SSH session to HOST; a failure to connect is that host's failure (HostFailure)."""
    from ..executors.ssh import SSHError, SSHTarget
    try:
        return SSHTarget.for_host(host, cluster, connect_timeout).connect()
    except SSHError as e:
        raise HostFailure(str(e)) from None


def hostside(session: "SSHSession", job: "HostsideOp", data: bytes = b"", timeout: float = 600.0) -> dict:
    """Run one planned hostside/modelsync.py operation; its JSON result, or HostFailure with its error line."""
    from ..executors.ssh import SSHError
    script = HOSTSIDE.read_bytes()
    host, op = session.target.host, job.op
    try:
        r: Result = session.run(["python3", "-c", BOOTSTRAP, str(len(script)), op, *job.args],
                                timeout=timeout, stdin=script + data)
    except SSHError as e:
        raise HostFailure(_short(str(e), host, op)) from None
    if r.rc != 0:
        lines = [x for x in r.stderr.splitlines() if not x.startswith("progress ")]
        err = error_line(lines)
        if r.rc == 127:
            err = "python3 is not installed on the host (sync-model runs a small stdlib script there)"
        raise HostFailure(err or f"sync-model's host script ({op}) {exit_text(r.rc, ssh=True)}", rc=r.rc,
                          tail=lines[-10:])
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise HostFailure(f"sync-model's host script ({op}) printed no result", tail=r.stderr.splitlines()[-10:])


def error_line(lines: list[str]) -> str:
    """The last `error: ...` line a host script printed (hostside/modelsync.py, hostside/hubfetch.py), or ""."""
    return next((x[len("error: "):] for x in reversed(lines) if x.startswith("error: ")), "")


def _short(msg: str, host: str, op: str) -> str:
    """SSH errors quote the command; ours carries the whole script: name the operation instead."""
    cut = msg.find("`python3 -c")
    if cut >= 0:
        end = msg.find("`", cut + 1)
        msg = msg[:cut] + f"`sync-model {op}`" + (msg[end + 1:] if end >= 0 else "")
    return msg


def stream(session: "SSHSession", argv: list[str], stdin: bytes, timeout: float,
           on_line: Callable[[str], None], *, idle_timeout: float | None = None,
           cancel: "threading.Event | None" = None) -> tuple[int, str, str]:
    """Run ARGV, feed STDIN, call ON_LINE for each stdout/stderr line (\\r or \\n ended) as it comes
    (executors/ssh.py RemoteExec). Returns (rc, stdout tail, stderr tail). Past TIMEOUT, or IDLE_TIMEOUT
    without a line, the channel is closed and HostFailure raised (the command bounds its own run on the
    host too, with `timeout`); a set CANCEL (Ctrl-C) ends it with HostFailure("... cancelled")."""
    from ..executors.ssh import SSHError, SSHSilent, SSHTimeout
    host = session.target.host
    try:
        with session.open_exec(argv, idle_timeout=min(timeout, 60.0), keep=KEEP_TAIL) as ex:
            ex.write(stdin)
            try:
                r = ex.finish(timeout, lambda kind, line: on_line(line), idle_timeout=idle_timeout,
                              cancel=cancel)
            except SSHSilent as e:
                raise HostFailure(str(e), tail=ex.stderr.splitlines()[-10:]) from None
            except SSHTimeout:
                raise HostFailure(f"{host}: `{argv[0]} ...` did not finish within {timeout:g}s",
                                  tail=ex.stderr.splitlines()[-10:]) from None
    except SSHError as e:
        raise HostFailure(str(e)) from None
    return r.rc, r.stdout, r.stderr
