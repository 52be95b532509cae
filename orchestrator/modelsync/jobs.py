"""What sync-model runs on each host, as planned: the jobs the stage's actions carry and `apply` executes.

Pure (no host is touched here). The plan builds one `SyncJob` per host from the deployment and the
command's settings; push.py and shared.py run exactly these commands. What only the run can know is a
parameter of the job, not a recomputation: the bytes still to send (they bound rsync's whole-transfer
timeout) and, with `source: shared`, the fresh marker nonce.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..hostside.modelsync import BOOTSTRAP
from . import rows
from .rsync import SshOptions, rsync_argv
from .settings import Settings, cache_file

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..inventory import Host

NONCE = "NONCE"          # how a plan shows the marker nonce `source: shared` draws at run time
MARKER = ".deployctl-shared-marker"   # the marker file `source: shared` writes on the head


@dataclass(frozen=True)
class HostsideOp:
    """One operation of hostside/modelsync.py on a host: `python3 -c BOOTSTRAP N OP ARGS...`, the script
    itself on stdin (nothing is installed on the host)."""
    op: str                              # manifest | verify | unmark
    args: tuple[str, ...]

    def with_marker_value(self, value: str) -> "HostsideOp":
        """The op with the planned `--marker NAME=NONCE` given its run-time value."""
        return replace(self, args=tuple(a.replace("=" + NONCE, "=" + value) if a.endswith("=" + NONCE) else a
                                        for a in self.args))

    def shown(self, host: "Host") -> tuple[str, ...]:
        """The command as the plan shows it (the script's length stands in for N)."""
        return ("ssh", f"{host.user}@{host.address}", "python3", "-c", BOOTSTRAP, "<len(hostside/modelsync.py)>",
                self.op, *self.args)


@dataclass(frozen=True)
class Transfer:
    """The rsync the head runs to one worker (rsync.py has the why of every flag)."""
    src: str
    user: str
    address: str
    dst: str
    port: int
    ssh: SshOptions
    io_timeout: float
    timeout: float | None                # whole transfer; None: from the bytes to send (Settings)
    bwlimit_mbps: float | None

    def total_timeout(self, nbytes: int) -> float:
        return Settings(timeout=self.timeout).transfer_timeout(nbytes)

    def argv(self, nbytes: int) -> list[str]:
        """The argv for sending NBYTES (the differing files' paths go to its stdin)."""
        return rsync_argv(self.src, self.user, self.address, self.dst, self.port, self.ssh,
                          io_timeout=self.io_timeout, total_timeout=self.total_timeout(nbytes),
                          bwlimit_mbps=self.bwlimit_mbps)


@dataclass(frozen=True)
class SyncJob:
    """One host's part: CHECK (the head's manifest, or a worker's verify); for a worker that gets a
    copy, the TRANSFER run on the head and AFTER (verify again, dropping rsync's leftovers)."""
    check: HostsideOp
    transfer: Transfer | None = None
    after: HostsideOp | None = None


def ssh_options(dep: "Deployment", worker: "Host", st: Settings) -> SshOptions:
    """How the head's ssh reaches WORKER (the head's key and known_hosts: --head-key, else the inventory's)."""
    c = dep.cluster
    return SshOptions(key_file=st.head_key or worker.key_file,
                      known_hosts_file=st.head_known_hosts or c.known_hosts_file,
                      check_host_keys=c.host_key_checking, connect_timeout=st.connect_timeout)


def _root_args(host: "Host", root: str) -> tuple[str, ...]:
    return ("--root", root, "--cache", cache_file(host.nvme_dir, root))


def head_job(dep: "Deployment", st: Settings, marker: str = "") -> SyncJob:
    """The head's manifest. With `source: head` and direct distribution it also proves the head can read
    the key and known_hosts files its rsync will use (--require); MARKER: `NAME=NONCE` for `source: shared`."""
    head = dep.cluster.head_host
    args = _root_args(head, dep.checkpoint_dir(head))
    if not marker and dep.cluster.distribution == "direct":
        opts = [ssh_options(dep, w, st) for w in dep.cluster.workers]
        args += tuple(a for p in sorted({p for o in opts for p in (o.key_file, o.known_hosts_file) if p})
                      for a in ("--require", p))
    args += ("--rehash",) if st.rehash else ()
    args += ("--marker", marker) if marker else ()
    if not marker and rows.applies(dep):    # where the Engram rows are: what each rank keeps (rows.py)
        args += tuple(a for name in rows.tensor_names(dep) for a in ("--tensor", name))
    return SyncJob(HostsideOp("manifest", args))


def push_job(dep: "Deployment", worker: "Host", st: Settings) -> SyncJob:
    """`source: head`: verify the worker against the head's manifest, rsync what differs, verify again."""
    root = dep.checkpoint_dir(worker)
    transfer = Transfer(dep.checkpoint_dir(dep.cluster.head_host), worker.user, worker.address, root, worker.port,
                        ssh_options(dep, worker, st), st.io_timeout, st.timeout, st.bwlimit_mbps)
    return _verified(worker, root, st, transfer)


def chain_job(dep: "Deployment", worker: "Host", st: Settings) -> SyncJob:
    """`distribution: chain`: verify the worker, receive what it lacks through the chain (chained.py), verify
    again dropping the chain's partial folder. No transfer command: the chain is one run for all workers."""
    return _verified(worker, dep.checkpoint_dir(worker), st, None)


def _verified(worker: "Host", root: str, st: Settings, transfer: Transfer | None) -> SyncJob:
    """A worker's verify before its copy and after it (the second drops the copy's leftovers)."""
    rehash = ("--rehash",) if st.rehash else ()
    return SyncJob(HostsideOp("verify", _root_args(worker, root) + rehash), transfer,
                   HostsideOp("verify", _root_args(worker, root) + ("--clean",) + rehash))


def shared_job(dep: "Deployment", worker: "Host", marker: str) -> SyncJob:
    """`source: shared`: the worker sees every file with its size and the head's marker; copies nothing."""
    return SyncJob(HostsideOp("verify", _root_args(worker, dep.checkpoint_dir(worker))
                              + ("--sizes-only", "--marker", marker)))
