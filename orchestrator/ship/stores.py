"""What differs between the Docker engines and image stores users run, for ship and preflight (pure).

  graph-driver store (Docker 20.10; 25+ unless switched): an image ID is its config digest; layers are
      kept uncompressed, so a layer blob's digest is its diff_id.
  containerd image store (`"features": {"containerd-snapshotter": true}`; the default of fresh installs
      of Docker 29): an image ID is its manifest (or index) digest; layers stay compressed as they came,
      so a blob's name is not a diff_id and only the manifest links the two.

`docker save` writes the legacy layout (one folder per layer, named by a v1 ID) up to Docker 24 and
the OCI image layout from 25.0 (blobs/sha256/<hex>, index.json, plus a manifest.json whose layers are
blob paths; moby v25.0.0 release notes). The image config's digest is the one identity every store
keeps: loading an archive into another store keeps the config's bytes, not the manifest.

Measured on Debian's 20.10.24 and 26.1.5 (tests/test_engines.py): an archive with layers left out
loads wherever it is in the OCI layout; a containerd-store engine refuses a legacy-layout archive that
lacks a layer folder ("failed to resolve layers"), so that combination gets the whole image.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

MIN_VERSION = (20, 10)        # the oldest engine deployctl supports (API 1.41; what it is tested on)
OCI_SAVE_FROM = (25, 0)       # `docker save` writes the OCI image layout from here on
CONTAINERD_DRIVER = "io.containerd.snapshotter.v1"
# `docker info` in one line: version, graph driver, its status pairs (driver-type names the store)
INFO_FORMAT = "{{.ServerVersion}} {{.Driver}} {{json .DriverStatus}}"


def parse_version(text: str) -> tuple[int, int] | None:
    """'26.1.5+dfsg1' -> (26, 1); '20.10.24' -> (20, 10); None when it is no version."""
    m = re.match(r"^v?(\d+)\.(\d+)", text.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class EngineFacts:
    version: str
    driver: str = ""
    containerd_store: bool = False

    @property
    def store(self) -> str:
        return "containerd image store" if self.containerd_store else f"graph-driver store ({self.driver or '?'})"

    @property
    def oci_save(self) -> bool:
        """Its `docker save` writes the OCI image layout (blobs named by digest)."""
        v = parse_version(self.version)
        return bool(v and v >= OCI_SAVE_FROM)

    def too_old(self) -> str | None:
        """Why this engine is refused, or None."""
        v = parse_version(self.version)
        if v is None:
            return f"cannot read the engine's version ({self.version!r})"
        if v < MIN_VERSION:
            return (f"Docker {self.version} is too old: deployctl needs Docker Engine "
                    f"{MIN_VERSION[0]}.{MIN_VERSION[1]} or newer (upgrade the engine on this host)")
        return None

    def describe(self) -> str:
        return f"Docker {self.version}, {self.store}"


def facts_from_info(info: dict) -> EngineFacts:
    """From `docker info`'s JSON (or the INFO_FORMAT fields)."""
    status = info.get("DriverStatus") or []
    containerd = any(isinstance(p, list) and len(p) == 2 and p[1] == CONTAINERD_DRIVER for p in status)
    return EngineFacts(str(info.get("ServerVersion") or ""), str(info.get("Driver") or ""), containerd)


def facts_from_line(line: str) -> EngineFacts:
    """From one line printed with INFO_FORMAT."""
    version, _, rest = line.strip().partition(" ")
    driver, _, status = rest.partition(" ")
    try:
        pairs = json.loads(status) if status else []
    except ValueError:
        pairs = []
    return facts_from_info({"ServerVersion": version, "Driver": driver, "DriverStatus": pairs})
