"""What deployctl renders for the engines, as the argv tests hand it to the probes: every host of
every recipe of one engine kind, and one probe run over all of them (the engine's imports cost
seconds, paid once)."""
from __future__ import annotations

from orchestrator.deployment import load_deployment
from orchestrator.launch.containerspec import engine_argv
from orchestrator.paths import INVENTORIES_DIR, RECIPES_DIR
from orchestrator.recipe import load_recipe
from tests.conformance.engines import run_probe, versions


def rendered_argvs(recipes: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """(recipe, host) -> the argv deployctl renders for that host (workers join the head), for each
    recipe with the inventory (in inventories/) its hosts come from."""
    out = {}
    for recipe, inv in recipes.items():
        dep = load_deployment(INVENTORIES_DIR / inv, recipe)
        head = dep.cluster.head_host
        for h in dep.cluster.hosts:
            out[(recipe, h.name)] = list(engine_argv(dep, h, head.fabric_address or head.address))
    return out


def probe_all(engine: str, argvs: dict[tuple[str, str], list[str]]) -> dict[tuple[str, str], dict]:
    """One `<engine>_argv` probe run over every argv; the venv must hold versions.txt's release."""
    cases = sorted(argvs)
    ans = run_probe(f"{engine}_argv", {"argvs": [argvs[c] for c in cases]})
    assert ans[f"{engine}_version"] == versions()[engine], \
        f"the venv holds another {engine} than tests/conformance/versions.txt"
    return dict(zip(cases, ans["results"]))


def recipes_of(kind: str) -> set[str]:
    """Every recipe in recipes/ whose engine is `kind` (the tests must cover each)."""
    return {p.stem for p in RECIPES_DIR.glob("*.yml") if load_recipe(p.stem).recipe.engine.kind == kind}


def with_arg(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag` set to `value` (replaced where present, appended otherwise)."""
    a = list(argv)
    if flag in a:
        a[a.index(flag) + 1] = value
    else:
        a += [flag, value]
    return a


def with_rejected(argvs: dict[tuple[str, str], list[str]],
                  rejected: dict[str, tuple[list[str], str, str]]) -> dict[tuple[str, str], list[str]]:
    """ARGVS and the argvs of REJECTED's cases (keyed ("rejected", name)): one probe run for both."""
    return {**argvs, **{("rejected", n): c[0] for n, c in rejected.items()}}


def assert_rejected(results: dict[tuple[str, str], dict], cases: dict[str, tuple[list[str], str, str]]) -> None:
    """Every case (argv, stage, text): the `<engine>_argv` probe refused it at that stage, with that
    text in its error: the probe really rejects what the engine rejects, where the engine does."""
    for name in sorted(cases):
        res = results[("rejected", name)]
        _, stage, text = cases[name]
        assert not res["ok"], f"{name}: the probe accepted it"
        assert res["stage"] == stage, (name, res["stage"], res["error"])
        assert text in res["error"], (name, res["error"])
