"""A node of a distribution chain: runs ON EVERY HOST of the chain (standard library only).

The head sends each byte once: the source (on the head, or on the node before a dead one when a
chain is repaired) streams files to the first node; every node forwards each chunk downstream the
moment it arrives, then writes the files it needs. Distribution then takes about one copy's time
whatever the node count, and the bytes travel between neighbours over the addresses the controller
gives (the fabric's).

Started by the controller as `python3 -c BOOTSTRAP N` (orchestrator/chain/run.py): the first N
bytes of stdin are this source, then JSON lines on stdin:
  1. the spec: {"role": "source"|"relay", "mode": "files"|"stream", "run": ID, "secret": HEX,
     "bind": ADDR, "stall_s", "deadline_s", "accept_s", and per mode:
     files: "root": DIR, "files": [[rel, size, sha256], ...] (the source's stream, in order),
            "need": [rel, ...] (what this node writes),
            "keep": {rel: [[start, end], ...]} (files of NEED this node holds only in part: a DeepSeek
            rank's own Engram rows and every byte that is not an Engram row; orchestrator/modelsync/rows.py);
     stream: "sink": ARGV, a local command fed every byte (the image: ship_relay.py -> docker load)}
  2. once every node listens: {"next": [ADDR, PORT]} or {"next": null} (the chain's tail).
stdin's end = the controller is gone: the node stops at once (nothing is left running or listening).
`python3 -c SOURCE pipe SPEC` is the source of a stream chain: it sends its own stdin (the ship
agent's output on the head) to SPEC's next hop; the secret comes in its environment
(DEPLOYCTL_CHAIN_SECRET, set by the agent from the controller's channel), never in argv.

Wire (TCP, one connection per hop): a mutual HMAC-SHA256 challenge over a per-run secret (the secret
travels only inside the controller's SSH channels, never in argv or on disk), then frames:
type (1 byte) + length (4, big-endian) + payload. H: a file's header (JSON: path, size, sha256),
D: its data, E: its end, Z: the end of the stream. Authenticated, not encrypted: the fabric is the
cluster's own cable; every file's sha256 is checked against the manifest on arrival.

A file in KEEP is written sparse: its full size (holes), only the kept ranges at their own offsets. The
whole stream of it is still hashed and must match the manifest; then ROOT/.deployctl-partial.json
records {sha256, keep, kept: the sha256 of the kept bytes} before the file takes its name, which is
what sync-model's verify checks it against later (hostside/modelsync.py, partial_expectations).

Output (stdout, JSON lines): {"ev": "listen", "port": P} (relay) / {"ev": "ready"} (source),
{"ev": "p", "recv", "fwd", "written", "file"} every second, {"ev": "done", ...} last. A file is written
to ROOT/.deployctl-chain-partial/ and renamed to its real name only after its sha256 matched; a
downstream that fails is cut off (reported) while this node still completes; an upstream that ends
early leaves the files completed so far (a re-run sends only what is missing).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

PARTIAL = ".deployctl-chain-partial"        # names starting .deployctl are never listed by a manifest
RECORD = ".deployctl-partial.json"          # hostside/modelsync.py PARTIAL_RECORD: files held in part
KEPT = "kept:"                              # hostside/modelsync.py KEPT: a partial file's cache value
HDR = struct.Struct(">cI")
CHUNK = 1 << 20
NONCE = 16
PROGRESS_S = 1.0
SECRET_ENV = "DEPLOYCTL_CHAIN_SECRET"
TAIL = 30


class Fail(Exception):
    pass


class Out:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    def emit(self, **doc) -> None:
        with self.lock:
            try:
                sys.stdout.write(json.dumps(doc, separators=(",", ":")) + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise Fail("the peer closed the connection during the handshake")
        buf += got
    return bytes(buf)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def proof(secret: bytes, run: str, side: str, nonce: bytes) -> bytes:
    return hmac.new(secret, f"deployctl-chain/{run}/{side}/".encode() + nonce, hashlib.sha256).digest()


def handshake_accepting(sock: socket.socket, secret: bytes, run: str) -> None:
    """This node accepted SOCK: the upstream proves the secret first, then this node does."""
    mine = os.urandom(NONCE)
    sock.sendall(mine)
    theirs = recv_exact(sock, 32 + NONCE)
    if not hmac.compare_digest(theirs[:32], proof(secret, run, "up", mine)):
        raise Fail("a connection that does not know this run's secret")
    sock.sendall(proof(secret, run, "down", theirs[32:]))


def handshake_connecting(sock: socket.socket, secret: bytes, run: str) -> None:
    theirs = recv_exact(sock, NONCE)
    mine = os.urandom(NONCE)
    sock.sendall(proof(secret, run, "up", theirs) + mine)
    if not hmac.compare_digest(recv_exact(sock, 32), proof(secret, run, "down", mine)):
        raise Fail("the next node does not know this run's secret")


class Node:
    def __init__(self, spec: dict, out: Out):
        self.spec, self.out = spec, out
        self.secret = bytes.fromhex(spec["secret"])
        self.run = spec["run"]
        self.root = spec.get("root", "")
        self.stall = float(spec.get("stall_s", 60))
        self.need = set(spec.get("need", ()))
        self.keep: dict[str, list] = spec.get("keep") or {}
        self.recv = self.fwd = self.written = 0
        self.down: socket.socket | None = None
        self.down_lost = ""
        self.up_lost = ""
        self.bad: list[str] = []
        self.local_error = ""                    # this node could not write (full disk, bad folder): it
                                                 # still forwards, the nodes after it need the bytes
        self.done_files: list[str] = []
        self.current = ""
        self.finished = False
        self.t_first = self.t_last = 0.0         # first and last byte received (the rate's clock)
        self.mode = spec.get("mode", "files")
        self.sink: subprocess.Popen | None = None
        self.sink_tail: list[str] = []
        self.sink_rc: int | None = None

    # -- downstream ---------------------------------------------------------------------------------
    def connect_next(self, nxt) -> None:
        if not nxt:
            return
        addr, port = nxt[0], int(nxt[1])
        try:
            s = socket.create_connection((addr, port), timeout=self.stall)
            s.settimeout(self.stall)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handshake_connecting(s, self.secret, self.run)
            self.down = s
        except (OSError, Fail) as e:
            self.down_lost = f"cannot connect to the next node at {addr}:{port}: {e}"

    def forward(self, data) -> None:
        if self.down is None:
            return
        try:
            self.down.sendall(data)
            self.fwd += len(data)
        except OSError as e:
            why = "took no bytes for %gs" % self.stall if isinstance(e, socket.timeout) else str(e)
            self.down_lost = f"the next node stopped taking data after {self.fwd} bytes: {why}"
            self.close_down()

    def close_down(self) -> None:
        if self.down is not None:
            try:
                self.down.close()
            except OSError:
                pass
            self.down = None

    # -- local files --------------------------------------------------------------------------------
    def apply(self, kind: bytes, payload: bytes, state: dict) -> None:
        if kind == b"H":
            head = json.loads(payload)
            rel = head["path"]
            if rel.startswith("/") or ".." in rel.split("/"):
                raise Fail(f"refused a path outside the checkpoint folder: {rel!r}")
            self.current = rel
            state.clear()
            if rel in self.need:
                part = os.path.join(self.root, PARTIAL, rel)
                os.makedirs(os.path.dirname(part), exist_ok=True)
                f = open(part, "wb", buffering=0)
                state.update(rel=rel, head=head, part=part, f=f, h=hashlib.sha256(), n=0)
                if rel in self.keep:
                    f.truncate(int(head["size"]))        # holes where nothing is kept
                    state.update(keep=[(int(a), int(b)) for a, b in self.keep[rel]], kh=hashlib.sha256())
        elif kind == b"D":
            if state:
                state["h"].update(payload)
                if "keep" in state:
                    self.write_kept(state, payload)
                else:
                    pwrite_all(state["f"].fileno(), memoryview(payload), state["n"])
                    self.written += len(payload)
                state["n"] += len(payload)
        elif kind == b"E":
            if state:
                self.finish_file(state)
            state.clear()
        elif kind == b"Z":
            self.finished = True

    def write_kept(self, state: dict, payload: bytes) -> None:
        """The parts of PAYLOAD (file bytes [n, n + len)) inside a kept range, at their own offsets."""
        lo, hi = state["n"], state["n"] + len(payload)
        view = memoryview(payload)
        for a, b in state["keep"]:
            s, e = max(a, lo), min(b, hi)
            if s < e:
                piece = view[s - lo:e - lo]
                pwrite_all(state["f"].fileno(), piece, s)
                state["kh"].update(piece)
                self.written += e - s

    def record(self, rel: str, entry: dict | None) -> None:
        """ROOT's record of the files held in part: REL's ENTRY set (or dropped), written atomically."""
        path = os.path.join(self.root, RECORD)
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        files = doc.get("files") if isinstance(doc.get("files"), dict) else {}
        if entry is None and rel not in files:
            return
        if entry is None:
            files.pop(rel)
        else:
            files[rel] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"version": 1, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def drop_partial(self, state: dict) -> None:
        f = state.get("f")
        if f is not None:
            try:
                f.close()
                os.unlink(state["part"])
            except OSError:
                pass
        state.clear()

    def finish_file(self, st: dict) -> None:
        f, head, rel = st["f"], st["head"], st["rel"]
        os.fsync(f.fileno())
        f.close()
        sha = st["h"].hexdigest()
        if st["n"] != head["size"] or sha != head["sha256"]:
            self.bad.append(f"{rel}: received {st['n']} bytes, sha256 {sha[:12]}, manifest {head['size']} bytes, "
                            f"sha256 {head['sha256'][:12]}")
            os.unlink(st["part"])
            return
        value = sha
        if "keep" in st:
            # the record first: a crash before the rename leaves the old file, whose kept ranges do not
            # hash to this record, so it is sent again
            value = KEPT + st["kh"].hexdigest()
            self.record(rel, {"sha256": sha, "keep": [list(k) for k in st["keep"]], "kept": value[len(KEPT):]})
        dst = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(st["part"], dst)
        if "keep" not in st:
            self.record(rel, None)               # whole now: no longer held in part
        self.done_files.append(rel)
        s = os.stat(dst)
        # modelsync's hash-cache entry (hostside/modelsync.py HashCache): the verify after the copy
        # trusts this value while the file keeps this stat, instead of reading the file again
        entry = [s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, value, s.st_nlink]
        self.out.emit(ev="file", path=rel, bytes=st["n"], kept=st["n"] if "keep" not in st else
                      sum(b - a for a, b in st["keep"]), cache=entry)

    # -- roles --------------------------------------------------------------------------------------
    def relay(self, up: socket.socket) -> None:
        buf = bytearray()
        state: dict = {}
        up.settimeout(self.stall)
        while not self.finished:
            try:
                data = up.recv(CHUNK)
            except socket.timeout:
                self.up_lost = f"no data from the previous node for {self.stall:g}s"
                break
            except OSError as e:
                self.up_lost = f"the connection from the previous node broke: {e}"
                break
            if not data:
                self.up_lost = "the previous node closed the stream before its end mark"
                break
            self.recv += len(data)
            self.t_last = time.monotonic()
            self.t_first = self.t_first or self.t_last
            self.forward(data)                # downstream first: the chain is pipelined
            if self.mode == "stream":
                self.feed(data)
                continue
            buf += data
            pos = 0
            while len(buf) - pos >= HDR.size:
                kind, n = HDR.unpack_from(buf, pos)
                if len(buf) - pos < HDR.size + n:
                    break
                payload = bytes(buf[pos + HDR.size:pos + HDR.size + n])
                if not self.local_error or kind == b"Z":     # after a write error: forward only
                    try:
                        self.apply(kind, payload, state)
                    except OSError as e:
                        self.local_error = f"writing {self.current} under {self.root}: {e}"
                        self.drop_partial(state)
                pos += HDR.size + n
            del buf[:pos]
        if state.get("f"):
            state["f"].close()                # an incomplete file stays in the partial folder
        self.close_down()
        if self.sink is not None:
            self.end_sink()

    # -- stream mode: every byte into a local command -------------------------------------------------
    def start_sink(self) -> None:
        self.sink = subprocess.Popen(self.spec["sink"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=0)
        threading.Thread(target=self._read_sink, daemon=True).start()

    def _read_sink(self) -> None:
        assert self.sink is not None and self.sink.stdout is not None
        for line in iter(self.sink.stdout.readline, b""):
            self.sink_tail = (self.sink_tail + [line.decode("utf-8", "replace").rstrip()])[-TAIL:]

    def feed(self, data: bytes) -> None:
        """Into the sink; a sink that ended (its stream's own check failed, docker load failed) is not
        fed further, and this node still forwards: the nodes after it need the bytes."""
        if self.sink is None or self.sink.stdin is None or self.sink.stdin.closed:
            return
        try:
            self.sink.stdin.write(data)
            self.written += len(data)
        except (BrokenPipeError, OSError, ValueError):
            self.sink.stdin.close()

    def end_sink(self) -> None:
        """The stream ended (whole or not): the sink decides. ship_relay.py loads only a stream that
        carried its end mark, and stops docker load otherwise (no half image)."""
        assert self.sink is not None
        try:
            if self.sink.stdin is not None and not self.sink.stdin.closed:
                self.sink.stdin.close()
        except OSError:
            pass
        try:
            self.sink_rc = self.sink.wait(timeout=float(self.spec.get("sink_timeout_s", 1800)))
        except subprocess.TimeoutExpired:
            self.sink.kill()
            self.sink_rc = self.sink.wait()
            self.sink_tail.append("chain node: the sink did not finish in time and was stopped")
        time.sleep(0.05)
        self.finished = self.sink_rc == 0

    def source(self) -> None:
        rate = float(self.spec.get("rate_bps") or 0)     # sync-model --bwlimit: every hop runs at the source's pace
        t0 = time.monotonic()
        for rel, size, sha in self.spec["files"]:
            self.current = rel
            head = json.dumps({"path": rel, "size": size, "sha256": sha}).encode()
            self.send_frame(b"H", head)
            with open(os.path.join(self.root, rel), "rb") as f:
                while True:
                    data = f.read(CHUNK)
                    if not data:
                        break
                    self.recv += len(data)
                    self.send_frame(b"D", data)
                    if rate:
                        ahead = self.recv / rate - (time.monotonic() - t0)
                        if ahead > 0:
                            time.sleep(ahead)
            self.send_frame(b"E", b"")
            if self.down is None:
                return
        self.send_frame(b"Z", b"")
        self.finished = True
        self.close_down()

    def send_frame(self, kind: bytes, payload: bytes) -> None:
        if len(payload) < 65536:
            self.forward(HDR.pack(kind, len(payload)) + payload)
        else:                                     # no copy of a data chunk to prepend five bytes
            self.forward(HDR.pack(kind, len(payload)))
            self.forward(payload)

    def report(self) -> dict:
        return {"recv": self.recv, "fwd": self.fwd, "written": self.written, "file": self.current,
                "stream_s": round(self.t_last - self.t_first, 3)}


def accept_upstream(lsock: socket.socket, node: Node, deadline: float) -> socket.socket:
    """The first connection that proves the run's secret (a stranger's is closed, the wait goes on)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise Fail("the previous node did not connect in time")
        lsock.settimeout(left)
        try:
            conn, peer = lsock.accept()
        except socket.timeout:
            raise Fail("the previous node did not connect in time") from None
        conn.settimeout(node.stall)
        try:
            handshake_accepting(conn, node.secret, node.run)
            return conn
        except (OSError, Fail) as e:
            sys.stderr.write(f"chain node: refused {peer[0]}: {e}\n")
            conn.close()


def main() -> int:
    out = Out()
    spec = json.loads(sys.stdin.buffer.readline())
    node = Node(spec, out)
    started = time.monotonic()
    lsock = None
    if spec["role"] == "relay":
        lsock = socket.socket(socket.AF_INET6 if ":" in spec["bind"] else socket.AF_INET)
        lsock.bind((spec["bind"], 0))
        lsock.listen(4)
        out.emit(ev="listen", port=lsock.getsockname()[1])
    else:
        out.emit(ev="ready")
    line = sys.stdin.buffer.readline()
    if not line:
        return 4                                  # the controller is gone before the chain was wired
    nxt = json.loads(line).get("next")

    def watch_stdin() -> None:                    # the controller gone: stop here and now
        while os.read(0, 4096):                   # the raw fd: a daemon thread blocked in the buffered
            pass                                  # reader would abort the interpreter's exit
        os._exit(4)

    def tick() -> None:
        while True:
            time.sleep(PROGRESS_S)
            out.emit(ev="p", **node.report())
            if time.monotonic() - started > float(spec.get("deadline_s", 86400)):
                sys.stderr.write("chain node: the run's deadline passed\n")
                os._exit(5)

    threading.Thread(target=watch_stdin, daemon=True).start()
    threading.Thread(target=tick, daemon=True).start()
    rc = 0
    try:
        node.connect_next(nxt)
        if node.mode == "stream" and lsock is not None:
            node.start_sink()
        if lsock is not None:
            up = accept_upstream(lsock, node, time.monotonic() + float(spec.get("accept_s", 60)))
            lsock.close()                         # nothing listens after the upstream connected
            lsock = None
            node.relay(up)
            up.close()
        else:
            node.source()
    except (Fail, OSError) as e:
        node.up_lost = node.up_lost or str(e)
        rc = 1
    finally:
        if lsock is not None:
            lsock.close()
    if node.sink is not None and node.sink_rc is None:
        node.end_sink()
    missing = sorted(node.need - set(node.done_files))
    ok = (node.finished and not node.bad and not missing and not node.local_error if spec["role"] == "relay"
          else node.finished)
    extra = {"sink_rc": node.sink_rc, "sink_tail": node.sink_tail} if node.mode == "stream" else {}
    out.emit(ev="done", ok=bool(ok and rc == 0), files=len(node.done_files), missing=missing[:50],
             missing_count=len(missing), bad=node.bad, local_error=node.local_error, up_lost=node.up_lost,
             down_lost=node.down_lost,
             seconds=round(time.monotonic() - started, 3), **extra, **node.report())
    return 0 if ok and rc == 0 else 1


def pipe_source(spec: dict) -> int:
    """The source of a stream chain: this process's stdin to the next hop, as it comes."""
    spec = dict(spec, secret=os.environ.pop(SECRET_ENV, ""))
    node = Node(spec, Out())
    node.connect_next(spec["next"])
    if node.down is None:
        sys.stderr.write(f"chain source: {node.down_lost}\n")
        return 1
    while True:
        data = os.read(0, CHUNK)
        if not data:
            break
        node.forward(data)
        if node.down is None:
            sys.stderr.write(f"chain source: {node.down_lost}\n")
            return 1
    node.close_down()
    return 0


if __name__ == "__main__":
    sys.exit(pipe_source(json.loads(sys.argv[2])) if sys.argv[1:2] == ["pipe"] else main())
