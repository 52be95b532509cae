"""The Docker engines a test host can run: the machine's own 20.10, and Docker 26 on either image store.

  20.10           Debian bookworm's docker.io (the system's dockerd, graph-driver store, overlay2)
  26              Debian trixie's docker.io 26.1.5 + containerd 1.7.24, graph-driver store (overlay2)
  26-containerd   the same binaries with the containerd image store
                  (daemon.json {"features": {"containerd-snapshotter": true}}, the default of fresh
                  Docker Engine installs since 29)

Docker 26 is fetched on demand with apt from the trixie suite of the mirror this machine already
uses, through a sources folder and lists folder of its own (the system's apt state is untouched),
unpacked with `dpkg-deb -x` into /var/cache/deployctl-testcluster/engines/docker-26/ and kept there.
Its dockerd runs with that bin folder first on PATH (its containerd and shims) and the system's runc
(trixie's runc wants a newer glibc): verified on this machine kind, docs/../shared/reference/test-cluster.md.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("/var/cache/deployctl-testcluster/engines")
MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
PACKAGES = ("docker.io", "containerd", "docker-cli")
# from the .debs: the daemon side, and the CLI a host's SSH sessions get first on PATH
BINARIES = ("usr/sbin/dockerd", "usr/sbin/docker-proxy", "usr/bin/containerd", "usr/bin/containerd-shim",
            "usr/bin/containerd-shim-runc-v1", "usr/bin/containerd-shim-runc-v2", "usr/bin/ctr",
            "usr/bin/docker")
DEFAULT = "26"                # what the suite runs on (what users run); DCTL_ENGINE overrides it


class EngineError(RuntimeError):
    pass


@dataclass(frozen=True)
class Engine:
    name: str                 # 20.10 | 26 | 26-containerd
    bundle: str | None        # the cached bundle's folder name (None: the system's binaries)
    containerd_store: bool

    @property
    def bin_dir(self) -> Path | None:
        return CACHE / self.bundle / "bin" if self.bundle else None

    def daemon_json(self) -> str:
        return '{"features": {"containerd-snapshotter": true}}\n' if self.containerd_store else "{}\n"

    def path_env(self) -> str:
        """PATH for this engine's dockerd and for a host's SSH sessions (its `docker` CLI first)."""
        system = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        return f"{self.bin_dir}:{system}" if self.bin_dir else system


ENGINES = {
    "20.10": Engine("20.10", None, False),
    "26": Engine("26", "docker-26", False),
    "26-containerd": Engine("26-containerd", "docker-26", True),
}


def get(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise EngineError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}") from None


def default_name() -> str:
    return os.environ.get("DCTL_ENGINE") or DEFAULT


def per_host(spec: str | list[str] | None, n: int) -> list[str]:
    """Engine names for hosts node1..nodeN from 'E' (all) or 'E1,E2,...' (per host, the last one
    repeated): '26-containerd,20.10' = the head on the containerd store, every worker on 20.10."""
    if spec is None:
        names = [default_name()]
    elif isinstance(spec, str):
        names = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        names = list(spec)
    if not names:
        raise EngineError("--engine: no engine named")
    for name in names:
        get(name)
    return [names[min(i, len(names) - 1)] for i in range(n)]


def ensure(engine: Engine, log=lambda m: None) -> None:
    """Make ENGINE's binaries available (a no-op for the system's; fetched once, then cached)."""
    if engine.bundle is None:
        if not shutil.which("dockerd"):
            raise EngineError("no dockerd on this machine: install docker.io (.ci/setup does)")
        return
    folder = CACHE / engine.bundle
    if (folder / "bin" / "dockerd").exists():
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{engine.bundle}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another session fetching the same bundle: wait for it
        if (folder / "bin" / "dockerd").exists():
            return
        log(f"fetching Docker 26 (trixie: {', '.join(PACKAGES)}) into {folder}")
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            _fetch(Path(tmp), folder)


def _fetch(tmp: Path, folder: Path) -> None:
    (tmp / "sources").mkdir()
    (tmp / "lists" / "partial").mkdir(parents=True)
    (tmp / "debs").mkdir()
    (tmp / "sources" / "trixie.sources").write_text(
        f"Types: deb\nURIs: {MIRROR}\nSuites: trixie\nComponents: main\nSigned-By: {KEYRING}\n")
    apt = ["apt-get", "-q", "-o", "Dir::Etc::sourcelist=/dev/null", "-o", f"Dir::Etc::sourceparts={tmp}/sources",
           "-o", f"Dir::State::Lists={tmp}/lists", "-o", "APT::Sandbox::User=root"]
    for argv, cwd in ((apt + ["update"], None), (apt + ["download", *PACKAGES], tmp / "debs")):
        r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise EngineError(f"{' '.join(argv[:1] + argv[-len(PACKAGES) - 1:])} failed "
                              f"(exit {r.returncode}): {(r.stderr or r.stdout)[-800:]}")
    root = tmp / "root"
    for deb in sorted((tmp / "debs").glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, timeout=300)
    staged = tmp / "bundle"
    (staged / "bin").mkdir(parents=True)
    for rel in BINARIES:
        src = root / rel
        if not src.exists():
            raise EngineError(f"the trixie packages lack {rel}")
        shutil.copy2(src, staged / "bin" / src.name)
    (staged / "VERSION").write_text(subprocess.run([str(staged / "bin" / "dockerd"), "--version"],
                                                   capture_output=True, text=True, timeout=30).stdout)
    os.replace(staged, folder)                    # whole or not at all: a killed fetch leaves no half bundle
