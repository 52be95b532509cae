"""Facts about the hardware kinds deployctl knows (docs/deployment-facts.md, "Hardware kinds")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["dgx-spark", "rtx-pro-6000", "b300"]


@dataclass(frozen=True)
class HardwareKind:
    name: str
    unified_memory: bool        # CPU and GPU share one pool: pinning a table frees nothing
    gpu_memory_gb: float        # per GPU (for unified: the whole pool)
    arch: str                   # the machine architecture `uname -m` reports
    default_gpus: int
    placements: tuple[str, ...]  # where a conditional-memory table may live


KINDS: dict[str, HardwareKind] = {
    "dgx-spark": HardwareKind("dgx-spark", True, 128.0, "aarch64", 1, ("nvme", "memory", "gpu")),
    "rtx-pro-6000": HardwareKind("rtx-pro-6000", False, 96.0, "x86_64", 1,
                                 ("pinned", "memory", "nvme", "gpu")),
    "b300": HardwareKind("b300", False, 288.0, "x86_64", 8, ("gpu", "pinned", "memory", "nvme")),
}
