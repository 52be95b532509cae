"""How a host-side process ended, in words: the signal that stopped it and its likely cause.

An exit code carries a signal in one of these ways:
- a shell (and so a command run over ssh, or by Ansible's shell module) reports 128+N;
- Python's subprocess (Ansible's command module, a local Popen) reports -N;
- coreutils `timeout` exits 124 when its time limit made it send TERM; after `-k GRACE` it sends KILL
  to the command and to itself, so a shell sees 137 and a subprocess parent -9;
- paramiko returns -1 when sshd reported the process's signal (`exit-signal`) instead of an exit
  status: paramiko does not pass the signal on, so only "a signal" is known.
A leaf: standard library only.
"""
from __future__ import annotations

import signal

# Why a process usually gets each signal, for an operator reading the failure.
CAUSES = {
    signal.SIGKILL: "likely the kernel's OOM killer (check `dmesg` on the host) or an operator's kill",
    signal.SIGTERM: "stopped by a TERM (shutdown or an operator)",
    signal.SIGINT: "interrupted (Ctrl-C or an operator)",
    signal.SIGHUP: "its session hung up (the SSH connection or terminal closed)",
    signal.SIGSEGV: "it crashed with a segmentation fault",
    signal.SIGBUS: "it crashed with a bus error (a mapped file shrank, or its disk failed)",
    signal.SIGABRT: "it aborted (a failed assertion or a fatal error in the program)",
    signal.SIGILL: "it crashed on an illegal instruction (built for another CPU?)",
    signal.SIGFPE: "it crashed on an arithmetic error",
    signal.SIGPIPE: "what it was writing to was closed (broken pipe)",
    signal.SIGXCPU: "it ran past its CPU-time limit (ulimit -t)",
    signal.SIGXFSZ: "it wrote past its file-size limit (ulimit -f)",
}
TIMEOUT_RC = 124                          # coreutils `timeout`: the limit passed, TERM was sent


def signal_of(rc: int | None) -> signal.Signals | None:
    """The signal RC says killed the process (128+N or -N), or None for an ordinary exit."""
    if rc is None or rc == 0:
        return None
    n = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    try:
        return signal.Signals(n) if n > 0 else None
    except ValueError:
        return None


def _secs(s: float) -> str:
    return f"{int(s)}" if float(s).is_integer() else f"{s:.1f}"


def describe_exit(rc: int | None, *, time_limit_s: float | None = None, ssh: bool = False) -> str | None:
    """How a process with exit code RC was stopped, or None when RC is an ordinary exit code.

    TIME_LIMIT_S: the command ran under coreutils `timeout` with this limit (124 and a KILL then
    mean the limit). SSH: RC came from paramiko, whose -1 means "killed by some signal".
    """
    if rc is None:
        return None
    limit = f"{_secs(time_limit_s)} s" if time_limit_s is not None else None
    if limit and rc == TIMEOUT_RC:
        return f"did not finish within {limit} on the host and was killed by `timeout` (SIGTERM, rc 124)"
    if ssh and rc == -1:
        why = (f"its time limit ({limit}, then `timeout -k`) if it ran that long, else likely the kernel's "
               f"OOM killer (check `dmesg` on the host)") if limit else CAUSES[signal.SIGKILL]
        return (f"was killed by a signal or lost its connection (SSH gave no exit status, rc -1): "
                f"if killed, {why}")
    sig = signal_of(rc)
    if sig is None:
        return None
    head = f"was killed by {sig.name} (rc {rc})"
    if sig == signal.SIGKILL and limit:
        return (f"{head}: its time limit of {limit} passed and `timeout -k` killed it (if it ended "
                f"sooner: the kernel's OOM killer, check `dmesg` on the host)")
    cause = CAUSES.get(sig)
    return f"{head}: {cause}" if cause else head


def exit_text(rc: int | None, **kw: object) -> str:
    """`exited 3`, or how the process was killed (describe_exit)."""
    return describe_exit(rc, **kw) or f"exited {rc}"        # type: ignore[arg-type]
