"""sync-model: every node has the exact checkpoint (placeholder)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    head = dep.cluster.head_host
    src = dep.checkpoint_dir(head)
    acts = [Action("sync-model", w.name, "rsync",
                   f"sync the checkpoint {src} from {head.name} to {w.name}",
                   command=("rsync", "-a", "--partial", f"{src}/",
                            f"{w.user}@{w.address}:{dep.checkpoint_dir(w)}/"))
            for w in dep.cluster.workers]
    return acts, "" if acts else "single host: the head's copy is the only one"


STAGE = Stage("sync-model", plan, not_implemented("sync-model", "checkpoint distribution issue"),
              "give every node the exact checkpoint")
