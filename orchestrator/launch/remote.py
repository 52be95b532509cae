"""Reaching the deployment's hosts: one reused SSH session per host, `docker -H <docker_host>` there.

The Docker CLI runs on each host over deployctl's SSH executor (paramiko, known_hosts checked):
one transport for everything, the same commands an operator types in the runbooks, and the
inventory's `docker_host` passed explicitly with -H (never whatever DOCKER_HOST the login has).
Every command has a timeout; a session that breaks is dropped and reopened on the next command.
"""
from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, TypeVar

from ..executors.docker_cli import docker_argv
from ..executors.ssh import Result, SSHError, SSHSession, SSHTarget, SSHTimeout

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host
    from ..runoptions import RunState

T = TypeVar("T")
K = TypeVar("K")


def ssh_target(dep: "Deployment", host: "Host", connect_timeout: float = 10.0) -> SSHTarget:
    return SSHTarget.for_host(host, dep.cluster, connect_timeout=connect_timeout)


class HostShell:
    """Commands on one host through one SSH session, opened on first use and reused."""

    def __init__(self, dep: "Deployment", host: "Host", connect_timeout: float = 10.0):
        self.host = host
        self.target = ssh_target(dep, host, connect_timeout)
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
    """A HostShell per host of the deployment; closes them all on exit."""

    def __init__(self, dep: "Deployment", connect_timeout: float = 10.0):
        self._by_name = {h.name: HostShell(dep, h, connect_timeout) for h in dep.cluster.hosts}

    def __getitem__(self, host: str) -> HostShell:
        return self._by_name[host]

    def __enter__(self) -> "Shells":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for s in self._by_name.values():
            s.close()


def run_shells(dep: "Deployment", state: "RunState") -> Shells:
    """The run's shared Shells (state.shells), so the stages of one run reuse their SSH sessions;
    whoever made the run's context closes it at the end (cli/pipeline.py)."""
    pool = state.shells
    if pool is None:
        pool = state.shells = Shells(dep)
    assert isinstance(pool, Shells)
    return pool


def short_reason(e: BaseException) -> str:
    """An exception as one short line: SSH errors without the host prefix and the command text."""
    text = str(e)
    if isinstance(e, SSHError) and text.startswith(e.host + ": "):
        text = text[len(e.host) + 2:]
    return re.sub(r"`[^`]{60,}`", "a command", text)


def parallel(items: Iterable[K], fn: Callable[[K], T]) -> dict[K, "T | BaseException"]:
    """fn(item) for every item at once; an exception is that item's value (never lost, never raised)."""
    items = list(items)

    def one(item: K) -> "T | BaseException":
        try:
            return fn(item)
        except Exception as e:  # noqa: BLE001 - per-item failures are values
            return e

    if not items:
        return {}
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return dict(zip(items, pool.map(one, items)))
