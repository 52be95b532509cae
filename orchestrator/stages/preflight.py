"""preflight: check every host before anything is touched (placeholder until the sizing issue)."""
from __future__ import annotations

from ..plan import Action
from ._pending import not_implemented
from .base import Stage


def plan(dep):
    acts = [Action("preflight", h.name, "ssh-checks",
                   f"check {h.name} ({h.address}): SSH host key, Docker engine, GPUs, arch, free space, RAM",
                   command=("ssh", "-p", str(h.port), f"{h.user}@{h.address}",
                            "uname -m; nproc; free -b; df -B1 --output=avail " + h.nvme_dir +
                            "; docker info --format '{{json .}}'"))
            for h in dep.cluster.hosts]
    return acts, ""


STAGE = Stage("preflight", plan, not_implemented("preflight", "sizing and preflight issue"),
              "check SSH, Docker, GPUs, architecture, free space and RAM on every host")
