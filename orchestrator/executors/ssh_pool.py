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
    """The command agents of one shared connection: SSHSession.runner.

    A caller that finds no idle agent while one is starting waits for that start instead of
    starting its own: each start is a login shell on the host (the cost the agent exists to pay
    once), and the usual case is the warm-up's agent being ready a moment later."""

    def __init__(self, session: SSHSession):
        self.session = session
        self.idle: list[CommandAgent] = []
        self.cond = threading.Condition()
        self.starting = 0
        self.unavailable = False
        self.locked: dict[str, CommandAgent] = {}     # lock path -> the agent holding it

    def _take(self) -> CommandAgent | None:
        """An idle agent, or a new one (None: the host has none, see the module doc)."""
        with self.cond:
            while not self.idle and self.starting and not self.unavailable:
                self.cond.wait()
            if self.unavailable:
                return None
            if self.idle:
                return self.idle.pop()
            self.starting += 1
        try:
            return CommandAgent(self.session)
        except AgentUnavailable as e:
            log.debug("%s: no command agent (%s): one channel per command", self.session.target.host, e)
            self.unavailable = True
            return None
        finally:
            with self.cond:
                self.starting -= 1
                self.cond.notify_all()

    def _give_back(self, agent: CommandAgent) -> None:
        with self.cond:
            if len(self.idle) < IDLE_AGENTS or agent in self.locked.values():   # a lock holder lives on
                self.idle.append(agent)
                self.cond.notify_all()
                return
        agent.close()

    def warm(self) -> None:
        """Start an agent (unless one is idle) and keep it idle for the run's first command."""
        agent = self._take()
        if agent is not None:
            self._give_back(agent)

    def __call__(self, cmd: str, argv: list[str] | None, stdin: bytes, env: dict[str, str] | None,
                 timeout: float) -> Result | None:
        agent = self._take()
        if agent is None:
            return None
        try:
            r = agent.call(cmd, argv=argv, stdin=stdin, env=env, timeout=timeout)
        finally:
            self._done_with(agent)
        return r

    def _done_with(self, agent: CommandAgent) -> None:
        """Back to idle, unless its channel is out of step (a request broke off): then closed."""
        if agent.broken:
            agent.close()
            with self.cond:
                self.locked = {p: a for p, a in self.locked.items() if a is not agent}
                self.cond.notify_all()
        else:
            self._give_back(agent)

    def lock(self, path: str, holder: str, timeout: float, wait_s: float = 0.0) -> Result | None:
        """flock PATH in an agent of this connection, held until unlock(PATH) or the connection's
        end (CommandAgent.lock); None when the host has no agent (the caller uses flock(1)). The
        agent stays in use for other commands meanwhile, never closed as surplus."""
        agent = self._take()
        if agent is None:
            return None
        try:
            r = agent.lock(path, holder, timeout, wait_s)
            if r.rc == 0:
                with self.cond:
                    self.locked[path] = agent
            return r
        finally:
            self._done_with(agent)

    def unlock(self, path: str, timeout: float = 10.0) -> None:
        """Let PATH go: through the agent holding it, once that agent is idle; an agent that broke
        is closed, and its lock went with it."""
        def idle_holder() -> CommandAgent | None:
            a = self.locked.get(path)
            return a if a is not None and a in self.idle else None

        with self.cond:
            if not self.cond.wait_for(lambda: path not in self.locked or idle_holder(), timeout):
                return            # still busy past TIMEOUT: the lock ends with the connection
            agent = idle_holder()
            if agent is None:
                return
            self.idle.remove(agent)
            del self.locked[path]
        try:
            agent.unlock(path, timeout)
        finally:
            self._done_with(agent)

    def close(self) -> None:
        with self.cond:
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
                s = self.session(t)
                if isinstance(s.runner, _Agents):
                    s.runner.warm()
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
