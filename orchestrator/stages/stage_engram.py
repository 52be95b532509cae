"""stage-engram: each rank's Engram rows onto its NVMe (placeholder)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    eg = dep.recipe.engram
    if eg is None:
        return [], "recipe has no Engram tables"
    if eg.placement != "nvme":
        return [], f"Engram placement is {eg.placement}: nothing to stage on NVMe"
    acts = [Action("stage-engram", h.name, "ansible-playbook",
                   f"stage rank {h.rank}'s Engram rows to {dep.engram_dir(h)}",
                   command=("deployctl", "engram", "stage", "--checkpoint", dep.checkpoint_dir(h),
                            "--dest", dep.engram_dir(h), "--rank", str(h.rank)))
            for h in dep.cluster.hosts]
    return acts, ""


STAGE = Stage("stage-engram", plan, not_implemented("stage-engram", "Engram issue"),
              "extract each rank's Engram rows onto its NVMe")
