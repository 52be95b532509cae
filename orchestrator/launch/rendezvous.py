"""Before a multi-node engine group starts: the head's rendezvous port is free and every worker can
reach it over the fabric.

vLLM's mp backend meets at the head's TCPStore (--master-addr:--master-port; torch.distributed,
vllm/distributed/parallel_state.py init_distributed_environment), which listens on every address
(seen with the released vLLM at TP=2: `*:<master port>`). Three failures of that meeting hang for
minutes with nothing named, or end with a cryptic torch error:
- the port is taken on the head (a head of another deployment, or one started by hand, still up): a
  new worker joins the stale store and fails with "DistNetworkError: Broken pipe" or hangs;
- the port is blocked between worker and head (a firewall dropping it): the worker's connect retries
  until torch's timeout;
- the master address is not the head's (no route, or another host's): likewise.
So after the old containers are gone and before any engine starts, the head listens on the port for
a few seconds (as the store will: every address) and each worker connects to the master address from
its own namespace, in parallel. Any problem fails the host it concerns, naming the address, the port,
what answered (or did not) and who holds the port; nothing has started yet.

The programs run on the hosts with python3 (standard library; through the host's command agent).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..outcomes import HostFailure, parallel

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..executors.shells import Shells

LISTEN_S = 6.0            # the head listens this long for the workers (they connect within CONNECT_S)
CONNECT_S = 4.0           # a worker retries a refused connection this long; a dropped SYN times out here
SSH_SLACK_S = 15.0

# argv[1] port, argv[2] how many workers, argv[3] seconds. Binds every address as the TCPStore does;
# EADDRINUSE names the listening process (its socket's inode in /proc/net/tcp*, then /proc/*/fd).
HEAD = r'''
import errno, json, os, socket, sys, time
port, want, wait = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def holder(port):
    inodes = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(f).read().splitlines()[1:]
        except OSError:
            continue
        for r in rows:
            p = r.split()
            if len(p) > 9 and p[3] == "0A" and int(p[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(p[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            for fd in fds:
                if os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                    return f"pid {pid}: {cmd.strip()[:160]}"
        except OSError:
            continue
    return "a process this host does not show" if inodes else ""
try:
    try:
        s = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False)
    except (OSError, ValueError) as e:
        if getattr(e, "errno", None) == errno.EADDRINUSE:
            raise
        s = socket.create_server(("", port))
except OSError as e:
    print(json.dumps({"bound": False, "error": os.strerror(e.errno) if e.errno else str(e), "holder": holder(port)}))
    sys.exit(0)
s.settimeout(0.2)
peers, end = [], time.monotonic() + wait
while len(peers) < want and time.monotonic() < end:
    try:
        c, a = s.accept()
    except socket.timeout:
        continue
    peers.append(a[0].removeprefix("::ffff:"))
    c.close()
s.close()
print(json.dumps({"bound": True, "peers": peers}))
'''

# argv[1] address, argv[2] port, argv[3] seconds: connect until accepted or the time is up.
WORKER = r'''
import json, os, socket, sys, time
addr, port, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end, last, tries = time.monotonic() + wait, "", 0
while True:
    tries += 1
    left = end - time.monotonic()
    if left <= 0:
        break
    try:
        with socket.create_connection((addr, port), timeout=max(0.2, left)) as c:
            print(json.dumps({"ok": True, "tries": tries, "source": c.getsockname()[0]}))
            sys.exit(0)
    except socket.timeout:
        last = "no answer (the connection attempt timed out: dropped on the way?)"
    except OSError as e:
        last = os.strerror(e.errno) if e.errno else str(e)
        time.sleep(0.2)
print(json.dumps({"ok": False, "tries": tries, "error": last}))
'''


@dataclass(frozen=True)
class Check:
    master: str
    port: int
    head: str
    workers: tuple[str, ...]

    def head_argv(self) -> list[str]:
        return ["python3", "-c", HEAD, str(self.port), str(len(self.workers)), str(LISTEN_S)]

    def worker_argv(self) -> list[str]:
        return ["python3", "-c", WORKER, self.master, str(self.port), str(CONNECT_S)]


def needed(dep: "Deployment") -> bool:
    """Only a vLLM group over several nodes meets at a TCPStore on the head."""
    return dep.recipe.engine.kind == "vllm" and dep.recipe.parallelism.nodes > 1


def check(dep: "Deployment", shells: "Shells", master: str) -> dict[str, BaseException]:
    """Host -> why it fails the rendezvous check (empty: every worker reached the head's port)."""
    c = Check(master, dep.recipe.engine.master_port, dep.cluster.head,
              tuple(h.name for h in dep.cluster.workers))
    where = f"{master}:{c.port}"

    def one(name: str) -> dict:
        argv = c.head_argv() if name == c.head else c.worker_argv()
        r = shells[name].run(argv, timeout=LISTEN_S + SSH_SLACK_S)
        if r.rc != 0:
            raise HostFailure(f"the rendezvous check could not run here (python3 exit {r.rc}): "
                              f"{r.stderr.strip()[-300:]}", rc=r.rc)
        return json.loads(r.stdout.strip().splitlines()[-1])
    res = parallel([c.head, *c.workers], one)
    bad: dict[str, BaseException] = dict(res.failed)
    head = res.ok.get(c.head)
    if head is not None and not head["bound"]:
        who = f" by {head['holder']}" if head.get("holder") else ""
        bad[c.head] = HostFailure(
            f"the rendezvous port {c.port} (engine.master_port) is taken on {c.head}{who} ({head['error']}): "
            "an engine of another deployment, or one started by hand, is still up there; workers would join "
            "its store and fail (torch: DistNetworkError) or hang. Stop it, or give this deployment another "
            "engine.master_port")
    for w in c.workers:
        got = res.ok.get(w)
        if got is not None and not got["ok"] and (head is None or head["bound"]):
            bad[w] = HostFailure(
                f"cannot reach the head's rendezvous {where} over the fabric from {w}: {got['error']} "
                f"after {got['tries']} attempt(s) in {CONNECT_S:g}s; a firewall on the way or on {c.head} "
                f"(TCP port {c.port} must be open from the workers' fabric addresses), or {master} is not "
                f"{c.head}'s address. No engine was started")
    return bad
