"""preflight: check every host before anything is touched, and report every problem at once.

All hosts in parallel; per host one SSH session (executors/ssh.py: host keys checked) and these
checks, each run even when an earlier one failed (only a host without SSH skips the rest):

  ssh     reachable, with a known host key
  arch    `uname -m` is the hardware kind's (aarch64 for dgx-spark); inventory `expect_arch` overrides
  docker  `docker -H <docker_host> info` answers (always the inventory's engine, default the standard
          socket: never a DOCKER_HOST the login sets; executors/docker_cli.py); reports the engine's
          version and image store (graph driver or containerd), refuses one older than
          ship/stores.py MIN_VERSION
  gpus    the NVIDIA runtime is in `docker info` Runtimes and `nvidia-smi -L` lists >= gpus GPUs;
          skipped only with the documented opt-out `expect_gpus: false` (hosts without GPUs)
  nvme    free space (df, nearest existing parent) >= the sizing model's NVMe need, counting what
          is already staged there (du)
  ram     MemAvailable >= the sizing model's host-RAM need (pinned tables, page cache), and
          >= the recipe's engine.min_mem_available_gib (the launch memory gate, judged early; not
          judged while a container of the deployment runs there: launch stops it first)
  fabric  /sys/class/net/IF/operstate is up (when the inventory gives fabric_iface)
  clock   `date +%s.%N` within 2 s of this machine's clock (half the SSH round trip allowed)

Every command is an argv list (the executor quotes it); every remote operation has a timeout.
"""
from __future__ import annotations

import json
import re
import shlex
import time
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..executors.docker_cli import docker_argv
from ..ship.stores import facts_from_info
from ..hardware import KINDS
from ..inventory import Host
from ..launch.memgate import mem_available_kib, memgate_verdict
from ..outcomes import HostResult, run_per_host
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage

CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 20.0
MAX_CLOCK_SKEW_S = 2.0
IFACE_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")
# The nearest existing parent of $1, its free bytes and mount point, then what $1 already holds.
SPACE_SH = ('p=$1; while [ ! -e "$p" ]; do p=$(dirname -- "$p"); done; '
            'df -B1 --output=avail,target -- "$p" | tail -n 1; '
            'if [ -d "$1" ]; then du -s -B1 -x -- "$1" | cut -f1; else echo 0; fi')


@dataclass(frozen=True)
class Check:
    name: str
    status: str            # ok | failed | skipped
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


def commands(h: Host, nvme: list[dict[str, Any]], gate_deployment: str = "") -> dict[str, list[list[str]]]:
    """The argv of every check, by check name (what `plan` shows and `apply` runs)."""
    out: dict[str, list[list[str]]] = {
        "arch": [["uname", "-m"]],
        "docker": [docker_argv(h, "info", "--format", "{{json .}}")],
    }
    if h.expect_gpus and h.gpus > 0:
        out["gpus"] = [["nvidia-smi", "-L"]]
    if nvme:
        out["nvme"] = [["sh", "-c", SPACE_SH, "sh", n["path"]] for n in nvme]
    out["ram"] = [["cat", "/proc/meminfo"]]
    if gate_deployment:   # the memory gate: is the deployment's engine running there (holding memory)?
        out["ram"].append(docker_argv(h, "ps", "-q", "--filter", f"label=deployctl.deployment={gate_deployment}"))
    if h.fabric_iface:
        out["fabric"] = [["cat", f"/sys/class/net/{h.fabric_iface}/operstate"]]
    out["clock"] = [["date", "+%s.%N"]]
    return out


def plan(dep, options: RunOptions):
    from ..sizing import size
    sizing = size(dep)
    acts = []
    for h in dep.cluster.hosts:
        if h.fabric_iface and not IFACE_RE.match(h.fabric_iface):
            raise InputError(f"host {h.name}: fabric_iface {h.fabric_iface!r} is not a network interface name",
                             file=str(dep.cluster.file), key=f"all.hosts.{h.name}.fabric_iface")
        node = sizing.node(h.name)
        nvme = [{"path": p, "need_gb": round(gb, 2)} for p, gb in node.nvme_needs()]
        ram = round(node.host_ram_need_gb(), 2)
        gate = dep.recipe.engine.min_mem_available_gib
        cmds = commands(h, nvme, dep.name if gate else "")
        arch = h.arch
        gpus = (f"{h.gpus} GPU(s) + NVIDIA runtime" if "gpus" in cmds else
                "GPU checks off (expect_gpus: false)" if not h.expect_gpus else "no GPUs declared")
        space = ", ".join(f"{n['need_gb']:.1f} GB free for {n['path']}" for n in nvme) or "no NVMe need"
        summary = (f"check {h.name} ({h.address}): SSH host key, {arch}, Docker engine, {gpus}, {space}"
                   + (f", {ram:.1f} GB available RAM" if ram else "")
                   + (f", MemAvailable >= {gate:g} GiB (launch memory gate)" if gate else "")
                   + (f", fabric {h.fabric_iface} up" if h.fabric_iface else "") + ", clock")
        api = f"ssh {h.user}@{h.address}:{h.port}: " + " ; ".join(
            shlex.join(argv) for argvs in cmds.values() for argv in argvs)
        acts.append(Action("preflight", h.name, "ssh-checks", summary, api=api, details={
            "arch": arch, "gpus": h.gpus, "expect_gpus": h.expect_gpus, "nvme": nvme,
            "host_ram_need_gb": ram, "fabric_iface": h.fabric_iface, "max_clock_skew_s": MAX_CLOCK_SKEW_S,
            "commands": cmds, "min_mem_available_gib": gate, **_pinned(dep, h)}))
    return acts, ""


def _pinned(dep, h: Host) -> dict[str, Any]:
    """The pinned PLE table's RAM rule, for hosts whose GPU memory is not the host's memory."""
    ple = dep.recipe.ple
    if ple is None or ple.placement != "pinned" or KINDS[h.hardware].unified_memory:
        return {}
    return {"pinned_table": {"min_host_ram_gb": ple.min_host_ram_gb}}


# ---------------------------------------------------------------------------------------------
# Reading the answers (pure)

def check_arch(out: str, expected: str) -> Check:
    got = out.strip()
    if got == expected:
        return Check("arch", "ok", got)
    return Check("arch", "failed", f"`uname -m` is {got or '(nothing)'}, the hardware kind needs {expected} "
                                   "(a host of another kind? set expect_arch in the inventory to override)")


def docker_runtimes(rc: int, out: str, err: str) -> tuple[Check, list[str] | None]:
    """The docker check and the engine's runtimes (None when the engine did not answer)."""
    tail = (err.strip() or out.strip()).splitlines()[-3:]
    if rc != 0:
        return Check("docker", "failed", f"`docker info` exited {rc}: {' | '.join(tail)}"), None
    try:
        info = json.loads(out)
    except ValueError:
        return Check("docker", "failed", f"`docker info` printed no JSON: {' | '.join(tail)}"), None
    errors = info.get("ServerErrors") or []
    if errors or not info.get("ServerVersion"):
        return Check("docker", "failed", f"Docker engine not reachable: {'; '.join(errors) or 'no ServerVersion'}"), None
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    facts = facts_from_info(info)
    old = facts.too_old()
    if old:
        return Check("docker", "failed", old), runtimes
    return Check("docker", "ok", f"{facts.describe()}, runtimes {', '.join(runtimes)}"), runtimes


def check_gpus(runtimes: list[str] | None, smi: tuple[int, str, str] | None, want: int) -> Check:
    problems = []
    if runtimes is None:
        problems.append("cannot see the NVIDIA runtime (docker info failed)")
    elif "nvidia" not in runtimes:
        problems.append(f"no nvidia runtime in docker info (runtimes: {', '.join(runtimes) or 'none'}): install "
                        "nvidia-container-toolkit")
    found = 0
    if smi is not None:
        rc, out, err = smi
        found = sum(1 for line in out.splitlines() if line.startswith("GPU "))
        if rc != 0:
            problems.append(f"`nvidia-smi -L` exited {rc}: {(err.strip() or out.strip())[-200:]}")
        elif found < want:
            problems.append(f"`nvidia-smi -L` lists {found} GPU(s), the inventory declares {want}")
    if problems:
        return Check("gpus", "failed", "; ".join(problems) + " (a host without GPUs: set expect_gpus: false)")
    return Check("gpus", "ok", f"{found} GPU(s), nvidia runtime")


def parse_space(out: str) -> tuple[int, str, int]:
    """SPACE_SH output -> (free bytes, mount point, bytes already in the folder)."""
    lines = [x for x in out.strip().splitlines() if x.strip()]
    avail, _, target = lines[0].strip().partition(" ")
    return int(avail), target.strip(), int(lines[1].strip()) if len(lines) > 1 else 0


def check_nvme(host: str, spaces: list[tuple[str, float, tuple[int, str, int] | str]]) -> Check:
    """spaces: (folder, need GB, parsed df/du or an error). Needs on one filesystem add up."""
    from ..sizing import GB, nvme_problem
    per_fs: dict[str, dict[str, Any]] = {}
    errors = []
    for folder, need_gb, got in spaces:
        if isinstance(got, str):
            errors.append(f"{folder}: {got}")
            continue
        avail, fs, present = got
        d = per_fs.setdefault(fs, {"avail": avail / GB, "need": 0.0, "folders": []})
        d["need"] += max(0.0, need_gb - present / GB)
        d["folders"].append(folder)
    for fs, d in per_fs.items():
        if d["avail"] < d["need"]:
            p = nvme_problem(host, " and ".join(d["folders"]), d["need"], d["avail"], fs)
            errors.append(f"{p.message}; {p.fix}")
    if errors:
        return Check("nvme", "failed", "; ".join(errors))
    return Check("nvme", "ok", ", ".join(f"{d['avail']:.1f} GB free on {fs}, needs {d['need']:.1f}"
                                         for fs, d in per_fs.items()))


def mem_available_gb(meminfo: str) -> float:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise ValueError("no MemAvailable line in /proc/meminfo")


def check_ram(host: str, meminfo: str, need_gb: float, pinned_table: dict[str, Any] | None = None,
              min_gib: float = 0.0, engine_running: bool = False) -> Check:
    """MemAvailable against the sizing model's host-RAM need; a pinned PLE table is judged by the
    PLE writer's own rule (hostside/ple_write.py: pinned_ram_verdict), so both stages agree. MIN_GIB:
    the launch memory gate (launch/memgate.py memgate_verdict), unless the deployment's engine
    runs there (ENGINE_RUNNING: launch stops it and drops the page cache before judging)."""
    from ..sizing import host_ram_problem
    avail = mem_available_gb(meminfo)
    gate = ""
    if min_gib:
        ok, msg = memgate_verdict(host, mem_available_kib(meminfo), min_gib)
        if engine_running:
            gate = f"; memory gate ({min_gib:g} GiB) judged at launch: the deployment's engine runs here"
        elif not ok:
            return Check("ram", "failed", msg)
        else:
            gate = f"; {msg} (memory gate)"
    if pinned_table is not None:
        from ..hostside.ple_spec import pinned_ram_verdict
        ok, msg = pinned_ram_verdict(int(avail * 1e9), pinned_table, host)
        if not ok:
            return Check("ram", "failed", f"{msg} (short by {need_gb - avail:.1f} GB)" if need_gb > avail else msg)
    if need_gb and avail < need_gb:
        p = host_ram_problem(host, need_gb, avail, "MemAvailable")
        return Check("ram", "failed", f"{p.message}; {p.fix}")
    return Check("ram", "ok", f"{avail:.1f} GB available" + (f", needs {need_gb:.1f}" if need_gb else "") + gate)


def check_fabric(iface: str, rc: int, out: str) -> Check:
    state = out.strip() if rc == 0 else "missing"
    if state == "up":
        return Check("fabric", "ok", f"{iface} up")
    return Check("fabric", "failed", f"fabric link {iface} is {state} (/sys/class/net/{iface}/operstate): "
                                     "check the cable and switch port, or fix fabric_iface")


def check_clock(remote: str, t0: float, t1: float) -> Check:
    offset = float(remote.strip()) - (t0 + t1) / 2
    slack = (t1 - t0) / 2
    detail = f"{offset:+.2f} s from this machine (round trip {t1 - t0:.2f} s)"
    if abs(offset) - slack > MAX_CLOCK_SKEW_S:
        return Check("clock", "failed", f"clock off by {detail}, more than {MAX_CLOCK_SKEW_S:g} s: "
                                        "run chrony/NTP on every node")
    return Check("clock", "ok", detail)


# ---------------------------------------------------------------------------------------------
# Running them

def _host_checks(session, h: Host, d: dict[str, Any]) -> list[Check]:
    from ..executors.host_batch import run_batch
    from ..executors.ssh import SSHError
    cmds: dict[str, list[list[str]]] = d["commands"]
    # every check's commands in one round trip (executors/host_batch.py); one by one if that fails
    every = [argv for argvs in cmds.values() for argv in argvs]
    t0 = time.time()
    try:
        answered = {json.dumps(a): r for a, r in zip(every, run_batch(session, every, COMMAND_TIMEOUT_S))}
    except SSHError:
        answered = {}
    t1 = time.time()

    def run(argv: list[str]) -> tuple[int, str, str]:
        r = answered.get(json.dumps(argv)) or session.run(argv, timeout=COMMAND_TIMEOUT_S)
        return r.rc, r.stdout, r.stderr

    def guarded(name: str, fn) -> Check:
        try:
            return fn()
        except SSHError as e:
            return Check(name, "failed", str(e))
        except (ValueError, IndexError) as e:
            return Check(name, "failed", f"unexpected output: {e}")

    checks = [guarded("arch", lambda: check_arch(run(cmds["arch"][0])[1], d["arch"]))]
    runtimes: list[list[str] | None] = [None]

    def docker() -> Check:
        c, runtimes[0] = docker_runtimes(*run(cmds["docker"][0]))
        return c
    checks.append(guarded("docker", docker))
    if "gpus" in cmds:
        checks.append(guarded("gpus", lambda: check_gpus(runtimes[0], run(cmds["gpus"][0]), d["gpus"])))
    else:
        why = "expect_gpus: false (inventory opt-out)" if not d["expect_gpus"] else "the host declares no GPUs"
        checks.append(Check("gpus", "skipped", why))
    if "nvme" in cmds:
        def nvme() -> Check:
            spaces: list[tuple[str, float, tuple[int, str, int] | str]] = []
            for n, argv in zip(d["nvme"], cmds["nvme"]):
                rc, out, err = run(argv)
                spaces.append((n["path"], n["need_gb"],
                               parse_space(out) if rc == 0 else f"df exited {rc}: {err.strip()[-200:]}"))
            return check_nvme(h.name, spaces)
        checks.append(guarded("nvme", nvme))
    def ram() -> Check:
        meminfo = run(cmds["ram"][0])[1]
        running = False
        if len(cmds["ram"]) > 1:
            rc, out, _ = run(cmds["ram"][1])
            running = rc == 0 and bool(out.strip())
        return check_ram(h.name, meminfo, d["host_ram_need_gb"], d.get("pinned_table"),
                         d.get("min_mem_available_gib") or 0.0, running)
    checks.append(guarded("ram", ram))
    if "fabric" in cmds:
        checks.append(guarded("fabric", lambda: check_fabric(h.fabric_iface or "", *run(cmds["fabric"][0])[:2])))

    def clock() -> Check:
        if answered:          # read within the batch's round trip
            return check_clock(run(cmds["clock"][0])[1], t0, t1)
        t = time.time()
        out = run(cmds["clock"][0])[1]
        return check_clock(out, t, time.time())
    checks.append(guarded("clock", clock))
    return checks


def apply(dep, actions, ctx):
    from ..executors.ssh import SSHError, SSHTarget
    c = dep.cluster

    def one(action: Action, log) -> HostResult:
        h = c.host(action.host)
        target = SSHTarget.for_host(h, c, connect_timeout=CONNECT_TIMEOUT_S)
        log.write(f"preflight {h.name}: {action.summary}")
        try:
            with target.connect() as session:
                checks = [Check("ssh", "ok", f"{h.user}@{h.address}:{h.port}, host key known")]
                checks += _host_checks(session, h, action.details)
        except SSHError as e:
            checks = [Check("ssh", "failed", str(e))]
        for ch in checks:
            log.write(f"{ch.name}: {ch.status}: {ch.detail}")
        failed = [ch for ch in checks if ch.status == "failed"]
        data = {"checks": [ch.to_json() for ch in checks]}
        if failed:
            msg = f"{len(failed)} check(s) failed: " + "; ".join(f"{ch.name}: {ch.detail}" for ch in failed)
            return HostResult(h.name, "preflight", "failed", msg, tail=log.tail(), data=data)
        done = [ch for ch in checks if ch.status == "ok"]
        return HostResult(h.name, "preflight", "ok", f"{len(done)} checks ok: " + "; ".join(
            f"{ch.name} {ch.detail}" for ch in checks if ch.name != "ssh"), data=data)

    return run_per_host(actions, ctx, one)


STAGE = Stage("preflight", plan, apply,
              "check SSH, Docker, GPUs, architecture, free space, RAM, fabric and clocks on every host")
