"""`docker save` tar surgery with the standard library only: it also runs on the head inside the ship agent.

A `docker save` archive of Docker 20.10 (graph-driver image store) holds, in lexical order:

    <v1id>/  <v1id>/VERSION  <v1id>/json  <v1id>/layer.tar    one folder per layer
    <image id hex>.json                                          the image config
    manifest.json  repositories

The folders are named by legacy v1 IDs, not by diff_id, and manifest.json (which maps them to
layers) comes last, so a streaming filter cannot look the names up. It identifies each folder from
its `json`, which precedes layer.tar: a folder's name is the sha256 of a canonical JSON made of that
file with `layer_id` = the layer's chain ID (moby image/v1.CreateID). A chain ID of the image that
reproduces the folder's name identifies it with certainty; a folder nothing reproduces is sent
(never dropped on a guess). Engines that name layer blobs by digest (blobs/sha256/<hex>, Docker 25+)
are matched on the name: a graph-driver store's blob name is the layer's diff_id; a containerd
store keeps layers compressed, so its blob names map to diff_ids through the manifest (`blob_diffs`,
read beforehand by image_manifest.py). A blob matched by neither is sent to every target.

`docker load` accepts an archive reduced to the folders a target lacks, because it skips every layer
whose chain is already in its store (verified on 20.10: docs/deployment-facts.md, "Verified: `docker load` of a partial save").
"""
from __future__ import annotations

import hashlib
import json
import re
import tarfile
from typing import BinaryIO, Iterable, Iterator

BLOCK = 512
READ_CHUNK = 1 << 20                  # bytes per read of the save stream: bounded memory
SMALL_MEMBER = 1 << 20                # a layer folder's json larger than this is not parsed (sent as is)
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
HEX64 = re.compile(r"^[0-9a-f]{64}$")
EXTENDED = {b"x", b"g", b"L", b"K"}    # pax and GNU headers that belong to the member after them


# --------------------------------------------------------------------------------------------------
# Chains

def chain_ids(diff_ids: list[str]) -> list[str]:
    """ChainID(L0) = diff_id(L0); ChainID(Ln) = sha256(ChainID(Ln-1) + " " + diff_id(Ln))."""
    out: list[str] = []
    for d in diff_ids:
        out.append(d if not out else "sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest())
    return out


def present_chains(images_diff_ids: Iterable[list[str]]) -> set[str]:
    """Every chain a store holds, from the diff_id lists of its images (each image holds its prefixes)."""
    have: set[str] = set()
    for diffs in images_diff_ids:
        have.update(chain_ids(diffs))
    return have


def layers_to_send(diff_ids: list[str], have: set[str]) -> list[int]:
    """Indices of the image's layer folders a target needs: every layer whose chain it lacks, plus the
    first folder of a diff_id a needed later folder shares (docker save writes the later one as a
    symlink to the first)."""
    chains = chain_ids(diff_ids)
    missing = [i for i, c in enumerate(chains) if c not in have]
    needed_diffs = {diff_ids[i] for i in missing}
    send = set(missing)
    for d in needed_diffs:
        send.add(diff_ids.index(d))
    return sorted(send)


# --------------------------------------------------------------------------------------------------
# Identifying a v1 layer folder from its json

def _top_items(text: str) -> list[tuple[str, str]]:
    """The top-level (key, raw value text) pairs of a JSON object, values byte-for-byte as written."""
    dec = json.JSONDecoder()
    i = text.index("{") + 1
    items = []
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "}":
            return items
        key, i = dec.raw_decode(text, i)
        while text[i] in " \t\r\n:":
            i += 1
        _, j = dec.raw_decode(text, i)
        items.append((key, text[i:j]))
        i = j


def v1_candidates(folder_json: bytes, chains: list[str]) -> Iterator[tuple[int, str]]:
    """(layer index, v1 id) for every chain as if it were this folder's layer, both for a lower
    layer (`os` added after the id was made) and for the top layer (`os` part of its config)."""
    try:
        items = dict(_top_items(folder_json.decode("utf-8")))
    except (ValueError, IndexError, UnicodeDecodeError):
        return
    items.pop("id", None)
    if "parent" in items:
        try:
            items["parent"] = json.dumps("sha256:" + json.loads(items["parent"]))
        except (ValueError, TypeError):
            return
    variants = [items]
    if "os" in items:
        variants.append({k: v for k, v in items.items() if k != "os"})
    for i, chain in enumerate(chains):
        for v in variants:
            doc = {**v, "layer_id": json.dumps(chain)}
            text = "{" + ",".join(json.dumps(k) + ":" + doc[k] for k in sorted(doc)) + "}"
            yield i, hashlib.sha256(text.encode("utf-8")).hexdigest()


def identify_folder(name: str, folder_json: bytes, chains: list[str]) -> int | None:
    """The index of the layer whose folder is NAME, or None when no chain reproduces the name."""
    for i, v1 in v1_candidates(folder_json, chains):
        if v1 == name:
            return i
    return None


# --------------------------------------------------------------------------------------------------
# A raw streaming tar reader: members pass through byte-for-byte

class Member:
    """One archive member: its raw header blocks (extended headers included) and its padded data."""

    __slots__ = ("name", "type", "size", "header", "_reader", "_left")

    def __init__(self, name: str, type_: bytes, size: int, header: bytes, reader: "TarReader"):
        self.name, self.type, self.size, self.header = name, type_, size, header
        self._reader = reader
        self._left = _padded(size)

    def chunks(self) -> Iterator[bytes]:
        """The data blocks (padded to 512), in pieces of at most READ_CHUNK; each is read once."""
        while self._left:
            b = self._reader._read(min(self._left, READ_CHUNK))
            self._left -= len(b)
            yield b

    def read_all(self, limit: int) -> bytes | None:
        """The whole data (unpadded) when size <= limit, else None (nothing read)."""
        if self.size > limit:
            return None
        return b"".join(self.chunks())[:self.size]

    def skip(self) -> None:
        for _ in self.chunks():
            pass


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


class TarError(Exception):
    pass


class TarReader:
    """Reads a tar stream (no seeking) and yields Members; a member's data must be consumed (or is
    skipped) before the next one is read."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.bytes_read = 0

    def _read(self, n: int) -> bytes:
        out = self.stream.read(n)
        if len(out) < n:                       # a pipe may return short reads: keep reading
            parts = [out]
            got = len(out)
            while got < n:
                b = self.stream.read(n - got)
                if not b:
                    raise TarError(f"archive truncated after {self.bytes_read + got} bytes")
                parts.append(b)
                got += len(b)
            out = b"".join(parts)
        self.bytes_read += n
        return out

    def __iter__(self) -> Iterator[Member]:
        prev: Member | None = None
        ext = bytearray()
        long_name: str | None = None
        pax: dict[str, str] = {}
        while True:
            if prev is not None:
                prev.skip()
                prev = None
            block = self._read(BLOCK)
            if block == b"\0" * BLOCK:
                return
            try:
                info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
            except tarfile.HeaderError as e:
                raise TarError(f"bad tar header at byte {self.bytes_read - BLOCK}: {e}") from None
            type_ = info.type
            if type_ in EXTENDED:
                data = self._read(_padded(info.size))
                ext += block + data
                body = data[:info.size]
                if type_ in (b"L", b"K"):
                    if type_ == b"L":
                        long_name = body.rstrip(b"\0").decode("utf-8", "surrogateescape")
                elif type_ == b"x":
                    pax.update(_pax_records(body))
                continue
            name = pax.get("path") or long_name or info.name
            size = int(pax["size"]) if "size" in pax else info.size
            if type_ in (tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE,
                         tarfile.BLKTYPE, tarfile.FIFOTYPE):
                size = 0 if "size" not in pax else size
            m = Member(name.rstrip("/") + ("/" if type_ == tarfile.DIRTYPE else ""), type_, size,
                       bytes(ext) + block, self)
            ext, long_name, pax = bytearray(), None, {}
            prev = m
            yield m


def _pax_records(body: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(body):
        sp = body.find(b" ", i)
        if sp < 0:
            break
        n = int(body[i:sp])
        rec = body[sp + 1:i + n - 1]          # without the trailing newline
        k, _, v = rec.partition(b"=")
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        i += n
    return out


# --------------------------------------------------------------------------------------------------
# The router: which target gets which bytes

class SaveFilter:
    """Routes a `docker save` stream to several targets, each getting a valid archive reduced to the
    layer folders it needs (`send[target]` = layer indices, see layers_to_send).

    `route(stream)` yields (targets, bytes): every target named gets those bytes, in order.
    After the stream: `folders` (v1 folder -> layer index or None), `unidentified`, `config_seen`.
    """

    def __init__(self, diff_ids: list[str], send: dict[str, list[int]], image_id: str | None = None,
                 blob_diffs: dict[str, str] | None = None):
        self.diff_ids = diff_ids
        self.blob_diffs = blob_diffs or {}     # compressed blob digest -> diff_id (containerd store)
        self.chains = chain_ids(diff_ids)
        self.targets = frozenset(send)
        self.send = {t: frozenset(ix) for t, ix in send.items()}
        self.image_id = image_id
        self.folders: dict[str, int | None] = {}
        self.unidentified: list[str] = []
        self.config_seen: str | None = None
        self.events: list[dict] = []          # per layer folder: index, size, who gets it (for logs)

    def _for_index(self, i: int | None) -> frozenset[str]:
        if i is None:
            return self.targets
        return frozenset(t for t in self.targets if i in self.send[t])

    def _for_diff(self, diff: str) -> frozenset[str]:
        idx = {i for i, d in enumerate(self.diff_ids) if d == diff}
        return frozenset(t for t in self.targets if idx & self.send[t])

    def route(self, stream: BinaryIO) -> Iterator[tuple[frozenset[str], bytes]]:
        folder: str | None = None              # the layer folder being read
        folder_to: frozenset[str] | None = None    # its targets, once decided
        pending: list[bytes] = []               # its members read before the decision

        def decide(index: int | None) -> Iterator[tuple[frozenset[str], bytes]]:
            nonlocal folder_to, pending
            folder_to = self._for_index(index)
            assert folder is not None
            self.folders[folder] = index
            if index is None:
                self.unidentified.append(folder)
            self.events.append({"folder": folder, "index": index, "to": sorted(folder_to)})
            if folder_to and pending:
                yield folder_to, b"".join(pending)
            pending = []

        for m in TarReader(stream):
            top, _, rest = m.name.partition("/")
            if folder is not None and top != folder:
                if folder_to is None:
                    yield from decide(None)
                folder, folder_to = None, None
            if not rest and top.endswith(".json") and HEX64.match(top[:-5]):
                self.config_seen = "sha256:" + top[:-5]
                if self.image_id and self.config_seen != self.image_id:
                    raise TarError(f"the archive holds image {self.config_seen}, not {self.image_id} "
                                   f"(the image changed during the save?)")
            if HEX64.match(top) and (rest or m.name.endswith("/")):
                if folder is None:
                    folder, folder_to, pending = top, None, []
                if folder_to is None:
                    if rest == "json":
                        body = m.read_all(SMALL_MEMBER)
                        if body is None:
                            yield from decide(None)
                            yield from self._whole(folder_to, m)
                            continue
                        pending.append(m.header + body + b"\0" * (_padded(len(body)) - len(body)))
                        yield from decide(identify_folder(top, body, self.chains))
                        continue
                    if m.size <= SMALL_MEMBER and rest != "layer.tar":
                        pending.append(m.header + b"".join(m.chunks()))
                        continue
                    yield from decide(None)
                yield from self._whole(folder_to, m)
                continue
            if top == "blobs" and rest.startswith("sha256/") and HEX64.match(rest[7:]):
                digest = "sha256:" + rest[7:]
                diff = self.blob_diffs.get(digest, digest)
                if diff in self.diff_ids:
                    to = self._for_diff(diff)
                    self.events.append({"folder": rest[7:], "index": self.diff_ids.index(diff), "to": sorted(to)})
                else:
                    to = self.targets          # the config, manifests, or a blob nothing names: sent
                yield from self._whole(to, m)
                continue
            yield from self._whole(self.targets, m)
        if folder is not None and folder_to is None:
            yield from decide(None)
        yield self.targets, END_OF_ARCHIVE

    @staticmethod
    def _whole(to: frozenset[str] | None, m: Member) -> Iterator[tuple[frozenset[str], bytes]]:
        if not to:
            m.skip()
            return
        yield to, m.header
        for chunk in m.chunks():
            yield to, chunk
