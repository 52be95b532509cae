"""The checkpoint a run uses, as resolved before planning (resolve.py): a value the Deployment carries."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Resolved:
    """The checkpoint a run uses: the commit (snapshots/<commit>) and, when known, its files."""
    commit: str
    revision: str
    source: str                                  # hub | cache (refs/ and the state file) | pinned (taken as written, not asked)
    files: tuple[dict[str, Any], ...] = ()       # name, size, blob_id, sha256 (LFS files)
    offline: str = ""                            # why the Hub was not reachable (the cache was used)
    check: dict[str, Any] = field(default_factory=dict)   # hubfetch `check` on the head
    uid: int = 0
    gid: int = 0

    @property
    def total(self) -> int:
        return sum(int(f["size"]) for f in self.files)

    @property
    def pinned(self) -> bool:
        return bool(COMMIT.match(self.revision))

    @property
    def up_to_date(self) -> bool:
        return bool(self.check.get("up_to_date"))

    def hub_sha256(self) -> dict[str, str]:
        """The Hub's sha256 per LFS file: what sync-model's manifest must agree with."""
        return {f["name"]: f["sha256"] for f in self.files if f.get("sha256")}

    def to_json(self) -> dict[str, Any]:
        return {"commit": self.commit, "revision": self.revision, "pinned": self.pinned, "source": self.source,
                "files": len(self.files), "bytes": self.total, "offline": self.offline,
                "up_to_date": self.up_to_date}
