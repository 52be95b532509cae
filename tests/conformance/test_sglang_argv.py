"""deployctl's SGLang command lines against the released SGLang (tests/conformance/versions.txt).

Every `python3 -m sglang.launch_server ...` argv deployctl renders for the SGLang recipes goes
through the released ServerArgs parser (sglang.srt.server_args.prepare_server_args, what
launch_server's __main__ runs; probes/sglang_argv.py), and the PLE offload flags land as the
recipe's placement says. The venv is built by .ci/conformance-venv on first use; nothing is skipped.
"""
from __future__ import annotations

import pytest

from orchestrator.launch.containerspec import PLE_MOUNT
from orchestrator.deployment import load_deployment
from orchestrator.paths import INVENTORIES_DIR
from tests.conformance.engines import versions
from tests.conformance import rendered
from tests.conformance.rendered import probe_all, recipes_of, rendered_argvs

# The first test of a session may build the engine's venv (.ci/conformance-venv: minutes, once).
pytestmark = pytest.mark.timeout(1800)

SGLANG_RECIPES = {
    "qwen38-flash-next-spark": "spark1.yml",
    "qwen38-flash-next-rtx": "rtx1.yml",
}
# ple.placement -> --ple-offload-backend (orchestrator/launch/containerspec.py)
BACKEND = {"nvme": "file", "pinned": "pinned"}


ARGVS = rendered_argvs(SGLANG_RECIPES)
CASES = sorted(ARGVS)


def rejected_cases() -> dict[str, tuple[list[str], str, str]]:
    """Argvs the released parser must refuse: (argv, the stage, a text of its error)."""
    base = ARGVS[CASES[0]]

    def with_arg(flag: str, value: str) -> list[str]:
        return rendered.with_arg(base, flag, value)

    return {
        "bogus flag": (base + ["--definitely-not-an-sglang-flag", "1"], "parse",
                       "unrecognized arguments: --definitely-not-an-sglang-flag"),
        "bad backend": (with_arg("--ple-offload-backend", "disk"), "parse",
                        "argument --ple-offload-backend: invalid choice: 'disk'"),
        "bad int": (with_arg("--tp-size", "one"), "parse", "--tp-size"),
        "abbreviated flag": (base + ["--mem-fraction", "0.5"], "flags", "--mem-fraction"),
        "not launch_server": (["python3", "-m", "sglang.bench_serving"] + base[3:], "argv",
                              "sglang.launch_server"),
    }


REJECTED = rejected_cases()


@pytest.fixture(scope="module")
def sglang_results() -> dict[tuple[str, str], dict]:
    return probe_all("sglang", rendered.with_rejected(ARGVS, REJECTED))


def test_every_sglang_recipe_is_covered():
    assert recipes_of("sglang") == set(SGLANG_RECIPES)


@pytest.mark.parametrize("recipe,host", CASES, ids=[f"{r}-{h}" for r, h in CASES])
def test_sglang_accepts_rendered_argv(sglang_results, recipe, host):
    res = sglang_results[(recipe, host)]
    assert res["ok"], (f"released SGLang {versions()['sglang']} rejects deployctl's argv for recipe "
                       f"{recipe}, host {host}: stage {res['stage']}: {res['error']}\n"
                       f"argv: {ARGVS[(recipe, host)]}")


@pytest.mark.parametrize("recipe,host", CASES, ids=[f"{r}-{h}" for r, h in CASES])
def test_parsed_values_follow_the_recipe(sglang_results, recipe, host):
    res = sglang_results[(recipe, host)]
    assert res["ok"], res["error"]
    dep = load_deployment(INVENTORIES_DIR / SGLANG_RECIPES[recipe], recipe)
    r, p = dep.recipe, res["parsed"]
    assert p["model_path"] == ARGVS[(recipe, host)][ARGVS[(recipe, host)].index("--model-path") + 1]
    assert p["tp_size"] == r.parallelism.tensor_parallel
    assert p["port"] == dep.api_port and p["host"] == dep.api_listen == dep.cluster.head_host.address
    assert p["served_model_name"] == r.engine.served_name
    assert p["api_key"] is None, "deployctl renders no --api-key"
    assert p["speculative_algorithm"] == r.engine.args.get("speculative-algorithm")
    for k in ("speculative-num-steps", "speculative-eagle-topk", "speculative-num-draft-tokens",
              "context-length", "max-running-requests", "mem-fraction-static"):
        if k in r.engine.args:
            assert float(p[k.replace("-", "_")]) == float(r.engine.args[k]), k
    # The PLE table: offloaded, on the backend the placement names, in the mounted folder.
    assert p["ple_offload_backend"] == BACKEND[r.ple.placement]
    assert p["ple_offload_dir"] == (PLE_MOUNT if r.ple.placement == "nvme" else None)
    # Unset, SGLang decides the offload itself while resolving (model_overrides/qwen4_exp.py:
    # CUDA and a bf16 model dtype), and `--ple-offload-backend file` without the offload is an
    # error there (arg_groups/memory_hook.py); the recipe's table placement must not hang on that.
    assert p["ple_offload_embedding"] is True, (
        f"{recipe}: --ple-offload-embedding is {p['ple_offload_embedding']!r}; the table placement "
        f"{r.ple.placement!r} needs the offload on")
    assert set(res["flags"]) == {a for a in ARGVS[(recipe, host)] if a.startswith("--")}


def test_wrong_flags_are_reported_by_the_released_parser(sglang_results):
    rendered.assert_rejected(sglang_results, REJECTED)
