"""#14: a staged table is proven before it is served (hostside/tableproof.py). On the Engram op: a byte
flipped in a staged row (mtime kept or not) is found by the next run's check and restage; damage the
filesystem does not see is found by the random sample; a touched but intact file is kept and its
stat recorded. The PLE op's cases are in tests/test_ple_write.py; the cluster replay in
tests/test_hardening_cluster.py."""
from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from orchestrator.hostside import engram_stage as op
from orchestrator.hostside import tableproof
from orchestrator.hostside.engram_spec import MANIFEST_NAME
from tests.engram_synth import Synth


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Synth:
    return Synth(tmp_path_factory.mktemp("engram"), [1, 14], [50, 60, 70], 8, 32, 1)


def _staged(synth: Synth, dest: Path):
    spec = synth.spec(4, 1, chunk_bytes=4096)
    res = op.stage(spec, synth.ckpt, dest)
    assert res["status"] == "ok", res
    return spec, json.loads((dest / MANIFEST_NAME).read_text())


def _flip_in_rows(dest: Path, manifest: dict, keep_mtime: bool) -> tuple[str, int]:
    """Flip one byte in the middle of the first file's staged rows."""
    fe = next(f for f in manifest["files"] if any(p["length"] for p in f["pieces"]))
    piece = max(fe["pieces"], key=lambda p: p["length"])
    at = piece["offset"] + piece["length"] // 2
    path = dest / fe["name"]
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return fe["name"], at


@pytest.mark.parametrize("keep_mtime", [True, False])
def test_a_flipped_staged_byte_is_found_and_restaged(synth, tmp_path, keep_mtime):
    dest = tmp_path / "d"
    spec, manifest = _staged(synth, dest)
    name, _ = _flip_in_rows(dest, manifest, keep_mtime)
    chk = op.check(spec, synth.ckpt, dest)             # what `up` asks first, over SSH
    assert chk["up_to_date"] is False and "corrupt staged data" in chk["reason"] and name in chk["reason"], chk
    assert not (dest / MANIFEST_NAME).exists(), "a proven-corrupt folder loses its manifest"
    res = op.stage(spec, synth.ckpt, dest)
    assert res["status"] == "ok", res
    synth.check_dest(dest, 4, 1)


def test_the_stage_itself_restages_what_its_check_would_refuse(synth, tmp_path):
    dest = tmp_path / "d"
    spec, manifest = _staged(synth, dest)
    name, _ = _flip_in_rows(dest, manifest, keep_mtime=True)
    res = op.stage(spec, synth.ckpt, dest)
    assert res["status"] == "ok" and "corrupt staged data" in res["reason"] and name in res["reason"], res
    synth.check_dest(dest, 4, 1)


def test_silent_damage_is_found_by_the_sample(synth, tmp_path):
    """The stat stamp unchanged (damage below the filesystem), stood in for by a manifest chunk hash
    that no longer matches: the sample window, which covers this small folder, finds it."""
    dest = tmp_path / "d"
    spec, manifest = _staged(synth, dest)
    fe = next(f for f in manifest["files"] if f["sha256"])
    fe["sha256"][0] = "0" * 64
    (dest / MANIFEST_NAME).write_text(json.dumps(manifest))
    res = op.stage(spec, synth.ckpt, dest)
    assert res["status"] == "ok" and f"{fe['name']} chunk 0 (bytes " in res["reason"], res


def test_a_touched_intact_file_is_kept_and_its_stat_recorded(synth, tmp_path):
    dest = tmp_path / "d"
    spec, manifest = _staged(synth, dest)
    fe = manifest["files"][0]
    p = dest / fe["name"]
    os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    res = op.stage(spec, synth.ckpt, dest)
    assert res["status"] == "skipped" and "checked in full" in res["reason"] and "mtime" in res["reason"], res
    m2 = json.loads((dest / MANIFEST_NAME).read_text())
    assert m2["content_digest"] == manifest["content_digest"], "a new stat is not new content"
    assert next(f for f in m2["files"] if f["name"] == fe["name"])["stat"] == tableproof.stamp(p)
    again = op.stage(spec, synth.ckpt, dest)
    assert again["status"] == "skipped" and "checked in full" not in again["reason"], again


def test_the_sample_is_bounded_and_uniform(tmp_path):
    """k = budget / chunk size chunks, drawn without replacement across files (no state file: random)."""
    files = []
    for n in range(3):
        p = tmp_path / f"f{n}"
        data = random.Random(n).randbytes(10 * 4096)
        p.write_bytes(data)
        sums = tuple(hashlib.sha256(data[i:i + 4096]).hexdigest() for i in range(0, len(data), 4096))
        files.append(tableproof.TableFile(str(p), ((0, len(data)),), 4096, sums, tableproof.stamp(p)))
    proof = tableproof.prove(files, sample_bytes=5 * 4096, rng=random.Random(1))
    assert proof.ok and proof.chunks == 5 and proof.total_chunks == 30 and proof.bytes == 5 * 4096
    assert tableproof.prove(files, sample_bytes=0).chunks == 1, "at least one chunk"
    assert tableproof.prove(files, full_check=True).chunks == 30


def test_the_window_covers_every_chunk_within_its_runs(tmp_path):
    """With the state file, runs re-hash consecutive windows: all N chunks within ceil(N / k) runs,
    so damage the stat cannot see is found within that many runs for certain."""
    import hashlib
    p = tmp_path / "t"
    data = random.Random(3).randbytes(23 * 4096)
    p.write_bytes(data)
    sums = [hashlib.sha256(data[i:i + 4096]).hexdigest() for i in range(0, len(data), 4096)]
    sums[17] = "0" * 64                                   # one chunk the stat cannot see is damaged
    f = tableproof.TableFile(str(p), ((0, len(data)),), 4096, tuple(sums), tableproof.stamp(p))
    state = tmp_path / tableproof.STATE_NAME
    runs = tableproof.runs_to_cover(23, 5 * 4096, 4096)
    assert runs == 5
    seen, found = set(), None
    for run in range(runs):
        proof = tableproof.prove([f], sample_bytes=5 * 4096, state=state)
        assert proof.chunks == 5
        if not proof.ok and found is None:
            found = run
            assert proof.bad == [f"{p} chunk 17 (bytes {17 * 4096}..{18 * 4096})"]
        seen |= {int(b.split(" chunk ")[1].split()[0]) for b in proof.bad}
    assert found is not None and found < runs
    state_doc = json.loads(state.read_text())
    assert state_doc["chunks"] == 23
