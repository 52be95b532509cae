"""Write big tables from checkpoint byte ranges at disk speed without flooding the page cache.

Shared by the host-side table writers (PLE file, Engram staging). Standard library only.

A write is a list of `Segment`s (source file byte range -> destination offset). The bytes of
all segments, in order, form a stream cut into fixed-size chunks; each chunk gets a sha256
(the manifest's per-chunk checksums). For every chunk:

  1. copy its pieces with copy_file_range (kernel-side, no user buffer; pread/pwrite fallback),
  2. start writeback of the written range (sync_file_range WRITE, asynchronous),
  3. hash the source range just copied in a worker thread (bounded buffer; hashlib releases the
     GIL, so hashing runs beside the next chunk's copy),
  4. once `window` newer chunks are in flight: wait for the chunk's writeback, then
     posix_fadvise(DONTNEED) its written range and its source range (widened to 4 MiB: large
     folios straddling an unaligned tensor edge are otherwise kept).

The next chunk's source ranges are requested ahead (POSIX_FADV_WILLNEED: shards in other files
are not covered by the kernel's sequential readahead). So at most about `window + 2` chunks of
written and of read pages sit in the page cache at any time (2 x 6 x 64 MiB = 768 MiB by default,
~700 MiB measured; on a DGX Spark the page cache is the GPU's memory), and user-space memory is
the hash buffers.
Preallocation (fallocate) reserves the space first: ENOSPC comes before any byte is written.
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from .safetensors import copy_range

CHECKSUM = "sha256"
CHUNK_BYTES = 64 * 1024 * 1024         # checksum granularity and writeback unit
WINDOW = 4                             # chunks in flight before the oldest is synced and dropped
HASH_BUF = 8 * 1024 * 1024             # per hash worker
COPY_CALL = 16 * 1024 * 1024          # bytes per copy_file_range call
FOLIO_ALIGN = 4 * 1024 * 1024          # source ranges are dropped widened to this (large folios)

_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


@dataclass(frozen=True)
class Segment:
    """`length` bytes at `src_off` of file `src` go to `dst_off` of the destination."""
    src: str
    src_off: int
    dst_off: int
    length: int


@dataclass(frozen=True)
class Piece:
    """A part of a segment that lies inside one chunk."""
    src: str
    src_off: int
    dst_off: int
    length: int


def merge_adjacent(segments: Iterable[Segment]) -> list[Segment]:
    """Join segments that continue each other in both source and destination (bigger copies)."""
    out: list[Segment] = []
    for s in segments:
        if s.length <= 0:
            continue
        if out:
            p = out[-1]
            if p.src == s.src and p.src_off + p.length == s.src_off and p.dst_off + p.length == s.dst_off:
                out[-1] = Segment(p.src, p.src_off, p.dst_off, p.length + s.length)
                continue
        out.append(s)
    return out


def chunk_pieces(segments: list[Segment], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[Piece]]:
    """The stream of segment bytes cut into chunks of `chunk_bytes` (the last may be shorter)."""
    cur: list[Piece] = []
    room = chunk_bytes
    for s in segments:
        done = 0
        while done < s.length:
            n = min(room, s.length - done)
            cur.append(Piece(s.src, s.src_off + done, s.dst_off + done, n))
            done += n
            room -= n
            if room == 0:
                yield cur
                cur, room = [], chunk_bytes
    if cur:
        yield cur


# -- kernel helpers -----------------------------------------------------------------------------

class _Libc:
    """sync_file_range and fallocate through ctypes (Python's os module has neither)."""

    def __init__(self) -> None:
        self.sync_file_range = self.fallocate = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            sfr = libc.sync_file_range
            sfr.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            sfr.restype = ctypes.c_int
            self.sync_file_range = sfr
            fa = libc.fallocate
            fa.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fa.restype = ctypes.c_int
            self.fallocate = fa
        except (OSError, AttributeError):
            pass


_LIBC = _Libc()


def sync_range(fd: int, off: int, length: int, wait: bool) -> None:
    """Start (wait=False) or complete (wait=True) writeback of a byte range; fdatasync where
    sync_file_range is not available."""
    if _LIBC.sync_file_range is not None:
        flags = (_SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER) if wait else _SYNC_WRITE
        if _LIBC.sync_file_range(fd, off, length, flags) == 0:
            return
        e = ctypes.get_errno()
        if e not in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
            raise OSError(e, os.strerror(e))
    if wait:
        os.fdatasync(fd)


def drop_cache(fd: int, off: int, length: int) -> None:
    """Ask the kernel to drop clean cached pages of a range (written pages must be synced first)."""
    try:
        os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


def drop_cache_around(fd: int, off: int, length: int, align: int = FOLIO_ALIGN) -> None:
    """drop_cache for a range of a file being read, widened to `align` boundaries: DONTNEED
    leaves a large folio (ext4/xfs cache files in folios of up to a few MiB) that straddles the
    range's edge, so edges of unaligned ranges (tensors) would otherwise stay cached. The
    neighbours dropped with it are clean pages of the same source file (at worst read again)."""
    lo = off // align * align
    hi = -(-(off + length) // align) * align
    drop_cache(fd, lo, hi - lo)


def preallocate(fd: int, off: int, length: int) -> bool:
    """Reserve disk blocks for a range. True if reserved; False if the filesystem cannot
    (the write then proceeds without a reservation). ENOSPC and other errors raise OSError."""
    if length <= 0:
        return True
    if _LIBC.fallocate is not None:       # the syscall: no slow zero-writing emulation
        if _LIBC.fallocate(fd, 0, off, length) == 0:
            return True
        e = ctypes.get_errno()
        if e in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(e, os.strerror(e))
    try:
        os.posix_fallocate(fd, off, length)
        return True
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return False
        raise


# -- hashing ------------------------------------------------------------------------------------

class _Hasher:
    """A small thread pool hashing byte ranges of files through one bounded buffer per thread."""

    def __init__(self, workers: int) -> None:
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="hash")

    def _buf(self) -> memoryview:
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = memoryview(bytearray(HASH_BUF))
        return b

    def _hash(self, parts: list[tuple[int, int, int]]) -> str:
        h = hashlib.sha256()
        buf = self._buf()
        for fd, off, length in parts:
            done = 0
            while done < length:
                n = min(len(buf), length - done)
                got = os.preadv(fd, [buf[:n]], off + done)
                if got <= 0:
                    raise OSError(errno.EIO, f"short read at offset {off + done}")
                h.update(buf[:got])
                done += got
        return h.hexdigest()

    def submit(self, parts: list[tuple[int, int, int]]) -> "Future[str]":
        return self._pool.submit(self._hash, parts)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


# -- the writer ---------------------------------------------------------------------------------

@dataclass
class CopyResult:
    chunks: list[str]          # sha256 per chunk of the stream
    chunk_bytes: int
    bytes: int
    seconds: float
    preallocated: bool


Progress = Callable[[int, int], None]      # (bytes done, bytes total)


class _Sources:
    """Source files opened once each, read-only."""

    def __init__(self) -> None:
        self.fds: dict[str, int] = {}

    def fd(self, path: str) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _dst_spans(pieces: list[Piece]) -> list[tuple[int, int]]:
    """Contiguous destination ranges of a chunk."""
    spans: list[tuple[int, int]] = []
    for p in pieces:
        if spans and spans[-1][0] + spans[-1][1] == p.dst_off:
            spans[-1] = (spans[-1][0], spans[-1][1] + p.length)
        else:
            spans.append((p.dst_off, p.length))
    return spans


def copy_segments(dst_fd: int, segments: list[Segment], *, chunk_bytes: int = CHUNK_BYTES,
                  window: int = WINDOW, workers: int | None = None, prealloc: bool = True,
                  progress: Progress | None = None, checksums: bool = True,
                  prefetch: bool = True) -> CopyResult:
    """Copy every segment into `dst_fd` (a new file opened for writing), gently; see the module doc.

    Returns the per-chunk sha256 of the copied bytes (none with checksums=False: the benchmark's
    measure of what hashing costs). The destination is fdatasync'ed at the end.
    Raises OSError (ENOSPC included) with the destination left as it is: the caller removes it.
    """
    if chunk_bytes < 4096 or window < 1:
        raise ValueError(f"chunk_bytes must be >= 4096 and window >= 1 (got {chunk_bytes}, {window})")
    segments = merge_adjacent(segments)
    total = sum(s.length for s in segments)
    t0 = time.monotonic()
    reserved = True
    if prealloc:
        for off, length in _dst_spans([Piece(s.src, s.src_off, s.dst_off, s.length) for s in segments]):
            reserved = preallocate(dst_fd, off, length) and reserved
    else:
        reserved = False
    srcs = _Sources()
    hasher = _Hasher(workers or default_workers())
    inflight: collections.deque[tuple[list[Piece], Future[str] | None]] = collections.deque()
    sums: list[str] = []
    done = 0

    def retire() -> None:
        pieces, fut = inflight.popleft()
        if fut is not None:
            sums.append(fut.result())
        for off, length in _dst_spans(pieces):
            sync_range(dst_fd, off, length, wait=True)
            drop_cache(dst_fd, off, length)
        for p in pieces:
            drop_cache_around(srcs.fd(p.src), p.src_off, p.length)

    try:
        chunks = chunk_pieces(segments, chunk_bytes)
        nxt = next(chunks, None)
        while nxt is not None:
            pieces, nxt = nxt, next(chunks, None)
            if prefetch and nxt is not None:      # the next chunk's source is read while this one copies
                for p in nxt:
                    try:
                        os.posix_fadvise(srcs.fd(p.src), p.src_off, p.length, os.POSIX_FADV_WILLNEED)
                    except OSError:
                        pass
            for p in pieces:   # copy_file_range in COPY_CALL steps (its pread fallback's buffer)
                copy_range(srcs.fd(p.src), p.src_off, dst_fd, p.dst_off, p.length, COPY_CALL)
            for off, length in _dst_spans(pieces):
                sync_range(dst_fd, off, length, wait=False)
            fut = hasher.submit([(srcs.fd(p.src), p.src_off, p.length) for p in pieces]) if checksums else None
            inflight.append((pieces, fut))
            while len(inflight) > window:
                retire()
            done += sum(p.length for p in pieces)
            if progress:
                progress(done, total)
        while inflight:
            retire()
        os.fdatasync(dst_fd)
    finally:
        hasher.close()
        srcs.close()
    return CopyResult(sums, chunk_bytes, total, time.monotonic() - t0, reserved)


def hash_chunks(fd: int, spans: list[tuple[int, int]], chunk_bytes: int = CHUNK_BYTES,
                workers: int | None = None, only: "set[int] | None" = None) -> Iterator[tuple[int, str]]:
    """(chunk index, sha256) of the stream formed by byte ranges `spans` of one file, in order,
    with bounded memory, dropping the read pages from the page cache as it goes. ONLY: hash just
    these chunk indices (a sample); the others are not read."""
    segs = [Segment("", off, off, length) for off, length in spans]
    hasher = _Hasher(workers or default_workers())
    limit = max(2, workers or default_workers())
    inflight: collections.deque[tuple[int, list[Piece], Future[str]]] = collections.deque()

    def retire() -> tuple[int, str]:
        i, pieces, fut = inflight.popleft()
        digest = fut.result()
        for p in pieces:
            drop_cache_around(fd, p.src_off, p.length)
        return i, digest

    try:
        for i, pieces in enumerate(chunk_pieces(segs, chunk_bytes)):
            if only is not None and i not in only:
                continue
            inflight.append((i, pieces, hasher.submit([(fd, p.src_off, p.length) for p in pieces])))
            while len(inflight) > limit:
                yield retire()
        while inflight:
            yield retire()
    finally:
        hasher.close()
