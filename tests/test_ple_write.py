"""The host-side PLE table writer (orchestrator/hostside/ple_write.py), on synthetic checkpoints.

16 shards over 5 safetensors files, tiny vocabularies (97/101 per order: 2,124 rows, padded to 2,176),
width 160; the shards are cut as an exporter that splits the real rows would cut them (133 rows each),
so the released SGLang's placement (shard i at row i x ceil(2,176 / 16) = 136 i) leaves zero gaps
between them. Small checksum chunks so shards straddle chunk boundaries. Every byte of the written
file is checked against tests/synth.py's independent row function and an independent placement.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import InputError
from orchestrator.hostside import bulkcopy, bundle, tableproof
from orchestrator.hostside import ple_write as P
from orchestrator.hostside import ple_spec
from orchestrator.hostside.geometry import TableGeometry, total_rows
from tests.synth import TensorPlan, expected_row, write_checkpoint

TENSOR = "model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{shard}.weight"
CHUNK = 8192                      # 51.2 rows of 160 B: chunks and shards never line up


def spec_doc(shards: int = 16, vocab=(97, 101), width: int = 160, placement: str = "nvme",
             tp: int = 1, ranks=(0,), split: int | None = None, **extra) -> dict:
    return {"format": ple_spec.SPEC_FORMAT, "placement": placement,
            "geometry": {"layers": [2], "orders": [2, 3], "heads_per_order": 8,
                         "vocab_per_order": list(vocab), "row_values": width, "dtype": "F8_E4M3"},
            "shard_tensor": TENSOR, "shards": shards, "tp": tp, "ranks": list(ranks),
            "engine_config": {"make_ngram_vocab_size_divisible_by": 128,
                              "split_ngram_parts": split or shards},
            "min_host_ram_gb": 64, "recipe": {"name": "test", "digest": "0"}, **extra}


def config_of(doc: dict) -> dict:
    """The checkpoint's config.json (text_config) matching a spec document."""
    return {"text_config": dict(doc["engine_config"], ple_embedding_dtype="float8_e4m3fn")}


def shard_plans(rows: int, shards: int, width: int = 160) -> list[TensorPlan]:
    """An exporter's cut of the real rows: ceil(rows / shards) per shard, the last the rest."""
    per = -(-rows // shards)
    return [TensorPlan(TENSOR.format(layer=2, shard=i), "F8_E4M3", max(0, min(per, rows - i * per)), width)
            for i in range(shards)]


def expected_bytes(plans: list[TensorPlan], spec=None, rank: int = 0) -> bytes:
    """The file the engine maps, built independently: padded row count, shard i at i x stride."""
    spec = spec or ple_spec.parse_spec(spec_doc(shards=len(plans)))
    rows = total_rows(spec.geometry)
    org = -(-rows // 128) * 128
    per = -(-org // 64) * 64 // spec.tp
    stride = -(-org // spec.engine_config["split_ngram_parts"])
    table = [bytes(160)] * (spec.tp * per)
    for i, t in enumerate(plans):
        for r in range(t.rows):
            table[i * stride + r] = expected_row(t.name, r, t.width)
    return b"".join(table[rank * per:(rank + 1) * per])


@pytest.fixture
def ckpt(tmp_path):
    doc = spec_doc()
    spec = ple_spec.parse_spec(doc)
    plans = shard_plans(total_rows(spec.geometry), 16)
    write_checkpoint(tmp_path / "ckpt", plans, files=5, config=config_of(doc))
    return spec, tmp_path / "ckpt", plans


def write(spec, ck, dest, **kw):
    kw.setdefault("chunk_bytes", CHUNK)
    return P.write_table(spec, ck, dest, quiet=True, **kw)


def run_main(tmp_path, doc, ck, dest, *extra) -> tuple[int, dict]:
    sp = tmp_path / "spec.json"
    sp.write_text(json.dumps(doc))
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = P.main(["--spec", str(sp), "--checkpoint", str(ck), "--dest", str(dest), "--quiet", *extra])
    return rc, json.loads(buf.getvalue().strip().splitlines()[-1])


class OpenSpy:
    """Records every path ple_write / bulkcopy open, to prove a file was not read."""

    def __init__(self, monkeypatch):
        self.paths: list[str] = []
        real = os.open

        def spy(path, flags, *a, **k):
            self.paths.append(os.path.realpath(path) if not isinstance(path, int) else str(path))
            return real(path, flags, *a, **k)
        monkeypatch.setattr(P.os, "open", spy)      # one os module: bulkcopy's open is the same

    def opened(self, path: Path) -> bool:
        return os.path.realpath(path) in self.paths


def test_every_byte_and_manifest(ckpt, tmp_path):
    spec, ck, plans = ckpt
    rows = total_rows(spec.geometry)
    assert rows == sum(t.rows for t in plans) == 2124
    out = write(spec, ck, tmp_path / "ple")
    assert out.status == "written", out
    f = Path(out.data["file"])
    # 2,124 rows padded to 2,176 (make_ngram_vocab_size_divisible_by), then to 64: the engine's name
    assert f.name == "ple_table_2176x160_float8_e4m3fn_348160B_rows0-2176.bin"
    data = f.read_bytes()
    assert data == expected_bytes(plans)
    assert data[133 * 160:136 * 160] == bytes(3 * 160)          # the gap after shard 0 stays zero
    assert data[136 * 160:137 * 160] == expected_row(plans[1].name, 0, 160)   # shard 1 at 1 x 136
    m = json.loads((tmp_path / "ple" / ple_spec.manifest_name(f.name)).read_text())
    assert (m["layout"]["shape"], m["row_bytes"], m["dtype"], m["bytes"]) == ([2176, 160], 160, "F8_E4M3", 348160)
    assert m["layout"]["shard_stride"] == 136 and m["layout"]["tag"] == "rows0-2176"
    spans = [(o, n) for o, n in m["spans"]]
    assert spans[0] == (0, 133 * 160) and spans[1] == (136 * 160, 133 * 160)
    stream = b"".join(data[o:o + n] for o, n in spans)
    sums = [__import__("hashlib").sha256(stream[i:i + CHUNK]).hexdigest() for i in range(0, len(stream), CHUNK)]
    assert m["checksum"] == {"scheme": "sha256", "chunk_bytes": CHUNK, "chunks": sums}
    assert [x["name"] for x in m["source"]["files"]] == sorted({p.name for p in ck.glob("*.safetensors")})
    assert m["recipe"] == {"name": "test", "digest": "0"}
    assert out.data["readback_rows"] >= 2 * 16
    assert sorted(os.listdir(tmp_path / "ple")) == sorted([f.name, ple_spec.manifest_name(f.name)])


def test_two_ranks_each_get_their_vocabulary_shard(tmp_path):
    doc = spec_doc(tp=2, ranks=[0, 1])
    spec = ple_spec.parse_spec(doc)
    plans = shard_plans(total_rows(spec.geometry), 16)
    write_checkpoint(tmp_path / "ck", plans, files=3, config=config_of(doc))
    out = write(spec, tmp_path / "ck", tmp_path / "ple")
    names = [Path(f).name for f in out.data["files"]]
    assert names == ["ple_table_1088x160_float8_e4m3fn_174080B_rows0-1088.bin",
                     "ple_table_1088x160_float8_e4m3fn_174080B_rows1088-2176.bin"]
    for rank, f in enumerate(out.data["files"]):
        assert Path(f).read_bytes() == expected_bytes(plans, spec, rank)
    assert write(spec, tmp_path / "ck", tmp_path / "ple").status == "kept"


def test_config_json_must_agree_with_the_recipe(ckpt, tmp_path):
    spec, ck, plans = ckpt
    write_checkpoint(tmp_path / "ck8", plans, files=5, config={"text_config": {"split_ngram_parts": 8}})
    rc, res = run_main(tmp_path, spec_doc(), tmp_path / "ck8", tmp_path / "ple")
    assert rc == 2
    assert "split_ngram_parts: config.json has 8, the recipe's ple.split_ngram_parts is 16" in res["error"]
    assert not (tmp_path / "ple").exists()


def test_ple_layer_ids_must_name_the_recipes_layer(ckpt, tmp_path):
    spec, ck, plans = ckpt
    cfg = config_of(spec_doc())
    cfg["text_config"]["ple_layer_ids"] = [2]          # 1-based: decoder layer 1, not the recipe's 2
    write_checkpoint(tmp_path / "ckl", plans, files=5, config=cfg)
    rc, res = run_main(tmp_path, spec_doc(), tmp_path / "ckl", tmp_path / "ple")
    assert rc == 2 and "ple_layer_ids: config.json has [2] (1-based)" in res["error"] and "needs 3" in res["error"]


def test_shards_that_would_overlap_are_refused(ckpt, tmp_path):
    spec, ck, plans = ckpt
    doc = spec_doc(split=32)                       # stride 68 < 133 rows
    write_checkpoint(tmp_path / "ck32", plans, files=5, config=config_of(doc))
    rc, res = run_main(tmp_path, doc, tmp_path / "ck32", tmp_path / "ple")
    assert rc == 2 and "shard 0" in res["error"] and "would overlap the next shard" in res["error"]


def test_restart_keeps_the_file_reading_only_a_sample(ckpt, tmp_path, monkeypatch):
    """A kept table is proven by re-hashing a random sample of its chunks within the byte budget
    (hostside/tableproof.py), never in full and never rewritten."""
    spec, ck, _ = ckpt
    dest = tmp_path / "ple"
    first = write(spec, ck, dest)
    f = Path(first.data["file"])
    st = f.stat()
    monkeypatch.setattr(tableproof, "SAMPLE_BYTES", 3 * CHUNK)
    hashed = []
    real = bulkcopy.hash_chunks
    monkeypatch.setattr(bulkcopy, "hash_chunks",
                        lambda fd, spans, cb, workers=None, only=None: hashed.append(only) or real(
                            fd, spans, cb, workers=workers, only=only))
    again = write(spec, ck, dest)
    assert again.status == "kept", again
    assert "matches its manifest" in again.reason and "proven: 3 of 42 chunks" in again.reason, again.reason
    assert again.data["decided_in_s"] < 2
    assert len(hashed) == 1 and len(hashed[0]) == 3
    st2 = f.stat()
    assert (st2.st_ino, st2.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)


def test_check_reports_without_writing_or_reading_the_table(ckpt, tmp_path, monkeypatch):
    spec, ck, plans = ckpt
    dest = tmp_path / "ple"
    assert P.check_table(spec, ck, dest)["up_to_date"] is False           # nothing written yet
    assert not dest.exists(), "--check creates nothing"
    f = Path(write(spec, ck, dest).data["file"])
    doc = P.check_table(spec, ck, dest)
    assert doc["up_to_date"] is True and doc["reason"].startswith("kept: ") and doc["file"] == str(f)
    assert "proven: 42 of 42 chunks" in doc["reason"], doc["reason"]     # the sample covers a small table
    info = ple_spec.Checkpoint(ck).tensor(plans[0].name)
    os.utime(info.file, ns=(info.file.stat().st_atime_ns, info.file.stat().st_mtime_ns + 10**9))
    doc = P.check_table(spec, ck, dest)
    assert doc["up_to_date"] is False and "the checkpoint changed" in doc["reason"]


def test_changed_checkpoint_rewrites_by_rename_without_reading_the_old_file(ckpt, tmp_path, monkeypatch):
    spec, ck, plans = ckpt
    dest = tmp_path / "ple"
    f = Path(write(spec, ck, dest).data["file"])
    old_ino = f.stat().st_ino
    # a new revision of the checkpoint: other bytes in shard 3's rows
    t = plans[3]
    info = ple_spec.Checkpoint(ck).tensor(t.name)
    with open(info.file, "r+b") as fh:
        fh.seek(info.offset)
        fh.write(b"\xAB" * 160)
    spy = OpenSpy(monkeypatch)
    out = write(spec, ck, dest)
    assert out.status == "rewritten" and "checkpoint changed" in out.reason, out
    assert spy.opened(info.file) and not spy.opened(f)   # sources read; the old table never opened
    assert f.stat().st_ino != old_ino              # a new file renamed over it
    start = 3 * 136 * 160                         # shard 3 at row 3 x stride
    data = f.read_bytes()
    assert data[start:start + 160] == b"\xAB" * 160
    assert data[:start] == expected_bytes(plans)[:start]


def test_stale_tables_and_temp_files_are_removed_after_the_new_one(ckpt, tmp_path):
    spec, ck, plans = ckpt
    dest = tmp_path / "ple"
    dest.mkdir()
    stale = dest / "ple_table_999x160_F8_E4M3_159840B.bin"
    stale.write_bytes(b"x" * 10)
    crashed = dest / ".ple_table_2124x160_F8_E4M3_339840B.bin.4242.tmp"
    crashed.write_bytes(b"y")
    unrelated = dest / "notes.txt"
    unrelated.write_text("keep me")
    out = write(spec, ck, dest)
    assert sorted(out.data["removed"]) == sorted([stale.name, crashed.name])
    assert not stale.exists() and not crashed.exists() and unrelated.exists()
    assert [p.name for p in dest.glob("ple_table_*.bin")] == [Path(out.data["file"]).name]


def test_other_geometry_replaces_the_table(ckpt, tmp_path):
    spec, ck, _ = ckpt
    dest = tmp_path / "ple"
    old = Path(write(spec, ck, dest).data["file"])
    # same shards regrouped: 8 shards over another checkpoint with another vocabulary
    doc2 = spec_doc(shards=8, vocab=(211, 223))
    spec2 = ple_spec.parse_spec(doc2)
    plans2 = shard_plans(total_rows(spec2.geometry), 8)
    write_checkpoint(tmp_path / "ck2", plans2, files=3, config=config_of(doc2))
    out = write(spec2, tmp_path / "ck2", dest)
    assert out.status == "written" and "no manifest" in out.reason
    assert sorted(out.data["removed"]) == sorted([old.name, ple_spec.manifest_name(old.name)]) and not old.exists()
    assert Path(out.data["file"]).read_bytes() == expected_bytes(plans2, spec2)


def test_verify_finds_a_corrupted_byte_and_rewrites(ckpt, tmp_path):
    spec, ck, plans = ckpt
    dest = tmp_path / "ple"
    f = Path(write(spec, ck, dest).data["file"])
    ok = write(spec, ck, dest, verify=True)
    assert ok.status == "kept" and "--verify: 42 of 42 chunks" in ok.reason, ok.reason
    st = f.stat()
    with open(f, "r+b") as fh:                    # the bytes change; size and mtime are put back
        fh.seek(20000)
        b = fh.read(1)
        fh.seek(20000)
        fh.write(bytes([b[0] ^ 0x40]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = write(spec, ck, dest, verify=True)
    assert out.status == "rewritten", out
    assert "corrupt table: " in out.reason and f"{f} chunk 2 (bytes " in out.reason, out.reason
    assert f.read_bytes() == expected_bytes(plans)


def test_a_restart_finds_a_flipped_byte_with_its_mtime_kept(ckpt, tmp_path):
    """ctime, which user space cannot set back, is in the stat stamp: the next run re-hashes the
    touched file in full and rewrites it (no --verify needed)."""
    spec, ck, plans = ckpt
    dest = tmp_path / "ple"
    f = Path(write(spec, ck, dest).data["file"])
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(30000)
        b = fh.read(1)
        fh.seek(30000)
        fh.write(bytes([b[0] ^ 0x01]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    doc = P.check_table(spec, ck, dest)
    assert doc["up_to_date"] is False and "corrupt table" in doc["reason"], doc
    assert not (dest / ple_spec.manifest_name(f.name)).exists(), "the manifest of a corrupt table is removed"
    out = write(spec, ck, dest)
    assert out.status == "rewritten" and f.read_bytes() == expected_bytes(plans)


def test_a_touched_but_intact_table_is_kept_and_its_stat_recorded(ckpt, tmp_path):
    spec, ck, _ = ckpt
    dest = tmp_path / "ple"
    f = Path(write(spec, ck, dest).data["file"])
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    out = write(spec, ck, dest)
    assert out.status == "kept" and "checked in full" in out.reason and "mtime" in out.reason, out.reason
    again = write(spec, ck, dest)
    assert again.status == "kept" and "checked in full" not in again.reason, again.reason


def test_silent_damage_is_found_by_the_sample(ckpt, tmp_path):
    """Damage the filesystem does not see (stat unchanged): stood in for by a manifest whose chunk
    hash no longer matches; the random sample, which covers this small table, finds it."""
    spec, ck, plans = ckpt
    dest = tmp_path / "ple"
    f = Path(write(spec, ck, dest).data["file"])
    mpath = dest / ple_spec.manifest_name(f.name)
    man = json.loads(mpath.read_text())
    man["checksum"]["chunks"][7] = "0" * 64
    mpath.write_text(json.dumps(man))
    out = write(spec, ck, dest)
    assert out.status == "rewritten" and f"{f} chunk 7 (bytes " in out.reason, out.reason
    assert f.read_bytes() == expected_bytes(plans)


@pytest.fixture
def small_fs(tmp_path):
    """small_fs(kib) -> a tmpfs of that size (ENOSPC on cue), unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts = []

    def mount(kib: int) -> Path:
        d = tmp_path / f"small{len(mounts)}"
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "dctl-ple-test", str(d)], check=True)
        mounts.append(d)
        return d
    yield mount
    for d in mounts:
        subprocess.run(["umount", str(d)], check=True)


def test_enospc_leaves_no_table_and_no_manifest(ckpt, small_fs):
    spec, ck, _ = ckpt
    small = small_fs(200)
    for prealloc in (True, False):            # refused at fallocate / mid-write without it
        dest = small / "ple"
        with pytest.raises(ple_spec.WriteFailed) as e:
            write(spec, ck, dest, prealloc=prealloc)
        assert "no space left" in str(e.value) and "348,160 bytes" in str(e.value)
        assert os.listdir(dest) == [], (prealloc, os.listdir(dest))


def test_old_table_removed_first_when_both_do_not_fit(ckpt, small_fs):
    spec, ck, plans = ckpt
    dest = small_fs(520) / "ple"
    f = Path(write(spec, ck, dest).data["file"])          # 348,160 bytes: two do not fit
    os.utime(next(ck.glob("*.safetensors")))              # a new checkpoint revision
    out = write(spec, ck, dest)
    assert out.status == "rewritten" and out.data["removed"] == [f.name], out
    assert f.read_bytes() == expected_bytes(plans)


def test_missing_shard_is_named(ckpt, tmp_path):
    spec, ck, plans = ckpt
    write_checkpoint(tmp_path / "ck15", plans[:5] + plans[6:], files=4, config=config_of(spec_doc()))
    rc, res = run_main(tmp_path, spec_doc(), tmp_path / "ck15", tmp_path / "ple")
    assert rc == 2 and res["status"] == "failed"
    assert "1 of 16 PLE shard tensors missing: shard 5" in res["error"]
    assert TENSOR.format(layer=2, shard=5) in res["error"]
    assert not (tmp_path / "ple").exists()


def test_wrong_width_is_named(ckpt, tmp_path):
    spec, ck, plans = ckpt
    bad = list(plans)
    bad[9] = TensorPlan(plans[9].name, "F8_E4M3", plans[9].rows, 128)
    write_checkpoint(tmp_path / "ckw", bad, files=5, config=config_of(spec_doc()))
    rc, res = run_main(tmp_path, spec_doc(), tmp_path / "ckw", tmp_path / "ple")
    assert rc == 2
    assert "shard 9" in res["error"] and "width 128" in res["error"] and "row_values is 160" in res["error"]


def test_row_total_mismatch_names_both_figures(ckpt, tmp_path):
    spec, ck, plans = ckpt
    short = list(plans)
    short[15] = TensorPlan(plans[15].name, "F8_E4M3", plans[15].rows - 3, 160)
    write_checkpoint(tmp_path / "cks", short, files=5, config=config_of(spec_doc()))
    rc, res = run_main(tmp_path, spec_doc(), tmp_path / "cks", tmp_path / "ple")
    assert rc == 2
    assert "hold 2,121 rows" in res["error"] and "geometry has 2,124 rows" in res["error"]


def test_readback_mismatch_fails_and_leaves_nothing(ckpt, tmp_path, monkeypatch):
    spec, ck, _ = ckpt
    real = bulkcopy.copy_range

    def off_by_one_row(src_fd, src_off, dst_fd, dst_off, length, chunk):
        real(src_fd, src_off + 160 if dst_off == 0 else src_off, dst_fd, dst_off, length, chunk)
    monkeypatch.setattr(bulkcopy, "copy_range", off_by_one_row)
    with pytest.raises(ple_spec.WriteFailed, match="read-back check: row 0"):
        write(spec, ck, tmp_path / "ple")
    assert os.listdir(tmp_path / "ple") == []


def test_one_writer_per_folder(ckpt, tmp_path):
    spec, ck, _ = ckpt
    dest = tmp_path / "ple"
    dest.mkdir()
    held = P._DirLock(dest)
    try:
        with pytest.raises(ple_spec.WriteFailed, match="another ple-write holds the lock"):
            write(spec, ck, dest)
    finally:
        held.close()


def test_spec_errors_name_the_key(tmp_path):
    with pytest.raises(InputError, match="shard_tensor.*needs \\{shard\\}"):
        ple_spec.parse_spec(spec_doc(shard_tensor="a.{layer}.weight"))
    with pytest.raises(InputError, match="ranks.*distinct ranks in 0..0"):
        ple_spec.parse_spec(spec_doc(ranks=[1]))
    with pytest.raises(InputError, match="engine_config.split_ngram_parts.*missing"):
        d = spec_doc()
        del d["engine_config"]["split_ngram_parts"]
        ple_spec.parse_spec(d)
    with pytest.raises(InputError, match="geometry.layers.*one layer"):
        d = spec_doc()
        d["geometry"]["layers"] = [1, 2]
        ple_spec.parse_spec(d)


def test_pinned_ram_verdict_is_pure_and_names_host_needed_available():
    spec = ple_spec.parse_spec(spec_doc(placement="pinned"))
    ok, msg = ple_spec.pinned_ram_verdict(70 * 10**9, spec, "rtx1")
    assert ok and "rtx1: 70.0 GB RAM available >= 64 GB" in msg
    ok, msg = ple_spec.pinned_ram_verdict(20 * 10**9, {"min_host_ram_gb": 64}, "rtx1")
    assert not ok
    assert "rtx1" in msg and "needs 64 GB" in msg and "has 20.0 GB available" in msg


def test_pinned_placement_writes_no_file_and_refuses_low_ram(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   10000000 kB\n")   # 10.24 GB
    spec = ple_spec.parse_spec(spec_doc(placement="pinned", min_host_ram_gb=8))
    out = P.write_table(spec, "", "", host="h1", meminfo=str(meminfo))
    assert out.status == "no-file" and "no file is written" in out.reason and "10.2 GB" in out.reason
    spec = ple_spec.parse_spec(spec_doc(placement="pinned", min_host_ram_gb=100000))
    with pytest.raises(ple_spec.WriteFailed, match="h1: refusing placement 'pinned'.*needs 100000 GB"):
        P.write_table(spec, "", "", host="h1", meminfo=str(meminfo))


def test_zipapp_runs_under_a_bare_python(ckpt, tmp_path):
    """What a host runs: the zipapp, the system python3 in isolated mode (no deployctl installed)."""
    spec, ck, plans = ckpt
    pyz = bundle.build(tmp_path / "bundle")
    (tmp_path / "spec.json").write_text(json.dumps(spec_doc()))
    py = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    argv = [py, "-I", str(pyz), "ple-write", "--spec", str(tmp_path / "spec.json"),
            "--checkpoint", str(ck), "--dest", str(tmp_path / "ple"), "--host", "n1"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["status"] == "written" and res["host"] == "n1"
    assert Path(res["file"]).read_bytes() == expected_bytes(plans)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert json.loads(p.stdout.strip().splitlines()[-1])["status"] == "kept"


def test_chunks_cut_across_segments():
    segs = [bulkcopy.Segment("a", 100, 0, 5), bulkcopy.Segment("a", 105, 5, 3), bulkcopy.Segment("b", 0, 8, 4)]
    merged = bulkcopy.merge_adjacent(segs)
    assert merged == [bulkcopy.Segment("a", 100, 0, 8), bulkcopy.Segment("b", 0, 8, 4)]
    chunks = list(bulkcopy.chunk_pieces(merged, 5))
    assert [[(p.src, p.src_off, p.dst_off, p.length) for p in c] for c in chunks] == [
        [("a", 100, 0, 5)], [("a", 105, 5, 3), ("b", 0, 8, 2)], [("b", 2, 10, 2)]]


def test_geometry_of_the_real_recipe():
    g = TableGeometry((2,), (2, 3), 8, (20_000_000, 20_000_000), 160)
    spec = ple_spec.parse_spec(spec_doc(vocab=(20_000_000, 20_000_000), shards=128))
    assert total_rows(g) == 320_001_446
    (t,) = spec.tables()
    assert t.file_name == "ple_table_320001536x160_float8_e4m3fn_51200245760B_rows0-320001536.bin"
    assert t.shard_stride == 2_500_012
