"""Each rank receives what it reads: which bytes of the checkpoint a DeepSeek worker keeps (pure).

With Engram on NVMe the patched engine reads a rank's Engram rows through DSV41_ENGRAM_DIR and never
the other ranks' (docs/engram-contract.md, rules 3 and 8), and its weights iterator skips the Engram
tensors altogether (`patch/full/weight_utils.diff`: `safetensors_weights_iterator` continues past any
name ending in `.engram.embed.weight` / `.engram.embed.scale` when DSV41_ENGRAM_DISK=1). What the loader
does need from an Engram shard is its header (safe_open checks the file's size against it) and every
other tensor in it. So a worker keeps, of each shard holding Engram tensors: every byte except the
other ranks' rows, at the original offsets, the rest holes; every other file whole. The chain still
carries whole files past the node (the nodes after it need them) and checks the whole stream's sha256
against the manifest (hostside/chain_node.py); stage-engram then links the worker's shards (nothing to
copy). Only with `distribution: chain` (rsync sends whole files) and `model.source: head`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import StageFailed
from ..hostside.engram_spec import Spec, spec_for, staged_bytes
from ..hostside.geometry import layer_tables

if TYPE_CHECKING:
    from ..deployment import Deployment

Spans = list[list[int]]          # [[start, end), ...] in file order, disjoint


def applies(dep: "Deployment") -> bool:
    """Workers receive only their rank's Engram rows: the recipe stages Engram on NVMe, asks for it
    (engram.receive: rows), one rank per node, the checkpoint is the head's (source head) and travels
    through the chain."""
    eg, r = dep.recipe.engram, dep.recipe
    return (eg is not None and eg.placement == "nvme" and eg.receive == "rows"
            and r.model.source == "head" and dep.cluster.distribution == "chain"
            and r.parallelism.gpus_per_node == 1 and bool(dep.cluster.workers))


def tensor_names(dep: "Deployment") -> list[str]:
    """The Engram tensors the head's manifest locates (`--tensor`), in layer order, weight then scale."""
    spec = spec_for(dep.recipe, 0)
    return [name for layer in spec.geometry.layers for _, name, _, _ in spec.fields(layer)]


def unlocated(dep: "Deployment", tensors: dict[str, list]) -> str:
    """Why the workers get whole files after all: the head's checkpoint does not hold every Engram
    tensor the recipe names ("" when it does). stage-engram refuses such a checkpoint, naming the file."""
    missing = [n for n in tensor_names(dep) if n not in tensors]
    if not missing:
        return ""
    return (f"the head's checkpoint has no {', '.join(repr(n) for n in missing[:2])}"
            f"{f' (+{len(missing) - 2} more)' if len(missing) > 2 else ''}: every file is sent whole")


def keep_spans(spec: Spec, tensors: dict[str, list], sizes: dict[str, int]) -> dict[str, Spans]:
    """Per file holding Engram tensors, the byte ranges SPEC's rank keeps: all of [0, size) but the
    other ranks' rows of each Engram tensor. TENSORS: name -> [file, start, end) from the head's
    manifest; SIZES: file -> size."""
    totals = {t.layer: t.rows for t in layer_tables(spec.geometry)}
    drops: dict[str, list[tuple[int, int]]] = {}
    for rr in spec.ranges():
        for _, name, _, row_bytes in spec.fields(rr.layer):
            if name not in tensors:
                raise StageFailed(f"the head's manifest does not locate Engram tensor {name!r}")
            rel, start, end = tensors[name]
            if end - start != totals[rr.layer] * row_bytes:
                raise StageFailed(f"tensor {name!r} in {rel} holds {end - start} bytes; the recipe's geometry "
                                  f"gives {totals[rr.layer]} rows of {row_bytes} B: check engram.geometry "
                                  f"against the checkpoint (deployctl engram ranges)")
            drops.setdefault(rel, []).extend([(start, start + rr.row_start * row_bytes),
                                              (start + rr.row_end * row_bytes, end)])
    return {rel: complement(sorted((a, b) for a, b in cut if b > a), sizes[rel]) for rel, cut in drops.items()}


def complement(cut: list[tuple[int, int]], size: int) -> Spans:
    """[0, size) minus the sorted ranges CUT."""
    out, pos = [], 0
    for a, b in cut:
        if a > pos:
            out.append([pos, a])
        pos = max(pos, b)
    if pos < size:
        out.append([pos, size])
    return out


def kept_bytes(spans: Spans) -> int:
    return sum(b - a for a, b in spans)


def figures(dep: "Deployment", rank: int) -> dict[str, int]:
    """The recipe's own numbers for one rank (no host read): the Engram bytes in the checkpoint, this
    rank's rows of them, and what it therefore does not receive."""
    spec = spec_for(dep.recipe, rank)
    engram = sum(t.rows for t in layer_tables(spec.geometry)) * spec.row_bytes
    mine = staged_bytes(spec)
    return {"rank": rank, "tp": spec.tp, "engram_bytes": engram, "rank_row_bytes": mine,
            "not_received_bytes": engram - mine}
