"""One SSH connection per host for a whole command, shared by every stage and thread.

    with shared_connections():          # the CLI wraps each command in one (cli/common.py)
        SSHTarget.for_host(h, c).connect()   # -> this scope's connection to h, opened on first use

Inside the scope SSHTarget.connect() hands out the scope's session for that host (same address,
port, user, key and host-key settings), opened on first use; its close() is a no-op and the scope
closes every connection when it ends (also on errors and Ctrl-C). Outside a scope nothing changes:
each connect() is a connection of its own (library use, tests of single operations).

Each shared connection also runs short commands through a command agent (executors/command_agent.py):
one login shell per host per run instead of one per command.

Limits kept:
- sshd's MaxSessions (10 by default) bounds the channels one connection may have open at once:
  past CHANNELS_PER_CONNECTION a further connection to the same host is opened.
- A connection whose transport died (host rebooted, link cut and keepalive failed) is replaced on
  the next connect(); a command that fails on it still fails, naming the host, as before.
Scopes nest (the outermost one owns the connections), and one scope may be shared by threads.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

from . import ssh
from .command_agent import AgentUnavailable, CommandAgent
from .ssh import Result, SSHSession, SSHTarget

log = logging.getLogger(__name__)

CHANNELS_PER_CONNECTION = 8      # below sshd's default MaxSessions (10)
FIRST_ALONE_S = 2.0              # warm(): how long the others wait for the first host's connection
IDLE_AGENTS = 2                  # agents kept per connection (threads on one host rarely exceed it)


class _Agents:
    """The command agents of one shared connection: SSHSession.runner."""

    def __init__(self, session: SSHSession):
        self.session = session
        self.idle: list[CommandAgent] = []
        self.lock = threading.Lock()
        self.unavailable = False

    def __call__(self, cmd: str, argv: list[str] | None, stdin: bytes, env: dict[str, str] | None,
                 timeout: float) -> Result | None:
        if self.unavailable:
            return None
        with self.lock:
            agent = self.idle.pop() if self.idle else None
        if agent is None:
            try:
                agent = CommandAgent(self.session)
            except AgentUnavailable as e:
                log.debug("%s: no command agent (%s): one channel per command", self.session.target.host, e)
                self.unavailable = True
                return None
        try:
            r = agent.call(cmd, argv=argv, stdin=stdin, env=env, timeout=timeout)
        except BaseException:
            agent.close()
            raise
        with self.lock:
            if len(self.idle) < IDLE_AGENTS:
                self.idle.append(agent)
                agent = None
        if agent is not None:
            agent.close()
        return r

    def close(self) -> None:
        with self.lock:
            agents, self.idle = self.idle, []
        for a in agents:
            a.close()


def _key(t: SSHTarget) -> tuple:
    return (t.address, t.port, t.user, t.key_file, t.known_hosts_file, t.check_host_keys)


def _open_channels(s: SSHSession) -> int:
    chans = getattr(s.transport, "_channels", None)     # paramiko's ChannelMap
    try:
        return len(chans.values()) if chans is not None else 0
    except Exception:  # noqa: BLE001 - a private structure: never let it break a run
        return 0


class ConnectionPool:
    def __init__(self) -> None:
        self._conns: dict[tuple, list[tuple[SSHSession, _Agents]]] = {}
        self._locks: dict[tuple, threading.Lock] = {}
        self._lock = threading.Lock()
        self.opened = 0                  # connections opened in this scope (bench/scale.py reports it)
        self._warmers: list[threading.Thread] = []

    def warm(self, targets: list[SSHTarget]) -> None:
        """Open the connections (and their agents) to TARGETS in the background, so the first stage
        does not wait host after host. The first target (the head: what a run asks first) starts
        alone, the others once it is up (at most FIRST_ALONE_S later): starting them all at once
        would slow the head's by as many login shells. Failures are left to the stage that needs
        the host: it reports them with its own context."""
        def one(t: SSHTarget, after: threading.Thread | None) -> None:
            if after is not None:
                after.join(FIRST_ALONE_S)
            try:
                self.session(t).run(["true"], timeout=30)
            except Exception:  # noqa: BLE001 - see the docstring
                pass
        first: threading.Thread | None = None
        for t in targets:
            th = threading.Thread(target=one, args=(t, first), name=f"ssh-warm-{t.host}", daemon=True)
            th.start()
            self._warmers.append(th)
            first = first or th

    def session(self, target: SSHTarget) -> SSHSession:
        key = _key(target)
        with self._lock:
            key_lock = self._locks.setdefault(key, threading.Lock())
        with key_lock:
            live = []
            for s, agents in self._conns.get(key, []):
                if s.transport.is_active():
                    live.append((s, agents))
                else:
                    agents.close()
                    s.close_connection()
            self._conns[key] = live
            for s, _ in live:
                if _open_channels(s) < CHANNELS_PER_CONNECTION:
                    return s
            s = SSHSession(target, shared=True)     # SSHError names the host, as ever
            agents = _Agents(s)
            s.runner = agents
            live.append((s, agents))
            self.opened += 1
            return s

    def close(self) -> None:
        for th in self._warmers:          # each bounded by the connect and agent start-up timeouts
            th.join()
        with self._lock:
            conns, self._conns = self._conns, {}
        for entries in conns.values():
            for s, agents in entries:
                agents.close()
                s.close_connection()


def warm_up(targets: list[SSHTarget]) -> None:
    """ConnectionPool.warm on the current scope's pool; nothing outside a scope."""
    pool = _pool
    if pool is not None:
        pool.warm(targets)


def connections_opened() -> int | None:
    """SSH connections opened so far in the current scope (a run's --json reports it); None outside one."""
    pool = _pool
    return pool.opened if pool is not None else None


_scope_lock = threading.Lock()
_pool: ConnectionPool | None = None
_depth = 0


@contextlib.contextmanager
def shared_connections() -> Iterator[ConnectionPool]:
    """The scope's pool; nested scopes share the outermost one."""
    global _pool, _depth
    with _scope_lock:
        if _pool is None:
            _pool = ConnectionPool()
            ssh.use_shared(_pool.session)
        _depth += 1
        pool = _pool
    try:
        yield pool
    finally:
        with _scope_lock:
            _depth -= 1
            done = _depth == 0
            if done:
                ssh.use_shared(None)
                _pool = None
        if done:
            pool.close()
