"""ple-write: Qwen's n-gram ("PLE") table as the very file SGLang maps, written once.

    python3 deployctl-tables-*.pyz ple-write --spec spec.json --checkpoint DIR --dest DIR
                                             [--verify] [--check] [--host NAME] [--no-preallocate]

Runs on the host (standard library only). For each TP rank the spec lists, the file the released
SGLang maps from `--ple-offload-dir` (name, shape, rank shard and the row every checkpoint shard
lands on: hostside/ple_layout.py, which cites the upstream functions) is written from the shard tensors
(`shard_tensor` with {layer}, {shard} = 0..shards-1); rows no shard covers stay zero (holes). Beside
each table its manifest `<table>.deployctl-manifest.json` is written last:

    {"format": "deployctl-ple-manifest/2", "file": NAME, "bytes", "row_bytes", "width", "dtype",
     "layout": RankTable.to_json(), "spans": [[offset, length], ...] (the written byte ranges),
     "checksum": {"scheme": "sha256", "chunk_bytes", "chunks": [hex, ...]} (over the spans, in order),
     "source": {"checkpoint", "files": [Checkpoint.identity ...], "tensors": [...]},
     "table_key": digest of (layout, tensor names, source identity),
     "stat": {"size", "ino", "mtime_ns", "ctime_ns"}, "content_digest" (what launch binds into the spec),
     "recipe": {"name", "digest"}, "spec": {...}, "written": {...}}

The image's SGLang patch (dockerfiles/sglang-qwen38/patches/deployctl_sglang_ple) reads that manifest
to skip the engine's own boot-time rewrite of a table deployctl wrote and checked.

Restart: when the manifest's table_key equals the current one and the file has the recorded size,
the file is kept once it is proven (tableproof.py: every chunk re-hashed if its inode, mtime or
ctime changed since it was written, else the next 2 GiB window of chunks; a mismatch rewrites it);
`--verify` re-hashes every chunk. Otherwise a new
temp file is written and renamed over the old one (never read-modify-write); `ple_table_*.bin`
files that are not one of the spec's tables (another geometry, an older deployctl's name) are
removed afterwards, with their manifests.

Placement `pinned` writes no file: the op checks the host's MemAvailable against
`min_host_ram_gb` instead (`pinned_ram_verdict`, also used by preflight).

The spec, the source shards and the pinned-placement RAM check: ple_spec.py.

Prints one JSON object as its last stdout line. Exit 0 written / kept / pinned ok, 1 failed
(I/O, no space, read-back mismatch, not enough RAM), 2 bad input (missing shard, wrong width,
row total different from the geometry's, shards that overlap under split_ngram_parts).
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import hashlib
import glob
import json
import mmap
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DeployctlError, InputError
from ..fsutil import atomic_write_text, fsync_dir
from . import bulkcopy, tableproof
from .ple_layout import RankTable
from .ple_spec import (MANIFEST_SUFFIX, PleTableSpec, Source, WriteFailed, load_spec, manifest_name, mem_available,
                       pinned_ram_verdict, resolve_source, segments_for, spans_of, table_key)

MANIFEST_FORMAT = "deployctl-ple-manifest/2"
TABLE_GLOB = "ple_table_*.bin"                 # every name ple_table_file_name can produce
RANDOM_SAMPLES = 64




# -- restart decision ---------------------------------------------------------------------------

def read_manifest(dest: Path, name: str) -> dict | None:
    try:
        doc = json.loads((dest / manifest_name(name)).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == MANIFEST_FORMAT else None


def keep_reason(man: dict | None, dest: Path, name: str, key: str, src: Source,
                bytes_: int) -> tuple[bool, str]:
    """(keep?, why) from the manifest, the file's stat and the source identity: nothing is read."""
    if man is None:
        return False, "no valid manifest" if (dest / manifest_name(name)).exists() else "no manifest"
    if man.get("file") != name:
        return False, f"the manifest describes {man.get('file')} (another geometry)"
    if man.get("source", {}).get("files") != src.identity:
        old = {f["name"]: f for f in man.get("source", {}).get("files", [])}
        changed = [f["name"] for f in src.identity if old.get(f["name"]) != f] or ["(file list)"]
        return False, f"the checkpoint changed ({', '.join(changed[:3])}: size, mtime or header)"
    if man.get("table_key") != key:
        return False, "the shard layout or geometry changed"
    try:
        st = os.stat(dest / name)
    except FileNotFoundError:
        return False, f"{name} is missing"
    rec = man.get("stat", {})
    if st.st_size != bytes_ or rec.get("size") != bytes_:
        return False, f"{name} has {st.st_size} bytes, expected {bytes_}"
    # a changed inode, mtime or ctime is not decided here: prove() re-hashes such a file in full
    return True, (f"{name} matches its manifest: same checkpoint ({len(src.identity)} file(s): "
                  f"sizes, mtimes, headers), same layout ({man.get('layout', {}).get('shape')} x "
                  f"{man.get('row_bytes')} B rows), same size")


def proven(dest: Path, name: str, man: dict, full_check: bool = False) -> tuple[bool, str, dict[str, Any]]:
    """(True, what was checked) when the kept file's bytes still match its manifest (tableproof.py:
    the next window of its chunks, or all of them for a file touched since it was written, or with
    --verify); else (False, why) and the manifest is removed, so the table is rewritten rather
    than mapped by the engine. A touched file found intact gets its new stat recorded."""
    ck = man["checksum"]
    f = tableproof.TableFile(str(dest / name), tuple((int(o), int(n)) for o, n in man["spans"]),
                             int(ck["chunk_bytes"]), tuple(ck["chunks"]), man.get("stat"))
    proof = tableproof.prove([f], full_check=full_check, state=dest / f".{name}{tableproof.STATE_SUFFIX}")
    if not proof.ok:
        (dest / manifest_name(name)).unlink(missing_ok=True)
        return (False, f"corrupt table: {'; '.join(proof.bad[:3])} differ from its manifest ({proof.summary()})",
                proof.to_json())
    if proof.refreshed:
        man["stat"] = proof.refreshed[f.path]
        atomic_write_text(dest / manifest_name(name), json.dumps(man, indent=1) + "\n")
    return True, proof.summary(), proof.to_json()


def content_digest(name: str, key: str, chunks: list[str]) -> str:
    """What the engine maps, in one hash (file name, layout and source key, chunk hashes, and a random
    id of this write: a rewrite renames a new file into place, even with the same bytes, and an engine
    started before still maps the old one; a freed inode number is often reused, so it cannot tell).
    Launch puts it in the container's spec digest, so a rewritten table restarts the engine."""
    return hashlib.sha256(json.dumps([name, key, chunks, os.urandom(16).hex()]).encode()).hexdigest()


# -- read-back check ----------------------------------------------------------------------------

def expected_row(table: RankTable, src: Source, row: int) -> tuple[str, int] | None:
    """(source file, byte offset) of file row `row` by the engine's placement; None for a zero row."""
    g = table.start + row
    shard, within = divmod(g, table.shard_stride)
    if g >= table.end or shard >= len(src.tensors) or within >= src.tensors[shard]["rows"]:
        return None
    t = src.tensors[shard]
    return str(src.checkpoint.folder / t["file"]), t["offset"] + within * table.row_bytes


def readback_check(path: str, table: RankTable, src: Source, samples: int = RANDOM_SAMPLES,
                   seed: int | None = None) -> int:
    """mmap the written file; compare sampled rows (first, last, every shard's first and last
    in this file, a padding row, random ones) with the checkpoint bytes by the engine's placement.
    Returns the rows checked; raises WriteFailed."""
    rb = table.row_bytes
    rows = {0, table.rows - 1}
    for i, t in enumerate(src.tensors):
        placed = table.place(i, t["rows"])
        if placed:
            rows.update((placed[0], placed[0] + placed[2] - 1))
    rng = random.Random(seed)
    rows.update(rng.randrange(table.rows) for _ in range(min(samples, table.rows)))
    fds: dict[str, int] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        with mmap.mmap(fd, table.nbytes, prot=mmap.PROT_READ) as mm:
            checks = []
            for row in sorted(rows):
                where = expected_row(table, src, row)
                sfd = None
                if where:
                    sfd = fds.get(where[0])
                    if sfd is None:
                        sfd = fds[where[0]] = os.open(where[0], os.O_RDONLY)
                checks.append((row, where, sfd))
            # ask for every sampled page at once (async readahead), then compare: the disk sees
            # one deep queue of small reads instead of hundreds of serial ones
            for row, where, sfd in checks:
                page = row * rb // mmap.PAGESIZE * mmap.PAGESIZE
                mm.madvise(mmap.MADV_WILLNEED, page, min(2 * mmap.PAGESIZE, table.nbytes - page))
                if where:
                    os.posix_fadvise(sfd, where[1], rb, os.POSIX_FADV_WILLNEED)
            for row, where, sfd in checks:
                want = os.pread(sfd, rb, where[1]) if where else bytes(rb)
                if mm[row * rb:(row + 1) * rb] != want:
                    what = f"{where[0]} at byte {where[1]}" if where else "zeros (no shard covers it)"
                    raise WriteFailed(f"read-back check: row {row} of {Path(path).name} differs from "
                                      f"the checkpoint ({what})")
                if where:
                    bulkcopy.drop_cache_around(sfd, where[1], rb)
        return len(rows)
    finally:
        bulkcopy.drop_cache(fd, 0, 0)
        os.close(fd)
        for f in fds.values():
            os.close(f)


# -- the write ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str                    # written | rewritten | kept | no-file
    reason: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"op": "ple-write", "status": self.status, "reason": self.reason, **self.data}


class _DirLock:
    """flock on the destination folder: one writer per folder."""

    def __init__(self, dest: Path):
        self.fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise WriteFailed(f"another ple-write holds the lock on {dest}; wait for it to finish") from None

    def close(self) -> None:
        os.close(self.fd)


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _remove(paths: list[Path]) -> list[str]:
    out = []
    for p in paths:
        try:
            p.unlink()
            out.append(p.name)
        except FileNotFoundError:
            pass
    return out


def write_table(spec: PleTableSpec, checkpoint: str | Path, dest: str | Path, *, verify: bool = False,
                host: str | None = None, prealloc: bool = True,
                chunk_bytes: int = bulkcopy.CHUNK_BYTES, quiet: bool = False,
                meminfo: str = "/proc/meminfo") -> Outcome:
    """Write (or keep) every rank's table file; see the module doc. Raises InputError (exit 2) or
    WriteFailed (exit 1)."""
    t0 = time.monotonic()
    if spec.placement == "pinned":
        ok, msg = pinned_ram_verdict(mem_available(meminfo), spec, host)
        if not ok:
            raise WriteFailed(msg)
        return Outcome("no-file", "placement 'pinned': SGLang loads the table into pinned RAM, "
                       "no file is written; " + msg, {"host": host})
    if spec.placement != "nvme":
        return Outcome("no-file", f"placement {spec.placement!r}: no table file to write", {"host": host})

    src = resolve_source(spec, checkpoint)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tables = spec.tables()
    lock = _DirLock(dest)
    try:
        removed = _remove(_matching(dest, f".{TABLE_GLOB}.*.tmp"))   # a crashed run's temp files
        results = [_write_one(spec, src, t, dest, Path(checkpoint), verify=verify, host=host,
                              prealloc=prealloc, chunk_bytes=chunk_bytes, quiet=quiet) for t in tables]
        removed += _remove(_others(dest, [t.file_name for t in tables]))
        fsync_dir(dest)
    finally:
        lock.close()
    first = results[0]
    status = ("kept" if all(r.status == "kept" for r in results) else
              "rewritten" if any(r.status == "rewritten" for r in results) else "written")
    reason = "; ".join(r.reason for r in results)
    data = {**first.data, "removed": removed + sum((r.data.get("removed", []) for r in results), []),
            "seconds": round(time.monotonic() - t0, 3),
            "files": [r.data["file"] for r in results]}
    if len(results) > 1:
        data["tables"] = [r.to_json() for r in results]
    return Outcome(status, reason, data)


def _write_one(spec: PleTableSpec, src: Source, table: RankTable, dest: Path, checkpoint: Path, *,
               verify: bool, host: str | None, prealloc: bool, chunk_bytes: int, quiet: bool) -> Outcome:
    t0 = time.monotonic()
    name, total = table.file_name, table.nbytes
    final = dest / name
    key = table_key(spec, src, table)
    man = read_manifest(dest, name)
    keep, why = keep_reason(man, dest, name, key, src, total)
    base = {"file": str(final), "rows": table.rows, "row_bytes": table.row_bytes, "bytes": total,
            "rank": table.rank, "decided_in_s": round(time.monotonic() - t0, 3), "host": host}
    if keep:
        assert man is not None
        keep, proof, _ = proven(dest, name, man, full_check=verify)
        why = f"{why}; {'--verify' if verify else 'proven'}: {proof}" if keep else proof
    if keep:
        return Outcome("kept", why, {**base, "seconds": round(time.monotonic() - t0, 3)})

    existed = final.exists()
    _log(f"ple-write: writing {name} ({total / 1e9:.2f} GB, {table.rows:,} rows) to {dest}: {why}", quiet)
    (dest / manifest_name(name)).unlink(missing_ok=True)   # the manifest is removed first, written last
    fsync_dir(dest)
    removed = _make_room(dest, [final], total, quiet)
    segments = segments_for(table, src, table.row_bytes)
    tmp = dest / f".{name}.{os.getpid()}.tmp"
    try:
        res = _write_new(tmp, segments, total, prealloc, chunk_bytes, quiet, dest, name)
        checked = readback_check(str(tmp), table, src)
        os.rename(tmp, final)                     # over the old file: it is never read
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(dest)
    manifest = {
        "format": MANIFEST_FORMAT, "file": name, "bytes": total, "row_bytes": table.row_bytes,
        "width": table.width, "dtype": table.dtype, "layout": table.to_json(),
        "spans": spans_of(segments),
        "checksum": {"scheme": bulkcopy.CHECKSUM, "chunk_bytes": res.chunk_bytes, "chunks": res.chunks},
        "source": {"checkpoint": str(checkpoint.resolve()), "files": src.identity,
                   "tensors": src.tensors, "config": src.config},
        "table_key": key,
        "stat": tableproof.stamp(final),
        "content_digest": content_digest(name, key, res.chunks),
        "recipe": spec.recipe, "spec": spec.to_json(),
        "written": {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "seconds": round(res.seconds, 3), "preallocated": res.preallocated,
                    "readback_rows": checked, "host": host},
    }
    atomic_write_text(dest / manifest_name(name), json.dumps(manifest, indent=1) + "\n")
    return Outcome("rewritten" if existed else "written", why, {
        **base, "removed": removed, "seconds": round(time.monotonic() - t0, 3),
        "copy_seconds": round(res.seconds, 3),
        "mb_per_s": round(res.bytes / 1e6 / res.seconds, 1) if res.seconds > 0 else None,
        "preallocated": res.preallocated, "readback_rows": checked,
        "chunks": len(res.chunks), "chunk_bytes": res.chunk_bytes})


def _make_room(dest: Path, replaced: list[Path], total: int, quiet: bool) -> list[str]:
    """The new file is written beside the old one and renamed over it. When the folder's
    filesystem cannot hold both, the tables being replaced (invalid by now, their manifest gone)
    and tables of other geometries are removed first: better than failing for want of the space
    they hold."""
    st = os.statvfs(dest)
    free = st.f_bavail * st.f_frsize
    if free >= total:
        return []
    old = [p for p in _matching(dest, TABLE_GLOB) if p in replaced or not (dest / manifest_name(p.name)).exists()]
    held = sum(p.stat().st_blocks * 512 for p in old)
    if not old or free + held < total:
        return []                   # fallocate will refuse with the figures
    _log(f"ple-write: {free:,} bytes free, {total:,} needed: removing the replaced table(s) first", quiet)
    out = _remove(old)
    fsync_dir(dest)
    return out


def _matching(dest: Path, pattern: str) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(os.path.join(glob.escape(str(dest)), pattern)))]


def _others(dest: Path, names: list[str]) -> list[Path]:
    """Table files (and their manifests) that are none of this spec's tables: the engine maps
    only its own name, so these just hold disk space."""
    stale = [p for p in _matching(dest, TABLE_GLOB) if p.name not in names]
    stale += [p for p in _matching(dest, "ple_table_*" + MANIFEST_SUFFIX)
              if p.name[:-len(MANIFEST_SUFFIX)] not in names]
    stale += [p for p in _matching(dest, "deployctl-ple-manifest.json")]     # deployctl <= 0.1's
    return stale


def _write_new(tmp: Path, segments: list[bulkcopy.Segment], total: int, prealloc: bool,
               chunk_bytes: int, quiet: bool, dest: Path, name: str) -> bulkcopy.CopyResult:
    """Copy the shards into a new temp file of the table's full size (the caller removes it on
    failure). Rows no shard covers are holes: zeros, as the engine's fresh sparse file has."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    last = [time.monotonic()]

    def progress(done: int, tot: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 5 or done == tot:
            last[0] = now
            _log(f"ple-write: {done / 1e9:.2f} / {tot / 1e9:.2f} GB", quiet)

    try:
        # the whole file at once: ENOSPC before any byte is written (False: no fallocate here)
        reserved = prealloc and bulkcopy.preallocate(fd, 0, total)
        os.ftruncate(fd, total)
        res = bulkcopy.copy_segments(fd, segments, chunk_bytes=chunk_bytes, prealloc=False,
                                     progress=progress)
        return dataclasses.replace(res, preallocated=reserved)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            st = os.statvfs(dest)
            raise WriteFailed(
                f"no space left in {dest} for {name}: it needs {total:,} bytes "
                f"({total / 1e9:.2f} GB); {st.f_bavail * st.f_frsize:,} bytes are free besides the "
                "partial write, which was removed (no table file and no manifest were left)") from None
        raise WriteFailed(f"writing {tmp}: {e}") from None
    finally:
        os.close(fd)


def check_table(spec: PleTableSpec, checkpoint: str | Path, dest: str | Path, full: bool = False) -> dict[str, Any]:
    """Would write_table keep every file? Reads manifests, stats, config.json, safetensors headers and
    the proof's sample of each kept table (`proven`); writes no table data and takes no lock (what the
    stage and launch ask over SSH). A proven-corrupt table loses its manifest here."""
    if spec.placement != "nvme":
        return {"op": "ple-write", "status": "check", "up_to_date": False,
                "reason": f"placement {spec.placement!r}: checked on the host by the op itself"}
    src = resolve_source(spec, checkpoint)
    dest = Path(dest)
    tables = spec.tables()
    whys, ok, proofs = [], True, []
    for t in tables:
        man = read_manifest(dest, t.file_name)
        keep, why = keep_reason(man, dest, t.file_name, table_key(spec, src, t), src, t.nbytes)
        if keep:
            assert man is not None
            keep, said, proof = proven(dest, t.file_name, man, full)
            why = f"{why}; proven: {said}" if keep else said
            proofs.append(proof)
        ok, whys = ok and keep, whys + [why]
    stale = [p.name for p in _others(dest, [t.file_name for t in tables])]
    if ok and stale:
        ok, whys = False, whys + [f"stale table files to remove: {', '.join(stale[:3])}"]
    return {"op": "ple-write", "status": "check", "up_to_date": ok,
            "reason": ("kept: " if ok else "") + "; ".join(whys),
            "proof": {"bytes": sum(p["bytes"] for p in proofs), "seconds": sum(p["seconds"] for p in proofs),
                      "chunks": sum(p["chunks"] for p in proofs)},
            "file": str(dest / tables[0].file_name), "bytes": sum(t.nbytes for t in tables)}


# -- command line -------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ple-write", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, help="the JSON spec deployctl wrote")
    ap.add_argument("--checkpoint", help="checkpoint folder (safetensors)")
    ap.add_argument("--dest", help="folder for the table file (the engine's --ple-offload-dir)")
    ap.add_argument("--verify", action="store_true", help="re-hash a kept file against its manifest")
    ap.add_argument("--check", action="store_true", help="report whether the file is current (proven); no table data is written")
    ap.add_argument("--host", default=None, help="this host's inventory name (for messages)")
    ap.add_argument("--no-preallocate", action="store_true", help="skip fallocate")
    ap.add_argument("--chunk-mib", type=int, default=bulkcopy.CHUNK_BYTES >> 20)
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    try:
        spec = load_spec(a.spec)
        if a.chunk_mib < 1:
            raise InputError(f"must be >= 1, got {a.chunk_mib}", key="--chunk-mib")
        if spec.placement == "nvme" and not (a.checkpoint and a.dest):
            raise InputError("placement nvme needs --checkpoint and --dest", key="--checkpoint")
        if a.check:
            print(json.dumps({**check_table(spec, a.checkpoint or "", a.dest or "", full=a.verify), "host": a.host}))
            return 0
        out = write_table(spec, a.checkpoint or "", a.dest or "", verify=a.verify, host=a.host,
                          prealloc=not a.no_preallocate, chunk_bytes=a.chunk_mib << 20, quiet=a.quiet)
    except DeployctlError as e:
        print(json.dumps({"op": "ple-write", "status": "failed", "error": str(e), "exit": e.exit_code,
                          "host": a.host}))
        print(f"ple-write: error: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps(out.to_json()))
    return 0
