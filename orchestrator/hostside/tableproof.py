"""Proof that staged table files still hold what their manifests say, cheap enough to run on every
`up` and `launch` (docs/table-proof.md has the numbers). Standard library only.

Two checks per file, against what the writer recorded when it wrote the file:
- its stat stamp (size, inode, mtime, ctime). Any change means someone touched the file since:
  every chunk of it is re-hashed (the full check). ctime cannot be set back from user space, so
  an in-place write whose mtime was restored by hand is still seen here;
- otherwise a window of its chunks, within a byte budget shared by every file of the stage
  (SAMPLE_BYTES): what catches damage the filesystem does not see (a bad sector, bit rot, a write
  below the filesystem). The window moves on with every run (its start is kept in a small state
  file beside the tables), so N chunks are all re-hashed within ceil(N / k) runs: a damaged chunk
  is found within that many runs for certain, not just with a probability.
A file whose stamp changed but whose every chunk still matches is fine: the caller records the new
stamp (`refreshed`) so the next run samples again.
"""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_text
from . import bulkcopy

SAMPLE_BYTES = 2 << 30      # per stage and host: well under a second of reads on a Spark's NVMe, hashed in parallel
STATE_SUFFIX = ".deployctl-proof.json"
STATE_NAME = STATE_SUFFIX                # the window's start, beside the tables (a folder's; PLE: one per table)
STAMP_FIELDS = ("size", "ino", "mtime_ns", "ctime_ns")


def stamp(path: str | Path) -> dict[str, int]:
    st = os.stat(path)
    return {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def stamp_change(path: str | Path, recorded: dict[str, Any] | None) -> str | None:
    """What changed since RECORDED ("size", "inode and mtime", ...), None when nothing did."""
    if not recorded:
        return "no stat recorded (an older manifest)"
    now = stamp(path)
    names = {"ino": "inode", "mtime_ns": "mtime", "ctime_ns": "ctime", "size": "size"}
    diff = [names[k] for k in STAMP_FIELDS if recorded.get(k) is not None and recorded.get(k) != now[k]]
    missing = [k for k in STAMP_FIELDS if recorded.get(k) is None]
    if diff:
        return " and ".join(diff) + " changed"
    return "no " + ", ".join(names[k] for k in missing) + " recorded" if missing else None


@dataclass(frozen=True)
class TableFile:
    """One file to prove: its byte ranges (the ones the chunk hashes cover) and the recorded hashes."""
    path: str
    spans: tuple[tuple[int, int], ...]
    chunk_bytes: int
    sha256: tuple[str, ...]
    recorded_stamp: dict[str, Any] | None = None


@dataclass
class Proof:
    files: int = 0
    chunks: int = 0                      # chunks hashed
    total_chunks: int = 0
    bytes: int = 0                       # bytes hashed
    full: list[str] = field(default_factory=list)        # files checked in full, with why
    refreshed: dict[str, dict[str, int]] = field(default_factory=dict)   # path -> new stamp (all chunks equal)
    bad: list[str] = field(default_factory=list)         # "path chunk i (bytes a..b)"
    refused: list[str] = field(default_factory=list)     # files this proof cannot vouch for and a
                                                         # restage would not repair (a linked shard written since)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.bad and not self.refused

    def summary(self) -> str:
        what = (f"{self.chunks} of {self.total_chunks} chunks ({self.bytes / 1e9:.3g} GB) re-hashed in "
                f"{self.seconds:.2f} s" + (": equal" if self.ok else ""))
        if self.full:
            what += f"; checked in full: {'; '.join(self.full[:3])}"
        return what

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "chunks": self.chunks, "total_chunks": self.total_chunks,
                "bytes": self.bytes, "full": self.full, "bad": self.bad, "refused": self.refused,
                "seconds": round(self.seconds, 3)}


def chunk_count(f: TableFile) -> int:
    return len(f.sha256)


def prove(files: list[TableFile], sample_bytes: int | None = None, rng: random.Random | None = None,
          workers: int | None = None, full_check: bool = False, state: Path | None = None) -> Proof:
    """Full check of every file whose stamp changed (of every file with FULL_CHECK: --verify), a
    sample of the others' chunks (at most SAMPLE_BYTES in all, at least one chunk): the window
    that starts where STATE says the last run stopped (then STATE moves it on), or a random one
    without STATE. Reads from the disk: cached pages are dropped first."""
    t0, rng = time.monotonic(), rng or random.Random()
    sample_bytes = SAMPLE_BYTES if sample_bytes is None else sample_bytes
    out = Proof(files=len(files), total_chunks=sum(chunk_count(f) for f in files))
    full: dict[str, str] = {}
    for f in files:
        why = "--verify" if full_check else stamp_change(f.path, f.recorded_stamp)
        if why:
            full[f.path] = why
    pool = [(f.path, i) for f in files if f.path not in full for i in range(chunk_count(f))]
    k = min(len(pool), max(1, sample_bytes // max(1, min((f.chunk_bytes for f in files), default=1))))
    picked: dict[str, set[int]] = {}
    for path, i in _window(pool, k, state, rng):
        picked.setdefault(path, set()).add(i)
    for f in files:
        only = None if f.path in full else picked.get(f.path)
        if f.path not in full and not only:
            continue
        got = _hash(f, only, workers)
        for i, h in got.items():
            if i >= len(f.sha256) or h != f.sha256[i]:
                out.bad.append(f"{f.path} chunk {i} ({where(f.spans, i, f.chunk_bytes)})")
        if only is None and len(got) != len(f.sha256):
            out.bad.append(f"{f.path}: {len(got)} chunks hashed, the manifest lists {len(f.sha256)}")
        out.chunks += len(got)
        total = sum(n for _, n in f.spans)
        out.bytes += sum(max(0, min(f.chunk_bytes, total - i * f.chunk_bytes)) for i in got)
        if f.path in full:
            if not full_check:           # --verify checks every file in full: no need to say so per file
                out.full.append(f"{Path(f.path).name}: {full[f.path]}")
            if not any(b.startswith(f.path + " ") or b.startswith(f.path + ":") for b in out.bad):
                out.refreshed[f.path] = stamp(f.path)
    out.seconds = time.monotonic() - t0
    return out


def _window(pool: list[tuple[str, int]], k: int, state: Path | None,
            rng: random.Random) -> list[tuple[str, int]]:
    """K chunks of POOL: from the start STATE records (a random start the first time), wrapping."""
    if not pool:
        return []
    if state is None:
        return rng.sample(pool, k)
    try:
        start = int(json.loads(state.read_text())["next"]) % len(pool)
    except (OSError, ValueError, KeyError, TypeError):
        start = rng.randrange(len(pool))
    try:
        atomic_write_text(state, json.dumps({"next": (start + k) % len(pool), "chunks": len(pool)}) + "\n")
    except OSError:
        pass            # a read-only folder: the next run starts at a random place instead
    return [pool[(start + j) % len(pool)] for j in range(k)]


def _hash(f: TableFile, only: set[int] | None, workers: int | None) -> dict[int, str]:
    fd = os.open(f.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)      # the disk's bytes, not a cached copy
        return dict(bulkcopy.hash_chunks(fd, list(f.spans), f.chunk_bytes, workers=workers, only=only))
    finally:
        os.close(fd)


def where(spans: tuple[tuple[int, int], ...] | list[tuple[int, int]], i: int, cb: int) -> str:
    """Byte ranges of the file that chunk i of the span stream covers ("bytes a..b[, c..d]")."""
    lo, hi, pos, parts = i * cb, (i + 1) * cb, 0, []
    for off, n in spans:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            parts.append(f"{off + a - pos}..{off + b - pos}")
        pos += n
    return "bytes " + ", ".join(parts)


def runs_to_cover(total_chunks: int, sample_bytes: int, chunk_bytes: int) -> int:
    """Runs after which the moving window has re-hashed every chunk once (docs/table-proof.md)."""
    k = max(1, sample_bytes // chunk_bytes)
    return max(1, -(-total_chunks // k))
