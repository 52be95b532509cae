"""deployctl's SGLang patch (dockerfiles/sglang-qwen38/patches/deployctl_sglang_ple) on the released
sglang: registered by the released registry as the Qwen4-Exp model class, and given a table the
released Qwen4ExpPinnedHostEmbedding maps from the file backend, it keeps a table deployctl wrote and
checked (bytes, inode and mtime untouched, no shard tensor reaches the loader) and hands every shard
to upstream's loader otherwise (no manifest, a touched file, no file)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.hostside import ple_spec
from tests import synth
from tests.conformance.engines import run_probe

PATCHES = Path(__file__).resolve().parents[2] / "dockerfiles" / "sglang-qwen38" / "patches"
SHARDS = [f"model.language_model.layers.2.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(4)]


@pytest.fixture
def written(tmp_path):
    return synth.qwen_checkpoint_and_table(tmp_path)


def probe(ck: Path, table_dir: Path) -> dict:
    return run_probe("sglang_patch", {"config_json": str(ck / "config.json"), "model_path": str(ck),
                                      "table_dir": str(table_dir), "patches_dir": str(PATCHES)})


def test_registered_and_keeps_a_verified_table(written):
    ck, table = written
    res = probe(ck, table.parent)
    assert res["subclass"] is True
    assert res["registered"] == "deployctl_sglang_ple.qwen4_exp_prewritten.Qwen4ExpForConditionalGeneration"
    assert res["table_path"] == res["patch_table_path"] == str(table)
    assert res["verdict"][0] is True, res["verdict"]
    assert res["before"] == res["after"] and res["before"]["size"] == table.stat().st_size
    assert res["names_to_upstream"] == ["model.language_model.embed_tokens.weight"]   # no shard reads
    assert res["returned"] == ["model.layers.2.ple.ple_embedding.ngram_embedding.weight"]


@pytest.mark.parametrize("spoil", ["no-manifest", "touched", "no-table"])
def test_anything_else_goes_to_upstreams_loader(written, spoil):
    ck, table = written
    if spoil == "no-manifest":
        Path(str(table) + ple_spec.MANIFEST_SUFFIX).unlink()
    elif spoil == "touched":
        st = table.stat()
        os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    else:
        table.unlink()
    res = probe(ck, table.parent)
    assert res["verdict"][0] is False
    assert {"no-manifest": "no deployctl manifest", "touched": "modified or replaced",
            "no-table": "modified or replaced"}[spoil] in res["verdict"][1]   # no-table: a new inode
    assert res["names_to_upstream"] == [*SHARDS, "model.language_model.embed_tokens.weight"]
    assert res["returned"] == []
    if spoil == "no-table":                   # the released allocator made the sparse file
        assert res["before"] is None and res["after"]["size"] == 2682880
