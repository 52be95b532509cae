"""A local Hugging Face Hub endpoint for tests: the real `huggingface_hub` client pointed at it with
HF_ENDPOINT downloads the synthetic checkpoints from it, as it would from huggingface.co.

Only what a model download uses, with the Hub's own contract (huggingface_hub 2.4.0):
- GET  /api/models/{repo}[/revision/{rev}][?blobs=true] hf_api.py `HfApi.model_info`: id, sha (the
  commit), private, gated, siblings [{rfilename, size, blobId, lfs: {sha256, size, pointerSize}}];
- HEAD|GET /{repo}/resolve/{rev}/{path}                 file_download.py `get_hf_file_metadata` reads
  X-Repo-Commit, ETag (git blob id), X-Linked-Etag and X-Linked-Size (an LFS file's sha256 and size);
  GET honours `Range: bytes=N-` (http_get resumes with it) with 206 and Content-Range;
- errors as utils/_http.py `hf_raise_for_status` reads them: X-Error-Code RepoNotFound (401 without a
  token, as the Hub answers for a repo it does not show), RevisionNotFound, EntryNotFound (404),
  GatedRepo (401 without a token, 403 with one that has no access).

Repos live under ROOT: `ROOT/ORG/NAME/repo.json` ({"refs": {name: commit}, "gated": bool, "private":
bool, "tokens": [...], "commits": {commit: {path: {size, sha256, blob_id, lfs}}}}), the files of a
commit in `ROOT/ORG/NAME/COMMIT/`. `faults.json` next to repo.json makes it misbehave on purpose:
{"corrupt": {path: offset}} serves that byte flipped, {"rate": bytes_per_s} throttles file bodies.
Every request is appended to ROOT/requests.log as a JSON line (method, path, range, status, bytes).

Run: python3 -m tests.hub_endpoint --root DIR --bind ADDR --port N   (publish() fills ROOT)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_MIN_BYTES = 10 * 1024 * 1024      # and every *.safetensors: what a model repo's .gitattributes sends to LFS
CHUNK = 1024 * 1024


def file_ids(path: Path) -> tuple[str, str]:
    """(git's object id: sha1 of "blob <size>\\0" + content, the Hub's blobId and ETag; the sha256, an
    LFS file's id), from one read. Written here independently of hostside/hubfetch.py, which checks them."""
    blob = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            blob.update(chunk)
            sha.update(chunk)
    return blob.hexdigest(), sha.hexdigest()


def _repo_dir(root: Path, repo: str) -> Path:
    return root / repo


def publish(root: str | Path, repo: str, src: str | Path, ref: str = "main", *, gated: bool = False,
            private: bool = False, tokens: tuple[str, ...] = ()) -> str:
    """Make SRC's files commit COMMIT of REPO (hard links where possible) and point REF at it. The
    commit id is derived from the files' ids, so publishing the same files again is a no-op."""
    root, src = Path(root), Path(src)
    index: dict[str, dict] = {}
    for p in sorted(x for x in src.rglob("*") if x.is_file() and not x.name.startswith(".")):
        rel = p.relative_to(src).as_posix()
        size = p.stat().st_size
        lfs = size >= LFS_MIN_BYTES or rel.endswith(".safetensors")
        blob_id, sha256 = file_ids(p)
        index[rel] = {"size": size, "blob_id": blob_id, "lfs": lfs, "sha256": sha256 if lfs else None}
    commit = hashlib.sha1(json.dumps(index, sort_keys=True).encode()).hexdigest()
    rdir = _repo_dir(root, repo)
    cdir = rdir / commit
    if not cdir.exists():
        tmp = rdir / f".{commit}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel in index:
            dst = tmp / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src / rel, dst)
            except OSError:
                shutil.copyfile(src / rel, dst)
        os.replace(tmp, cdir)
    meta_path = rdir / "repo.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"refs": {}, "commits": {}}
    meta["commits"][commit] = index
    meta["refs"][ref] = commit
    meta.update(gated=gated, private=private, tokens=list(tokens))
    tmp_meta = meta_path.with_suffix(".tmp")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)
    return commit


def set_faults(root: str | Path, repo: str, **faults) -> None:
    """faults.json of REPO: corrupt={path: offset}, rate=bytes_per_s; no arguments: behave again."""
    p = _repo_dir(Path(root), repo) / "faults.json"
    if faults:
        p.write_text(json.dumps(faults))
    else:
        p.unlink(missing_ok=True)


class Hub:
    def __init__(self, root: Path):
        self.root = root
        self.log_lock = threading.Lock()

    def repo(self, repo: str) -> dict | None:
        p = _repo_dir(self.root, repo) / "repo.json"
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo) or not p.exists():
            return None
        return json.loads(p.read_text())

    def faults(self, repo: str) -> dict:
        p = _repo_dir(self.root, repo) / "faults.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def log(self, **entry) -> None:
        with self.log_lock, open(self.root / "requests.log", "a") as f:
            f.write(json.dumps(entry) + "\n")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"          # keep-alive, as the client's connection pool expects
    server_version = "deployctl-hub-double"
    hub: Hub

    def log_message(self, fmt, *args) -> None:      # requests.log has what tests need
        pass

    # -- replies -----------------------------------------------------------------------------------
    def _reply(self, status: int, body: bytes = b"", headers: dict | None = None, error_code: str = "",
               message: str = "") -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if error_code:
            self.send_header("X-Error-Code", error_code)
        if message:
            self.send_header("X-Error-Message", message)
            body = body or json.dumps({"error": message}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.hub.log(method=self.command, path=self.path, range=self.headers.get("Range"), status=status,
                     bytes=0 if self.command == "HEAD" else len(body))

    def _token(self) -> str:
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer "):] if auth.startswith("Bearer ") else ""

    def _lookup(self, repo: str, rev: str, files: bool) -> tuple[dict, str] | None:
        """The repo and the commit REV names, or None after replying with the Hub's error."""
        meta = self.hub.repo(repo)
        token = self._token()
        if meta is None or (meta.get("private") and token not in meta.get("tokens", [])):
            self._reply(401 if not token else 404, error_code="RepoNotFound",
                        message="Repository not found")
            return None
        commit = rev if rev in meta["commits"] else meta["refs"].get(rev)
        if commit is None:
            self._reply(404, error_code="RevisionNotFound", message=f"Invalid rev id: {rev}")
            return None
        if files and meta.get("gated") and token not in meta.get("tokens", []):
            self._reply(401 if not token else 403, error_code="GatedRepo",
                        message=f"Access to model {repo} is restricted. You must have access to it and be "
                                "authenticated to access it. Please log in.")
            return None
        return meta, commit

    # -- routes ------------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def _route(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        if m and self.command == "GET":       # no /revision/: the default branch (model_info(revision=None))
            return self._model_info(m.group(1), m.group(2) or "main", parse_qs(url.query))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._resolve(m.group(1), m.group(2), m.group(3))
        self._reply(404, message="Not found")

    def _model_info(self, repo: str, rev: str, query: dict) -> None:
        found = self._lookup(repo, rev, files=False)
        if not found:
            return
        meta, commit = found
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for name, f in sorted(meta["commits"][commit].items()):
            s: dict = {"rfilename": name}
            if blobs:
                s.update(size=f["size"], blobId=f["blob_id"])
                if f["lfs"]:
                    s["lfs"] = {"sha256": f["sha256"], "size": f["size"], "pointerSize": 134}
            siblings.append(s)
        doc = {"_id": hashlib.md5(repo.encode()).hexdigest()[:24], "id": repo, "modelId": repo,
               "sha": commit, "private": bool(meta.get("private")),
               "gated": "manual" if meta.get("gated") else False, "disabled": False,
               "siblings": siblings}
        self._reply(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo: str, rev: str, name: str) -> None:
        found = self._lookup(repo, rev, files=True)
        if not found:
            return
        meta, commit = found
        f = meta["commits"][commit].get(name)
        if f is None:
            self._reply(404, headers={"X-Repo-Commit": commit}, error_code="EntryNotFound",
                        message="Entry not found")
            return
        path = _repo_dir(self.hub.root, repo) / commit / name
        size = f["size"]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{f["blob_id"]}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if f["lfs"]:
            headers.update({"X-Linked-Etag": f'"{f["sha256"]}"', "X-Linked-Size": str(size)})
        start = 0
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-", rng or "")
        status = 200
        if m and self.command == "GET":
            start = int(m.group(1))
            if start >= size:
                self._reply(416, headers={"Content-Range": f"bytes */{size}"})
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(size - start))
        self.end_headers()
        sent = 0
        if self.command == "GET":
            try:
                sent = self._body(repo, name, path, start, size)
            except (BrokenPipeError, ConnectionResetError):
                pass
        self.hub.log(method=self.command, path=self.path, range=rng, status=status, bytes=sent)

    def _body(self, repo: str, name: str, path: Path, start: int, size: int) -> int:
        faults = self.hub.faults(repo)
        flip = faults.get("corrupt", {}).get(name)
        rate = faults.get("rate")
        with open(path, "rb") as fh:
            if flip is None and not rate:
                return self.connection.sendfile(fh, start, size - start)   # zero-copy, as a CDN would be fast
            fh.seek(start)
            pos, sent, t0 = start, 0, time.monotonic()
            while pos < size:
                chunk = bytearray(fh.read(min(CHUNK // 4 if rate else CHUNK, size - pos)))
                if flip is not None and pos <= flip < pos + len(chunk):
                    chunk[flip - pos] ^= 0xFF
                self.wfile.write(chunk)
                pos += len(chunk)
                sent += len(chunk)
                if rate:
                    ahead = sent / rate - (time.monotonic() - t0)
                    if ahead > 0:
                        time.sleep(ahead)
            return sent


def serve(root: str | Path, bind: str, port: int) -> ThreadingHTTPServer:
    hub = Hub(Path(root))
    handler = type("BoundHandler", (Handler,), {"hub": hub})
    ThreadingHTTPServer.daemon_threads = True
    return ThreadingHTTPServer((bind, port), handler)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8088)
    a = ap.parse_args()
    Path(a.root).mkdir(parents=True, exist_ok=True)
    srv = serve(a.root, a.bind, a.port)
    print(f"hub endpoint http://{a.bind}:{a.port} serving {a.root}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
