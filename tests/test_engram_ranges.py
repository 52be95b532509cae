"""Engram geometry: the prime scheme against a brute force, rank ranges for TP 1..8, `engram ranges`."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.recipe import load_recipe
from orchestrator.hostside.geometry import TableGeometry, all_rank_ranges, layer_tables, rank_ranges
from tests.engram_synth import brute_primes

SMALL = [
    ([1, 14], [50, 60, 70], 8),
    ([0], [53], 3),                 # a prime base is taken itself ("at or above")
    ([3, 5, 7], [50, 52, 50], 4),   # orders competing for the same primes, across layers
    ([2], [2, 2], 5),
]


@pytest.mark.parametrize("layers,vocab,heads", SMALL)
def test_prime_scheme_matches_brute_force(layers, vocab, heads):
    g = TableGeometry(tuple(layers), tuple(range(2, 2 + len(vocab))), heads, tuple(vocab), 16)
    want = brute_primes(layers, vocab, heads)
    got = {t.layer: [s.rows for s in t.subtables] for t in layer_tables(g)}
    assert got == want
    for t in layer_tables(g):
        starts = [s.row_start for s in t.subtables]
        assert starts == [sum(want[t.layer][:i]) for i in range(len(starts))]
        assert [(s.order, s.head) for s in t.subtables] == [(o, h) for o in g.orders for h in range(heads)]


def check_partition(g: TableGeometry, tp: int) -> None:
    sizes = {t.layer: [s.rows for s in t.subtables] for t in layer_tables(g)}
    n = len(g.orders) * g.heads_per_order
    part = -(-n // tp)
    for layer, subs in sizes.items():
        rr = [r for r in all_rank_ranges(g, tp) if r.layer == layer]
        assert [r.rank for r in rr] == list(range(tp))
        pos = 0
        for r in rr:
            h0 = min(r.rank * part, n)
            h1 = min(h0 + part, n)
            assert (r.head_start, r.head_end) == (h0, h1)
            assert r.row_start == pos == sum(subs[:h0])          # contiguous, in order
            assert r.row_end == sum(subs[:h1])
            pos = r.row_end
        assert pos == sum(subs)                                   # covers every row


@pytest.mark.parametrize("tp", range(1, 9))
def test_rank_ranges_real_geometry(tp):
    g = load_recipe("deepseek-v41-flash-tp4").recipe.engram.geometry
    check_partition(g, tp)
    if tp == 7:       # ceil(24/7) = 4: ranks 0..5 own 4 heads, rank 6 owns none
        last = rank_ranges(g, 7, 6)
        assert all(r.rows == 0 and r.head_start == r.head_end == 24 for r in last)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 5, 6, 7, 8, 13, 30])
def test_rank_ranges_small_geometry(tp):
    g = TableGeometry((1, 14), (2, 3, 4), 8, (50, 60, 70), 32)
    check_partition(g, tp)


def test_ranges_json_real_recipe():
    t0 = time.monotonic()
    r = CliRunner().invoke(cli, ["engram", "ranges", "--recipe", "deepseek-v41-flash-tp4", "--json"])
    assert r.exit_code == 0, r.output
    assert time.monotonic() - t0 < 1.0
    rows = json.loads(r.output)
    assert len(rows) == 8 and sorted({(x["rank"], x["layer"]) for x in rows}) == [
        (k, layer) for k in range(4) for layer in (1, 14)]
    g = load_recipe("deepseek-v41-flash-tp4").recipe.engram.geometry
    for t in layer_tables(g):
        mine = sorted((x for x in rows if x["layer"] == t.layer), key=lambda x: x["rank"])
        assert mine[0]["row_start"] == 0 and mine[-1]["row_end"] == t.rows
        for a, b in zip(mine, mine[1:]):
            assert a["row_end"] == b["row_start"]
        for x in mine:
            assert x["rows"] == x["row_end"] - x["row_start"]
            assert x["bytes"] == x["rows"] * (256 + 8)
            assert x["head_end"] - x["head_start"] == 6
    assert sum(x["rows"] for x in rows) == 768_022_850


def test_ranges_cli_is_fast_and_takes_overrides():
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", "engram", "ranges", "-r", "deepseek-v41-flash-tp4",
                        "--ranks", "7", "--set", "engram.scale_tensor=null"], capture_output=True, text=True)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    assert took < 2.0          # interpreter start included; the computation itself is ~0.05 s
    assert "7 rank(s), 256 B per row" in p.stdout
    lines = [ln.split() for ln in p.stdout.splitlines() if ln.strip().startswith("6 ")]
    assert lines and all(ln[6] == "0" for ln in lines)      # rank 6 of 7 owns no rows


def test_ranges_bad_ranks_is_input_error():
    r = CliRunner().invoke(cli, ["engram", "ranges", "-r", "deepseek-v41-flash-tp4", "--ranks", "0"])
    assert r.exit_code == 2
