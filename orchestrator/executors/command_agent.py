"""The controller's side of hostside/command_agent.py: short commands over one long-lived channel.

A shared SSH connection (executors/ssh_pool.py) starts an agent on first use and keeps it (two at
most per connection, idle), so a run's many small commands on a host cost a round trip each
instead of a login shell each (see the agent's module doc for why, and what a command sees).
Only whole-output commands go this way (SSHSession.run); streams keep their own channels.

Failure rules: an agent that cannot start (no python3 on the host) turns the connection back to a
channel per command, said once in the debug log; an agent whose channel breaks mid-request is
dropped and the request fails like a command whose connection broke (SSHError naming the host);
a request past its timeout raises SSHTimeout, the agent having killed the command's process group.
"""
from __future__ import annotations

import base64
import json
import shlex
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

from .ssh import Result, SSHError, SSHTimeout, _tail_note

if TYPE_CHECKING:
    from .ssh import SSHSession

SOURCE = (Path(__file__).resolve().parent.parent / "hostside" / "command_agent.py").read_text()
START_TIMEOUT_S = 20.0      # login shell + python3 start-up on a loaded host
REPLY_GRACE_S = 10.0        # past the command's own timeout: the agent kills it and answers
MAX_FRAME = 1 << 31


class AgentUnavailable(Exception):
    """The agent did not start; the session goes back to one channel per command."""


class CommandAgent:
    def __init__(self, session: "SSHSession"):
        self.host = session.target.host
        self.broken = False                # a request failed mid-frame: the channel is out of step
        # a shell line: the login shell hands the agent its own environment (see the agent's doc)
        self.ch: paramiko.Channel = session.channel_for(
            f'exec python3 -c {shlex.quote(SOURCE)} "$(env -0 | base64 -w0)"')
        try:
            hello = self._read_frame(time.monotonic() + START_TIMEOUT_S)
        except (SSHError, ValueError) as e:
            self.close()
            raise AgentUnavailable(str(e)) from None
        if not isinstance(hello, dict) or hello.get("protocol") != 1:
            self.close()
            raise AgentUnavailable(f"unexpected greeting {hello!r}")

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            self.ch.settimeout(left)
            chunk = self.ch.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise SSHError(self.host, "the command agent's channel closed (connection lost or agent "
                                          "killed)")
            buf += chunk
        return bytes(buf)

    def _read_frame(self, deadline: float) -> dict:
        self.broken = True        # until a whole frame is read
        try:
            (n,) = struct.unpack(">Q", self._recv_exact(8, deadline))
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes")
            doc = json.loads(self._recv_exact(n, deadline))
            self.broken = False
            return doc
        except socket.timeout:
            raise SSHTimeout(self.host, "no answer from the command agent in time") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise SSHError(self.host, f"the command agent's channel broke: {e}") from None

    def _request(self, doc: dict, what: str, timeout: float) -> dict:
        req = json.dumps(doc).encode()
        self.broken = True        # until the answer is read
        try:
            self.ch.settimeout(max(timeout, 1.0))
            self.ch.sendall(struct.pack(">Q", len(req)) + req)
        except (socket.timeout, paramiko.SSHException, OSError, EOFError) as e:
            raise SSHError(self.host, f"cannot send {what} to the command agent (link down or host "
                                      f"wedged?): {e}") from None
        return self._read_frame(time.monotonic() + timeout + REPLY_GRACE_S)

    def call(self, cmd: str, *, argv: list[str] | None = None, stdin: bytes = b"",
             env: dict[str, str] | None = None, timeout: float = 60.0) -> Result:
        doc = self._request({"cmd": cmd, "argv": argv, "stdin": base64.b64encode(stdin).decode(),
                             "env": env or {}, "timeout": timeout}, f"`{cmd}`", timeout)
        out, err = base64.b64decode(doc.get("out", "")), base64.b64decode(doc.get("err", ""))
        if doc.get("timeout"):
            raise SSHTimeout(self.host, f"command timed out after {timeout:g}s: `{cmd}`" + _tail_note(out, err))
        return Result(int(doc["rc"]), out.decode(errors="replace"), err.decode(errors="replace"))

    def lock(self, path: str, holder: str, timeout: float, wait_s: float = 0.0) -> Result:
        """flock PATH, trying for up to WAIT_S while it is held, then held by the agent until unlock()
        or its end (see the agent's doc): rc 0 taken, LOCK_BUSY (hostside/command_agent.py) held by
        another process (stdout: the holder it wrote)."""
        doc = self._request({"lock": path, "holder": holder, "wait": wait_s}, f"a lock on {path}",
                            timeout + wait_s)
        return Result(int(doc["rc"]), base64.b64decode(doc.get("out", "")).decode(errors="replace"),
                      base64.b64decode(doc.get("err", "")).decode(errors="replace"))

    def unlock(self, path: str, timeout: float = 10.0) -> None:
        self._request({"unlock": path}, f"the release of {path}", timeout)

    def close(self) -> None:
        try:
            self.ch.close()          # the agent reads EOF and exits
        except Exception:  # noqa: BLE001 - closing a channel on a dead link
            pass
