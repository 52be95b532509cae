"""Table geometry by the Engram prime scheme, and the per-rank partition by whole heads.

For each layer in turn and each order in turn, the sizes of that order's heads are
the next `heads_per_order` primes at or above the order's base vocabulary size,
never reusing a prime already taken by an earlier head or layer (one "seen" set
across all layers). A layer's table is its sub-tables concatenated in
(order, head) order. Ranks own whole sub-tables: ceil(heads / TP) per rank,
contiguous and in order (the last ranks may own fewer, or none).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import InputError


@dataclass(frozen=True)
class TableGeometry:
    """A hashed n-gram table: per layer, one sub-table per (order, head), prime-sized."""
    layers: tuple[int, ...]
    orders: tuple[int, ...]
    heads_per_order: int
    vocab_per_order: tuple[int, ...]   # base vocabulary size per order, same length as orders
    row_values: int                    # values per row (FP8: bytes per row)
    dtype: str = "F8_E4M3"

    def validate(self, path: str, file: str) -> None:
        if len(self.vocab_per_order) != len(self.orders):
            raise InputError(f"has {len(self.vocab_per_order)} entries but orders has "
                             f"{len(self.orders)}; give one base vocabulary size per order",
                             file=file, key=f"{path}.vocab_per_order")
        for name in ("heads_per_order", "row_values"):
            if getattr(self, name) < 1:
                raise InputError("must be >= 1", file=file, key=f"{path}.{name}")
        if not self.layers:
            raise InputError("needs at least one layer", file=file, key=f"{path}.layers")
        # sizes and orders are > 0 (a vocabulary of 0 makes no primes); layers are indices >= 0
        for name, low in (("vocab_per_order", 1), ("orders", 1), ("layers", 0)):
            for i, v in enumerate(getattr(self, name)):
                if v < low:
                    raise InputError(f"must be >= {low}, got {v}", file=file, key=f"{path}.{name}[{i}]")


_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin: exact for every n < 3.3e24 with these bases."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _SMALL_PRIMES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class SubTable:
    layer: int
    order: int
    head: int
    index: int          # position in the layer's (order, head) sequence
    rows: int           # the prime
    row_start: int      # first row in the layer's table


@dataclass(frozen=True)
class LayerTable:
    layer: int
    subtables: tuple[SubTable, ...]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.subtables)


@dataclass(frozen=True)
class RankRange:
    rank: int
    layer: int
    head_start: int     # sub-table indices [head_start, head_end)
    head_end: int
    row_start: int      # rows [row_start, row_end) of the layer's table
    row_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


def _key(g: TableGeometry) -> tuple:
    return (g.layers, g.orders, g.heads_per_order, g.vocab_per_order)


@lru_cache(maxsize=32)
def _layer_tables(key: tuple) -> tuple[LayerTable, ...]:
    layers, orders, heads, vocab = key
    seen: set[int] = set()
    out = []
    for layer in layers:
        subs, start, idx = [], 0, 0
        for order, base in zip(orders, vocab):
            cand = base
            for head in range(heads):
                while not is_prime(cand) or cand in seen:
                    cand += 1
                seen.add(cand)
                subs.append(SubTable(layer, order, head, idx, cand, start))
                start += cand
                idx += 1
                cand += 1
        out.append(LayerTable(layer, tuple(subs)))
    return tuple(out)


def layer_tables(g: TableGeometry) -> tuple[LayerTable, ...]:
    """Every layer's sub-tables with their sizes and row offsets."""
    return _layer_tables(_key(g))


def total_rows(g: TableGeometry) -> int:
    return sum(t.rows for t in layer_tables(g))


def heads_per_layer(g: TableGeometry) -> int:
    return len(g.orders) * g.heads_per_order


def rank_heads(n_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Sub-table indices [start, end) rank `rank` owns: ceil(n/TP) per rank, contiguous."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside 0..{tp - 1}")
    part = -(-n_heads // tp)
    start = min(rank * part, n_heads)
    return start, min(start + part, n_heads)


def rank_ranges(g: TableGeometry, tp: int, rank: int) -> tuple[RankRange, ...]:
    """The rows rank `rank` of `tp` owns in every layer (empty ranges where it owns no head)."""
    out = []
    for t in layer_tables(g):
        h0, h1 = rank_heads(len(t.subtables), tp, rank)
        lo = t.subtables[h0].row_start if h0 < len(t.subtables) else t.rows
        hi = t.subtables[h1].row_start if h1 < len(t.subtables) else t.rows
        out.append(RankRange(rank, t.layer, h0, h1, lo, hi))
    return tuple(out)


def all_rank_ranges(g: TableGeometry, tp: int) -> tuple[RankRange, ...]:
    return tuple(r for rank in range(tp) for r in rank_ranges(g, tp, rank))
