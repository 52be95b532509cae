"""The head's manifest and a node's verdict against it (controller side, pure).

A manifest is what the head's checkpoint folder holds: (relative path, size, sha256) per file, links
followed. A verdict is what `hostside.py verify` found on a node: which files are missing or differ
(size, then sha256), extra files, free space where they would go, the mount holding the folder.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

Entry = tuple[str, int, str]            # relative path, size, sha256


def gb(n: float) -> str:
    """Decimal GB, as the recipes and df speak; small amounts keep two decimals."""
    return f"{n / 1e9:.2f} GB"


@dataclass(frozen=True)
class Manifest:
    root: str
    files: tuple[Entry, ...]
    hashed_bytes: int = 0               # how much the head had to (re)hash for it; 0 = all from cache
    seconds: float = 0.0

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Manifest":
        return cls(doc["root"], tuple((str(p), int(s), str(h)) for p, s, h in doc["files"]),
                   int(doc.get("hashed_bytes", 0)), float(doc.get("seconds", 0.0)))

    @property
    def total_bytes(self) -> int:
        return sum(s for _, s, _ in self.files)

    @property
    def digest(self) -> str:
        """Identity of the content (paths, sizes, hashes): equal digests, equal checkpoints."""
        blob = json.dumps(self.files, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def size_of(self, rel: str) -> int:
        return next(s for p, s, _ in self.files if p == rel)

    def to_stdin(self, seen: dict | None = None, partial: dict | None = None) -> bytes:
        """What `hostside.py verify` reads. SEEN: hash-cache entries for files a chain node hashed as it
        wrote them (modelsync/chained.py), so the verify after the copy does not read them again.
        PARTIAL: rel -> the byte ranges this node keeps of it (modelsync/rows.py)."""
        return json.dumps({"files": self.files, **({"seen": seen} if seen else {}),
                           **({"partial": partial} if partial else {})}, separators=(",", ":")).encode()

    def describe(self) -> str:
        return f"{len(self.files)} files, {gb(self.total_bytes)}"


@dataclass(frozen=True)
class Verdict:
    root: str
    exists: bool
    missing: tuple[str, ...]
    differ: tuple[tuple[str, str], ...]  # (path, why)
    ok: int
    extra: tuple[str, ...]
    avail_path: str
    avail_bytes: int
    mount: dict[str, Any] = field(default_factory=dict)
    marker: str | None = None
    rsync: str | None = None
    hashed_bytes: int = 0
    seconds: float = 0.0

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> "Verdict":
        return cls(doc["root"], bool(doc["exists"]), tuple(doc["missing"]),
                   tuple((p, why) for p, why in doc["differ"]), int(doc["ok"]), tuple(doc["extra"]),
                   doc["avail_path"], int(doc["avail_bytes"]), doc.get("mount") or {}, doc.get("marker"),
                   doc.get("rsync"), int(doc.get("hashed_bytes", 0)), float(doc.get("seconds", 0.0)))

    @property
    def complete(self) -> bool:
        return not self.missing and not self.differ

    def to_send(self, manifest: Manifest) -> list[str]:
        """The files that are not exactly the head's, in manifest order."""
        bad = set(self.missing) | {p for p, _ in self.differ}
        return [p for p, _, _ in manifest.files if p in bad]

    def bytes_to_send(self, manifest: Manifest) -> int:
        return sum(manifest.size_of(p) for p in self.to_send(manifest))

    def problems(self, limit: int = 3) -> str:
        """`2 missing (a, b), 1 differs (c: sha256 ...)`, for messages."""
        parts = []
        if self.missing:
            more = f", +{len(self.missing) - limit} more" if len(self.missing) > limit else ""
            parts.append(f"{len(self.missing)} missing ({', '.join(self.missing[:limit])}{more})")
        if self.differ:
            shown = "; ".join(f"{p}: {why}" for p, why in self.differ[:limit])
            more = f"; +{len(self.differ) - limit} more" if len(self.differ) > limit else ""
            parts.append(f"{len(self.differ)} differ ({shown}{more})")
        return ", ".join(parts) or "none"
