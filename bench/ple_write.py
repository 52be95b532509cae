"""Benchmark the PLE table writer (orchestrator/hostside/ple_write.py) against a plain write.

    python3 bench/ple_write.py [--size-gb 2] [--shards 128] [--files 8] [--rounds 3] [--dir D] [--json]

Makes a synthetic Qwen-shaped checkpoint of about SIZE GB (the qwen38-flash-next-spark recipe,
scaled down with recipe overrides: `shards` shard tensors over `files` safetensors files), then,
in the same run and on the same filesystem, ROUNDS back-to-back pairs in alternating order:

  plain   a child python3 writes SIZE bytes sequentially (16 MiB buffers) to a new file, fsync
  ple     a child runs the host-side op from the zipapp (`ple-write`) into an empty folder

and prints the ratio of their throughputs (median of the pairs' ratios; target >= 0.9). The source
files are dropped from the page cache before every ple round (a cold start reads the checkpoint
from disk, as after a reboot); the plain write has nothing to read. Also measured:

  restart   the op again on the written table: wall time of the whole child (python start,
            zipapp import, headers, manifest; the decision itself is `decided_in_s`)
  rewrite   the op after the checkpoint changed with the old table still there (the reported
            engine's 55-minute case): should cost what a fresh write costs
  RSS       peak resident memory of the op's child process (wait4 rusage)
  cache     page cache held by the checkpoint and table files: the peak while writing (sampled
            with mincore every 50 ms) and what is left after the op, against the plain write
  checksums the copy alone (bulkcopy.copy_segments in this process) with and without the per-chunk
            sha256, alternating, cold sources: what the checksums cost
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.recipe import load_recipe                      # noqa: E402
from orchestrator.stages.write_ple import spec_for               # noqa: E402
from orchestrator.hostside import bulkcopy, bundle                 # noqa: E402
from orchestrator.hostside import ple_spec                          # noqa: E402
from orchestrator.hostside.geometry import total_rows              # noqa: E402
from tests.synth import TensorPlan, ple_shard_rows, recipe_config, write_checkpoint             # noqa: E402

RECIPE = "qwen38-flash-next-spark"
PLAIN_WRITER = """
import os, sys
path, total = sys.argv[1], int(sys.argv[2])
buf = os.urandom(16 << 20)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
done = 0
while done < total:
    done += os.write(fd, memoryview(buf)[:min(len(buf), total - done)])
os.fsync(fd)
os.close(fd)
"""


class CacheSampler:
    """Peak page-cache bytes of some files (and of every file in some folders) while it runs."""

    def __init__(self, files: list[Path], folders: list[Path], every_s: float = 0.05):
        self.files, self.folders, self.every = files, folders, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        paths = list(self.files) + [p for d in self.folders if d.is_dir() for p in d.iterdir() if p.is_file()]
        total = 0
        for p in paths:
            try:
                total += cached_bytes(p)
            except (FileNotFoundError, OSError):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.every)

    def __enter__(self) -> "CacheSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def run_child(argv: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stdout) of a child process."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    out, err = p.stdout.read().decode(), p.stderr.read().decode()
    p.stdout.close()
    p.stderr.close()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed (exit {p.returncode}):\n{err[-2000:]}\n{out[-2000:]}")
    return wall, ru.ru_maxrss * 1024, out


def cached_bytes(path: Path) -> int:
    """Bytes of `path` resident in the page cache (mincore over a read-only mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = ctypes.create_string_buffer((size + page - 1) // page)
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(b & 1 for b in vec.raw) * page
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def make_checkpoint(folder: Path, size_gb: float, shards: int, files: int, seed: int):
    """A checkpoint whose PLE shards hold the recipe geometry's rows, with vocab scaled to SIZE."""
    width = 160
    vocab = max(200, int(size_gb * 1e9 / width / 16))
    sets = [f"ple.geometry.vocab_per_order=[{vocab},{vocab}]", f"ple.shards={shards}",
            f"ple.split_ngram_parts={shards}"]
    recipe = load_recipe(RECIPE, sets).recipe
    rows = total_rows(recipe.ple.geometry)
    layer = recipe.ple.geometry.layers[0]
    # shards cut as the released SGLang's loader places them (tests/synth.py ple_shard_rows)
    tensors = [TensorPlan(recipe.ple.shard_tensor.format(layer=layer, shard=i), "F8_E4M3", n, width)
               for i, n in enumerate(ple_shard_rows(recipe.ple))]
    write_checkpoint(folder, tensors, files=files, config=recipe_config(recipe))
    return recipe, rows * width


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--shards", type=int, default=128)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default="/var/tmp/deployctl-bench-ple")
    ap.add_argument("--keep", action="store_true", help="keep the folder afterwards")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    base = Path(a.dir)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        t0 = time.monotonic()
        ck = base / "checkpoint"
        recipe, total = make_checkpoint(ck, a.size_gb, a.shards, a.files, seed=1)
        say(f"checkpoint: {total / 1e9:.2f} GB, {a.shards} shards over {a.files} files "
            f"({time.monotonic() - t0:.1f} s to make)")
        spec = base / "spec.json"
        spec.write_text(json.dumps(spec_for(recipe)))
        pyz = bundle.build(base)
        sources = sorted(ck.glob("*.safetensors"))
        op = [sys.executable, str(pyz), "ple-write", "--spec", str(spec), "--checkpoint", str(ck)]

        plain, ple, rss, ple_cache, plain_cache, ple_peak, plain_peak = [], [], [], [], [], [], []

        def plain_round() -> None:
            os.sync()
            pdir = base / "plain"
            pdir.mkdir()
            out = pdir / "plain.bin"
            with CacheSampler([], [pdir]) as cs:
                wall, _, _ = run_child([sys.executable, "-c", PLAIN_WRITER, str(out), str(total)])
            plain.append(total / wall / 1e6)
            plain_cache.append(cached_bytes(out))
            plain_peak.append(cs.peak)
            shutil.rmtree(pdir)

        def ple_round(r: int) -> dict:
            os.sync()
            for s in sources:
                drop_cache(s)
            dest = base / f"ple-{r}"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            with CacheSampler(sources, [dest]) as cs:
                wall, peak, stdout = run_child([*op, "--dest", str(dest), "--quiet"])
            res = json.loads(stdout.strip().splitlines()[-1])
            ple.append(total / wall / 1e6)
            rss.append(peak)
            ple_cache.append(cached_bytes(Path(res["file"])) + sum(cached_bytes(s) for s in sources))
            ple_peak.append(cs.peak)
            return res

        # back to back in pairs, the order alternating: the disk's mood (other tenants, the host's
        # cache) changes between rounds more than between the two runs of a pair
        for r in range(a.rounds):
            if r % 2 == 0:
                plain_round()
                res = ple_round(r)
            else:
                res = ple_round(r)
                plain_round()
            say(f"round {r + 1}: plain {plain[-1]:.0f} MB/s, ple-write {ple[-1]:.0f} MB/s "
                f"(copy {res['mb_per_s']} MB/s; pair ratio {ple[-1] / plain[-1]:.2f}), peak RSS "
                f"{rss[-1] / 2**20:.0f} MiB, page cache peak {ple_peak[-1] / 2**20:.0f} MiB, left "
                f"{ple_cache[-1] / 2**20:.1f} MiB (plain write: peak {plain_peak[-1] / 2**20:.0f} MiB, "
                f"left {plain_cache[-1] / 2**20:.0f} MiB)")
            if r < a.rounds - 1:
                shutil.rmtree(base / f"ple-{r}")
        last = base / f"ple-{a.rounds - 1}"

        noop = []
        for _ in range(3):
            wall, _, stdout = run_child([*op, "--dest", str(last), "--quiet"])
            res = json.loads(stdout.strip().splitlines()[-1])
            assert res["status"] == "kept", res
            noop.append((wall, res["decided_in_s"]))

        # the checkpoint changes (a new revision): the old table is still there and is replaced
        os.utime(sources[0])
        for s in sources:
            drop_cache(s)
        os.sync()
        wall, _, stdout = run_child([*op, "--dest", str(last), "--quiet"])
        res = json.loads(stdout.strip().splitlines()[-1])
        assert res["status"] == "rewritten", res
        rewrite = total / wall / 1e6
        plain_round()                                  # its pair
        rewrite_ratio = rewrite / plain.pop()
        plain_cache.pop()
        plain_peak.pop()

        # what the per-chunk sha256 costs: the copy alone, with and without, alternating
        table_spec = ple_spec.load_spec(spec)
        src = ple_spec.resolve_source(table_spec, ck)
        (table,) = table_spec.tables()
        segments = ple_spec.segments_for(table, src, table.row_bytes)
        with_sums, without = [], []
        for r in range(a.rounds):
            for flag, acc in ((True, with_sums), (False, without))[::1 if r % 2 == 0 else -1]:
                for s in sources:
                    drop_cache(s)
                os.sync()
                out = base / "copy.bin"
                fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                res_c = bulkcopy.copy_segments(fd, segments, checksums=flag)
                os.close(fd)
                out.unlink()
                acc.append(total / res_c.seconds / 1e6)
        say(f"copy with sha256 {[round(x) for x in with_sums]} MB/s, without {[round(x) for x in without]} MB/s")

        report = {
            "bytes": total, "shards": a.shards, "files": a.files, "rounds": a.rounds,
            "plain_mb_s": [round(x) for x in plain], "ple_mb_s": [round(x) for x in ple],
            "pair_ratios": [round(x / y, 3) for x, y in zip(ple, plain)],
            "ratio": round(statistics.median(x / y for x, y in zip(ple, plain)), 3),
            "rewrite_over_old_mb_s": round(rewrite),
            "rewrite_ratio": round(rewrite_ratio, 3),
            "noop_wall_s": round(max(w for w, _ in noop), 3),
            "noop_decided_in_s": round(max(d for _, d in noop), 4),
            "peak_rss_mib": round(max(rss) / 2**20, 1),
            "page_cache_peak_mib": round(max(ple_peak) / 2**20, 1),
            "page_cache_left_mib": round(max(ple_cache) / 2**20, 2),
            "plain_write_cache_peak_mib": round(statistics.median(plain_peak) / 2**20, 1),
            "plain_write_cache_left_mib": round(statistics.median(plain_cache) / 2**20, 1),
            "copy_with_sha256_mb_s": round(statistics.median(with_sums)),
            "copy_without_sha256_mb_s": round(statistics.median(without)),
            "sha256_cost": round(1 - statistics.median(x / y for x, y in zip(with_sums, without)), 3),
        }
        if a.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"table {total / 1e9:.2f} GB, {a.shards} shards / {a.files} files, {a.rounds} rounds")
            print(f"plain write+fsync  {statistics.median(plain):7.0f} MB/s  {report['plain_mb_s']}")
            print(f"ple-write          {statistics.median(ple):7.0f} MB/s  {report['ple_mb_s']}")
            print(f"ratio              {report['ratio']:7.3f}  (median of the pairs {report['pair_ratios']}; "
                  "target >= 0.9)")
            print(f"rewrite over old   {rewrite:7.0f} MB/s  (ratio {report['rewrite_ratio']})")
            print(f"restart no-op      {report['noop_wall_s']:7.3f} s wall (decision "
                  f"{report['noop_decided_in_s']} s)")
            print(f"peak RSS           {report['peak_rss_mib']:7.1f} MiB")
            print(f"page cache         peak {report['page_cache_peak_mib']:.0f} MiB while writing, "
                  f"{report['page_cache_left_mib']:.2f} MiB left (table + checkpoint files); the plain "
                  f"write: peak {report['plain_write_cache_peak_mib']:.0f} MiB, "
                  f"{report['plain_write_cache_left_mib']:.0f} MiB left")
            print(f"sha256 per chunk   copy {report['copy_with_sha256_mb_s']} MB/s with, "
                  f"{report['copy_without_sha256_mb_s']} MB/s without (cost {report['sha256_cost']:.1%})")
        return 0
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
