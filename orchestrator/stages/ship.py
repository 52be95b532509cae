"""ship: move the image from the head to every worker (placeholder)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    e, head = dep.recipe.engine, dep.cluster.head_host
    acts = [Action("ship", w.name, "image-ship",
                   f"send the layers of {e.image} that {w.name} lacks from {head.name}",
                   command=("ssh", f"{head.user}@{head.address}",
                            f"docker save {e.image} | ssh {w.user}@{w.address} docker load"),
                   details={"image": e.image})
            for w in dep.cluster.workers]
    return acts, "" if acts else "single host: nothing to ship"


STAGE = Stage("ship", plan, not_implemented("ship", "ship issue"),
              "ship the image to every worker, only the layers it lacks")
