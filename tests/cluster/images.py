"""Base images made on this machine (nothing can be pulled here), and moving images between engines.

- dctl-busybox:latest  the busybox-static binary plus its applet links (a few MB, made in ~1 s)
- dctl-debian:bookworm debootstrap minbase + python3 + ca-certificates (~260 MB, ~1 min the first
                       time; the rootfs tarball is cached under CACHE_DIR so a wiped engine re-imports
                       it in seconds), plus the Hugging Face Hub client (HUB_CLIENT, from PyPI wheels
                       cached under CACHE_DIR), as the vLLM and SGLang images the double stands in for
                       ship it: fetch-model runs it from the serving image

Both are cached in the local engine: `docker image inspect` finds them -> nothing is done.
`ensure_base_images(arch="aarch64")` makes their arm64 counterparts instead, dctl-busybox:latest-arm64
and dctl-debian:bookworm-arm64 (tests/cluster/arm64.py); base_image_names says which is which.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

BUSYBOX_IMAGE = "dctl-busybox:latest"
DEBIAN_IMAGE = "dctl-debian:bookworm"
CACHE_DIR = Path("/var/cache/deployctl-testcluster")
DEBIAN_TARBALL = CACHE_DIR / "dctl-debian-bookworm.rootfs.tar"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_ROOTFS_IMAGE = "dctl-debian-rootfs:bookworm"
HUB_CLIENT = "huggingface_hub==2.4.0"          # the same pin as pyproject's test extra
HUB_LABEL = "deployctl.hub-client"
WHEELS_DIR = CACHE_DIR / "wheels"
LOCAL_ENGINE = "unix:///var/run/docker.sock"


def _docker(engine: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", engine, *args], **kw)


def image_present(image: str, engine: str = LOCAL_ENGINE) -> bool:
    return _docker(engine, "image", "inspect", image, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL).returncode == 0


@contextlib.contextmanager
def _cache_lock() -> Iterator[None]:
    """Two runs at once (a person's `up` and a pytest session) must not build the same image twice."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` (from /proc/self/mountinfo)."""
    prefix = str(path).rstrip("/") + "/"
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            mp = line.split()[4].replace("\\040", " ")
            if mp == str(path) or mp.startswith(prefix):
                out.append(mp)
    return out


def _rmtree_no_mounts(path: Path) -> None:
    """rmtree follows into mounted filesystems: unmount first (debootstrap may leave /proc mounted)."""
    for mp in sorted(mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], check=False)
    if mounts_under(path):
        raise RuntimeError(f"refusing to delete {path}: still has mounts {mounts_under(path)}")
    shutil.rmtree(path, ignore_errors=True)


def _import_tar(tar_cmd: list[str], image: str, changes: list[str], engine: str) -> None:
    args = ["docker", "-H", engine, "import"]
    for c in changes:
        args += ["--change", c]
    args += ["-", image]
    tar = subprocess.Popen(tar_cmd, stdout=subprocess.PIPE)
    try:
        imp = subprocess.run(args, stdin=tar.stdout, capture_output=True, text=True)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        tar_rc = tar.wait()
    if tar_rc != 0 or imp.returncode != 0:
        raise RuntimeError(f"docker import {image} failed (tar rc {tar_rc}, import rc {imp.returncode}): "
                           f"{imp.stderr.strip()[-2000:]}")


def busybox_root(root: Path, busybox: Path, applets: list[str]) -> None:
    """A minimal root filesystem in ROOT: BUSYBOX (of whatever architecture) and a link per applet."""
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root", "var", "usr"):
        (root / d).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "tmp", 0o1777)
    shutil.copy2(busybox, root / "bin" / "busybox")
    for applet in applets:
        if applet != "busybox":
            (root / "bin" / applet).symlink_to("busybox")
    (root / "usr" / "bin").symlink_to("../bin")
    (root / "sbin").symlink_to("bin")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (root / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")


def build_busybox(engine: str = LOCAL_ENGINE) -> None:
    busybox = shutil.which("busybox") or "/bin/busybox"
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="dctl-busybox-") as tmp:
        root = Path(tmp)
        busybox_root(root, Path(busybox), applets)
        _import_tar(["tar", "-C", str(root), "--numeric-owner", "-c", "."], BUSYBOX_IMAGE,
                    ['CMD ["/bin/sh"]'], engine)


def _debootstrap_tarball() -> None:
    """debootstrap into a scratch folder, then pack it to DEBIAN_TARBALL (atomically: .part + rename)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    root = CACHE_DIR / "rootfs-bookworm.tmp"
    if root.exists():
        _rmtree_no_mounts(root)
    try:
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=python3,ca-certificates",
             "bookworm", str(root), DEBIAN_MIRROR],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
        for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / sub).glob("*"):
                if p.is_file():
                    p.unlink()
        for mp in sorted(mounts_under(root), key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], check=False)
        part = DEBIAN_TARBALL.with_name(DEBIAN_TARBALL.name + ".part")
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], check=True)
        with open(part, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(part, DEBIAN_TARBALL)
    finally:
        _rmtree_no_mounts(root)


def build_debian(engine: str = LOCAL_ENGINE) -> None:
    if not DEBIAN_TARBALL.exists():
        _debootstrap_tarball()
    if not image_present(DEBIAN_ROOTFS_IMAGE, engine):
        _import_tar(["cat", str(DEBIAN_TARBALL)], DEBIAN_ROOTFS_IMAGE,
                    ['CMD ["/bin/bash"]', "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                     "ENV LANG=C.UTF-8"], engine)
    _add_hub_client(engine)


def _add_hub_client(engine: str) -> None:
    """DEBIAN_IMAGE = the rootfs + HUB_CLIENT and its dependencies in /usr/local/lib/python3.11/
    dist-packages (installed here with --target: this machine's python is 3.11 on x86_64, as bookworm's)."""
    import sys
    if sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"the image's python is 3.11; installing {HUB_CLIENT} for it needs python 3.11 here")
    WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    have = subprocess.run([*pip, "download", "--no-index", "--find-links", str(WHEELS_DIR), "-d", str(WHEELS_DIR),
                           HUB_CLIENT], capture_output=True, text=True)
    if have.returncode != 0:
        subprocess.run([*pip, "download", "-d", str(WHEELS_DIR), HUB_CLIENT], check=True, capture_output=True)
    with tempfile.TemporaryDirectory(prefix="dctl-debian-hub-") as tmp:
        site = Path(tmp) / "site"
        subprocess.run([*pip, "install", "--no-index", "--find-links", str(WHEELS_DIR), "--target", str(site),
                        HUB_CLIENT], check=True, capture_output=True)
        (Path(tmp) / "Dockerfile").write_text(
            f"FROM {DEBIAN_ROOTFS_IMAGE}\nCOPY site/ /usr/local/lib/python3.11/dist-packages/\n"
            f"LABEL {HUB_LABEL}={HUB_CLIENT}\n")
        p = subprocess.run(["docker", "-H", engine, "build", "-q", "-t", DEBIAN_IMAGE, tmp],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"building {DEBIAN_IMAGE} failed: {p.stderr[-2000:]}")


def _debian_current(engine: str) -> bool:
    """DEBIAN_IMAGE is there and carries this checkout's Hub client (an older one is rebuilt)."""
    p = _docker(engine, "image", "inspect", "--format", f'{{{{index .Config.Labels "{HUB_LABEL}"}}}}',
                DEBIAN_IMAGE, capture_output=True, text=True)
    return p.returncode == 0 and p.stdout.strip() == HUB_CLIENT


def base_image_names(arch: str | None = None) -> dict[str, str]:
    """{canonical name: the local engine's image of ARCH} (default this machine's architecture)."""
    from . import arm64
    if arch is not None and arm64.emulated(arch):
        return {BUSYBOX_IMAGE: arm64.BUSYBOX_IMAGE, DEBIAN_IMAGE: arm64.DEBIAN_IMAGE}
    return {BUSYBOX_IMAGE: BUSYBOX_IMAGE, DEBIAN_IMAGE: DEBIAN_IMAGE}


def ensure_base_images(engine: str = LOCAL_ENGINE, debian: bool = True, arch: str | None = None) -> list[str]:
    """Make the base images in the local engine unless `docker image inspect` already finds them.
    ARCH "aarch64" (or "arm64"): the arm64 ones (base_image_names); default this machine's."""
    if arch is not None:
        from . import arm64
        if arm64.emulated(arch):
            with _cache_lock():
                return arm64.ensure_images(engine, debian)
    made = []
    with _cache_lock():
        if not image_present(BUSYBOX_IMAGE, engine):
            build_busybox(engine)
            made.append(BUSYBOX_IMAGE)
        if debian and not _debian_current(engine):
            build_debian(engine)
            made.append(DEBIAN_IMAGE)
    return made


def copy_image(image: str | list[str], src_engine: str, dst_engine: str, timeout: float = 600) -> None:
    """docker save IMAGE... (src engine) | docker load (dst engine), streamed through a pipe. Several
    references go in one archive: each keeps its tag and its own config (a build cache's step images)."""
    refs = [image] if isinstance(image, str) else list(image)
    save = subprocess.Popen(["docker", "-H", src_engine, "save", *refs], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        load = subprocess.run(["docker", "-H", dst_engine, "load", "-q"], stdin=save.stdout,
                              capture_output=True, text=True, timeout=timeout)
    finally:
        assert save.stdout is not None
        save.stdout.close()
        try:
            save.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            save.kill()
            save.wait()
    save_err = save.stderr.read().decode(errors="replace") if save.stderr else ""
    if save.stderr:
        save.stderr.close()
    if save.returncode != 0 or load.returncode != 0:
        raise RuntimeError(f"moving {image} from {src_engine} to {dst_engine} failed: "
                           f"save rc {save.returncode} {save_err.strip()[-1000:]}; "
                           f"load rc {load.returncode} {load.stderr.strip()[-1000:]}")
