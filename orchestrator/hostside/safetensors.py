"""Read sharded safetensors checkpoints by their headers: where each tensor's bytes are.

Nothing here loads a tensor. A safetensors file is an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, ...} and
the data; offsets are relative to the end of the header. A sharded checkpoint has
`model.safetensors.index.json` with {"weight_map": {tensor: file}}; a single-file
checkpoint has just `model.safetensors` (or any *.safetensors files).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024          # the format's own limit
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1, "E8M0": 1, "F8_E8M0": 1,
               "BF16": 2, "F16": 2, "I16": 2, "U16": 2, "F32": 4, "I32": 4, "U32": 4,
               "F64": 8, "I64": 8, "U64": 8, "BOOL": 1}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int          # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes per row of a 2-D (or higher) tensor: the product of all but the first dim."""
        n = DTYPE_BYTES.get(self.dtype, 1)
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True)
class FileIdentity:
    """What identifies a source file cheaply: name, size, mtime and a digest of its header."""
    name: str
    size: int
    mtime_ns: int
    header_sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "mtime_ns": self.mtime_ns,
                "header_sha256": self.header_sha256}


def read_header(path: Path) -> tuple[dict, int, str]:
    """(header dict, data start offset, sha256 of the header bytes) of one safetensors file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InputError("truncated safetensors file (no header length)", file=str(path))
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise InputError(f"truncated or corrupt safetensors file (header length {n}, "
                                 f"file size {size})", file=str(path))
            hb = f.read(n)
    except FileNotFoundError:
        raise InputError("checkpoint file not found (listed in the index but missing)",
                         file=str(path)) from None
    try:
        header = json.loads(hb)
    except ValueError as e:
        raise InputError(f"corrupt safetensors header: {e}", file=str(path)) from None
    return header, 8 + n, hashlib.sha256(hb).hexdigest()


class Checkpoint:
    """A checkpoint folder: tensor name -> TensorInfo, read lazily one file header at a time."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._headers: dict[str, tuple[dict, int, str]] = {}
        if not self.folder.is_dir():
            raise InputError("checkpoint folder not found", file=str(self.folder))
        index = self.folder / INDEX_NAME
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise InputError(f"bad index (expected a 'weight_map'): {e}", file=str(index)) from None
            self.weight_map: dict[str, str] = dict(wm)
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise InputError(f"no {INDEX_NAME} and no *.safetensors files", file=str(self.folder))
            self.weight_map = {}
            for name in files:
                header, _, _ = self._header(name)
                for t in header:
                    if t != "__metadata__":
                        self.weight_map[t] = name

    def _header(self, file: str) -> tuple[dict, int, str]:
        if file not in self._headers:
            self._headers[file] = read_header(self.folder / file)
        return self._headers[file]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    @property
    def index_path(self) -> Path | None:
        """The index file, or None for a checkpoint without one (its weight map comes from the headers)."""
        p = self.folder / INDEX_NAME
        return p if p.exists() else None

    def data_start(self, file: str) -> int:
        """Byte offset where a file's tensor data begins: 8 + its header length."""
        return self._header(file)[1]

    def tensor(self, name: str) -> TensorInfo:
        file = self.weight_map.get(name)
        if file is None:
            raise InputError(f"tensor {name!r} is not in the checkpoint", file=str(self.folder))
        header, start, _ = self._header(file)
        meta = header.get(name)
        path = self.folder / file
        if meta is None:
            raise InputError(f"tensor {name!r} is in the index but not in the file's header",
                             file=str(path))
        b, e = meta["data_offsets"]
        info = TensorInfo(name, path, meta["dtype"], tuple(meta["shape"]), start + b, e - b)
        size = path.stat().st_size
        if info.offset + info.nbytes > size:
            raise InputError(f"truncated: tensor {name!r} needs bytes up to "
                             f"{info.offset + info.nbytes} but the file has {size}", file=str(path))
        expect = DTYPE_BYTES.get(info.dtype, 1) * _prod(info.shape)
        if expect != info.nbytes:
            raise InputError(f"tensor {name!r}: shape {list(info.shape)} x {info.dtype} is {expect} "
                             f"bytes but its data_offsets span {info.nbytes}", file=str(path))
        return info

    def identity(self, files: list[str] | None = None) -> list[FileIdentity]:
        """Cheap identity of the files (all, or those given): no tensor data is read."""
        out = []
        for name in sorted(set(files if files is not None else self.weight_map.values())):
            p = self.folder / name
            st = p.stat()
            _, _, digest = self._header(name)
            out.append(FileIdentity(name, st.st_size, st.st_mtime_ns, digest))
        return out


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, length: int,
               chunk: int = 64 * 1024 * 1024) -> None:
    """Copy `length` bytes between files at the given offsets without a user-space buffer
    where the kernel allows it (copy_file_range), else with pread/pwrite in bounded chunks."""
    done = 0
    while done < length:
        n = min(chunk, length - done)
        try:
            w = os.copy_file_range(src_fd, dst_fd, n, src_off + done, dst_off + done)
        except OSError as e:
            if e.errno not in (18, 22, 38, 95):   # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP: fall back
                raise
            w = 0
        if w == 0:
            buf = os.pread(src_fd, n, src_off + done)
            if not buf:
                raise InputError(f"unexpected end of file at offset {src_off + done}")
            w = os.pwrite(dst_fd, buf, dst_off + done)
        done += w
