"""engram-stage: every byte of every rank's shard copies; hard links; idempotence; restage on change
(and over a folder of the old whole-layer format); the zipapp on a bare interpreter; the no-op on a
real-size checkpoint."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.recipe import load_recipe
from orchestrator.stages.stage_engram import engram_spec
from orchestrator.hostside import bulkcopy, bundle, tableproof
from orchestrator.hostside import engram_stage as op
from orchestrator.hostside import engram_checks as ec
from orchestrator.hostside import engram_spec as es
from orchestrator.hostside.geometry import layer_tables
from tests.engram_synth import RECIPE, WEIGHT, Synth, make_checkpoint



@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Synth:
    return Synth(tmp_path_factory.mktemp("engram"), [1, 14], [50, 60, 70], 8, 32, 1)


@pytest.fixture(scope="module")
def synth3(tmp_path_factory) -> Synth:
    """3 layers of 6 heads, 16-value rows with 2 scales: TP 4 and 8 leave ranks without heads."""
    return Synth(tmp_path_factory.mktemp("engram3"), [0, 3, 9], [100, 120], 3, 16, 2, seed=7)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_every_byte_every_rank(synth, synth3, tmp_path, tp):
    for s in (synth, synth3):
        for rank in range(tp):
            dest = tmp_path / f"{id(s)}-{rank}"
            res = op.stage(s.spec(tp, rank, chunk_bytes=4096), s.ckpt, dest)
            assert res["status"] == "ok" and res["mode"] == "copy", res
            s.check_dest(dest, tp, rank)


def test_no_scale_tensor(tmp_path):
    s = Synth(tmp_path, [2], [40], 4, 32, None)
    for rank in range(3):
        dest = tmp_path / f"d{rank}"
        assert op.stage(s.spec(3, rank), s.ckpt, dest)["status"] == "ok"
        s.check_dest(dest, 3, rank)


def test_copies_have_holes_and_take_only_the_staged_bytes(tmp_path):
    """A rank's copy of a shard: the shard's size, but disk blocks only for its header page and its
    rows' pages; the space check counts exactly those (allocated, not apparent, bytes)."""
    s = Synth(tmp_path, [1, 14], [20000, 20000, 20000], 8, 32, 1, seed=5)     # ~30 MB of rows
    dest = tmp_path / "d"
    res = op.stage(s.spec(8, 7), s.ckpt, dest)
    t = s.tensors[WEIGHT.format(layer=14)]
    copy = dest / t.file.name
    st = copy.stat()
    lo, hi = s.expected_range(14, 8, 7)
    fd = os.open(copy, os.O_RDONLY)
    try:
        hole_from = os.lseek(fd, 0, os.SEEK_HOLE)                     # the header page, then a hole
        assert hole_from <= -(-(8 + 4096) // 4096) * 4096 < t.offset + lo * 32
        assert os.lseek(fd, hole_from, os.SEEK_DATA) >= (t.offset + lo * 32) // 4096 * 4096
    finally:
        os.close(fd)
    assert st.st_size == t.file.stat().st_size and st.st_blocks * 512 < st.st_size // 4
    on_disk = sum((dest / n).stat().st_blocks * 512 for n in res["files"]) + 4096
    m = json.loads((dest / "engram-manifest.json").read_text())
    assert abs(m["allocated_bytes"] - on_disk) <= 4096 * len(res["files"]), (m["allocated_bytes"], on_disk)
    assert m["allocated_bytes"] < m["apparent_bytes"] // 4
    chk = op.check(s.spec(8, 7), s.ckpt, tmp_path / "new")
    assert chk["need_bytes"] == m["allocated_bytes"] and chk["apparent_bytes"] == m["apparent_bytes"]


def test_link_mode_links_every_shard_and_copies_nothing(synth, tmp_path):
    """engram.staging auto on a node whose checkpoint shares the filesystem: the shards are hard links
    (every row, the checkpoint's own bytes), the engine reads them the same way; a restage by copy
    replaces the links; verify checks the links."""
    dest = tmp_path / "d"
    spec = synth.spec(4, 1, staging="auto")
    assert spec.link
    res = op.stage(spec, synth.ckpt, dest)
    assert res["status"] == "ok" and res["mode"] == "link" and res["bytes_written"] == 0, res
    for name in res["files"]:
        a, b = (dest / name).stat(), (synth.ckpt / name).stat()
        assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    assert (dest / "model.safetensors.index.json").read_bytes() == \
        (synth.ckpt / "model.safetensors.index.json").read_bytes()
    m = json.loads((dest / "engram-manifest.json").read_text())
    assert m["mode"] == "link" and m["allocated_bytes"] == 4096 and all(f["sha256"] == [] for f in m["files"])
    chk = op.check(spec, synth.ckpt, tmp_path / "other")
    assert chk["mode"] == "link" and chk["need_bytes"] == 4096
    assert ec.check_rank(dest, spec.ranges())["rank"] == 1
    res = op.stage(spec, synth.ckpt, dest, verify=True)
    assert res["status"] == "skipped" and "every link is still the checkpoint's shard" in res["reason"]
    # the checkpoint's shard replaced (a resync writes a new file): no longer the same inode -> relinked
    shard = synth.tensors[WEIGHT.format(layer=1)].file
    tmp = shard.with_name(shard.name + ".new")
    tmp.write_bytes(shard.read_bytes())
    st = shard.stat()
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp, shard)
    res = op.stage(spec, synth.ckpt, dest)
    assert res["status"] == "ok" and "no longer a link" in res["reason"], res
    # engram.staging copy: the links are replaced by sparse copies (the checkpoint's files untouched)
    res = op.stage(synth.spec(4, 1), synth.ckpt, dest)
    assert res["status"] == "ok" and res["mode"] == "copy" and "link True -> False" in res["reason"], res
    synth.check_dest(dest, 4, 1)
    assert all((synth.ckpt / n).stat().st_nlink == 1 for n in res["files"])
    # a shared checkpoint (sync-model source shared) is never linked
    r = load_recipe(RECIPE, synth.sets(staging="auto") + ["model.source=shared", "model.shared_path=/mnt/m"]).recipe
    assert not engram_spec(r, 1).link


def test_a_linked_shard_written_since_is_refused_until_sync_model_has_hashed_it(tmp_path):
    """#59: a linked shard has no chunk hashes of its own; its proof is its stamp and sync-model's hash
    of it. The stager restamps sync-model's hash cache around its own link (the next manifest hashes
    nothing); a byte flipped in the staged shard with its mtime put back moves ctime: the stage refuses
    (exit 1, naming the file, the manifest kept: a restage would link the same bytes again), launch's
    check says not current, sync-model's next manifest re-hashes it; a shard replaced by the repair is
    relinked. A shard touched but intact stands again once sync-model has hashed it."""
    from orchestrator.hostside import modelsync as M
    s = Synth(tmp_path / "s", [1, 14], [50, 60, 70], 8, 32, 1, seed=3)
    cache, dest = str(tmp_path / "nvme" / "c.json"), tmp_path / "d"
    spec = s.spec(4, 2, staging="auto")

    def manifest() -> dict:
        return M.op_manifest({"root": str(s.ckpt), "cache": cache, "rehash": False, "require": [], "tensor": [],
                              "marker": ""})
    first = manifest()
    sha = {rel: h for rel, _, h in first["files"]}
    res = op.stage(spec, s.ckpt, dest, hash_cache=cache)
    assert res["status"] == "ok" and res["mode"] == "link", res
    m = json.loads((dest / "engram-manifest.json").read_text())
    assert all(fe["verified"] == sha[fe["name"]] for fe in m["files"])
    assert manifest()["hashed_bytes"] == 0, "the stager restamped the hash cache around its links"
    t = s.tensors[WEIGHT.format(layer=1)]
    lo, _ = s.expected_range(1, 4, 2)
    staged = dest / t.file.name
    st = staged.stat()
    with open(staged, "r+b") as fh:                     # one byte of rank 2's first row, the mtime put back
        off = t.offset + lo * 32
        byte = os.pread(fh.fileno(), 1, off)
        os.pwrite(fh.fileno(), bytes([byte[0] ^ 0xFF]), off)
    os.utime(staged, ns=(st.st_atime_ns, st.st_mtime_ns))
    chk = op.check(spec, s.ckpt, dest, hash_cache=cache)
    assert chk["up_to_date"] is False and str(staged) in chk["reason"] and "ctime changed" in chk["reason"], chk
    assert "sync-model" in chk["reason"]
    with pytest.raises(ec.LinkChanged, match=re.escape(str(staged))):
        op.stage(spec, s.ckpt, dest, hash_cache=cache)
    assert (dest / "engram-manifest.json").exists(), "kept: a restage would link the same bytes"
    again = manifest()                                  # sync-model sees the write too
    assert again["hashed_bytes"] == t.file.stat().st_size
    assert {r: h for r, _, h in again["files"]}[t.file.name] != sha[t.file.name]
    with pytest.raises(ec.LinkChanged, match="sync-model found other bytes"):
        op.stage(spec, s.ckpt, dest, hash_cache=cache)
    # the repair (sync-model writes a new file and renames it over the shard): relinked, served right
    good = bytearray(t.file.read_bytes())
    good[off] ^= 0xFF
    new = t.file.with_name(t.file.name + ".new")
    new.write_bytes(bytes(good))
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, t.file)
    assert manifest()["hashed_bytes"] == t.file.stat().st_size
    res = op.stage(spec, s.ckpt, dest, hash_cache=cache)
    assert res["status"] == "ok" and "no longer a link" in res["reason"], res
    assert hashlib.sha256(staged.read_bytes()).hexdigest() == sha[t.file.name]
    # touched but intact (chmod moves ctime): refused until sync-model has hashed it, then proven
    os.chmod(t.file, 0o600)
    assert op.check(spec, s.ckpt, dest, hash_cache=cache)["up_to_date"] is False
    assert manifest()["hashed_bytes"] == t.file.stat().st_size
    res = op.stage(spec, s.ckpt, dest, hash_cache=cache)
    assert res["status"] == "skipped" and "sync-model hashed it since: equal" in res["reason"], res
    assert op.stage(spec, s.ckpt, dest, hash_cache=cache)["status"] == "skipped"


def test_link_refused_falls_back_to_copy(synth, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(op.os, "link", refuse)
    dest = tmp_path / "d"
    res = op.stage(synth.spec(4, 2, staging="auto"), synth.ckpt, dest)
    assert res["status"] == "ok" and res["mode"] == "copy", res
    synth.check_dest(dest, 4, 2)


def test_skip_reads_only_a_bounded_sample_and_says_why(synth, tmp_path, monkeypatch):
    """A no-op re-hashes a random sample of the staged chunks within the spec's byte budget
    (hostside/tableproof.py), never the checkpoint's rows and never a copy."""
    dest = tmp_path / "d"
    spec = synth.spec(4, 2, chunk_bytes=4096, sample_bytes=3 * 4096)
    assert op.stage(spec, synth.ckpt, dest)["status"] == "ok"

    def boom(*a, **k):
        raise AssertionError("table data was copied or read from the checkpoint on a no-op")
    real, sampled = bulkcopy.hash_chunks, []

    def hash_some(fd, spans, cb, workers=None, only=None):
        assert only is not None, "every chunk hashed on a no-op"
        sampled.extend(only)
        return real(fd, spans, cb, workers=workers, only=only)
    monkeypatch.setattr(bulkcopy, "copy_segments", boom)
    monkeypatch.setattr(bulkcopy, "hash_chunks", hash_some)
    monkeypatch.setattr(ec, "read_checkpoint_row", boom)
    monkeypatch.setattr(ec.EngineView, "row", boom)
    t0 = time.monotonic()
    res = op.stage(spec, synth.ckpt, dest)
    assert time.monotonic() - t0 < 2
    assert res["status"] == "skipped"
    assert "already staged: rank 2 of 4, layout sparse, 4 shard copies" in res["reason"]
    assert len(sampled) == 3 and "proven: 3 of " in res["reason"], res["reason"]


def test_restage_on_changed_checkpoint_rank_and_index(synth, tmp_path):
    dest = tmp_path / "d"
    assert op.stage(synth.spec(4, 1), synth.ckpt, dest)["status"] == "ok"
    # another rank into the same folder: restaged, the old rows are gone
    res = op.stage(synth.spec(4, 3), synth.ckpt, dest)
    assert res["status"] == "ok" and "rank 1 -> 3" in res["reason"]
    synth.check_dest(dest, 4, 3)
    # the checkpoint changed (a shard rewritten: new mtime)
    shard = synth.tensors[WEIGHT.format(layer=14)].file
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        res = op.stage(synth.spec(4, 3), synth.ckpt, dest)
        assert res["status"] == "ok" and "checkpoint changed" in res["reason"] and shard.name in res["reason"]
        assert op.stage(synth.spec(4, 3), synth.ckpt, dest)["status"] == "skipped"
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert op.stage(synth.spec(4, 3), synth.ckpt, dest)["status"] == "ok"      # the old mtime is a change too
    # the index changed (the copy in DEST must be the checkpoint's): restaged
    index = synth.ckpt / "model.safetensors.index.json"
    old = index.read_bytes()
    index.write_bytes(old.replace(b'"metadata"', b'"metadata" ', 1))
    try:
        res = op.stage(synth.spec(4, 3), synth.ckpt, dest)
        assert res["status"] == "ok" and "model.safetensors.index.json" in res["reason"], res
        assert (dest / "model.safetensors.index.json").read_bytes() == index.read_bytes()
    finally:
        index.write_bytes(old)
    assert op.stage(synth.spec(4, 3), synth.ckpt, dest)["status"] == "ok"      # and back
    # the index in DEST damaged: restaged
    (dest / "model.safetensors.index.json").write_text("{}")
    res = op.stage(synth.spec(4, 3), synth.ckpt, dest)
    assert res["status"] == "ok" and "differs from the checkpoint's" in res["reason"], res
    synth.check_dest(dest, 4, 3)


def test_restage_over_the_old_whole_layer_format(synth, tmp_path):
    """A folder staged by manifest version 1 (engram-L{L}.weight.bin / .scale.bin, no header, no index:
    nothing the engine reads): restaged, the old files removed, their space counted as reclaimable."""
    dest = tmp_path / "d"
    dest.mkdir()
    for name in ("engram-L1.weight.bin", "engram-L1.scale.bin", "engram-L14.weight.bin", "engram-L14.scale.bin"):
        with open(dest / name, "wb") as f:
            f.write(b"\1" * 8192)
    (dest / "engram-local.json").write_text(json.dumps({"layers": es.local_ranges(synth.spec(4, 0))}))
    (dest / "engram-manifest.json").write_text(json.dumps({"format": es.MANIFEST_FORMAT, "version": 1,
                                                          "complete": True}))
    chk = op.check(synth.spec(4, 0), synth.ckpt, dest)
    assert not chk["up_to_date"] and chk["reclaimable_bytes"] >= 4 * 8192
    res = op.stage(synth.spec(4, 0), synth.ckpt, dest)
    assert res["status"] == "ok" and "another version" in res["reason"]
    synth.check_dest(dest, 4, 0)


def test_packed_layout_is_refused_with_the_reason(synth):
    with pytest.raises(Exception, match="packed"):
        load_recipe(RECIPE, synth.sets() + ["engram.layout=packed"])
    with pytest.raises(op.InputError, match="'packed' was removed, no engine reads it"):
        es.Spec.from_json({**synth.spec(4, 0).to_json(), "layout": "packed"})


def test_cli_stage_json_and_text(synth, tmp_path):
    dest = tmp_path / "d"
    args = ["engram", "stage", "--recipe", RECIPE, *[x for s in synth.sets() for x in ("--set", s)],
            "--checkpoint", str(synth.ckpt), "--dest", str(dest), "--rank", "1"]
    r = CliRunner().invoke(cli, args + ["--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["status"] == "ok" and doc["ranges"] == {"1": list(synth.expected_range(1, 4, 1)),
                                                       "14": list(synth.expected_range(14, 4, 1))}
    synth.check_dest(dest, 4, 1)
    r = CliRunner().invoke(cli, args + ["--verify"])
    assert r.exit_code == 0 and r.output.startswith("skipped: already staged"), r.output
    r = CliRunner().invoke(cli, args[:-1] + ["4"])
    assert r.exit_code == 2 and "--rank 4 is outside 0..3" in r.output


def test_zipapp_on_a_bare_interpreter(synth, tmp_path):
    """The host-side path: the shipped zipapp, `python3 -I -S` (no site-packages: stdlib only)."""
    pyz = bundle.build(tmp_path)
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(synth.spec(2, 0).to_json()))
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
    synth.check_dest(dest, 2, 1)
    p = subprocess.run(argv + ["--rank", "1", "--verify"], capture_output=True, text=True, timeout=60)
    res = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 0 and res["status"] == "skipped" and res["verified"], p.stdout
    p = subprocess.run(argv + ["--rank", "1", "--check-rank"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout.splitlines()[-1])["status"] == "rank-ok"


def test_noop_on_real_size_checkpoint_is_fast(tmp_path):
    """The real geometry (768M rows, 202 GB of Engram tensors, holes on disk): a re-stage with nothing
    to do answers in seconds, process start included: it reads headers and re-hashes a sample of
    at most tableproof.SAMPLE_BYTES (2 GiB) of the staged rows."""
    r = load_recipe(RECIPE).recipe
    g = r.engram.geometry
    sizes = {t.layer: [s.rows for s in t.subtables] for t in layer_tables(g)}
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, list(g.layers), list(g.vocab_per_order), g.heads_per_order, g.row_values, 8,
                    data="holes", sizes=sizes)
    spec = engram_spec(r, 2)
    dest = tmp_path / "nvme"
    dest.mkdir()
    sources = es.resolve_sources(spec, ckpt)
    mode, _ = op.staging_mode(spec, sources, dest)
    files = es.out_files(spec, sources, mode)
    assert mode == "link"               # the recipe's default on a node's own checkpoint, same filesystem
    files = es.out_files(spec, sources, "copy")
    spec = es.Spec.from_json({**spec.to_json(), "link": False})
    for f in files:                     # a staged folder as a real copy leaves it (data: holes)
        with open(dest / f.name, "wb") as fh:
            fh.truncate(f.size)
    (dest / "model.safetensors.index.json").write_bytes(sources.index)
    cb = spec.chunk_bytes

    zeros: dict[int, str] = {}

    def zero_chunks(f) -> list[str]:      # the rows are holes: every chunk reads as zeros
        lens = [min(cb, f.length - i * cb) for i in range(f.chunk_count(cb))]
        return [zeros.get(n) or zeros.setdefault(n, hashlib.sha256(bytes(n)).hexdigest()) for n in lens]

    def header_sha(f) -> str:
        with open(dest / f.name, "rb") as fh:
            return hashlib.sha256(fh.read(f.header_bytes)).hexdigest()
    for f in files:
        with open(ckpt / f.name, "rb") as src, open(dest / f.name, "r+b") as fh:
            fh.write(src.read(f.header_bytes))
    mfiles = [{**op._manifest_file(f, zero_chunks(f), cb, header_sha(f)), "stat": tableproof.stamp(dest / f.name)}
              for f in files]
    (dest / "engram-local.json").write_text(json.dumps({"layers": es.local_ranges(spec)}))
    (dest / "engram-manifest.json").write_text(json.dumps(op._manifest(spec, sources, files, mfiles, 0.0)))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", "engram", "stage", "-r", RECIPE, "--rank", "2",
                        "--set", "engram.staging=copy",
                        "--checkpoint", str(ckpt), "--dest", str(dest), "--json"],
                       capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["status"] == "skipped" and doc["reason"].startswith("already staged: rank 2 of 4"), doc
    # 32 chunks of 64 MiB from a random start: one of them may be a file's shorter last chunk
    m = re.search(r"proven: 32 of 758 chunks \((\d+\.\d+) GB\)", doc["reason"])
    assert m and 1.9 <= float(m.group(1)) <= 2.15, doc["reason"]
    print(f"no-op with a 2 GiB sample on the real geometry: {took:.2f} s")
    assert took < 6.0, took          # a sanity bound (a full re-hash takes minutes); bench/ measures
