"""hostside/command_agent.py on this machine (no SSH): its protocol, the shell path and the
`python3 -c` fork path behave as sshd plus a fresh interpreter would. tests/test_ssh_pool.py runs
it through real sshd hosts."""
from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.hostside import command_agent as agent

SOURCE = Path(agent.__file__).read_text()


class Agent:
    def __init__(self, env_arg: str = ""):
        # started the way executors/command_agent.py starts it: `python3 -c SOURCE ENV`
        self.p = subprocess.Popen([sys.executable, "-c", SOURCE, env_arg], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env={**os.environ, "SHELL": "/bin/sh"})
        assert self.read()["protocol"] == 1

    def read(self) -> dict:
        (n,) = struct.unpack(">Q", self.p.stdout.read(8))
        return json.loads(self.p.stdout.read(n))

    def call(self, cmd: str = "", argv: list[str] | None = None, stdin: bytes = b"", env=None,
             timeout: float = 10) -> dict:
        req = json.dumps({"cmd": cmd, "argv": argv, "stdin": base64.b64encode(stdin).decode(),
                          "env": env or {}, "timeout": timeout}).encode()
        self.p.stdin.write(struct.pack(">Q", len(req)) + req)
        self.p.stdin.flush()
        doc = self.read()
        for k in ("out", "err"):
            doc[k] = base64.b64decode(doc[k]).decode()
        return doc

    def close(self) -> int:
        self.p.stdin.close()
        return self.p.wait(timeout=10)


@pytest.fixture
def ag():
    a = Agent()
    yield a
    assert a.close() == 0, "EOF on stdin ends the agent"


def py(src: str, *args: str) -> list[str]:
    return ["python3", "-c", src, *args]


def test_shell_lines_run_like_sshd_runs_them(ag):
    r = ag.call("echo \"$1|$X\"; cat; echo e >&2; exit 7", stdin=b"in\n", env={"X": "a b"})
    assert (r["rc"], r["out"], r["err"]) == (7, "|a b\nin\n", "e\n")


def test_python_programs_run_in_a_fork_as_a_fresh_interpreter_would(ag):
    src = ("import sys, os\nprint(sys.argv, __name__, os.environ.get('X'), sys.stdin.read())\n"
           "print('to err', file=sys.stderr)\nsys.exit(int(sys.argv[1]))")
    r = ag.call(argv=py(src, "3", "two words"), stdin=b"data", env={"X": "y"})
    assert (r["rc"], r["out"], r["err"]) == (3, "['-c', '3', 'two words'] __main__ y data\n", "to err\n")
    r = ag.call(argv=py("raise ValueError('boom')"))
    assert r["rc"] == 1 and r["err"].splitlines()[-1] == "ValueError: boom"
    assert 'File "<string>", line 1' in r["err"] and "command_agent" not in r["err"], r["err"]
    r = ag.call(argv=py("import sys; sys.exit('a message')"))
    assert (r["rc"], r["err"]) == (1, "a message\n")
    r = ag.call(argv=py("def f(a: int): pass\nprint(f.__annotations__)"))   # no inherited __future__
    assert r["out"] == "{'a': <class 'int'>}\n"
    r = ag.call(argv=py("import sys; print('x'); sys.stdout.close()"))
    assert (r["rc"], r["out"]) == (0, "x\n")
    r = ag.call(argv=py("import sys; sys.stdout.write('y' * 500000)"))
    assert len(r["out"]) == 500000
    # a fresh interpreter each time: nothing one program sets is seen by the next
    ag.call(argv=py("import json; json.marker = 1"))
    assert ag.call(argv=py("import json; print(hasattr(json, 'marker'))"))["out"] == "False\n"
    # the same source again (compiled once by the agent) runs afresh with its own argv
    counter = "import sys; n = globals().get('n', 0) + 1; print(n, sys.argv[1:])"
    assert [ag.call(argv=py(counter, str(i)))["out"] for i in (1, 2)] == ["1 ['1']\n", "1 ['2']\n"]
    r = ag.call(argv=py("def f(:\n  pass"))                          # as the interpreter reports it
    assert r["rc"] == 1 and "SyntaxError" in r["err"] and "command_agent" not in r["err"], r["err"]


def test_what_runs_in_a_fork_and_what_does_not():
    assert agent.forkable_python(["python3", "-c", "pass"], {})
    assert agent.forkable_python([sys.executable, "-c", "pass"], {})        # this interpreter by path
    assert not agent.forkable_python(["/bin/true", "-c", "pass"], {})       # another program
    assert not agent.forkable_python(["python3", "-c", "pass"], {"PATH": "/x"})
    assert not agent.forkable_python(["python3", "-c", "pass"], {"PYTHONPATH": "/x"})
    assert not agent.forkable_python(["python3", "-m", "x"], {})
    assert not agent.forkable_python(["/usr/bin/env", "-c", "x"], {})
    assert not agent.forkable_python(None, {})


def test_a_timeout_kills_the_command_and_what_it_started(ag):
    marker = "2718.2818"
    for req in ({"cmd": f"sleep {marker} & sleep {marker}"},
                {"argv": py(f"import subprocess; subprocess.run(['sleep', '{marker}'])")}):
        t0 = time.monotonic()
        r = ag.call(timeout=1, **req)
        assert r.get("timeout") is True and time.monotonic() - t0 < 5, r
        left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout
        assert left == "", left
    assert ag.call("echo alive")["out"] == "alive\n"


def test_the_login_environment_is_what_commands_get():
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "SHLVL": "1", "_": "/usr/bin/env", "K": "v=w"}
    raw = base64.b64encode("\0".join(f"{k}={v}" for k, v in env.items()).encode()).decode()
    got = agent.login_env(raw)
    assert got == {"PATH": "/usr/bin:/bin", "HOME": "/root", "SHLVL": "1", "K": "v=w"}
    assert agent.login_env(base64.b64encode(b"SHLVL=0\0A=1").decode())["SHLVL"] == "1"   # no ~/.bashrc again
    assert agent.login_env("not base64!")["PATH"] == os.environ["PATH"]                 # its own, then
    a = Agent(raw)
    try:
        r = a.call("echo $K $SHLVL; command -v sh")
        assert r["out"].splitlines()[0] == "v=w 1" and r["out"].splitlines()[1] == shutil.which("sh", path=env["PATH"])
    finally:
        a.close()


def _lock(a: Agent, path: str, holder: str = "", unlock: bool = False, wait: float | None = None) -> dict:
    req = json.dumps({"unlock": path} if unlock else
                     {"lock": path, "holder": holder, **({"wait": wait} if wait is not None else {})}).encode()
    a.p.stdin.write(struct.pack(">Q", len(req)) + req)
    a.p.stdin.flush()
    doc = a.read()
    doc["out"] = base64.b64decode(doc.get("out", "")).decode()
    return doc


def _flock_rc(path: str) -> int:
    """What launch/lock.py's other path (and another deployctl) gets: `flock -n -E 75 PATH true`."""
    return subprocess.run(["flock", "-n", "-E", "75", path, "true"], timeout=10).returncode


def test_the_agents_lock_is_flocks_lock_and_ends_with_the_agent(tmp_path):
    path = str(tmp_path / "deployctl-x.lock")
    a, b = Agent(), Agent()
    try:
        assert _lock(a, path, "run A")["rc"] == 0
        assert Path(path).read_text() == "run A\n"                  # who holds it, for a refused run
        assert _flock_rc(path) == 75                               # flock(1) is refused...
        held = _lock(b, path, "run B")
        assert held["rc"] == 75 and held["out"] == "run A\n"       # ...and so is another agent, told who
        assert a.call("sleep 0.1; echo still")["out"] == "still\n"  # commands meanwhile: the lock stays
        assert a.call(argv=py("print('fork')"))["out"] == "fork\n"
        assert _flock_rc(path) == 75
        assert _lock(a, path, unlock=True)["rc"] == 0
        assert _flock_rc(path) == 0                                # unlock lets it go
        assert _lock(b, path, "run B")["rc"] == 0
    finally:
        assert b.close() == 0                                      # EOF: the agent ends, so does its lock
        a.close()
    assert _flock_rc(path) == 0
    # flock(1) holding it: the agent is refused
    with subprocess.Popen(["flock", path, "-c", "echo held; exec sleep 30"], stdout=subprocess.PIPE, text=True) as f:
        assert f.stdout.readline() == "held\n"
        c = Agent()
        try:
            assert _lock(c, path, "run C")["rc"] == 75
        finally:
            c.close()
            f.kill()


def test_a_lock_held_for_an_instant_is_waited_for_and_a_check_leaves_the_holder(tmp_path):
    """The head's supervisor checks the deployment's lock every tick by taking it for an instant
    (hostside/supervisor.py lock_busy): a run that asks meanwhile waits its grace and gets it (before,
    it was refused with an empty holder: "holder unknown"); the check never rewrites who held it last;
    a lock held past the grace is still refused, naming its holder."""
    from orchestrator.hostside.command_agent import drop_lock, take_lock
    path = str(tmp_path / "deployctl-y.lock")
    mine: dict[str, int] = {}
    assert take_lock(mine, path, "deployctl up by a run")["rc"] == 0
    drop_lock(mine, path)
    assert take_lock(mine, path, None)["rc"] == 0                  # the supervisor's check
    assert Path(path).read_text() == "deployctl up by a run\n", "a check leaves the file as it was"
    a = Agent()
    try:
        assert _lock(a, path, "run W")["rc"] == 75                 # no wait asked: refused at once
        threading.Timer(0.3, drop_lock, (mine, path)).start()      # the check lets go 0.3 s later
        t0 = time.monotonic()
        assert _lock(a, path, "run W", wait=2.0)["rc"] == 0
        assert 0.25 <= time.monotonic() - t0 < 2.0
        assert Path(path).read_text() == "run W\n"
        b = Agent()
        try:
            t0 = time.monotonic()
            held = _lock(b, path, "run X", wait=0.5)
            assert held["rc"] == 75 and held["out"] == "run W\n" and time.monotonic() - t0 >= 0.5
        finally:
            b.close()
    finally:
        a.close()
