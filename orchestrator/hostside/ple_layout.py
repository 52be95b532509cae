"""The PLE table file exactly as the released SGLang maps it: name, shape, rank shard, row placement.

Standard library only (runs on hosts inside the tables zipapp, and in planning). The rules are read
from sglang 0.5.23 (the conformance tier, tests/conformance/, checks them by calling that package):

- `sglang/srt/models/qwen4_exp.py`, `Qwen4ExpNGramEmbedding.__init__`: the table has one prime-sized
  sub-table per (order, head) (`_build_head_vocab_and_offsets`, the same scheme as geometry.py); their
  sum is padded up to the config's `make_ngram_vocab_size_divisible_by` (default 128). That padded
  count is the `org_vocab_size` of a `VocabParallelEmbedding` of width
  `ple_embed_dim / ((ngram_size - 1) * heads_per_ngram)` (160 for Qwen3.8-Flash-Next).
- `sglang/srt/layers/vocab_parallel_embedding.py`: `pad_vocab_size(org_vocab_size, 64)`, divided by
  the TP size, is a rank's row count; `VocabParallelEmbedding._get_indices` gives the rank's
  vocabulary shard `[min(r * n, org), min((r + 1) * n, org))`.
- `sglang/srt/models/qwen4_exp_ple_table.py`: `Qwen4ExpPinnedHostEmbedding.__init__` asks
  `allocate_ple_host_table(shape, dtype, backend, table_dir, tag="rows{start}-{end}")`, which maps
  `table_dir/ple_table_file_name(...)` = `ple_table_{d0}x{d1}_{torch dtype}_{bytes}B_{tag}.bin`
  read-write (`torch.from_file(shared=True)`), truncating it first when its size differs.
- `qwen4_exp.py`, `load_weights` -> `load_qwen4_exp_ple_shard`: checkpoint shard i goes to global rows
  `[i * ceil(org_vocab_size / split_ngram_parts), + its rows)` (config `split_ngram_parts`, default
  512; the padded count, not the real row total), clipped to the rank's shard
  (`copy_ple_rows_to_tp_embedding`). Rows no shard covers stay zero.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from .safetensors import DTYPE_BYTES

VOCAB_PADDING = 64                 # vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
DEFAULT_DIVISIBLE_BY = 128         # configs/qwen4_exp.py Qwen4ExpTextConfig default
DEFAULT_SPLIT_PARTS = 512          # qwen4_exp.py load_weights: getattr(text_config, "split_ngram_parts", 512)
# safetensors dtype -> str(torch dtype) without "torch." (what ple_table_file_name prints)
TORCH_DTYPE = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "BF16": "bfloat16",
               "F16": "float16", "F32": "float32"}


def _ceil_to(n: int, k: int) -> int:
    return (n + k - 1) // k * k


@dataclass(frozen=True)
class RankTable:
    """One TP rank's table file: what the engine maps and where every checkpoint row lands."""
    tp: int
    rank: int
    rows_total: int          # real rows (sum of the prime sub-table sizes)
    org_vocab_size: int      # padded to make_ngram_vocab_size_divisible_by
    rows: int                # rows in this rank's file (num_embeddings_per_partition)
    start: int               # org_vocab_start_index
    end: int                 # org_vocab_end_index
    width: int
    dtype: str               # safetensors dtype of the table (the checkpoint's)
    split_parts: int

    @property
    def torch_dtype(self) -> str:
        return TORCH_DTYPE[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.width * DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.width)

    @property
    def tag(self) -> str:
        return f"rows{self.start}-{self.end}"

    @property
    def file_name(self) -> str:
        return (f"ple_table_{self.rows}x{self.width}_{self.torch_dtype}_{self.nbytes}B_{self.tag}.bin")

    @property
    def shard_stride(self) -> int:
        """Rows between the starts of consecutive checkpoint shards (load_qwen4_exp_ple_shard)."""
        return -(-self.org_vocab_size // self.split_parts)

    def place(self, shard: int, shard_rows: int) -> tuple[int, int, int] | None:
        """(first row in this file, first row of the shard, row count) of the part of checkpoint
        shard `shard` that lands in this rank's file, or None when none of it does."""
        g0 = shard * self.shard_stride
        lo, hi = max(g0, self.start), min(g0 + shard_rows, self.end)
        if lo >= hi:
            return None
        return lo - self.start, lo - g0, hi - lo

    def to_json(self) -> dict[str, Any]:
        return {"tp": self.tp, "rank": self.rank, "rows_total": self.rows_total,
                "org_vocab_size": self.org_vocab_size, "shape": list(self.shape), "start": self.start,
                "end": self.end, "dtype": self.dtype, "torch_dtype": self.torch_dtype,
                "bytes": self.nbytes, "tag": self.tag, "file": self.file_name,
                "split_ngram_parts": self.split_parts, "shard_stride": self.shard_stride}


def rank_table(rows_total: int, width: int, dtype: str, tp: int, rank: int, *,
               divisible_by: int = DEFAULT_DIVISIBLE_BY, split_parts: int = DEFAULT_SPLIT_PARTS) -> RankTable:
    if dtype not in TORCH_DTYPE:
        raise InputError(f"dtype {dtype!r}: SGLang's PLE table is one of {sorted(TORCH_DTYPE)}",
                         key="ple.geometry.dtype")
    if tp < 1 or not 0 <= rank < tp:
        raise InputError(f"rank {rank} of TP {tp}", key="parallelism.tensor_parallel")
    org = _ceil_to(rows_total, divisible_by)
    padded = _ceil_to(org, VOCAB_PADDING)
    if padded % tp:
        # vocab_parallel_embedding's divide() asserts the same
        raise InputError(f"the padded PLE vocabulary ({padded:,} rows) does not divide by TP {tp}",
                         key="parallelism.tensor_parallel")
    per = padded // tp
    start, end = min(rank * per, org), min((rank + 1) * per, org)
    return RankTable(tp, rank, rows_total, org, per, start, end, width, dtype, split_parts)


# -- the checkpoint's config.json ----------------------------------------------------------------

CONFIG_KEYS = ("make_ngram_vocab_size_divisible_by", "split_ngram_parts")


def engine_config(checkpoint: str | Path) -> dict[str, Any]:
    """The values of config.json the engine sizes the table with (text_config wins, as in
    configs/qwen4_exp.py Qwen4ExpConfig: a top-level split_ngram_parts is dropped when a
    text_config exists), with upstream's defaults for missing keys."""
    path = Path(checkpoint) / "config.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError("the checkpoint has no config.json (SGLang sizes the PLE table from it)",
                         file=str(path)) from None
    except ValueError as e:
        raise InputError(f"not JSON: {e}", file=str(path)) from None
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
    return {"make_ngram_vocab_size_divisible_by": int(text.get("make_ngram_vocab_size_divisible_by",
                                                               DEFAULT_DIVISIBLE_BY)),
            "split_ngram_parts": int(text.get("split_ngram_parts", DEFAULT_SPLIT_PARTS)),
            "ple_embedding_dtype": text.get("ple_embedding_dtype"),
            "ple_layer_ids": text.get("ple_layer_ids")}


def check_engine_config(found: dict[str, Any], expected: dict[str, int], source: str,
                        layer: int | None = None) -> None:
    """The recipe's values (used to plan the file name) must be the checkpoint's (exit 2). `layer`
    (0-based, as in the shard tensor names) must be a PLE layer: config ple_layer_ids are 1-based
    (qwen4_exp.py _has_ple: layer_id + 1 in ple_layer_ids)."""
    bad = [f"{k}: config.json has {found[k]}, the recipe's ple.{k} is {expected[k]}"
           for k in CONFIG_KEYS if k in expected and found.get(k) != expected[k]]
    ids = found.get("ple_layer_ids")
    if layer is not None and ids is not None and layer + 1 not in ids:
        bad.append(f"ple_layer_ids: config.json has {ids} (1-based), the recipe's ple.geometry.layers "
                   f"[{layer}] (0-based) needs {layer + 1} there")
    if bad:
        raise InputError("the recipe disagrees with the checkpoint on how SGLang lays out the PLE "
                         f"table ({'; '.join(bad)}); set ple.<key> to the checkpoint's value",
                         file=source)
