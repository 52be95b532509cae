"""Each rank receives what it reads (orchestrator/modelsync/rows.py, hostside/chain_node.py `keep`,
hostside/modelsync.py's partial verify), on a synthetic DeepSeek-shaped checkpoint, with local chain
node processes: a node keeps of an Engram shard every byte but the other ranks' rows (holes), still
checks the whole stream's sha256, records what it kept; verify accepts exactly that and nothing else."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.hostside import chain_node, modelsync
from orchestrator.hostside.engram_spec import spec_for
from orchestrator.modelsync import rows
from tests.engram_synth import Synth
from tests.test_chain_units import _done, _first, _spec, _start, _wire

RECIPE = "deepseek-v41-flash-tp4"


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return Synth(tmp_path_factory.mktemp("rows"), [1, 14], [300, 300, 300], 8, 32, 1, seed=5)


def _names(spec) -> list[str]:
    return [n for layer in spec.geometry.layers for _, n, _, _ in spec.fields(layer)]


def _manifest(root: Path, spec) -> tuple[list, dict]:
    files = [[p.name, p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()] for p in sorted(root.iterdir())]
    return files, modelsync.tensor_ranges(str(root), _names(spec))


def test_the_head_locates_every_engram_tensor_the_engines_way(synth):
    spec = synth.spec(4, 0)
    _, tensors = _manifest(synth.ckpt, spec)
    for name, (rel, start, end) in tensors.items():
        t = synth.tensors[name]
        assert (rel, start, end) == (t.file.name, t.offset, t.offset + t.nbytes)
    # a tensor the checkpoint does not hold is left out: sync-model then sends whole files, and says why
    assert modelsync.tensor_ranges(str(synth.ckpt), ["layers.7.engram.embed.weight"]) == {}


@pytest.mark.parametrize("tp", [4, 8])
def test_a_rank_keeps_everything_but_the_other_ranks_rows(synth, tp):
    """Applied to the shard's bytes, the spans give exactly header + other tensors + the rank's rows."""
    files, tensors = _manifest(synth.ckpt, synth.spec(tp, 0))
    sizes = {rel: size for rel, size, _ in files}
    total_kept = {}
    for rank in range(tp):
        keep = rows.keep_spans(synth.spec(tp, rank), tensors, sizes)
        assert sorted(keep) == sorted({t.file.name for n, t in synth.tensors.items() if ".engram." in n})
        for rel, spans in keep.items():
            src = (synth.ckpt / rel).read_bytes()
            got = bytearray(len(src))
            for a, b in spans:
                got[a:b] = src[a:b]
            assert bytes(got) == synth.partial_bytes(rel, tp, rank), (rel, rank)
        total_kept[rank] = sum(rows.kept_bytes(s) for s in keep.values())
    # every rank's rows are kept by exactly one rank: the kept sums add up to the shards once plus
    # the non-Engram bytes once per rank
    engram = sum(t.nbytes for n, t in synth.tensors.items() if ".engram." in n)
    shards = sum(sizes[rel] for rel in keep)
    assert sum(total_kept.values()) == engram + tp * (shards - engram)


def test_a_geometry_that_disagrees_with_the_checkpoint_is_refused(synth):
    files, tensors = _manifest(synth.ckpt, synth.spec(4, 0))
    name = next(iter(tensors))
    bad = {**tensors, name: [tensors[name][0], tensors[name][1], tensors[name][2] - 1]}
    with pytest.raises(Exception, match="check engram.geometry"):
        rows.keep_spans(synth.spec(4, 1), bad, {rel: size for rel, size, _ in files})


def test_the_plan_figures_at_the_real_geometry(tmp_path):
    """The recipes' own numbers (docs/distribution.md): 50.69 GB of rows per rank at TP=4, 25.34 GB at TP=8,
    of the 202.8 GB of Engram rows."""
    from tests.test_fabric_units import _inventory

    def inv(n: int) -> Path:
        (tmp_path / str(n)).mkdir(exist_ok=True)
        return _inventory(tmp_path / str(n), "switch", {f"n{i}": {"fabric_address": f"10.9.0.{i}"}
                                                        for i in range(1, n + 1)})
    for recipe, tp, want in (("deepseek-v41-flash-tp4", 4, 50.69), ("deepseek-v41-flash-tp8-nvme", 8, 25.34)):
        dep = load_deployment(inv(tp), recipe)
        assert rows.applies(dep)
        f = rows.figures(dep, 1)
        assert f["tp"] == tp and round(f["rank_row_bytes"] / 1e9, 2) == want, f
        assert round(f["engram_bytes"] / 1e9, 1) == 202.8
    assert rows.unlocated(dep, {}).startswith("the head's checkpoint has no 'layers.1.engram.embed.weight'")
    assert "(+2 more): every file is sent whole" in rows.unlocated(dep, {})
    assert rows.unlocated(dep, {n: ["f", 0, 1] for n in rows.tensor_names(dep)}) == ""
    assert not rows.applies(load_deployment(inv(4), "deepseek-v41-flash-tp4", ("engram.receive=full",)))
    assert not rows.applies(load_deployment(inv(8), "deepseek-v41-flash-tp8-mem"))


def _chain(synth, tmp_path, ranks: dict[str, int], tp: int = 4):
    """The head's source streaming the whole checkpoint through one relay per entry of RANKS."""
    spec0 = synth.spec(tp, 0)
    files, tensors = _manifest(synth.ckpt, spec0)
    sizes = {rel: size for rel, size, _ in files}
    secret = os.urandom(32).hex()
    nodes, keeps = {}, {}
    for name, rank in ranks.items():
        keeps[name] = rows.keep_spans(synth.spec(tp, rank), tensors, sizes)
        nodes[name] = _start(_spec("relay", tmp_path / name, secret, need=[f[0] for f in files], keep=keeps[name]))
    ports = {n: _first(p)["port"] for n, p in nodes.items()}
    order = list(ranks)
    for i, n in enumerate(order):
        _wire(nodes[n], ["127.0.0.1", ports[order[i + 1]]] if i + 1 < len(order) else None)
    source = _start(_spec("source", synth.ckpt, secret, files=files))
    _first(source)
    _wire(source, ["127.0.0.1", ports[order[0]]])
    assert _done(source)[0] == 0
    events = {}
    for n, p in nodes.items():
        rc, done, err = _done(p)
        assert rc == 0 and done["ok"], (n, done, err)
        events[n] = done
    return files, keeps, events


def _verify(root: Path, files: list, partial: dict | None, *flags: str, seen: dict | None = None) -> dict:
    args = modelsync.parse(["verify", "--root", str(root), "--cache", str(root.parent / f"{root.name}.cache"), *flags])
    return modelsync.op_verify(args, {"files": files, **({"partial": partial} if partial else {}),
                                      **({"seen": seen} if seen else {})})


def test_each_node_writes_only_its_ranks_rows_and_forwards_everything(synth, tmp_path):
    files, keeps, done = _chain(synth, tmp_path, {"node2": 1, "node3": 2})
    whole = sum(size for _, size, _ in files)
    assert done["node2"]["recv"] == done["node3"]["recv"] and done["node2"]["fwd"] == done["node2"]["recv"]
    for node, rank in (("node2", 1), ("node3", 2)):
        root = tmp_path / node
        kept = sum(rows.kept_bytes(s) for s in keeps[node].values())
        # wrote the whole of the files not in part, only the kept ranges of the Engram shards
        assert done[node]["written"] == whole - sum(size for rel, size, _ in files if rel in keeps[node]) + kept
        for rel, size, sha in files:
            data = (root / rel).read_bytes()
            if rel in keeps[node]:
                assert data == synth.partial_bytes(rel, 4, rank), (node, rel)
                assert hashlib.sha256(data).hexdigest() != sha
            else:
                assert hashlib.sha256(data).hexdigest() == sha
        record = json.loads((root / chain_node.RECORD).read_text())["files"]
        assert sorted(record) == sorted(keeps[node])
        for rel, rec in record.items():
            assert rec["keep"] == keeps[node][rel] and rec["sha256"] == dict((f[0], f[2]) for f in files)[rel]
        assert not (root / chain_node.PARTIAL).exists() or not any((root / chain_node.PARTIAL).rglob("*.safetensors"))
    # the holes are holes (ext4 here): a shard takes what it keeps on disk, page-rounded, not its size
    big = [rel for rel in keeps["node2"] if (tmp_path / "node2" / rel).stat().st_size > 64 * 4096]
    assert len(big) == 2                               # the two weight shards; the scale shards are a few KB
    for rel in big:
        spans, st = keeps["node2"][rel], (tmp_path / "node2" / rel).stat()
        assert st.st_blocks * 512 <= rows.kept_bytes(spans) + 2 * 4096 * len(spans) < st.st_size, rel


def test_verify_accepts_a_rank_s_partial_shards_and_nothing_else(synth, tmp_path):
    files, keeps, _ = _chain(synth, tmp_path, {"node2": 1})
    root, keep = tmp_path / "node2", keeps["node2"]
    v = _verify(root, files, keep)
    assert not v["missing"] and not v["differ"] and v["ok"] == len(files) and v["partial_ok"] == len(keep), v
    kept = sum(rows.kept_bytes(s) for s in keep.values())
    # --rehash trusts no cache: it reads the kept ranges only, not the holes
    v = _verify(root, files, keep, "--rehash")
    assert not v["differ"] and v["partial_ok"] == len(keep) and v["hashed_bytes"] <= kept + sum(
        s for rel, s, _ in files if rel not in keep), v
    assert v["hashed_bytes"] >= kept
    # another rank's ranges, or the whole file wanted: these shards are not what is wanted
    other = rows.keep_spans(synth.spec(4, 2), modelsync.tensor_ranges(str(synth.ckpt), _names(synth.spec(4, 0))),
                            {rel: size for rel, size, _ in files})
    v = _verify(root, files, other)
    assert sorted(p for p, _ in v["differ"]) == sorted(keep), v
    v = _verify(root, files, None)
    assert sorted(p for p, _ in v["differ"]) == sorted(keep), v
    assert all("held in part" in why for _, why in v["differ"]), v
    # a kept byte changed (the mtime put back): --rehash finds it
    rel = sorted(keep)[0]
    path = root / rel
    st = path.stat()
    a, _b = keep[rel][-1]
    with open(path, "r+b") as f:
        f.seek(a)
        byte = f.read(1)
        f.seek(a)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    v = _verify(root, files, keep, "--rehash")
    assert [p for p, _ in v["differ"]] == [rel] and "kept ranges" in v["differ"][0][1], v


def test_a_whole_file_satisfies_a_partial_want(synth, tmp_path):
    """A node that holds the whole checkpoint (a pre-seeded disk) is exact for any rank: nothing sent."""
    import shutil
    files, tensors = _manifest(synth.ckpt, synth.spec(4, 0))
    root = tmp_path / "seeded"
    shutil.copytree(synth.ckpt, root)
    keep = rows.keep_spans(synth.spec(4, 3), tensors, {rel: size for rel, size, _ in files})
    v = _verify(root, files, keep)
    assert not v["differ"] and not v["missing"] and v["partial_ok"] == 0 and v["ok"] == len(files), v


def test_spec_for_is_stage_engrams_spec(synth):
    from orchestrator.recipe import load_recipe
    from orchestrator.stages.stage_engram import engram_spec
    r = load_recipe(RECIPE, synth.sets()).recipe
    assert spec_for(r, 2).to_json() == engram_spec(r, 2).to_json()


def test_the_engines_loader_reads_every_other_tensor_from_a_partial_folder(synth, tmp_path):
    """The double's weights iterator (released vLLM's filter + iterator, the community's Engram skip)
    loads the same tensors, byte for byte, from a worker's partial folder as from the checkpoint; a
    folder that lacks an indexed shard, or holds a shard cut short, fails as the real loader does."""
    import shutil

    from tests.test_engram_engine_read import D
    _chain(synth, tmp_path, {"node2": 1})
    full, part = D.engram_weights_loaded(str(synth.ckpt)), D.engram_weights_loaded(str(tmp_path / "node2"))
    assert full == part and full["tensors"] == 4 and full["skipped_engram"] == 4, (full, part)
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "node2", broken)
    (broken / "model-00004-of-00004.safetensors").unlink()
    with pytest.raises(D.EngramError, match="Weight files referenced in index but missing"):
        D.engram_weights_loaded(str(broken))
    shutil.copy(synth.ckpt / "model-00004-of-00004.safetensors", broken)
    with open(broken / "model-00001-of-00004.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 1)
    with pytest.raises(D.EngramError, match="MetadataIncompleteBuffer"):
        D.engram_weights_loaded(str(broken))
