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
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from orchestrator.recipe import Recipe
from orchestrator.hostside import geometry as G
from orchestrator.hostside.safetensors import DTYPE_BYTES

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


SPACE_MARGIN = 2 << 30      # left free after a synthetic checkpoint: the tests and the engines need room too


class SpaceError(RuntimeError):
    """Not enough free space for a synthetic checkpoint: refused before a byte is written."""


def checkpoint_bytes(tensors: list[TensorPlan]) -> int:
    """What write_checkpoint will write for TENSORS (data; headers and the index are a few KB)."""
    return sum(t.rows * t.width for t in tensors)


def check_space(folder: str | Path, tensors: list[TensorPlan], what: str = "a synthetic checkpoint") -> None:
    """Refuse, naming the size, when FOLDER's filesystem cannot take TENSORS plus SPACE_MARGIN."""
    need = checkpoint_bytes(tensors)
    probe = Path(folder)
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need + SPACE_MARGIN > free:
        raise SpaceError(f"{what} of {need / 1e9:.1f} GB does not fit in {folder}: {free / 1e9:.1f} GB free on "
                         f"its filesystem, {(need + SPACE_MARGIN) / 1e9:.1f} GB needed with a "
                         f"{SPACE_MARGIN >> 30} GiB margin (scale the recipe down with recipe_overrides / --set, "
                         f"or free space)")


def write_checkpoint(folder: str | Path, tensors: list[TensorPlan], files: int = 3,
                     extra: dict[str, bytes] | None = None, config: dict | None = None) -> Path:
    """Write `tensors` round-robin over `files` safetensors files plus the index json and
    config.json (`config`, default a placeholder). Refuses (SpaceError) before writing anything when
    the filesystem cannot take it."""
    folder = Path(folder)
    check_space(folder, tensors)
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
    (folder / "config.json").write_text(json.dumps(config or {"synthetic": True}, indent=1))
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
        layer = ple.geometry.layers[0]
        for i, rows in enumerate(ple_shard_rows(ple)):
            out.append(TensorPlan(ple.shard_tensor.format(layer=layer, shard=i), ple.geometry.dtype,
                                  rows, ple.geometry.row_values))
    return out


def ple_shard_rows(ple, shards: int | None = None) -> list[int]:
    """Rows of each PLE checkpoint shard as an exporter for the released SGLang cuts them: shard i
    holds global rows [i x stride, ...) with stride = ceil(padded rows / split_ngram_parts)
    (sglang qwen4_exp.py load_qwen4_exp_ple_shard), the last one the remainder."""
    shards = shards or ple.shards
    total = G.total_rows(ple.geometry)
    div = ple.make_ngram_vocab_size_divisible_by
    stride = -(-((total + div - 1) // div * div) // ple.split_ngram_parts)
    return [max(0, min(stride, total - i * stride)) for i in range(shards)]


def recipe_config(recipe: Recipe) -> dict:
    """config.json of a synthetic checkpoint: for a PLE recipe the Qwen4-Exp fields SGLang sizes and
    places the table with (configs/qwen4_exp.py, text_config authoritative)."""
    ple = recipe.ple
    if ple is None:
        return {"synthetic": True, **engram_config(recipe)}
    g = ple.geometry
    heads = len(g.orders) * g.heads_per_order
    return {"synthetic": True, "architectures": ["Qwen4ExpForConditionalGeneration"],
            "model_type": "qwen4_exp",
            "text_config": {"model_type": "qwen4_exp_text", "ple_layer_ids": [g.layers[0] + 1],
                            # what Qwen4ExpNGramEmbedding.__init__ also reads (hash multipliers, EOS)
                            "vocab_size": 248320, "eos_token_id": 248044, "num_hidden_layers": 48,
                            "ngram_size": max(g.orders), "heads_per_ngram": g.heads_per_order,
                            "ngram_vocab_size_base": g.vocab_per_order[0],
                            "ple_embed_dim": heads * g.row_values, "hidden_size": heads * g.row_values,
                            "make_ngram_vocab_size_divisible_by": ple.make_ngram_vocab_size_divisible_by,
                            "split_ngram_parts": ple.split_ngram_parts,
                            "ple_embedding_dtype": "float8_e4m3fn" if g.dtype == "F8_E4M3" else None}}


def engram_config(recipe: Recipe) -> dict:
    """The DeepSeek-V4.1 config.json keys the patched vLLM engram.py builds its Engram tables from
    (EngramLayout: engram_layer_ids, engram_vocab_size, engram_max_ngram_size, engram_n_heads,
    engram_head_dim; one scale per 32 values), for a recipe whose geometry they can express (one
    base vocabulary for every order, orders 2..N); {} otherwise (the engine double then reads nothing)."""
    eg = recipe.engram
    if eg is None:
        return {}
    g = eg.geometry
    if len(set(g.vocab_per_order)) != 1 or list(g.orders) != list(range(2, 2 + len(g.orders))):
        return {}
    return {"engram_layer_ids": list(g.layers), "engram_vocab_size": g.vocab_per_order[0],
            "engram_max_ngram_size": len(g.orders) + 1, "engram_n_heads": g.heads_per_order,
            "engram_head_dim": g.row_values,
            "engram_num_embeddings": [t.rows for t in G.layer_tables(g)]}


QWEN_SMALL_SETS = ("ple.geometry.vocab_per_order=[997,1009]", "ple.shards=4", "ple.split_ngram_parts=4")


def qwen_checkpoint_and_table(folder: str | Path, sets=QWEN_SMALL_SETS) -> tuple[Path, Path]:
    """A small Qwen checkpoint (FOLDER/ck, config.json with the PLE fields SGLang reads) and the table
    file deployctl's write-ple op wrote from it into FOLDER/ple, with its manifest."""
    from orchestrator.recipe import load_recipe
    from orchestrator.stages.write_ple import spec_for
    from orchestrator.hostside import ple_write
    from orchestrator.hostside import ple_spec
    r = load_recipe("qwen38-flash-next-spark", sets).recipe
    ck = Path(folder) / "ck"
    write_checkpoint(ck, [t for t in recipe_tensors(r) if ".ple." in t.name], files=2, config=recipe_config(r))
    out = ple_write.write_table(ple_spec.parse_spec(spec_for(r)), ck, Path(folder) / "ple", quiet=True)
    return ck, Path(out.data["file"])
