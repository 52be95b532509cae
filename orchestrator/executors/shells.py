"""The run's SSH sessions: one reused session per host, `docker -H <docker_host>` there.

The Docker CLI runs on each host over the SSH executor (executors/ssh.py: paramiko, known_hosts
checked): one transport for everything, the same commands an operator types in the runbooks, and
the inventory's `docker_host` passed explicitly with -H (executors/docker_cli.py, never whatever
DOCKER_HOST the login has). Every command has a timeout; a session that breaks is dropped and
reopened on the next command. A run keeps one `Shells` in its RunState (`run_shells`), so its
stages reuse their sessions; whoever made the run's context closes it (cli/pipeline.py).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

from .docker_cli import docker_argv
from .ssh import Result, SSHError, SSHSession, SSHTarget, SSHTimeout

if TYPE_CHECKING:
    from ..inventory import Cluster, Host
    from ..runoptions import RunState   # noqa: F401  (annotation only)


class HostShell:
    """Commands on one host through one SSH session, opened on first use and reused."""

    def __init__(self, cluster: "Cluster", host: "Host", connect_timeout: float = 10.0):
        self.host = host
        self.target = SSHTarget.for_host(host, cluster, connect_timeout=connect_timeout)
        self._session: SSHSession | None = None
        self._lock = threading.Lock()

    def docker(self, *args: str) -> list[str]:
        """`docker -H <this host's engine> ARGS...` as an argv (executors/docker_cli.py)."""
        return docker_argv(self.host, *args)

    def run(self, argv: Sequence[str], timeout: float = 60.0, stdin: str | None = None) -> Result:
        with self._lock:
            reused = self._session is not None
            try:
                return self._run(argv, timeout, stdin)
            except SSHTimeout:
                self._drop()
                raise
            except SSHError:
                self._drop()
                if not reused:
                    raise
            # A reused session may have been closed by the host (sshd restarted): one fresh try.
            try:
                return self._run(argv, timeout, stdin)
            except SSHError:
                self._drop()
                raise

    def _run(self, argv: Sequence[str], timeout: float, stdin: str | None) -> Result:
        if self._session is None:
            self._session = self.target.connect()
        return self._session.run(list(argv), timeout=timeout, stdin=stdin)

    def _drop(self) -> None:
        if self._session is not None:
            try:
                self._session.close()
            finally:
                self._session = None

    def close(self) -> None:
        with self._lock:
            self._drop()


class Shells:
    """A HostShell per host of the cluster; closes them all on exit."""

    def __init__(self, cluster: "Cluster", connect_timeout: float = 10.0):
        self._by_name = {h.name: HostShell(cluster, h, connect_timeout) for h in cluster.hosts}

    def __getitem__(self, host: str) -> HostShell:
        return self._by_name[host]

    def __enter__(self) -> "Shells":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in self._by_name.values():
            s.close()


def run_shells(cluster: "Cluster", state: "RunState") -> Shells:
    """The run's shared Shells (state.shells), made on first use."""
    if state.shells is None:
        state.shells = Shells(cluster)
    assert isinstance(state.shells, Shells)
    return state.shells
