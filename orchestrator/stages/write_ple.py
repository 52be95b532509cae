"""write-ple: Qwen's memory-mapped n-gram table file on NVMe (placeholder)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    ple = dep.recipe.ple
    if ple is None:
        return [], "recipe has no PLE table"
    if ple.placement != "nvme":
        return [], f"PLE placement is {ple.placement}: no file to write"
    acts = [Action("write-ple", h.name, "ansible-playbook",
                   f"write the PLE table file to {dep.ple_dir(h)}",
                   command=("deployctl", "ple", "write", "--checkpoint", dep.checkpoint_dir(h),
                            "--dest", dep.ple_dir(h)))
            for h in dep.cluster.hosts]
    return acts, ""


STAGE = Stage("write-ple", plan, not_implemented("write-ple", "PLE issue"),
              "write the memory-mapped PLE table file once")
