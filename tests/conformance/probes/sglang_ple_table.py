"""The Qwen4-Exp PLE n-gram table per TP rank as the released SGLang builds it, and (optionally)
what its file backend does with a table file that is already there.

stdin:  {"config_json": "/path/config.json", "tp": 1, "table_dir": "/dir", "allocate": false,
         "ple_embedding_dtype": null}   # optional: override text_config.ple_embedding_dtype
stdout: {"sglang_version": "0.5.23", "tp": 1,
         "text_config": {ngram_size, heads_per_ngram, ngram_vocab_size_base, ple_embed_dim,
                         make_ngram_vocab_size_divisible_by, ple_embedding_dtype,
                         split_ngram_parts, ple_layer_ids, num_hidden_layers},
         "ranks": [per rank of the first PLE layer: {"rank", "shape", "dtype", "tag",
                   "file_name", "bytes", "shard_size", "org_vocab_size", "org_vocab_start",
                   "org_vocab_end", "split_ngram_parts", "path"}],
         "ple_layers": [{"ple_layer_id", "decoder_layer", "ple_layer_index", "module_prefix",
                         "checkpoint_shard_tensor", "head_vocab_sizes", "head_offsets",
                         "total_vocab_size", "padded_vocab_size", "ranks": [...]}],
         "allocate": null | [{"rank", "path", "existed", "before": {...} | null,
                              "after": {...}, "unchanged": bool, "first_rows_hex": [4 rows],
                              "last_row_hex": "..", "table_shape", "table_dtype"}]}

What runs (sglang 0.5.23):
  sglang/srt/configs/qwen4_exp.py   Qwen4ExpConfig / Qwen4ExpTextConfig .from_json_file
  sglang/srt/models/qwen4_exp.py    _has_ple (which decoder layers hold a PLE module: layer_id + 1
                                    in ple_layer_ids), the ple_layer_index numbering of
                                    Qwen4ExpDecoderLayer, Qwen4ExpNGramEmbedding.__init__ itself
                                    (_build_head_vocab_and_offsets: sympy primes,
                                    make_ngram_vocab_size_divisible_by padding, _ple_table_is_fp8,
                                    embedding dim = ple_embed_dim / ngram heads) building its
                                    VocabParallelEmbedding (pad_vocab_size, _get_indices)
  sglang/srt/models/qwen4_exp_ple_table.py  ple_table_file_name(shape, dtype, tag) and
                                    allocate_ple_host_table(shape, dtype, "file", dir, tag)
  The module is built under torch.device("meta") with text_config.ple_offload_embedding False
  (the offload wrapper would allocate; it only copies shape, dtype and shard_indices, and names
  the file rows{org_vocab_start_index}-{org_vocab_end_index}, as Qwen4ExpPinnedHostEmbedding
  does). The TP rank and size are stated with the released get_parallel().override(tp_rank=,
  tp_size=) (sglang/srt/runtime_context.py), no distributed init.
  shard_size is load_qwen4_exp_ple_shard's arithmetic (a closure inside
  Qwen4ExpForConditionalGeneration.load_weights, not callable on its own):
  ceil(emb.org_vocab_size / split_ngram_parts), split_ngram_parts from text_config (default 512).
One stand-in: torchvision. sglang imports it at module level for vision models
(sglang/srt/multimodal/internvl_utils.py, via sglang/srt/configs/__init__.py), and PyPI's Linux
torchvision is a CUDA build that cannot load into the CPU torch of this venv. The import is
answered by an inert module (after transformers is imported, so transformers still sees no
torchvision); nothing on the PLE path calls it.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
from typing import Any
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run  # noqa: E402

MIB = 1 << 20


class _InertTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__spec__, m.__path__, m.__name__ = spec, [], spec.name
        return m

    def exec_module(self, module):
        pass


def _import_sglang():
    import transformers  # noqa: F401 - first, so its torchvision probe finds none
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - absent or not loadable into CPU torch
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
        sys.meta_path.insert(0, _InertTorchvision())
    import sglang.srt.models.qwen4_exp as Q
    import sglang.srt.models.qwen4_exp_ple_table as T
    from sglang.srt.configs.qwen4_exp import Qwen4ExpConfig, Qwen4ExpTextConfig
    from sglang.srt.runtime_context import get_parallel
    return Q, T, Qwen4ExpConfig, Qwen4ExpTextConfig, get_parallel


def _file_state(path: str) -> dict[str, Any] | None:
    if not os.path.exists(path):
        return None
    st = os.stat(path)
    with open(path, "rb") as f:
        first = f.read(MIB)
        f.seek(max(0, st.st_size - MIB))
        last = f.read(MIB)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino,
            "sha256_first_mib": hashlib.sha256(first).hexdigest(),
            "sha256_last_mib": hashlib.sha256(last).hexdigest()}


def main(payload: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata

    import torch

    Q, T, Qwen4ExpConfig, Qwen4ExpTextConfig, get_parallel = _import_sglang()

    path = payload["config_json"]
    with open(path) as f:
        raw = json.load(f)
    if raw.get("model_type") == "qwen4_exp" or "text_config" in raw:
        cfg = Qwen4ExpConfig.from_json_file(path)
    else:
        cfg = Qwen4ExpTextConfig.from_json_file(path)
    tc = getattr(cfg, "text_config", cfg)
    if payload.get("ple_embedding_dtype"):
        tc.ple_embedding_dtype = payload["ple_embedding_dtype"]
    tc.ple_offload_embedding = False          # build the plain table on meta: nothing allocated
    parts = int(getattr(tc, "split_ngram_parts", getattr(cfg, "split_ngram_parts", 512)))
    tp = int(payload.get("tp", 1))
    table_dir = payload.get("table_dir")

    # Qwen4ExpDecoderLayer: a decoder layer holds PLE iff _has_ple(layer_id, config); its
    # ple_layer_index is its rank among the sorted ple_layer_ids.
    decoder_layers = [i for i in range(int(tc.num_hidden_layers)) if Q._has_ple(i, tc)]
    ids_sorted = sorted(set(tc.ple_layer_ids))
    layers_out = []
    for layer_id in decoder_layers:
        ple_layer_index = {abs_id: idx for idx, abs_id in enumerate(ids_sorted)}[layer_id + 1]
        prefix = f"model.layers.{layer_id}.ple.ple_embedding"
        ranks = []
        sizes = offsets = None
        total = padded = None
        for rank in range(tp):
            with get_parallel().override(tp_rank=rank, tp_size=tp), torch.device("meta"):
                m = Q.Qwen4ExpNGramEmbedding(tc, tc.ple_embed_dim, ple_layer_index=ple_layer_index,
                                             quant_config=None, prefix=prefix)
            emb = m.ngram_embedding
            if sizes is None:
                sizes, offsets, total = m._build_head_vocab_and_offsets()
                padded = emb.num_embeddings
            si = emb.shard_indices
            shape = tuple(int(d) for d in emb.weight.shape)
            dtype = emb.weight.dtype
            tag = f"rows{si.org_vocab_start_index}-{si.org_vocab_end_index}"
            name = T.ple_table_file_name(shape, dtype, tag)
            ranks.append({
                "rank": rank, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
                "tag": tag, "file_name": name,
                "bytes": emb.weight.numel() * emb.weight.element_size(),
                "shard_size": (emb.org_vocab_size + parts - 1) // parts,
                "split_ngram_parts": parts, "org_vocab_size": emb.org_vocab_size,
                "org_vocab_start": si.org_vocab_start_index, "org_vocab_end": si.org_vocab_end_index,
                "num_embeddings_padded": emb.num_embeddings_padded,
                "path": os.path.join(os.path.expanduser(table_dir), name) if table_dir else None})
        layers_out.append({
            "ple_layer_id": layer_id + 1, "decoder_layer": layer_id,
            "ple_layer_index": ple_layer_index, "module_prefix": prefix,
            "checkpoint_shard_tensor": f"model.language_model.layers.{layer_id}.ple.ple_embedding"
                                       ".ngram_embedding.shard_{shard}.weight",
            "head_vocab_sizes": sizes, "head_offsets": offsets, "total_vocab_size": total,
            "padded_vocab_size": padded, "ranks": ranks})

    allocated = None
    if payload.get("allocate"):
        if not table_dir:
            raise ValueError("allocate needs table_dir")
        if not layers_out:
            raise ValueError("the config has no PLE layer (ple_layer_ids)")
        allocated = []
        for r in layers_out[0]["ranks"]:
            before = _file_state(r["path"])
            table = T.allocate_ple_host_table(tuple(r["shape"]), getattr(torch, r["dtype"]),
                                              "file", table_dir, r["tag"])
            got = getattr(table, "_sglang_ple_file_path", None)
            raw_rows = table.view(torch.uint8)
            first = [raw_rows[i].numpy().tobytes().hex() for i in range(min(4, table.shape[0]))]
            last = raw_rows[-1].numpy().tobytes().hex() if table.shape[0] else None
            shape_t, dtype_t = list(table.shape), str(table.dtype).replace("torch.", "")
            del table, raw_rows
            after = _file_state(got or r["path"])
            allocated.append({
                "rank": r["rank"], "path": got, "existed": before is not None,
                "before": before, "after": after,
                "unchanged": before is not None and before == after,
                "first_rows_hex": first, "last_row_hex": last,
                "table_shape": shape_t, "table_dtype": dtype_t})

    return {"sglang_version": importlib.metadata.version("sglang"), "tp": tp,
            "text_config": {k: getattr(tc, k, None) for k in (
                "ngram_size", "heads_per_ngram", "ngram_vocab_size_base", "ple_embed_dim",
                "make_ngram_vocab_size_divisible_by", "ple_embedding_dtype", "ple_layer_ids",
                "num_hidden_layers")} | {"split_ngram_parts": parts},
            "ranks": layers_out[0]["ranks"] if layers_out else [],
            "ple_layers": layers_out, "allocate": allocated}


if __name__ == "__main__":
    run(main)
