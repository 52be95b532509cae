"""Qwen4-Exp whose loader keeps a pre-written PLE table file (sglang 0.5.23).

Upstream (sglang/srt/models/qwen4_exp.py, `load_weights` -> `load_qwen4_exp_ple_shard` ->
`copy_ple_rows_to_tp_embedding`) copies every checkpoint shard of the n-gram table into the
file-backed mapping at every boot: 47.7 GiB through page faults, 10 minutes for a new file and 55
when the file is already there. When every PLE table of the model is a file deployctl wrote and
checked (prewritten.verdict), this class drops the shard tensors from the weight stream before
upstream's loader sees them and reports their parameters as loaded, as upstream does after copying.
In every other case (pinned backend, no manifest, any mismatch) it is upstream's load_weights.
"""
from __future__ import annotations

import logging
import os
from typing import Iterable, Tuple

import torch

from sglang.srt.environ import envs
from sglang.srt.models import qwen4_exp as upstream
from sglang.srt.models.qwen4_exp_ple_table import ple_table_file_name

from .prewritten import verdict

logger = logging.getLogger(__name__)
SHARD_MARK = ".ngram_embedding.shard_"


def table_path(module) -> str | None:
    """The file allocate_ple_host_table mapped for one Qwen4ExpNGramEmbedding (None: not a file)."""
    emb = module.ngram_embedding
    if not isinstance(emb, upstream.Qwen4ExpPinnedHostEmbedding):
        return None
    if getattr(module.config, "ple_offload_backend", "pinned") != "file":
        return None
    table_dir = os.path.expanduser(getattr(module.config, "ple_offload_dir", None)
                                   or envs.SGLANG_QWEN4_PLE_FILE_DIR.get())
    tag = (f"rows{emb.shard_indices.org_vocab_start_index}"
           f"-{emb.shard_indices.org_vocab_end_index}")     # as Qwen4ExpPinnedHostEmbedding.__init__
    return os.path.join(table_dir, ple_table_file_name(emb.weight.shape, emb.weight.dtype, tag))


def skip_shards(weights: Iterable[Tuple[str, torch.Tensor]]):
    """The weight stream without the PLE shard tensors (they are never read from disk)."""
    for name, tensor in weights:
        if SHARD_MARK not in name:
            yield name, tensor


class Qwen4ExpForConditionalGeneration(upstream.Qwen4ExpForConditionalGeneration):
    def load_weights(self, weights):
        modules = {n: m for n, m in self.named_modules() if isinstance(m, upstream.Qwen4ExpNGramEmbedding)}
        model_path = getattr(self.config, "_name_or_path", "") or ""
        kept = []
        for name, module in modules.items():
            path = table_path(module)
            if path is None:
                return super().load_weights(weights)
            w = module.ngram_embedding.weight
            ok, why = verdict(path, w.numel() * w.element_size(), model_path)
            logger.info("PLE table %s: %s", "kept" if ok else "written by the loader", why)
            if not ok:
                return super().load_weights(weights)
            kept.append(name)
        if not kept:
            return super().load_weights(weights)
        loaded = super().load_weights(skip_shards(weights))
        # what load_qwen4_exp_ple_shard records after a copy (loaded_shard_params)
        loaded.update(f"{name}.ngram_embedding.weight" for name in kept)
        return loaded


EntryClass = [Qwen4ExpForConditionalGeneration]
