"""The engine releases the recipes say they are checked against are the ones the tier installs:
bumping `engine.release` in a recipe without tests/conformance/versions.txt fails here, and a new
version there builds new venvs (.ci/conformance-venv keys them by it), so the tier reruns on it."""
from __future__ import annotations

import pytest

from orchestrator.paths import RECIPES_DIR
from orchestrator.recipe import load_recipe
from tests.conformance.engines import versions

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yml"))


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_release_is_the_checked_one(name):
    e = load_recipe(name).recipe.engine
    assert e.release, f"recipes/{name}.yml: engine.release names no PyPI release"
    assert e.release == versions()[e.kind], (
        f"recipes/{name}.yml: engine.release {e.release} but tests/conformance/versions.txt checks "
        f"{e.kind}=={versions()[e.kind]}: bump both")
