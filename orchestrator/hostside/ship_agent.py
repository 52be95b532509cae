"""The ship agent: runs ON THE HEAD (standard library only), shipped as `python3 -c SOURCE SPEC`.

One `docker save` on the head, its stream parsed once and fanned out to every worker that needs
something, each over its own `ssh worker docker load` and each reduced to the layer folders that
worker lacks (layers.SaveFilter). Memory is bounded: a few 1 MiB chunks queued per worker.

Faults stay per worker: a worker whose ssh ends, or that takes no bytes for `stall_s` seconds, is cut
off (its ssh killed) and the others go on. Every step is bounded: `deadline_s` for the whole run,
`load_timeout_s` for a worker's `docker load` after its last byte. The controller is watched through
stdin: when its SSH channel closes (Ctrl-C, laptop gone) stdin ends and the agent kills what it
started and exits.

Output (stdout): one JSON object a line. {"ev": "start"}, {"ev": "p", ...} heartbeats with byte
counts every `progress_s`, {"ev": "layer", ...} per layer folder, last {"ev": "done", ...}.
SPEC (argv[1], JSON): image_id, diff_ids, blob_diffs (blob digest -> diff_id), save (argv), workers [{name, argv, send: [layer index]}],
need_files [paths the ssh to workers needs], stall_s, deadline_s, load_timeout_s, progress_s, queue,
env_from_stdin (then the first line of stdin is a JSON object of environment variables for the
workers' commands: a chain's secret, orchestrator/chain/).
"""
from __future__ import annotations

import collections
import json
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time

try:                                   # in the repository; shipped, image_layers.py is prepended to this source
    from .image_layers import READ_CHUNK, SaveFilter, TarError
except ImportError:
    pass

TAIL_LINES = 30
# Framing to the worker's relay (relay.py, which checks the same values): 4-byte length + payload,
# length 0 = heartbeat, END = the stream is complete.
FRAME = struct.Struct(">I")
END = 0xFFFFFFFF


class Out:
    """Thread-safe JSON lines on stdout; a closed stdout (controller gone) is remembered, not raised."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.broken = False

    def emit(self, **doc) -> None:
        line = json.dumps(doc, separators=(",", ":")) + "\n"
        with self.lock:
            if self.broken:
                return
            try:
                sys.stdout.write(line)
                sys.stdout.flush()
            except (OSError, ValueError):
                self.broken = True


class Worker:
    def __init__(self, spec: dict, depth: int, heartbeat_s: float):
        self.heartbeat_s = heartbeat_s
        self.name: str = spec["name"]
        self.argv: list[str] = spec["argv"]
        self.send: list[int] = spec["send"]
        self.q: "queue.Queue[bytes | None]" = queue.Queue(maxsize=depth)
        self.proc: subprocess.Popen | None = None
        self.bytes = 0
        self.error: str | None = None          # set once: the first reason this worker failed
        self.kind: str | None = None           # stall | ssh | save | deadline | aborted
        self.killed = False                    # this agent killed its ssh: its rc says nothing then
        self.blocked_since: float | None = None
        self.first_byte: float | None = None
        self.last_byte: float | None = None
        self.eof_at: float | None = None
        self.tail: "collections.deque[str]" = collections.deque(maxlen=TAIL_LINES)
        self.done = threading.Event()          # writer finished (stdin closed or failed)
        self.lock = threading.Lock()

    @property
    def dead(self) -> bool:
        return self.error is not None

    def fail(self, kind: str, message: str) -> None:
        with self.lock:
            if self.error is None:
                self.error, self.kind = message, kind
        self.kill()
        try:
            self.q.put_nowait(None)            # wake the writer if it waits for data
        except queue.Full:
            pass                               # it is busy: it sees `dead` at its next chunk

    def kill(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            self.killed = True
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass

    def start(self, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, bufsize=0, start_new_session=True,
                                     env=dict(os.environ, **env) if env else None)
        threading.Thread(target=self._read_output, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            self.tail.append(line.decode("utf-8", "replace").rstrip())
        rc = self.proc.wait()
        if self.eof_at is None and not self.dead:
            # ended before its stream did: unreachable, refused, or docker load failed early
            self.fail("ssh", f"ssh to {self.name} exited {rc} after {self.bytes} bytes, before the stream ended")

    def _write(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        stdin = self.proc.stdin
        try:
            while True:
                try:
                    chunk = self.q.get(timeout=self.heartbeat_s)
                except queue.Empty:
                    self._send(FRAME.pack(0))         # heartbeat: the relay knows the head is there
                    continue
                if self.dead:
                    break
                if chunk is None:
                    self._send(FRAME.pack(END))
                    self.eof_at = time.monotonic()
                    break
                self._send(FRAME.pack(len(chunk)))
                self._send(chunk, payload=True)
        except (BrokenPipeError, OSError, ValueError) as e:
            self.blocked_since = None
            self.fail("ssh", f"the stream to {self.name} broke after {self.bytes} bytes ({e})")
        finally:
            try:
                stdin.close()
            except OSError:
                pass
            self.done.set()

    def _send(self, data: bytes, payload: bool = False) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        view = memoryview(data)
        while view:
            self.blocked_since = time.monotonic()
            n = self.proc.stdin.write(view)
            self.blocked_since = None
            if not n:
                raise BrokenPipeError("write returned 0")
            view = view[n:]
            if payload:
                self.bytes += n
                now = time.monotonic()
                self.first_byte = self.first_byte or now
                self.last_byte = now

    def put(self, chunk: bytes | None, stop: threading.Event) -> None:
        """Queue a chunk; waits while the queue is full unless this worker dies or the run stops."""
        while not self.dead and not stop.is_set():
            try:
                self.q.put(chunk, timeout=0.2)
                return
            except queue.Full:
                continue

    def result(self) -> dict:
        rc = self.proc.poll() if self.proc else None
        stream_s = (self.last_byte - self.first_byte) if self.first_byte and self.last_byte else 0.0
        return {"ok": self.error is None and rc == 0, "rc": rc, "error": self.error, "kind": self.kind,
                "killed": self.killed, "bytes": self.bytes, "stream_s": round(stream_s, 3), "tail": list(self.tail)}


class Agent:
    def __init__(self, spec: dict, out: Out):
        self.spec, self.out = spec, out
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + float(spec.get("deadline_s", 7200))
        self.stall = float(spec.get("stall_s", 60))
        self.workers = [Worker(w, int(spec.get("queue", 8)), float(spec.get("heartbeat_s", 2.0)))
                        for w in spec["workers"]]
        self.save: subprocess.Popen | None = None
        self.save_tail: "collections.deque[str]" = collections.deque(maxlen=TAIL_LINES)
        self.save_bytes = 0
        self.phase = "starting"
        self.env: dict = {}                    # for the workers' commands, from the controller's channel

    # -- watchers ---------------------------------------------------------------------------------
    def _watch_controller(self) -> None:
        try:
            while os.read(0, 4096):             # raw fd: no buffered-reader lock at exit
                pass
        except (OSError, ValueError):
            pass
        if not self.stop.is_set():
            self.abort("aborted", "the controller closed its connection to the head (cancelled)")
            time.sleep(2)
            os._exit(4)

    def _monitor(self) -> None:
        every = float(self.spec.get("progress_s", 0.5))
        while not self.stop.wait(every):
            now = time.monotonic()
            for w in self.workers:
                b = w.blocked_since
                if b is not None and not w.dead and now - b > self.stall:
                    w.fail("stall", f"{w.name} took no bytes for {self.stall:g}s (after {w.bytes} bytes): "
                                    f"network cut or host hung")
            if now > self.deadline:
                self.abort("deadline", f"the ship did not finish within {self.spec.get('deadline_s')}s")
            if now > self.deadline + 30:
                os._exit(3)
            save = self.save
            if save is not None and save.poll() is None and all(w.dead for w in self.workers):
                save.kill()                    # nobody left to send to: do not finish a long save
            self.out.emit(ev="p", phase=self.phase, save=self.save_bytes, t=round(now - self.t0, 2),
                          b={w.name: w.bytes for w in self.workers},
                          dead=[w.name for w in self.workers if w.dead])

    def abort(self, kind: str, message: str) -> None:
        for w in self.workers:
            w.fail(kind, message)
        if self.save is not None and self.save.poll() is None:
            self.save.kill()

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> dict:
        missing = [p for p in self.spec.get("need_files", []) if not os.access(p, os.R_OK)]
        if missing:
            msg = (f"the head cannot read {', '.join(missing)}: it connects to the workers over SSH "
                   f"itself and needs the SSH key and known_hosts file there (copy them to the head, or "
                   f"pass `deployctl ship --head-ssh-key/--head-known-hosts` with paths on the head)")
            for w in self.workers:
                w.error, w.kind = msg, "setup"
            return self.summary()
        threading.Thread(target=self._watch_controller, daemon=True).start()
        threading.Thread(target=self._monitor, daemon=True).start()
        self.out.emit(ev="start", workers=[w.name for w in self.workers])
        for w in self.workers:
            try:
                w.start(self.env)
            except OSError as e:
                w.fail("ssh", f"cannot start ssh on the head: {e}")
        self.phase = "save"
        try:
            self.save = subprocess.Popen(self.spec["save"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         start_new_session=True)
        except OSError as e:
            self.abort("save", f"cannot run docker save on the head: {e}")
            return self.finish()
        threading.Thread(target=self._read_save_err, daemon=True).start()
        self.pump()
        return self.finish()

    def _read_save_err(self) -> None:
        assert self.save is not None and self.save.stderr is not None
        for line in iter(self.save.stderr.readline, b""):
            self.save_tail.append(line.decode("utf-8", "replace").rstrip())

    def pump(self) -> None:
        assert self.save is not None and self.save.stdout is not None
        by_name = {w.name: w for w in self.workers}
        flt = SaveFilter(self.spec["diff_ids"], {w.name: w.send for w in self.workers}, self.spec.get("image_id"),
                         self.spec.get("blob_diffs"))
        counted = _Counting(self.save.stdout, self)
        reported = 0
        try:
            for to, chunk in flt.route(counted):
                if self.phase == "save":
                    self.phase = "stream"
                for ev in flt.events[reported:]:
                    self.out.emit(ev="layer", **ev)
                reported = len(flt.events)
                for name in to:
                    by_name[name].put(chunk, self.stop)
                if all(w.dead for w in self.workers):
                    self.save.kill()
                    self.save.wait()
                    return
        except TarError as e:
            self.abort("save", f"docker save on the head produced a bad stream: {e}"
                               + _tail_note(self.save_tail))
        except OSError as e:
            self.abort("save", f"reading docker save on the head failed: {e}")
        for ev in flt.events[reported:]:
            self.out.emit(ev="layer", **ev)
        # drain what is left (the end of the archive), then the save's exit code decides
        try:
            while self.save.stdout.read(READ_CHUNK):
                pass
        except (OSError, ValueError):
            pass
        try:
            rc = self.save.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.save.kill()
            rc = self.save.wait()
        if rc != 0:
            self.abort("save", f"docker save on the head exited {rc}" + _tail_note(self.save_tail))
            return
        self.phase = "load"
        for w in self.workers:
            w.put(None, self.stop)

    def finish(self) -> dict:
        load_timeout = float(self.spec.get("load_timeout_s", 1800))
        for w in self.workers:
            if w.proc is None:
                continue
            w.done.wait(timeout=max(0.0, self.deadline - time.monotonic()))
            if not w.done.is_set():
                w.fail("deadline", f"the stream to {w.name} did not end before the deadline")
            limit = min(self.deadline, (w.eof_at or time.monotonic()) + load_timeout)
            try:
                w.proc.wait(timeout=max(0.5, limit - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.fail("deadline", f"docker load on {w.name} did not finish within {load_timeout:g}s "
                                   f"after its last byte")
                w.proc.wait()
        time.sleep(0.1)                       # let the output readers take the last lines
        self.stop.set()
        return self.summary()

    def summary(self) -> dict:
        return {"workers": {w.name: w.result() for w in self.workers},
                "save": {"rc": self.save.poll() if self.save else None, "bytes": self.save_bytes,
                         "tail": list(self.save_tail)},
                "seconds": round(time.monotonic() - self.t0, 3)}


class _Counting:
    """The save stream, counting bytes read (for progress)."""

    def __init__(self, f, agent: Agent):
        self.f, self.agent = f, agent

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        self.agent.save_bytes += len(b)
        return b


def _tail_note(lines, n: int = 5) -> str:
    lines = [ln for ln in lines if ln.strip()]
    return (": " + " | ".join(lines[-n:])) if lines else ""


def read_line_raw() -> bytes:
    """The first line of stdin, read from the raw fd (the controller watch reads it the same way)."""
    buf = b""
    while not buf.endswith(b"\n"):
        got = os.read(0, 4096)
        if not got:
            break
        buf += got
    return buf


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    out = Out()
    agent = Agent(spec, out)
    if spec.get("env_from_stdin"):
        # secrets for the workers' commands (a chain's per-run secret): through the controller's SSH
        # channel into their environment, never in an argv that `ps` shows
        agent.env = json.loads(read_line_raw() or b"{}")
    res = agent.run()
    out.emit(ev="done", **res)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)                            # daemon threads may sit in reads: skip interpreter teardown
