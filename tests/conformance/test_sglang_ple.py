"""deployctl's PLE table files against the released SGLang's Qwen4-Exp code (probes/sglang_ple_table.py).

(i)  Layout: for each SGLang recipe (and TP 2, beyond the recipes' TP 1), the file deployctl's
     write-ple names and sizes for each rank (orchestrator/hostside/ple_write.py via ple_layout.py)
     is the one the released Qwen4ExpNGramEmbedding / VocabParallelEmbedding / ple_table_file_name
     build: name, shape, dtype, rank rows, and the stride at which load_weights places shard i.
(ii) End to end on a small synthetic checkpoint: deployctl writes the table, then the released
     allocate_ple_host_table maps the folder: it must find deployctl's file, leave it untouched
     (size, mtime, first/last MiB) and see the checkpoint's rows where SGLang's loader puts them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.recipe import load_recipe
from orchestrator.stages.write_ple import spec_for
from orchestrator.hostside import ple_write as P
from orchestrator.hostside import ple_spec
from orchestrator.hostside.geometry import TableGeometry, total_rows
from tests.conformance.engines import run_probes, versions
from tests.synth import TensorPlan, expected_row, write_checkpoint

# The first test of a session may build the engine's venv (.ci/conformance-venv: minutes, once).
pytestmark = pytest.mark.timeout(1800)

RECIPES = ("qwen38-flash-next-spark", "qwen38-flash-next-rtx")
TORCH_DTYPE = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16"}


def text_config(g: TableGeometry, engine_config: dict) -> dict:
    """A Qwen4-Exp config.json (text_config) with the recipe's table geometry, in SGLang's terms."""
    orders = list(g.orders)
    assert orders == list(range(2, max(orders) + 1)), "SGLang hashes every n-gram size 2..ngram_size"
    assert len(set(g.vocab_per_order)) == 1, "SGLang has one ngram_vocab_size_base for all orders"
    heads = len(orders) * g.heads_per_order
    layer = g.layers[0]                            # 0-based in the shard names; ple_layer_ids are 1-based
    return {"model_type": "qwen4_exp_text", "hidden_size": 256, "num_hidden_layers": layer + 2,
            "vocab_size": 1024, "eos_token_id": 1, "ple_layer_ids": [layer + 1],
            "ple_embed_dim": g.row_values * heads, "ngram_size": max(orders),
            "heads_per_ngram": g.heads_per_order, "ngram_vocab_size_base": g.vocab_per_order[0],
            "make_ngram_vocab_size_divisible_by": engine_config["make_ngram_vocab_size_divisible_by"],
            "split_ngram_parts": engine_config["split_ngram_parts"],
            "ple_embedding_dtype": TORCH_DTYPE[g.dtype] if g.dtype.startswith("F8") else None}


def write_config(folder: Path, g: TableGeometry, engine_config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({"model_type": "qwen4_exp", "architectures":
                                ["Qwen4ExpForConditionalGeneration"],
                                "text_config": text_config(g, engine_config)}))
    return path


def _spec(recipe: str, tp: int) -> ple_spec.PleTableSpec:
    doc = spec_for(load_recipe(recipe).recipe)
    doc.update(tp=tp, ranks=list(range(tp)))
    return ple_spec.parse_spec(doc)


LAYOUTS = [(r, tp) for r in RECIPES for tp in (1, 2)]
# (ii)'s small tables (vocab 97 per order: 1,552 rows, padded to 1,664), 16 shards, TP 2
SMALL_TP, SMALL_SHARDS, SMALL_WIDTH = 2, 16, 160


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    """The released SGLang's answers to every case of this module, one probe run (its imports once):
    each layout (RECIPES x TP 1, 2) by (recipe, tp), and under "mapped" its allocation of the folder
    deployctl wrote (with what was written: small_table)."""
    d = tmp_path_factory.mktemp("sglang-ple")
    payloads = {}
    for recipe, tp in LAYOUTS:
        spec = _spec(recipe, tp)
        cfg = write_config(d / f"{recipe}-tp{tp}", spec.geometry, spec.engine_config)
        payloads[(recipe, tp)] = {"config_json": str(cfg), "tp": tp}
    small = small_table(d / "mapped")
    payloads["mapped"] = {"config_json": str(small["config"]), "tp": SMALL_TP, "table_dir": str(small["dest"]),
                          "allocate": True}
    got = dict(zip(payloads, run_probes("sglang_ple_table", list(payloads.values()))))
    got["small_table"] = small
    return got


@pytest.mark.parametrize("recipe,tp", LAYOUTS)
def test_table_layout_equals_released_sglang(answers, recipe, tp):
    spec = _spec(recipe, tp)
    ans = answers[(recipe, tp)]
    assert ans["sglang_version"] == versions()["sglang"]
    layer = ans["ple_layers"][0]
    assert layer["total_vocab_size"] == total_rows(spec.geometry), "the prime scheme differs"
    mine = {t.rank: t for t in spec.tables()}
    assert sorted(mine) == [r["rank"] for r in ans["ranks"]]
    for e in ans["ranks"]:
        t = mine[e["rank"]]
        where = f"{recipe} TP{tp} rank {e['rank']}"
        assert t.file_name == e["file_name"], (
            f"{where}: deployctl writes {t.file_name}, the released SGLang maps {e['file_name']}")
        assert list(t.shape) == e["shape"] and t.torch_dtype == e["dtype"], where
        assert t.nbytes == e["bytes"], where
        assert (t.start, t.end) == (e["org_vocab_start"], e["org_vocab_end"]), where
        assert t.org_vocab_size == e["org_vocab_size"], where
        assert t.shard_stride == e["shard_size"], (
            f"{where}: deployctl places shard i at row i x {t.shard_stride}, SGLang's loader at "
            f"i x {e['shard_size']}")


def small_table(d: Path) -> dict:
    """A checkpoint of small PLE shards and the table deployctl's write-ple makes of it (TP 2)."""
    tp, shards, width = SMALL_TP, SMALL_SHARDS, SMALL_WIDTH
    g = TableGeometry(layers=(2,), orders=(2, 3), heads_per_order=8, vocab_per_order=(97, 97),
                      row_values=width, dtype="F8_E4M3")
    eng = {"make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": shards}
    doc = {"format": ple_spec.SPEC_FORMAT, "placement": "nvme",
           "geometry": {"layers": list(g.layers), "orders": list(g.orders),
                        "heads_per_order": g.heads_per_order, "vocab_per_order": list(g.vocab_per_order),
                        "row_values": width, "dtype": g.dtype},
           "shard_tensor": "model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding"
                           ".shard_{shard}.weight",
           "shards": shards, "tp": tp, "ranks": list(range(tp)), "engine_config": eng,
           "min_host_ram_gb": 1, "recipe": {"name": "conformance", "digest": "0"}}
    spec = ple_spec.parse_spec(doc)
    rows = total_rows(g)
    per = -(-rows // shards)                       # an exporter's cut of the real rows
    plans = [TensorPlan(spec.shard_name(i), "F8_E4M3", max(0, min(per, rows - i * per)), width)
             for i in range(shards)]
    ck, dest = d / "ckpt", d / "ple"
    write_checkpoint(ck, plans, files=3)
    cfg = write_config(ck, g, eng)                 # the checkpoint's own config.json
    P.write_table(spec, ck, dest, quiet=True)
    return {"config": cfg, "dest": dest, "plans": plans,
            "written": sorted(p.name for p in dest.glob("ple_table_*.bin"))}


def test_released_sglang_maps_deployctl_file_untouched(answers):
    """The released allocate_ple_host_table finds deployctl's files, leaves them as written and
    reads each rank's rows where SGLang's loader would have put them."""
    shards, width = SMALL_SHARDS, SMALL_WIDTH
    small, ans = answers["small_table"], answers["mapped"]
    plans, written = small["plans"], small["written"]
    assert sorted(Path(a["path"]).name for a in ans["allocate"]) == written, (
        f"deployctl wrote {written}; the released SGLang maps "
        f"{sorted(Path(a['path']).name for a in ans['allocate'])}")
    for a, r in zip(ans["allocate"], ans["ranks"]):
        where = f"rank {a['rank']} ({Path(a['path']).name})"
        assert a["existed"] and a["unchanged"], f"{where}: SGLang rewrote or resized it: {a}"
        stride = r["shard_size"]

        def want(g_row: int) -> str:       # SGLang's loader: shard i's row k at global i * stride + k
            i, k = divmod(g_row, stride)
            if i < shards and k < plans[i].rows:
                return expected_row(plans[i].name, k, width).hex()
            return bytes(width).hex()

        start, end = r["org_vocab_start"], r["org_vocab_end"]
        assert a["first_rows_hex"] == [want(start + j) for j in range(4)], where
        last = start + r["shape"][0] - 1
        assert a["last_row_hex"] == (want(last) if last < end else bytes(width).hex()), where
