"""The Engram row range each TP rank loads, as the released vLLM computes it.

stdin:  {"tp": [4, 8],
         "config": {"layers": [1, 14], "orders": [2, 3, 4], "heads_per_order": 8,
                    "vocab_per_order": [16000000, 16000000, 16000000], "row_values": 256},
         "engram_config": {"cpu_offload": false}}          # optional: vllm serve --engram-config
stdout: {"vllm_version": "0.33.0",
         "hf_config": {engram_* attributes given to EngramLayout},
         "layers": [{"layer": 1, "index": 0, "head_sizes": [primes...], "rows": sum}, ...],
         "ranges": {"4": [{"rank": 0, "layer": 1, "head_start": 0, "head_end": 6,
                           "lo": 0, "hi": ..., "loader_lo": ..., "loader_hi": ...,
                           "part_n_hash_cols": 6}, ...], "8": [...]}}

What runs is the released vllm/models/deepseek_v41/common/engram.py:
  EngramLayout.from_config(config)   the prime-sized bucket ranges (find_next_prime, one "seen"
                                     set over all layers), per layer in engram_layer_ids order
  Engram._create_embedding(None, layout, layer_hash_index)   as DeepseekV41 decoder layers call
                                     it (layer_hash_index = layout.layer_ids.index(layer))
  -> ParallelEngramEmbedding.__init__: part_n_hash_cols = cdiv(n_hash_cols, num_shards), the
     rank's heads [head_start, head_start + part), rows [vocab_start_idx, vocab_end_idx), and
     the weight loader's narrow(engram_vocab_start, weight rows) (_engram_head_shard_weight_loader)
built under torch.device("meta") (so nothing is allocated) with only these replaced:
  get_tensor_model_parallel_rank / _world_size (engram's own imports) -> the rank and TP asked
  get_current_vllm_config -> an object whose engram_config is the released EngramConfig(**given)
  torch.cuda.get_device_properties / torch.accelerator.current_device_index -> a stand-in device
     (the module reads the SM count at init; no GPU here)
  is_uva_available -> True, only when engram_config asks for cpu_offload (a host capability)
The Engram DP group stays uninitialised, so get_engram_dp_size() is 1: TP-only sharding, which is
what deployctl's recipes run (one replica spread over the nodes).
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import run  # noqa: E402


def hf_engram_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """deployctl's geometry -> the checkpoint config attributes EngramLayout reads."""
    if "engram_layer_ids" in cfg:                 # already in the checkpoint's own terms
        return dict(cfg)
    orders = [int(o) for o in cfg["orders"]]
    max_n = max(orders)
    if orders != list(range(2, max_n + 1)):
        raise ValueError(f"orders {orders}: vLLM hashes every n-gram size 2..max "
                         f"(engram_max_ngram_size), so orders must be 2..{max_n} in order")
    vocab = {int(v) for v in cfg["vocab_per_order"]}
    if len(vocab) != 1:
        raise ValueError(f"vocab_per_order {cfg['vocab_per_order']}: vLLM has one "
                         f"engram_vocab_size for every order")
    return {"engram_layer_ids": [int(x) for x in cfg["layers"]],
            "engram_max_ngram_size": max_n,
            "engram_n_heads": int(cfg["heads_per_order"]),
            "engram_vocab_size": vocab.pop(),
            "engram_head_dim": int(cfg["row_values"]),
            # not used by the layout's primes nor by the sharding; real values come with the
            # checkpoint (tokenizer-derived) and only feed the hash multipliers
            "engram_compressed_vocab_size": int(cfg.get("compressed_vocab_size", 1)),
            "engram_pad_token_id": int(cfg.get("pad_token_id", 0))}


def main(payload: dict[str, Any]) -> dict[str, Any]:
    import importlib.metadata

    import torch

    from vllm.config.engram import EngramConfig
    from vllm.models.deepseek_v41.common import engram as E

    hf = hf_engram_config(payload["config"])
    ecfg = EngramConfig(**payload.get("engram_config", {}))

    # The tables' row counts (engram_num_embeddings) come with the checkpoint; the primes do not
    # depend on them, so a first layout gives them: each layer's table holds exactly its buckets.
    probe_cfg = types.SimpleNamespace(**hf, engram_num_embeddings=[0] * len(hf["engram_layer_ids"]))
    first = E.EngramLayout.from_config(probe_cfg)
    if "engram_num_embeddings" not in hf:
        hf["engram_num_embeddings"] = [sum(p for order in layer for p in order)
                                       for layer in first.primes]
    layout = E.EngramLayout.from_config(types.SimpleNamespace(**hf))

    layers = []
    for i, layer in enumerate(layout.layer_ids):
        sizes = [p for order in layout.primes[i] for p in order]
        layers.append({"layer": layer, "index": i, "head_sizes": sizes, "rows": sum(sizes),
                       "num_embeddings": layout.num_embeddings[i]})

    state = {"rank": 0, "tp": 1}
    E.get_tensor_model_parallel_rank = lambda: state["rank"]
    E.get_tensor_model_parallel_world_size = lambda: state["tp"]
    E.get_current_vllm_config = lambda: types.SimpleNamespace(engram_config=ecfg)
    if ecfg.cpu_offload:
        E.is_uva_available = lambda: True
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(multi_processor_count=1)
    torch.accelerator.current_device_index = lambda: 0

    ranges: dict[str, list[dict[str, Any]]] = {}
    for tp in payload["tp"]:
        out = []
        for rank in range(int(tp)):
            state.update(rank=rank, tp=int(tp))
            for i, layer in enumerate(layout.layer_ids):
                with torch.device("meta"):
                    emb = E.Engram._create_embedding(None, layout, layout.layer_ids.index(layer))
                out.append({"rank": rank, "layer": layer,
                            "head_start": emb.head_start,
                            "head_end": min(emb.head_start + emb.part_n_hash_cols, emb.n_hash_cols),
                            "part_n_hash_cols": emb.part_n_hash_cols,
                            "lo": emb.vocab_start_idx, "hi": emb.vocab_end_idx,
                            "loader_lo": emb.weight.engram_vocab_start,
                            "loader_hi": emb.weight.engram_vocab_start + emb.weight.shape[0],
                            "weight_shape": list(emb.weight.shape),
                            "weight_dtype": str(emb.weight.dtype).replace("torch.", ""),
                            "scale_shape": list(emb.weight_scale_inv.shape)})
        ranges[str(tp)] = out
    return {"vllm_version": importlib.metadata.version("vllm"), "hf_config": hf,
            "engram_config": {k: getattr(ecfg, k) for k in ("cpu_offload", "embedding_across_dp",
                                                            "dp_shared_memory", "use_thp")},
            "layers": layers, "ranges": ranges}


if __name__ == "__main__":
    run(main)
