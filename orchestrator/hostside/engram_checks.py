"""Checks of a staged Engram folder: rows read back the way the patched engine reads them
(`EngineView`, `fidelity_check`), every staged byte against the manifest (`verify_files`), and the
rank check launch uses to refuse a host holding another rank's rows (`check_rank`). Standard library only.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from ..errors import StageFailed
from .engram_spec import (FIDELITY_SAMPLES, LOCAL_NAME, MANIFEST_NAME, RankMismatch, Sources, Spec,
                          VerifyFailed)
from .safetensors import INDEX_NAME, MAX_HEADER
from . import tableproof


def same_inode(a: Path, b: Path) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except FileNotFoundError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)



def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None



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



def verify_files(dest: Path, manifest: Mapping[str, Any], threads: int,
                 link_value: "LinkValue | None" = None) -> int:
    """Re-hash every staged chunk (from the disk: cached pages are dropped first) and every header
    against the manifest, and the index (prove_staged in full). Returns the bytes hashed; raises
    VerifyFailed naming the file, the chunk and its byte range (LinkChanged: a linked shard written
    since it was staged, which no restage repairs)."""
    for fe in manifest["files"]:
        path = dest / fe["name"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise VerifyFailed(f"{path}: missing (listed in {MANIFEST_NAME})") from None
        if size != fe["size"]:
            raise VerifyFailed(f"{path}: {size} bytes, the manifest says {fe['size']}")
    proof = prove_staged(dest, manifest, full_check=True, workers=threads, link_value=link_value)
    if proof.refused:
        raise LinkChanged(link_refusal(proof.refused))
    if proof.bad:
        bad = proof.bad
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise VerifyFailed(f"corrupt staged data: {'; '.join(bad[:5])}{more}: sha256 differs from "
                           f"{MANIFEST_NAME}; the manifest is removed, run the stage again to restage")
    return proof.bytes



LinkValue = Callable[[str, os.stat_result], "str | None"]


class LinkChanged(StageFailed):
    """A linked shard was written since it was staged and nothing has checked it since: refused (exit
    1), the manifest kept (a restage would link the very same bytes again)."""


def link_refusal(refused: list[str]) -> str:
    more = f" and {len(refused) - 3} more" if len(refused) > 3 else ""
    return (f"refused: {'; '.join(refused[:3])}{more}. A linked shard is the checkpoint's own file, so "
            "restaging would link the same bytes again: run `deployctl sync-model` (or `deployctl up`), which "
            "re-hashes it against the head's sha256 and repairs it, then stage again")


def prove_staged(dest: Path, manifest: Mapping[str, Any], sample_bytes: int | None = None,
                 full_check: bool = False, workers: int | None = None,
                 link_value: LinkValue | None = None) -> tableproof.Proof:
    """What every `up` and `launch` runs on a folder its manifest calls current (tableproof.py): the
    index and every header against the manifest, then the copies' chunks: in full for a file whose
    stat stamp changed (every file with FULL_CHECK: verify_files), else the next window of the sample.
    A link's rows are the checkpoint's own bytes, which sync-model proves against the head: it must
    still be a link to the checkpoint's shard, its header is read, and its stat stamp must be the one
    recorded when it was linked. A link whose stamp moved (a write, even one that put the mtime back,
    moves ctime) stands only if sync-model has hashed the shard in its current state since
    (LINK_VALUE(name, stat): its hash cache's value at exactly this stat) and found what it found when
    the link was made (the manifest's `verified`); otherwise it is refused (`Proof.refused`): a
    restage would link the same bytes again, only sync-model repairs them."""
    files, bad, refused, vouched = [], [], [], {}
    if file_sha256(dest / INDEX_NAME) != manifest.get("index", {}).get("sha256"):
        bad.append(f"{dest / INDEX_NAME} (missing or changed)")
    for fe in manifest.get("files", []):
        path = dest / fe["name"]
        try:
            with open(path, "rb") as fh:
                head = os.pread(fh.fileno(), fe["header_bytes"], 0)
        except FileNotFoundError:
            bad.append(f"{path} (missing)")
            continue
        if hashlib.sha256(head).hexdigest() != fe["header_sha256"]:
            bad.append(f"{path} header (bytes 0..{fe['header_bytes']})")
        if fe.get("mode") == "link":
            src = Path(manifest.get("source", {}).get("checkpoint", "")) / fe["name"]
            if not same_inode(path, src):
                bad.append(f"{path} (no longer a hard link to {src})")
                continue
            why = tableproof.stamp_change(path, fe.get("stat"))
            if why:
                value = link_value(fe["name"], os.stat(path)) if link_value else None
                if value is not None and fe.get("verified") in (None, value):
                    vouched[str(path)] = tableproof.stamp(path)
                else:
                    seen = ("sync-model has not hashed it since" if value is None else
                            "sync-model found other bytes there than when it was linked")
                    refused.append(f"{path} ({why} since it was staged, whatever its mtime says; {seen})")
        else:
            spans = tuple((p["offset"], p["length"]) for p in fe["pieces"] if p["length"])
            files.append(tableproof.TableFile(str(path), spans, fe["chunk_bytes"], tuple(fe["sha256"]),
                                              fe.get("stat")))
    proof = tableproof.prove(files, sample_bytes, full_check=full_check, state=dest / tableproof.STATE_NAME,
                             workers=workers)
    proof.bad[:0] = bad
    proof.refused += refused
    proof.refreshed.update(vouched)
    proof.full += [f"{Path(p).name}: a link, its stamp moved, sync-model hashed it since: equal" for p in vouched]
    return proof


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

