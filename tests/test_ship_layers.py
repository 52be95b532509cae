"""ship without the cluster: chains, v1 folder identification, the tar router, the relay, the agent.

The agent runs here for real (python3 -c, as on the head) with local commands for `docker save`
and for each worker's `ssh ... docker load`.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from orchestrator.hostside import ship_agent as agent, ship_relay as relay
from orchestrator.hostside.image_layers import (END_OF_ARCHIVE, SaveFilter, chain_ids, identify_folder, layers_to_send,
                                      present_chains, v1_candidates)
from orchestrator.ship.transfer import Timeouts, agent_program, explain, history_layer_sizes

HERE = Path(__file__).resolve().parent
RELAY = (HERE.parent / "orchestrator" / "hostside" / "ship_relay.py").read_text()

# Recorded from `docker save` of a 4-layer image on Docker 20.10.24 (legacy builder); the top
# layer's config has HTML-escaped and non-ASCII text on purpose.
DIFF_IDS = [
    "sha256:8f3760ed9673c1d49bcea2f20b9dae702a88837faa2d900ee2a09a5f568a0ee5",
    "sha256:b998e3940be3cfb3af3ac0b895d637cc9e8f44eab594a4941ac2ef500658b553",
    "sha256:1f7b92a840697ca1b4f55fe95e21b2c35800fbed09df6403693b02aab00ae5b6",
    "sha256:1cba2006f0ec50f3a83839e9c6bd382340dd38f138898cba102f767336ef46c5"
]
FOLDERS = [
    "0a3e7d1e5c56e06d1567515524422e8f556cc6ede5ae26217ff268bf3c5eae46",
    "298f0e8d639f5e9ff1c96a75a6c0bd61d7dbc1e5982cfa9ce42d405dddcda4f9",
    "4f0346e6fa6f93fdf88c682ab24d1cd9afd147a181a6b4bc37808fc98bb670cc",
    "ad9a17ab8f2724a5cc78ef763631e8bab14a94e2fca40c8e09d17c6f4ef292db"
]
LOWER_JSON = b'{"id":"298f0e8d639f5e9ff1c96a75a6c0bd61d7dbc1e5982cfa9ce42d405dddcda4f9","parent":"0a3e7d1e5c56e06d1567515524422e8f556cc6ede5ae26217ff268bf3c5eae46","created":"1970-01-01T00:00:00Z","container_config":{"Hostname":"","Domainname":"","User":"","AttachStdin":false,"AttachStdout":false,"AttachStderr":false,"Tty":false,"OpenStdin":false,"StdinOnce":false,"Env":null,"Cmd":null,"Image":"","Volumes":null,"WorkingDir":"","Entrypoint":null,"OnBuild":null,"Labels":null},"os":"linux"}'
TOP_JSON = b'{"id":"ad9a17ab8f2724a5cc78ef763631e8bab14a94e2fca40c8e09d17c6f4ef292db","parent":"4f0346e6fa6f93fdf88c682ab24d1cd9afd147a181a6b4bc37808fc98bb670cc","created":"2026-11-29T22:57:19.964382266Z","container":"7ec260a9e7d781c90730b8f32a750eced8a415a5f707af5f084991b19ef79093","container_config":{"Hostname":"7ec260a9e7d7","Domainname":"","User":"","AttachStdin":false,"AttachStdout":false,"AttachStderr":false,"Tty":false,"OpenStdin":false,"StdinOnce":false,"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","FOO=a\\u003cb\\u003e\\u0026c","BAR=\xc3\xbcn\xc3\xaf"],"Cmd":["/bin/sh","-c","#(nop) ","CMD [\\"/bin/sh\\"]"],"Image":"sha256:1c7d3b54d35ec3fc5befa16ad0226717064002b40ce1ca54dc35f986284fda29","Volumes":null,"WorkingDir":"","Entrypoint":null,"OnBuild":null,"Labels":{"x":"y"}},"docker_version":"20.10.24+dfsg1","config":{"Hostname":"","Domainname":"","User":"","AttachStdin":false,"AttachStdout":false,"AttachStderr":false,"Tty":false,"OpenStdin":false,"StdinOnce":false,"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","FOO=a\\u003cb\\u003e\\u0026c","BAR=\xc3\xbcn\xc3\xaf"],"Cmd":["/bin/sh"],"Image":"sha256:1c7d3b54d35ec3fc5befa16ad0226717064002b40ce1ca54dc35f986284fda29","Volumes":null,"WorkingDir":"","Entrypoint":null,"OnBuild":null,"Labels":{"x":"y"}},"architecture":"amd64","os":"linux"}'


def test_chain_ids():
    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    assert chain_ids([a, b]) == [a, "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()]
    assert present_chains([[a, b], [b]]) == {a, chain_ids([a, b])[1], b}


def test_layers_to_send():
    d = DIFF_IDS
    assert layers_to_send(d, set()) == [0, 1, 2, 3]
    assert layers_to_send(d, set(chain_ids(d)[:3])) == [3]
    assert layers_to_send(d, set(chain_ids(d))) == []
    # a diff_id in a later folder is a symlink to its first folder: that one travels too
    dup = [d[0], d[1], d[1]]
    assert layers_to_send(dup, set(chain_ids(dup)[:2])) == [1, 2]
    # the same diff_id under another parent is another chain: it does not count as present
    assert layers_to_send(d, {d[1]}) == [0, 1, 2, 3]


def test_identify_folders_recorded_from_docker_20_10():
    chains = chain_ids(DIFF_IDS)
    assert identify_folder(FOLDERS[1], LOWER_JSON, chains) == 1
    assert identify_folder(FOLDERS[3], TOP_JSON, chains) == 3
    assert identify_folder(FOLDERS[2], LOWER_JSON, chains) is None     # wrong json: no guess
    assert identify_folder(FOLDERS[1], b"not json", chains) is None


def _member(tf: tarfile.TarFile, name: str, data: bytes | None = None, link: str | None = None) -> None:
    ti = tarfile.TarInfo(name)
    if data is None and link is None:
        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        tf.addfile(ti)
    elif link is not None:
        ti.type, ti.linkname = tarfile.SYMTYPE, link
        tf.addfile(ti)
    else:
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))


def fake_save(diff_ids: list[str], sizes: list[int], image_id: str = "sha256:" + "c" * 64,
              symlink_dups: bool = True) -> tuple[bytes, list[str]]:
    """A docker-save-like archive whose folder names follow moby's v1 ID rule (lexical order)."""
    chains = chain_ids(diff_ids)
    folders, jsons, parent = [], [], None
    for i in range(len(diff_ids)):
        doc = {"id": "", "created": "1970-01-01T00:00:00Z", "os": "linux"}
        if parent:
            doc["parent"] = parent
        raw = json.dumps(doc, separators=(",", ":")).encode()
        v1 = next(v for j, v in v1_candidates(raw, chains) if j == i)   # the lower-layer variant comes first
        doc["id"] = v1
        folders.append(v1)
        jsons.append(json.dumps(doc, separators=(",", ":")).encode())
        parent = v1
    entries = []
    first: dict[str, str] = {}
    for i, (f, js) in enumerate(zip(folders, jsons)):
        entries += [(f + "/", None, None), (f + "/VERSION", b"1.0", None), (f + "/json", js, None)]
        if symlink_dups and diff_ids[i] in first:
            entries.append((f + "/layer.tar", None, f"../{first[diff_ids[i]]}/layer.tar"))
        else:
            first.setdefault(diff_ids[i], f)
            entries.append((f + "/layer.tar", os.urandom(sizes[i]), None))
    entries.append((image_id[7:] + ".json", b'{"rootfs":{}}', None))
    entries.append(("manifest.json", json.dumps([{"Layers": [f + "/layer.tar" for f in folders]}]).encode(), None))
    entries.sort(key=lambda e: e[0])
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.USTAR_FORMAT) as tf:
        for name, data, link in entries:
            _member(tf, name.rstrip("/") if data is None and link is None else name, data, link)
    return buf.getvalue(), folders


def route(archive: bytes, diff_ids: list[str], send: dict[str, list[int]], image_id: str | None = None,
          blob_diffs: dict[str, str] | None = None):
    f = SaveFilter(diff_ids, send, image_id, blob_diffs)
    outs = {t: bytearray() for t in send}
    for to, chunk in f.route(io.BytesIO(archive)):
        for t in to:
            outs[t] += chunk
    return f, {t: bytes(b) for t, b in outs.items()}


def names(archive: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r|") as tf:
        return [m.name for m in tf]


def test_filter_routes_only_needed_folders():
    diffs = ["sha256:" + hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
    archive, folders = fake_save(diffs, [300_000, 2_000_000, 50_000, 7_000])
    f, out = route(archive, diffs, {"full": [0, 1, 2, 3], "patch": [3], "none": []}, "sha256:" + "c" * 64)
    assert f.folders == {folders[i]: i for i in range(4)} and not f.unidentified
    # everything: the same bytes as the input's members, then the end of the archive
    assert names(out["full"]) == names(archive)
    assert out["full"].endswith(END_OF_ARCHIVE)
    patch = names(out["patch"])
    assert [n for n in patch if "/" in n and n.split("/")[0] != folders[3]] == []
    assert f"{folders[3]}/layer.tar" in patch and "manifest.json" in patch and "c" * 64 + ".json" in patch
    assert 7_000 < len(out["patch"]) < 7_000 + 8_192
    assert all("/" not in n for n in names(out["none"]))


def test_filter_keeps_symlink_targets_and_sends_unknown_folders():
    d = ["sha256:" + "1" * 64, "sha256:" + "2" * 64, "sha256:" + "2" * 64]
    archive, folders = fake_save(d, [1000, 2000, 2000])
    _, out = route(archive, d, {"w": layers_to_send(d, set(chain_ids(d)[:2]))})
    got = names(out["w"])
    assert f"{folders[1]}/layer.tar" in got and f"{folders[2]}/layer.tar" in got and f"{folders[0]}/layer.tar" not in got
    # a folder whose json reproduces no chain (another engine's rule): sent to every target
    other = ["sha256:" + "9" * 64] * 3
    f, out = route(archive, other, {"a": [], "b": []})
    assert len(f.unidentified) == 3 and names(out["a"]) == names(archive)


def test_filter_refuses_another_image():
    diffs = ["sha256:" + "1" * 64]
    archive, _ = fake_save(diffs, [10])
    with pytest.raises(Exception, match="not sha256:" + "d" * 64):
        route(archive, diffs, {"w": [0]}, "sha256:" + "d" * 64)


def test_filter_matches_blobs_by_digest():
    layer = os.urandom(5000)
    diff = "sha256:" + hashlib.sha256(layer).hexdigest()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        _member(tf, "blobs/sha256/" + diff[7:], layer)
        _member(tf, "blobs/sha256/" + "e" * 64, b"{}")
        _member(tf, "index.json", b"{}")
    _, out = route(buf.getvalue(), [diff], {"has": [], "lacks": [0]})
    assert names(out["has"]) == ["blobs/sha256/" + "e" * 64, "index.json"]
    assert len(names(out["lacks"])) == 3


def containerd_save(layers: list[bytes], manifest_last: bool = True) -> tuple[bytes, dict]:
    """An archive as a containerd-store engine's `docker save` writes it (Docker 26.1.5 here): gzip
    layer blobs named by their compressed digest, config and manifest blobs, all in digest order."""
    import gzip
    blobs, diffs, gz = {}, [], []
    for data in layers:
        diffs.append("sha256:" + hashlib.sha256(data).hexdigest())
        z = gzip.compress(data, mtime=0)
        gz.append("sha256:" + hashlib.sha256(z).hexdigest())
        blobs[gz[-1]] = z
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": diffs}}).encode()
    cfg = "sha256:" + hashlib.sha256(config).hexdigest()
    blobs[cfg] = config
    manifest = json.dumps({"schemaVersion": 2, "config": {"digest": cfg},
                           "layers": [{"digest": d} for d in gz]}).encode()
    mid = "sha256:" + hashlib.sha256(manifest).hexdigest()
    blobs[mid] = manifest
    order = sorted(blobs)
    if manifest_last:                    # the worst case for a streaming reader: after every layer
        order = [d for d in order if d != mid] + [mid]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        for d in order:
            _member(tf, "blobs/sha256/" + d[7:], blobs[d])
        _member(tf, "index.json", json.dumps({"manifests": [{"digest": mid}]}).encode())
    return buf.getvalue(), {"id": mid, "config": cfg, "diff_ids": diffs, "blobs": gz}


def test_filter_maps_compressed_blobs_to_diff_ids_through_the_manifest():
    archive, img = containerd_save([os.urandom(3000), os.urandom(2000), b"patch" * 100])
    blob_diffs = dict(zip(img["blobs"], img["diff_ids"]))
    f, out = route(archive, img["diff_ids"], {"has2": [2], "lacks": [0, 1, 2]}, img["id"], blob_diffs)
    got = {n for n in names(out["has2"]) if n.startswith("blobs/sha256/")}
    layer_blobs = {"blobs/sha256/" + b[7:] for b in img["blobs"]}
    assert got & layer_blobs == {"blobs/sha256/" + img["blobs"][2][7:]}     # only its missing layer
    assert layer_blobs <= set(names(out["lacks"]))
    assert sorted(ev["index"] for ev in f.events) == [0, 1, 2]
    # without the manifest's map the compressed blobs are unknown, so every target gets them: no guess
    _, blind = route(archive, img["diff_ids"], {"has2": [2]}, img["id"])
    assert layer_blobs <= set(names(blind["has2"]))


def test_manifest_scan_finds_config_and_blobs_even_when_the_manifest_comes_last():
    from orchestrator.hostside import image_manifest
    for last in (True, False):
        archive, img = containerd_save([os.urandom(1000), os.urandom(1000)], manifest_last=last)
        got = image_manifest.scan(io.BytesIO(archive), img["id"], "amd64")
        assert got == {"manifest": img["id"], "config": img["config"], "layers": img["blobs"]}
    # an ID that names no manifest (a graph-driver store's, the config digest): index.json says
    assert image_manifest.scan(io.BytesIO(archive), img["config"], "amd64")["config"] == img["config"]
    # an index: the platform asked for, not an attestation manifest
    docs = {"sha256:i": {"manifests": [{"digest": "sha256:att", "platform": {"architecture": "unknown"}},
                                      {"digest": "sha256:arm", "platform": {"architecture": "arm64"}},
                                      {"digest": "sha256:x86", "platform": {"architecture": "amd64"}}]},
            "sha256:arm": {"config": {"digest": "sha256:c-arm"}, "layers": []},
            "sha256:x86": {"config": {"digest": "sha256:c-x86"}, "layers": []}}
    assert image_manifest.resolve(docs, "sha256:i", "arm64")["config"] == "sha256:c-arm"
    assert image_manifest.resolve(docs, "sha256:i", "riscv64")["config"] == "sha256:c-arm"


def test_the_same_image_is_found_across_image_stores():
    from orchestrator.ship.stores import EngineFacts
    from orchestrator.ship.transfer import HeadImage, Manifest, WorkerImages, find_image, whole_image_reason
    diffs = ("sha256:" + "1" * 64, "sha256:" + "2" * 64)
    cfg, mid, other = "sha256:" + "c" * 64, "sha256:" + "a" * 64, "sha256:" + "b" * 64
    cd26, g26, g20 = EngineFacts("26.1.5", "overlayfs", True), EngineFacts("26.1.5", "overlay2"), EngineFacts("20.10.24")
    head_cd = HeadImage("img:1", mid, diffs, 1, engine=cd26, manifest=Manifest(mid, cfg, ("sha256:g1", "sha256:g2")))
    head_g = HeadImage("img:1", cfg, diffs, 1, engine=g20)
    asked: list[str] = []

    def config_of(i: str) -> str:
        asked.append(i)
        return cfg if i == other else "sha256:" + "9" * 64

    def worker(ids, engine, tagged=None):
        return WorkerImages(frozenset(ids), frozenset(), {tagged: ("img:1",)} if tagged else {},
                            {i: diffs for i in ids}, engine)

    assert find_image(head_cd, worker([mid], cd26), config_of) == mid              # containerd -> containerd
    assert find_image(head_cd, worker([cfg], g20), config_of) == cfg              # containerd -> graph: config
    assert find_image(head_g, worker([cfg], g26), config_of) == cfg               # graph -> graph
    assert find_image(head_g, worker([other], g26), config_of) is None            # a graph ID is its config
    assert not asked
    # graph -> containerd: the worker's own manifest is read for its config; the tagged one first
    assert find_image(head_g, worker(["sha256:" + "0" * 64, other], cd26, tagged=other), config_of) == other
    assert asked == [other]
    assert find_image(head_g, worker(["sha256:" + "0" * 64], cd26), config_of) is None
    assert head_cd.blob_diffs() == {"sha256:g1": diffs[0], "sha256:g2": diffs[1]} and head_g.blob_diffs() == {}
    # the one combination without a delta: a legacy archive into a containerd store
    assert "whole image" in whole_image_reason(head_g, worker([], cd26))
    assert whole_image_reason(HeadImage("img:1", cfg, diffs, 1, engine=g26), worker([], cd26)) is None
    assert whole_image_reason(head_g, worker([], g26)) is None


# --------------------------------------------------------------------------------------------------
# The relay (worker side) and the agent (head side), run as they are run on hosts

def frames(*payloads: bytes, end: bool = True) -> bytes:
    out = b"".join(relay.frame(p) for p in payloads)
    return out + (relay.HEADER.pack(relay.END) if end else b"")


def run_relay(stdin: bytes, out: Path, idle: str = "5", wait: float = 0) -> subprocess.CompletedProcess:
    p = subprocess.Popen([sys.executable, "-c", RELAY, idle, "sh", "-c", f"cat > {out}"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdin.write(stdin)
    p.stdin.flush()
    if wait:
        time.sleep(wait)
    p.stdin.close()
    rc = p.wait(timeout=30)
    return subprocess.CompletedProcess(p.args, rc, p.stdout.read(), p.stderr.read().decode())


def test_relay(tmp_path):
    r = run_relay(frames(b"abc", b"", b"x" * 3_000_000), tmp_path / "a")
    assert r.returncode == 0 and (tmp_path / "a").read_bytes() == b"abc" + b"x" * 3_000_000
    r = run_relay(frames(b"abc", end=False), tmp_path / "b")
    assert r.returncode == 125 and "ended before its end mark" in r.stderr
    r = run_relay(frames(b"abc", end=False), tmp_path / "c", idle="1", wait=3)
    assert r.returncode == 125 and "no data from the head for 1s" in r.stderr
    assert (agent.END, agent.FRAME.format) == (relay.END, relay.HEADER.format)


def run_agent(tmp_path: Path, archive: bytes, diffs: list[str], workers: dict[str, tuple[list[int], list[str]]],
              stall: float = 5) -> tuple[dict, list[dict]]:
    src = tmp_path / "save.tar"
    src.write_bytes(archive)
    spec = {"image_id": None, "diff_ids": diffs, "save": ["cat", str(src)], "stall_s": stall, "deadline_s": 60,
            "load_timeout_s": 30, "progress_s": 0.2, "heartbeat_s": 0.5,
            "workers": [{"name": n, "send": s, "argv": argv} for n, (s, argv) in workers.items()]}
    r, keep_open = os.pipe()              # the controller's channel: open while it listens
    try:
        p = subprocess.run([sys.executable, "-c", agent_program(), json.dumps(spec)], capture_output=True,
                           text=True, timeout=90, stdin=r)
    finally:
        os.close(r)
        os.close(keep_open)
    events = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert p.returncode == 0 and events[-1]["ev"] == "done", p.stderr
    return events[-1], events


def relay_into(path: Path, idle: str = "5") -> list[str]:
    return [sys.executable, "-c", RELAY, idle, "sh", "-c", f"cat > {path}"]


def test_agent_fans_out_and_isolates_failures(tmp_path):
    diffs = ["sha256:" + hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    archive, folders = fake_save(diffs, [3_000_000, 1_000_000, 10_000])
    done, events = run_agent(tmp_path, archive, diffs, {
        "full": ([0, 1, 2], relay_into(tmp_path / "full.tar")),
        "patch": ([2], relay_into(tmp_path / "patch.tar")),
        "gone": ([0, 1, 2], ["sh", "-c", "echo 'ssh: connect to host x port 22: Connection timed out' >&2; exit 255"]),
        "stuck": ([0, 1, 2], ["sh", "-c", "exec sleep 60"]),        # never reads: the network is cut
    }, stall=2)
    w = done["workers"]
    assert w["full"]["ok"] and w["patch"]["ok"], w
    assert names((tmp_path / "full.tar").read_bytes()) == names(archive)
    assert w["full"]["bytes"] == len((tmp_path / "full.tar").read_bytes())
    assert 10_000 < w["patch"]["bytes"] < 20_000
    assert not w["gone"]["ok"] and "exited 255" in w["gone"]["error"]
    assert "unreachable from the head" in explain("gone", w["gone"])
    assert not w["stuck"]["ok"] and w["stuck"]["kind"] == "stall" and "no bytes for 2s" in w["stuck"]["error"]
    layer_evs = [e for e in events if e["ev"] == "layer"]
    assert {e["folder"]: e["index"] for e in layer_evs} == {f: i for i, f in enumerate(folders)}
    assert any(e["ev"] == "p" for e in events)


def test_agent_reports_a_failed_save(tmp_path):
    diffs = ["sha256:" + "1" * 64]
    archive, _ = fake_save(diffs, [1000])
    done, _ = run_agent(tmp_path, archive[:1500], diffs, {"w": ([0], relay_into(tmp_path / "w.tar"))})
    assert not done["workers"]["w"]["ok"] and "docker save" in done["workers"]["w"]["error"]
    assert not (tmp_path / "w.tar").exists() or (tmp_path / "w.tar").stat().st_size < 1500


def test_agent_stops_when_the_controller_goes(tmp_path):
    """stdin closed = the controller's SSH channel closed: the agent kills what it started and exits."""
    diffs = ["sha256:" + "1" * 64]
    archive, _ = fake_save(diffs, [1000])
    (tmp_path / "save.tar").write_bytes(archive)
    spec = {"diff_ids": diffs, "save": ["sh", "-c", f"sleep 30; cat {tmp_path / 'save.tar'}"], "stall_s": 5,
            "deadline_s": 60, "workers": [{"name": "w", "send": [0], "argv": relay_into(tmp_path / "w.tar")}]}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", agent_program(), json.dumps(spec)], capture_output=True, text=True,
                       timeout=30, stdin=subprocess.DEVNULL)
    assert p.returncode == 4 and time.monotonic() - t0 < 10


def test_explain_and_estimates():
    full = {"error": "ssh to node4 exited 1 after 20000 bytes, before the stream ended", "rc": 1,
            "tail": ["Error processing tar file(exit status 1): write /big: no space left on device"]}
    msg = explain("node4", full)
    assert "disk is full" in msg and "no space left on device" in msg and "20000 bytes" in msg
    assert history_layer_sizes("6\n0\n262144\n0\n1984239\n", 3) == (1984239, 262144, 6)
    assert history_layer_sizes("0\n0\n", 3) is None
    assert Timeouts().stall_s == 60
