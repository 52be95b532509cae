"""The staged folder read the way the patched vLLM engram.py reads it, through the engine double's
re-implementation of that reader (tests/engine_double/engine_double.py: engram_local_dir,
EngramDiskTable, engram_tables; docs/engram-contract.md), which shares no code with the stager:

- every rank's rows for TP 4 (every row, weight and scale) from DSV41_ENGRAM_DIR equal the checkpoint's,
  byte for byte (the checkpoint read through the synthetic writer's own offsets), for copies and links;
- a folder whose engram-local.json does not cover the rank (or is missing, or half covers) sends the
  reader to the model folder; a model folder without the rows then fails;
- a copy without its header, rows at the wrong offsets (the known "rank offset" bug), the old
  whole-layer files: the reader fails or reads other bytes, and the double exits 5;
- launch renders DSV41_ENGRAM_DIR = the container mount of the staged folder.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.launch.containerspec import ENGRAM_MOUNT, container_spec
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.recipe import load_recipe
from orchestrator.hostside import engram_stage as op
from orchestrator.hostside import engram_checks as ec
from orchestrator.hostside import engram_spec as es
from orchestrator.hostside.geometry import TableGeometry, rank_ranges
from tests.engram_synth import SCALE, WEIGHT, Synth, read_rows

HERE = Path(__file__).resolve().parent
DOUBLE_PATH = HERE / "engine_double" / "engine_double.py"


def _load_double():
    spec = importlib.util.spec_from_file_location("engine_double_engram", DOUBLE_PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


D = _load_double()


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Synth:
    """24 heads (3 orders x 8), 32-value rows with 1 scale each (the engine's 1 scale per 32 values)."""
    return Synth(tmp_path_factory.mktemp("engram-read"), [1, 14], [300, 300, 300], 8, 32, 1, seed=23)


@pytest.fixture(scope="module")
def staged(synth, tmp_path_factory) -> dict[int, Path]:
    """Every rank of TP 4 staged (copies) into its own folder."""
    root = tmp_path_factory.mktemp("staged")
    out = {}
    for rank in range(4):
        out[rank] = root / f"rank{rank}"
        assert op.stage(synth.spec(4, rank, chunk_bytes=4096), synth.ckpt, out[rank])["status"] == "ok"
    return out


def checkpoint_row(s: Synth, layer: int, row: int) -> tuple[bytes, bytes]:
    """Row `row` of the layer's weight and scale as the synthetic writer placed them."""
    return (read_rows(s.tensors[WEIGHT.format(layer=layer)], row, row + 1),
            read_rows(s.tensors[SCALE.format(layer=layer)], row, row + 1))


def read_all(s: Synth, folder: Path | None, tp: int, rank: int, model: Path | None = None):
    """{layer: (source, dir, row_start, [(weight, scale) of every rank row])} through the double's reader."""
    env = {"DSV41_ENGRAM_DIR": str(folder)} if folder else {}
    out = {}
    for t in D.engram_tables(str(model or s.ckpt), tp, rank, env=env):
        out[t.layer] = (t.source, t.dir, t.row_start, t.read(list(range(t.num_rows))))
    return out


def test_double_geometry_is_the_engines_and_deployctls():
    """The double computes each rank's rows from config.json the engine's way; deployctl's geometry
    (hostside/geometry.py) gives the same rows, for the real recipe and TP 1..8."""
    r = load_recipe("deepseek-v41-flash-tp4").recipe
    g = r.engram.geometry
    config = {"engram_layer_ids": list(g.layers), "engram_vocab_size": g.vocab_per_order[0],
              "engram_max_ngram_size": len(g.orders) + 1, "engram_n_heads": g.heads_per_order}
    sizes = D.engram_head_sizes(config)
    assert sum(sizes[1]) == 384006168 and sum(sizes[14]) == 384016682   # the community's published ends
    for tp in range(1, 9):
        for rank in range(tp):
            for rr in rank_ranges(g, tp, rank):
                lo, n = D.engram_rank_rows(sizes[rr.layer], tp, rank)
                assert (lo, lo + n) == (rr.row_start, rr.row_end), (tp, rank, rr.layer)
    # the community's TP4 rank 1 ranges (docs/RECIPE.md: "1:96000564:192001740 14:96003054:192007016")
    assert [D.engram_rank_rows(sizes[layer], 4, 1) for layer in (1, 14)] == \
        [(96000564, 192001740 - 96000564), (96003054, 192007016 - 96003054)]
    small = TableGeometry((0, 3), (2, 3), 5, (40, 40), 32)
    sizes = D.engram_head_sizes({"engram_layer_ids": [0, 3], "engram_vocab_size": 40,
                                 "engram_max_ngram_size": 3, "engram_n_heads": 5})
    for tp in (1, 3, 4, 8):                 # TP 8 leaves ranks without heads: [total, total)
        for rank in range(tp):
            for rr in rank_ranges(small, tp, rank):
                lo, n = D.engram_rank_rows(sizes[rr.layer], tp, rank)
                assert (lo, lo + n) == (rr.row_start, rr.row_end)


@pytest.mark.parametrize("staging", ["copy", "auto"])
def test_every_rank_reads_every_row_from_the_staged_folder(synth, staged, tmp_path, staging):
    """TP 4, every rank, every row of its range, weight and scale: read through DSV41_ENGRAM_DIR the
    engine's way, equal to the checkpoint byte for byte. auto = hard links (same filesystem here)."""
    for rank in range(4):
        folder = staged[rank]
        if staging == "auto":
            folder = tmp_path / f"link{rank}"
            res = op.stage(synth.spec(4, rank, staging="auto"), synth.ckpt, folder)
            assert res["mode"] == "link", res
        got = read_all(synth, folder, 4, rank)
        assert sorted(got) == [1, 14]
        for layer, (source, used, row_start, rows) in got.items():
            lo, hi = synth.expected_range(layer, 4, rank)
            assert (source, used, row_start, len(rows)) == ("local", str(folder), lo, hi - lo)
            for i, pair in enumerate(rows):
                assert pair == checkpoint_row(synth, layer, lo + i), (rank, layer, lo + i)


def test_folder_not_covering_the_rank_falls_back_to_the_model_folder(synth, staged, tmp_path):
    # rank 1's folder used by rank 2: engram-local.json does not cover its rows -> the model folder
    got = read_all(synth, staged[1], 4, 2)
    for layer, (source, used, row_start, rows) in got.items():
        lo, hi = synth.expected_range(layer, 4, 2)
        assert (source, used, row_start) == ("model", str(synth.ckpt), lo)
        assert rows == [checkpoint_row(synth, layer, r) for r in range(lo, hi)]
    # no engram-local.json, or DSV41_ENGRAM_DIR unset: the model folder
    bare = tmp_path / "bare"
    shutil.copytree(staged[2], bare)
    (bare / "engram-local.json").unlink()
    assert {v[0] for v in read_all(synth, bare, 4, 2).values()} == {"model"}
    assert {v[0] for v in read_all(synth, None, 4, 2).values()} == {"model"}
    # a range covering layer 1 but not all of layer 14's rows: per layer, as the engine decides
    half = tmp_path / "half"
    shutil.copytree(staged[2], half)
    lo14, hi14 = synth.expected_range(14, 4, 2)
    local = json.loads((half / "engram-local.json").read_text())
    local["layers"]["14"] = [lo14, hi14 - 1]
    (half / "engram-local.json").write_text(json.dumps(local))
    got = read_all(synth, half, 4, 2)
    assert got[1][0] == "local" and got[14][0] == "model"
    # and with the model folder lacking the rows (config only, no shards): the engine cannot start
    empty = tmp_path / "model-without-rows"
    empty.mkdir()
    shutil.copy(synth.ckpt / "config.json", empty)
    with pytest.raises(D.EngramError, match="model-without-rows"):
        read_all(synth, staged[1], 4, 2, model=empty)


def shifted_copy(synth: Synth, good: Path, dest: Path, rank: int, how: str) -> None:
    """A broken staged folder: the good one's index and engram-local.json, with shard files made
    `how`: "no-header" (the file starts at the data: every offset moves by 8 + header length) or
    "local-offsets" (the header kept, the rank's rows written from the tensor's row 0: the offsets a
    reader that ignores the rank's first row would use)."""
    shutil.copytree(good, dest)
    for name in (n for n in os.listdir(dest) if n.endswith(".safetensors")):
        data = (synth.ckpt / name).read_bytes()
        hlen = 8 + int.from_bytes(data[:8], "little")
        out = bytearray(len(data))
        if how == "local-offsets":
            out[:hlen] = data[:hlen]
        for layer in synth.layers:
            lo, hi = synth.expected_range(layer, 4, rank)
            for tmpl in (WEIGHT, SCALE):
                t = synth.tensors[tmpl.format(layer=layer)]
                if t.file.name != name:
                    continue
                rows = read_rows(t, lo, hi)
                at = t.offset - hlen + lo * t.row_bytes if how == "no-header" else t.offset
                out[at:at + len(rows)] = rows
        (dest / name).unlink()
        (dest / name).write_bytes(bytes(out))


def test_corrupted_offsets_fail(synth, staged, tmp_path):
    rank = 1
    nohead = tmp_path / "no-header"
    shifted_copy(synth, staged[rank], nohead, rank, "no-header")
    with pytest.raises(D.EngramError):
        read_all(synth, nohead, 4, rank)
    with pytest.raises(es.VerifyFailed, match="the engine's reader cannot find"):
        ec.fidelity_check(synth.spec(4, rank), es.resolve_sources(synth.spec(4, rank), synth.ckpt), nohead)

    local = tmp_path / "local-offsets"
    shifted_copy(synth, staged[rank], local, rank, "local-offsets")
    got = read_all(synth, local, 4, rank)             # readable, but not the checkpoint's rows
    lo, hi = synth.expected_range(1, 4, rank)
    assert got[1][0] == "local" and got[1][3][0] != checkpoint_row(synth, 1, lo)
    with pytest.raises(D.EngramError, match="differs from the model folder"):
        D.engram_check_rank(str(synth.ckpt), 4, rank, 16, env={"DSV41_ENGRAM_DIR": str(local)})
    with pytest.raises(es.VerifyFailed, match="not where the engine looks for them"):
        ec.fidelity_check(synth.spec(4, rank), es.resolve_sources(synth.spec(4, rank), synth.ckpt), local)

    old = tmp_path / "old-format"                     # manifest version 1: engram-L*.bin, no index, no header
    old.mkdir()
    shutil.copy(staged[rank] / "engram-local.json", old)
    for layer in synth.layers:
        (old / f"engram-L{layer}.weight.bin").write_bytes(bytes(64))
    with pytest.raises(D.EngramError, match="model.safetensors.index.json"):
        read_all(synth, old, 4, rank)


# ----------------------------------------------------------------------------- the double as a process

def run_double(synth: Synth, engram_dir: Path | None, record: Path, timeout: float = 30) -> tuple[int | None, str]:
    """`vllm serve CKPT --tensor-parallel-size 4` (one node: the double checks ranks 0..3) with
    DSV41_ENGRAM_DISK=1; returns (exit code or None if it came up serving, its output)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DOUBLE_", "DSV41_"))}
    env.update(DSV41_ENGRAM_DISK="1", DOUBLE_LOAD_S="0", DOUBLE_RECORD_DIR=str(record), PYTHONUNBUFFERED="1")
    if engram_dir:
        env["DSV41_ENGRAM_DIR"] = str(engram_dir)
    log = record / "out.log"
    record.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        p = subprocess.Popen([sys.executable, str(DOUBLE_PATH), "vllm", "serve", str(synth.ckpt),
                              "--tensor-parallel-size", "4", "--host", "127.0.0.1", "--port", str(port)],
                             stdout=fh, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if p.poll() is not None:
                return p.returncode, log.read_text()
            if "Application startup complete" in log.read_text():
                return None, log.read_text()
            time.sleep(0.05)
        raise AssertionError(f"the double neither served nor exited in {timeout} s:\n{log.read_text()}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_double_process_reads_the_staged_rows_and_records_them(synth, staged, tmp_path):
    code, out = run_double(synth, staged[2], tmp_path / "rec")
    assert code is None, out
    for layer in (1, 14):
        lo, hi = synth.expected_range(layer, 4, 2)
        assert f"Engram rows from local dir {staged[2]}: layer {layer} rows [{lo}, {hi})" in out
        assert f"Engram layer {layer} rows [{lo}, {hi}) read from node-local {staged[2]}" in out
        lo0, hi0 = synth.expected_range(layer, 4, 0)       # rank 0 is not covered by rank 2's folder
        assert (f"DSV41_ENGRAM_DIR={staged[2]} holds layer {layer} rows [{lo}, {hi}), this rank needs "
                f"[{lo0}, +{hi0 - lo0}); reading {synth.ckpt}") in out
        assert f"Engram rows from model folder {synth.ckpt}: layer {layer}" in out
    import hashlib
    rec = json.loads((tmp_path / "rec" / "engram-rows-rank2.json").read_text())
    for layer, doc in rec["layers"].items():
        assert doc["source"] == "local" and doc["compared"] and len(doc["rows"]) >= 3
        for row, (w, s) in doc["rows"].items():
            cw, cs = checkpoint_row(synth, int(layer), int(row))
            assert (w, s) == (hashlib.sha256(cw).hexdigest(), hashlib.sha256(cs).hexdigest())
    assert json.loads((tmp_path / "rec" / "engram-rows-rank0.json").read_text())["layers"]["1"]["source"] == "model"


@pytest.mark.parametrize("how", ["no-header", "local-offsets"])
def test_double_process_exits_5_on_a_corrupted_copy(synth, staged, tmp_path, how):
    broken = tmp_path / how
    shifted_copy(synth, staged[3], broken, 3, how)
    code, out = run_double(synth, broken, tmp_path / "rec")
    assert code == 5, out
    assert "Engram-on-disk (rank 3 of 4)" in out
    if how == "local-offsets":
        assert "differs from the model folder" in out


def test_double_process_exits_5_without_rows_anywhere(synth, staged, tmp_path):
    """A rank not covered by the folder, and a model folder that lacks the rows: the engine fails."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(synth.ckpt / "config.json", model)
    s2 = Synth.__new__(Synth)
    s2.ckpt = model
    code, out = run_double(s2, staged[1], tmp_path / "rec")
    assert code == 5 and "Engram-on-disk (rank 0 of 4)" in out, out


# ------------------------------------------------------------------------------------------- launch

def test_launch_points_the_engine_at_the_staged_folder():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    for h in dep.cluster.hosts:
        spec = container_spec(dep, h, None, None)
        assert spec.env["DSV41_ENGRAM_DIR"] == ENGRAM_MOUNT == "/engram"
        assert (dep.engram_dir(h), ENGRAM_MOUNT, "ro") in spec.mounts
        assert spec.env["DSV41_ENGRAM_DISK"] == "1"
    other = load_deployment(INVENTORIES_DIR / "spark4.yml", sets=("engram.local_dir_env=SPARK_ENGRAM_DIR",))
    env = container_spec(other, other.cluster.hosts[1], None, None).env
    assert env["SPARK_ENGRAM_DIR"] == "/engram" and "DSV41_ENGRAM_DIR" not in env
    off = load_deployment(INVENTORIES_DIR / "spark4.yml", sets=("engram.local_dir_env=null",))
    assert not any(k.endswith("ENGRAM_DIR") for k in container_spec(off, off.cluster.hosts[0], None, None).env)
    mem = load_deployment(INVENTORIES_DIR / "spark8.yml", "deepseek-v41-flash-tp8-mem")
    assert "DSV41_ENGRAM_DIR" not in container_spec(mem, mem.cluster.hosts[0], None, None).env


def test_hf_cache_symlinks_and_a_checkpoint_without_index(synth, tmp_path):
    """HF cache layout (snapshot files are symlinks into ../../blobs): copies read through the links,
    links point at the blobs themselves. A checkpoint without an index: the staged folder gets one
    written from the headers, which the engine's reader then uses."""
    repo = tmp_path / "models--x--y"
    snap, blobs = repo / "snapshots" / "main", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for p in synth.ckpt.iterdir():
        shutil.copy(p, blobs / p.name)
        (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / p.name)
    for staging, rank in (("copy", 1), ("auto", 2)):
        dest = tmp_path / f"d-{staging}"
        res = op.stage(synth.spec(4, rank, staging=staging), snap, dest)
        assert res["mode"] == ("link" if staging == "auto" else "copy"), res
        for name in res["files"]:
            linked = os.stat(dest / name).st_ino == os.stat(blobs / name).st_ino
            assert linked == (staging == "auto") and not (dest / name).is_symlink()
        got = read_all(synth, dest, 4, rank, model=snap)
        for layer, (source, _, lo, rows) in got.items():
            assert source == "local" and rows == [checkpoint_row(synth, layer, lo + i) for i in range(len(rows))]
    bare = tmp_path / "no-index"
    shutil.copytree(synth.ckpt, bare)
    (bare / "model.safetensors.index.json").unlink()
    dest = tmp_path / "d-no-index"
    assert op.stage(synth.spec(4, 3), bare, dest)["status"] == "ok"
    wm = json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"]
    assert wm[WEIGHT.format(layer=14)] == synth.tensors[WEIGHT.format(layer=14)].file.name
    got = read_all(synth, dest, 4, 3, model=bare)
    assert {v[0] for v in got.values()} == {"local"}
    assert op.stage(synth.spec(4, 3), bare, dest)["status"] == "skipped"
