"""The ship relay: runs ON A WORKER (standard library only), as `python3 -c SOURCE IDLE_S docker ... load`.

It reads framed data from the head (4-byte big-endian length + payload; length 0 is a heartbeat the
head sends while it has nothing for this worker; END ends the stream) and writes the payload into
`docker load`. Without it a `docker load` whose SSH link died unnoticed would wait on stdin for
hours holding a partial archive in Docker's temp folder; with it, no frame for IDLE_S seconds or a
stream that ends without END stops the load, which then removes its temp files.
"""
from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
import time

END = 0xFFFFFFFF
HEADER = struct.Struct(">I")


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def shell_status(rc: int) -> int:
    """A child's status as a shell reports it: killed by signal N (Popen's -N) is 128+N, which the
    head decodes (orchestrator/signals.py); exiting with -9 itself would report 247."""
    return 128 - rc if rc < 0 else rc


def main(argv: list[str]) -> int:
    idle, cmd = float(argv[0]), argv[1:]
    load = subprocess.Popen(cmd, stdin=subprocess.PIPE)
    assert load.stdin is not None
    buf = bytearray()
    last = time.monotonic()

    def stop(message: str) -> int:
        sys.stderr.write(f"deployctl ship relay: {message}; docker load stopped\n")
        load.kill()
        load.wait()
        return 125

    while True:
        ready, _, _ = select.select([0], [], [], 1.0)
        if not ready:
            if load.poll() is not None:
                return shell_status(load.returncode) or 1   # docker load ended early: its output says why
            if time.monotonic() - last > idle:
                return stop(f"no data from the head for {idle:g}s")
            continue
        data = os.read(0, 1 << 20)
        if not data:
            return stop("the stream from the head ended before its end mark")
        last = time.monotonic()
        buf += data
        while len(buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(buf)
            if n == END:
                load.stdin.close()
                return shell_status(load.wait())
            if len(buf) < HEADER.size + n:
                break
            if n:
                try:
                    load.stdin.write(buf[HEADER.size:HEADER.size + n])
                except (BrokenPipeError, OSError):
                    return shell_status(load.wait()) or 1
            del buf[:HEADER.size + n]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
