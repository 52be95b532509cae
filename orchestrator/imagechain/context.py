"""Tar streams for the engine: docker build contexts and container uploads.

Written to a temporary file (bounded memory, a vLLM checkout can be large), from the same `walk`
the digest hashes. Metadata is normalised (owner root, fixed mtime) so the same content always makes
the same tar, and the engine's own layer cache agrees with ours.
"""
from __future__ import annotations

import io
import os
import posixpath
import tarfile
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterable

from .digest import walk

MTIME = 946684800               # 2000-01-01: a fixed time for every member


class TarBuilder:
    """Add files from disk or memory below chosen destinations; `finish()` gives the stream."""

    def __init__(self) -> None:
        self._file: BinaryIO = tempfile.TemporaryFile(prefix="deployctl-ctx-")   # type: ignore[assignment]
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.PAX_FORMAT)
        self._dirs: set[str] = set()

    def _info(self, name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.size, ti.mtime = kind, mode, size, MTIME
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        return ti

    def _parents(self, name: str) -> None:
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d and d not in self._dirs:
                self._dirs.add(d)
                self._tar.addfile(self._info(d, tarfile.DIRTYPE, 0o755))

    def add_bytes(self, name: str, data: bytes, mode: int = 0o644) -> None:
        name = _clean(name)
        self._parents(name)
        self._tar.addfile(self._info(name, tarfile.REGTYPE, mode, len(data)), io.BytesIO(data))

    def add_tree(self, src: Path, dest: str, exclude: tuple[str, ...]) -> None:
        """SRC (a file or a folder) at DEST: a folder's contents go below DEST."""
        dest = _clean(dest)
        for e in walk(src, exclude):
            if src.is_dir():
                name = posixpath.join(dest, e.rel) if e.rel else dest
            else:
                name = dest
            name = _clean(name)
            if not name or name == ".":
                continue
            self._parents(name)
            if e.kind == "dir":
                if name not in self._dirs:
                    self._dirs.add(name)
                    self._tar.addfile(self._info(name, tarfile.DIRTYPE, e.mode))
            elif e.kind == "symlink":
                ti = self._info(name, tarfile.SYMTYPE, e.mode)
                ti.linkname = os.readlink(e.path)
                self._tar.addfile(ti)
            else:
                size = os.path.getsize(e.path)
                with open(e.path, "rb") as f:
                    self._tar.addfile(self._info(name, tarfile.REGTYPE, e.mode, size), f)

    def add_members(self, members: Iterable[tuple[tarfile.TarInfo, bytes | None]], dest: str) -> None:
        """Members of another tar (e.g. copied out of a container) re-rooted below DEST."""
        for m, data in members:
            name = _clean(posixpath.join(dest, m.name))
            if m.isdir():
                self._parents(name + "/x")
            elif m.isfile() and data is not None:
                self.add_bytes(name, data, m.mode)
            elif m.issym():
                self._parents(name)
                ti = self._info(name, tarfile.SYMTYPE, 0o777)
                ti.linkname = m.linkname
                self._tar.addfile(ti)

    def finish(self) -> BinaryIO:
        self._tar.close()
        self._file.seek(0)
        return self._file


def _clean(name: str) -> str:
    name = posixpath.normpath(name.lstrip("/")) if name else ""
    return "" if name == "." else name
