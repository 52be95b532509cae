"""This host's side of the supervisor (hostside/supervisor.py): its files, memory and disk, the masking of
secrets in kept log lines, its own rank (Local) and the log line format."""

from __future__ import annotations

import os
import re
import time
from typing import Any, Callable
from .supervisor_engine import Engine, PREVIOUS_SUFFIX, RankView, container_view




def read_file(path: str, default: str = "") -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return default


def mem_available_kib() -> int | None:
    for line in read_file("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return None


def disk_avail(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def masker(secrets: list[str]) -> Callable[[str], str]:
    """Secrets out of every line kept: the serving key's value and `--api-key X`-like arguments."""
    pat = re.compile(r"(?i)((?:api[-_]?key|token|secret|password)[\"']?\s*[=:]?\s*[\"']?)([^\s\"',]{6,})")
    values = [s for s in secrets if s]

    def mask(line: str) -> str:
        for v in values:
            line = line.replace(v, "***")
        return pat.sub(lambda m: m.group(1) + "***", line)
    return mask


class Local:
    """This host's rank: its container, memory, boot id."""

    def __init__(self, cfg: dict[str, Any], engine: Engine):
        self.cfg, self.engine = cfg, engine
        self.boot_id_file = cfg.get("boot_id_file") or "/proc/sys/kernel/random/boot_id"

    def generations(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The rank's container and the previous generation kept beside it (None: none)."""
        docs = [container_view(d) for d in self.engine.containers(self.cfg["deployment"])]
        prev = [c for c in docs if c["name"].endswith(PREVIOUS_SUFFIX)]
        docs = sorted((c for c in docs if c not in prev), key=lambda c: c["status"] == "running")   # running last
        return (docs[-1] if docs else None), (prev[0] if prev else None)

    def view(self, mask: Callable[[str], str]) -> RankView:
        c, prev = self.generations()
        tail = [mask(x) for x in self.engine.logs_tail(c["id"])] if c and c["status"] != "running" else []
        return RankView(self.cfg["host"], c, read_file(self.boot_id_file), mem_available_kib(), 0.0, tail,
                        disk_avail(self.cfg.get("disk_path") or "/state"), prev)

    def do(self, verb: str) -> str:
        c, prev = self.generations()
        if verb == "swap":          # the rollback: the kept generation takes the current one's place
            if prev is None:
                raise OSError(f"no previous generation of {self.cfg['deployment']} on {self.cfg['host']}")
            name = prev["name"][:-len(PREVIOUS_SUFFIX)]
            if c is not None:
                self.engine.remove(c["id"])
            self.engine.rename(prev["id"], name)
            return f"removed {c['name'] if c else 'nothing'}; {prev['name']} is {name} again"
        if c is None:
            raise OSError(f"no container of {self.cfg['deployment']} on {self.cfg['host']}")
        if verb == "stop":
            if c["status"] in ("running", "restarting", "paused"):
                self.engine.stop(c["id"], self.cfg["stop_timeout_s"])
            return f"stopped {c['name']}"
        if verb == "start":
            self.engine.start(c["id"])
            return f"started {c['name']}"
        raise ValueError(f"unknown order {verb!r}")


def log(msg: str) -> None:
    print(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + " " + msg, flush=True)
