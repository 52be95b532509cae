"""build: the serving image chain on the head's Docker engine (placeholder)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    e, head = dep.recipe.engine, dep.cluster.head_host
    act = Action("build", head.name, "docker-build",
                 f"build image {e.image} from chain {e.chain} on {head.name}'s engine",
                 api=f"Docker SDK at {head.ssh_url}: build chain {e.chain} -> {e.image}",
                 details={"image": e.image, "chain": e.chain})
    return [act], ""


STAGE = Stage("build", plan, not_implemented("build", "image build issue"),
              "build the serving image, cached per layer, on the head node")
