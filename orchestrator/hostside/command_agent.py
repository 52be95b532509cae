"""deployctl's command agent: runs ON A HOST, started once per SSH connection as
`exec python3 -c SOURCE "$(env -0 | base64 -w0)"` (executors/command_agent.py START), and runs the command lines the controller sends it, one at a time (standard library only).

Why: sshd starts the login shell for every command, and on hosts where root's ~/.bashrc does work
(pyenv, conda, module systems: Debian's bash sources it for commands run by sshd) that alone costs
~0.1 s per command; a run asks each host dozens of small questions. The agent pays that once.
What a command sees is what sshd would give it: the same user, the environment the login shell
built, and `$SHELL -c LINE`, which is how sshd runs a command. The environment is the login shell's
own (`env -0`, base64, as argv[1]), not the agent's: a `python3` that is a shim (pyenv) changes the
environment of what it starts. The child shell does not source ~/.bashrc again: bash skips it when
SHLVL says it is not the first shell.

A `python3 -c SOURCE ARGS...` request (argv given, no PATH or PYTHON* override) runs in a fork of
the agent instead: the same interpreter the login PATH names (the agent is that `python3`), no
interpreter start-up (~50 ms of CPU per call where site-packages has .pth files), a fresh __main__,
sys.argv ['-c', ARGS...], the request's environment and pipes; exit codes as the interpreter gives.
deployctl's host-side programs are all run that way.

Protocol over the channel's stdin/stdout, each message a frame: 8-byte big-endian length, then
JSON. First the agent sends {"ready": pid, "protocol": 1}. Then per request
    {"cmd": LINE, "argv": [..] or null, "stdin": base64, "env": {..}, "timeout": seconds}
it answers {"rc", "out": base64, "err": base64} or, past the timeout (the command's process group
is then killed), {"timeout": true, "out", "err"}. EOF on stdin ends the agent. It never writes to
stderr, so the channel's stderr cannot fill.

Locks: {"lock": PATH, "holder": TEXT, "wait": S} takes flock(2) LOCK_EX|LOCK_NB on PATH (created
0644), the lock `flock PATH` takes, so the two exclude each other, trying again for up to S seconds
(default 0) while another process holds it: the supervisor's check holds it for microseconds; on
success TEXT replaces the file's content (who holds it) and the answer is {"rc": 0}; when another
process still holds it, {"rc": 75, "out": base64 of the file} (75: what `flock -E 75` exits with).
{"unlock": PATH} lets it go. A lock lives in this process (its fd is close-on-exec, and forked
programs close it first), so it ends with the agent: when the controller closes the channel, or
dies and sshd ends the session.
"""
from __future__ import annotations

import base64
import errno
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import time

PROTOCOL = 1


def _read_exact(f, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _b64(data: bytes | None) -> str:
    return base64.b64encode(data or b"").decode()


def _kill_group(p: subprocess.Popen) -> tuple[bytes, bytes]:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        return p.communicate(timeout=5)
    except subprocess.TimeoutExpired:      # a descendant left the group and holds the pipes
        return b"", b""


def login_env(arg: str | None) -> dict[str, str]:
    """The login shell's environment from `env -0 | base64` (argv[1]); this process's without it."""
    try:
        pairs = [kv.split("=", 1) for kv in base64.b64decode(arg or "").decode().split("\0") if "=" in kv]
    except ValueError:
        pairs = []
    env = dict(pairs) if pairs else dict(os.environ)
    env.pop("_", None)
    # bash reads ~/.bashrc under sshd only as the first shell (SHLVL < 2 once it counts itself)
    if not env.get("SHLVL", "").isdigit() or int(env["SHLVL"]) < 1:
        env["SHLVL"] = "1"
    return env


def forkable_python(argv: list[str] | None, extra_env: dict[str, str]) -> bool:
    """`python3 -c SOURCE ARGS...` that names this very interpreter and changes neither PATH nor
    PYTHON*/PYENV*: run in a fork of the agent. `python3` is this interpreter by construction (the
    agent was started as `python3` from the same login environment and folder; a pyenv shim picks
    the same version again); a path names it when it resolves to sys.executable."""
    if not argv or len(argv) < 3 or argv[1] != "-c":
        return False
    if any(k == "PATH" or k.startswith(("PYTHON", "PYENV")) for k in extra_env):
        return False
    if argv[0] == "python3":
        return True
    return "/" in argv[0] and os.path.realpath(argv[0]) == os.path.realpath(sys.executable)


_CODE: dict[str, object] = {}      # source -> code object: compiled once per agent, inherited by forks
CODE_CACHE = 16


def compiled(source: str) -> object | None:
    """SOURCE compiled as `python3 -c` compiles it, cached (a run sends each host program several
    times: ~5 ms of CPU per fork saved); None when it does not compile (the child then compiles it
    again and reports the error as the interpreter would)."""
    code = _CODE.get(source)
    if code is None:
        try:
            code = compile(source, "<string>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            return None
        if len(_CODE) >= CODE_CACHE:
            _CODE.pop(next(iter(_CODE)))
        _CODE[source] = code
    return code


def _python_child(source: str, args: list[str], env: dict[str, str], program: object | None = None) -> None:
    """In a forked child whose fds 0-2 are the request's pipes (subprocess set them up): what
    `python3 -c SOURCE ARGS...` would do (PROGRAM: SOURCE already compiled), without starting an
    interpreter; never returns."""
    import atexit
    import builtins
    import traceback
    import types
    # subprocess waits for its exec-status pipe (close-on-exec) to close before Popen returns; no exec
    # comes, so close it (and any other inherited fd) now, or Popen would wait for the program to end
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
    code = 0
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")
        sys.argv = ["-c", *args]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        exec(program if program is not None else compile(source, "<string>", "exec", dont_inherit=True),
             main.__dict__)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        etype, value, tb = sys.exc_info()
        traceback.print_exception(etype, value, tb.tb_next if tb else None)   # from the program's frame
        code = 1
    try:
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            if not f.closed:
                f.flush()
    except BaseException:  # noqa: BLE001 - the interpreter's code when flushing at exit fails
        code = code or 120
    os._exit(code & 0xFF)


LOCK_BUSY = 75      # a lock held by another process: what `flock -E 75` exits with (launch/lock.py)
# What deployctl's host programs import (host_read.py, modelsync.py, the tables zipapp's check):
# loaded once here, so a forked program finds them in sys.modules instead of importing them again
# (http.client alone is ~20 ms of CPU: it pulls in the email package).
PRELOAD = ("http.client", "urllib.parse", "socket", "hashlib", "glob", "io", "contextlib", "traceback", "re",
           "runpy", "zipfile", "zipimport", "dataclasses", "pathlib", "tempfile", "shutil")


def preload() -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:       # a trimmed interpreter: the program imports what it needs itself
            pass


def take_lock(locks: dict[str, int], path: str, holder: str | None, wait_s: float = 0.0) -> dict:
    """A lock request's answer (see the module doc); LOCKS: path -> fd of the locks held. HOLDER None:
    the file is left as it is (a check that lets the lock go at once must not erase who held it
    last, nor show an empty holder to a run refused meanwhile)."""
    if path in locks:
        return {"rc": 0, "out": "", "err": ""}
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY, 0o644)
    except OSError as e:
        return {"rc": 1, "out": "", "err": _b64(f"cannot open {path}: {e}\n".encode())}
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as e:
            busy = e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)       # another process holds it
            if busy and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            try:
                if busy:
                    return {"rc": LOCK_BUSY, "out": _b64(os.pread(fd, 4096, 0)), "err": ""}
                return {"rc": 1, "out": "", "err": _b64(f"flock {path}: {e}\n".encode())}
            finally:
                os.close(fd)
    if holder is not None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode() + b"\n", 0)
    locks[path] = fd
    return {"rc": 0, "out": "", "err": ""}


def drop_lock(locks: dict[str, int], path: str) -> dict:
    fd = locks.pop(path, None)
    if fd is not None:
        os.close(fd)       # the only fd of this open file: the lock goes with it
    return {"rc": 0, "out": "", "err": ""}


def serve(rd, wr, base_env: dict[str, str]) -> None:
    shell = base_env.get("SHELL") or "/bin/sh"
    locks: dict[str, int] = {}

    def send(doc: dict) -> None:
        data = json.dumps(doc).encode()
        wr.write(struct.pack(">Q", len(data)) + data)
        wr.flush()

    send({"ready": os.getpid(), "protocol": PROTOCOL})
    preload()        # while the controller sends the first request
    while True:
        head = _read_exact(rd, 8)
        if head is None:
            return
        body = _read_exact(rd, struct.unpack(">Q", head)[0])
        if body is None:
            return
        req = json.loads(body)
        if "lock" in req:
            send(take_lock(locks, req["lock"], req.get("holder", ""), float(req.get("wait") or 0)))
            continue
        if "unlock" in req:
            send(drop_lock(locks, req["unlock"]))
            continue
        extra = req.get("env") or {}
        env = {**base_env, **extra}
        argv = req.get("argv")
        # its own process group: a timeout kills the command and what it started, not the agent
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            if forkable_python(argv, extra):
                # the child runs the program in preexec_fn and exits there, so nothing is exec'd;
                # Python's own signal settings stay (it ignores SIGPIPE: BrokenPipeError, as ever)
                program = compiled(argv[2])
                p = subprocess.Popen(["python3"], **pipes, restore_signals=False,
                                     preexec_fn=lambda: _python_child(argv[2], argv[3:], env, program))
            else:
                p = subprocess.Popen([shell, "-c", req["cmd"]], **pipes, env=env)
        except OSError as e:
            send({"rc": 127, "out": "", "err": _b64(f"{shell}: {e}\n".encode())})
            continue
        try:
            out, err = p.communicate(base64.b64decode(req.get("stdin") or ""), timeout=req.get("timeout"))
        except subprocess.TimeoutExpired:
            out, err = _kill_group(p)
            send({"timeout": True, "out": _b64(out), "err": _b64(err)})
            continue
        send({"rc": p.returncode, "out": _b64(out), "err": _b64(err)})


if __name__ == "__main__":
    sys.stderr = open(os.devnull, "w")     # see the module doc: stderr stays empty
    try:
        serve(sys.stdin.buffer, sys.stdout.buffer, login_env(sys.argv[1] if len(sys.argv) > 1 else None))
    except (BrokenPipeError, KeyboardInterrupt):
        pass
