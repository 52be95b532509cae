"""A tiny base image whose config says linux/arm64/v8, for the image-platform tests on this x86-64
machine: Debian bookworm's busybox-static for arm64 (its pinned .deb from the Debian mirror, cached
outside the repository) as one layer, written as a `docker load` tarball (manifest.json, config, layer)
with the architecture in the config: `docker import --platform` is ignored by Docker 20.10, and a
save/edit/load round trip differs between engines (26 saves OCI layouts), while this tarball loads on
both. The same rootfs can be labelled amd64 (`arch="amd64"`): an image of the wrong platform for the
refusal tests (nothing in it runs).

Its binaries run on x86-64 only under qemu-user (Debian's qemu-user-static registers qemu-aarch64 with
binfmt_misc, flags PF: it also works inside containers); `emulates_arm64()` says whether they do here.
tests/cluster/images.py may grow its own arm64 bases; this one is made in well under a second.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import urllib.request
from pathlib import Path

MIRROR = os.environ.get("DEPLOYCTL_DEBIAN_MIRROR") or "http://deb.debian.org/debian"
DEB = "pool/main/b/busybox/busybox-static_1.35.0-4+deb12u1+b1_arm64.deb"
DEB_SHA256 = "732c9135564fc71337e0e05fb4da4d11e6c28c1834bce3e405e575afef2a52f5"   # bookworm arm64 Packages
CACHE = Path("/var/cache/deployctl-testcluster/arm64")
APPLETS = ("sh", "uname", "cat", "ls", "echo", "test", "true", "mkdir", "cp", "rm", "env", "grep", "sed")
MTIME = 946684800


def _deb() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / DEB.rsplit("/", 1)[-1]
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == DEB_SHA256:
        return path
    data = urllib.request.urlopen(f"{MIRROR}/{DEB}", timeout=120).read()
    got = hashlib.sha256(data).hexdigest()
    if got != DEB_SHA256:
        raise RuntimeError(f"{MIRROR}/{DEB}: sha256 {got}, pinned {DEB_SHA256}")
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def _busybox() -> bytes:
    fs = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(_deb())], capture_output=True, check=True,
                        timeout=60).stdout
    with tarfile.open(fileobj=io.BytesIO(fs)) as t:
        member = t.extractfile("./bin/busybox")
        assert member is not None
        return member.read()


def _layer(busybox: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            ti = tarfile.TarInfo(name)
            ti.type, ti.mode, ti.mtime, ti.size, ti.linkname = kind, mode, MTIME, len(data), link
            t.addfile(ti, io.BytesIO(data) if data else None)
        for d in ("bin", "etc", "tmp", "opt"):
            add(d, tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755)
        add("bin/busybox", tarfile.REGTYPE, 0o755, busybox)
        for a in APPLETS:
            add(f"bin/{a}", tarfile.SYMTYPE, 0o777, link="busybox")
    return buf.getvalue()


def image_tar(tag: str, arch: str = "arm64", variant: str = "v8") -> bytes:
    """A `docker load` tarball of the busybox rootfs tagged TAG, its config saying linux/ARCH[/VARIANT]."""
    layer = _layer(_busybox())
    layer_sha = hashlib.sha256(layer).hexdigest()
    config = {"architecture": arch, **({"variant": variant} if variant else {}), "os": "linux",
              "created": "2000-01-01T00:00:00Z",
              "config": {"Cmd": ["/bin/sh"], "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
              "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_sha}"]},
              "history": [{"created": "2000-01-01T00:00:00Z", "created_by": f"tests/arm64_base.py: {DEB}"}]}
    cfg = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    cfg_name = hashlib.sha256(cfg).hexdigest() + ".json"
    manifest = json.dumps([{"Config": cfg_name, "RepoTags": [tag], "Layers": [f"{layer_sha}/layer.tar"]}]).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, data in ((f"{layer_sha}/layer.tar", layer), (cfg_name, cfg), ("manifest.json", manifest)):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), MTIME, 0o644
            t.addfile(ti, io.BytesIO(data))
    return out.getvalue()


def load(client, tag: str, arch: str = "arm64", variant: str = "v8") -> str:
    """TAG in CLIENT's engine (a Docker SDK client), made when missing; its image ID."""
    import docker
    try:
        attrs = client.api.inspect_image(tag)
        if attrs.get("Architecture") == arch and (attrs.get("Variant") or "") == variant:
            return attrs["Id"]
    except docker.errors.ImageNotFound:
        pass
    client.images.load(image_tar(tag, arch, variant))
    return client.api.inspect_image(tag)["Id"]


def emulates_arm64() -> bool:
    """Whether arm64 binaries run on this machine (natively, or qemu-aarch64 through binfmt_misc)."""
    if os.uname().machine == "aarch64":
        return True
    try:
        return Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").read_text().splitlines()[0].strip() == "enabled"
    except (OSError, IndexError):
        return False
