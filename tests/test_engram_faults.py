"""engram-stage under faults: no space (tmpfs), a killed run, corruption, a wrong rank, a broken checkpoint."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.errors import InputError, StageFailed
from orchestrator.hostside import engram_stage as op
from orchestrator.hostside import engram_checks as ec
from orchestrator.hostside import engram_spec as es
from tests.engram_synth import RECIPE, SCALE, WEIGHT, Synth

MANIFEST, LOCAL = "engram-manifest.json", "engram-local.json"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Synth:
    return Synth(tmp_path_factory.mktemp("small"), [1, 14], [50, 60, 70], 8, 32, 1)


@pytest.fixture(scope="module")
def mid(tmp_path_factory) -> Synth:
    """~6.5 MB of Engram rows: more than a 2 MB tmpfs holds, 1/8 of it less."""
    return Synth(tmp_path_factory.mktemp("mid"), [1, 14], [4000, 4000, 4000], 8, 32, 1)


@pytest.fixture
def tiny_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "nvme"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def cli_args(s: Synth, ckpt: Path, dest: Path, rank: int, *extra: str) -> list[str]:
    return ["engram", "stage", "--recipe", RECIPE, *[x for v in s.sets() for x in ("--set", v)],
            "--checkpoint", str(ckpt), "--dest", str(dest), "--rank", str(rank), *extra]


def test_space_checked_before_writing(mid, tiny_fs):
    dest = tiny_fs / "engram"
    with pytest.raises(StageFailed, match=r"not enough free space on .*/nvme/engram: need 0\.006[0-9]+ GB \+ "
                                          r"margin 0\.0 GB, free 0\.00[0-9]+ GB"):
        op.stage(mid.spec(1, 0), mid.ckpt, dest)
    assert [p for p in os.listdir(dest) if not p.startswith(".engram-stage.lock")] == []


def test_enospc_mid_write_leaves_no_manifest(mid, tiny_fs, monkeypatch):
    dest = tiny_fs / "engram"
    assert op.stage(mid.spec(8, 0), mid.ckpt, dest)["status"] == "ok"        # a good staging, 0.8 MB
    assert (dest / MANIFEST).exists()
    monkeypatch.setattr(op, "free_bytes", lambda p: 1 << 40)                   # a filesystem that lies
    with pytest.raises(StageFailed, match="no space left on .*nothing was staged"):
        op.stage(mid.spec(1, 0), mid.ckpt, dest)                               # 6.5 MB into 2 MB
    left = os.listdir(dest)
    assert MANIFEST not in left and LOCAL not in left
    assert not [p for p in left if p.endswith(".tmp")]
    monkeypatch.undo()
    assert op.stage(mid.spec(8, 0), mid.ckpt, dest)["status"] == "ok"        # and it recovers
    mid.check_dest(dest, 8, 0)


def test_killed_run_then_rerun_completes(tmp_path):
    s = Synth(tmp_path, [1, 14], [300000, 300000, 300000], 8, 32, 1, seed=3)     # ~475 MB of rows
    dest = tmp_path / "d"
    assert op.stage(s.spec(4, 0), s.ckpt, dest)["status"] == "ok"
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(s.spec(1, 0).to_json()))
    argv = [sys.executable, "-m", "orchestrator.hostside", "engram-stage", "--spec", str(spec_file),
            "--checkpoint", str(s.ckpt), "--dest", str(dest), "--threads", "1"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while not any(n.endswith(".safetensors.tmp") for n in os.listdir(dest)):   # the shard copies begun
        assert p.poll() is None and time.monotonic() - t0 < 30, "the run ended before writing"
        time.sleep(0.002)
    time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    left = os.listdir(dest)
    assert MANIFEST not in left and LOCAL not in left               # removed before any data was touched
    assert any(n.endswith(".tmp") for n in left)                    # it really died mid-way
    p = subprocess.run(argv + ["--verify"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.splitlines()[-1])
    assert res["status"] == "ok" and res["verified"] and res["fidelity_rows"] > 30
    assert not [n for n in os.listdir(dest) if n.endswith(".tmp")]
    m = json.loads((dest / MANIFEST).read_text())
    assert (m["tp"], m["rank"]) == (1, 0)


def test_corrupt_byte_caught_by_verify(small, tmp_path):
    dest = tmp_path / "d"
    spec = small.spec(4, 2, chunk_bytes=4096)
    assert op.stage(spec, small.ckpt, dest)["status"] == "ok"
    lo, hi = small.expected_range(14, 4, 2)
    t = small.tensors[WEIGHT.format(layer=14)]                   # its shard holds only this Engram tensor
    name, start = t.file.name, t.offset + lo * 32
    pos = start + 1000 * 32 + 5
    with open(dest / name, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
    entry = next(f for f in json.loads((dest / MANIFEST).read_text())["files"] if f["name"] == name)
    chunk = (pos - start) // entry["chunk_bytes"]
    assert chunk > 0
    lo_b = start + chunk * entry["chunk_bytes"]
    with pytest.raises(StageFailed, match=rf"{name} chunk {chunk} \(bytes {lo_b}\.\.{lo_b + 4096}\)"):
        op.stage(spec, small.ckpt, dest, verify=True)
    assert not (dest / MANIFEST).exists()                        # nothing claims the data is good now
    assert op.stage(spec, small.ckpt, dest)["status"] == "ok"    # the next run restages
    small.check_dest(dest, 4, 2)


def test_damaged_header_caught_by_verify_and_fidelity(small, tmp_path):
    """The copy's safetensors header is what the engine parses for every offset: a changed byte in it
    fails --verify (header digest), and a copy without its header fails the engine's-way read back."""
    dest = tmp_path / "d"
    spec = small.spec(4, 1)
    assert op.stage(spec, small.ckpt, dest)["status"] == "ok"
    name = small.tensors[SCALE.format(layer=1)].file.name
    with open(dest / name, "r+b") as f:
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(b"x" if b != b"x" else b"y")
    with pytest.raises(StageFailed, match=rf"{name} header"):
        op.stage(spec, small.ckpt, dest, verify=True)
    assert op.stage(spec, small.ckpt, dest)["status"] == "ok"
    # without the header (the rows where they belong, the first bytes zero): the engine cannot read it
    with open(dest / name, "r+b") as f:
        f.write(bytes(8))
    with pytest.raises(es.VerifyFailed, match="the engine's reader cannot find"):
        ec.fidelity_check(spec, es.resolve_sources(spec, small.ckpt), dest)


def test_verify_through_the_cli_names_file_and_chunk(small, tmp_path):
    dest = tmp_path / "d"
    r = CliRunner().invoke(cli, cli_args(small, small.ckpt, dest, 1))
    assert r.exit_code == 0, r.output
    lo, _ = small.expected_range(1, 4, 1)
    t = small.tensors[SCALE.format(layer=1)]
    with open(dest / t.file.name, "r+b") as f:
        f.seek(t.offset + lo + 3)
        f.write(b"\xee" if f.read(1) != b"\xee" else b"\x11")
    r = CliRunner().invoke(cli, cli_args(small, small.ckpt, dest, 1, "--verify"))
    assert r.exit_code == 1
    assert f"{t.file.name} chunk 0" in r.output and "sha256 differs" in r.output


def test_wrong_rank_refused(small, tmp_path):
    dest = tmp_path / "d"
    op.stage(small.spec(4, 1), small.ckpt, dest)
    m = ec.check_rank(dest, small.spec(4, 1).ranges())
    assert m["rank"] == 1
    assert ec.check_rank(dest, {1: small.expected_range(1, 4, 1), 14: small.expected_range(14, 4, 1)})
    lo, hi = small.expected_range(1, 4, 2)
    with pytest.raises(es.RankMismatch, match=rf"layer 1 holds rows \[\d+, \d+\] \(staged for rank 1 of 4\) "
                                              rf"but this host's rank owns rows \[{lo}, {hi}\]"):
        ec.check_rank(dest, small.spec(4, 2).ranges())
    # the launch stage reads the two files over SSH: same check through a reader function
    files = {str(dest / n): (dest / n).read_text() for n in (MANIFEST, LOCAL)}
    with pytest.raises(es.RankMismatch):
        ec.check_rank(str(dest), small.spec(4, 0).ranges(), read_text=files.get)
    with pytest.raises(es.RankMismatch, match="no complete Engram staging"):
        ec.check_rank(tmp_path / "empty", small.spec(4, 0).ranges())
    r = CliRunner().invoke(cli, ["engram", "check-rank", "--recipe", RECIPE,
                                 *[x for v in small.sets() for x in ("--set", v)],
                                 "--dest", str(dest), "--rank", "3"])
    assert r.exit_code == 1 and "restage this host" in r.output


@pytest.mark.parametrize("fault", ["missing", "truncated"])
def test_broken_checkpoint_named_exit_2(small, tmp_path, fault):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(small.ckpt, ckpt)
    dest = tmp_path / "d"
    assert CliRunner().invoke(cli, cli_args(small, ckpt, dest, 0)).exit_code == 0
    shard = ckpt / small.tensors[WEIGHT.format(layer=14)].file.name
    if fault == "missing":
        shard.unlink()
    else:
        os.truncate(shard, shard.stat().st_size - 100)
    r = CliRunner().invoke(cli, cli_args(small, ckpt, dest, 0))
    assert r.exit_code == 2, r.output
    assert shard.name in r.output and ("missing" in r.output or "truncated" in r.output)
    assert (dest / MANIFEST).exists()               # bad input: the good staging is left alone
    # the host-side entry point says the same, as JSON naming the file
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(small.spec(4, 0).to_json()))
    p = subprocess.run([sys.executable, "-m", "orchestrator.hostside", "engram-stage", "--spec", str(spec_file),
                        "--checkpoint", str(ckpt), "--dest", str(dest)], capture_output=True, text=True)
    assert p.returncode == 2
    res = json.loads(p.stdout.splitlines()[-1])
    assert res["status"] == "failed" and res["file"] == str(shard)


def test_geometry_mismatch_is_input_error(small, tmp_path):
    spec = es.Spec.from_json({**small.spec(4, 0).to_json(),
                              "geometry": {**small.spec(4, 0).to_json()["geometry"], "vocab_per_order": [50, 60, 200]}})
    with pytest.raises(InputError, match="check engram.geometry"):
        op.stage(spec, small.ckpt, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_second_stager_on_the_same_folder_is_refused(small, tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    fd = os.open(dest / ".engram-stage.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(StageFailed, match="another engram-stage is running"):
            op.stage(small.spec(4, 0), small.ckpt, dest)
    finally:
        os.close(fd)
