"""One SSH connection per host per command (executors/ssh_pool.py) and its command agent
(executors/command_agent.py, hostside/command_agent.py), against the test cluster's real sshd hosts."""
from __future__ import annotations

import subprocess
import threading
import time

import pytest

from orchestrator.executors import command_agent, ssh_pool
from orchestrator.executors.ssh import SSHError, SSHTimeout
from orchestrator.executors.ssh_pool import shared_connections

pytestmark = pytest.mark.cluster


def test_a_scope_hands_out_one_connection_per_host(cluster):
    a, b = cluster.hosts[0], cluster.hosts[1]
    with shared_connections() as pool:
        s1, s2 = cluster.ssh_target(a).connect(), cluster.ssh_target(a).connect()
        assert s1 is s2
        assert cluster.ssh_target(b).connect() is not s1
        s1.close()                                   # a no-op on a shared session
        assert s1.run(["true"], timeout=20).rc == 0
        results = []
        threads = [threading.Thread(target=lambda: results.append(cluster.ssh_target(a).run(["echo", "x"])))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.stdout for r in results] == ["x\n"] * 6
        assert pool.opened == 2
    assert not s1.transport.is_active()              # the scope closed it
    fresh = cluster.ssh_target(a).connect()          # outside a scope: a connection of its own
    try:
        assert fresh is not s1 and not fresh.shared
    finally:
        fresh.close()


def test_the_agent_runs_commands_as_sshd_would(cluster):
    h = cluster.hosts[0]
    probe = ["sh", "-c", 'echo "$PATH|$HOME|$(id -u)|$1"; cat; echo err >&2; exit 3', "sh", "it's $x"]
    direct = cluster.ssh_target(h).run(probe, timeout=20, stdin="from stdin\n")
    with shared_connections():
        s = cluster.ssh_target(h).connect()
        via = s.run(probe, timeout=20, stdin="from stdin\n")
        assert s.runner is not None and s.runner.idle, "the command did not go through an agent"
        env = s.run("echo $DCTL_X", timeout=20, env={"DCTL_X": "a b"})
    assert (via.rc, via.stdout, via.stderr) == (direct.rc, direct.stdout, direct.stderr) == (
        3, direct.stdout.split("\n")[0] + "\nfrom stdin\n", "err\n")
    assert direct.stdout.endswith("|it's $x\nfrom stdin\n")
    assert env.stdout == "a b\n"


def test_a_command_past_its_timeout_is_killed_with_what_it_started(cluster):
    h = cluster.hosts[1]
    marker = "3141.5926"
    with shared_connections():
        s = cluster.ssh_target(h).connect()
        t0 = time.monotonic()
        with pytest.raises(SSHTimeout) as e:
            s.run(["sh", "-c", f"echo started; sleep {marker} & sleep {marker}"], timeout=1.5)
        assert time.monotonic() - t0 < 6
        assert h.name in str(e.value) and "timed out after 1.5s" in str(e.value) and "started" in str(e.value)
        assert s.run(["echo", "still usable"], timeout=20).stdout == "still usable\n"
    left = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert left.stdout == "", f"the timed-out command's processes survived: {left.stdout}"


def test_a_host_without_the_agent_gets_a_channel_per_command(cluster, monkeypatch):
    monkeypatch.setattr(command_agent, "SOURCE", "import sys; sys.exit(127)")   # as if no python3
    with shared_connections():
        s = cluster.ssh_target(cluster.hosts[2]).connect()
        assert s.run(["echo", "fallback"], timeout=20).stdout == "fallback\n"
        assert s.runner is not None and s.runner.unavailable
        assert s.run(["sh", "-c", "exit 4"], timeout=20).rc == 4


def test_more_streams_than_sshd_allows_per_connection_open_another(cluster):
    h = cluster.hosts[3]
    n = ssh_pool.CHANNELS_PER_CONNECTION + 3
    with shared_connections() as pool:
        execs = [cluster.ssh_target(h).connect().open_exec(["cat"]) for _ in range(n)]
        try:
            for i, ex in enumerate(execs):
                ex.write(f"stream {i}\n".encode())
            outs = [ex.finish(timeout=20).stdout for ex in execs]
        finally:
            for ex in execs:
                ex.ch.close()
        assert outs == [f"stream {i}\n" for i in range(n)]
        assert pool.opened == 2


def test_a_connection_lost_mid_scope_is_replaced(cluster):
    h = cluster.hosts[3]
    with shared_connections() as pool:
        s = cluster.ssh_target(h).connect()
        assert s.run(["true"], timeout=20).rc == 0
        s.transport.close()                          # as when the host's sshd went away
        with pytest.raises(SSHError) as e:
            s.run(["true"], timeout=5)
        assert h.name in str(e.value)
        again = cluster.ssh_target(h).connect()
        assert again is not s and again.run(["echo", "back"], timeout=20).stdout == "back\n"
        assert pool.opened == 2


def test_callers_wait_for_the_agent_being_started_and_a_lock_lives_in_it(cluster, monkeypatch):
    """The warm-up's agent serves the first command (one login per host, not one per caller), and
    the head lock taken in an agent (launch/lock.py) excludes flock(1) in any other process, lasts
    through other commands, and is let go by unlock or by the scope's end."""
    h = cluster.hosts[2]
    target = cluster.ssh_target(h)
    path = "/var/lock/deployctl-test-pool.lock"
    flock = ["flock", "-n", "-E", "75", path, "true"]
    starts = []

    class Counted(command_agent.CommandAgent):
        def __init__(self, session):
            starts.append(time.monotonic())
            super().__init__(session)
    monkeypatch.setattr(ssh_pool, "CommandAgent", Counted)
    with shared_connections() as pool:
        ssh_pool.warm_up([target])
        time.sleep(0.05)                                                   # the warm-up is starting it
        assert target.run(["echo", "y"]).stdout == "y\n"
        assert len(starts) == 1 and pool.opened == 1, starts
        agents = target.connect().runner
        assert agents.lock(path, "test pool holder", 20).rc == 0
        refused = target.run(flock, timeout=20)                            # another process: refused
        busy = [threading.Thread(target=lambda: target.run(["sleep", "0.3"])) for _ in range(3)]
        for t in busy:
            t.start()
        for t in busy:
            t.join()
        assert target.run(["cat", path]).stdout == "test pool holder\n"
        still = target.run(flock, timeout=20)                              # the holder was not closed
        agents.unlock(path)
        freed = target.run(flock, timeout=20)
        assert agents.lock(path, "held to the end", 20).rc == 0
    after = cluster.ssh_target(h).run(flock, timeout=20)
    assert (refused.rc, still.rc, freed.rc, after.rc) == (75, 75, 0, 0), (refused, still, freed, after)
