"""The rsync the head runs to push files to one worker: its argv (pure), progress and stats parsing,
and what its exit codes mean. Nothing here touches a host.

Choices (and why):
- Runs ON THE HEAD (`ssh head rsync ... root@WORKER:DST/`): the bytes go head -> worker over the
  cluster network, never through the laptop. The head authenticates to the worker with KEY and
  checks the worker's host key against KNOWN_HOSTS; on the test cluster these are the inventory's
  own files (every test host shares this machine's filesystem). A real cluster needs, ON THE HEAD,
  a key whose public half is in each worker's authorized_keys and a known_hosts file with the
  workers' host keys for the addresses in the inventory (`ssh-keyscan ADDR >> FILE` on the head,
  fingerprints checked): pass them with `--head-key` / `--head-known-hosts`.
- `--files-from=- --from0 --ignore-times`: the controller already knows, by sha256, exactly which
  files differ; rsync gets only those and never trusts its own size+mtime quick check for them (a
  corrupted file of the right size and mtime is still re-sent). The delta algorithm stays on, so a
  file with a few bad blocks costs those blocks, and a partial file is a basis for the rest.
- `--copy-links`: dereference. An HF snapshot is symlinks into ../../blobs; the worker gets regular
  files in snapshots/REV, which is all the engine sees (only that folder is mounted into the
  container, so relative links into ../../blobs would dangle there anyway). The head's manifest is
  of the dereferenced content, so head (links) and worker (files) compare equal.
- `--partial-dir=.deployctl-rsync-partial` (not --inplace, not bare --partial): an interrupted file
  is kept in that hidden folder and used as the basis on the next run (resume), while the real name
  only ever holds a complete file (rsync writes a temp file and renames it). --inplace would leave a
  half-written file under the real name; bare --partial would too. Names starting `.deployctl` are
  never listed by the manifest, so the folder is invisible to checks.
- `--timeout=IO`: no data either way for IO seconds (a cut link, a wedged worker) ends rsync with
  code 30 instead of a hang; `timeout -k 10 TOTAL` on the head bounds the whole transfer; ssh's
  ConnectTimeout/ServerAlive bound the connection.
- `--mkpath` creates the worker's checkpoint folder (rsync >= 3.2.3 on head and workers).
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from ..hostside.modelsync import PARTIAL_DIR    # one name for the host script and the argv
from ..signals import describe_exit


@dataclass(frozen=True)
class SshOptions:
    """How the head's ssh reaches a worker (for rsync -e)."""
    key_file: str | None              # None: the head's default keys (~/.ssh/id_*, agent)
    known_hosts_file: str | None      # None: the head's ~/.ssh/known_hosts
    check_host_keys: bool = True
    connect_timeout: float = 10.0


def ssh_command(port: int, o: SshOptions) -> list[str]:
    argv = ["ssh", "-p", str(port)]
    if o.key_file:
        argv += ["-i", o.key_file,
                 "-o", "IdentitiesOnly=yes"]              # only that key: no agent or id_* guesses
    if o.check_host_keys:
        if o.known_hosts_file:
            argv += ["-o", f"UserKnownHostsFile={o.known_hosts_file}"]
        argv += ["-o", "StrictHostKeyChecking=yes"]      # unknown or changed key: refuse, never add
    else:
        # inventory host_key_checking: false, the explicit opt-out: any key, remembered nowhere
        argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    argv += [
        "-o", "BatchMode=yes",                            # never prompt: a missing key fails, no hang
        "-o", f"ConnectTimeout={int(o.connect_timeout)}",  # a down worker fails in seconds
        "-o", "ServerAliveInterval=5",                    # a cut link ends the session in ~15 s
        "-o", "ServerAliveCountMax=3",
        "-o", "Compression=no",                           # safetensors do not compress; CPU is scarce
        "-o", "LogLevel=ERROR",                           # no "Permanently added" noise in the logs
    ]
    return argv


def rsync_argv(src: str, user: str, address: str, dst: str, port: int, ssh: SshOptions, *,
               io_timeout: float, total_timeout: float, bwlimit_mbps: float | None = None) -> list[str]:
    """The argv run on the head; the file list (NUL-separated) goes to its stdin."""
    argv = ["timeout", "-k", "10", str(int(total_timeout)),   # the whole transfer, bounded on the head
            "rsync",
            "--files-from=-", "--from0",       # exactly the files whose sha256 differs
            "--ignore-times",                  # ... and never skip one of them on size+mtime
            "--copy-links",                    # HF snapshot links -> regular files on the worker
            "--times", "--perms",              # keep mtimes (caches, rsync) and modes
            "--mkpath",                        # create the checkpoint folder on the worker
            f"--partial-dir={PARTIAL_DIR}",    # resumable; the real name holds only whole files
            f"--timeout={int(io_timeout)}",    # no data for this long: exit 30, no hang
            "--info=progress2,stats2",         # one overall progress line; stats for the report
            "--no-inc-recursive"]              # whole list known up front: progress2 % is total
    if bwlimit_mbps:
        argv.append(f"--bwlimit={int(bwlimit_mbps * 1000)}k")   # rsync's k = 1024 B; close enough
    argv += ["-e", " ".join(shlex.quote(a) for a in ssh_command(port, ssh)),
             src.rstrip("/") + "/", f"{user}@{address}:{dst.rstrip('/')}/"]
    return argv


# -- output ----------------------------------------------------------------------------------------

_PROGRESS = re.compile(r"^\s*([\d,]+)\s+(\d+)%\s+\S+/s\s+(\d+:\d\d:\d\d)")
_STAT = re.compile(r"^(Number of regular files transferred|Total transferred file size|Literal data|"
                   r"Matched data|Total bytes sent|Total bytes received):\s*([\d,]+)")
STAT_KEYS = {"Number of regular files transferred": "files_sent", "Total transferred file size": "bytes_sent",
             "Literal data": "literal_bytes", "Matched data": "matched_bytes",
             "Total bytes sent": "wire_bytes_sent", "Total bytes received": "wire_bytes_received"}


def parse_progress(line: str) -> tuple[int, int] | None:
    """`  80,000,003 100%   85.11MB/s    0:00:00 (xfr#3, to-chk=0/3)` -> (bytes, percent)."""
    m = _PROGRESS.match(line)
    return (int(m.group(1).replace(",", "")), int(m.group(2))) if m else None


def parse_stats(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        m = _STAT.match(line.strip())
        if m:
            out[STAT_KEYS[m.group(1)]] = int(m.group(2).replace(",", ""))
    return out


def explain(rc: int, stderr: str, worker: str, address: str, dst: str, io_timeout: float,
            total_timeout: float) -> str:
    """A sentence for an rsync failure: what happened and what to do."""
    low = stderr.lower()
    if "no space left on device" in low:
        return f"out of space on {worker}:{dst} (rsync exit {rc}); free space there and re-run (resumes)"
    if "host key verification failed" in low:
        return (f"the head does not know {worker}'s SSH host key for {address} (rsync exit {rc}): add it "
                f"to the head's known_hosts (ssh-keyscan {address}, fingerprint checked)")
    if "permission denied" in low and "publickey" in low:
        return (f"the head cannot log in to {worker} ({address}) with its key (rsync exit {rc}): add the "
                f"head's public key to {worker}'s authorized_keys, or pass --head-key")
    if rc == 124:
        return (f"the copy to {worker} did not finish within {total_timeout:g}s and was stopped; "
                f"re-run to resume (partial data kept in {PARTIAL_DIR})")
    # run over ssh under `timeout -k 10 TOTAL`: a KILL (the limit's, or the OOM killer's) is rc -1 there
    killed = describe_exit(rc, time_limit_s=total_timeout, ssh=True)
    if killed:
        return f"rsync to {worker} {killed}; re-run to resume (partial data kept in {PARTIAL_DIR})"
    if rc == 30 or "timeout" in low:
        return (f"no data moved to {worker} ({address}) for {io_timeout:g}s (link down or host wedged?), "
                f"rsync exit {rc}; re-run to resume (partial data kept in {PARTIAL_DIR})")
    if rc == 255 or "connection timed out" in low or "no route to host" in low:
        return f"the head cannot reach {worker} over SSH at {address} (rsync exit {rc})"
    if rc in (12, 10):
        return (f"the connection to {worker} ({address}) broke mid-copy (rsync exit {rc}); "
                f"re-run to resume (partial data kept in {PARTIAL_DIR})")
    if rc == 127:
        return "rsync is not installed on the head (apt-get install rsync)"
    return f"rsync to {worker} failed (exit {rc})"
