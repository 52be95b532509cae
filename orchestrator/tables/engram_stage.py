"""engram-stage: put one rank's rows of every Engram layer onto this node's disk, exactly and at disk speed.

Runs on the node (from the zipapp: `python3 deployctl-tables-*.pyz engram-stage ...`) and locally
(`deployctl engram stage`); standard library only. Usage:

    engram-stage --spec SPEC.json --checkpoint DIR --dest DIR [--verify] [--check] [--check-rank]
                 [--rank R] [--threads N]

Prints progress on stderr and one JSON object as the last stdout line:
    {"op": "engram-stage", "status": "ok" | "skipped" | "failed" | "check" | "rank-ok", ...}
Exit codes: 0 ok or skipped, 1 failed (I/O, no space, verify or fidelity mismatch, wrong rank),
2 bad input (spec, checkpoint missing/truncated/mismatched: the file is named).

Spec (`--spec`, JSON; built from a recipe by `deployctl`, see `Spec.to_json`):
    {"kind": "engram-stage-spec", "version": 1,
     "recipe": "deepseek-v41-flash-tp4", "recipe_digest": "0123456789abcdef",
     "geometry": {"layers": [1, 14], "orders": [2, 3, 4], "heads_per_order": 8,
                  "vocab_per_order": [16000000, 16000000, 16000000], "row_values": 256,
                  "dtype": "F8_E4M3"},
     "weight_tensor": "layers.{layer}.engram.embed.weight",
     "scale_tensor": "layers.{layer}.engram.embed.scale",      # or null: no scale tensor
     "scale_dtype": "U8", "scale_values_per_row": 8,
     "layout": "sparse" | "packed", "tp": 4, "rank": 1,
     "free_margin_gb": 5.0,                                     # optional
     "chunk_bytes": 67108864}                                   # optional: checksum chunk size

What lands in DEST:
  layout "sparse" (default; what the patched vLLM reader expects): per layer L
      engram-L{L}.weight.bin   as large as the whole layer table (total_rows x row bytes); only the
      engram-L{L}.scale.bin    rank's rows are written, at their original offsets (global row r at
                               byte r x row_bytes); the rest is a hole (never written, takes no space)
      engram-local.json        {"layers": {"1": [lo, hi], "14": [lo, hi]}}: the rank's rows [lo, hi)
  layout "packed": per layer L one dense file
      engram-L{L}.packed.bin   a 4096-byte header, then the rank's rows as records of weight row +
                               scale row (256 B FP8 + 8 B E8M0 for DeepSeek), local row i (global row
                               lo + i) at byte 4096 + i x record_bytes. Header: b"DCTLENG1", u32 LE
                               header size (4096), u32 LE length n, n bytes of JSON (`packed_header`:
                               layer, row_start, row_end, total_rows, record_bytes, fields), zeros.
      engram-local.json        as above
  engram-manifest.json         written last: spec key, source identity (file names, sizes, mtimes,
                               header digests), every file with its size, staged byte range and
                               per-chunk sha256 (64 MiB chunks), recipe digest, tp, rank, layout.

Atomicity: the old manifest and engram-local.json are removed (and the folder fsynced) before any
data is touched; data files are written under temporary names (.NAME.tmp), fsynced and renamed;
the fidelity check runs on the renamed files; engram-local.json then the manifest are written
atomically. So a manifest always describes complete data, and a killed run is simply re-run.

Idempotence: same spec key (geometry, tensor names, dtypes, layout, tp, rank) + same source
identity + every file present with its size + same engram-local.json -> "skipped" without reading
table data (only the index and the relevant safetensors headers). The whole-recipe digest is
recorded but does not force a restage (changing an engine flag must not copy 196 GB again).

`check_rank(dest, expected_ranges)` is what the launch stage uses to refuse a host whose staged
rows belong to another rank; `read_staged_row` reads one row the way the engine does.
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import os
import random
import struct
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ..errors import DeployctlError, InputError, StageFailed
from ..fsutil import atomic_write_text, fsync_dir
from . import bulkcopy
from .geometry import RankRange, TableGeometry, rank_ranges
from .safetensors import DTYPE_BYTES, Checkpoint, TensorInfo

SPEC_KIND = "engram-stage-spec"
SPEC_VERSION = 1
MANIFEST_NAME = "engram-manifest.json"
MANIFEST_FORMAT = "deployctl-engram-manifest"
MANIFEST_VERSION = 1
LOCAL_NAME = "engram-local.json"
LOCK_NAME = ".engram-stage.lock"
PACKED_MAGIC = b"DCTLENG1"
PACKED_HEADER_BYTES = 4096
CHUNK_BYTES = 64 * 1024 * 1024     # checksum granularity
IO_BYTES = 8 * 1024 * 1024         # one read/hash/write piece (per thread: bounded memory)
FIDELITY_SAMPLES = 16              # random rows per layer, besides the first and last
SCALE_ALIASES = ({"U8", "E8M0", "F8_E8M0"},)   # one-byte E8M0 scales are labelled either way


class VerifyFailed(StageFailed):
    """Staged bytes differ from the manifest or from the checkpoint."""


class RankMismatch(StageFailed):
    """A host's staged rows are not the rows its rank owns."""


# ---------------------------------------------------------------------------------------------------
# The spec

@dataclass(frozen=True)
class Spec:
    geometry: TableGeometry
    weight_tensor: str
    scale_tensor: str | None
    scale_dtype: str
    scale_values_per_row: int
    layout: str
    tp: int
    rank: int
    recipe: str = ""
    recipe_digest: str = ""
    free_margin_gb: float = 0.0
    chunk_bytes: int = CHUNK_BYTES

    @classmethod
    def from_json(cls, d: Mapping[str, Any], source: str = "spec") -> "Spec":
        def need(key: str, kind: type | tuple) -> Any:
            if key not in d:
                raise InputError("missing key", file=source, key=key)
            v = d[key]
            if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
                raise InputError(f"expected {getattr(kind, '__name__', kind)}, got {v!r}",
                                 file=source, key=key)
            return v

        if not isinstance(d, Mapping):
            raise InputError("expected a JSON object", file=source)
        if d.get("kind", SPEC_KIND) != SPEC_KIND or d.get("version", SPEC_VERSION) != SPEC_VERSION:
            raise InputError(f"not an {SPEC_KIND} version {SPEC_VERSION} "
                             f"(kind {d.get('kind')!r}, version {d.get('version')!r})", file=source)
        g = need("geometry", dict)
        try:
            geo = TableGeometry(layers=tuple(int(x) for x in g["layers"]),
                                orders=tuple(int(x) for x in g["orders"]),
                                heads_per_order=int(g["heads_per_order"]),
                                vocab_per_order=tuple(int(x) for x in g["vocab_per_order"]),
                                row_values=int(g["row_values"]), dtype=str(g.get("dtype", "F8_E4M3")))
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"bad geometry: {e!r}", file=source, key="geometry") from None
        geo.validate("geometry", source)
        scale = d.get("scale_tensor")
        if scale is not None and not isinstance(scale, str):
            raise InputError(f"expected a string or null, got {scale!r}", file=source, key="scale_tensor")
        spec = cls(geometry=geo, weight_tensor=need("weight_tensor", str), scale_tensor=scale,
                   scale_dtype=str(d.get("scale_dtype", "U8")),
                   scale_values_per_row=int(d.get("scale_values_per_row", 8)),
                   layout=need("layout", str), tp=need("tp", int), rank=need("rank", int),
                   recipe=str(d.get("recipe", "")), recipe_digest=str(d.get("recipe_digest", "")),
                   free_margin_gb=float(d.get("free_margin_gb", 0.0)),
                   chunk_bytes=int(d.get("chunk_bytes", CHUNK_BYTES)))
        spec.check(source)
        return spec

    def check(self, source: str = "spec") -> None:
        if self.layout not in ("sparse", "packed"):
            raise InputError(f"expected 'sparse' or 'packed', got {self.layout!r}", file=source, key="layout")
        if self.tp < 1:
            raise InputError(f"must be >= 1, got {self.tp}", file=source, key="tp")
        if not 0 <= self.rank < self.tp:
            raise InputError(f"rank {self.rank} is outside 0..{self.tp - 1} (tp {self.tp})",
                             file=source, key="rank")
        for key, dtype in (("geometry.dtype", self.geometry.dtype), ("scale_dtype", self.scale_dtype)):
            if dtype not in DTYPE_BYTES:
                raise InputError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})",
                                 file=source, key=key)
        if "{layer}" not in self.weight_tensor:
            raise InputError("must contain {layer}", file=source, key="weight_tensor")
        if self.scale_tensor is not None and "{layer}" not in self.scale_tensor:
            raise InputError("must contain {layer}", file=source, key="scale_tensor")
        if self.scale_tensor is not None and self.scale_values_per_row < 1:
            raise InputError("must be >= 1 when there is a scale tensor", file=source,
                             key="scale_values_per_row")
        if self.chunk_bytes < 4096:
            raise InputError(f"must be >= 4096, got {self.chunk_bytes}", file=source, key="chunk_bytes")

    def to_json(self) -> dict[str, Any]:
        g = self.geometry
        return {"kind": SPEC_KIND, "version": SPEC_VERSION, "recipe": self.recipe,
                "recipe_digest": self.recipe_digest,
                "geometry": {"layers": list(g.layers), "orders": list(g.orders),
                             "heads_per_order": g.heads_per_order, "vocab_per_order": list(g.vocab_per_order),
                             "row_values": g.row_values, "dtype": g.dtype},
                "weight_tensor": self.weight_tensor, "scale_tensor": self.scale_tensor,
                "scale_dtype": self.scale_dtype, "scale_values_per_row": self.scale_values_per_row,
                "layout": self.layout, "tp": self.tp, "rank": self.rank,
                "free_margin_gb": self.free_margin_gb, "chunk_bytes": self.chunk_bytes}

    def with_rank(self, rank: int) -> "Spec":
        d = self.to_json()
        d["rank"] = rank
        return Spec.from_json(d)

    def key(self) -> dict[str, Any]:
        """What decides whether staged data is still right (besides the source identity)."""
        d = self.to_json()
        for k in ("recipe", "recipe_digest", "free_margin_gb", "kind"):
            d.pop(k)
        return d

    @property
    def weight_row_bytes(self) -> int:
        return self.geometry.row_values * DTYPE_BYTES[self.geometry.dtype]

    @property
    def scale_row_bytes(self) -> int:
        if self.scale_tensor is None:
            return 0
        return self.scale_values_per_row * DTYPE_BYTES[self.scale_dtype]

    @property
    def row_bytes(self) -> int:
        """Weight + scale bytes of one row."""
        return self.weight_row_bytes + self.scale_row_bytes

    def ranges(self) -> tuple[RankRange, ...]:
        return rank_ranges(self.geometry, self.tp, self.rank)

    def fields(self, layer: int) -> list[tuple[str, str, str, int]]:
        """(field, tensor name, dtype, row bytes) of a layer, in record order."""
        out = [("weight", self.weight_tensor.format(layer=layer), self.geometry.dtype, self.weight_row_bytes)]
        if self.scale_tensor is not None:
            out.append(("scale", self.scale_tensor.format(layer=layer), self.scale_dtype, self.scale_row_bytes))
        return out


def local_ranges(spec: Spec) -> dict[str, list[int]]:
    """engram-local.json's "layers" for a spec: {"1": [lo, hi], ...}."""
    return {str(r.layer): [r.row_start, r.row_end] for r in spec.ranges()}


# ---------------------------------------------------------------------------------------------------
# What is written: one OutFile per data file (pure: from the spec alone)

@dataclass(frozen=True)
class Field:
    name: str            # weight | scale
    tensor: str
    dtype: str
    row_bytes: int


@dataclass(frozen=True)
class OutFile:
    name: str
    layer: int
    kind: str            # weight | scale | packed
    fields: tuple[Field, ...]
    row_start: int       # the rank's global rows [row_start, row_end)
    row_end: int
    total_rows: int      # rows of the whole layer table
    offset: int          # byte offset of global row row_start in the file
    size: int            # apparent file size
    header: bytes = b""  # written at offset 0 (packed)

    @property
    def record_bytes(self) -> int:
        return sum(f.row_bytes for f in self.fields)

    @property
    def length(self) -> int:
        return (self.row_end - self.row_start) * self.record_bytes

    def row_offset(self, row: int) -> int:
        return self.offset + (row - self.row_start) * self.record_bytes

    def rows_per_piece(self) -> int:
        return max(1, IO_BYTES // self.record_bytes)

    def rows_per_chunk(self, chunk_bytes: int) -> int:
        """Whole records per checksum chunk (a chunk is read/written in pieces of <= IO_BYTES)."""
        return max(1, chunk_bytes // self.record_bytes)

    def chunks(self, chunk_bytes: int) -> list[tuple[int, int]]:
        """Global row ranges of the checksum chunks."""
        step = self.rows_per_chunk(chunk_bytes)
        return [(r, min(r + step, self.row_end)) for r in range(self.row_start, self.row_end, step)]

    def allocated_bytes(self) -> int:
        """Disk space the file takes (data blocks, rounded up to 4 KiB pages at both ends)."""
        if self.length == 0:
            return len(self.header) and 4096
        lo, hi = self.offset // 4096 * 4096, -(-(self.offset + self.length) // 4096) * 4096
        return hi - lo + (4096 if self.header else 0)


def packed_header(spec: Spec, rr: RankRange, total_rows: int, fields: Iterable[Field]) -> bytes:
    fields = list(fields)
    doc = {"format": "deployctl-engram-packed", "version": 1, "layer": rr.layer,
           "row_start": rr.row_start, "row_end": rr.row_end, "rows": rr.rows, "total_rows": total_rows,
           "tp": spec.tp, "rank": spec.rank, "record_bytes": sum(f.row_bytes for f in fields),
           "fields": [{"name": f.name, "dtype": f.dtype, "bytes": f.row_bytes} for f in fields],
           "data_offset": PACKED_HEADER_BYTES}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    head = PACKED_MAGIC + struct.pack("<II", PACKED_HEADER_BYTES, len(blob)) + blob
    assert len(head) <= PACKED_HEADER_BYTES
    return head + b"\0" * (PACKED_HEADER_BYTES - len(head))


def out_files(spec: Spec) -> list[OutFile]:
    from .geometry import layer_tables
    totals = {t.layer: t.rows for t in layer_tables(spec.geometry)}
    out = []
    for rr in spec.ranges():
        fields = [Field(*f) for f in spec.fields(rr.layer)]
        total = totals[rr.layer]
        if spec.layout == "sparse":
            for f in fields:
                out.append(OutFile(f"engram-L{rr.layer}.{f.name}.bin", rr.layer, f.name, (f,),
                                   rr.row_start, rr.row_end, total, rr.row_start * f.row_bytes,
                                   total * f.row_bytes))
        else:
            rec = sum(f.row_bytes for f in fields)
            out.append(OutFile(f"engram-L{rr.layer}.packed.bin", rr.layer, "packed", tuple(fields),
                               rr.row_start, rr.row_end, total, PACKED_HEADER_BYTES,
                               PACKED_HEADER_BYTES + rr.rows * rec, packed_header(spec, rr, total, fields)))
    return out


def is_our_file(name: str) -> bool:
    """Data and temporary files this op writes (and may delete) in DEST."""
    if name.startswith(".engram-L") and name.endswith(".tmp"):
        return True
    return name.startswith("engram-L") and name.endswith(".bin")


def tmp_name(name: str) -> str:
    return f".{name}.tmp"


# ---------------------------------------------------------------------------------------------------
# The checkpoint side

@dataclass(frozen=True)
class Sources:
    checkpoint: Checkpoint
    tensors: dict[tuple[int, str], TensorInfo]     # (layer, field) -> tensor

    def files(self) -> list[str]:
        return sorted({t.file.name for t in self.tensors.values()})

    def identity(self) -> list[dict]:
        return [i.to_json() for i in self.checkpoint.identity(self.files())]


def _same_dtype(a: str, b: str) -> bool:
    return a == b or any(a in s and b in s for s in SCALE_ALIASES)


def resolve_sources(spec: Spec, checkpoint: str | Path) -> Sources:
    """Find every Engram tensor and check it against the geometry (names the file on a mismatch)."""
    from .geometry import layer_tables
    ckpt = Checkpoint(checkpoint)
    totals = {t.layer: t.rows for t in layer_tables(spec.geometry)}
    tensors = {}
    for layer in spec.geometry.layers:
        for fname, tname, dtype, row_bytes in spec.fields(layer):
            t = ckpt.tensor(tname)
            where = str(t.file)
            if not _same_dtype(t.dtype, dtype):
                raise InputError(f"tensor {tname!r} is {t.dtype}; the recipe says {dtype}", file=where)
            if t.rows != totals[layer] or t.row_bytes != row_bytes:
                raise InputError(
                    f"tensor {tname!r} has shape {list(t.shape)} ({t.rows} rows of {t.row_bytes} B) but the "
                    f"recipe's geometry gives layer {layer} {totals[layer]} rows of {row_bytes} B: check "
                    "engram.geometry (vocab_per_order, heads_per_order, row_values) and "
                    "scale_values_per_row against this checkpoint", file=where)
            tensors[(layer, fname)] = t
    return Sources(ckpt, tensors)


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
                         if k in ("tp", "rank", "layout")) or f"{', '.join(diff)} changed"
        return False, f"staged for something else: {what}"
    ident = sources.identity()
    if m.get("source", {}).get("files") != ident:
        old_files = {f["name"]: f for f in m.get("source", {}).get("files", [])}
        changed = [i["name"] for i in ident if old_files.get(i["name"]) != i] or ["(file set)"]
        return False, f"checkpoint changed: {', '.join(changed)} (name, size, mtime or header differ)"
    for f in files:
        p = dest / f.name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            return False, f"{f.name} is missing"
        if size != f.size:
            return False, f"{f.name} is {size} bytes, expected {f.size}"
    local = read_json(dest / LOCAL_NAME)
    if not isinstance(local, dict) or local.get("layers") != local_ranges(spec):
        return False, f"{LOCAL_NAME} is missing or does not match rank {spec.rank}"
    n = sum(f.length for f in files)
    return True, (f"already staged: rank {spec.rank} of {spec.tp}, layout {spec.layout}, "
                  f"{len(files)} files ({n} bytes) from the same checkpoint "
                  f"({len(ident)} source files: same sizes, mtimes and header digests)")


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the filesystem holding `path` (or its nearest parent)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def reclaimable_bytes(dest: Path) -> int:
    """Space freed by removing what a restage replaces (our data and temporary files)."""
    total = 0
    if dest.is_dir():
        for e in os.scandir(dest):
            if is_our_file(e.name) and e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_blocks * 512
    return total


def space_report(spec: Spec, dest: Path, files: list[OutFile], current: bool) -> dict[str, Any]:
    need = 0 if current else sum(f.allocated_bytes() for f in files)
    margin = int(spec.free_margin_gb * 1e9)
    free, recl = free_bytes(dest), (0 if current else reclaimable_bytes(dest))
    return {"path": str(dest), "need_bytes": need, "margin_bytes": margin, "free_bytes": free,
            "reclaimable_bytes": recl, "ok": current or need + margin <= free + recl,
            "need_gb": gb(need), "free_gb": gb(free + recl), "margin_gb": spec.free_margin_gb}


def gb(n: int) -> float:
    """Bytes as decimal GB, 4 significant digits (50.69, 0.006543): small test disks stay readable."""
    return float(f"{n / 1e9:.4g}")


def invalidate_manifest(dest: Path) -> None:
    """Remove the manifest (then engram-local.json), durably: from here on nothing claims the folder
    holds complete data, so an interrupted run or a failed verify leads to a restage."""
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
# Interleaving (packed layout); contiguous copies go through bulkcopy

_WORD = {8: "Q", 4: "I", 2: "H", 1: "B"}


INTERLEAVE_BLOCK = 1 << 20         # output bytes interleaved at a time: the strided passes stay in cache


def interleave(out: memoryview, parts: list[tuple[memoryview, int]], rows: int) -> None:
    """Write `rows` records into `out`: each record = the next row of every part, in order.
    Strided copies with the widest word that divides every row size (8 B for 256 + 8), one
    cache-sized block of rows at a time (1.6x faster than whole pieces)."""
    sizes = [rb for _, rb in parts]
    ws = next(w for w in (8, 4, 2, 1) if all(s % w == 0 for s in sizes))
    rec = sum(sizes) // ws
    o = out[:rows * rec * ws].cast(_WORD[ws])
    srcs = [(mv[:rows * rb].cast(_WORD[ws]), rb // ws) for mv, rb in parts]
    block = max(1, INTERLEAVE_BLOCK // (rec * ws))
    for b0 in range(0, rows, block):
        b1 = min(rows, b0 + block)
        ob, col = o[b0 * rec:b1 * rec], 0
        for src, n in srcs:
            sb = src[b0 * n:b1 * n]
            for j in range(n):
                ob[col + j::rec] = sb[j::n]
            col += n


class Copier:
    """Write packed OutFiles (records of weight row + scale row, interleaved in user space) from Sources
    into open temporary files: chunks in parallel threads, each read/interleaved/hashed/written in
    pieces of <= IO_BYTES, sha256 per chunk, source and written pages dropped behind."""

    def __init__(self, spec: Spec, sources: Sources, threads: int,
                 progress: Callable[[int], None] | None = None):
        self.spec, self.sources, self.threads = spec, sources, threads
        self.progress = progress
        self._local = threading.local()
        self._stop = threading.Event()
        self._src_fds: dict[Path, int] = {}

    def _buf(self, name: str, size: int) -> memoryview:
        bufs = self._local.__dict__.setdefault("bufs", {})
        b = bufs.get(name)
        if b is None or len(b) < size:
            b = bufs[name] = bytearray(size)
        return memoryview(b)[:size]

    def _src_fd(self, t: TensorInfo) -> int:
        return self._src_fds[t.file]

    def _read(self, t: TensorInfo, row_bytes: int, row: int, rows: int, into: memoryview) -> None:
        want, pos = rows * row_bytes, t.offset + row * row_bytes
        got = 0
        while got < want:
            n = os.preadv(self._src_fd(t), [into[got:want]], pos + got)
            if n == 0:
                raise InputError(f"truncated: {t.name!r} ends early (read {pos + got} of "
                                 f"{t.offset + t.nbytes} bytes)", file=str(t.file))
            got += n

    def fill(self, f: OutFile, row: int, rows: int) -> memoryview:
        """The output bytes of rows [row, row+rows) of `f` (one piece, a thread-local buffer)."""
        parts = []
        for fld in f.fields:
            mv = self._buf(fld.name, rows * fld.row_bytes)
            self._read(self.sources.tensors[(f.layer, fld.name)], fld.row_bytes, row, rows, mv)
            parts.append((mv, fld.row_bytes))
        out = self._buf("out", rows * f.record_bytes)
        interleave(out, parts, rows)
        return out

    def _chunk(self, f: OutFile, fd: int, r0: int, r1: int) -> str:
        h = hashlib.sha256()
        step, row = f.rows_per_piece(), r0
        while row < r1:
            if self._stop.is_set():
                raise _Stopped()
            n = min(step, r1 - row)
            mv = self.fill(f, row, n)
            h.update(mv)
            off, done = f.row_offset(row), 0
            while done < len(mv):
                done += os.pwrite(fd, mv[done:], off + done)
            if self.progress:
                self.progress(len(mv))
            row += n
        # drop behind: the source pages are not needed again; start writeback of what we wrote
        # (on a Spark the page cache shares the 128 GB with the GPU)
        for fld in f.fields:
            t = self.sources.tensors[(f.layer, fld.name)]
            os.posix_fadvise(self._src_fd(t), t.offset + r0 * fld.row_bytes, (r1 - r0) * fld.row_bytes,
                             os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, f.row_offset(r0), (r1 - r0) * f.record_bytes, os.POSIX_FADV_DONTNEED)
        return h.hexdigest()

    def run(self, jobs: list[tuple[OutFile, int]]) -> dict[str, tuple[list[str], int]]:
        """jobs: (file, open fd). Returns {file name: ([sha256 per chunk], chunk bytes)}."""
        for f, _ in jobs:
            for fld in f.fields:
                t = self.sources.tensors[(f.layer, fld.name)]
                if t.file not in self._src_fds:
                    self._src_fds[t.file] = os.open(t.file, os.O_RDONLY)
        try:
            work = [(f, fd, i, r0, r1) for f, fd in jobs
                    for i, (r0, r1) in enumerate(f.chunks(self.spec.chunk_bytes))]
            sums: dict[str, list[str]] = {f.name: [""] * len(f.chunks(self.spec.chunk_bytes)) for f, _ in jobs}
            with ThreadPoolExecutor(max_workers=self.threads) as pool:
                futs = {pool.submit(self._chunk, f, fd, r0, r1): (f.name, i) for f, fd, i, r0, r1 in work}
                done, _ = wait(futs, return_when=FIRST_EXCEPTION)
                if any(fu.exception() for fu in done):
                    self._stop.set()
                    wait(futs)
                    errs = [fu.exception() for fu in futs if fu.exception()]
                    raise next((e for e in errs if not isinstance(e, _Stopped)), errs[0])
                for fu, (name, i) in futs.items():
                    sums[name][i] = fu.result()
            return {f.name: (sums[f.name], f.rows_per_chunk(self.spec.chunk_bytes) * f.record_bytes)
                    for f, _ in jobs}
        finally:
            for fd in self._src_fds.values():
                os.close(fd)
            self._src_fds.clear()


class _Stopped(Exception):
    pass


# ---------------------------------------------------------------------------------------------------
# Reading back: the engine's view, and the checkpoint's

def read_staged_row(dest: str | Path, layout: str, entry: Mapping[str, Any], row: int) -> dict[str, bytes]:
    """One global row of a layer as the engine reads it, {field: bytes}.

    `entry` is the layer's file entries from the manifest ({"files": [...]}) or the equivalent.
    sparse: byte row x row_bytes of engram-L{L}.{field}.bin (the global row offset, not the local one);
    packed: byte data_offset + (row - row_start) x record_bytes of engram-L{L}.packed.bin.
    """
    out = {}
    for fe in entry["files"]:
        path = Path(dest) / fe["name"]
        fields = fe["fields"]
        rec = sum(x["bytes"] for x in fields)
        if layout == "sparse":
            off = row * rec
        else:
            off = fe["data_offset"] + (row - fe["row_start"]) * rec
        with open(path, "rb") as fh:
            data = os.pread(fh.fileno(), rec, off)
        pos = 0
        for x in fields:
            out[x["name"]] = data[pos:pos + x["bytes"]]
            pos += x["bytes"]
    return out


def read_checkpoint_row(sources: Sources, layer: int, field: str, row: int) -> bytes:
    t = sources.tensors[(layer, field)]
    with open(t.file, "rb") as fh:
        return os.pread(fh.fileno(), t.row_bytes, t.offset + row * t.row_bytes)


def fidelity_check(spec: Spec, sources: Sources, dest: Path, manifest_files: list[dict],
                   rng: random.Random | None = None) -> int:
    """Compare rows at each layer's range start, end-1 and random points, read the engine's way,
    with the checkpoint's bytes at the same global row. Returns the number of rows checked."""
    rng = rng or random.Random()
    checked = 0
    for rr in spec.ranges():
        if rr.rows == 0:
            continue
        entry = {"files": [fe for fe in manifest_files if fe["layer"] == rr.layer]}
        rows = {rr.row_start, rr.row_end - 1} | {rng.randrange(rr.row_start, rr.row_end)
                                                  for _ in range(FIDELITY_SAMPLES)}
        for row in sorted(rows):
            staged = read_staged_row(dest, spec.layout, entry, row)
            for fname, *_ in spec.fields(rr.layer):
                want = read_checkpoint_row(sources, rr.layer, fname, row)
                if staged.get(fname) != want:
                    raise VerifyFailed(
                        f"fidelity: layer {rr.layer} row {row} ({fname}) read from {dest} the engine's way "
                        f"differs from the checkpoint ({sources.tensors[(rr.layer, fname)].file.name}); "
                        "the staged rows are not where the engine looks for them")
            checked += 1
    return checked


def verify_files(dest: Path, manifest: Mapping[str, Any], threads: int) -> int:
    """Re-hash every staged chunk (from the disk: cached pages are dropped first) against the manifest.
    Returns the bytes hashed; raises VerifyFailed naming the file, the chunk and its byte range."""
    total, bad = 0, []
    for fe in manifest["files"]:
        path = dest / fe["name"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise VerifyFailed(f"{path}: missing (listed in {MANIFEST_NAME})") from None
        if size != fe["size"]:
            raise VerifyFailed(f"{path}: {size} bytes, the manifest says {fe['size']}")
        cb, start, length = fe["chunk_bytes"], fe["offset"], fe["length"]
        with open(path, "rb") as fh:
            fd = fh.fileno()
            if fe.get("header_sha256"):
                head = os.pread(fd, fe["data_offset"], 0)
                if hashlib.sha256(head).hexdigest() != fe["header_sha256"]:
                    bad.append(f"{path} header (bytes 0..{fe['data_offset']})")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got = dict(bulkcopy.hash_chunks(fd, [(start, length)] if length else [], cb, workers=threads))
        for i, want in enumerate(fe["sha256"]):
            if got.get(i) != want:
                lo = start + i * cb
                bad.append(f"{path} chunk {i} (bytes {lo}..{min(lo + cb, start + length)})")
        total += length
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise VerifyFailed(f"corrupt staged data: {'; '.join(bad[:5])}{more}: sha256 differs from "
                           f"{MANIFEST_NAME}; the manifest is removed, run the stage again to restage")
    return total


# ---------------------------------------------------------------------------------------------------
# The rank check the launch stage uses

def expected_local(expected_ranges: Mapping[Any, Any] | Iterable[Any]) -> dict[str, list[int]]:
    """{layer: (lo, hi)} or RankRange-like objects -> engram-local.json's "layers" form."""
    if isinstance(expected_ranges, Mapping):
        return {str(k): [int(v[0]), int(v[1])] for k, v in expected_ranges.items()}
    return {str(r.layer): [r.row_start, r.row_end] for r in expected_ranges}


def check_rank(dest: str | Path, expected_ranges: Mapping[Any, Any] | Iterable[Any],
               read_text: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """Refuse a staged folder whose rows are not `expected_ranges` (the rank's rows per layer).

    expected_ranges: {layer: (row_start, row_end)} or RankRange objects (geometry.rank_ranges).
    read_text(path) -> text or None (missing): how to read a file of DEST; default: the local disk
    (the launch stage passes an SSH reader, or runs `engram-stage --check-rank` on the host).
    Returns the manifest; raises RankMismatch naming the folder, the layer, staged and expected rows.
    """
    def local_read(p: str) -> str | None:
        try:
            return Path(p).read_text()
        except FileNotFoundError:
            return None

    read = read_text or local_read
    want = expected_local(expected_ranges)
    base = str(dest).rstrip("/")
    mtext, ltext = read(f"{base}/{MANIFEST_NAME}"), read(f"{base}/{LOCAL_NAME}")
    if mtext is None or ltext is None:
        raise RankMismatch(f"{base}: no complete Engram staging ({MANIFEST_NAME if mtext is None else LOCAL_NAME} "
                           "missing); run `deployctl stage` first")
    try:
        manifest, local = json.loads(mtext), json.loads(ltext)
    except ValueError as e:
        raise RankMismatch(f"{base}: unreadable {MANIFEST_NAME} or {LOCAL_NAME} ({e}); restage") from None
    staged = local.get("layers") if isinstance(local, dict) else None
    mranges = {k: [v["row_start"], v["row_end"]] for k, v in manifest.get("layers", {}).items()}
    if staged != mranges:
        raise RankMismatch(f"{base}: {LOCAL_NAME} {staged} disagrees with {MANIFEST_NAME} {mranges}; restage")
    if staged != want:
        for layer in sorted(set(want) | set(staged or {}), key=lambda x: int(x)):
            if (staged or {}).get(layer) != want.get(layer):
                raise RankMismatch(
                    f"{base}: layer {layer} holds rows {(staged or {}).get(layer)} (staged for rank "
                    f"{manifest.get('rank')} of {manifest.get('tp')}) but this host's rank owns rows "
                    f"{want.get(layer)}; the engine would serve another rank's rows: restage this host")
    return manifest


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
          threads: int | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Stage (or skip, or verify) spec.rank's rows into `dest`. Returns the result document."""
    t0 = time.monotonic()
    dest = Path(dest).absolute()
    threads = threads or default_threads()
    sources = resolve_sources(spec, checkpoint)       # bad input fails before DEST is touched
    files = out_files(spec)
    base = {"op": "engram-stage", "dest": str(dest), "rank": spec.rank, "tp": spec.tp, "layout": spec.layout,
            "ranges": local_ranges(spec), "bytes": sum(f.length for f in files)}
    dest.mkdir(parents=True, exist_ok=True)
    with _Lock(dest):
        current, why = up_to_date(spec, sources, dest, files)
        if current:
            if not verify:
                return {**base, "status": "skipped", "reason": why, "seconds": round(time.monotonic() - t0, 3)}
            manifest = read_json(dest / MANIFEST_NAME)
            try:
                n = verify_files(dest, manifest, threads)
                rows = fidelity_check(spec, sources, dest, manifest["files"])
            except VerifyFailed:
                invalidate_manifest(dest)
                raise
            return {**base, "status": "skipped", "verified": True, "verified_bytes": n, "fidelity_rows": rows,
                    "reason": f"{why}; verified: every chunk's sha256 matches and {rows} rows match the "
                              "checkpoint", "seconds": round(time.monotonic() - t0, 3)}
        _say(log, f"staging rank {spec.rank} of {spec.tp} ({spec.layout}) into {dest}: {why}")
        space = space_report(spec, dest, files, False)
        if not space["ok"]:
            raise StageFailed(_space_message(space))
        invalidate(dest)
        written = _write_files(spec, sources, dest, files, threads, log)
        mfiles = [_manifest_file(f, *written[f.name]) for f in files]
        rows = fidelity_check(spec, sources, dest, mfiles)
        manifest = _manifest(spec, sources, files, mfiles, time.monotonic() - t0)
        verified = None
        if verify:
            verified = verify_files(dest, manifest, threads)
        atomic_write_text(dest / LOCAL_NAME, json.dumps({"layers": local_ranges(spec)}) + "\n")
        atomic_write_text(dest / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
        secs = time.monotonic() - t0
        out = {**base, "status": "ok", "reason": why, "seconds": round(secs, 3),
               "mb_per_s": round(base["bytes"] / max(secs, 1e-9) / 1e6, 1), "fidelity_rows": rows,
               "files": [f.name for f in files]}
        if verified is not None:
            out["verified"], out["verified_bytes"] = True, verified
        return out


def _space_message(space: Mapping[str, Any]) -> str:
    return (f"not enough free space on {space['path']}: need {space['need_gb']} GB + margin "
            f"{space['margin_gb']} GB, free {space['free_gb']} GB (counting files a restage replaces)")


def _write_files(spec: Spec, sources: Sources, dest: Path, files: list[OutFile], threads: int,
                 log: Callable[[str], None] | None) -> dict[str, tuple[list[str], int]]:
    """Write every file under its temporary name, fsync, rename. {name: (chunk sha256s, chunk bytes)}.

    A file of one field (sparse layout) is one contiguous byte range of one tensor: bulkcopy copies it
    kernel-side (copy_file_range) with preallocation and drop-behind. A packed file interleaves the
    weight and scale rows, which only user space can do: the Copier below."""
    fds: list[tuple[OutFile, int]] = []
    progress = _Progress(sum(f.length for f in files), log)
    sums: dict[str, tuple[list[str], int]] = {}
    try:
        for f in files:
            fd = os.open(dest / tmp_name(f.name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append((f, fd))
            os.ftruncate(fd, f.size)                      # holes: a sparse file costs no space
            if f.header:
                os.pwrite(fd, f.header, 0)
        for f, fd in fds:
            if len(f.fields) == 1:
                t = sources.tensors[(f.layer, f.fields[0].name)]
                seg = bulkcopy.Segment(str(t.file), t.offset + f.row_start * f.record_bytes, f.offset, f.length)
                r = bulkcopy.copy_segments(fd, [seg], chunk_bytes=spec.chunk_bytes, workers=threads,
                                           progress=progress.per_file())
                sums[f.name] = (r.chunks, r.chunk_bytes)
        packed = [(f, fd) for f, fd in fds if len(f.fields) > 1]
        if packed:
            sums.update(Copier(spec, sources, threads, progress).run(packed))
        for f, fd in fds:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        _discard(dest, fds)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StageFailed(f"no space left on {dest} while writing the Engram rows "
                              f"({gb(sum(f.allocated_bytes() for f in files))} GB needed, "
                              f"{gb(free_bytes(dest))} GB free after removing the partial files); "
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
    return sums


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


def _manifest_file(f: OutFile, sums: list[str], chunk_bytes: int) -> dict[str, Any]:
    d = {"name": f.name, "layer": f.layer, "kind": f.kind, "size": f.size,
         "row_start": f.row_start, "row_end": f.row_end, "total_rows": f.total_rows,
         "offset": f.offset, "length": f.length, "data_offset": f.offset if f.header else 0,
         "fields": [{"name": x.name, "tensor": x.tensor, "dtype": x.dtype, "bytes": x.row_bytes}
                    for x in f.fields],
         "chunk_bytes": chunk_bytes, "sha256": sums}
    if f.header:
        d["header_sha256"] = hashlib.sha256(f.header).hexdigest()
    return d


def _manifest(spec: Spec, sources: Sources, files: list[OutFile], mfiles: list[dict],
              seconds: float) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "complete": True,
        "key": spec.key(), "recipe": spec.recipe, "recipe_digest": spec.recipe_digest,
        "tp": spec.tp, "rank": spec.rank, "layout": spec.layout,
        "row_bytes": {"weight": spec.weight_row_bytes, "scale": spec.scale_row_bytes},
        "dtypes": {"weight": spec.geometry.dtype, "scale": spec.scale_dtype if spec.scale_tensor else None},
        "layers": {str(r.layer): {"row_start": r.row_start, "row_end": r.row_end, "head_start": r.head_start,
                                  "head_end": r.head_end, "total_rows": files_total(files, r.layer)}
                   for r in spec.ranges()},
        "source": {"checkpoint": str(sources.checkpoint.folder.absolute()), "files": sources.identity(),
                   "tensors": {f"{layer}.{fld}": {"name": t.name, "file": t.file.name, "dtype": t.dtype,
                                                  "shape": list(t.shape), "offset": t.offset}
                               for (layer, fld), t in sorted(sources.tensors.items())}},
        "files": mfiles, "bytes": sum(f.length for f in files),
        "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(seconds, 3),
    }


def files_total(files: list[OutFile], layer: int) -> int:
    return next(f.total_rows for f in files if f.layer == layer)


def check(spec: Spec, checkpoint: str | Path, dest: str | Path) -> dict[str, Any]:
    """What a run would do, without writing: up to date?, space needed and free (for the playbook)."""
    dest = Path(dest).absolute()
    sources = resolve_sources(spec, checkpoint)
    files = out_files(spec)
    current, why = up_to_date(spec, sources, dest, files) if dest.is_dir() else (False, f"{dest} does not exist")
    return {"op": "engram-stage", "status": "check", "up_to_date": current, "reason": why,
            "rank": spec.rank, "tp": spec.tp, **space_report(spec, dest, files, current)}


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

def load_spec(path: str, rank: int | None = None) -> Spec:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError("spec file not found", file=path) from None
    except ValueError as e:
        raise InputError(f"not JSON: {e}", file=path) from None
    if rank is not None and isinstance(raw, dict):
        raw = {**raw, "rank": rank}
    return Spec.from_json(raw, path)


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
    ap.add_argument("--check", action="store_true", help="report up-to-date and free space; write nothing")
    ap.add_argument("--check-rank", action="store_true",
                    help="refuse (exit 1) unless DEST holds exactly the spec's rank's rows")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    log = lambda m: print(f"engram-stage: {m}", file=sys.stderr, flush=True)
    try:
        spec = load_spec(a.spec, a.rank)
        if a.check_rank:
            m = check_rank(a.dest, spec.ranges())
            res = {"op": "engram-stage", "status": "rank-ok", "dest": a.dest, "rank": m.get("rank"),
                   "tp": m.get("tp"), "ranges": local_ranges(spec)}
        elif a.check:
            res = check(spec, a.checkpoint, a.dest)
        else:
            res = stage(spec, a.checkpoint, a.dest, verify=a.verify, threads=a.threads, log=log)
        code = 0
    except DeployctlError as e:
        log(f"error: {e}")
        res, code = error_result(e), e.exit_code
    except OSError as e:
        log(f"error: {e}")
        res, code = error_result(e), 1
    print(json.dumps(res, sort_keys=True), flush=True)
    return code
