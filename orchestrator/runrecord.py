"""Run records: every `up` (and every stage command) writes runs/<run-id>/.

  plan.json        the plan as planned (secrets masked)
  events.jsonl     one JSON object a line: stage and action starts and ends
  logs/<host>/<stage>.log   everything a host printed for a stage
  status.json      the final status, written last (atomically)

Everything written here goes through secrets.py: mask_data for the JSON documents and events,
mask_text for log lines and progress. The secret values are looked up at each write (secrets=None), so
a secret registered during the run (launch's expanded ${VAR}s) is masked from then on.
"""
from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError
from .fsutil import atomic_write_text
from .runoptions import RunOptions, RunState
from .secrets import mask_data, mask_text

TAIL_LINES = 20


class HostLog:
    """A per-(host, stage) log file that masks secrets and keeps the last lines for errors."""

    def __init__(self, path: Path, secrets: list[str] | None = None, echo=None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "a", buffering=1)
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._secrets = secrets
        self._echo = echo
        self._lock = threading.Lock()

    def write(self, text: str) -> None:
        text = mask_text(text, self._secrets)
        with self._lock:
            for line in text.splitlines() or [""]:
                self._tail.append(line)
                self._f.write(line + "\n")
                if self._echo:
                    self._echo(line)

    def tail(self, n: int = TAIL_LINES) -> list[str]:
        with self._lock:
            return list(self._tail)[-n:]

    def close(self) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.close()


@dataclass
class RunContext:
    """What a stage's apply needs from the run: logs, events, cancellation, options (the command's,
    frozen) and state (what a stage hands to a later one)."""
    run_dir: Path
    verbose: int = 0
    quiet: bool = False
    options: RunOptions = field(default_factory=RunOptions)
    state: RunState = field(default_factory=RunState)
    cancel: threading.Event = field(default_factory=threading.Event)
    console: Any = None                   # rich Console for progress, None when --json
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _secrets: list[str] | None = None     # None: the secrets known at each write (secrets.secret_values)

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._events = open(self.run_dir / "events.jsonl", "a", buffering=1)

    def log_path(self, host: str, stage: str) -> Path:
        return self.run_dir / "logs" / host / f"{stage}.log"

    def host_log(self, host: str, stage: str) -> HostLog:
        echo = None
        if self.verbose and self.console is not None:
            echo = lambda line, h=host: self.console.print(f"[dim]{h}[/dim] {line}", markup=True,
                                                           highlight=False)
        return HostLog(self.log_path(host, stage), self._secrets, echo)

    def event(self, kind: str, **data: Any) -> None:
        rec = mask_data({"t": round(time.time(), 3), "event": kind, **data}, self._secrets)
        with self._lock:
            self._events.write(json.dumps(rec, default=str) + "\n")

    def say(self, text: str) -> None:
        """A progress line for people (stderr), unless --quiet or --json."""
        if self.console is not None and not self.quiet:
            self.console.print(mask_text(text, self._secrets), highlight=False)

    def write_json(self, name: str, doc: Any) -> Path:
        p = self.run_dir / name
        atomic_write_text(p, json.dumps(mask_data(doc, self._secrets), indent=2, default=str) + "\n")
        return p

    def close(self) -> None:
        self._events.close()


def new_run_dir(root: str | Path, deployment: str, command: str) -> Path:
    """A new folder runs/<stamp>-<deployment>-<command>[-N], always directly inside ROOT."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    leaf = f"{stamp}-{deployment}-{command}"
    # The inventory's name rule (checks.name) already refuses these; a name that slips through by
    # another way must still never put a run record (or anything a stage writes there) elsewhere.
    if "/" in leaf or "\\" in leaf or "\0" in leaf or ".." in leaf:
        raise InputError(f"deployment {deployment!r}: a run record's folder name must not contain "
                         "'/', '..' or NUL", key="all.vars.deployment")
    base = Path(root) / leaf
    p, i = base, 1
    while p.exists():
        i += 1
        p = Path(f"{base}-{i}")
    p.mkdir(parents=True)
    return p
