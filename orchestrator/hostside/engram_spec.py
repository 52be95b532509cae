"""engram-stage's input: the spec (which rank, which rows, which tensors) and where the rank's rows are in
the checkpoint (`Sources`, read from the safetensors headers only). Standard library only.

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
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError, StageFailed
from .geometry import RankRange, TableGeometry, rank_ranges
from .tableproof import SAMPLE_BYTES
from .safetensors import DTYPE_BYTES, Checkpoint, TensorInfo


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
    sample_bytes: int = SAMPLE_BYTES   # what a no-op re-hashes of the staged rows (hostside/tableproof.py)

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
                   chunk_bytes=int(d.get("chunk_bytes", CHUNK_BYTES)), link=bool(d.get("link", False)),
                   sample_bytes=int(d.get("sample_bytes", SAMPLE_BYTES)))
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
        if self.sample_bytes < 0:
            raise InputError(f"must be >= 0, got {self.sample_bytes}", file=source, key="sample_bytes")

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
                "free_margin_gb": self.free_margin_gb, "chunk_bytes": self.chunk_bytes, "link": self.link,
                "sample_bytes": self.sample_bytes}

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


def spec_for(recipe: Any, rank: int, tp: int | None = None) -> Spec:
    """The spec of RECIPE's (an orchestrator.recipe.Recipe) Engram tables for `rank` of `tp` (default the
    recipe's tensor_parallel): what stage-engram runs and what sync-model sends a rank of."""
    eg = recipe.engram
    if eg is None:
        raise InputError(f"recipe {recipe.name} has no Engram tables", key="engram")
    spec = Spec(geometry=eg.geometry, weight_tensor=eg.weight_tensor, scale_tensor=eg.scale_tensor,
                scale_dtype=eg.scale_dtype, scale_values_per_row=eg.scale_values_per_row,
                layout=eg.layout, tp=tp or recipe.parallelism.tensor_parallel, rank=rank,
                recipe=recipe.name, recipe_digest=recipe.digest, free_margin_gb=eg.free_margin_gb,
                link=eg.staging == "auto" and recipe.model.source != "shared")
    spec.check(f"recipe {recipe.name}")
    return spec


def local_ranges(spec: Spec) -> dict[str, list[int]]:
    """engram-local.json's "layers" for a spec: {"1": [lo, hi], ...}."""
    return {str(r.layer): [r.row_start, r.row_end] for r in spec.ranges()}


def staged_bytes(spec: Spec) -> int:
    """Table bytes a rank's staging copies (weight + scale rows; headers and the index aside). Pure."""
    return sum(r.rows for r in spec.ranges()) * spec.row_bytes


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


def index_allocated(sources: Sources) -> int:
    return -(-len(sources.index) // PAGE) * PAGE

