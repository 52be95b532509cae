"""One deployctl run at a time per deployment: a lock held on the head for the whole run.

flock(2) on LOCKFILE, taken after at most GRACE_S of waiting (the head's supervisor checks the lock
by taking it for an instant every tick, hostside/supervisor.py lock_busy: a run that met that instant
was refused, "holder unknown"; a real holder keeps it far longer), with the holder written into the
file (so a refused run can say who holds it), held by a process that lives as long as our SSH
session to the head:
- on a shared connection (every CLI command, executors/ssh_pool.py), the head's command agent holds
  it (hostside/command_agent.py take_lock): no login shell of its own;
- else (no agent on the head, library use) the session runs
  `flock -n LOCKFILE -c '...; echo LOCKED; exec cat'`, `cat` keeping it until its stdin closes.
Both take the same lock, so they exclude each other. Closing the session releases it; so does the
controller dying or being killed (sshd ends the session), so a stale lock cannot outlive its run.
"""
from __future__ import annotations

import getpass
import os
import shlex
import socket
import time
from typing import TYPE_CHECKING

from ..errors import StageFailed
from ..paths import LOCK_DIR, lock_path  # noqa: F401  (re-exported: the lock's file)
from ..executors.ssh import RemoteExec, SSHError, SSHSession, SSHTarget, command_line
from ..hostside.command_agent import LOCK_BUSY

if TYPE_CHECKING:
    from ..deployment import Deployment

BUSY = LOCK_BUSY             # flock -E (and the agent's answer): the lock is held by someone else
ACQUIRE_TIMEOUT_S = 20.0
GRACE_S = 2.0                # how long a held lock is waited for before the run is refused


class LockHeld(StageFailed):
    """Another run holds the deployment's lock (exit 1)."""


def holder_text(command: str) -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (container without passwd entry)
        user = str(os.getuid())
    return (f"deployctl {command} by {user}@{socket.gethostname()} pid {os.getpid()} "
            f"since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")


class HeadLock:
    """Context manager: the deployment's lock on its head, for the duration of the block."""

    def __init__(self, dep: "Deployment", command: str, timeout: float = ACQUIRE_TIMEOUT_S):
        self.dep, self.command, self.timeout = dep, command, timeout
        self.head = dep.cluster.head_host
        self.path = lock_path(dep.name)
        self._session: SSHSession | None = None
        self._ex: RemoteExec | None = None
        self._agents = None        # the head's agents (executors/ssh_pool.py) when one holds the lock

    def __enter__(self) -> "HeadLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        head, path = self.head.name, self.path
        try:
            self._session = SSHTarget.for_host(self.head, self.dep.cluster).connect()
        except SSHError as e:
            raise StageFailed(f"cannot take the deployment lock {path} on the head {head}: {e}") from None
        agents = self._session.runner
        if hasattr(agents, "lock"):
            try:
                r = agents.lock(path, holder_text(self.command), self.timeout, GRACE_S)
            except SSHError as e:
                raise StageFailed(f"cannot take the deployment lock {path} on the head {head}: {e}") from None
            if r is not None:
                self._agents = agents if r.rc == 0 else None
                if r.rc == 0:
                    return
                self._refuse(r.rc, r.stdout.strip(), r.stdout, r.stderr)
        inner = (f"printf '%s\\n' {shlex.quote(holder_text(self.command))} > {shlex.quote(path)}; "
                 "echo LOCKED; exec cat")
        cmd = command_line(["flock", "-w", f"{GRACE_S:g}", "-E", str(BUSY), path, "-c", inner])
        try:
            self._ex = self._session.open_exec(cmd, idle_timeout=self.timeout)
            # `cat` holds the lock while stdin stays open: read until LOCKED, never close stdin here
            rc = self._ex.read(timeout=self.timeout + GRACE_S,
                               until=lambda kind, line: line.strip() == "LOCKED")
        except SSHError as e:
            self.release()
            raise StageFailed(f"cannot take the deployment lock {path} on the head {head}: {e}") from None
        if rc is None:
            return
        holder = ""
        if rc == BUSY:
            try:
                holder = self._session.run(["cat", path], timeout=10).stdout.strip()
            except SSHError:
                pass
        self._refuse(rc, holder, self._ex.stdout, self._ex.stderr)

    def _refuse(self, rc: int, holder: str, out: str, err: str) -> None:
        head, path = self.head.name, self.path
        self.release()
        if rc == BUSY:
            raise LockHeld(f"deployment {self.dep.name} is locked on the head {head} ({path}): another "
                           f"deployctl run is using this cluster ({holder or 'holder unknown'}). Wait for "
                           f"it to finish or stop it (the lock is released when that run ends)")
        raise StageFailed(f"cannot take the deployment lock {path} on the head {head}: flock exited "
                          f"{rc}: {err.strip()[-300:] or out.strip()[-300:] or 'no output'}")

    def release(self) -> None:
        """Let the lock go: the agent drops it, or `cat` sees EOF and flock exits."""
        if self._agents is not None:
            try:
                self._agents.unlock(self.path)
            except SSHError:
                pass      # the head's connection broke: the agent, and its lock, are gone with it
            self._agents = None
        if self._ex is not None:
            try:
                self._ex.close_stdin()
                self._ex.ch.close()
            except Exception:  # noqa: BLE001 - closing a dead channel
                pass
            self._ex = None
        if self._session is not None:
            self._session.close()
            self._session = None
