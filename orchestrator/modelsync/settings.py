"""sync-model's knobs (from `deployctl sync-model` options; `up` uses the defaults) and its paths."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, fields
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..runoptions import RunOptions

MARGIN_BYTES = 1_000_000_000          # kept free on a worker's model filesystem beyond the copy
MIN_RATE = 20e6                       # B/s: the default whole-transfer timeout assumes at least this
HASH_RATE = 100e6                     # B/s: the default verify timeout assumes hashing at least this
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Settings:
    io_timeout: float = 60.0          # rsync --timeout: no data for this long = the worker is lost
    timeout: float | None = None      # whole transfer per worker; None: 300 s + bytes at MIN_RATE
    bwlimit_mbps: float | None = None  # MB/s per worker (leave room for other traffic on the link)
    rehash: bool = False              # ignore the hash caches (bit rot that kept size/mtime/ctime)
    head_key: str | None = None       # key ON THE HEAD for head -> worker ssh; default: inventory's
    head_known_hosts: str | None = None  # known_hosts ON THE HEAD; default: the inventory's
    connect_timeout: float = 10.0

    @classmethod
    def from_options(cls, options: "RunOptions") -> "Settings":
        """The command's sync-model flags over the defaults (a flag not given keeps the default)."""
        o = options.sync_model
        return cls(**{f.name: getattr(o, f.name) for f in fields(o) if getattr(o, f.name) is not None})

    def transfer_timeout(self, nbytes: int) -> float:
        return self.timeout or 300.0 + nbytes / MIN_RATE


def verify_timeout(nbytes: int) -> float:
    return 300.0 + nbytes / HASH_RATE


def cache_file(nvme_dir: str, checkpoint_dir: str) -> str:
    """The hash cache for one checkpoint folder on one host: in the host's nvme_dir (local, ours),
    not next to the checkpoint (an HF snapshots/ folder must hold only snapshot folders)."""
    key = hashlib.sha256(checkpoint_dir.encode()).hexdigest()[:16]
    return str(PurePosixPath(nvme_dir) / ".deployctl" / "modelsync" / f"{key}.json")


def revision_note(revision: str, checkpoint_dir: str, resolved: str = "") -> str:
    """How the plan shows the revision: a commit is pinned; a branch or tag name is not (RESOLVED:
    the commit this run resolved it to, modelfetch/resolve.py)."""
    if checkpoint_dir:
        return f"folder {checkpoint_dir} (revision {revision} as recorded in the recipe)"
    if COMMIT.match(revision):
        return f"revision {revision[:12]} (pinned commit)"
    if resolved and resolved != revision:
        return (f"revision {revision!r} = commit {resolved[:12]} for this run (NOT pinned: the branch may move; "
                f"pin model.revision to {resolved} for an exact checkpoint)")
    return (f"revision {revision!r} (NOT pinned: a branch or tag; pin model.revision to the commit "
            f"in the head's snapshots/ for an exact checkpoint)")
