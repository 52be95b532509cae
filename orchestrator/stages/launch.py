"""launch: the engine containers on every host (placeholder)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    e = dep.recipe.engine
    acts = [Action("launch", h.name, "docker-run",
                   f"start {e.kind} rank {h.rank} from {e.image} on {h.name}",
                   api=f"Docker SDK at {h.ssh_url}: containers.run({e.image})")
            for h in dep.cluster.hosts]
    return acts, ""


STAGE = Stage("launch", plan, not_implemented("launch", "launch issue"),
              "start the engine on every host")
