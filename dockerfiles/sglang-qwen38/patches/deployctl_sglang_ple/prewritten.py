"""Is the PLE table file beside its deployctl manifest still the table of this checkpoint?

Standard library only: the SGLang patch (qwen4_exp_prewritten.py) and deployctl's engine double both
call `verdict`. The manifest is what deployctl's write-ple op writes last, after the read-back check
(orchestrator/hostside/ple_write.py): `<table>.deployctl-manifest.json` with the table's name, size,
inode and mtime, and the identity (name, size, mtime, sha256 of the safetensors header) of every
checkpoint file the rows came from. Any difference, or no manifest, means "let the engine write it".
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

MANIFEST_SUFFIX = ".deployctl-manifest.json"
MANIFEST_FORMAT = "deployctl-ple-manifest/2"
MAX_HEADER = 100 * 1024 * 1024


def header_sha256(path: str) -> str:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER:
            raise ValueError(f"{path}: header length {n}")
        return hashlib.sha256(f.read(n)).hexdigest()


def verdict(table_path: str, expected_bytes: int, model_path: str) -> tuple[bool, str]:
    """(keep, why): keep only when the file has the size the engine maps, is the very file its
    manifest describes (inode, mtime) and the checkpoint files are the ones it was written from."""
    name = os.path.basename(table_path)
    try:
        st = os.stat(table_path)
    except FileNotFoundError:
        return False, f"{name} does not exist"
    try:
        with open(table_path + MANIFEST_SUFFIX) as f:
            man = json.load(f)
    except FileNotFoundError:
        return False, f"no deployctl manifest beside {name}"
    except ValueError as e:
        return False, f"unreadable deployctl manifest beside {name} ({e})"
    if not isinstance(man, dict) or man.get("format") != MANIFEST_FORMAT:
        return False, f"the manifest beside {name} is not {MANIFEST_FORMAT}"
    if man.get("file") != name:
        return False, f"the manifest describes {man.get('file')!r}, not {name}"
    if not (st.st_size == expected_bytes == man.get("bytes")):
        return False, (f"{name} has {st.st_size} bytes, the engine maps {expected_bytes}, the manifest "
                       f"says {man.get('bytes')}")
    rec = man.get("stat") or {}
    if (st.st_ino, st.st_mtime_ns) != (rec.get("ino"), rec.get("mtime_ns")):
        return False, f"{name} was modified or replaced after deployctl wrote it (inode/mtime differ)"
    files = (man.get("source") or {}).get("files") or []
    if not files:
        return False, "the manifest names no checkpoint files"
    for f in files:
        p = os.path.join(model_path, f["name"])
        try:
            fst = os.stat(p)
            same = (fst.st_size == f["size"] and fst.st_mtime_ns == f["mtime_ns"]
                    and header_sha256(p) == f["header_sha256"])
        except (OSError, ValueError, KeyError, struct.error):
            same = False
        if not same:
            return False, f"checkpoint file {f.get('name')} is not the one the table was written from"
    return True, (f"{name} was written by deployctl from this checkpoint ({len(files)} file(s): "
                  "size, mtime and header equal) and is unchanged since (size, inode, mtime)")
