"""deployctl's SSH executor (paramiko): remote commands, streams into a remote command, SFTP.

Rules it keeps:
- Host keys are checked against a known_hosts file (the inventory's, else ~/.ssh/known_hosts) with a
  reject policy; an unknown key is an error naming the host and the fix. Only an explicit
  `check_host_keys=False` accepts any key, and that is logged as a warning every time.
- argv lists are joined with shlex.quote: nothing reaches the remote shell unquoted.
- Every step has a timeout (TCP connect, SSH banner, auth, channel open, command), so a host whose
  link is down fails in bounded time with an error naming the host; nothing hangs.
- Streams are copied in bounded chunks (`open_exec` for e.g. `docker save | ssh docker load`).

Usage:
    t = SSHTarget("node1", "10.213.0.11", key_file=..., known_hosts_file=...)
    r = t.run(["docker", "image", "inspect", "x"], timeout=30)     # one connection, one command
    with t.connect() as s:                                          # one connection, many operations
        s.run("uname -a"); s.put_file("a", "/tmp/a")
        with s.open_exec(["docker", "load"]) as ex:
            ex.copy_from(fileobj); r = ex.finish(timeout=600)
"""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import select
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Callable, Iterable, Sequence

import paramiko

from ..errors import DeployctlError
from ..signals import exit_text

if TYPE_CHECKING:
    from ..inventory import Cluster, Host

log = logging.getLogger(__name__)

CHUNK = 256 * 1024              # bytes per send/recv: bounded memory for any stream size
TAIL_BYTES = 64 * 1024          # output kept from a streaming command (its last bytes)


class SSHError(DeployctlError):
    """An SSH failure; the message always names the host."""

    def __init__(self, host: str, message: str):
        self.host = host
        super().__init__(f"{host}: {message}")


class HostKeyError(SSHError):
    pass


class SSHTimeout(SSHError):
    pass


class SSHSilent(SSHTimeout):
    """A command produced no output for its idle timeout (a cut link, a wedged host)."""


@dataclass(frozen=True)
class Result:
    rc: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


def command_line(argv: Sequence[str] | str) -> str:
    """A list is quoted word by word; a str is taken as a shell command line the caller wrote."""
    if isinstance(argv, str):
        return argv
    return " ".join(shlex.quote(str(a)) for a in argv)


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's SHA256 fingerprint, as `ssh-keygen -lf` prints it."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    """paramiko's RejectPolicy, with an error that names the host and tells how to fix it."""

    def __init__(self, target: "SSHTarget", known_hosts: Path | None):
        self.target, self.known_hosts = target, known_hosts

    def missing_host_key(self, client, hostname, key) -> None:
        t = self.target
        where = str(self.known_hosts) if self.known_hosts else "~/.ssh/known_hosts (missing)"
        keyscan = f"ssh-keyscan -p {t.port} {t.address}" if t.port != 22 else f"ssh-keyscan {t.address}"
        raise HostKeyError(t.host, f"unknown SSH host key for {t.address}:{t.port} ({key.get_name()} "
                           f"{fingerprint(key)}): not in {where}. If this is the right host, add its key: "
                           f"`{keyscan} >> {self.known_hosts or '~/.ssh/known_hosts'}` (check the fingerprint), "
                           f"or opt out with host_key_checking: false in the inventory")


@dataclass(frozen=True)
class SSHTarget:
    host: str                         # inventory name, used in every message
    address: str
    port: int = 22
    user: str = "root"
    key_file: str | None = None
    known_hosts_file: str | None = None
    check_host_keys: bool = True
    connect_timeout: float = 10.0     # TCP connect, SSH banner, auth and channel open, each

    @classmethod
    def for_host(cls, host: "Host", cluster: "Cluster", connect_timeout: float = 10.0) -> "SSHTarget":
        """The target of an inventory Host, with its Cluster's known_hosts file and host key setting."""
        return cls(host=host.name, address=host.address, port=host.port, user=host.user,
                   key_file=host.key_file, known_hosts_file=cluster.known_hosts_file,
                   check_host_keys=cluster.host_key_checking, connect_timeout=connect_timeout)

    def connect(self) -> "SSHSession":
        """A session to the target: inside a shared-connection scope (executors/ssh_pool.py) the
        scope's connection to this host, else a connection of its own; close it either way."""
        if _shared is not None:
            return _shared(self)
        return SSHSession(self)

    def run(self, argv: Sequence[str] | str, timeout: float = 60.0, stdin: bytes | str | None = None,
            env: dict[str, str] | None = None) -> Result:
        with self.connect() as s:
            return s.run(argv, timeout=timeout, stdin=stdin, env=env)

    def put_file(self, local: str | Path, remote: str, mode: int | None = None, timeout: float = 600.0) -> None:
        with self.connect() as s:
            s.put_file(local, remote, mode=mode, timeout=timeout)

    def get_file(self, remote: str, local: str | Path, timeout: float = 600.0) -> None:
        with self.connect() as s:
            s.get_file(remote, local, timeout=timeout)


# Set by executors/ssh_pool.py while a scope shares one connection per host (this module stays a leaf).
_shared: Callable[[SSHTarget], "SSHSession"] | None = None

# What runs a whole-output command instead of a channel of its own (command_line, the argv when
# the caller gave a list, stdin, env, timeout) -> Result, or None to use a channel; executors/ssh_pool.py sets one on shared sessions.
CommandRunner = Callable[[str, "list[str] | None", bytes, "dict[str, str] | None", float], "Result | None"]


def use_shared(source: Callable[[SSHTarget], "SSHSession"] | None) -> None:
    global _shared
    _shared = source


class SSHSession:
    """One authenticated SSH connection to a target; use as a context manager.
    A shared session (the scope's, see SSHTarget.connect) ignores close(); its scope closes it."""

    def __init__(self, target: SSHTarget, shared: bool = False):
        self.target = target
        self.shared = shared
        self.runner: CommandRunner | None = None
        self.client = paramiko.SSHClient()
        t = target
        known: Path | None = None
        if t.check_host_keys:
            known = Path(t.known_hosts_file).expanduser() if t.known_hosts_file else Path("~/.ssh/known_hosts").expanduser()
            if known.exists():
                # load_system_host_keys: used for checks, never written back (no silent additions)
                self.client.load_system_host_keys(str(known))
            self.client.set_missing_host_key_policy(_RejectUnknown(t, known if known.exists() else None))
        else:
            log.warning("%s: SSH host key checking is OFF (host_key_checking: false): any key offered by "
                        "%s:%d is accepted (AutoAddPolicy, kept in memory only)", t.host, t.address, t.port)
            self.client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        try:
            self.client.connect(
                t.address, port=t.port, username=t.user,
                key_filename=t.key_file,
                # With a key file: use only it (no agent, no ~/.ssh/id_* guesses) so CI behaves like a laptop.
                look_for_keys=t.key_file is None, allow_agent=t.key_file is None,
                timeout=t.connect_timeout,          # TCP connect: a host whose link is down fails here
                banner_timeout=t.connect_timeout,   # sshd accepted but never speaks (overloaded, wedged)
                auth_timeout=t.connect_timeout,     # auth exchange stalls
                channel_timeout=t.connect_timeout,  # opening a session channel stalls
                compress=False,                     # payloads are images and checkpoints: already dense
            )
        except HostKeyError:
            self.client.close()
            raise
        except paramiko.BadHostKeyException as e:
            self.client.close()
            raise HostKeyError(t.host, f"SSH host key of {t.address}:{t.port} does NOT match {known}: got "
                               f"{e.key.get_name()} {fingerprint(e.key)}, expected "
                               f"{fingerprint(e.expected_key)}. The host was reinstalled or this is "
                               f"not the host you think; fix the known_hosts entry after checking") from None
        except paramiko.AuthenticationException as e:
            self.client.close()
            raise SSHError(t.host, f"SSH authentication failed as {t.user}@{t.address}:{t.port} with key "
                           f"{t.key_file or '(agent/default keys)'}: {e}") from None
        except (socket.timeout, TimeoutError) as e:
            self.client.close()
            raise SSHTimeout(t.host, f"cannot connect to {t.address}:{t.port} within {t.connect_timeout:g}s "
                             f"(host down or network cut?): {e or 'timed out'}") from None
        except (paramiko.SSHException, OSError) as e:
            self.client.close()
            raise SSHError(t.host, f"cannot connect to {t.address}:{t.port}: {e}") from None
        transport = self.client.get_transport()
        assert transport is not None
        # Keepalives make a connection over a cut link fail instead of waiting on TCP forever.
        transport.set_keepalive(5)
        # Small requests and replies: without this each channel open waits out a delayed ACK (~40 ms).
        sock = transport.sock
        if isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport

    def __enter__(self) -> "SSHSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self.shared:
            self.client.close()

    def close_connection(self) -> None:
        self.client.close()

    # -- commands ------------------------------------------------------------------------------
    def _channel(self, cmd: str, env: dict[str, str] | None) -> paramiko.Channel:
        t = self.target
        try:
            ch = self.transport.open_session(timeout=t.connect_timeout)
            if env:
                # Not ch.update_environment: sshd drops variables it does not AcceptEnv. Prefix instead.
                cmd = "env " + " ".join(shlex.quote(f"{k}={v}") for k, v in env.items()) + " " + cmd
            ch.exec_command(cmd)
        except (paramiko.SSHException, OSError, EOFError) as e:
            kind = SSHTimeout if "timeout" in str(e).lower() else SSHError
            raise kind(t.host, f"cannot start command `{cmd}` (link down or host wedged?): {e}") from None
        return ch

    def channel_for(self, argv: Sequence[str] | str) -> paramiko.Channel:
        """A channel running ARGV (quoted as in run()), for a caller speaking its own protocol."""
        return self._channel(command_line(argv), None)

    def run(self, argv: Sequence[str] | str, timeout: float = 60.0, stdin: bytes | str | None = None,
            env: dict[str, str] | None = None) -> Result:
        """Run a command; its output is returned whole (use open_exec for large streams)."""
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        if self.runner is not None:
            r = self.runner(command_line(argv), None if isinstance(argv, str) else [str(a) for a in argv],
                            data, env, timeout)
            if r is not None:
                return r
        deadline = time.monotonic() + timeout
        with self.open_exec(argv, idle_timeout=timeout, env=env, keep=None) as ex:
            try:
                if data:
                    ex.write(data)
                return ex.finish(max(deadline - time.monotonic(), 0.0))
            except SSHTimeout:
                raise SSHTimeout(self.target.host, f"command timed out after {timeout:g}s: `{ex.cmd}`"
                                 + _tail_note(ex._out, ex._err)) from None

    def check(self, argv: Sequence[str] | str, timeout: float = 60.0, stdin: bytes | str | None = None) -> Result:
        """run(), raising SSHError (with the command, code and output tail) unless it exits 0."""
        r = self.run(argv, timeout=timeout, stdin=stdin)
        if r.rc != 0:
            raise SSHError(self.target.host, f"`{command_line(argv)}` {exit_text(r.rc, ssh=True)}"
                           + _tail_note(r.stdout.encode(), r.stderr.encode()))
        return r

    def open_exec(self, argv: Sequence[str] | str, idle_timeout: float = 60.0,
                  env: dict[str, str] | None = None, keep: int | None = TAIL_BYTES) -> "RemoteExec":
        """Start a command to stream into and read from as it runs (bounded memory); see RemoteExec."""
        cmd = command_line(argv)
        return RemoteExec(self.target.host, cmd, self._channel(cmd, env), idle_timeout, keep)

    # -- files ---------------------------------------------------------------------------------
    def _sftp(self, timeout: float) -> paramiko.SFTPClient:
        try:
            sftp = self.client.open_sftp()
        except (paramiko.SSHException, OSError) as e:
            raise SSHError(self.target.host, f"cannot open SFTP: {e}") from None
        sftp.get_channel().settimeout(timeout)   # each SFTP request: a stalled link raises, no hang
        return sftp

    def put_file(self, local: str | Path, remote: str, mode: int | None = None, timeout: float = 600.0) -> None:
        """Copy LOCAL to REMOTE atomically (REMOTE.part, then rename): no half file under the real name."""
        sftp = self._sftp(min(timeout, 60.0))
        part = remote + ".part"
        deadline = time.monotonic() + timeout

        def progress(done: int, total: int) -> None:
            if time.monotonic() > deadline:
                raise SSHTimeout(self.target.host, f"upload of {local} to {remote} timed out after {timeout:g}s "
                                 f"({done}/{total} bytes)")
        try:
            sftp.put(str(local), part, callback=progress, confirm=True)
            if mode is not None:
                sftp.chmod(part, mode)
            sftp.posix_rename(part, remote)
        except SSHError:
            raise
        except (OSError, paramiko.SSHException) as e:
            raise SSHError(self.target.host, f"upload of {local} to {remote} failed: {e}") from None
        finally:
            sftp.close()

    def get_file(self, remote: str, local: str | Path, timeout: float = 600.0) -> None:
        sftp = self._sftp(min(timeout, 60.0))
        part = Path(str(local) + ".part")
        deadline = time.monotonic() + timeout

        def progress(done: int, total: int) -> None:
            if time.monotonic() > deadline:
                raise SSHTimeout(self.target.host, f"download of {remote} timed out after {timeout:g}s")
        try:
            sftp.get(remote, str(part), callback=progress)
            os.replace(part, local)
        except SSHError:
            raise
        except (OSError, paramiko.SSHException) as e:
            raise SSHError(self.target.host, f"download of {remote} to {local} failed: {e}") from None
        finally:
            part.unlink(missing_ok=True)
            sftp.close()


class RemoteExec:
    """A running remote command, the one way deployctl reads a command's output as it comes.

    write() / copy_from() stream into its stdin in CHUNK pieces; read() hands over each output line
    (split on \n and on \r, so progress meters count) until the command ends, `until` says stop,
    `cancel` is set, the overall deadline passes or nothing arrives for `idle_timeout`; finish() closes
    stdin and reads to the end -> Result. Output is drained while writing (the remote never blocks on
    a full pipe) and only its last `keep` bytes are kept (None: all of it, for run()).
    """

    def __init__(self, host: str, cmd: str, ch: paramiko.Channel, idle_timeout: float,
                 keep: int | None = TAIL_BYTES):
        self.host, self.cmd, self.ch, self.idle_timeout, self.keep = host, cmd, ch, idle_timeout, keep
        self._out, self._err = bytearray(), bytearray()
        self._lines = {"out": bytearray(), "err": bytearray()}
        self._on_line: Callable[[str, str], None] | None = None
        self.bytes_sent = 0
        self.last_output = time.monotonic()

    def __enter__(self) -> "RemoteExec":
        return self

    def __exit__(self, *exc) -> None:
        self.ch.close()

    # -- output ----------------------------------------------------------------------------------
    def _take(self, kind: str, data: bytes) -> None:
        buf = self._out if kind == "out" else self._err
        buf += data
        if self.keep is not None:
            del buf[:-self.keep]
        self.last_output = time.monotonic()
        if self._on_line is None:
            return
        pending = self._lines[kind]
        pending += data
        while True:
            cuts = [i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0]
            if not cuts:
                break
            i = min(cuts)
            line = pending[:i].decode(errors="replace")
            del pending[:i + 1]
            if line.strip():
                self._on_line(kind, line)

    def _drain(self) -> bool:
        got = False
        while self.ch.recv_ready():
            self._take("out", self.ch.recv(CHUNK))
            got = True
        while self.ch.recv_stderr_ready():
            self._take("err", self.ch.recv_stderr(CHUNK))
            got = True
        return got

    def _ended(self) -> bool:
        ch = self.ch
        return (ch.exit_status_ready() and not ch.recv_ready() and not ch.recv_stderr_ready()
                and (ch.eof_received or ch.closed))

    def read(self, on_line: Callable[[str, str], None] | None = None, *, timeout: float = 600.0,
             idle_timeout: float | None = None, cancel: threading.Event | None = None,
             until: Callable[[str, str], bool] | None = None) -> int | None:
        """Read until the command ends: its exit code. ON_LINE(kind, line) gets each line of stdout
        ("out") and stderr ("err"). Returns None, the command still running, when UNTIL(kind, line)
        is true for a line or CANCEL is set. Raises SSHTimeout past TIMEOUT, or when nothing arrives
        for IDLE_TIMEOUT (a cut link, a wedged host)."""
        stop: list[bool] = []

        def line(kind: str, text: str) -> None:
            if on_line:
                on_line(kind, text)
            if until and until(kind, text):
                stop.append(True)
        self._on_line = line if (on_line or until) else None
        deadline = time.monotonic() + timeout
        self.last_output = time.monotonic()
        try:
            while True:
                busy = self._drain()
                if stop or (cancel is not None and cancel.is_set()):
                    return None
                if self._ended():
                    break
                now = time.monotonic()
                if now > deadline:
                    raise SSHTimeout(self.host, f"`{self.cmd}` did not finish within {timeout:g}s"
                                     + _tail_note(self._out, self._err))
                if idle_timeout is not None and now - self.last_output > idle_timeout:
                    raise SSHSilent(self.host, f"`{self.cmd}` went silent for {idle_timeout:g}s"
                                     + _tail_note(self._out, self._err))
                if not busy:
                    select.select([self.ch], [], [], 0.05)
            for kind, pending in self._lines.items():   # a last line without its newline
                if pending.strip() and self._on_line:
                    self._on_line(kind, pending.decode(errors="replace"))
                pending.clear()
            return self.ch.recv_exit_status()
        finally:
            self._on_line = None

    @property
    def stdout(self) -> str:
        return self._out.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self._err.decode(errors="replace")

    # -- input -----------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            deadline = time.monotonic() + self.idle_timeout
            while not self.ch.send_ready():
                self._drain()
                if self.ch.exit_status_ready() or self.ch.closed:
                    how = exit_text(self.ch.recv_exit_status(), ssh=True)
                    raise SSHError(self.host, f"`{self.cmd}` ended after {self.bytes_sent} bytes of input: "
                                   f"it {how}" + _tail_note(self._out, self._err))
                if time.monotonic() > deadline:
                    raise SSHTimeout(self.host, f"`{self.cmd}` took no input for {self.idle_timeout:g}s "
                                     f"after {self.bytes_sent} bytes" + _tail_note(self._out, self._err))
                select.select([self.ch], [], [], 0.05)
            n = self.ch.send(view[:CHUNK])
            view = view[n:]
            self.bytes_sent += n
            self._drain()

    def copy_from(self, src: BinaryIO | Iterable[bytes]) -> int:
        """Stream a file object (read in CHUNK pieces) or an iterable of byte chunks into stdin."""
        if hasattr(src, "read"):
            while True:
                chunk = src.read(CHUNK)   # type: ignore[union-attr]
                if not chunk:
                    break
                self.write(chunk)
        else:
            for chunk in src:
                self.write(chunk)
        return self.bytes_sent

    def close_stdin(self) -> None:
        self.ch.shutdown_write()

    def finish(self, timeout: float = 600.0, on_line: Callable[[str, str], None] | None = None, *,
               idle_timeout: float | None = None, cancel: threading.Event | None = None) -> Result:
        """Close stdin, read to the end (at most TIMEOUT), return its code and output (tail).
        A set CANCEL raises SSHError("cancelled")."""
        self.close_stdin()
        try:
            rc = self.read(on_line, timeout=timeout, idle_timeout=idle_timeout, cancel=cancel)
        finally:
            self.ch.close()
        if rc is None:
            raise SSHError(self.host, f"`{self.cmd}` cancelled")
        return Result(rc, self.stdout, self.stderr)


def _tail_note(out: bytes | bytearray, err: bytes | bytearray, lines: int = 10) -> str:
    text = (bytes(err) or bytes(out)).decode(errors="replace").strip()
    if not text:
        return ""
    return "; last output:\n" + "\n".join(text.splitlines()[-lines:])


def short_reason(e: BaseException) -> str:
    """An exception as one short line: SSH errors without the host prefix and the command text."""
    text = str(e)
    if isinstance(e, SSHError) and text.startswith(e.host + ": "):
        text = text[len(e.host) + 2:]
    return re.sub(r"`[^`]{60,}`", "a command", text)
