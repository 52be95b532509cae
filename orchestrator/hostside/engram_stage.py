"""engram-stage: put one rank's rows of every Engram layer onto this node's disk, in the exact form the
patched vLLM engine reads through DSV41_ENGRAM_DIR (docs/engram-contract.md), at disk speed.

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
     "layout": "sparse", "tp": 4, "rank": 1,
     "free_margin_gb": 5.0,                                     # optional
     "chunk_bytes": 67108864,                                   # optional: checksum chunk size
     "link": true}                                              # optional: may hard-link (below)

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

Atomicity: the old manifest and engram-local.json are removed (and the folder fsynced) before any data
is touched: from then on the engine falls back to the model folder for this folder. Shard copies are
written under temporary names (.NAME.tmp), fsynced and renamed; then the index (atomically); the
fidelity check reads rows back through the index and headers in DEST exactly as the engine does;
engram-local.json then the manifest are written atomically. So a manifest always describes complete
data, and a killed run is simply re-run.

Idempotence: same spec key (geometry, tensor names, dtypes, layout, tp, rank) + same source identity
+ every file present with its size + the same index + the same engram-local.json -> "skipped" without
reading table data (only the index and the relevant safetensors headers). The whole-recipe digest is
recorded but does not force a restage (changing an engine flag must not copy 49 GB again).

`check_rank(dest, expected_ranges)` is what the launch stage uses to refuse a host whose staged rows
belong to another rank; `EngineView` reads rows the way the engine does.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ..errors import DeployctlError, InputError, StageFailed
from ..fsutil import atomic_write_bytes, atomic_write_text, fsync_dir
from . import bulkcopy
from .geometry import RankRange, TableGeometry, rank_ranges
from .safetensors import DTYPE_BYTES, INDEX_NAME, MAX_HEADER, Checkpoint, TensorInfo

SPEC_KIND = "engram-stage-spec"
SPEC_VERSION = 1
LAYOUTS = ("sparse",)
MANIFEST_NAME = "engram-manifest.json"
MANIFEST_FORMAT = "deployctl-engram-manifest"
MANIFEST_VERSION = 2               # 1: deployctl's own engram-L{L}.*.bin files, which no engine read
LOCAL_NAME = "engram-local.json"
LOCK_NAME = ".engram-stage.lock"
CHUNK_BYTES = 64 * 1024 * 1024     # checksum granularity
PAGE = 4096
FIDELITY_SAMPLES = 16              # random rows per layer and field, besides the first and last
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
    link: bool = False          # hard-link the Engram shards when DEST shares the checkpoint's filesystem

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
                   chunk_bytes=int(d.get("chunk_bytes", CHUNK_BYTES)), link=bool(d.get("link", False)))
        spec.check(source)
        return spec

    def check(self, source: str = "spec") -> None:
        if self.layout not in LAYOUTS:
            why = (": 'packed' was removed, no engine reads it (the patched vLLM reads only sparse copies "
                   "of the checkpoint's own shards, docs/engram-contract.md)" if self.layout == "packed" else "")
            raise InputError(f"expected 'sparse', got {self.layout!r}{why}", file=source, key="layout")
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
                "free_margin_gb": self.free_margin_gb, "chunk_bytes": self.chunk_bytes, "link": self.link}

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
        """(field, tensor name, dtype, row bytes) of a layer: weight, then scale."""
        out = [("weight", self.weight_tensor.format(layer=layer), self.geometry.dtype, self.weight_row_bytes)]
        if self.scale_tensor is not None:
            out.append(("scale", self.scale_tensor.format(layer=layer), self.scale_dtype, self.scale_row_bytes))
        return out


def local_ranges(spec: Spec) -> dict[str, list[int]]:
    """engram-local.json's "layers" for a spec: {"1": [lo, hi], ...}."""
    return {str(r.layer): [r.row_start, r.row_end] for r in spec.ranges()}


def staged_bytes(spec: Spec) -> int:
    """Table bytes a rank's staging copies (weight + scale rows; headers and the index aside). Pure."""
    return sum(r.rows for r in spec.ranges()) * spec.row_bytes


# ---------------------------------------------------------------------------------------------------
# The checkpoint side

@dataclass(frozen=True)
class Sources:
    checkpoint: Checkpoint
    tensors: dict[tuple[int, str], TensorInfo]     # (layer, field) -> tensor
    index: bytes                                   # model.safetensors.index.json, verbatim
    sizes: dict[str, int]                          # shard name -> size, for the shards holding Engram tensors
    data_starts: dict[str, int]                    # shard name -> 8 + header length

    def files(self) -> list[str]:
        return sorted({t.file.name for t in self.tensors.values()})

    def identity(self) -> list[dict]:
        return [i.to_json() for i in self.checkpoint.identity(self.files())]

    @property
    def index_sha256(self) -> str:
        return hashlib.sha256(self.index).hexdigest()


def _same_dtype(a: str, b: str) -> bool:
    return a == b or any(a in s and b in s for s in SCALE_ALIASES)


def index_bytes(ckpt: Checkpoint) -> bytes:
    """The checkpoint's index as it is on disk; for a checkpoint without one (a single file), an index
    with the weight map its headers give (the engine opens DIR/model.safetensors.index.json either way)."""
    p = ckpt.index_path
    if p is not None:
        return p.read_bytes()
    doc = {"metadata": {"deployctl": "written by engram-stage: the checkpoint has no index"},
           "weight_map": dict(sorted(ckpt.weight_map.items()))}
    return (json.dumps(doc, indent=2) + "\n").encode()


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
    names = sorted({t.file.name for t in tensors.values()})
    sizes = {n: (ckpt.folder / n).stat().st_size for n in names}
    starts = {n: ckpt.data_start(n) for n in names}
    return Sources(ckpt, tensors, index_bytes(ckpt), sizes, starts)


# ---------------------------------------------------------------------------------------------------
# What is written: one OutFile per shard holding Engram tensors (from the spec and the checkpoint's headers)

@dataclass(frozen=True)
class Piece:
    """The rank's rows of one Engram tensor inside a shard copy (offsets are the shard's own)."""
    layer: int
    field: str           # weight | scale
    tensor: str
    row_start: int       # global rows [row_start, row_end)
    row_end: int
    row_bytes: int
    offset: int          # absolute byte offset of row row_start: 8 + header + data_offsets[0] + row_start x row_bytes

    @property
    def length(self) -> int:
        return (self.row_end - self.row_start) * self.row_bytes

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "field": self.field, "tensor": self.tensor, "row_start": self.row_start,
                "row_end": self.row_end, "row_bytes": self.row_bytes, "offset": self.offset,
                "length": self.length}


@dataclass(frozen=True)
class OutFile:
    name: str                   # the shard's own file name
    size: int                   # apparent size: the shard's size
    header_bytes: int           # bytes [0, header_bytes) copied verbatim: 8 + header length
    pieces: tuple[Piece, ...]   # in file order
    mode: str = "copy"          # copy: the sparse copy; link: a hard link to the shard (every row, no bytes)

    @property
    def length(self) -> int:
        return sum(p.length for p in self.pieces)

    def spans(self) -> list[tuple[int, int]]:
        """The staged byte ranges (offset, length), in file order: what the per-chunk sha256 covers."""
        return [(p.offset, p.length) for p in self.pieces if p.length]

    def chunk_count(self, chunk_bytes: int) -> int:
        return -(-self.length // chunk_bytes)

    def allocated_bytes(self) -> int:
        """Disk space the copy takes: the header and the staged ranges, rounded out to 4 KiB pages
        (the union: two ranges sharing a page count it once). The holes take nothing; a link nothing."""
        if self.mode == "link":
            return 0
        iv = sorted([(0, self.header_bytes)] + [(o, o + n) for o, n in self.spans()])
        total, cur_lo, cur_hi = 0, -1, -1
        for lo, hi in iv:
            lo, hi = lo // PAGE * PAGE, -(-hi // PAGE) * PAGE
            if lo > cur_hi:
                total += cur_hi - cur_lo if cur_hi > cur_lo else 0
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        return total + (cur_hi - cur_lo if cur_hi > cur_lo else 0)


def out_files(spec: Spec, sources: Sources, mode: str = "copy") -> list[OutFile]:
    by_file: dict[str, list[Piece]] = {}
    for rr in spec.ranges():
        for fname, tname, _, rb in spec.fields(rr.layer):
            t = sources.tensors[(rr.layer, fname)]
            by_file.setdefault(t.file.name, []).append(
                Piece(rr.layer, fname, tname, rr.row_start, rr.row_end, rb, t.offset + rr.row_start * rb))
    return [OutFile(name, sources.sizes[name], sources.data_starts[name],
                    tuple(sorted(pieces, key=lambda p: p.offset)), mode)
            for name, pieces in sorted(by_file.items())]


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


def _same_inode(a: Path, b: Path) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except FileNotFoundError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def index_allocated(sources: Sources) -> int:
    return -(-len(sources.index) // PAGE) * PAGE


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


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


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
        if f.mode == "link" and not _same_inode(dest / f.name, sources.checkpoint.folder / f.name):
            return False, f"{f.name} is no longer a link to the checkpoint's shard"
    if _file_sha256(dest / INDEX_NAME) != sources.index_sha256:
        return False, f"{INDEX_NAME} in {dest} is missing or differs from the checkpoint's"
    local = read_json(dest / LOCAL_NAME)
    if not isinstance(local, dict) or local.get("layers") != local_ranges(spec):
        return False, f"{LOCAL_NAME} is missing or does not match rank {spec.rank}"
    n = sum(f.length for f in files)
    what = "shard links" if files and files[0].mode == "link" else "shard copies"
    return True, (f"already staged: rank {spec.rank} of {spec.tp}, layout {spec.layout}, "
                  f"{len(files)} {what} ({n} bytes of rows) from the same checkpoint "
                  f"({len(ident)} source files: same sizes, mtimes and header digests; same index)")


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
# Reading back: the engine's view, and the checkpoint's

class EngineView:
    """Rows of a folder read the way the patched engram.py's DiskEngramTable reads them
    (docs/engram-contract.md): DIR/model.safetensors.index.json -> weight_map[tensor] -> DIR/<file>;
    its header (u64 LE length n, n bytes of JSON) -> data_offsets[0]; row r at 8 + n + data_offsets[0]
    + r x row_bytes. Nothing is taken from the manifest: a copy without its header, or with rows at
    other offsets, reads wrong here exactly as it would in the engine."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._map: dict[str, str] | None = None
        self._headers: dict[str, tuple[int, dict]] = {}

    def locate(self, tensor: str) -> tuple[Path, int, tuple[int, ...]]:
        """(file, absolute offset of row 0, shape) of a tensor. Raises VerifyFailed saying what is wrong."""
        try:
            if self._map is None:
                self._map = json.loads((self.folder / INDEX_NAME).read_text())["weight_map"]
            fname = self._map[tensor]
            path = self.folder / fname
            if fname not in self._headers:
                with open(path, "rb") as f:
                    (n,) = struct.unpack("<Q", f.read(8))
                    if n > MAX_HEADER:
                        raise ValueError(f"header length {n} (no safetensors header at byte 0)")
                    self._headers[fname] = (n, json.loads(f.read(n)))
            n, header = self._headers[fname]
            meta = header[tensor]
            return path, 8 + n + int(meta["data_offsets"][0]), tuple(meta["shape"])
        except (OSError, KeyError, ValueError, TypeError, struct.error) as e:
            raise VerifyFailed(f"the engine's reader cannot find {tensor!r} in {self.folder}: "
                               f"{type(e).__name__}: {e}") from None

    def row(self, tensor: str, row: int, row_bytes: int) -> bytes:
        path, off, _ = self.locate(tensor)
        with open(path, "rb") as fh:
            return os.pread(fh.fileno(), row_bytes, off + row * row_bytes)


def read_checkpoint_row(sources: Sources, layer: int, field: str, row: int) -> bytes:
    t = sources.tensors[(layer, field)]
    with open(t.file, "rb") as fh:
        return os.pread(fh.fileno(), t.row_bytes, t.offset + row * t.row_bytes)


def fidelity_check(spec: Spec, sources: Sources, dest: Path, rng: random.Random | None = None) -> int:
    """Read rows at each layer's range start, end-1 and random points from DEST the engine's way (index,
    then header, then offsets) and compare them with the checkpoint's bytes of the same global rows.
    Returns the number of rows checked (per layer and row; every field compared)."""
    rng = rng or random.Random()
    view = EngineView(dest)
    checked = 0
    for rr in spec.ranges():
        for fname, tname, _, rb in spec.fields(rr.layer):
            _, off, shape = view.locate(tname)
            t = sources.tensors[(rr.layer, fname)]
            if (off, shape) != (t.offset, t.shape):
                raise VerifyFailed(
                    f"fidelity: {tname!r} in {dest} is at byte {off} with shape {list(shape)} by its header, "
                    f"the checkpoint's at byte {t.offset} with shape {list(t.shape)}: the engine would read "
                    "other bytes than the checkpoint's")
        if rr.rows == 0:
            continue
        rows = {rr.row_start, rr.row_end - 1} | {rng.randrange(rr.row_start, rr.row_end)
                                                  for _ in range(FIDELITY_SAMPLES)}
        for row in sorted(rows):
            for fname, tname, _, rb in spec.fields(rr.layer):
                if view.row(tname, row, rb) != read_checkpoint_row(sources, rr.layer, fname, row):
                    raise VerifyFailed(
                        f"fidelity: layer {rr.layer} row {row} ({fname}) read from {dest} the engine's way "
                        f"differs from the checkpoint ({sources.tensors[(rr.layer, fname)].file.name}); "
                        "the staged rows are not where the engine looks for them")
            checked += 1
    return checked


def verify_files(dest: Path, manifest: Mapping[str, Any], threads: int) -> int:
    """Re-hash every staged chunk (from the disk: cached pages are dropped first) and every header
    against the manifest, and the index. Returns the bytes hashed; raises VerifyFailed naming the file,
    the chunk and its byte range."""
    total, bad = 0, []
    idx = manifest.get("index", {})
    if _file_sha256(dest / INDEX_NAME) != idx.get("sha256"):
        bad.append(f"{dest / INDEX_NAME} (missing or changed)")
    for fe in manifest["files"]:
        path = dest / fe["name"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise VerifyFailed(f"{path}: missing (listed in {MANIFEST_NAME})") from None
        if size != fe["size"]:
            raise VerifyFailed(f"{path}: {size} bytes, the manifest says {fe['size']}")
        cb = fe["chunk_bytes"]
        spans = [(p["offset"], p["length"]) for p in fe["pieces"] if p["length"]]
        link = fe.get("mode") == "link"
        if link:
            src = Path(manifest.get("source", {}).get("checkpoint", "")) / fe["name"]
            if not _same_inode(path, src):
                bad.append(f"{path} (no longer a hard link to {src})")
            spans = []     # a link's rows are the checkpoint's own bytes (sync-model checks those)
        with open(path, "rb") as fh:
            fd = fh.fileno()
            head = os.pread(fd, fe["header_bytes"], 0)
            if hashlib.sha256(head).hexdigest() != fe["header_sha256"]:
                bad.append(f"{path} header (bytes 0..{fe['header_bytes']})")
            if not link:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got = dict(bulkcopy.hash_chunks(fd, spans, cb, workers=threads)) if spans else {}
        for i, want in enumerate(fe["sha256"]):
            if got.get(i) != want:
                bad.append(f"{path} chunk {i} ({_chunk_where(spans, i, cb)})")
        total += sum(n for _, n in spans)
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise VerifyFailed(f"corrupt staged data: {'; '.join(bad[:5])}{more}: sha256 differs from "
                           f"{MANIFEST_NAME}; the manifest is removed, run the stage again to restage")
    return total


def _chunk_where(spans: list[tuple[int, int]], i: int, cb: int) -> str:
    """Byte ranges of the file that chunk i of the span stream covers ("bytes a..b[, c..d]")."""
    lo, hi, pos, parts = i * cb, (i + 1) * cb, 0, []
    for off, n in spans:
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            parts.append(f"{off + a - pos}..{off + b - pos}")
        pos += n
    return "bytes " + ", ".join(parts)


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
    mode, mode_why = staging_mode(spec, sources, dest)
    files = out_files(spec, sources, mode)
    base = {"op": "engram-stage", "dest": str(dest), "rank": spec.rank, "tp": spec.tp, "layout": spec.layout,
            "ranges": local_ranges(spec), "bytes": sum(f.length for f in files), "mode": mode}
    dest.mkdir(parents=True, exist_ok=True)
    with _Lock(dest):
        current, why = up_to_date(spec, sources, dest, files)
        if current:
            if not verify:
                return {**base, "status": "skipped", "reason": why, "seconds": round(time.monotonic() - t0, 3)}
            manifest = read_json(dest / MANIFEST_NAME)
            try:
                n = verify_files(dest, manifest, threads)
                rows = fidelity_check(spec, sources, dest)
            except VerifyFailed:
                invalidate_manifest(dest)
                raise
            what = ("every link is still the checkpoint's shard, headers match" if mode == "link"
                    else "every chunk's sha256 matches")
            return {**base, "status": "skipped", "verified": True, "verified_bytes": n, "fidelity_rows": rows,
                    "reason": f"{why}; verified: {what} and {rows} rows match the checkpoint",
                    "seconds": round(time.monotonic() - t0, 3)}
        _say(log, f"staging rank {spec.rank} of {spec.tp} ({spec.layout}, {mode_why}) into {dest}: {why}")
        space = space_report(spec, sources, dest, files, False)
        if not space["ok"]:
            raise StageFailed(_space_message(space))
        invalidate(dest)
        written = None
        if mode == "link":
            try:
                written = _link_files(spec, sources, dest, files)
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
            invalidate(dest)
            raise
        mfiles = [_manifest_file(f, *written[f.name]) for f in files]
        manifest = _manifest(spec, sources, files, mfiles, time.monotonic() - t0)
        verified = None
        if verify:
            verified = verify_files(dest, manifest, threads)
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


def _link_files(spec: Spec, sources: Sources, dest: Path,
                files: list[OutFile]) -> dict[str, tuple[list[str], int, str, list[int] | None]]:
    """Hard-link every Engram shard of the checkpoint into DEST (temporary name, then rename): the
    engine reads the checkpoint's own bytes, every row present; nothing is copied. Raises OSError
    (EXDEV, EPERM, ...) with nothing left behind when the filesystem refuses."""
    out: dict[str, tuple[list[str], int, str, list[int] | None]] = {}
    made: list[Path] = []
    try:
        for f in files:
            src, tmp = sources.checkpoint.folder / f.name, dest / tmp_name(f.name)
            os.link(os.path.realpath(src), tmp)     # a symlinked shard (HF cache): link its blob (link(2)
                                                    # would link the symlink itself, dangling in DEST)
            made.append(tmp)
            with open(tmp, "rb") as fh:
                head = os.pread(fh.fileno(), f.header_bytes, 0)
            st = os.stat(tmp)
            out[f.name] = ([], spec.chunk_bytes, hashlib.sha256(head).hexdigest(), [st.st_dev, st.st_ino])
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
                   inode: list[int] | None = None) -> dict[str, Any]:
    d = {"name": f.name, "mode": f.mode, "size": f.size, "header_bytes": f.header_bytes,
         "header_sha256": header_sha256, "pieces": [p.to_json() for p in f.pieces], "length": f.length,
         "allocated_bytes": f.allocated_bytes(), "chunk_bytes": chunk_bytes, "sha256": sums}
    if inode is not None:
        d["inode"] = inode
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
        "files": mfiles, "bytes": sum(f.length for f in files),
        "allocated_bytes": sum(f.allocated_bytes() for f in files) + index_allocated(sources),
        "apparent_bytes": sum(f.size for f in files),
        "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(seconds, 3),
    }


def check(spec: Spec, checkpoint: str | Path, dest: str | Path) -> dict[str, Any]:
    """What a run would do, without writing: up to date?, space needed and free (for the playbook)."""
    dest = Path(dest).absolute()
    sources = resolve_sources(spec, checkpoint)
    mode, mode_why = staging_mode(spec, sources, dest)
    files = out_files(spec, sources, mode)
    current, why = up_to_date(spec, sources, dest, files) if dest.is_dir() else (False, f"{dest} does not exist")
    return {"op": "engram-stage", "status": "check", "up_to_date": current, "reason": why, "mode": mode,
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
