"""ple-write's input: the spec, the checkpoint's shard tensors it reads (`Source`), which byte ranges of
them make each rank's table (`segments_for`), and the pinned placement's RAM verdict (also used by
preflight). Standard library only.

The spec (written by `deployctl`, see orchestrator/stages/write_ple.py `spec_for`):

    {"format": "deployctl-ple-spec/2", "placement": "nvme" | "pinned" | ...,
     "geometry": {"layers": [2], "orders": [2, 3], "heads_per_order": 8,
                  "vocab_per_order": [20000000, 20000000], "row_values": 160, "dtype": "F8_E4M3"},
     "shard_tensor": "model.language_model.layers.{layer}....shard_{shard}.weight", "shards": 128,
     "tp": 1, "ranks": [0],
     "engine_config": {"make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 128},
     "min_host_ram_gb": 64.0, "recipe": {"name": ..., "digest": ...}}

`engine_config` must equal the checkpoint's config.json (text_config): the recipe's values name the
file at plan time, the checkpoint's are what the engine uses; a difference is bad input.
"""
from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DeployctlError, InputError
from . import bulkcopy
from .geometry import TableGeometry, total_rows
from .ple_layout import CONFIG_KEYS, RankTable, check_engine_config, engine_config, rank_table
from .safetensors import DTYPE_BYTES, Checkpoint

MANIFEST_SUFFIX = ".deployctl-manifest.json"   # beside each table: <table>.deployctl-manifest.json


class WriteFailed(DeployctlError):
    """The table could not be written (I/O, space, read-back mismatch, RAM): exit 1."""
    exit_code = 1
SPEC_FORMAT = "deployctl-ple-spec/2"



@dataclass(frozen=True)
class PleTableSpec:
    placement: str
    geometry: TableGeometry
    shard_tensor: str
    shards: int
    tp: int = 1
    ranks: tuple[int, ...] = (0,)
    engine_config: dict = field(default_factory=dict)   # make_ngram_vocab_size_divisible_by, split_ngram_parts
    min_host_ram_gb: float = 64.0
    recipe: dict = field(default_factory=dict)
    source: str = "spec"                   # where it came from, for messages

    @property
    def layer(self) -> int:
        return self.geometry.layers[0]

    @property
    def width(self) -> int:
        return self.geometry.row_values

    @property
    def row_bytes(self) -> int:
        return self.geometry.row_values * DTYPE_BYTES[self.geometry.dtype]

    def shard_name(self, i: int) -> str:
        return self.shard_tensor.format(layer=self.layer, shard=i)

    def tables(self) -> list[RankTable]:
        """The file of every rank this host writes (ple_layout.py: the engine's own rules)."""
        rows = total_rows(self.geometry)
        return [rank_table(rows, self.width, self.geometry.dtype, self.tp, r,
                           divisible_by=self.engine_config["make_ngram_vocab_size_divisible_by"],
                           split_parts=self.engine_config["split_ngram_parts"]) for r in self.ranks]

    def to_json(self) -> dict:
        g = self.geometry
        return {"format": SPEC_FORMAT, "placement": self.placement,
                "geometry": {"layers": list(g.layers), "orders": list(g.orders),
                             "heads_per_order": g.heads_per_order,
                             "vocab_per_order": list(g.vocab_per_order),
                             "row_values": g.row_values, "dtype": g.dtype},
                "shard_tensor": self.shard_tensor, "shards": self.shards, "tp": self.tp,
                "ranks": list(self.ranks), "engine_config": dict(self.engine_config),
                "min_host_ram_gb": self.min_host_ram_gb, "recipe": dict(self.recipe)}



def manifest_name(table: str) -> str:
    return table + MANIFEST_SUFFIX



def parse_spec(doc: Any, source: str = "spec") -> PleTableSpec:
    """Check a spec document (see the module doc); errors name the key."""
    def bad(key: str, msg: str) -> InputError:
        return InputError(msg, file=source, key=key)

    if not isinstance(doc, dict):
        raise bad("", "expected a JSON object")
    if doc.get("format") != SPEC_FORMAT:
        raise bad("format", f"expected {SPEC_FORMAT!r}, got {doc.get('format')!r}")

    def need(d: dict, key: str, typ: type | tuple, path: str) -> Any:
        if key not in d:
            raise bad(f"{path}{key}", "missing")
        v = d[key]
        if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
            raise bad(f"{path}{key}", f"expected {getattr(typ, '__name__', typ)}, got {v!r}")
        return v

    g = need(doc, "geometry", dict, "")
    ints = lambda k: tuple(need({k: x}, k, int, "geometry.") for x in need(g, k, list, "geometry."))
    geom = TableGeometry(layers=ints("layers"), orders=ints("orders"),
                         heads_per_order=need(g, "heads_per_order", int, "geometry."),
                         vocab_per_order=ints("vocab_per_order"),
                         row_values=need(g, "row_values", int, "geometry."),
                         dtype=need(g, "dtype", str, "geometry."))
    geom.validate("geometry", source)
    if geom.dtype not in DTYPE_BYTES:
        raise bad("geometry.dtype", f"unknown safetensors dtype {geom.dtype!r}")
    if len(geom.layers) != 1:
        raise bad("geometry.layers", f"a PLE table file holds one layer's table; got layers "
                  f"{list(geom.layers)}")
    shards = need(doc, "shards", int, "")
    if shards < 1:
        raise bad("shards", "must be >= 1")
    tensor = need(doc, "shard_tensor", str, "")
    _check_format(tensor, {"layer", "shard"}, "shard_tensor", source, required={"shard"})
    tp = need(doc, "tp", int, "")
    ranks = tuple(need({"ranks": r}, "ranks", int, "") for r in need(doc, "ranks", list, ""))
    if tp < 1 or not ranks or any(not 0 <= r < tp for r in ranks) or len(set(ranks)) != len(ranks):
        raise bad("ranks", f"expected distinct ranks in 0..{tp - 1}, got {list(ranks)}")
    ec = need(doc, "engine_config", dict, "")
    conf = {k: need(ec, k, int, "engine_config.") for k in CONFIG_KEYS}
    for k, v in conf.items():
        if v < 1:
            raise bad(f"engine_config.{k}", f"must be >= 1, got {v}")
    ram = doc.get("min_host_ram_gb", 64.0)
    if isinstance(ram, bool) or not isinstance(ram, (int, float)):
        raise bad("min_host_ram_gb", f"expected a number, got {ram!r}")
    spec = PleTableSpec(placement=need(doc, "placement", str, ""), geometry=geom,
                        shard_tensor=tensor, shards=shards, tp=tp, ranks=ranks, engine_config=conf,
                        min_host_ram_gb=float(ram), recipe=dict(doc.get("recipe") or {}),
                        source=source)
    spec.tables()                          # the engine's own divisibility rules (InputError)
    return spec



def _check_format(text: str, allowed: set[str], key: str, source: str,
                  required: set[str] = frozenset()) -> None:
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise InputError(f"{text!r}: {e}", file=source, key=key) from None
    unknown = names - allowed
    if unknown:
        raise InputError(f"{text!r}: unknown placeholder {{{sorted(unknown)[0]}}} (known: "
                         f"{', '.join('{%s}' % a for a in sorted(allowed))})", file=source, key=key)
    if required - names:
        raise InputError(f"{text!r}: needs {{{sorted(required - names)[0]}}}", file=source, key=key)



def load_spec(path: str | Path) -> PleTableSpec:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise InputError("spec file not found", file=str(path)) from None
    except ValueError as e:
        raise InputError(f"not JSON: {e}", file=str(path)) from None
    return parse_spec(doc, str(path))



def pinned_ram_verdict(available_bytes: int, spec: Any, host: str | None = None) -> tuple[bool, str]:
    """Whether a host with `available_bytes` of available RAM (MemAvailable) can hold the pinned
    PLE table. `spec` is the recipe's PleSpec, a PleTableSpec or a spec mapping (its
    min_host_ram_gb, decimal GB). Pure: (ok, message naming the host, needed and available GB)."""
    need = spec.get("min_host_ram_gb") if isinstance(spec, dict) else getattr(spec, "min_host_ram_gb")
    need_gb = float(need if need is not None else 64.0)
    have_gb = available_bytes / 1e9
    who = host or "this host"
    if have_gb >= need_gb:
        return True, (f"{who}: {have_gb:.1f} GB RAM available >= {need_gb:g} GB needed for the "
                      "pinned PLE table (ple.min_host_ram_gb)")
    return False, (f"{who}: refusing placement 'pinned': the PLE table in pinned system RAM needs "
                   f"{need_gb:g} GB available (ple.min_host_ram_gb) but {who} has {have_gb:.1f} GB "
                   "available (MemAvailable). Free memory on the host, use a host with more RAM, "
                   "or put the table on NVMe (--set ple.placement=nvme)")



def mem_available(meminfo: str = "/proc/meminfo") -> int:
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise WriteFailed(f"{meminfo} has no MemAvailable line")



@dataclass(frozen=True)
class Source:
    checkpoint: Checkpoint
    rows: int
    tensors: list[dict]                    # name, file, offset, rows (in shard order)
    identity: list[dict]                   # Checkpoint.identity of the files holding the shards
    config: dict                           # the checkpoint's config.json values (ple_layout.engine_config)



def resolve_source(spec: PleTableSpec, checkpoint_dir: str | Path) -> Source:
    """Find every shard; check dtype, width, the row total against the geometry and the shards'
    places under the checkpoint's split_ngram_parts (exit 2)."""
    ck = Checkpoint(checkpoint_dir)
    config = engine_config(ck.folder)
    check_engine_config(config, spec.engine_config, str(ck.folder / "config.json"), spec.layer)
    names = [spec.shard_name(i) for i in range(spec.shards)]
    missing = [i for i, n in enumerate(names) if not ck.has(n)]
    if missing:
        shown = ", ".join(f"shard {i} ({names[i]!r})" for i in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise InputError(f"{len(missing)} of {spec.shards} PLE shard tensors missing: {shown}{more}; "
                         f"the recipe expects shards 0..{spec.shards - 1} named by ple.shard_tensor",
                         file=str(ck.folder))
    tensors = []
    for i, name in enumerate(names):
        t = ck.tensor(name)
        where = f"shard {i} ({name!r}) in {t.file.name}"
        if t.dtype != spec.geometry.dtype:
            raise InputError(f"{where} is {t.dtype}, the recipe's ple.geometry.dtype is "
                             f"{spec.geometry.dtype}", file=str(t.file))
        if len(t.shape) != 2 or t.shape[1] != spec.width:
            width = t.shape[1] if len(t.shape) == 2 else f"shape {list(t.shape)}"
            raise InputError(f"{where} has shape {list(t.shape)}: width {width}, but the recipe's "
                             f"ple.geometry.row_values is {spec.width}", file=str(t.file))
        tensors.append({"name": name, "file": t.file.name, "offset": t.offset, "rows": t.rows})
    rows = sum(t["rows"] for t in tensors)
    expect = total_rows(spec.geometry)
    if rows != expect:
        g = spec.geometry
        raise InputError(
            f"the {spec.shards} PLE shards hold {rows:,} rows but the recipe geometry has "
            f"{expect:,} rows (prime scheme: layers {list(g.layers)}, orders {list(g.orders)}, "
            f"{g.heads_per_order} heads per order, base vocabulary {list(g.vocab_per_order)}); "
            "check ple.geometry and ple.shards against the checkpoint", file=str(ck.folder))
    first = spec.tables()[0]
    stride, org = first.shard_stride, first.org_vocab_size
    for i, t in enumerate(tensors):
        if t["rows"] > stride or i * stride + t["rows"] > org:
            # the engine would overwrite the next shard's rows with these (or drop them)
            raise InputError(
                f"shard {i} ({t['name']!r}) has {t['rows']:,} rows but SGLang places shard i at row "
                f"i x {stride:,} (ceil({org:,} padded rows / split_ngram_parts "
                f"{spec.engine_config['split_ngram_parts']})): it would overlap "
                f"{'the next shard' if t['rows'] > stride else 'the end of the table'}; check "
                "ple.shards and ple.split_ngram_parts against the checkpoint", file=str(ck.folder))
    files = sorted({t["file"] for t in tensors})
    identity = [i.to_json() for i in ck.identity(files)]
    return Source(ck, rows, tensors, identity, config)



def segments_for(table: RankTable, src: Source, row_bytes: int) -> list[bulkcopy.Segment]:
    """Checkpoint byte ranges -> this rank's file, where load_qwen4_exp_ple_shard puts them."""
    out = []
    for i, t in enumerate(src.tensors):
        placed = table.place(i, t["rows"])
        if placed:
            dst_row, src_row, n = placed
            out.append(bulkcopy.Segment(str(src.checkpoint.folder / t["file"]),
                                        t["offset"] + src_row * row_bytes, dst_row * row_bytes,
                                        n * row_bytes))
    return out



def spans_of(segments: list[bulkcopy.Segment]) -> list[list[int]]:
    return [[s.dst_off, s.length] for s in bulkcopy.merge_adjacent(segments)]



def table_key(spec: PleTableSpec, src: Source, table: RankTable) -> str:
    doc = {"geometry": spec.to_json()["geometry"], "layout": table.to_json(), "tensors": src.tensors,
           "identity": src.identity}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()

