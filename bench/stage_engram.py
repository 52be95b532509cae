"""Benchmark engram-stage against a plain copy of the same bytes, on this machine's disk.

    python3 bench/stage_engram.py [--gb 2] [--dir DIR] [--staging copy|auto] [--rounds 2]
                                  [--threads N] [--keep] [--json]

Writes a synthetic checkpoint (DeepSeek row shape: 256 B FP8 + 8 B scale per row, 2 Engram layers of
24 prime-sized heads, 4 safetensors files with unrelated tensors) of about --gb GB of Engram rows into
a temporary folder under --dir (default: the system temp folder; keep it on the disk you care about),
then alternates, --rounds times:

  baseline   os.copy_file_range of every Engram tensor into a new file, sequentially, then fsync
  staging    `python3 -m orchestrator.hostside engram-stage` for rank 0 of 1 (all rows: the same bytes),
             in a child process: copy, per-chunk sha256, fsync, fidelity check, manifest

Before every run: sync, then posix_fadvise(DONTNEED) over every source file and the destination
folder's files are deleted, so neither run reads from the page cache the other filled (said in the
output). Reported: best time of each, the throughput ratio staging/baseline (target >= 0.9), the
staging child's peak RSS (os.wait4 rusage), and the no-op re-stage time (process start included).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.recipe import load_recipe  # noqa: E402
from orchestrator.stages.stage_engram import engram_spec  # noqa: E402
from orchestrator.hostside.geometry import layer_tables  # noqa: E402
from tests.engram_synth import make_checkpoint  # noqa: E402

ROW = 256 + 8


def drop_caches(files: list[Path]) -> None:
    os.sync()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def clear(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    os.sync()


def baseline(tensors: list, dest: Path) -> float:
    """Sequential copy_file_range of each tensor's bytes into its own file, then fsync each."""
    t0 = time.monotonic()
    for t in tensors:
        src = os.open(t.file, os.O_RDONLY)
        dst = os.open(dest / t.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < t.nbytes:
                n = os.copy_file_range(src, dst, min(64 << 20, t.nbytes - done), t.offset + done, done)
                if n == 0:
                    raise RuntimeError(f"short copy of {t.name}")
                done += n
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
    return time.monotonic() - t0


def run_op_rusage(argv: list[str]) -> tuple[float, int, dict]:
    """(wall seconds, peak RSS bytes, the op's JSON result) of one child process (os.wait4: its own rusage)."""
    t0 = time.monotonic()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # child: exec the op with stdout into the pipe
        os.close(r)
        os.dup2(w, 1)
        os.chdir(ROOT)
        os.execv(argv[0], argv)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status, ru = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"engram-stage failed (status {status})")
    return wall, ru.ru_maxrss * 1024, json.loads(b"".join(chunks).decode().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="GB of Engram rows (default 2)")
    ap.add_argument("--dir", default=None, help="parent of the temporary folder (default: system temp)")
    ap.add_argument("--staging", choices=("copy", "auto"), default="copy",
                    help="copy: what the benchmark measures; auto: hard links where the checkpoint is local")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    vocab = max(100, int(a.gb * 1e9 / ROW / 2 / 24))
    recipe = load_recipe("deepseek-v41-flash-tp4", [f"engram.geometry.vocab_per_order=[{vocab},{vocab},{vocab}]",
                                                    f"engram.staging={a.staging}", "engram.free_margin_gb=0"]).recipe
    g = recipe.engram.geometry
    sizes = {t.layer: [s.rows for s in t.subtables] for t in layer_tables(g)}
    work = Path(tempfile.mkdtemp(prefix="engram-bench-", dir=a.dir))
    say = (lambda m: None) if a.json else (lambda m: print(m, flush=True))
    try:
        t0 = time.monotonic()
        tensors = make_checkpoint(work / "ckpt", list(g.layers), list(g.vocab_per_order), g.heads_per_order,
                                  g.row_values, 8, data="fast", sizes=sizes)
        engram = [t for t in tensors.values() if ".engram." in t.name]
        nbytes = sum(t.nbytes for t in engram)
        fstype = subprocess.run(["stat", "-f", "-c", "%T", str(work)], capture_output=True, text=True).stdout.strip()
        say(f"engram-stage bench: {nbytes / 1e9:.2f} GB of Engram rows ({len(g.layers)} layers x 24 heads, "
            f"{ROW} B rows) in a 4-file checkpoint under {work} ({fstype}); written in "
            f"{time.monotonic() - t0:.1f} s")
        say("caches: before every run: sync, posix_fadvise(DONTNEED) on every source file, fresh empty "
            "destination folder")
        spec = work / "spec.json"
        spec.write_text(json.dumps(engram_spec(recipe, 0, 1).to_json()))
        sources = sorted({t.file for t in engram})
        dest = work / "dest"
        op = [sys.executable, "-m", "orchestrator.hostside", "engram-stage", "--spec", str(spec),
              "--checkpoint", str(work / "ckpt"), "--dest", str(dest)]
        if a.threads:
            op += ["--threads", str(a.threads)]
        base_t, ours_t, rss, res = [], [], 0, {}
        for i in range(a.rounds):
            clear(dest)
            drop_caches(sources)
            base_t.append(baseline(engram, dest))
            say(f"  round {i + 1}: baseline {base_t[-1]:.2f} s ({nbytes / base_t[-1] / 1e6:.0f} MB/s)")
            clear(dest)
            drop_caches(sources)
            wall, peak, res = run_op_rusage(op)
            ours_t.append(wall)
            rss = max(rss, peak)
            say(f"  round {i + 1}: engram-stage {wall:.2f} s ({nbytes / wall / 1e6:.0f} MB/s), "
                f"peak RSS {peak / 1e6:.0f} MB")
        drop_caches(sources)
        noop_wall, _, noop = run_op_rusage(op)
        assert noop["status"] == "skipped", noop
        b, o = min(base_t), min(ours_t)
        doc = {"bytes": nbytes, "staging": a.staging, "fs": fstype, "rounds": a.rounds,
               "baseline_s": round(b, 3), "baseline_mb_s": round(nbytes / b / 1e6, 1),
               "stage_s": round(o, 3), "stage_mb_s": round(nbytes / o / 1e6, 1), "ratio": round(b / o, 3),
               "peak_rss_mb": round(rss / 1e6, 1), "noop_s": round(noop_wall, 3),
               "noop_op_s": noop.get("seconds"), "threads": a.threads or "default",
               "cache_drop": "sync + posix_fadvise(DONTNEED) on the sources, empty destination, before each run"}
        if a.json:
            print(json.dumps(doc, indent=2))
        else:
            say(f"baseline (copy_file_range + fsync, sequential): {b:.2f} s, {doc['baseline_mb_s']:.0f} MB/s "
                f"(best of {a.rounds})")
            say(f"engram-stage ({a.staging}, sha256 + fidelity + manifest): {o:.2f} s, {doc['stage_mb_s']:.0f} MB/s "
                f"(best of {a.rounds})")
            say(f"ratio {doc['ratio']:.2f} (target >= 0.9); peak RSS of the staging process "
                f"{doc['peak_rss_mb']:.0f} MB; no-op re-stage {noop_wall:.2f} s (process start included; "
                f"the op itself {noop.get('seconds')} s)")
        return 0
    finally:
        if a.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
