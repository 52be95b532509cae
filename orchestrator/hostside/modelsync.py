"""Host-side half of sync-model: manifests, verification, mount facts. Standard library only.

This file is sent to a host over SSH and run there with the host's python3 (see remote.py:
`python3 -c BOOTSTRAP N OP ARGS`, the first N bytes of stdin are this source, the rest is the
operation's input). It writes nothing on the host except its hash cache and, when asked, a marker.

  manifest --root DIR --cache FILE [--rehash] [--marker NAME=NONCE] [--require PATH]... [--tensor NAME]...
      The checkpoint's files (relative path, size, sha256), symlinks followed (an HF snapshot's
      links into ../../blobs are read through); per --tensor, the file holding it (the index's
      weight_map) and its absolute byte range [start, end) in that file. Prints one JSON object.
  verify --root DIR --cache FILE [--sizes-only] [--rehash] [--marker NAME] [--clean]   (stdin: a manifest)
      Which of the manifest's files are missing or differ here, extra files, free space on the
      filesystem that would receive them, rsync present. Prints one JSON object. --clean: when
      complete, remove rsync's leftovers (partial-dir, temp files of manifest files).
  unmark --root DIR --marker NAME
      Remove a marker written by `manifest --marker`.

verify's stdin may carry "seen": {rel: cache entry} for files a chain node hashed while writing
them (orchestrator/hostside/chain_node.py); they count as cached while their stat is unchanged.
And "partial": {rel: [[start, end], ...]}: files this node should hold only in part (a DeepSeek rank's
own Engram rows plus everything that is not an Engram row; orchestrator/modelsync/rows.py). Such a
file counts as the manifest's when the node's record of partial files (ROOT/.deployctl-partial.json,
written by chain_node.py after the whole stream matched the manifest's sha256) names the same sha256
and the same ranges, and the kept ranges still hash to the recorded value ("kept:" entries in the hash
cache; --rehash reads the kept ranges again). A whole file always counts; a partial file where the
whole one is wanted never does.
Hash cache: FILE maps a relative path to [size, mtime_ns, ctime_ns, inode, sha256, nlink] of the file
it was hashed from; a file is re-hashed when any of those changed (ctime: a rewrite that restored the
mtime still shows, whatever the link count did). A hard link added or removed moves ctime and the link
count, not one byte, and a write may ride along unseen, so the stat alone never excuses it: whoever
makes or removes the link restamps the entry (`restamp`: stage-engram, which links the Engram shards,
does so for exactly the files it linked, when their entry was current just before), and the first
no-op after a cold up hashes nothing. --rehash trusts no stat at all. Names starting with `.deployctl` are ours (partial-dir, markers): never listed.
Progress goes to stderr as `progress HASHED TOTAL` lines; errors exit 3 with one line on stderr.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# How the controller starts this file: `python3 -c BOOTSTRAP N OP ARGS`, this source as the first
# N bytes of stdin (nothing is installed on the host), the operation's input after it.
BOOTSTRAP = ("import sys;n=int(sys.argv.pop(1));"
             "exec(compile(sys.stdin.buffer.read(n),'deployctl-modelsync','exec'))")
OURS = ".deployctl"                   # prefix of names we create inside a checkpoint folder
PARTIAL_DIR = ".deployctl-rsync-partial"   # rsync --partial-dir (rsync.py uses this name)
CHAIN_PARTIAL = ".deployctl-chain-partial"  # chain_node.py's PARTIAL: files not yet verified
PARTIAL_RECORD = ".deployctl-partial.json"  # chain_node.py's RECORD: the files held only in part
KEPT = "kept:"                        # a hash-cache value that is the sha256 of a partial file's kept ranges
RSYNC_TEMP = re.compile(r"^\.(.+)\.[A-Za-z0-9]{6}$")   # rsync's temp name for NAME
CHUNK = 8 * 1024 * 1024
CACHE_VERSION = 1
PROGRESS_EVERY_S = 2.0


class Fail(Exception):
    """A problem the operator must fix; printed as one line, exit 3."""


# -- walking and hashing -------------------------------------------------------------------------

def walk(root: str) -> tuple[dict[str, os.stat_result], list[str]]:
    """Relative path -> stat (links followed) of every file below ROOT; and broken links."""
    files: dict[str, os.stat_result] = {}
    broken: list[str] = []
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:       # a link loop: do not descend twice
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(OURS))
        for name in sorted(filenames):
            if name.startswith(OURS):
                continue
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            try:
                fst = os.stat(full)
            except FileNotFoundError:
                broken.append(f"{rel} -> {os.readlink(full)}" if os.path.islink(full) else rel)
                continue
            if os.path.isfile(full):
                files[rel] = fst
    return files, broken


def stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def same_file(key: list[int], nlink: int | None, st: os.stat_result) -> bool:
    """ST is still the file stamped KEY (and NLINK links): size, mtime, ctime, inode and link count all
    as recorded. A moved ctime is a write even when the link count moved too (a link and a write that
    restored the mtime look alike): a hard link is excused only by its maker's `restamp`.
    hostside/hubfetch.py applies the same rule to its state."""
    return key == stat_key(st) and (nlink is None or nlink == st.st_nlink)


def link_move(before: os.stat_result, after: os.stat_result) -> list | None:
    """[old stamp, old nlink, new stamp, new nlink] when BEFORE -> AFTER (one file's stat around a
    link(2), unlink(2) or rename(2) the caller made) moved ctime or the link count and nothing else
    (same inode, size, mtime); None otherwise (nothing to restamp, or something else happened)."""
    a, b = stat_key(before), stat_key(after)
    if a[0] != b[0] or a[1] != b[1] or a[3] != b[3] or (a == b and before.st_nlink == after.st_nlink):
        return None
    return [a, before.st_nlink, b, after.st_nlink]


def restamp(cache_path: str, root: str, moves: dict[str, list]) -> list[str]:
    """The linker's half of the hash cache's rule: for each rel -> MOVE (`link_move`, in order) whose
    entry in CACHE_PATH (for ROOT) was current at the move's old stat, the entry now holds the new
    stat. An entry that was not current stays as it is (its file is re-hashed next time: a write before
    the link is not excused). Returns the rels restamped. Best effort: a cache that cannot be read or
    written costs a re-hash, never a missed write."""
    try:
        with open(cache_path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return []
    if doc.get("version") != CACHE_VERSION or doc.get("root") != os.path.realpath(root):
        return []
    files, done = doc.get("files") or {}, []
    for rel, chain in moves.items():
        e = files.get(rel)
        for old, old_n, new, new_n in chain:
            if e and len(e) >= 5 and e[:4] == old and (len(e) < 6 or e[5] == old_n):
                e = files[rel] = new + [e[4], new_n]
                if rel not in done:
                    done.append(rel)
    if done:
        HashCache.write(cache_path, doc)
    return done


def cached_value(cache_path: str, root: str, rel: str, st: os.stat_result) -> str | None:
    """The hash cache's value for REL (a sha256, or KEPT + the kept ranges' sha256) when its entry
    stamps exactly ST: what sync-model read this file to be in its current state; else None."""
    try:
        with open(cache_path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    if doc.get("version") != CACHE_VERSION or doc.get("root") != os.path.realpath(root):
        return None
    e = (doc.get("files") or {}).get(rel)
    if not e or len(e) < 5 or not same_file(e[:4], e[5] if len(e) > 5 else None, st):
        return None
    return e[4]


def sha256_file(path: str, on_bytes) -> str:
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])                    # releases the GIL: threads hash in parallel
            on_bytes(n)
    return h.hexdigest()


def sha256_spans(path: str, spans: list, on_bytes) -> str:
    """sha256 of the bytes of SPANS ([start, end) in file order) concatenated: a partial file's kept
    ranges (chain_node.py hashes the same bytes as it writes them)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        for start, end in spans:
            pos = start
            while pos < end:
                data = os.pread(f.fileno(), min(CHUNK, end - pos), pos)
                if not data:
                    raise Fail(f"{path} ends at {pos}, before its kept range [{start}, {end})")
                h.update(data)
                pos += len(data)
                on_bytes(len(data))
    return h.hexdigest()


def read_record(root: str) -> dict:
    """ROOT's record of partial files: rel -> {"sha256": the whole file's, "keep": spans, "kept": sha256}."""
    try:
        with open(os.path.join(root, PARTIAL_RECORD)) as f:
            doc = json.load(f)
        return doc.get("files", {}) if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


class HashCache:
    """rel -> [size, mtime_ns, ctime_ns, ino, sha256], for one checkpoint root."""

    def __init__(self, path: str, root: str, ignore: bool):
        self.path, self.root = path, os.path.realpath(root)
        self.entries: dict[str, list] = {}
        if not ignore:
            try:
                with open(path) as f:
                    doc = json.load(f)
                if doc.get("version") == CACHE_VERSION and doc.get("root") == self.root:
                    self.entries = doc.get("files", {})
            except (OSError, ValueError):
                pass

    def get(self, rel: str, st: os.stat_result) -> str | None:
        e = self.entries.get(rel)
        if not e or not same_file(e[:4], e[5] if len(e) > 5 else None, st):
            return None
        return e[4]

    def put(self, rel: str, st: os.stat_result, sha: str) -> None:
        self.entries[rel] = stat_key(st) + [sha, st.st_nlink]

    def save(self, keep: set[str]) -> None:
        """Atomically (temp, fsync, rename); only entries for files that still exist. Best effort:
        a cache that cannot be written costs a re-hash next time, not this run."""
        self.write(self.path, {"version": CACHE_VERSION, "root": self.root,
                               "files": {k: v for k, v in self.entries.items() if k in keep}})

    @staticmethod
    def write(path: str, doc: dict) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            print(f"warning: hash cache {path} not written: {e}", file=sys.stderr, flush=True)


def hash_files(root: str, todo: dict[str, os.stat_result], cache: HashCache,
                spans: dict[str, list] | None = None) -> tuple[dict[str, str], int]:
    """sha256 of each file in TODO (from the cache where its stat is unchanged); bytes hashed. A file in
    SPANS is hashed over those ranges only: KEPT + their sha256. A cached value of either kind stands
    while the stat does (a KEPT one where the whole file is wanted then simply differs, unread)."""
    spans = spans or {}
    out: dict[str, str] = {}
    need = []
    for rel, st in todo.items():
        sha = cache.get(rel, st)
        if sha:
            out[rel] = sha
        else:
            need.append(rel)

    def size(rel: str) -> int:
        return sum(e - s for s, e in spans[rel]) if rel in spans else todo[rel].st_size
    total = sum(size(r) for r in need)
    done = [0]
    lock = threading.Lock()
    last = [time.monotonic()]

    def on_bytes(n: int) -> None:
        with lock:
            done[0] += n
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                print(f"progress {done[0]} {total}", file=sys.stderr, flush=True)

    def one(rel: str) -> tuple[str, str]:
        path = os.path.join(root, rel)
        if rel in spans:
            return rel, KEPT + sha256_spans(path, spans[rel], on_bytes)
        return rel, sha256_file(path, on_bytes)

    # Big files first so the threads finish together; a few threads saturate NVMe or NFS.
    need.sort(key=lambda r: -size(r))
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(need)))) as pool:
        for rel, sha in pool.map(one, need):
            # The stat from before hashing: a file changed while being read is re-hashed next time.
            cache.put(rel, todo[rel], sha)
            out[rel] = sha
    return out, total


# -- facts about where the files live ------------------------------------------------------------

def nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def free_bytes(path: str) -> tuple[str, int]:
    """Like `df -B1 --output=avail` of the nearest existing parent (f_bavail: what non-root gets)."""
    p = nearest_existing(path)
    st = os.statvfs(p)
    return p, st.f_bavail * st.f_frsize


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def mount_of(path: str) -> dict:
    """The mount holding PATH (nearest existing parent), from /proc/self/mountinfo: the last
    (topmost) entry whose mount point is the longest prefix of the real path."""
    real = os.path.realpath(nearest_existing(path))
    best: dict = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        left, _, right = line.partition(" - ")
        a, b = left.split(), right.split()
        if len(a) < 5 or len(b) < 2:
            continue
        target = _unescape(a[4])
        inside = real == target or real.startswith(target.rstrip("/") + "/")
        if inside and len(target) >= len(best.get("target", "")):
            best = {"target": target, "fsroot": _unescape(a[3]), "devno": a[2],
                    "fstype": b[0], "source": _unescape(b[1])}
    if best:
        rel = os.path.relpath(real, best["target"])
        best["path_in_fs"] = os.path.normpath(os.path.join(best["fsroot"], rel))
    try:
        best["fsid"] = str(os.statvfs(real).f_fsid)
    except (OSError, AttributeError):
        pass
    best["realpath"] = real
    return best


# -- operations ----------------------------------------------------------------------------------

def _marker_path(root: str, name: str) -> str:
    if not name.startswith(OURS) or "/" in name:
        raise Fail(f"bad marker name {name!r}")
    return os.path.join(root, name)


def _no_root(root: str) -> Fail:
    """The checkpoint folder is missing: say what an HF cache here does have."""
    msg = f"no checkpoint folder {root}"
    snaps = os.path.dirname(root.rstrip("/"))
    if os.path.basename(snaps) == "snapshots":
        repo = os.path.dirname(snaps)
        refs = {}
        try:
            for name in sorted(os.listdir(os.path.join(repo, "refs"))):
                with open(os.path.join(repo, "refs", name)) as f:
                    refs[name] = f.read().strip()
        except OSError:
            pass
        try:
            have = sorted(os.listdir(snaps))
        except OSError:
            have = []
        if refs:
            msg += "; refs here: " + ", ".join(f"{k} -> {v}" for k, v in refs.items())
        if have:
            msg += "; snapshots here: " + ", ".join(have[:5])
        if refs or have:
            msg += " (pin model.revision to one of these commits)"
    return Fail(msg)


def tensor_ranges(root: str, names: list[str]) -> dict[str, list]:
    """name -> [file (relative), start, end]: where each tensor's bytes are, from the index's weight_map
    (or the one model.safetensors) and that file's own header, the way safetensors readers find them
    (8-byte little-endian header length, JSON header, data_offsets after it). A name the index does
    not hold is left out (the caller sends whole files then; stage-engram names what is missing)."""
    if not names:
        return {}
    index = os.path.join(root, "model.safetensors.index.json")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except FileNotFoundError:
        weight_map = {n: "model.safetensors" for n in names} if os.path.isfile(
            os.path.join(root, "model.safetensors")) else {}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Fail(f"{index}: no readable weight_map ({e})")
    out: dict[str, list] = {}
    headers: dict[str, tuple[int, dict]] = {}
    for name in names:
        rel = weight_map.get(name)
        if rel is None:
            continue
        if rel not in headers:
            try:
                with open(os.path.join(root, rel), "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    headers[rel] = (8 + n, json.loads(f.read(n)))
            except (OSError, ValueError) as e:
                raise Fail(f"{os.path.join(root, rel)}: unreadable safetensors header ({e})")
        start, hdr = headers[rel]
        meta = hdr.get(name)
        if not isinstance(meta, dict) or "data_offsets" not in meta:
            continue
        lo, hi = meta["data_offsets"]
        out[name] = [rel, start + int(lo), start + int(hi)]
    return out


def op_manifest(args: dict) -> dict:
    root = args["root"]
    t0 = time.monotonic()
    missing_req = [p for p in args["require"] if not os.access(p, os.R_OK)]
    if not os.path.isdir(root):
        raise _no_root(root)
    files, broken = walk(root)
    if broken:
        raise Fail(f"broken links in {root} (an unfinished download?): " + ", ".join(broken[:5]))
    if not files:
        raise Fail(f"{root} holds no files")
    cache = HashCache(args["cache"], root, args["rehash"])
    shas, hashed = hash_files(root, files, cache)
    cache.save(set(files))
    out = {"root": root, "files": [[rel, files[rel].st_size, shas[rel]] for rel in sorted(files)],
           "hashed_bytes": hashed, "seconds": round(time.monotonic() - t0, 3),
           "mount": mount_of(root), "missing_required": missing_req,
           "rsync": shutil.which("rsync"), "ssh": shutil.which("ssh"),
           "tensors": tensor_ranges(root, args["tensor"])}
    if args["marker"]:
        name, _, nonce = args["marker"].partition("=")
        path = _marker_path(root, name)
        try:
            with open(path + ".tmp", "w") as f:
                f.write(nonce)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path + ".tmp", path)
        except OSError as e:
            raise Fail(f"cannot write the shared-storage marker {path}: {e}")
    return out


def op_verify(args: dict, manifest: dict) -> dict:
    root = args["root"]
    t0 = time.monotonic()
    avail_path, avail = free_bytes(root)
    out = {"root": root, "exists": os.path.isdir(root), "avail_path": avail_path, "avail_bytes": avail,
           "mount": mount_of(root), "rsync": shutil.which("rsync"), "missing": [], "differ": [],
           "ok": 0, "extra": [], "hashed_bytes": 0, "marker": None}
    want = {rel: (size, sha) for rel, size, sha in manifest["files"]}
    if args["marker"]:
        try:
            with open(_marker_path(root, args["marker"])) as f:
                out["marker"] = f.read()
        except OSError:
            pass
    if not out["exists"]:
        out["missing"] = sorted(want)
        out["seconds"] = round(time.monotonic() - t0, 3)
        return out
    have, broken = walk(root)
    out["extra"] = sorted(set(have) - set(want)) + [b for b in broken if b.split(" -> ")[0] not in want]
    same_size = {}
    for rel, (size, _sha) in sorted(want.items()):
        st = have.get(rel)
        if st is None:
            out["missing"].append(rel)
        elif st.st_size != size:
            out["differ"].append([rel, f"size {st.st_size} != {size}"])
        else:
            same_size[rel] = st
    if args["sizes_only"]:
        out["ok"] = len(same_size)
    else:
        cache = HashCache(args["cache"], root, args["rehash"])
        spans, expect = partial_expectations(root, manifest.get("partial") or {}, want, same_size)
        if not args["rehash"]:
            # a chain node hashed these as it wrote them and matched the manifest (chain_node.py); its
            # entry stands only while the file's stat is still the one it took after the rename
            for rel, e in (manifest.get("seen") or {}).items():
                if rel in want and len(e) == 6 and e[4] in (want[rel][1], expect.get(rel)):
                    cache.entries[rel] = e
        shas, out["hashed_bytes"] = hash_files(root, same_size, cache, spans)
        cache.save(set(have))
        out["partial_ok"] = 0
        for rel in sorted(same_size):
            if shas[rel] in (want[rel][1], expect.get(rel)):
                out["ok"] += 1
                out["partial_ok"] += shas[rel] == expect.get(rel)
            elif rel in spans:
                out["differ"].append([rel, "its kept ranges no longer hash to what the chain wrote"])
            elif shas[rel].startswith(KEPT):
                out["differ"].append([rel, "held in part (another rank's rows, or the whole file is wanted)"])
            else:
                out["differ"].append([rel, f"sha256 {shas[rel][:12]}... != {want[rel][1][:12]}..."])
    if args["clean"] and not out["missing"] and not out["differ"]:
        out["cleaned"] = clean(root, want, out["extra"])
        out["extra"] = [e for e in out["extra"] if e not in out["cleaned"]]
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def partial_expectations(root: str, partial: dict, want: dict, present: dict) -> tuple[dict, dict]:
    """For the files this node should hold in part: (rel -> spans to hash, rel -> the value they must
    hash to), for those the record says were written from a stream that matched the manifest with
    exactly these ranges kept. The others are judged whole (a whole file is always right)."""
    if not partial:
        return {}, {}
    record = read_record(root)
    spans, expect = {}, {}
    for rel, keep in partial.items():
        rec = record.get(rel)
        if rel in present and isinstance(rec, dict) and rec.get("sha256") == want[rel][1] and rec.get("keep") == keep:
            spans[rel], expect[rel] = keep, KEPT + str(rec.get("kept"))
    return spans, expect


def clean(root: str, want: dict, extra: list[str]) -> list[str]:
    """After a complete copy: drop rsync's leftovers, i.e. the partial-dir and the temp files of a
    killed receiver (`.NAME.XXXXXX` next to a manifest file NAME), and a chain's partial folder.
    Nothing else is touched."""
    removed = []
    for name in (PARTIAL_DIR, CHAIN_PARTIAL):
        partial = os.path.join(root, name)
        if os.path.isdir(partial):
            shutil.rmtree(partial, ignore_errors=True)
            removed.append(name)
    for rel in extra:
        d, name = os.path.split(rel)
        m = RSYNC_TEMP.match(name)
        if m and os.path.join(d, m.group(1)) in want:
            try:
                os.unlink(os.path.join(root, rel))
                removed.append(rel)
            except OSError:
                pass
    return removed


def op_unmark(args: dict) -> dict:
    path = _marker_path(args["root"], args["marker"])
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return {"removed": path}


def parse(argv: list[str]) -> dict:
    if not argv or argv[0] not in ("manifest", "verify", "unmark"):
        raise Fail("usage: {manifest|verify|unmark} --root DIR ...")
    args = {"op": argv[0], "root": "", "cache": "", "rehash": False, "sizes_only": False, "marker": "",
            "require": [], "tensor": [], "clean": False}
    it = iter(argv[1:])
    for a in it:
        if a in ("--root", "--cache", "--marker"):
            args[a[2:]] = next(it)
        elif a in ("--require", "--tensor"):
            args[a[2:]].append(next(it))
        elif a in ("--rehash", "--sizes-only", "--clean"):
            args[a[2:].replace("-", "_")] = True
        else:
            raise Fail(f"unknown argument {a!r}")
    if not args["root"]:
        raise Fail("--root is required")
    return args


def main(argv: list[str]) -> int:
    try:
        args = parse(argv)
        if args["op"] == "manifest":
            out = op_manifest(args)
        elif args["op"] == "verify":
            out = op_verify(args, json.loads(sys.stdin.buffer.read() or b"{}"))
        else:
            out = op_unmark(args)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    except OSError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 3
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
