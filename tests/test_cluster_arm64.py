"""arm64 test hosts (tests/cluster/arm64.py): a 2-host aarch64 cluster of its own, reached over SSH as
deployctl reaches hosts. Everything run over SSH is an arm64 program under qemu-user; the hosts' dockerds
are this machine's and run arm64 images. Each phase prints how long it took.

A cold cache first builds the arm64 rootfs (minutes) and the arm64 base images; warm, the module runs
in about a minute.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from tests.cluster import TestCluster, cluster_lock, state_dir
from tests.cluster import arm64
from tests.cluster.images import mounts_under

pytestmark = pytest.mark.cluster
NAME = "arm64t"
EM_AARCH64, EM_X86_64 = 183, 62          # ELF e_machine


@contextlib.contextmanager
def phase(what: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        print(f"[arm64] {what}: {time.monotonic() - t0:.1f}s")


@pytest.fixture(scope="module")
def arm() -> Iterator[TestCluster]:
    with cluster_lock(NAME, log=print):
        with phase("up: 2 aarch64 hosts (emulation checked, rootfs cached or built)"):
            c = TestCluster.up(NAME, 2, arch="aarch64", log=print)
        try:
            yield c
        finally:
            c.down()


def run(c: TestCluster, host, argv: list[str], timeout: float = 60):
    r = c.ssh_target(host).run(argv, timeout=timeout)
    assert r.rc == 0, (argv, r)
    return r


def elf_machine(c: TestCluster, host, path: str) -> int:
    """e_machine of PATH's ELF header on HOST, read over SSH (no `file` on the host)."""
    head = base64.b64decode(run(c, host, ["sh", "-c", 'head -c 20 "$1" | base64', "sh", path]).stdout)
    assert head[:4] == b"\x7fELF" and head[4] == 2 and head[5] == 1, head    # ELF, 64-bit, little-endian
    return int.from_bytes(head[18:20], "little")


def test_every_session_program_is_arm64(arm):
    for h in arm.hosts:
        assert h.arch == "aarch64" and h.emulated
        with phase(f"ssh {h.name} uname -m"):
            assert run(arm, h, ["uname", "-m"]).stdout.strip() == "aarch64"
        with phase(f"ssh {h.name} python3 platform.machine()"):
            out = run(arm, h, ["python3", "-c", "import platform; print(platform.machine())"]).stdout
        assert out.strip() == "aarch64"
        assert elf_machine(arm, h, "/usr/bin/python3") == EM_AARCH64
        assert elf_machine(arm, h, "/usr/sbin/sshd") == EM_AARCH64
        # the session's environment: the rootfs's PATH only, the host's own engine and home
        env = run(arm, h, ["sh", "-c", 'echo "$PATH|$DOCKER_HOST|$HOME"']).stdout.strip()
        assert env == f"{arm64.PATH}|{h.docker_host}|{h.dir / 'home'}", env


def test_docker_cli_is_arm64_and_the_engine_native(arm):
    h = arm.hosts[0]
    assert elf_machine(arm, h, "/usr/bin/docker") == EM_AARCH64
    with phase("ssh docker version (arm64 CLI, this machine's dockerd)"):
        out = run(arm, h, ["docker", "version", "--format",
                           "{{.Client.Arch}} {{.Client.Version}} {{.Server.Arch}} {{.Server.Version}}"]).stdout
    client_arch, client_version, server_arch, server_version = out.split()
    assert (client_arch, server_arch) == ("arm64", "amd64"), out
    assert client_version == arm64.docker_cli_version() == server_version, out


def test_arm64_base_images_run_on_the_hosts(arm):
    a, b = arm.hosts
    with phase("arm64 base images made (cached) and loaded into node1 (busybox + debian) and node2 (busybox)"):
        assert arm.load_base_images(a) == ["dctl-busybox:latest", "dctl-debian:bookworm"]
        assert arm.load_base_images(b, debian=False) == ["dctl-busybox:latest"]
    for h in (a, b):
        out = run(arm, h, ["docker", "image", "inspect", "--format", "{{.Architecture}}/{{.Variant}} {{.RepoTags}}",
                           "dctl-busybox:latest"]).stdout.strip()
        assert out == "arm64/v8 [dctl-busybox:latest]", out        # the canonical name only
    with phase("ssh docker run --rm dctl-busybox:latest uname -m"):
        r = run(arm, a, ["docker", "run", "--rm", "dctl-busybox:latest", "uname", "-m"], timeout=120)
    assert r.stdout.strip() == "aarch64", r
    with phase("ssh docker run dctl-debian:bookworm: python3 + the Hub client, arm64"):
        r = run(arm, a, ["docker", "run", "--rm", "dctl-debian:bookworm", "python3", "-c",
                         "import platform, huggingface_hub; print(platform.machine(), huggingface_hub.__version__)"],
                timeout=180)
    assert r.stdout.split()[0] == "aarch64" and r.stdout.split()[1] == "2.4.0", r


def test_iperf3_over_the_fabric(arm):
    a, b = arm.hosts
    server: dict = {}

    def serve() -> None:
        server["r"] = arm.ssh_target(b).run(["timeout", "30", "iperf3", "-s", "-1", "-B", b.fabric_address,
                                             "-p", "5201"], timeout=40)

    t = threading.Thread(target=serve)
    with phase("iperf3 node1 -> node2 over the fabric (both arm64)"):
        t.start()
        deadline = time.monotonic() + 25
        while True:
            r = arm.ssh_target(a).run(["iperf3", "-c", b.fabric_address, "-B", a.fabric_address, "-p", "5201",
                                       "-t", "1", "-J"], timeout=30)
            out = json.loads(r.stdout or "{}")       # iperf3 3.12 -J exits 0 on errors too: "error" says
            if (r.rc == 0 and "error" not in out) or time.monotonic() > deadline:
                break
            time.sleep(0.5)              # the server not listening yet
        t.join(40)
    assert r.rc == 0 and "error" not in out, r
    bps = out["end"]["sum_received"]["bits_per_second"]
    print(f"[arm64] iperf3 under emulation: {bps / 1e9:.2f} Gbit/s")
    assert bps > 0 and server["r"].rc == 0, server


def test_rsync_between_hosts_with_the_arm64_ssh_client(arm):
    a, b = arm.hosts
    src, dst = a.nvme_dir / "rsync-src", b.nvme_dir / "rsync-dst"
    src.mkdir(parents=True, exist_ok=True)
    (src / "payload.bin").write_bytes(os.urandom(3_000_000))
    s = state_dir(NAME)
    ssh = f"ssh -i {s / 'id_ed25519'} -o UserKnownHostsFile={s / 'known_hosts'} -o StrictHostKeyChecking=yes -o BatchMode=yes"
    with phase("rsync node1 -> node2 (arm64 rsync and ssh on both ends)"):
        run(arm, a, ["rsync", "-a", "--mkpath", "-e", ssh, f"{src}/", f"root@{b.address}:{dst}/"], timeout=120)
    sums = [run(arm, h, ["sha256sum", str(d / "payload.bin")]).stdout.split()[0] for h, d in ((a, src), (b, dst))]
    assert sums[0] == sums[1]


def test_iptables_lists_and_adds_rules_in_the_hosts_namespace(arm):
    """qemu-user cannot run iptables (arm64.py's doc): the rootfs's xtables-nft-multi is the amd64 build
    of the same package, run natively inside the chroot, on the host's own namespace."""
    h, other = arm.hosts
    assert elf_machine(arm, h, "/usr/sbin/xtables-nft-multi") == EM_X86_64
    assert elf_machine(arm, h, "/usr/sbin/xtables-nft-multi.aarch64") == EM_AARCH64
    rule = ["INPUT", "-s", "192.0.2.7/32", "-m", "comment", "--comment", "dctl-arm64-test", "-j", "DROP"]
    run(arm, h, ["iptables", "-S"])
    run(arm, h, ["iptables", "-I", *rule])
    try:
        assert "dctl-arm64-test" in run(arm, h, ["iptables", "-S", "INPUT"]).stdout
        # in the host's namespace, seen natively from outside; not in another host's
        native = arm.nsexec(h, ["iptables", "-S", "INPUT"])            # chrooted too: the same binary
        assert "dctl-arm64-test" in native.stdout, native
        assert "dctl-arm64-test" not in run(arm, other, ["iptables", "-S", "INPUT"]).stdout
        restore = run(arm, h, ["sh", "-c", "printf '*filter\\n:DCTLARM - [0:0]\\n-A DCTLARM -j RETURN\\nCOMMIT\\n' "
                                           "| iptables-restore --noflush && iptables -S DCTLARM"]).stdout
        assert "-A DCTLARM -j RETURN" in restore, restore
    finally:
        run(arm, h, ["sh", "-c", "iptables -D " + " ".join(rule) + "; iptables -F DCTLARM; iptables -X DCTLARM; true"])


def test_session_tools_under_emulation(arm):
    h = arm.hosts[0]
    # ss: netlink refused under qemu, the /proc fallback lists the listening sshd with its process
    ss = run(arm, h, ["ss", "-H", "-l", "-n", "-p", "-t"]).stdout
    assert f"{h.address}:22" in ss and "sshd" in ss, ss
    assert "sshd" in run(arm, h, ["ps", "-e", "-o", "comm"]).stdout
    assert "fab0" in run(arm, h, ["cat", "/sys/class/net/fab0/operstate", "/proc/net/dev"]).stdout
    run(arm, h, ["ping", "-n", "-c", "1", "-W", "2", "-M", "do", "-s", "8972", arm.hosts[1].fabric_address])
    run(arm, h, ["flock", "-w", "5", str(h.nvme_dir / ".lock"), "true"])


def test_round_trips(arm):
    """SSH round trips on an arm64 host (printed: compare with an x86 host's, bench/README.md)."""
    h = arm.hosts[0]
    for argv in (["true"], ["python3", "-c", "pass"]):
        with arm.ssh_target(h).connect() as s:
            s.run(argv, timeout=30)
            n, t0 = 5, time.monotonic()
            for _ in range(n):
                assert s.run(argv, timeout=30).rc == 0
            print(f"[arm64] {' '.join(argv)!r} over one SSH connection: {(time.monotonic() - t0) / n * 1000:.0f} ms")


def test_inventory_and_state(arm):
    inv = yaml.safe_load(arm.inventory_path.read_text())
    v = inv["all"]["vars"]
    assert v["ansible_python_interpreter"] == "/usr/bin/python3" and "expect_arch" not in v
    for hv in inv["all"]["hosts"].values():
        assert hv["hardware"] == "dgx-spark" and "expect_arch" not in hv
    from orchestrator.inventory import load_inventory
    assert [h.arch for h in load_inventory(arm.inventory_path).hosts] == ["aarch64", "aarch64"]
    again = TestCluster.attach(NAME)
    assert [h.arch for h in again.hosts] == ["aarch64", "aarch64"]
    assert [s["arch"] for s in again.status()] == ["aarch64", "aarch64"]
    assert all(s["sshd"] and s["docker"] for s in again.status())


def test_down_leaves_no_mount_and_no_process(arm):
    s = state_dir(NAME)
    st = json.loads((s / "state.json").read_text())
    assert st["arches"] == {"node1": "aarch64", "node2": "aarch64"}
    roots = [str(h.root) for h in arm.hosts]
    assert all(r in st["mounts"] for r in roots) and all(r in mounts_under(s) for r in roots)
    pids = [int((h.dir / f"{d}.pid").read_text()) for h in arm.hosts for d in ("sshd", "dockerd")]
    with phase("down"):
        arm.down()
    assert mounts_under(s) == [] and not s.exists()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    with open("/proc/self/mountinfo") as fh:
        assert not [line for line in fh if f"dctl-{NAME}-" in line or str(s) in line]
    assert not [ns for ns in os.listdir("/var/run/netns") if ns.startswith(f"dctl-{NAME}-")]
