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
from tests.conformance.engines import run_probes

PATCHES = Path(__file__).resolve().parents[2] / "dockerfiles" / "sglang-qwen38" / "patches"
SHARDS = [f"model.language_model.layers.2.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(4)]
SPOILS = ("no-manifest", "touched", "no-table")


def spoil_table(table: Path, how: str) -> None:
    if how == "no-manifest":
        Path(str(table) + ple_spec.MANIFEST_SUFFIX).unlink()
    elif how == "touched":
        st = table.stat()
        os.utime(table, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    else:
        table.unlink()


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each case's table and the released SGLang's answer, one probe run (its imports once): "kept"
    (the table as write-ple leaves it) and one per spoil, each its own checkpoint and table."""
    payloads, tables = {}, {}
    for case in ("kept", *SPOILS):
        ck, table = synth.qwen_checkpoint_and_table(tmp_path_factory.mktemp(case.replace("-", "_")))
        tables[case] = table
        if case != "kept":
            spoil_table(table, case)
        payloads[case] = {"config_json": str(ck / "config.json"), "model_path": str(ck),
                          "table_dir": str(table.parent), "patches_dir": str(PATCHES)}
    got = run_probes("sglang_patch", list(payloads.values()))
    return {case: (tables[case], ans) for case, ans in zip(payloads, got)}


def test_registered_and_keeps_a_verified_table(answers):
    table, res = answers["kept"]
    assert res["subclass"] is True
    assert res["registered"] == "deployctl_sglang_ple.qwen4_exp_prewritten.Qwen4ExpForConditionalGeneration"
    assert res["table_path"] == res["patch_table_path"] == str(table)
    assert res["verdict"][0] is True, res["verdict"]
    assert res["before"] == res["after"] and res["before"]["size"] == table.stat().st_size
    assert res["names_to_upstream"] == ["model.language_model.embed_tokens.weight"]   # no shard reads
    assert res["returned"] == ["model.layers.2.ple.ple_embedding.ngram_embedding.weight"]


@pytest.mark.parametrize("spoil", SPOILS)
def test_anything_else_goes_to_upstreams_loader(answers, spoil):
    _, res = answers[spoil]
    assert res["verdict"][0] is False
    assert {"no-manifest": "no deployctl manifest", "touched": "modified or replaced",
            "no-table": "modified or replaced"}[spoil] in res["verdict"][1]   # no-table: a new inode
    assert res["names_to_upstream"] == [*SHARDS, "model.language_model.embed_tokens.weight"]
    assert res["returned"] == []
    if spoil == "no-table":                   # the released allocator made the sparse file
        assert res["before"] is None and res["after"]["size"] == 2682880
