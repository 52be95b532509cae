"""arm64 (aarch64) test hosts on this x86_64 machine, under qemu-user: every DGX Spark is aarch64.

    TestCluster.up(name, n, arch="aarch64")            every host arm64
    TestCluster.up(name, n, arch="x86_64,aarch64")     per host, the last one repeated (as `engine`)
    python -m tests.cluster up --name NAME --hosts 2 --arch aarch64

An arm64 test host is what an x86 one is (a network namespace with its own address, sshd and dockerd;
cluster.py), except that everything reached over SSH is an arm64 program: its sshd is the arm64
/usr/sbin/sshd of an arm64 Debian bookworm root filesystem, run under qemu-aarch64 inside a chroot of
that host's own view of the rootfs. The sessions it starts (bash, python3, the docker CLI, rsync,
iperf3, ip, ss, ping, flock, ...) are arm64 binaries of that rootfs, so `uname -m` says aarch64 (qemu
reports the emulated machine) and deployctl's preflight sees the architecture of a DGX Spark.

Pieces, and why this shape:

- Emulation (ensure_emulation): binfmt_misc mounted, Debian's qemu-user-static + binfmt-support
  registering qemu-aarch64 with flags PF. F matters: the kernel opens the interpreter when it is
  registered, so an arm64 program starts from inside a chroot or a container whose files hold no qemu.
- The rootfs (ensure_rootfs): `debootstrap --arch=arm64` (the second stage runs under qemu through
  binfmt's F flag; no --foreign needed), ROOTFS_PACKAGES = every tool deployctl runs on a host (grep of
  orchestrator/hostside, executors, stages/preflight.py, fabric, launch/firewall.py and playbooks/),
  plus the arm64 docker CLI of the test hosts' engine (Debian trixie's docker-cli, fetched with a
  private apt state as engines.py fetches the amd64 engine). Cached under CACHE (outside the
  repository) in a folder named by the digest of rootfs_key() (suite, package list, docker CLI version,
  RECIPE): a change makes a new one. Built in a temporary folder, renamed into place, stamped last
  (rootfs-<digest>.ok): a killed build leaves nothing that looks finished; a lock so two runs do not
  build it twice. Read-only once published: every host mounts it as an overlay's lower layer.
- A host's root (mount_root): an overlay (lower = the cached rootfs, upper/work = S/nodeK/rootfs-upper,
  -work) at S/nodeK/root, so each host writes its own /etc, /tmp, /root, /var, as separate machines do,
  and a `down` throws the writes away with the state folder. Inside it: the cluster's state folder S
  bound at the same absolute path (every inventory path lives under S: nvme_dir, model_cache,
  docker.sock, sshd_config, the host key, the home), a procfs, a sysfs mounted from inside the host's
  network namespace (so /sys/class/net lists the host's own eth0 and fab0, as on a machine; an x86 test
  host sees this machine's), devtmpfs with a devpts of its own (ssh -t works) and this machine's
  /dev/shm (what an x86 host's SSH sessions see too). Every mount point is recorded in state.json
  before it is made; cleanup unmounts everything under S deepest first.
  Mount propagation: S is a shared mount (cluster.py), so each overlay is made private at once and the
  inner bind of S a slave: mounts made under S later (small_fs) reach the host's view, nothing made
  inside a root propagates out, and unmounting a root's /dev/pts can never reach this machine's. The
  overlays are all mounted before any inner bind, so no root receives copies of the other roots.
- The host's dockerd stays this machine's native x86_64 dockerd (per host, in its namespace, as for
  x86 hosts); it runs linux/arm64 images (its containers' programs start under qemu through the F
  flag). The arm64 CLI talks to it over S/nodeK/docker.sock (SetEnv DOCKER_HOST, as for x86 hosts).
- The base images (ensure_images): dctl-busybox:latest-arm64 (Debian's busybox-static:arm64) and
  dctl-debian:bookworm-arm64 (an arm64 debootstrap minbase + python3 + ca-certificates, plus the Hub
  client installed for aarch64 from PyPI wheels), made by writing the `docker save` archive here (layer
  tars, an image config saying architecture arm64, variant v8) and `docker load`ing it: Docker 20.10's
  `docker import --platform` is ignored (the config still says amd64). TestCluster.load_base_images
  puts them into a host's engine under the canonical names the chains' locks use.

What runs natively, what under emulation:
  emulated (arm64, qemu-user): sshd and every session program on the host: bash, sh, python3 and
  whatever deployctl sends it (host_read.py, the command agent, the table ops, ansible's modules),
  the docker CLI, rsync and the ssh client it runs, iperf3, ping, ip, ss, ps, flock, timeout, uname, ...;
  and the programs in arm64 containers.
  native (x86_64): the kernel; each host's dockerd, containerd and runc; the test bed's own plumbing
  (ip/tc from outside the namespaces, the Hub endpoint, node exporter); and iptables inside the
  rootfs (below).

What does not work under qemu-user 7.2 (Debian bookworm), found here:
  - iptables: the nft backend opens a NETLINK_NETFILTER socket, which qemu's linux-user layer refuses
    (socket() -> EPROTONOSUPPORT, "Failed to initialize nft: Protocol not supported"); the legacy
    backend's getsockopt(SOL_IP, IPT_SO_GET_INFO) is not implemented (-> ENOPROTOOPT, "Table does not
    exist"). Fallback: /usr/sbin/xtables-nft-multi in the rootfs (what iptables, iptables-restore,
    iptables-save and ip6tables* resolve to through Debian's alternatives) is the amd64 build of the same
    Debian package (bookworm's iptables 1.8.9), with its amd64 libraries under /usr/lib/x86_64-linux-gnu
    and /lib64/ld-linux-x86-64.so.2: it runs natively inside the chroot against the host's own network
    namespace, so deployctl's firewall (launch/firewall.py) lists and adds rules on an arm64 host exactly
    as on another. The arm64 original is kept as /usr/sbin/xtables-nft-multi.aarch64; iptables-legacy
    stays arm64 (and fails). /etc/dctl-testhost in the rootfs says so.
  - tc: qemu translates only rtnetlink's link, address and route messages; `tc qdisc show` fails
    ("Cannot send request: Operation not supported"). deployctl runs no tc on hosts (the test bed's
    shaping runs natively from outside).
  - ss: its NETLINK_SOCK_DIAG socket is refused too ("Cannot open netlink socket: Protocol not
    supported", on stderr); ss then falls back to /proc/net/{tcp,udp,...}, and -p reads /proc/PID/fd:
    the listing is complete (launch/exposure.py reads it).
Expect emulated programs to be several times slower than native ones (python3 start-up ~0.35 s vs
0.08 s here): keep payloads small in this tier.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .images import CACHE_DIR, HUB_CLIENT, HUB_LABEL, LOCAL_ENGINE, _rmtree_no_mounts, busybox_root, image_present

NATIVE = platform.machine()          # this machine's (x86_64)
AARCH64 = "aarch64"
_ALIASES = {"aarch64": AARCH64, "arm64": AARCH64, "x86_64": "x86_64", "amd64": "x86_64"}

CACHE = CACHE_DIR / "arm64"
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# Every tool deployctl runs on a host (minbase already has coreutils, util-linux, grep, sed, tar, gzip,
# findutils, bash, dash, hostname): python3 (+ yaml for ansible's modules), sshd and the ssh client
# (rsync from the head to a worker), rsync, iperf3 (fabric), ip/ss (iproute2), iptables (firewall),
# ps (procps), killall/fuser (psmisc), ping (fabric MTU), flock/fallocate (util-linux), timeout,
# sha256sum, base64 (coreutils). Not perftest: ib_write_bw needs RoCE hardware, as on the x86 hosts.
ROOTFS_PACKAGES = ("python3", "python3-yaml", "openssh-server", "openssh-client", "rsync", "iperf3",
                   "iproute2", "iptables", "procps", "psmisc", "iputils-ping", "util-linux", "coreutils",
                   "ca-certificates", "findutils", "grep", "sed", "tar", "gzip")
DOCKER_CLI_SUITE = "trixie"          # docker-cli 26.1.5, as engines.py's Docker 26
# the amd64 iptables that stands in for the arm64 one (see the module doc), with its libraries
NATIVE_IPTABLES_PACKAGES = ("iptables", "libxtables12", "libnftnl11", "libmnl0", "libnetfilter-conntrack3",
                            "libnfnetlink0", "libc6")
NATIVE_LIBS = ("libxtables.so.12", "libnftnl.so.11", "libmnl.so.0", "libnetfilter_conntrack.so.3",
               "libnfnetlink.so.0", "libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2")
RECIPE = 1                           # bump on any change to how the rootfs is made
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"   # a host's sessions: the rootfs's only

BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_ENTRY = "qemu-aarch64"

BUSYBOX_IMAGE = "dctl-busybox:latest-arm64"
DEBIAN_IMAGE = "dctl-debian:bookworm-arm64"
DEBIAN_TARBALL = CACHE_DIR / "dctl-debian-bookworm-arm64.rootfs.tar"
WHEELS_DIR = CACHE_DIR / "wheels-aarch64"
IMAGE_PLATFORM = "arm64/v8"          # what `docker image inspect --format '{{.Architecture}}/{{.Variant}}'` says
# PyPI platforms an aarch64 bookworm (glibc 2.36) takes: hf-xet publishes manylinux_2_28 only
PIP_PLATFORMS = ("manylinux_2_28_aarch64", "manylinux2014_aarch64")


class EmulationError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------
# Architectures (pure)

def normalize(name: str) -> str:
    """'arm64'/'aarch64' -> 'aarch64', 'amd64'/'x86_64' -> 'x86_64' (the names `uname -m` prints)."""
    a = _ALIASES.get(name.strip().lower())
    if a not in (NATIVE, AARCH64):
        raise EmulationError(f"unknown architecture {name!r}: aarch64 (arm64, under qemu) or {NATIVE} (this "
                             f"machine's)")
    return a


def per_host(spec: "str | Sequence[str] | None", n: int) -> list[str]:
    """Architectures of hosts node1..nodeN from 'A' (all) or 'A1,A2,...' (per host, the last one
    repeated), as engines.per_host; None: this machine's everywhere."""
    if spec is None:
        names = [NATIVE]
    elif isinstance(spec, str):
        names = [s for s in (p.strip() for p in spec.split(",")) if s]
    else:
        names = list(spec)
    if not names:
        raise EmulationError("--arch: no architecture named")
    names = [normalize(a) for a in names]
    return [names[min(i, len(names) - 1)] for i in range(n)]


def emulated(arch: str) -> bool:
    return normalize(arch) != NATIVE


# ---------------------------------------------------------------------------------------------------
# Emulation set-up

def _run(argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def binfmt_entry() -> dict[str, str] | None:
    """/proc/sys/fs/binfmt_misc/qemu-aarch64 parsed: {"state": enabled|disabled, "interpreter", "flags"}."""
    try:
        text = (BINFMT / QEMU_ENTRY).read_text()
    except OSError:
        return None
    out = {"state": text.splitlines()[0].strip() if text else ""}
    for line in text.splitlines()[1:]:
        k, _, v = line.partition(" ")
        out[k.rstrip(":")] = v.strip()
    return out


def ensure_emulation(log: Callable[[str], None] = lambda m: None) -> dict[str, str]:
    """binfmt_misc mounted and qemu-aarch64 registered, enabled, with the F flag (idempotent).
    Returns the registration; EmulationError saying what to do otherwise."""
    if not (BINFMT / "register").exists():
        r = _run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
        if r.returncode != 0 and not (BINFMT / "register").exists():
            raise EmulationError(f"cannot mount binfmt_misc on {BINFMT}: {r.stderr.strip()} "
                                 "(the kernel needs CONFIG_BINFMT_MISC; run as root)")
        log(f"mounted binfmt_misc on {BINFMT}")
    if (BINFMT / "status").exists() and (BINFMT / "status").read_text().strip() != "enabled":
        raise EmulationError(f"binfmt_misc is disabled ({BINFMT}/status): echo 1 > {BINFMT}/status")
    entry = binfmt_entry()
    if entry is None or entry.get("state") != "enabled":
        if not Path("/usr/share/binfmts/qemu-aarch64").exists() or not shutil.which("update-binfmts"):
            raise EmulationError("qemu-aarch64 is not registered with binfmt_misc and Debian's "
                                 "qemu-user-static/binfmt-support are not installed: "
                                 "apt-get install qemu-user-static binfmt-support (.ci/setup does)")
        r = _run(["update-binfmts", "--enable", QEMU_ENTRY])
        log(f"update-binfmts --enable {QEMU_ENTRY}: rc {r.returncode} {r.stderr.strip()}")
        entry = binfmt_entry()
        if entry is None or entry.get("state") != "enabled":
            raise EmulationError(f"update-binfmts --enable {QEMU_ENTRY} did not register it "
                                 f"({(r.stderr or r.stdout).strip()[-300:]})")
    if "F" not in entry.get("flags", ""):
        raise EmulationError(f"{QEMU_ENTRY} is registered without the F flag (flags {entry.get('flags')!r}): "
                             "arm64 programs in a chroot or a container could not find the interpreter. "
                             "Use Debian's qemu-user-static (it registers PF): update-binfmts --disable "
                             f"{QEMU_ENTRY}, then reinstall qemu-user-static")
    if not Path(entry.get("interpreter", "")).exists():
        raise EmulationError(f"{QEMU_ENTRY}'s interpreter {entry.get('interpreter')} is missing")
    return entry


# ---------------------------------------------------------------------------------------------------
# Debian packages through a private apt state (the system's apt state is untouched)

def apt_download(work: Path, suite: str, arch: str, packages: Sequence[str], dest: Path) -> list[Path]:
    """`apt-get download PACKAGES` for ARCH from SUITE of the mirror, into DEST."""
    d = work / f"apt-{suite}-{arch}"
    for sub in ("sources", "lists/partial", "cache/archives/partial"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    dest.mkdir(parents=True, exist_ok=True)
    (d / "sources" / f"{suite}.sources").write_text(
        f"Types: deb\nURIs: {MIRROR}\nSuites: {suite}\nComponents: main\nSigned-By: {KEYRING}\n")
    apt = ["apt-get", "-q", "-o", "Dir::Etc::sourcelist=/dev/null", "-o", f"Dir::Etc::sourceparts={d}/sources",
           "-o", f"Dir::State::Lists={d}/lists", "-o", f"Dir::Cache={d}/cache", "-o", "APT::Sandbox::User=root",
           "-o", f"APT::Architecture={arch}", "-o", f"APT::Architectures={arch}"]
    before = set(dest.glob("*.deb"))
    for argv, cwd in ((apt + ["update"], None), (apt + ["download", *packages], dest)):
        r = _run(argv, timeout=600, cwd=cwd)
        if r.returncode != 0:
            raise EmulationError(f"apt-get {argv[-len(packages) - 1] if cwd else 'update'} ({suite}, {arch}) "
                                 f"failed (exit {r.returncode}): {(r.stderr or r.stdout)[-800:]}")
    return sorted(set(dest.glob("*.deb")) - before)


def _deb_field(deb: Path, name: str) -> str:
    return _run(["dpkg-deb", "-f", str(deb), name]).stdout.strip()


def _deb_of(debs: Sequence[Path], package: str) -> Path:
    for deb in debs:
        if _deb_field(deb, "Package") == package:
            return deb
    raise EmulationError(f"apt-get download gave no {package}: {[d.name for d in debs]}")


# ---------------------------------------------------------------------------------------------------
# The rootfs

def docker_cli_version() -> str:
    """The Docker version of the test hosts' engine bundle ("26.1.5+dfsg1"): the arm64 CLI must be it."""
    from . import engines
    eng = engines.get("26")
    engines.ensure(eng)
    text = (engines.CACHE / str(eng.bundle) / "VERSION").read_text()
    m = re.search(r"version (\S+?),", text)
    if not m:
        raise EmulationError(f"cannot read the Docker 26 bundle's version from {text!r}")
    return m.group(1)


def rootfs_key() -> str:
    return (f"debian {SUITE} arm64 minbase; packages {','.join(sorted(ROOTFS_PACKAGES))}; "
            f"docker-cli {docker_cli_version()} ({DOCKER_CLI_SUITE} arm64); "
            f"native iptables {SUITE} amd64 ({','.join(NATIVE_IPTABLES_PACKAGES)}); recipe {RECIPE}")


def rootfs_path(key: str | None = None) -> Path:
    return CACHE / f"rootfs-{hashlib.sha256((key or rootfs_key()).encode()).hexdigest()[:16]}"


def _stamp(folder: Path) -> Path:
    return folder.with_name(folder.name + ".ok")


def rootfs_ready(folder: Path) -> bool:
    return _stamp(folder).exists() and (folder / "usr" / "sbin" / "sshd").exists()


@contextlib.contextmanager
def _lock(name: str) -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _in_use(folder: Path) -> bool:
    """FOLDER is an overlay's lower layer of a mounted host root (this mount namespace's)."""
    with open("/proc/self/mountinfo") as fh:
        return any(f"lowerdir={folder}," in line or f"lowerdir={folder} " in line for line in fh)


def ensure_rootfs(log: Callable[[str], None] = lambda m: None) -> Path:
    """The cached arm64 rootfs of this recipe, built first when missing (minutes: see the log)."""
    key = rootfs_key()
    folder = rootfs_path(key)
    if rootfs_ready(folder):
        return folder
    ensure_emulation(log)
    with _lock("rootfs"):                        # another run building it: wait, then use its result
        if rootfs_ready(folder):
            return folder
        for old in CACHE.glob(".build-*"):       # a killed build's scratch
            _rmtree_no_mounts(old)
        if folder.exists():                      # renamed but never stamped: not trusted
            _rmtree_no_mounts(folder)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=CACHE))
        try:
            t0 = time.monotonic()
            log(f"building the arm64 rootfs ({key}) in {work}")
            root = _build_rootfs(work, key, log)
            os.rename(root, folder)
            took = time.monotonic() - t0
            tmp = _stamp(folder).with_suffix(".part")
            tmp.write_text(json.dumps({"key": key, "built": time.time(), "seconds": round(took, 1)}) + "\n")
            os.replace(tmp, _stamp(folder))      # stamped last
            log(f"arm64 rootfs ready in {took:.0f}s: {folder}")
        finally:
            _rmtree_no_mounts(work)
        for old in CACHE.glob("rootfs-*"):       # earlier recipes, unless a running host still uses one
            if old.is_dir() and old != folder and not _in_use(old):
                _stamp(old).unlink(missing_ok=True)
                _rmtree_no_mounts(old)
    return folder


def _chroot(root: Path, script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return _run(["chroot", str(root), "/bin/sh", "-c", script], timeout=timeout,
                env={"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root"})


def _build_rootfs(work: Path, key: str, log: Callable[[str], None]) -> Path:
    root = work / "rootfs"
    t0 = time.monotonic()
    p = _run(["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}",
              SUITE, str(root), MIRROR], timeout=3600)
    if p.returncode != 0:
        raise EmulationError(f"debootstrap --arch=arm64 failed ({p.returncode}): {(p.stdout + p.stderr)[-3000:]}")
    log(f"debootstrap --arch=arm64 (second stage under qemu): {time.monotonic() - t0:.0f}s")

    # the arm64 docker CLI of the test hosts' engine (Debian trixie's docker-cli)
    want = docker_cli_version()
    deb = _deb_of(apt_download(work, DOCKER_CLI_SUITE, "arm64", ["docker-cli"], work / "debs-cli"), "docker-cli")
    got = _deb_field(deb, "Version")
    if not got.startswith(want):
        raise EmulationError(f"{DOCKER_CLI_SUITE}'s docker-cli for arm64 is {got}, the test hosts' engine is "
                             f"{want}: update both together (tests/cluster/engines.py)")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "cli")], check=True, timeout=300)
    shutil.copy2(work / "cli" / "usr" / "bin" / "docker", root / "usr" / "bin" / "docker")

    # iptables: the amd64 build of the same package runs natively (qemu cannot run the arm64 one)
    debs = apt_download(work, SUITE, "amd64", NATIVE_IPTABLES_PACKAGES, work / "debs-amd64")
    x86 = work / "amd64"
    for d in debs:
        subprocess.run(["dpkg-deb", "-x", str(d), str(x86)], check=True, timeout=300)
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    libdir.mkdir(parents=True, exist_ok=True)
    for lib in NATIVE_LIBS:
        src = next((c for c in (x86 / "lib" / "x86_64-linux-gnu" / lib, x86 / "usr" / "lib" / "x86_64-linux-gnu" / lib)
                    if c.exists()), None)
        if src is None:
            raise EmulationError(f"the amd64 packages {NATIVE_IPTABLES_PACKAGES} lack {lib}")
        shutil.copyfile(src, libdir / lib)       # the file itself under its soname
        os.chmod(libdir / lib, 0o755)
    shutil.copytree(x86 / "usr" / "lib" / "x86_64-linux-gnu" / "xtables", libdir / "xtables", symlinks=True)
    (root / "usr" / "lib64").mkdir(exist_ok=True)
    if not (root / "lib64").exists() and not (root / "lib64").is_symlink():
        (root / "lib64").symlink_to("usr/lib64")           # merged /usr, as the amd64 loader's path expects
    (root / "usr" / "lib64" / "ld-linux-x86-64.so.2").symlink_to("../lib/x86_64-linux-gnu/ld-linux-x86-64.so.2")
    multi = root / "usr" / "sbin" / "xtables-nft-multi"
    os.rename(multi, multi.with_name("xtables-nft-multi.aarch64"))
    shutil.copy2(x86 / "usr" / "sbin" / "xtables-nft-multi", multi)

    # sshd: its privilege separation folder; no host keys of the image's own (each host has its key)
    (root / "run" / "sshd").mkdir(mode=0o755, exist_ok=True)
    for k in (root / "etc" / "ssh").glob("ssh_host_*"):
        k.unlink()
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for f in (root / sub).glob("*"):
            if f.is_file():
                f.unlink()
    (root / "etc" / "dctl-testhost").write_text(
        "An arm64 test host's root filesystem (deployctl tests/cluster/arm64.py): programs run under qemu-user.\n"
        f"key: {key}\n"
        "iptables: /usr/sbin/xtables-nft-multi is the amd64 build of the same Debian package, run natively\n"
        "  (qemu-user refuses NETLINK_NETFILTER sockets and IPT_SO_* socket options); the arm64 one is\n"
        "  /usr/sbin/xtables-nft-multi.aarch64.\n")

    # the result answers: arm64 programs (under qemu), the CLI's version, the native iptables
    r = _chroot(root, "uname -m; python3 -c 'import yaml, platform; print(platform.machine())'; "
                      "docker --version; iptables --version; /usr/sbin/sshd -V 2>&1 | head -1; rsync --version | head -1; "
                      "iperf3 --version | head -1")
    lines = r.stdout.splitlines()
    if (r.returncode != 0 or lines[:2] != [AARCH64, AARCH64] or want.split("+")[0] not in r.stdout
            or "nf_tables" not in r.stdout):
        raise EmulationError(f"the arm64 rootfs does not answer as expected (rc {r.returncode}): "
                             f"{r.stdout[-1000:]} {r.stderr[-1000:]}")
    log("arm64 rootfs: " + "; ".join(lines))
    return root


# ---------------------------------------------------------------------------------------------------
# A host's root: the mounts, in the order they are made (cleanup unmounts deepest first)

def root_mountpoints(root: Path, state: Path) -> list[Path]:
    """Every mount point of a host root at ROOT for a cluster whose state folder is STATE."""
    inner = root / str(state).lstrip("/")
    return [root, inner, root / "proc", root / "sys", root / "dev", root / "dev" / "pts", root / "dev" / "shm"]


def mount_overlay(root: Path, lower: Path, upper: Path, work: Path, source: str) -> None:
    """Step 1 for every host before step 2 for any (module doc: mount propagation)."""
    for d in (root, upper, work):
        d.mkdir(parents=True, exist_ok=True)
    _must(["mount", "-t", "overlay", source, "-o", f"lowerdir={lower},upperdir={upper},workdir={work}", str(root)])
    _must(["mount", "--make-private", str(root)])


def mount_inside(root: Path, state: Path, netns_path: str) -> None:
    """Step 2: the state folder, /proc, /sys (of the host's namespace), /dev, /dev/pts, /dev/shm."""
    inner, proc, sysfs, dev, pts, shm = root_mountpoints(root, state)[1:]
    inner.mkdir(parents=True, exist_ok=True)
    _must(["mount", "--bind", str(state), str(inner)])
    _must(["mount", "--make-slave", str(inner)])
    _must(["mount", "-t", "proc", "-o", "nosuid,nodev,noexec", "proc", str(proc)])
    _must(["nsenter", f"--net={netns_path}", "mount", "-t", "sysfs", "-o", "nosuid,nodev,noexec", "sysfs", str(sysfs)])
    _must(["mount", "-t", "devtmpfs", "-o", "mode=0755,nosuid", "devtmpfs", str(dev)])
    pts.mkdir(exist_ok=True)
    _must(["mount", "-t", "devpts", "-o", "newinstance,ptmxmode=0666,mode=0620,gid=5,nosuid,noexec", "devpts", str(pts)])
    shm.mkdir(exist_ok=True)
    _must(["mount", "--bind", "/dev/shm", str(shm)])
    _must(["mount", "--make-private", str(shm)])


def _must(argv: list[str]) -> None:
    r = _run(argv, timeout=60)
    if r.returncode != 0:
        raise EmulationError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")


# ---------------------------------------------------------------------------------------------------
# arm64 base images in the local engine

def image_platform(image: str, engine: str = LOCAL_ENGINE) -> str:
    p = _run(["docker", "-H", engine, "image", "inspect", "--format", "{{.Architecture}}/{{.Variant}}", image])
    return p.stdout.strip() if p.returncode == 0 else ""


def _label(image: str, engine: str) -> str:
    p = _run(["docker", "-H", engine, "image", "inspect", "--format", f'{{{{index .Config.Labels "{HUB_LABEL}"}}}}',
              image])
    return p.stdout.strip() if p.returncode == 0 else ""


def ensure_images(engine: str = LOCAL_ENGINE, debian: bool = True, log: Callable[[str], None] = lambda m: None
                  ) -> list[str]:
    """BUSYBOX_IMAGE (and DEBIAN_IMAGE) in ENGINE, made unless present with the arm64 platform (and this
    checkout's Hub client). The caller holds images._cache_lock."""
    made = []
    if not (image_present(BUSYBOX_IMAGE, engine) and image_platform(BUSYBOX_IMAGE, engine) == IMAGE_PLATFORM):
        ensure_emulation(log)
        build_busybox(engine)
        made.append(BUSYBOX_IMAGE)
    if debian and not (image_platform(DEBIAN_IMAGE, engine) == IMAGE_PLATFORM
                       and _label(DEBIAN_IMAGE, engine) == HUB_CLIENT):
        ensure_emulation(log)
        build_debian(engine, log)
        made.append(DEBIAN_IMAGE)
    return made


def _config(diff_ids: list[str], cmd: list[str], env: list[str], labels: dict[str, str], created: str,
            history: list[str]) -> bytes:
    arch, variant = IMAGE_PLATFORM.split("/")
    return json.dumps({
        "architecture": arch, "variant": variant, "os": "linux", "created": created,
        "config": {"Cmd": cmd, "Env": env, **({"Labels": labels} if labels else {})},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": created, "created_by": h} for h in history],
    }, sort_keys=True, separators=(",", ":")).encode()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_layers(image: str, layers: Sequence[Path], engine: str = LOCAL_ENGINE, *, cmd: list[str],
                env: Sequence[str] = (), labels: dict[str, str] | None = None, history: Sequence[str] = ()) -> str:
    """`docker load` of a `docker save` archive written here: LAYERS (uncompressed tars, lowest first) and
    an image config saying linux/arm64/v8, tagged IMAGE. Returns the image id (sha256 of the config).
    Checked after: `docker image inspect` must say arm64/v8."""
    diff_ids = [f"sha256:{_sha256_file(p)}" for p in layers]
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(max(int(p.stat().st_mtime) for p in layers)))
    hist = list(history) + [f"layer {i + 1}" for i in range(len(history), len(layers))]
    config = _config(diff_ids, cmd, list(env), labels or {}, created, hist)
    cid = hashlib.sha256(config).hexdigest()
    names = [f"{d.split(':')[1]}/layer.tar" for d in diff_ids]
    manifest = json.dumps([{"Config": f"{cid}.json", "RepoTags": [image], "Layers": names}]).encode()
    with tempfile.TemporaryFile() as errf:
        load = subprocess.Popen(["docker", "-H", engine, "load", "-q"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=errf)
        assert load.stdin is not None
        try:
            with tarfile.open(fileobj=load.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                def add_bytes(name: str, data: bytes) -> None:
                    ti = tarfile.TarInfo(name)
                    ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
                    tar.addfile(ti, io.BytesIO(data))
                add_bytes(f"{cid}.json", config)
                for name, path in zip(names, layers):
                    ti = tarfile.TarInfo(name)
                    ti.size, ti.mtime, ti.mode = path.stat().st_size, 0, 0o644
                    with open(path, "rb") as fh:
                        tar.addfile(ti, fh)
                add_bytes("manifest.json", manifest)
        except BrokenPipeError:
            pass                         # docker load gave up: its stderr says why
        finally:
            with contextlib.suppress(BrokenPipeError):
                load.stdin.close()
        rc = load.wait(timeout=600)
        errf.seek(0)
        err = errf.read().decode(errors="replace")
    if rc != 0:
        raise EmulationError(f"docker load of {image} failed: {err[-1000:]}")
    got = image_platform(image, engine)
    if got != IMAGE_PLATFORM:
        raise EmulationError(f"{image} loaded as {got or '?'}, not {IMAGE_PLATFORM}")
    return f"sha256:{cid}"


def _tar_dir(folder: Path, out: Path) -> None:
    """FOLDER's tree as an uncompressed layer tar (numeric owners, sorted names)."""
    subprocess.run(["tar", "-C", str(folder), "--numeric-owner", "--sort=name", "-cf", str(out), "."], check=True,
                   timeout=600)


def build_busybox(engine: str = LOCAL_ENGINE) -> None:
    """BUSYBOX_IMAGE: Debian's busybox-static for arm64 plus its applet links (as images.build_busybox)."""
    with tempfile.TemporaryDirectory(prefix="dctl-busybox-arm64-") as tmp:
        t = Path(tmp)
        deb = _deb_of(apt_download(t, SUITE, "arm64", ["busybox-static"], t / "debs"), "busybox-static")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(t / "x")], check=True, timeout=120)
        busybox = t / "x" / "bin" / "busybox"
        applets = _run([str(busybox), "--list"]).stdout.split()      # an arm64 program: under qemu
        if not applets:
            raise EmulationError(f"the arm64 busybox does not run here ({busybox} --list printed nothing)")
        root = t / "root"
        busybox_root(root, busybox, applets)
        _tar_dir(root, t / "layer.tar")
        load_layers(BUSYBOX_IMAGE, [t / "layer.tar"], engine, cmd=["/bin/sh"],
                    history=[f"busybox-static {_deb_field(deb, 'Version')} arm64 (tests/cluster/arm64.py)"])


def _debootstrap_tarball(log: Callable[[str], None]) -> None:
    """An arm64 debootstrap minbase + python3 + ca-certificates packed to DEBIAN_TARBALL (.part + rename)."""
    with tempfile.TemporaryDirectory(prefix="dctl-debian-arm64-", dir=CACHE_DIR) as tmp:
        root = Path(tmp) / "rootfs"
        try:
            t0 = time.monotonic()
            p = _run(["debootstrap", "--arch=arm64", "--variant=minbase", "--include=python3,ca-certificates",
                      SUITE, str(root), MIRROR], timeout=3600)
            if p.returncode != 0:
                raise EmulationError(f"debootstrap --arch=arm64 failed ({p.returncode}): "
                                     f"{(p.stdout + p.stderr)[-3000:]}")
            log(f"debootstrap --arch=arm64 minbase for {DEBIAN_IMAGE}: {time.monotonic() - t0:.0f}s")
            for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for f in (root / sub).glob("*"):
                    if f.is_file():
                        f.unlink()
            part = DEBIAN_TARBALL.with_name(DEBIAN_TARBALL.name + ".part")
            subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], check=True,
                           timeout=600)
            with open(part, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(part, DEBIAN_TARBALL)
        finally:
            _rmtree_no_mounts(root)


def _hub_client_site(site: Path) -> None:
    """HUB_CLIENT and its dependencies for aarch64 cp311 in SITE (pip install --target), from wheels
    cached in WHEELS_DIR (downloaded from PyPI the first time)."""
    WHEELS_DIR.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    plat = [a for p in PIP_PLATFORMS for a in ("--platform", p)] + [
        "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp"]
    have = _run([*pip, "download", *plat, "--no-index", "--find-links", str(WHEELS_DIR), "-d", str(WHEELS_DIR),
                 HUB_CLIENT], timeout=600)
    if have.returncode != 0:
        r = _run([*pip, "download", *plat, "-d", str(WHEELS_DIR), HUB_CLIENT], timeout=600)
        if r.returncode != 0:
            raise EmulationError(f"pip download {HUB_CLIENT} for aarch64 failed: {r.stderr[-1500:]}")
    r = _run([*pip, "install", *plat, "--no-index", "--find-links", str(WHEELS_DIR), "--target", str(site),
              HUB_CLIENT], timeout=600)
    if r.returncode != 0:
        raise EmulationError(f"pip install --target {HUB_CLIENT} for aarch64 failed: {r.stderr[-1500:]}")


def build_debian(engine: str = LOCAL_ENGINE, log: Callable[[str], None] = lambda m: None) -> None:
    """DEBIAN_IMAGE: the cached arm64 rootfs tarball (layer 1) + the Hub client for aarch64 in
    /usr/local/lib/python3.11/dist-packages (layer 2), labelled as images.py labels the x86 one."""
    if not DEBIAN_TARBALL.exists():
        _debootstrap_tarball(log)
    with tempfile.TemporaryDirectory(prefix="dctl-debian-arm64-hub-") as tmp:
        layer = Path(tmp) / "layer"
        _hub_client_site(layer / "usr" / "local" / "lib" / "python3.11" / "dist-packages")
        _tar_dir(layer, Path(tmp) / "hub.tar")
        load_layers(DEBIAN_IMAGE, [DEBIAN_TARBALL, Path(tmp) / "hub.tar"], engine, cmd=["/bin/bash"],
                    env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
                    labels={HUB_LABEL: HUB_CLIENT},
                    history=[f"debootstrap --arch=arm64 --variant=minbase --include=python3,ca-certificates {SUITE}",
                             f"pip install --target ({', '.join(PIP_PLATFORMS)}) {HUB_CLIENT}"])
