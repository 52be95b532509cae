"""Host-side half of fetch-model: the checkpoint from a Hugging Face Hub into the head's HF cache.

Sent over SSH and run like hostside/modelsync.py (`python3 -c BOOTSTRAP N OP`: this source is the
first N bytes of stdin, the job's JSON the rest, so the token never appears in an argv). Three ops:

  resolve  (the head's python3, standard library) the Hub's model_info for the recipe's revision:
           the commit it names and the files the allow patterns select, with sizes and hashes.
  check    (the head's python3) is the snapshot at that commit complete and verified? Decided from
           the state file by size, mtime, ctime, inode and link count, without reading a byte
           (--rehash: no); a hard link is no write only when its maker restamped the state
           (`restamp`: stage-engram does, for the Engram shards it links).
  fetch    (in the serving image, whose python has huggingface_hub: vLLM and SGLang depend on it)
           check free space, download what is missing with the client's own transfer code, verify,
           publish into the HF cache layout, write the sync-model hash cache, then the state file.

The contract is huggingface_hub's (2.4.0, read for this):
- hf_api.py `HfApi.model_info(files_metadata=True)`: GET {endpoint}/api/models/{repo}/revision/{rev}
  ?blobs=true -> `sha` (the commit) and `siblings` [{rfilename, size, blobId, lfs: {sha256, size}}];
- utils/_http.py `hf_raise_for_status`: X-Error-Code RepoNotFound / RevisionNotFound / GatedRepo;
- utils/_paths.py `filter_repo_objects`: allow patterns are fnmatchcase, "dir/" means "dir/*";
- the cache layout (file_download.py `hf_hub_download`): models--ORG--NAME/blobs/<etag> (an LFS file's
  sha256, else its git blob id), snapshots/<commit>/<path> -> relative link to the blob,
  refs/<revision> holding the commit.
The transfer itself is `file_download.http_get` (auth headers, redirects, retries of a dropped
connection, Range resume) after `get_hf_file_metadata`. Not `hf_hub_download`: since 2.x it downloads
into a process-unique temporary file and deletes it on failure (`_download_to_tmp_and_move`), so a
killed run starts the file over, and it publishes a blob before anything checked its hash. Here the
partial file is `blobs/<etag>.incomplete` (resumed by the next run) and a blob becomes visible in the
snapshot only after its sha256 (LFS) or git blob id equals what the Hub published.

Progress goes to stderr as `progress {json}` lines; errors end with an `error: ...` line, exit 2 for
what the operator must fix before anything is written (no access, no such repo or revision, no
space), exit 1 for a failed download or a hash mismatch. The result is one JSON line on stdout.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import queue
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

BOOTSTRAP = ("import sys;n=int(sys.argv.pop(1));"
             "exec(compile(sys.stdin.buffer.read(n),'deployctl-hubfetch','exec'))")
STATE_VERSION = 1
CACHE_VERSION = 1                    # hostside/modelsync.py's hash cache format
CHUNK = 8 * 1024 * 1024
READ_CHUNK = 256 * 1024               # the client's read size (see _client)
PROGRESS_EVERY_S = 1.0
API_TIMEOUT_S = 30
COMMIT = re.compile(r"[0-9a-f]{40}")


class Fail(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


# -- the Hub's metadata (standard library) --------------------------------------------------------

def _request(url: str, token: str, method: str = "GET", endpoint: str = "") -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, method=method, headers={
        "User-Agent": "deployctl-fetch-model", **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=API_TIMEOUT_S) as r:
            return r.status, dict(r.headers), r.read() if method == "GET" else b""
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read() if method == "GET" else b""
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise Fail(f"cannot reach the Hub at {endpoint or url}: {reason} (check hf_endpoint in the inventory "
                   f"and the head's network)", 2) from None


def _hub_error(status: int, headers: dict, repo: str, revision: str, token: str) -> Fail:
    """hf_raise_for_status's reading of an error, as what the operator must do (exit 2)."""
    code = {k.lower(): v for k, v in headers.items()}.get("x-error-code", "")
    if code == "RevisionNotFound":
        return Fail(f"revision {revision!r} does not exist in {repo} (model.revision in the recipe)", 2)
    if code == "GatedRepo":
        if token:
            return Fail(f"{repo} is gated and the token has no access to it: request access on the Hub "
                        f"with the token's account", 2)
        return Fail(f"{repo} is gated: request access on the Hub, then give deployctl a token "
                    f"(HF_TOKEN in the environment, or hf_token_file in the inventory)", 2)
    if code == "RepoNotFound" or status in (401, 404):
        hint = "" if token else " (if it is private, give deployctl a token: HF_TOKEN or hf_token_file)"
        return Fail(f"repository {repo} not found on the Hub{hint} (model.repo in the recipe)", 2)
    return Fail(f"the Hub answered HTTP {status} for {repo}@{revision}", 1)


def selected(names: list[str], allow: list[str]) -> list[str]:
    """utils/_paths.py filter_repo_objects: fnmatchcase; a pattern ending in "/" matches below it."""
    if not allow:
        return list(names)
    pats = [p + "*" if p.endswith("/") else p for p in allow]
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]


def hub_metadata(job: dict) -> dict:
    endpoint, repo, rev, token = job["endpoint"].rstrip("/"), job["repo"], job["revision"], job.get("token", "")
    url = f"{endpoint}/api/models/{repo}/revision/{urllib.parse.quote(rev, safe='')}?blobs=true"
    status, headers, body = _request(url, token, endpoint=endpoint)
    if status != 200:
        raise _hub_error(status, headers, repo, rev, token)
    info = json.loads(body)
    files = []
    for s in info.get("siblings") or []:
        lfs = s.get("lfs") or {}
        files.append({"name": s["rfilename"], "size": int(s.get("size") or lfs.get("size") or 0),
                      "blob_id": s.get("blobId"), "sha256": lfs.get("sha256")})
    keep = set(selected([f["name"] for f in files], job.get("allow") or []))
    files = [f for f in files if f["name"] in keep]
    if not files:
        raise Fail(f"no file of {repo}@{rev} matches model.allow_patterns {job.get('allow')}", 2)
    commit = info.get("sha") or ""
    if info.get("gated"):      # model_info is public for a gated repo; its files are not: ask for one
        first = urllib.parse.quote(files[0]["name"])
        status, headers, _ = _request(f"{endpoint}/{repo}/resolve/{commit}/{first}", token, "HEAD", endpoint)
        if status in (401, 403):
            raise _hub_error(status, headers, repo, rev, token)
    return {"commit": commit, "files": files, "gated": bool(info.get("gated"))}


def from_cache(job: dict) -> dict:
    """What the head's cache says without the Hub: the commit (pinned, or refs/<revision> as the last
    fetch wrote it) and, when a fetch verified it, its files."""
    rev = job["revision"]
    commit = rev if COMMIT.fullmatch(rev) else ""
    if not commit:
        try:
            with open(os.path.join(repo_dir(job), "refs", rev)) as fh:
                commit = fh.read().strip()
        except OSError:
            pass
    rec = load_state(job["state"]).get("commits", {}).get(commit, {}) if commit else {}
    files = [{"name": n, "size": v["size"], "blob_id": v["blob_id"], "sha256": v["sha256"]}
             for n, v in sorted(rec.get("files", {}).items())]
    return {"commit": commit, "files": files, "gated": False}


def verified_pin(job: dict) -> bool:
    """Whether the revision is a commit this head fetched and verified with the same allow_patterns:
    a commit never changes, so its files are what the Hub would list, and the run needs no answer
    from the Hub (a rollback to a release's commit must not fail on an unreachable Hub, a revoked
    token or a rewritten repository after the failed run removed what ran)."""
    rev = job["revision"]
    rec = load_state(job["state"]).get("commits", {}).get(rev, {}) if COMMIT.fullmatch(rev) else {}
    return bool(rec.get("files")) and rec.get("allow") == list(job.get("allow") or [])


def op_resolve(job: dict) -> dict:
    """The commit and files of the run: from the Hub when asked (a head that cannot reach it falls
    back to what its cache verified, saying so), else from the cache; then `check` on them. A pinned
    commit this head verified is taken from its cache without asking (verified_pin)."""
    out: dict = {"source": "cache", "offline": ""}
    if job.get("ask_hub") and not verified_pin(job):
        try:
            out.update(hub_metadata(job), source="hub")
        except Fail as e:
            if "cannot reach the Hub" not in str(e):
                raise
            out.update(from_cache(job), offline=str(e))
            if not out["files"]:
                raise
    else:
        out.update(from_cache(job))
    out["total"] = sum(f["size"] for f in out["files"])
    out["uid"], out["gid"] = os.getuid(), os.getgid()
    if out["commit"] and out["files"]:
        out["check"] = op_check({**job, "commit": out["commit"], "files": out["files"]})
    return out


# -- the cache layout and the state ----------------------------------------------------------------

def repo_dir(job: dict) -> str:
    return os.path.join(job["model_cache"], "models--" + job["repo"].replace("/", "--"))


def etag(f: dict) -> str:
    return f["sha256"] or f["blob_id"]


def stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def same_file(key: list[int], nlink: int | None, st: os.stat_result) -> bool:
    """hostside/modelsync.py `same_file` (this file runs alone on the head): size, mtime, ctime, inode
    and link count as recorded. A moved ctime is a write, whatever the link count did: stage-engram's
    hard link to a shard's blob is excused by its `restamp` of this state, nothing else."""
    return key == stat_key(st) and (nlink is None or nlink == st.st_nlink)


def restamp(state_path: str, moves: list[list]) -> int:
    """The linker's half of `same_file`: every file record of the state (any commit) stamped exactly a
    move's old stat and link count (hostside/modelsync.py `link_move`, in order) gets its new ones.
    Returns how many records moved; best effort (a state not restamped costs one re-verification)."""
    state = load_state(state_path)
    n = 0
    for old, old_n, new, new_n in moves:
        for c in (state.get("commits") or {}).values():
            for rec in (c.get("files") or {}).values():
                if rec.get("stat") == old and rec.get("nlink", old_n) == old_n:
                    rec["stat"], rec["nlink"] = new, new_n
                    n += 1
    if n:
        try:
            write_json(state_path, state)
        except OSError:
            return 0
    return n


def load_state(path: str) -> dict:
    try:
        with open(path) as fh:
            doc = json.load(fh)
        return doc if doc.get("version") == STATE_VERSION else {}
    except (OSError, ValueError):
        return {}


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def plan_files(job: dict) -> tuple[list[dict], list[dict], int]:
    """(files current by the state, files to fetch, bytes already in their partial files)."""
    rdir = repo_dir(job)
    snap = os.path.join(rdir, "snapshots", job["commit"])
    known = load_state(job["state"]).get("commits", {}).get(job["commit"], {}).get("files", {})
    done, todo, partial = [], [], 0
    for f in job["files"]:
        rec = known.get(f["name"])
        try:
            st = os.stat(os.path.join(snap, f["name"]))
        except OSError:
            st = None
        if (not job.get("rehash") and rec and st is not None and rec["etag"] == etag(f)
                and same_file(rec["stat"], rec.get("nlink"), st)):
            done.append(f)
            continue
        todo.append(f)
        try:
            partial += os.path.getsize(os.path.join(rdir, "blobs", etag(f) + ".incomplete"))
        except OSError:
            pass
    return done, todo, partial


def space(job: dict, todo: list[dict], partial: int) -> dict:
    """What the files to fetch still need (their partial files hold the rest) against the free space
    of the model cache's filesystem, with the job's margin: what check reports and fetch refuses on."""
    where = nearest_existing(job["model_cache"])
    st = os.statvfs(where)
    out = {"need_bytes": max(0, sum(f["size"] for f in todo) - partial), "partial_bytes": partial,
           "free_bytes": st.f_bavail * st.f_frsize, "free_path": where,
           "margin_bytes": int(job.get("margin_bytes", 0))}
    out["fits"] = not todo or out["need_bytes"] + out["margin_bytes"] <= out["free_bytes"]
    return out


def op_check(job: dict) -> dict:
    done, todo, partial = plan_files(job)
    out = {"up_to_date": not todo, "files": len(job["files"]), "current": len(done),
           "missing": [f["name"] for f in todo][:20], "missing_count": len(todo), **space(job, todo, partial)}
    out["reason"] = (f"{len(done)} files at {job['commit'][:12]} verified (size, mtime, ctime, inode as "
                     f"when their hashes were checked)") if not todo else f"{len(todo)} files to fetch"
    return out


# -- the download ----------------------------------------------------------------------------------

def new_hash(lfs: bool, size: int):
    """What the Hub names a file by: an LFS file's sha256, else git's blob id (sha1 of "blob SIZE\\0" + data)."""
    return hashlib.sha256() if lfs else hashlib.sha1(f"blob {size}\0".encode())


def read_into(h, path: str, limit: int | None = None):
    """H updated with PATH's first LIMIT bytes (all of it: None)."""
    left = limit
    with open(path, "rb") as fh:
        while left is None or left > 0:
            b = fh.read(CHUNK if left is None else min(CHUNK, left))
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
    return h


class HashingFile:
    """The partial file as http_get writes it, hashed as it grows (in a thread of its own, so hashing
    overlaps the transfer; at most QUEUE chunks wait): verification costs no second read. http_get
    rewinds (seek + truncate) when a server ignores Range: the hash starts over then."""
    QUEUE = 32                          # chunks waiting for the hash thread (32 x 256 KiB)

    def __init__(self, path: str, lfs: bool, size: int):
        self.path, self.lfs, self.size = path, lfs, size
        self.fh = open(path, "ab")
        self.fh.seek(0, os.SEEK_END)
        self.q: "queue.Queue[bytes | None]" = queue.Queue(self.QUEUE)
        self.thread: threading.Thread | None = None
        self._reset(self.fh.tell())

    def _hasher(self, h) -> None:
        while (b := self.q.get()) is not None:
            h.update(b)

    def _stop(self) -> None:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join()
            self.thread = None

    def _reset(self, keep: int) -> None:
        self._stop()
        self.h = read_into(new_hash(self.lfs, self.size), self.path, keep)
        self.thread = threading.Thread(target=self._hasher, args=(self.h,), daemon=True)
        self.thread.start()

    def write(self, data) -> int:
        self.q.put(bytes(data))
        return self.fh.write(data)

    def tell(self) -> int:
        return self.fh.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.fh.seek(pos, whence)

    def truncate(self, size: int | None = None) -> int:
        n = self.fh.truncate(size)
        self.fh.flush()
        self._reset(self.fh.tell() if size is None else size)
        return n

    def flush(self) -> None:
        self.fh.flush()

    def close(self) -> None:
        # no fsync here: the blobs are flushed together before the state file is written (op_fetch)
        self.fh.close()
        self._stop()

    def hexdigest(self) -> str:
        self._stop()
        return self.h.hexdigest()


def hash_file(path: str, lfs: bool, size: int) -> str:
    return read_into(new_hash(lfs, size), path).hexdigest()


class Meter:
    """Bytes done per file and overall, printed as `progress {json}` lines every second."""

    def __init__(self, total: int, already: int):
        self.total, self.done, self.t0 = total, already, time.monotonic()
        self.start_done = already
        self.file, self.file_size, self.watch = "", 0, None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _file_done(self) -> int:
        try:
            return os.path.getsize(self.watch) if self.watch else 0
        except OSError:
            return 0

    def say(self, final: bool = False) -> None:
        cur = self._file_done()
        dt = max(time.monotonic() - self.t0, 1e-6)
        done = self.done + cur
        rate = (done - self.start_done) / dt
        doc = {"file": self.file, "file_done": cur, "file_size": self.file_size, "done": done,
               "total": self.total, "rate": round(rate), "eta_s": round((self.total - done) / rate) if rate else None}
        if final:
            doc["final"] = True
        print("progress " + json.dumps(doc), file=sys.stderr, flush=True)

    def _run(self) -> None:
        while not self.stop.wait(PROGRESS_EVERY_S):
            self.say()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _link(snap: str, name: str, blob: str) -> None:
    """snapshots/<commit>/<name> -> relative link to the blob, replaced atomically."""
    dst = os.path.join(snap, name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    rel = os.path.relpath(blob, os.path.dirname(dst))
    tmp = f"{dst}.deployctl-link.tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(rel, tmp)
    os.replace(tmp, dst)


def _client():
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")     # our progress lines, not tqdm's
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import huggingface_hub
        from huggingface_hub import constants, file_download
        from huggingface_hub.utils import build_hf_headers
    except ImportError:
        raise Fail("the serving image has no huggingface_hub (fetch-model runs the Hub's client from the "
                   "image; vLLM and SGLang images ship it)", 2) from None
    # http_get reads the body in DOWNLOAD_CHUNK_SIZE pieces (10 MiB), which httpx assembles by copying
    # into a growing buffer: measured here (2 vCPUs, 2 GB), 10 MiB pieces ~210 MB/s, 1 MiB ~290 MB/s,
    # 256 KiB ~530 MB/s (they stay in the CPU caches between the copy, the hash and the write)
    constants.DOWNLOAD_CHUNK_SIZE = READ_CHUNK
    return huggingface_hub, file_download, build_hf_headers


def op_fetch(job: dict) -> dict:
    t0 = time.monotonic()
    done, todo, partial = plan_files(job)
    rdir = repo_dir(job)
    blobs, snap = os.path.join(rdir, "blobs"), os.path.join(rdir, "snapshots", job["commit"])
    # Free space first, before a byte is written (the partial files already hold what they hold).
    sp = space(job, todo, partial)
    if not sp["fits"]:
        need, free = sp["need_bytes"] + sp["margin_bytes"], sp["free_bytes"]
        raise Fail(f"not enough space for {job['repo']}: {len(todo)} files need {need / 1e9:.1f} GB "
                   f"(with a {sp['margin_bytes'] / 1e9:.0f} GB margin), {sp['free_path']} has "
                   f"{free / 1e9:.1f} GB free: short by {(need - free) / 1e9:.1f} GB; free space or point "
                   f"model_cache at a larger disk", 2)
    hub, fd, build_headers = _client() if todo else (None, None, None)
    os.makedirs(blobs, exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    verified: dict[str, dict] = {}
    bad: list[str] = []
    meter = Meter(sum(f["size"] for f in job["files"]), sum(f["size"] for f in done))
    downloaded = reverified = 0
    try:
        for f in todo:
            name, size, lfs = f["name"], f["size"], bool(f["sha256"])
            want = etag(f)
            blob = os.path.join(blobs, want)
            if os.path.exists(blob) and hash_file(blob, lfs, size) == want:
                _link(snap, name, blob)                 # a blob another commit or an earlier run left
                meter.done += size
                reverified += 1
                continue
            if os.path.exists(blob):
                os.unlink(blob)
            part = blob + ".incomplete"
            url = hub.hf_hub_url(job["repo"], name, revision=job["commit"], endpoint=job["endpoint"])
            meta = hub.get_hf_file_metadata(url, token=job.get("token") or None, endpoint=job["endpoint"])
            if meta.commit_hash != job["commit"] or (meta.etag and meta.etag != want):
                raise Fail(f"the Hub's metadata for {name} changed since it was resolved (commit "
                           f"{meta.commit_hash}, etag {meta.etag}, expected {job['commit']}, {want})")
            out = HashingFile(part, lfs, size)
            meter.file, meter.file_size, meter.watch = name, size, part
            resumed = out.tell()
            try:
                if resumed < size:
                    headers = build_headers(token=job.get("token") or None)
                    headers["Accept-Encoding"] = "identity"
                    fd.http_get(meta.location, out, resume_size=resumed, headers=headers, expected_size=size)
            finally:
                out.close()
                meter.watch = None
            got = out.hexdigest() if os.path.getsize(part) == size else ""
            downloaded += size - resumed
            meter.done += size
            if got != want:
                os.unlink(part)                         # never served, never resumed from
                bad.append(f"{name} (expected {'sha256' if lfs else 'git blob id'} {want}, got "
                           f"{got or 'a file of ' + str(os.path.getsize(part) if os.path.exists(part) else 0) + ' bytes'})")
                print(f"mismatch {name}: the downloaded file was deleted", file=sys.stderr, flush=True)
                continue
            os.chmod(part, 0o644)
            os.replace(part, blob)
            _link(snap, name, blob)
            print(f"verified {name} ({size} bytes{', resumed at ' + str(resumed) if resumed else ''})",
                  file=sys.stderr, flush=True)
    finally:
        meter.close()
    if bad:
        raise Fail(f"{len(bad)} files of {job['repo']}@{job['commit'][:12]} did not match the Hub's hashes "
                   f"and were deleted: {'; '.join(bad)}; run fetch-model again to download them anew "
                   f"(if it repeats, the endpoint or a proxy serves corrupt data)")
    meter.say(final=True)
    # Publish: the revision's ref, the hashes for sync-model, then the state (what the no-op trusts).
    if job["revision"] != job["commit"]:
        os.makedirs(os.path.join(rdir, "refs"), exist_ok=True)
        with open(os.path.join(rdir, "refs", job["revision"] + ".tmp"), "w") as fh:
            fh.write(job["commit"])
        os.replace(os.path.join(rdir, "refs", job["revision"] + ".tmp"), os.path.join(rdir, "refs", job["revision"]))
    for f in job["files"]:            # durable before the state says so (one flush, after the transfers)
        fd = os.open(os.path.join(snap, f["name"]), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        st = os.stat(os.path.join(snap, f["name"]))
        verified[f["name"]] = {"size": f["size"], "etag": etag(f), "sha256": f["sha256"],
                               "blob_id": f["blob_id"], "stat": stat_key(st), "nlink": st.st_nlink}
    _feed_modelsync(job, snap, verified)
    state = load_state(job["state"]) or {"version": STATE_VERSION, "repo": job["repo"], "commits": {}}
    state["commits"][job["commit"]] = {"revision": job["revision"], "files": verified, "verified_at": time.time(),
                                       "allow": list(job.get("allow") or [])}
    write_json(job["state"], state)
    return {"commit": job["commit"], "files": len(job["files"]), "fetched": len(todo) - reverified, "reverified": reverified,
            "downloaded_bytes": downloaded, "resumed_bytes": partial, "total_bytes": meter.total,
            "seconds": round(time.monotonic() - t0, 3), "snapshot": snap}


def _feed_modelsync(job: dict, snap: str, verified: dict) -> None:
    """sync-model's hash cache for this snapshot (hostside/modelsync.py HashCache): the Hub's sha256
    under the stat it was verified at, so the head's manifest (what workers are checked against)
    carries the Hub's hashes without hashing again. Only LFS files: the Hub gives no sha256 for the
    others, sync-model hashes those (small) itself."""
    path = job.get("modelsync_cache")
    if not path:
        return
    root = os.path.realpath(snap)
    try:
        with open(path) as fh:
            doc = json.load(fh)
        if doc.get("version") != CACHE_VERSION or doc.get("root") != root:
            doc = {}
    except (OSError, ValueError):
        doc = {}
    files = doc.get("files", {})
    for name, v in verified.items():
        if v["sha256"]:
            files[name] = v["stat"] + [v["sha256"], v["nlink"]]
    write_json(path, {"version": CACHE_VERSION, "root": root, "files": files})


OPS = {"resolve": op_resolve, "check": op_check, "fetch": op_fetch}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in OPS:
        print(f"usage: hubfetch {{{','.join(OPS)}}} < job.json", file=sys.stderr)
        return 2
    try:
        job = json.loads(sys.stdin.buffer.read() or b"{}")
        out = OPS[argv[0]](job)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.code
    except KeyboardInterrupt:
        print("error: interrupted (the partial file is kept: the next run resumes it)", file=sys.stderr)
        return 130
    except Exception as e:   # noqa: BLE001 - a client error (connection lost after retries, ...): one line
        print(f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr, flush=True)
        return 1
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
