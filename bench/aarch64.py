"""The aarch64 tier's cost: the same pipeline on arm64 test hosts (qemu-user) and on x86-64 test hosts, one run.

    python3 bench/aarch64.py [--rounds 10] [--keep]

Two 2-host test clusters made here, one after the other: `benchx86` (this machine's architecture) and
`bencharm` (aarch64: tests/cluster/arm64.py, every program run over SSH is an arm64 binary under
qemu-user, each host's dockerd native), each with the demo's recipe for 2 hosts (DeepSeek-V4.1-Flash
scaled, TP=2, the engine double; tests/cluster/demo.py `prepare`). On each:

  cold    `deployctl up --json` on a fresh cluster: build (the test-double chain for the head's platform),
          ship over the fabric, fetch-model, sync-model, stage-engram, launch, health, supervise;
          every stage's own time from the run (`stages[].seconds`)
  no-op   `deployctl up` again (nothing to do: every stage asks the hosts and skips)
  status  `deployctl status`
  ssh     over one open SSH connection per host, ROUNDS times each: `true`, `python3 -c pass`,
          `python3 -c 'import json, hashlib, ssl'` (the host-side programs' start), and
          `docker version` (the arm64 CLI against the native engine)

Printed: each figure on both and the ratio arm64 / x86-64 (the slowdown emulation costs), and which
stages make up most of the cold `up`'s difference.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import TestCluster                      # noqa: E402
from tests.cluster.demo import prepare                      # noqa: E402

CLUSTERS = {"x86_64": "benchx86", "aarch64": "bencharm"}
PROBES = {"true": ["true"], "python3 -c pass": ["python3", "-c", "pass"],
          "python3 import json,hashlib,ssl": ["python3", "-c", "import json, hashlib, ssl"],
          "docker version": ["docker", "version", "--format", "{{.Client.Arch}}"]}


def dctl(*args: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    return p, time.monotonic() - t0


def probe(c: TestCluster, rounds: int) -> dict[str, float]:
    """Median seconds per probe over one open SSH connection to each host (all hosts pooled)."""
    times: dict[str, list[float]] = {k: [] for k in PROBES}
    for h in c.hosts:
        with c.ssh_target(h).connect() as s:
            for name, argv in PROBES.items():
                for _ in range(rounds):
                    t0 = time.monotonic()
                    r = s.run(argv, timeout=60)
                    times[name].append(time.monotonic() - t0)
                    if r.rc != 0:
                        raise SystemExit(f"{h.name}: {argv} exited {r.rc}: {r.stderr[-300:]}")
    return {k: statistics.median(v) for k, v in times.items()}


def one(arch: str, rounds: int, keep: bool) -> dict:
    name = CLUSTERS[arch]
    t0 = time.monotonic()
    c = prepare(name, 2, log=lambda m: None, arch=arch)
    made = time.monotonic() - t0
    inv = str(c.inventory_path)
    try:
        dctl("down", "-i", inv)
        p, cold = dctl("up", "-i", inv, "--json")
        if p.returncode != 0:
            raise SystemExit(f"{arch}: up failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        stages = {s["name"]: s["seconds"] for s in json.loads(p.stdout)["stages"]}
        p, noop = dctl("up", "-i", inv)
        if p.returncode != 0:
            raise SystemExit(f"{arch}: the no-op up failed:\n{p.stderr[-2000:]}")
        _, status = dctl("status", "-i", inv)
        ssh = probe(c, rounds)
        dctl("down", "-i", inv)
        return {"cluster_s": made, "cold_s": cold, "stages": stages, "noop_s": noop, "status_s": status, "ssh": ssh}
    finally:
        if not keep:
            c.down()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--keep", action="store_true", help="leave both clusters up")
    a = ap.parse_args()
    r = {arch: one(arch, a.rounds, a.keep) for arch in ("x86_64", "aarch64")}
    x, m = r["x86_64"], r["aarch64"]

    def row(what: str, xs: float, ms: float, unit: str = "s") -> None:
        f = (lambda v: f"{v * 1000:9.1f} ms") if unit == "ms" else (lambda v: f"{v:9.1f} s ")
        print(f"  {what:<38} {f(xs)} {f(ms)}   x{ms / xs if xs else float('nan'):5.2f}")

    print(f"{'':40} {'x86_64':>11} {'aarch64':>11}   arm64 / x86-64")
    row("cluster made (warm caches)", x["cluster_s"], m["cluster_s"])
    row("up, cold (wall)", x["cold_s"], m["cold_s"])
    for st in x["stages"]:
        if st in m["stages"]:
            row(f"  {st}", x["stages"][st], m["stages"][st])
    row("up, no-op", x["noop_s"], m["noop_s"])
    row("status", x["status_s"], m["status_s"])
    for k in PROBES:
        row(f"ssh: {k}", x["ssh"][k], m["ssh"][k], "ms")
    diff = {st: m["stages"][st] - x["stages"][st] for st in x["stages"] if st in m["stages"]}
    total = sum(d for d in diff.values() if d > 0) or 1.0
    top = sorted(diff.items(), key=lambda kv: -kv[1])[:4]
    print("where the cold up's extra time goes: "
          + ", ".join(f"{st} +{d:.1f}s ({d / total:.0%})" for st, d in top if d > 0))
    print(json.dumps({"deployctl.bench.aarch64": 1, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
