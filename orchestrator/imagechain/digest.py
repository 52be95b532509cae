"""Content hashing of inputs and the per-step digest.

A step's digest = sha256 of a canonical JSON "material": the step kind, the platform it is built for
(linux/arm64, linux/amd64: an arm64 build never reuses an amd64 cache image, whatever else they share),
the rendered Dockerfile (or script), build args, the content hash of every input (with where it goes),
the parent image ID and the IDs of the images it uses. `step_digest` is pure; `hash_tree` reads files.

`walk` is the single file walk both the hash and the upload tars use, so what is hashed is exactly
what is shipped: relative path, type, executable bit, content (or symlink target).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

DIGEST_VERSION = 1               # bump when the meaning of a step changes (forces rebuilds)
_BUF = 1 << 20


@dataclass(frozen=True)
class Entry:
    rel: str                     # posix path below the walked root ("" for a single file: its name)
    path: Path
    kind: str                    # file | dir | symlink
    mode: int                    # permission bits


def _excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, pat) for pat in exclude)


def walk(root: Path, exclude: tuple[str, ...]) -> Iterator[Entry]:
    """Files, folders and symlinks below ROOT (or ROOT itself when it is a file), sorted, deterministic."""
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode):
        yield _entry(root.name, root, st)
        return
    yield Entry("", root, "dir", stat.S_IMODE(st.st_mode))
    stack = [(root, "")]
    while stack:
        d, rel = stack.pop()
        names = sorted(os.listdir(d))
        subdirs = []
        for name in names:
            if _excluded(name, exclude):
                continue
            p = d / name
            r = f"{rel}/{name}" if rel else name
            st = os.lstat(p)
            e = _entry(r, p, st)
            yield e
            if e.kind == "dir":
                subdirs.append((p, r))
        stack.extend(reversed(subdirs))


def _entry(rel: str, path: Path, st: os.stat_result) -> Entry:
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif stat.S_ISDIR(st.st_mode):
        kind = "dir"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    else:
        raise ValueError(f"{path}: not a file, folder or symlink (sockets and devices cannot be inputs)")
    return Entry(rel, path, kind, stat.S_IMODE(st.st_mode))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_BUF):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path, exclude: tuple[str, ...] = ()) -> str:
    """sha256 over (path, type, exec bit, content) of everything `walk` yields."""
    h = hashlib.sha256()
    for e in walk(root, exclude):
        if e.kind == "file":
            what = file_sha256(e.path)
        elif e.kind == "symlink":
            what = os.readlink(e.path)
        else:
            what = ""
        h.update(json.dumps([e.rel, e.kind, bool(e.mode & 0o111), what]).encode() + b"\n")
    return h.hexdigest()


def canonical(material: Any) -> bytes:
    return json.dumps(material, sort_keys=True, separators=(",", ":"), default=str).encode()


def step_digest(material: dict[str, Any]) -> str:
    """Pure: the digest of a step from its material (see the module docstring)."""
    return "sha256:" + hashlib.sha256(canonical({"v": DIGEST_VERSION, **material})).hexdigest()


def step_material(*, kind: str, chain: str, step: str, platform: str, text: str, args: dict[str, str],
                  inputs: list[tuple[str, str]], parent_id: str, uses: dict[str, str],
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a step's digest covers. `platform` is the image platform built for (linux/arm64);
    `text` is the rendered Dockerfile or the script; `inputs` = (destination, content hash) pairs;
    `uses` = step name -> image ID."""
    return {"kind": kind, "chain": chain, "step": step, "platform": platform, "text": text,
            "args": dict(sorted(args.items())), "inputs": sorted(inputs), "parent": parent_id,
            "uses": dict(sorted(uses.items())), "extra": extra or {}}
