"""Synthetic safetensors checkpoints shaped like a recipe's (for tests, benchmarks and the demo).

Real weights cannot be downloaded here, so the tables are made with the recipe's geometry
(usually scaled down with --set / recipe_overrides) and deterministic content: every global row
has bytes derived from (tensor, row), so any row can be checked independently of the writer.
Tensors are written one row block at a time (bounded memory, any size).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from orchestrator.recipe import Recipe
from orchestrator.tables import geometry as G
from orchestrator.tables.safetensors import DTYPE_BYTES

BLOCK_ROWS = 4096


@dataclass(frozen=True)
class TensorPlan:
    name: str
    dtype: str
    rows: int
    width: int           # bytes per row


def _block(name: str, start: int, n: int, width: int) -> bytes:
    # Fast path for large tensors: a per-block seed, rotated per row (still a pure function of row).
    base = hashlib.blake2b(f"{name}:blk{start // BLOCK_ROWS}".encode(), digest_size=64).digest()
    base = (base * (width // 64 + 2))
    out = bytearray()
    for r in range(start, start + n):
        k = r % 61
        out += base[k:k + width]
    return bytes(out)


def expected_row(name: str, row: int, width: int) -> bytes:
    """What `write_checkpoint` stored for `row` of tensor `name`."""
    return _block(name, row - row % BLOCK_ROWS, BLOCK_ROWS, width)[(row % BLOCK_ROWS) * width:
                                                                  (row % BLOCK_ROWS + 1) * width]


def write_checkpoint(folder: str | Path, tensors: list[TensorPlan], files: int = 3,
                     extra: dict[str, bytes] | None = None) -> Path:
    """Write `tensors` round-robin over `files` safetensors files plus the index json."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    groups: list[list[TensorPlan]] = [[] for _ in range(max(1, files))]
    for i, t in enumerate(tensors):
        groups[i % len(groups)].append(t)
    weight_map = {}
    for fi, group in enumerate(groups):
        if not group:
            continue
        fname = f"model-{fi + 1:05d}-of-{len(groups):05d}.safetensors"
        header, off = {}, 0
        for t in group:
            n = t.rows * t.width
            values = t.width // DTYPE_BYTES[t.dtype]
            header[t.name] = {"dtype": t.dtype, "shape": [t.rows, values], "data_offsets": [off, off + n]}
            off += n
            weight_map[t.name] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        tmp = folder / f".{fname}.tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb)
            for t in group:
                for start in range(0, t.rows, BLOCK_ROWS):
                    f.write(_block(t.name, start, min(BLOCK_ROWS, t.rows - start), t.width))
        os.replace(tmp, folder / fname)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps({"synthetic": True}))
    for name, data in (extra or {}).items():
        (folder / name).write_bytes(data)
    return folder


def recipe_tensors(recipe: Recipe, dense_mb: int = 1) -> list[TensorPlan]:
    """The tensors a recipe's staging stages read (Engram / PLE), plus a little dense weight."""
    out = [TensorPlan("model.embed_tokens.weight", "BF16", dense_mb * 2048, 512)]
    eg = recipe.engram
    if eg is not None:
        for t in G.layer_tables(eg.geometry):
            out.append(TensorPlan(eg.weight_tensor.format(layer=t.layer), eg.geometry.dtype, t.rows,
                                  eg.geometry.row_values))
            if eg.scale_tensor:
                out.append(TensorPlan(eg.scale_tensor.format(layer=t.layer), eg.scale_dtype, t.rows,
                                      eg.scale_values_per_row))
    ple = recipe.ple
    if ple is not None:
        total = G.total_rows(ple.geometry)
        layer = ple.geometry.layers[0]
        base, rem = divmod(total, ple.shards)
        for i in range(ple.shards):
            out.append(TensorPlan(ple.shard_tensor.format(layer=layer, shard=i), ple.geometry.dtype,
                                  base + (1 if i < rem else 0), ple.geometry.row_values))
    return out
