"""engram-stage: every byte of every rank's files, both layouts; idempotence; restage on change;
the zipapp on a bare interpreter; the no-op on a real-size checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.recipe import load_recipe
from orchestrator.stages.stage_engram import engram_spec
from orchestrator.tables import bulkcopy, bundle
from orchestrator.tables import engram_stage as op
from orchestrator.tables.geometry import layer_tables
from tests.engram_synth import RECIPE, WEIGHT, Synth, make_checkpoint



@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Synth:
    return Synth(tmp_path_factory.mktemp("engram"), [1, 14], [50, 60, 70], 8, 32, 1)


@pytest.fixture(scope="module")
def synth3(tmp_path_factory) -> Synth:
    """3 layers of 6 heads, 16-value rows with 2 scales: TP 4 and 8 leave ranks without heads."""
    return Synth(tmp_path_factory.mktemp("engram3"), [0, 3, 9], [100, 120], 3, 16, 2, seed=7)


@pytest.mark.parametrize("layout", ["sparse", "packed"])
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_every_byte_every_rank(synth, synth3, tmp_path, tp, layout):
    for s in (synth, synth3):
        for rank in range(tp):
            dest = tmp_path / f"{id(s)}-{rank}"
            res = op.stage(s.spec(tp, rank, layout, chunk_bytes=4096), s.ckpt, dest)
            assert res["status"] == "ok", res
            s.check_dest(dest, tp, rank, layout)


def test_no_scale_tensor(tmp_path):
    s = Synth(tmp_path, [2], [40], 4, 32, None)
    for layout in ("sparse", "packed"):
        for rank in range(3):
            dest = tmp_path / f"{layout}{rank}"
            assert op.stage(s.spec(3, rank, layout), s.ckpt, dest)["status"] == "ok"
            s.check_dest(dest, 3, rank, layout)


def test_sparse_files_have_holes(synth, tmp_path):
    dest = tmp_path / "d"
    op.stage(synth.spec(8, 7), synth.ckpt, dest)
    st = (dest / "engram-L14.weight.bin").stat()
    lo, hi = synth.expected_range(14, 8, 7)
    fd = os.open(dest / "engram-L14.weight.bin", os.O_RDONLY)
    try:
        assert os.lseek(fd, 0, os.SEEK_DATA) >= lo * 32 // 4096 * 4096      # nothing written before the range
    finally:
        os.close(fd)
    assert st.st_blocks * 512 < st.st_size


def test_skip_is_fast_reads_no_data_and_says_why(synth, tmp_path, monkeypatch):
    dest = tmp_path / "d"
    spec = synth.spec(4, 2, "packed")
    assert op.stage(spec, synth.ckpt, dest)["status"] == "ok"

    def boom(*a, **k):
        raise AssertionError("table data was read on a no-op")
    for name in ("copy_segments", "hash_chunks"):
        monkeypatch.setattr(bulkcopy, name, boom)
    monkeypatch.setattr(op.Copier, "run", boom)
    monkeypatch.setattr(op, "read_checkpoint_row", boom)
    monkeypatch.setattr(op, "read_staged_row", boom)
    t0 = time.monotonic()
    res = op.stage(spec, synth.ckpt, dest)
    assert time.monotonic() - t0 < 2
    assert res["status"] == "skipped"
    assert "already staged: rank 2 of 4, layout packed" in res["reason"]


def test_restage_on_changed_checkpoint_rank_and_layout(synth, tmp_path):
    dest = tmp_path / "d"
    assert op.stage(synth.spec(4, 1), synth.ckpt, dest)["status"] == "ok"
    # another rank into the same folder: restaged, the old rows are gone
    res = op.stage(synth.spec(4, 3), synth.ckpt, dest)
    assert res["status"] == "ok" and "rank 1 -> 3" in res["reason"]
    synth.check_dest(dest, 4, 3, "sparse")
    # another layout: the sparse files are removed
    res = op.stage(synth.spec(4, 3, "packed"), synth.ckpt, dest)
    assert res["status"] == "ok" and "layout 'sparse' -> 'packed'" in res["reason"]
    assert sorted(p for p in os.listdir(dest) if p.endswith(".bin")) == ["engram-L1.packed.bin",
                                                                        "engram-L14.packed.bin"]
    synth.check_dest(dest, 4, 3, "packed")
    # the checkpoint changed (a shard rewritten: new mtime)
    shard = synth.tensors[WEIGHT.format(layer=14)].file
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        res = op.stage(synth.spec(4, 3, "packed"), synth.ckpt, dest)
        assert res["status"] == "ok" and "checkpoint changed" in res["reason"] and shard.name in res["reason"]
        assert op.stage(synth.spec(4, 3, "packed"), synth.ckpt, dest)["status"] == "skipped"
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_cli_stage_json_and_text(synth, tmp_path):
    dest = tmp_path / "d"
    args = ["engram", "stage", "--recipe", RECIPE, *[x for s in synth.sets() for x in ("--set", s)],
            "--checkpoint", str(synth.ckpt), "--dest", str(dest), "--rank", "1"]
    r = CliRunner().invoke(cli, args + ["--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["status"] == "ok" and doc["ranges"] == {"1": list(synth.expected_range(1, 4, 1)),
                                                       "14": list(synth.expected_range(14, 4, 1))}
    synth.check_dest(dest, 4, 1, "sparse")
    r = CliRunner().invoke(cli, args + ["--verify"])
    assert r.exit_code == 0 and r.output.startswith("skipped: already staged"), r.output
    r = CliRunner().invoke(cli, args[:-1] + ["4"])
    assert r.exit_code == 2 and "--rank 4 is outside 0..3" in r.output


def test_zipapp_on_a_bare_interpreter(synth, tmp_path):
    """The host-side path: the shipped zipapp, `python3 -I -S` (no site-packages: stdlib only)."""
    pyz = bundle.build(tmp_path)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(synth.spec(2, 0, "packed").to_json()))
    dest = tmp_path / "d"
    argv = ["python3", "-I", "-S", str(pyz), "engram-stage", "--spec", str(spec_file),
            "--checkpoint", str(synth.ckpt), "--dest", str(dest)]
    p = subprocess.run(argv + ["--check"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    chk = json.loads(p.stdout.splitlines()[-1])
    assert chk["status"] == "check" and chk["ok"] and not chk["up_to_date"] and chk["need_bytes"] > 0
    p = subprocess.run(argv + ["--rank", "1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["status"] == "ok"
    synth.check_dest(dest, 2, 1, "packed")
    p = subprocess.run(argv + ["--rank", "1", "--verify"], capture_output=True, text=True, timeout=60)
    res = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 0 and res["status"] == "skipped" and res["verified"], p.stdout
    p = subprocess.run(argv + ["--rank", "1", "--check-rank"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["status"] == "rank-ok"


def test_noop_on_real_size_checkpoint_is_fast(tmp_path):
    """The real geometry (768M rows, 202 GB of Engram tensors, holes on disk): a re-stage with nothing
    to do answers in under 2 s, process start included, because it reads only headers."""
    r = load_recipe(RECIPE).recipe
    g = r.engram.geometry
    sizes = {t.layer: [s.rows for s in t.subtables] for t in layer_tables(g)}
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, list(g.layers), list(g.vocab_per_order), g.heads_per_order, g.row_values, 8,
                    data="holes", sizes=sizes)
    spec = engram_spec(r, 2)
    dest = tmp_path / "nvme"
    dest.mkdir()
    sources = op.resolve_sources(spec, ckpt)
    files = op.out_files(spec)
    for f in files:                     # a staged folder as a real run leaves it (data: holes)
        with open(dest / f.name, "wb") as fh:
            fh.truncate(f.size)
    mfiles = [op._manifest_file(f, ["0" * 64] * len(f.chunks(spec.chunk_bytes)), spec.chunk_bytes) for f in files]
    (dest / "engram-local.json").write_text(json.dumps({"layers": op.local_ranges(spec)}))
    (dest / "engram-manifest.json").write_text(json.dumps(op._manifest(spec, sources, files, mfiles, 0.0)))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", "engram", "stage", "-r", RECIPE, "--rank", "2",
                        "--checkpoint", str(ckpt), "--dest", str(dest), "--json"],
                       capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["status"] == "skipped" and doc["reason"].startswith("already staged: rank 2 of 4")
    assert took < 2.0, took
