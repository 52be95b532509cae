"""Benchmark the proof every `up` and `launch` makes of a staged table (orchestrator/hostside/tableproof.py)
against `sha256sum` of the same bytes.

    python3 bench/table_proof.py [--size-gb 4] [--rounds 3] [--dir D] [--json]

Writes one file of SIZE GB of random bytes in DIR (default: a folder in /var/tmp, on disk) with its
manifest-style chunk hashes (64 MiB chunks), then, in the same run and on the same filesystem, ROUNDS
back-to-back pairs in alternating order, the file dropped from the page cache before each:

  sample    tableproof.prove: the stat stamp and one 2 GiB window of chunks (what a no-op `up` pays)
  baseline  `sha256sum` over exactly the bytes the sample re-hashed (dd of those chunks piped into it)

and prints the ratio of their throughputs (median of the pairs; >= 1 means the proof hashes at least
as fast as the coreutils tool, thanks to its worker threads), the sample's wall time, and the full
check (every chunk: what a touched file or --verify pays) against `sha256sum` of the whole file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.hostside import tableproof                       # noqa: E402

CHUNK = 64 << 20


def write_file(path: Path, size: int) -> list[str]:
    sums, done = [], 0
    rng = random.Random(7)
    with open(path, "wb") as f:
        while done < size:
            n = min(CHUNK, size - done)
            block = rng.randbytes(n)
            f.write(block)
            sums.append(hashlib.sha256(block).hexdigest())
            done += n
        f.flush()
        os.fsync(f.fileno())
    return sums


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sha256sum_chunks(path: Path, chunks: list[int]) -> float:
    """Seconds for `dd` of those chunks piped into `sha256sum`, cold."""
    drop(path)
    t0 = time.monotonic()
    for start, count in _runs(sorted(chunks)):
        dd = subprocess.Popen(["dd", f"if={path}", "bs=64M", f"skip={start}", f"count={count}", "status=none"],
                              stdout=subprocess.PIPE)
        subprocess.run(["sha256sum"], stdin=dd.stdout, stdout=subprocess.DEVNULL, check=True)
        dd.wait()
    return time.monotonic() - t0


def _runs(xs: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for x in xs:
        if out and out[-1][0] + out[-1][1] == x:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((x, 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    size = int(a.size_gb * 1e9)
    with tempfile.TemporaryDirectory(dir=a.dir or "/var/tmp", prefix="bench-proof-") as d:
        path = Path(d) / "table.bin"
        sums = write_file(path, size)
        tf = tableproof.TableFile(str(path), ((0, size),), CHUNK, tuple(sums), tableproof.stamp(path))
        state = Path(d) / tableproof.STATE_NAME
        ratios, samples = [], []
        for r in range(a.rounds):
            order = ("sample", "baseline") if r % 2 == 0 else ("baseline", "sample")
            got: dict[str, float] = {}
            picked: list[int] = []
            for what in order:
                if what == "sample":
                    drop(path)
                    before = json.loads(state.read_text())["next"] if state.exists() else None
                    proof = tableproof.prove([tf], state=state)
                    assert proof.ok, proof.bad
                    got["sample"] = proof.seconds
                    start = before if before is not None else (json.loads(state.read_text())["next"]
                                                              - proof.chunks) % len(sums)
                    picked = [(start + j) % len(sums) for j in range(proof.chunks)]
                    samples.append({"seconds": proof.seconds, "bytes": proof.bytes, "chunks": proof.chunks})
                else:
                    chunks = picked or list(range(min(len(sums), tableproof.SAMPLE_BYTES // CHUNK)))
                    got["baseline"] = sha256sum_chunks(path, chunks)
            ratios.append(got["baseline"] / got["sample"])
        drop(path)
        full = tableproof.prove([tf], full_check=True)
        drop(path)
        base_full = sha256sum_chunks(path, list(range(len(sums))))
    doc = {"size_bytes": size, "chunks": len(sums), "sample_bytes": tableproof.SAMPLE_BYTES,
           "rounds": a.rounds, "sample": samples, "throughput_ratio_vs_sha256sum": round(statistics.median(ratios), 3),
           "full_seconds": round(full.seconds, 3), "sha256sum_full_seconds": round(base_full, 3),
           "full_ratio_vs_sha256sum": round(base_full / full.seconds, 3),
           "runs_to_cover": tableproof.runs_to_cover(len(sums), tableproof.SAMPLE_BYTES, CHUNK)}
    if a.json:
        print(json.dumps(doc, indent=1))
    else:
        s = statistics.median(x["seconds"] for x in samples)
        print(f"table {size / 1e9:.2f} GB, {len(sums)} chunks of 64 MiB; sample {tableproof.SAMPLE_BYTES >> 30} GiB "
              f"per run: every chunk re-hashed within {doc['runs_to_cover']} runs")
        print(f"sample (cold): median {s:.2f} s; throughput vs sha256sum of the same chunks: "
              f"{doc['throughput_ratio_vs_sha256sum']:.2f}x (median of {a.rounds} pairs)")
        print(f"full check: {full.seconds:.2f} s vs sha256sum {base_full:.2f} s: {doc['full_ratio_vs_sha256sum']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
