"""Machine architectures and image platforms: the two names of one thing.

A host names its architecture as `uname -m` does (aarch64 on a DGX Spark, x86_64 on an RTX PRO 6000
host); an image's config names its platform as the OCI image spec does (architecture arm64 with
variant v8, or amd64: opencontainers/image-spec config.md, and the platform values Go's GOARCH
uses, which Docker's `docker image inspect` shows as .Architecture / .Variant). deployctl plans with
the host's name and checks images with this table.
"""
from __future__ import annotations

from dataclasses import dataclass

# uname -m -> (OCI architecture, the variants that name the same machine; "" = unset)
_OCI = {
    "aarch64": ("arm64", ("", "v8")),
    "arm64": ("arm64", ("", "v8")),       # macOS's uname name for the same machine
    "x86_64": ("amd64", ("",)),
    "amd64": ("amd64", ("",)),
}


@dataclass(frozen=True)
class Platform:
    architecture: str          # OCI: arm64, amd64
    variant: str = ""          # OCI: v8 for arm64 (often left unset)

    @property
    def docker(self) -> str:
        """The --platform value: linux/arm64, linux/amd64."""
        return f"linux/{self.architecture}"

    def __str__(self) -> str:
        return describe(self.architecture, self.variant)


def for_machine(machine: str) -> Platform:
    """The image platform a host of this `uname -m` runs natively. ValueError for an unknown one."""
    try:
        arch, variants = _OCI[machine]
    except KeyError:
        raise ValueError(f"unknown machine architecture {machine!r} (known: aarch64, x86_64)") from None
    return Platform(arch, variants[-1])


def runs_on(architecture: str, variant: str, machine: str) -> bool:
    """An image whose config says ARCHITECTURE/VARIANT runs natively on a `uname -m` MACHINE host."""
    want = _OCI.get(machine)
    return bool(want) and architecture == want[0] and (variant or "") in want[1]


def describe(architecture: str, variant: str = "", os: str = "linux") -> str:
    """An image config's platform as Docker writes it: linux/arm64/v8, linux/amd64."""
    return f"{os or '?'}/{architecture or '?'}" + (f"/{variant}" if variant else "")
