"""deployctl's SGLang patch package (dockerfiles/sglang-qwen38/patches/deployctl_sglang_ple) on the
released SGLang: registered through the released registry, and its load_weights on a PLE module the
released code builds and maps (allocate_ple_host_table, backend "file").

stdin:  {"config_json": PATH, "model_path": DIR, "table_dir": DIR, "patches_dir": DIR}
stdout: {"sglang_version", "subclass": bool, "registered": "module.Class",
         "table_path": the file the released wrapper mapped, "patch_table_path": what the patch computes,
         "verdict": [keep, why], "before": {...}, "after": {...},
         "names_to_upstream": [weight names upstream's load_weights received],
         "returned": [names the patched load_weights reported loaded]}

What runs (sglang 0.5.23): sglang/srt/models/registry.py import_model_classes (how
SGLANG_EXTERNAL_MODEL_PACKAGE is read), Qwen4ExpNGramEmbedding built with
ple_offload_embedding/ple_offload_backend "file"/ple_offload_dir as load_model_utils.py sets them, so
the released Qwen4ExpPinnedHostEmbedding maps the table through allocate_ple_host_table. Upstream's
Qwen4ExpForConditionalGeneration.load_weights needs the whole model, so it is replaced by a recorder
of the names it is handed: what is tested is which tensors the patch lets through to it, and that the
file is left as it was.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run  # noqa: E402
from sglang_ple_table import _file_state, _import_sglang  # noqa: E402


def main(payload: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata

    import torch

    Q, T, Qwen4ExpConfig, _, get_parallel = _import_sglang()
    from sglang.srt.models.registry import import_model_classes

    sys.path.insert(0, payload["patches_dir"])
    import deployctl_sglang_ple.qwen4_exp_prewritten as P

    registered = import_model_classes("deployctl_sglang_ple", strict=True)["Qwen4ExpForConditionalGeneration"]

    cfg = Qwen4ExpConfig.from_json_file(payload["config_json"])
    tc = cfg.text_config
    tc.ple_offload_embedding = True                  # load_model_utils.py sets these from the flags
    tc.ple_offload_backend = "file"
    tc.ple_offload_dir = payload["table_dir"]
    layer_id = sorted(set(tc.ple_layer_ids))[0] - 1
    table_dir = payload["table_dir"]
    states = {n: _file_state(os.path.join(table_dir, n)) for n in os.listdir(table_dir)} \
        if os.path.isdir(table_dir) else {}       # before the released wrapper maps anything
    prefix = f"model.layers.{layer_id}.ple.ple_embedding"
    with get_parallel().override(tp_rank=0, tp_size=1):
        module = Q.Qwen4ExpNGramEmbedding(tc, tc.ple_embed_dim, ple_layer_index=0, quant_config=None,
                                          prefix=prefix)
    emb = module.ngram_embedding
    mapped = emb.weight.data
    table_path = os.path.join(payload["table_dir"], T.ple_table_file_name(
        mapped.shape, mapped.dtype,
        f"rows{emb.shard_indices.org_vocab_start_index}-{emb.shard_indices.org_vocab_end_index}"))
    before = states.get(os.path.basename(table_path))
    patch_table_path = P.table_path(module)

    received: list[str] = []

    def upstream_load_weights(self, weights):
        for name, _ in weights:
            received.append(name)
        return set()

    class Model(P.Qwen4ExpForConditionalGeneration):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleDict({str(layer_id): torch.nn.Module()})
            self.model.layers[str(layer_id)].ple = torch.nn.Module()
            self.model.layers[str(layer_id)].ple.ple_embedding = module
            self.config = types.SimpleNamespace(_name_or_path=payload["model_path"])

    names = [f"model.language_model.layers.{layer_id}.ple.ple_embedding.ngram_embedding.shard_{i}.weight"
             for i in range(4)] + ["model.language_model.embed_tokens.weight"]
    Q.Qwen4ExpForConditionalGeneration.load_weights = upstream_load_weights
    model = Model()
    returned = model.load_weights((n, torch.empty(0)) for n in names)
    w = emb.weight
    verdict = P.verdict(table_path, w.numel() * w.element_size(), payload["model_path"])
    del emb, w, mapped, model
    return {"sglang_version": importlib.metadata.version("sglang"),
            "subclass": issubclass(P.Qwen4ExpForConditionalGeneration, Q.Qwen4ExpForConditionalGeneration),
            "registered": f"{registered.__module__}.{registered.__name__}",
            "table_path": table_path, "patch_table_path": patch_table_path,
            "verdict": list(verdict), "before": before, "after": _file_state(table_path),
            "names_to_upstream": received, "returned": sorted(returned)}


if __name__ == "__main__":
    run(main)
