"""Synthetic Engram checkpoints for the tests and bench/stage_engram.py.

A multi-file safetensors checkpoint (index + shards) with, per Engram layer, a weight tensor
[rows, row_values] (F8_E4M3) and a scale tensor [rows, scale_values] (U8) in different files, plus
unrelated tensors before and between them, so tensor data never starts at a file's data start.
Rows come from an independent brute force of the prime scheme (not orchestrator.hostside.geometry),
and the writer returns where every tensor's bytes are (TensorInfo filled by the writer itself), so
tests check staged bytes without using the code under test to find them.
"""
from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path
from typing import Callable

from orchestrator.recipe import load_recipe
from orchestrator.stages.stage_engram import engram_spec
from orchestrator.hostside import engram_spec as es
from orchestrator.hostside.safetensors import TensorInfo

WEIGHT = "layers.{layer}.engram.embed.weight"
SCALE = "layers.{layer}.engram.embed.scale"
RECIPE = "deepseek-v41-flash-tp4"


def brute_primes(layers: list[int], vocab: list[int], heads: int) -> dict[int, list[int]]:
    """Per layer the sub-table sizes by trial division: for each layer, order, head the smallest
    prime >= the order's base not taken before (one seen-set across layers)."""
    def prime(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))

    seen: set[int] = set()
    out = {}
    for layer in layers:
        sizes = []
        for base in vocab:
            n = base
            for _ in range(heads):
                while not prime(n) or n in seen:
                    n += 1
                seen.add(n)
                sizes.append(n)
                n += 1
        out[layer] = sizes
    return out


def read_rows(t: TensorInfo, lo: int, hi: int) -> bytes:
    """Rows [lo, hi) of a tensor as the writer placed them (its offset comes from the writer, not a reader)."""
    with open(t.file, "rb") as f:
        f.seek(t.offset + lo * t.row_bytes)
        return f.read((hi - lo) * t.row_bytes)


Fill = Callable[[int], bytes]


def write_safetensors(path: Path, tensors: list[tuple[str, str, tuple[int, ...], int]],
                      fill: Fill | None) -> dict[str, TensorInfo]:
    """tensors: (name, dtype, shape, nbytes); data from fill(n) in pieces of at most 8 MiB, or
    (fill None) a hole: the file is only truncated to its size (a huge checkpoint costing nothing)."""
    header, off = {}, 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    out = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        start = 8 + len(hb)
        for name, dtype, shape, nbytes in tensors:
            out[name] = TensorInfo(name, path, dtype, shape, start + header[name]["data_offsets"][0], nbytes)
            left = nbytes if fill is not None else 0
            while left:
                n = min(left, 8 << 20)
                f.write(fill(n))
                left -= n
        f.truncate(start + off)
    return out


def make_checkpoint(folder: str | Path, layers: list[int], vocab: list[int], heads: int, row_values: int,
                    scale_values: int | None = 1, seed: int = 0, data: str = "seeded",
                    scale_dtype: str = "U8", sizes: dict[int, list[int]] | None = None) -> dict[str, TensorInfo]:
    """Write a 4-file checkpoint; returns every tensor by name (Engram and unrelated).
    data: "seeded" (reproducible random), "fast" (os.urandom) or "holes" (no data written)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    fill: Fill | None = {"seeded": rng.randbytes, "fast": os.urandom, "holes": None}[data]
    sizes = sizes or brute_primes(layers, vocab, heads)
    per_file: list[list[tuple[str, str, tuple[int, ...], int]]] = [[], [], [], []]
    per_file[0].append(("model.embed_tokens.weight", "BF16", (37, 3), 37 * 3 * 2))
    for i, layer in enumerate(layers):
        rows = sum(sizes[layer])
        w = (WEIGHT.format(layer=layer), "F8_E4M3", (rows, row_values), rows * row_values)
        per_file[(2 * i) % 4].append(w)
        per_file[(2 * i + 1) % 4].append((f"layers.{layer}.mlp.gate.weight", "F32", (5, 3), 60))
        if scale_values:
            s = (SCALE.format(layer=layer), scale_dtype, (rows, scale_values), rows * scale_values)
            per_file[(2 * i + 1) % 4].append(s)
    per_file[3].append(("lm_head.weight", "BF16", (11, 7), 154))
    files = [f"model-{k + 1:05d}-of-{len(per_file):05d}.safetensors" for k in range(len(per_file))]
    tensors: dict[str, TensorInfo] = {}
    weight_map = {}
    for name, ts in zip(files, per_file):
        got = write_safetensors(folder / name, ts, fill)
        tensors.update(got)
        weight_map.update({t: name for t in got})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                    "weight_map": weight_map}, indent=1))
    if len(set(vocab)) == 1:        # what the patched engram.py builds its tables from (EngramLayout)
        (folder / "config.json").write_text(json.dumps(
            {"model_type": "deepseek_v41", "engram_layer_ids": list(layers), "engram_vocab_size": vocab[0],
             "engram_max_ngram_size": len(vocab) + 1, "engram_n_heads": heads, "engram_head_dim": row_values,
             "engram_num_embeddings": [sum(sizes[layer]) for layer in layers]}, indent=1))
    return tensors


def recipe_sets(layers: list[int], vocab: list[int], heads: int, row_values: int,
                scale_values: int | None = 1, layout: str = "sparse", staging: str = "copy") -> list[str]:
    """--set overrides that scale deepseek-v41-flash-tp4 down to a synthetic checkpoint (staging copy
    by default: the tests' checkpoints share the filesystem with DEST, where auto would link)."""
    sets = [f"engram.geometry.layers={json.dumps(layers)}",
            f"engram.geometry.vocab_per_order={json.dumps(vocab)}",
            f"engram.geometry.orders={json.dumps(list(range(2, 2 + len(vocab))))}",
            f"engram.geometry.heads_per_order={heads}",
            f"engram.geometry.row_values={row_values}",
            f"engram.layout={layout}", f"engram.staging={staging}", "engram.free_margin_gb=0"]
    if scale_values:
        sets.append(f"engram.scale_values_per_row={scale_values}")
    else:
        sets.append("engram.scale_tensor=null")
    return sets


class Synth:
    """A synthetic checkpoint and what the tests expect of it, computed independently."""

    def __init__(self, root: Path, layers, vocab, heads, row_values, scale_values, seed=1):
        self.layers, self.vocab, self.heads = layers, vocab, heads
        self.row_values, self.scale_values = row_values, scale_values
        self.ckpt = root / "ckpt"
        self.tensors = make_checkpoint(self.ckpt, layers, vocab, heads, row_values, scale_values, seed=seed)
        self.sizes = brute_primes(layers, vocab, heads)

    def sets(self, layout: str = "sparse", staging: str = "copy") -> list[str]:
        return recipe_sets(self.layers, self.vocab, self.heads, self.row_values, self.scale_values, layout,
                           staging)

    def spec(self, tp: int, rank: int, layout: str = "sparse", staging: str = "copy", **over) -> es.Spec:
        r = load_recipe(RECIPE, self.sets(layout, staging)).recipe
        return es.Spec.from_json({**engram_spec(r, rank, tp).to_json(), **over})

    def expected_range(self, layer: int, tp: int, rank: int) -> tuple[int, int]:
        subs = self.sizes[layer]
        part = -(-len(subs) // tp)
        h0 = min(rank * part, len(subs))
        h1 = min(h0 + part, len(subs))
        return sum(subs[:h0]), sum(subs[:h1])

    def partial_bytes(self, fname: str, tp: int, rank: int) -> bytes:
        """A shard as a worker keeps it when it receives only its rank's Engram rows: every byte of the
        shard but the other ranks' rows of its Engram tensors, which are zeros (holes)."""
        data = bytearray((self.ckpt / fname).read_bytes())
        for layer in self.layers:
            lo, hi = self.expected_range(layer, tp, rank)
            for name in (WEIGHT, SCALE):
                t = self.tensors.get(name.format(layer=layer))
                if t is None or t.file.name != fname:
                    continue
                start, end = t.offset, t.offset + t.rows * t.row_bytes
                data[start:start + lo * t.row_bytes] = bytes(lo * t.row_bytes)
                data[start + hi * t.row_bytes:end] = bytes(end - start - hi * t.row_bytes)
        return bytes(data)

    def check_dest(self, dest: Path, tp: int, rank: int, layout: str = "sparse") -> None:
        """Every byte of every file the rank's staging wrote: per checkpoint shard holding an Engram
        tensor, a copy of the same size whose header bytes are the shard's, whose rank rows of each
        Engram tensor are the shard's at the same offsets, and whose every other byte is zero; the
        index byte for byte; engram-local.json; the manifest."""
        assert layout == "sparse"
        wb, sb = self.row_values, self.scale_values or 0
        local, shards = {}, {}
        for layer in self.layers:
            lo, hi = self.expected_range(layer, tp, rank)
            local[str(layer)] = [lo, hi]
            for name, rb in ((WEIGHT, wb), (SCALE, sb)):
                if rb:
                    t = self.tensors[name.format(layer=layer)]
                    shards.setdefault(t.file.name, []).append((t, lo, hi))
        for fname, parts in shards.items():
            src = (self.ckpt / fname).read_bytes()
            data = (dest / fname).read_bytes()
            assert len(data) == len(src), fname
            hlen = 8 + struct.unpack("<Q", src[:8])[0]
            want = bytearray(len(src))
            want[:hlen] = src[:hlen]
            for t, lo, hi in parts:
                a, b = t.offset + lo * t.row_bytes, t.offset + hi * t.row_bytes
                want[a:b] = read_rows(t, lo, hi)
            assert data == bytes(want), f"{fname}: differs from header + rank {rank}'s rows + zeros"
        assert sorted(p for p in os.listdir(dest) if p.endswith(".safetensors")) == sorted(shards)
        assert (dest / "model.safetensors.index.json").read_bytes() == \
            (self.ckpt / "model.safetensors.index.json").read_bytes()
        assert json.loads((dest / "engram-local.json").read_text()) == {"layers": local}
        m = json.loads((dest / "engram-manifest.json").read_text())
        assert m["complete"] and (m["tp"], m["rank"], m["layout"]) == (tp, rank, layout)
        assert {k: [v["row_start"], v["row_end"]] for k, v in m["layers"].items()} == local
        assert not [p for p in os.listdir(dest) if p.endswith(".tmp") or p.startswith("engram-L")]
