"""engram-stage: put one rank's rows of every Engram layer onto this node's disk, in the exact form the
patched vLLM engine reads through DSV41_ENGRAM_DIR (docs/engram-contract.md), at disk speed.

Runs on the node (from the zipapp: `python3 deployctl-tables-*.pyz engram-stage ...`) and locally
(`deployctl engram stage`); standard library only. Usage:

    engram-stage --spec SPEC.json --checkpoint DIR --dest DIR [--verify] [--check] [--check-rank]
                 [--rank R] [--threads N] [--hash-cache FILE] [--fetch-state FILE]

Prints progress on stderr and one JSON object as the last stdout line:
    {"op": "engram-stage", "status": "ok" | "skipped" | "failed" | "check" | "rank-ok", ...}
Exit codes: 0 ok or skipped, 1 failed (I/O, no space, verify or fidelity mismatch, wrong rank),
2 bad input (spec, checkpoint missing/truncated/mismatched: the file is named).

The spec (`--spec`) and where the rows come from: engram_spec.py. The checks (the engine's view of
the rows, --verify, the rank check): engram_checks.py.

What lands in DEST (layout "sparse", the only one: what the patched engram.py reads, see
docs/engram-contract.md for where each rule comes from):
  model.safetensors.index.json   the checkpoint's index, byte for byte (written atomically)
  <shard>.safetensors            for every checkpoint shard holding an Engram weight or scale tensor, a
                                 sparse copy under the shard's own name: the same apparent size, the
                                 original header bytes [0, 8 + header length), and only this rank's rows
                                 [lo, hi) of each Engram tensor in the file, at their original offsets
                                 (8 + header length + data_offsets[0] + row x row_bytes); everything else
                                 is a hole (never written, takes no space)
  engram-local.json              {"layers": {"1": [lo, hi], "14": [lo, hi]}}: the rows present, per layer;
                                 the engine uses the folder for a layer only if this covers its rows
  engram-manifest.json           written last: spec key, source identity (file names, sizes, mtimes,
                                 header digests, the index's sha256), every file with its size, header
                                 digest, staged byte ranges and per-chunk sha256 over those ranges only
                                 (64 MiB chunks), recipe digest, tp, rank, layout.

Link mode ("link": true, from engram.staging auto on a node whose checkpoint is its own): when DEST is
on the filesystem of every Engram shard, each <shard>.safetensors is a hard link to the checkpoint's
shard instead of a copy: every row present at its own offset, nothing written (reading it costs the
engine what reading a copy costs; docs/engram-contract.md has the figures). The manifest then records
the links' inodes instead of chunk hashes; a shard replaced in the checkpoint (a new inode) is
relinked. A filesystem that refuses the link (EXDEV, EPERM, ...) gets copies.

Links and the hash caches: link(2) and unlink(2) move a shard's ctime and link count, which the stamps
other ops keep of the checkpoint's files (sync-model's hash cache, --hash-cache; fetch-model's state on
the head, --fetch-state) take for a write. The op stats the checkpoint's Engram shards around each of
its own link and unlink steps and restamps those records that were current just before (`_Restamps`),
so the next no-op hashes nothing, while a write before or after still shows. A linked shard has no
chunk hashes of its own: its manifest entry keeps the hash cache's value at link time (`verified`), and
the proof of a link whose stamp moved since asks the hash cache again (engram_checks.prove_staged):
hashed by sync-model in its current state and equal -> proven; else refused (exit 1, naming the file,
the manifest kept): restaging would link the same bytes, only sync-model repairs them.

Atomicity: the old manifest and engram-local.json are removed (and the folder fsynced) before any data
is touched: from then on the engine falls back to the model folder for this folder. Shard copies are
written under temporary names (.NAME.tmp), fsynced and renamed; then the index (atomically); the
fidelity check reads rows back through the index and headers in DEST exactly as the engine does;
engram-local.json then the manifest are written atomically. So a manifest always describes complete
data, and a killed run is simply re-run.

Idempotence: same spec key (geometry, tensor names, dtypes, layout, tp, rank) + same source identity
+ every file present with its size + the same index + the same engram-local.json + proven
(engram_checks.prove_staged: headers, and every chunk of a file whose stat stamp changed, else the
next window of a 2 GiB sample; a mismatch removes the manifest and restages) -> "skipped", with no
copy and no checkpoint row read. The manifest records each file's stat stamp and a content_digest
(what launch binds into the container spec: a restage restarts the engine). The whole-recipe digest is
recorded but does not force a restage (changing an engine flag must not copy 49 GB again).

"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import DeployctlError, InputError, StageFailed
from ..fsutil import atomic_write_bytes, atomic_write_text, fsync_dir
from . import bulkcopy, hubfetch, modelsync
from . import tableproof
from .engram_checks import (LinkChanged, check_rank, fidelity_check, file_sha256, link_refusal, prove_staged,
                            same_inode, verify_files)
from .engram_spec import (LOCAL_NAME, LOCK_NAME, MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSION, OutFile,
                          Sources, Spec, VerifyFailed, index_allocated, load_spec, local_ranges, out_files,
                          resolve_sources)
from .safetensors import INDEX_NAME


def staging_mode(spec: Spec, sources: Sources, dest: Path) -> tuple[str, str]:
    """("link" | "copy", why). Link (spec.link: the recipe's engram.staging auto and a checkpoint of the
    node's own, not a shared mount) when DEST is on the filesystem of every Engram shard: the engine
    then reads the checkpoint's own bytes through DEST at no cost in bytes or time."""
    if not spec.link:
        return "copy", "copy: engram.staging is copy or the checkpoint is on a shared mount"
    p = dest
    while not p.exists() and p != p.parent:
        p = p.parent
    dev = os.stat(p).st_dev
    other = [n for n in sources.files() if os.stat(sources.checkpoint.folder / n).st_dev != dev]
    if other:
        return "copy", f"copy: {other[0]} is on another filesystem than {dest}"
    return "link", f"link: the checkpoint's shards and {dest} share a filesystem"


def is_our_file(name: str) -> bool:
    """Files this op writes (and may delete) in DEST, besides the manifest, engram-local.json and the lock:
    the index, the shard copies, temporary files, and the files of manifest version 1 (engram-L*.bin)."""
    if name.startswith(".") and name.endswith(".tmp"):
        return True
    return (name == INDEX_NAME or name.endswith(".safetensors")
            or (name.startswith("engram-L") and name.endswith(".bin")))


def tmp_name(name: str) -> str:
    return f".{name}.tmp"


# ---------------------------------------------------------------------------------------------------
# Destination state

def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return {"__corrupt__": True}


def up_to_date(spec: Spec, sources: Sources, dest: Path, files: list[OutFile]) -> tuple[bool, str]:
    """(True, why it is current) or (False, why it must be staged)."""
    m = read_json(dest / MANIFEST_NAME)
    if m is None:
        return False, f"no {MANIFEST_NAME} in {dest}"
    if m.get("format") != MANIFEST_FORMAT or m.get("version") != MANIFEST_VERSION or not m.get("complete"):
        return False, f"{MANIFEST_NAME} is unreadable or from another version"
    old = m.get("key", {})
    if old != spec.key():
        diff = sorted(k for k in set(old) | set(spec.key()) if old.get(k) != spec.key().get(k))
        what = ", ".join(f"{k} {old.get(k)!r} -> {spec.key().get(k)!r}" for k in diff
                         if k in ("tp", "rank", "layout", "link")) or f"{', '.join(diff)} changed"
        return False, f"staged for something else: {what}"
    ident = sources.identity()
    src = m.get("source", {})
    if src.get("files") != ident:
        old_files = {f["name"]: f for f in src.get("files", [])}
        changed = [i["name"] for i in ident if old_files.get(i["name"]) != i] or ["(file set)"]
        return False, f"checkpoint changed: {', '.join(changed)} (name, size, mtime or header differ)"
    if src.get("index_sha256") != sources.index_sha256:
        return False, f"checkpoint changed: {INDEX_NAME}"
    if sorted(fe.get("name") for fe in m.get("files", [])) != sorted(f.name for f in files):
        return False, "the staged file set differs from the shards holding this rank's rows"
    modes = {fe.get("name"): fe.get("mode", "copy") for fe in m.get("files", [])}
    for f in files:
        try:
            size = (dest / f.name).stat().st_size
        except FileNotFoundError:
            return False, f"{f.name} is missing"
        if size != f.size:
            return False, f"{f.name} is {size} bytes, expected {f.size}"
        if modes.get(f.name) != f.mode:
            return False, f"{f.name} was staged by {modes.get(f.name)}, now by {f.mode}"
        if f.mode == "link" and not same_inode(dest / f.name, sources.checkpoint.folder / f.name):
            return False, f"{f.name} is no longer a link to the checkpoint's shard"
    if file_sha256(dest / INDEX_NAME) != sources.index_sha256:
        return False, f"{INDEX_NAME} in {dest} is missing or differs from the checkpoint's"
    local = read_json(dest / LOCAL_NAME)
    if not isinstance(local, dict) or local.get("layers") != local_ranges(spec):
        return False, f"{LOCAL_NAME} is missing or does not match rank {spec.rank}"
    n = sum(f.length for f in files)
    what = "shard links" if files and files[0].mode == "link" else "shard copies"
    return True, (f"already staged: rank {spec.rank} of {spec.tp}, layout {spec.layout}, "
                  f"{len(files)} {what} ({n} bytes of rows) from the same checkpoint "
                  f"({len(ident)} source files: same sizes, mtimes and header digests; same index)")


def proven(dest: Path, sample_bytes: int, full_check: bool = False,
           link_value: "Callable[[str, os.stat_result], str | None] | None" = None) -> tuple[bool, str, dict[str, Any]]:
    """(True, what was checked) when the staged bytes still match the manifest (engram_checks.
    prove_staged: a sample, or every chunk of a file touched since it was staged); else (False, why)
    and the manifest is removed, so this run (or the next) restages instead of serving bad rows. A
    touched file found intact gets its new stat recorded. Raises LinkChanged for a linked shard
    written since and not re-verified by sync-model (a restage would not repair it)."""
    manifest = read_json(dest / MANIFEST_NAME)
    proof = prove_staged(dest, manifest, sample_bytes, full_check, link_value=link_value)
    if proof.refused:
        raise LinkChanged(link_refusal(proof.refused))
    if not proof.ok:
        invalidate_manifest(dest)
        more = f" and {len(proof.bad) - 3} more" if len(proof.bad) > 3 else ""
        return False, (f"corrupt staged data: {'; '.join(proof.bad[:3])}{more} differ from {MANIFEST_NAME} "
                       f"({proof.summary()}): restaging"), proof.to_json()
    if proof.refreshed:
        refresh_stamps(dest, manifest, proof.refreshed)
    return True, proof.summary(), proof.to_json()


def refresh_stamps(dest: Path, manifest: dict[str, Any], stamps: Mapping[str, dict[str, int]]) -> None:
    """Record the files' current stat in the manifest (their content was just proven equal)."""
    for fe in manifest["files"]:
        new = stamps.get(str(dest / fe["name"]))
        if new:
            fe["stat"] = new
    atomic_write_text(dest / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")


class _Restamps:
    """The stamps other ops keep of this host's checkpoint files (sync-model's hash cache, HASH_CACHE;
    fetch-model's state on the head, FETCH_STATE), kept current across this op's own link(2) and
    unlink(2) of the Engram shards: `around()` stats the shards before and after one such step and
    `apply()` restamps the records that were current before it (hostside/modelsync.py `restamp`,
    hostside/hubfetch.py `restamp`). A record already stale stays stale: a write is never excused."""

    def __init__(self, sources: Sources, hash_cache: str | None, fetch_state: str | None):
        self.sources, self.hash_cache, self.fetch_state = sources, hash_cache, fetch_state
        self.moves: dict[str, list] = {}

    def _stats(self) -> dict[str, os.stat_result]:
        out = {}
        for name in self.sources.files():
            try:
                out[name] = os.stat(self.sources.checkpoint.folder / name)
            except OSError:
                pass
        return out

    @contextlib.contextmanager
    def around(self):
        before = self._stats()
        try:
            yield
        finally:
            after = self._stats()
            for name, b in before.items():
                move = modelsync.link_move(b, after[name]) if name in after else None
                if move:
                    self.moves.setdefault(name, []).append(move)

    def value(self, name: str, st: os.stat_result) -> str | None:
        """The hash cache's value for checkpoint file NAME at exactly ST (None: none, or no cache)."""
        if not self.hash_cache:
            return None
        return modelsync.cached_value(self.hash_cache, str(self.sources.checkpoint.folder), name, st)

    def apply(self) -> None:
        if not self.moves:
            return
        if self.hash_cache:
            modelsync.restamp(self.hash_cache, str(self.sources.checkpoint.folder), self.moves)
        if self.fetch_state:
            hubfetch.restamp(self.fetch_state, [m for chain in self.moves.values() for m in chain])
        self.moves = {}


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the filesystem holding `path` (or its nearest parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def reclaimable_bytes(dest: Path) -> int:
    """Space freed by removing what a restage replaces (our data and temporary files): their allocated
    blocks, not their apparent sizes (a sparse copy of a 100 GB shard may hold 25 GB)."""
    total = 0
    if dest.is_dir():
        for e in os.scandir(dest):
            if is_our_file(e.name) and e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                if st.st_nlink == 1:             # a file linked elsewhere too frees nothing
                    total += st.st_blocks * 512
    return total


def space_report(spec: Spec, sources: Sources, dest: Path, files: list[OutFile], current: bool) -> dict[str, Any]:
    need = 0 if current else sum(f.allocated_bytes() for f in files) + index_allocated(sources)
    margin = int(spec.free_margin_gb * 1e9)
    free, recl = free_bytes(dest), (0 if current else reclaimable_bytes(dest))
    return {"path": str(dest), "need_bytes": need, "margin_bytes": margin, "free_bytes": free,
            "reclaimable_bytes": recl, "ok": current or need + margin <= free + recl,
            "apparent_bytes": sum(f.size for f in files),
            "need_gb": in_gb(need), "free_gb": in_gb(free + recl), "margin_gb": spec.free_margin_gb}


def in_gb(n: int) -> float:
    """Bytes as decimal GB, 4 significant digits (50.69, 0.006543): small test disks stay readable."""
    return float(f"{n / 1e9:.4g}")


def invalidate_manifest(dest: Path) -> None:
    """Remove the manifest (then engram-local.json), durably: from here on nothing claims the folder
    holds complete data (an interrupted run or a failed verify leads to a restage), and the engine reads
    the model folder instead of this one (without engram-local.json it falls back)."""
    for name in (MANIFEST_NAME, LOCAL_NAME):
        try:
            os.unlink(dest / name)
        except FileNotFoundError:
            pass
        fsync_dir(dest)


def invalidate(dest: Path) -> None:
    """Before writing: the manifest first, then our data and temporary files (a restage replaces them)."""
    invalidate_manifest(dest)
    for e in list(os.scandir(dest)):
        if is_our_file(e.name):
            os.unlink(e.path)
    fsync_dir(dest)


# ---------------------------------------------------------------------------------------------------
# The operation

def _say(log: Callable[[str], None] | None, msg: str) -> None:
    if log:
        log(msg)


class _Progress:
    def __init__(self, total: int, log: Callable[[str], None] | None, every_s: float = 5.0):
        self.total, self.log, self.every = total, log, every_s
        self.done, self.t0, self.last = 0, time.monotonic(), time.monotonic()
        self._lock = threading.Lock()

    def per_file(self) -> Callable[[int, int], None]:
        """A bulkcopy progress callback (bytes done in this file, its total) feeding this counter."""
        seen = [0]

        def cb(done: int, total: int) -> None:
            self(done - seen[0])
            seen[0] = done
        return cb

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.log and now - self.last >= self.every:
                self.last = now
                rate = self.done / max(now - self.t0, 1e-9)
                self.log(f"staged {self.done / 1e9:.2f} of {self.total / 1e9:.2f} GB ({rate / 1e6:.0f} MB/s)")


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def stage(spec: Spec, checkpoint: str | Path, dest: str | Path, *, verify: bool = False,
          threads: int | None = None, log: Callable[[str], None] | None = None,
          hash_cache: str | None = None, fetch_state: str | None = None) -> dict[str, Any]:
    """Stage (or skip, or verify) spec.rank's rows into `dest`. Returns the result document.
    HASH_CACHE, FETCH_STATE: the checkpoint's stamps this op keeps current across its links (_Restamps)."""
    t0 = time.monotonic()
    dest = Path(dest).absolute()
    threads = threads or default_threads()
    sources = resolve_sources(spec, checkpoint)       # bad input fails before DEST is touched
    mode, mode_why = staging_mode(spec, sources, dest)
    files = out_files(spec, sources, mode)
    base = {"op": "engram-stage", "dest": str(dest), "rank": spec.rank, "tp": spec.tp, "layout": spec.layout,
            "ranges": local_ranges(spec), "bytes": sum(f.length for f in files), "mode": mode}
    dest.mkdir(parents=True, exist_ok=True)
    stamps = _Restamps(sources, hash_cache, fetch_state)
    with _Lock(dest):
        try:
            return _stage(spec, sources, dest, files, mode, mode_why, base, stamps, verify, threads, log, t0)
        finally:
            stamps.apply()


def _stage(spec: Spec, sources: Sources, dest: Path, files: list[OutFile], mode: str, mode_why: str,
           base: dict[str, Any], stamps: _Restamps, verify: bool, threads: int,
           log: Callable[[str], None] | None, t0: float) -> dict[str, Any]:
    current, why = up_to_date(spec, sources, dest, files)
    if current and not verify:
        current, proof, _ = proven(dest, spec.sample_bytes, link_value=stamps.value)
        if current:
            return {**base, "status": "skipped", "reason": f"{why}; proven: {proof}",
                    "seconds": round(time.monotonic() - t0, 3)}
        why = proof
    if current:
        manifest = read_json(dest / MANIFEST_NAME)
        try:
            n = verify_files(dest, manifest, threads, stamps.value)
            rows = fidelity_check(spec, sources, dest)
        except VerifyFailed:
            invalidate_manifest(dest)
            raise
        refresh_stamps(dest, manifest, {str(dest / fe["name"]): tableproof.stamp(dest / fe["name"])
                                        for fe in manifest["files"]})
        what = ("every link is still the checkpoint's shard, headers match" if mode == "link"
                else "every chunk's sha256 matches")
        return {**base, "status": "skipped", "verified": True, "verified_bytes": n, "fidelity_rows": rows,
                "reason": f"{why}; verified: {what} and {rows} rows match the checkpoint",
                "seconds": round(time.monotonic() - t0, 3)}
    _say(log, f"staging rank {spec.rank} of {spec.tp} ({spec.layout}, {mode_why}) into {dest}: {why}")
    space = space_report(spec, sources, dest, files, False)
    if not space["ok"]:
        raise StageFailed(_space_message(space))
    with stamps.around():
        invalidate(dest)
    written = None
    if mode == "link":
        try:
            with stamps.around():
                written = _link_files(spec, sources, dest, files, stamps)
        except OSError as e:
            _say(log, f"hard links refused ({e}); copying the rank's rows instead")
            mode, files = "copy", out_files(spec, sources, "copy")
            base = {**base, "mode": mode}
            space = space_report(spec, sources, dest, files, False)
            if not space["ok"]:
                raise StageFailed(_space_message(space)) from None
    if written is None:
        written = _write_files(spec, sources, dest, files, threads, log)
    atomic_write_bytes(dest / INDEX_NAME, sources.index)
    try:
        rows = fidelity_check(spec, sources, dest)
    except VerifyFailed:
        with stamps.around():
            invalidate(dest)
        raise
    mfiles = [{**_manifest_file(f, *written[f.name]), "stat": tableproof.stamp(dest / f.name)} for f in files]
    manifest = _manifest(spec, sources, files, mfiles, time.monotonic() - t0)
    verified = None
    if verify:
        verified = verify_files(dest, manifest, threads, stamps.value)
    atomic_write_text(dest / LOCAL_NAME, json.dumps({"layers": local_ranges(spec)}) + "\n")
    atomic_write_text(dest / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
    secs = time.monotonic() - t0
    out = {**base, "status": "ok", "reason": why, "seconds": round(secs, 3),
           "mb_per_s": round(base["bytes"] / max(secs, 1e-9) / 1e6, 1), "fidelity_rows": rows,
           "allocated_bytes": manifest["allocated_bytes"], "files": [f.name for f in files],
           "bytes_written": 0 if mode == "link" else base["bytes"]}
    if verified is not None:
        out["verified"], out["verified_bytes"] = True, verified
    return out


def _space_message(space: Mapping[str, Any]) -> str:
    return (f"not enough free space on {space['path']}: need {space['need_gb']} GB + margin "
            f"{space['margin_gb']} GB, free {space['free_gb']} GB (counting files a restage replaces)")


def _write_files(spec: Spec, sources: Sources, dest: Path, files: list[OutFile], threads: int,
                 log: Callable[[str], None] | None) -> dict[str, tuple[list[str], int, str, list[int] | None]]:
    """Write every shard copy under its temporary name, fsync, rename.
    Returns {name: (chunk sha256s, chunk bytes, header sha256, None)}.

    A copy is created at the shard's size (all holes), gets the shard's header bytes at 0, then the
    rank's row ranges through bulkcopy (copy_file_range, preallocation of just those ranges, per-chunk
    sha256 of the stream of ranges, drop-behind of source and written pages)."""
    fds: list[tuple[OutFile, int]] = []
    progress = _Progress(sum(f.length for f in files), log)
    out: dict[str, tuple[list[str], int, str, list[int] | None]] = {}
    try:
        for f in files:
            fd = os.open(dest / tmp_name(f.name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append((f, fd))
            os.ftruncate(fd, f.size)                      # holes: the rest of the copy costs no space
        for f, fd in fds:
            src = str(sources.checkpoint.folder / f.name)
            with open(src, "rb") as fh:
                head = os.pread(fh.fileno(), f.header_bytes, 0)
            if len(head) != f.header_bytes:
                raise InputError(f"truncated: header ends early (read {len(head)} of {f.header_bytes} bytes)",
                                 file=src)
            done = 0
            while done < len(head):
                done += os.pwrite(fd, head[done:], done)
            segs = [bulkcopy.Segment(src, off, off, n) for off, n in f.spans()]
            r = bulkcopy.copy_segments(fd, segs, chunk_bytes=spec.chunk_bytes, workers=threads,
                                       progress=progress.per_file())
            out[f.name] = (r.chunks, r.chunk_bytes, hashlib.sha256(head).hexdigest(), None)
        for f, fd in fds:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        _discard(dest, fds)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StageFailed(f"no space left on {dest} while writing the Engram rows "
                              f"({in_gb(sum(f.allocated_bytes() for f in files))} GB needed, "
                              f"{in_gb(free_bytes(dest))} GB free after removing the partial files); "
                              "nothing was staged") from None
        raise StageFailed(f"writing {dest}: {e}") from None
    except BaseException:
        _discard(dest, fds)
        raise
    for f, fd in fds:
        os.close(fd)
    for f in files:
        os.replace(dest / tmp_name(f.name), dest / f.name)
    fsync_dir(dest)
    return out


def _link_files(spec: Spec, sources: Sources, dest: Path, files: list[OutFile],
                stamps: _Restamps | None = None) -> dict[str, tuple[list[str], int, str, list[int] | None, str | None]]:
    """Hard-link every Engram shard of the checkpoint into DEST (temporary name, then rename): the
    engine reads the checkpoint's own bytes, every row present; nothing is copied. Raises OSError
    (EXDEV, EPERM, ...) with nothing left behind when the filesystem refuses. Each link carries what
    sync-model's hash cache held for the shard just before (STAMPS.value: None if not current then)."""
    out: dict[str, tuple[list[str], int, str, list[int] | None, str | None]] = {}
    made: list[Path] = []
    try:
        for f in files:
            src, tmp = sources.checkpoint.folder / f.name, dest / tmp_name(f.name)
            real = os.path.realpath(src)            # a symlinked shard (HF cache): link its blob (link(2)
                                                    # would link the symlink itself, dangling in DEST)
            verified = stamps.value(f.name, os.stat(real)) if stamps else None
            os.link(real, tmp)
            made.append(tmp)
            with open(tmp, "rb") as fh:
                head = os.pread(fh.fileno(), f.header_bytes, 0)
            st = os.stat(tmp)
            out[f.name] = ([], spec.chunk_bytes, hashlib.sha256(head).hexdigest(), [st.st_dev, st.st_ino], verified)
    except BaseException:
        for t in made:
            try:
                os.unlink(t)
            except FileNotFoundError:
                pass
        raise
    for f in files:
        os.replace(dest / tmp_name(f.name), dest / f.name)
    fsync_dir(dest)
    return out


def _discard(dest: Path, fds: list[tuple[OutFile, int]]) -> None:
    for f, fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
        try:
            os.unlink(dest / tmp_name(f.name))
        except FileNotFoundError:
            pass


def _manifest_file(f: OutFile, sums: list[str], chunk_bytes: int, header_sha256: str,
                   inode: list[int] | None = None, verified: str | None = None) -> dict[str, Any]:
    d = {"name": f.name, "mode": f.mode, "size": f.size, "header_bytes": f.header_bytes,
         "header_sha256": header_sha256, "pieces": [p.to_json() for p in f.pieces], "length": f.length,
         "allocated_bytes": f.allocated_bytes(), "chunk_bytes": chunk_bytes, "sha256": sums}
    if inode is not None:
        d["inode"] = inode
    if f.mode == "link":
        d["verified"] = verified      # sync-model's hash of the shard when linked (engram_checks.prove_staged)
    return d


def _manifest(spec: Spec, sources: Sources, files: list[OutFile], mfiles: list[dict],
              seconds: float) -> dict[str, Any]:
    from .geometry import layer_tables
    totals = {t.layer: t.rows for t in layer_tables(spec.geometry)}
    return {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "complete": True,
        "key": spec.key(), "recipe": spec.recipe, "recipe_digest": spec.recipe_digest,
        "tp": spec.tp, "rank": spec.rank, "layout": spec.layout, "mode": files[0].mode if files else "copy",
        "row_bytes": {"weight": spec.weight_row_bytes, "scale": spec.scale_row_bytes},
        "dtypes": {"weight": spec.geometry.dtype, "scale": spec.scale_dtype if spec.scale_tensor else None},
        "layers": {str(r.layer): {"row_start": r.row_start, "row_end": r.row_end, "head_start": r.head_start,
                                  "head_end": r.head_end, "total_rows": totals[r.layer]}
                   for r in spec.ranges()},
        "source": {"checkpoint": str(sources.checkpoint.folder.absolute()), "files": sources.identity(),
                   "index_sha256": sources.index_sha256,
                   "tensors": {f"{layer}.{fld}": {"name": t.name, "file": t.file.name, "dtype": t.dtype,
                                                  "shape": list(t.shape), "offset": t.offset}
                               for (layer, fld), t in sorted(sources.tensors.items())}},
        "index": {"name": INDEX_NAME, "sha256": sources.index_sha256, "size": len(sources.index)},
        "files": mfiles, "bytes": sum(f.length for f in files), "content_digest": content_digest(sources, mfiles),
        "allocated_bytes": sum(f.allocated_bytes() for f in files) + index_allocated(sources),
        "apparent_bytes": sum(f.size for f in files),
        "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(seconds, 3),
    }


def content_digest(sources: Sources, mfiles: list[dict[str, Any]]) -> str:
    """What the engine reads from the folder, in one hash: the index and, per file, its header and
    chunk hashes, and a random id of this staging (a restage renames new files into place, even with
    the same bytes: an engine started before still reads the old ones through its open descriptors,
    and a freed inode number is often reused, so neither content nor inode tells). Launch puts it in
    the container's spec digest, so a restage restarts the engine; re-recording a stat does not."""
    doc = [sources.index_sha256, os.urandom(16).hex()] + [[m["name"], m["size"], m["header_sha256"], m["sha256"],
                                                           m.get("inode")] for m in mfiles]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def check(spec: Spec, checkpoint: str | Path, dest: str | Path, full: bool = False,
          hash_cache: str | None = None) -> dict[str, Any]:
    """What a run would do: up to date (proven: `proven`)?, space needed and free (for the playbook).
    Writes no table data; the proof moves its sample window and removes a proven-corrupt manifest
    (not a linked shard's: LinkChanged is reported as not current, the manifest kept)."""
    dest = Path(dest).absolute()
    sources = resolve_sources(spec, checkpoint)
    mode, mode_why = staging_mode(spec, sources, dest)
    files = out_files(spec, sources, mode)
    current, why = up_to_date(spec, sources, dest, files) if dest.is_dir() else (False, f"{dest} does not exist")
    proof: dict[str, Any] = {}
    if current:
        try:
            current, said, proof = proven(dest, spec.sample_bytes, full,
                                          link_value=_Restamps(sources, hash_cache, None).value)
        except LinkChanged as e:
            current, said = False, str(e)
        why = f"{why}; proven: {said}" if current else said
    return {"op": "engram-stage", "status": "check", "up_to_date": current, "reason": why, "proof": proof, "mode": mode,
            "mode_reason": mode_why, "rank": spec.rank, "tp": spec.tp, **space_report(spec, sources, dest, files, current)}


class _Lock:
    """One stager per folder: a second run fails at once instead of interleaving writes."""

    def __init__(self, dest: Path):
        self.path = dest / LOCK_NAME

    def __enter__(self) -> "_Lock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise StageFailed(f"another engram-stage is running on {self.path.parent} "
                              f"(it holds {self.path})") from None
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------------------------------------------
# Command line (host side)


def error_result(e: BaseException) -> dict[str, Any]:
    d: dict[str, Any] = {"op": "engram-stage", "status": "failed", "error": str(e)}
    if isinstance(e, InputError) and e.file:
        d["file"] = e.file
    return d


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="engram-stage", description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True, help="the spec JSON (see the module doc)")
    ap.add_argument("--checkpoint", required=True, help="the checkpoint folder (index + safetensors)")
    ap.add_argument("--dest", required=True, help="the folder on local NVMe")
    ap.add_argument("--rank", type=int, default=None, help="override the spec's rank")
    ap.add_argument("--verify", action="store_true", help="re-hash everything against the manifest")
    ap.add_argument("--check", action="store_true", help="report up-to-date (proven) and free space; no table data is written")
    ap.add_argument("--check-rank", action="store_true",
                    help="refuse (exit 1) unless DEST holds exactly the spec's rank's rows")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hash-cache", default=None,
                    help="sync-model's hash cache of the checkpoint on this host (kept current across the links)")
    ap.add_argument("--fetch-state", default=None,
                    help="fetch-model's state on the head (kept current across the links)")
    a = ap.parse_args(argv)
    log = lambda m: print(f"engram-stage: {m}", file=sys.stderr, flush=True)
    try:
        spec = load_spec(a.spec, a.rank)
        if a.check_rank:
            m = check_rank(a.dest, spec.ranges())
            res = {"op": "engram-stage", "status": "rank-ok", "dest": a.dest, "rank": m.get("rank"),
                   "tp": m.get("tp"), "ranges": local_ranges(spec)}
        elif a.check:
            res = check(spec, a.checkpoint, a.dest, full=a.verify, hash_cache=a.hash_cache)
        else:
            res = stage(spec, a.checkpoint, a.dest, verify=a.verify, threads=a.threads, log=log,
                        hash_cache=a.hash_cache, fetch_state=a.fetch_state)
        code = 0
    except DeployctlError as e:
        log(f"error: {e}")
        res, code = error_result(e), e.exit_code
    except OSError as e:
        log(f"error: {e}")
        res, code = error_result(e), 1
    print(json.dumps(res, sort_keys=True), flush=True)
    return code
