"""Benchmark `deployctl ship` on a 4-host test cluster it brings up itself (and takes down), per engine.

    python3 bench/ship.py [--mb 300] [--name shipbench] [--engine 26] [--engine 26-containerd] [--json]

--engine (repeatable; default 20.10, 26 and 26-containerd, one cluster after another): the Docker
engine of every host (tests/cluster/engines.py), or HEAD,WORKER,... for a mixed cluster.

Builds on the head (node1) an image FROM dctl-busybox with three layers of random data (MB in all)
and a small patch layer, then measures, in the same run and from empty workers each time:

  baseline  the manual way: on the head, `docker save IMAGE | ssh WORKER docker load`, one worker
            after another (what the vendor reports did, with host keys checked like deployctl)
  full      `deployctl ship` to the 3 workers (one save on the head, fanned out in parallel)
  unchanged `deployctl ship` again: should move no image bytes (only SSH chatter remains)
  patch     the patch layer changed: `deployctl ship` sends that layer only (target <= 5% of full)

Bytes are counted independently of deployctl: the cluster's veth counters in the root namespace
(`/sys/class/net/<veth>/statistics`): rx of the head's veth = what the head sent, tx of a worker's
veth = what reached that worker (from the head and from this machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.ship.transfer import Timeouts, worker_ssh_argv   # noqa: E402
from orchestrator.inventory import load_inventory                   # noqa: E402
from tests.cluster import BUSYBOX_IMAGE, TestCluster, ensure_base_images   # noqa: E402

IMAGE = "dctl-shipbench:1"


def counters(c: TestCluster) -> dict[str, int]:
    def read(dev: str, what: str) -> int:
        return int(Path(f"/sys/class/net/{dev}/statistics/{what}").read_text())
    out = {"head_tx": read(c.hosts[0].veth, "rx_bytes")}
    for h in c.hosts[1:]:
        out[h.name] = read(h.veth, "tx_bytes")
    return out


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    d = {k: b[k] - a[k] for k in a}
    d["workers_rx"] = sum(v for k, v in d.items() if k.startswith("node"))
    return d


def docker(c: TestCluster, host: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "-H", c.host(host).docker_host, *args], capture_output=True, text=True,
                          timeout=timeout)


def build(c: TestCluster, ctx: Path, mb: int, patch: bytes) -> str:
    sizes = [mb // 2, mb * 3 // 10, mb - mb // 2 - mb * 3 // 10]
    steps = "".join(f"RUN head -c {s * 1_000_000} /dev/urandom > /data{i}\n" for i, s in enumerate(sizes))
    (ctx / "Dockerfile").write_text(f"FROM {BUSYBOX_IMAGE}\n{steps}COPY patch.bin /patch.bin\n")
    (ctx / "patch.bin").write_bytes(patch)
    r = subprocess.run(["docker", "-H", c.hosts[0].docker_host, "build", "-q", "-t", IMAGE, str(ctx)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    if r.returncode != 0:
        raise SystemExit(f"build failed: {r.stderr[-2000:]}")
    return r.stdout.strip()


def clear_workers(c: TestCluster) -> None:
    for h in c.hosts[1:]:
        docker(c, h.name, "image", "rm", "-f", IMAGE)
        docker(c, h.name, "image", "prune", "-af")
        left = docker(c, h.name, "image", "ls", "-aq").stdout.split()
        if left:
            raise SystemExit(f"{h.name} still has images {left}")


def ship(c: TestCluster) -> tuple[float, dict, dict]:
    before = counters(c)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", "ship", "-i", str(c.inventory_path), "--image", IMAGE,
                        "--json"], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    secs = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"deployctl ship failed ({p.returncode}):\n{p.stderr[-3000:]}")
    doc = json.loads(p.stdout)
    per_host = {r["host"]: r["data"] for s in doc["stages"] for r in s["results"]}
    return secs, delta(before, counters(c)), per_host


def baseline(c: TestCluster, tuned: bool) -> tuple[float, dict, list[float]]:
    """The manual distribution, run on the head: save | ssh load, serially. TUNED: with deployctl's
    ssh options (AES-GCM first), else plain ssh (OpenSSH's default cipher order) as people type it."""
    inv = load_inventory(c.inventory_path)
    head = inv.head_host
    t = Timeouts()
    steps = []
    for w in inv.workers:
        if tuned:
            ssh = worker_ssh_argv(w, inv, w.key_file, inv.known_hosts_file, t)[:-1]   # without the relay
        else:
            ssh = ["ssh", "-i", w.key_file, "-o", f"UserKnownHostsFile={inv.known_hosts_file}",
                   "-o", "StrictHostKeyChecking=yes", f"{w.user}@{w.address}"]
        load = shlex.join(["docker", "-H", w.docker_host, "load"])
        steps.append(f"docker -H {shlex.quote(head.docker_host)} save {IMAGE} | {shlex.join(ssh)} {shlex.quote(load)}")
    script = "set -e; " + "; ".join(f"s=$(date +%s.%N); {s} >/dev/null; e=$(date +%s.%N); echo $s $e"
                                     for s in steps)
    before = counters(c)
    t0 = time.monotonic()
    r = c.ssh_target(head.name).run(["bash", "-c", script], timeout=3600)
    secs = time.monotonic() - t0
    if r.rc != 0:
        raise SystemExit(f"baseline failed: {r.stderr[-2000:]}")
    each = [float(e) - float(s) for s, e in (ln.split() for ln in r.stdout.split("\n") if ln.strip())]
    return secs, delta(before, counters(c)), each


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def run_engine(engine: str, name: str, mb_: int) -> dict:
    """Every measurement on one fresh 4-host cluster whose hosts run ENGINE."""
    ensure_base_images(debian=False)
    c = TestCluster.up(name, 4, engine=engine)
    try:
        c.load_image("node1", BUSYBOX_IMAGE)
        with tempfile.TemporaryDirectory(prefix="dctl-shipbench-") as tmp:
            image_id = build(c, Path(tmp), mb_, b"v1" * 5000)
            size = json.loads(docker(c, "node1", "image", "inspect", IMAGE).stdout)[0]["Size"]
            # warm the head's page cache for both contenders alike
            warm = subprocess.run(f"docker -H {c.hosts[0].docker_host} save {image_id} | wc -c", shell=True,
                                  capture_output=True, text=True)
            save_bytes = int(warm.stdout.strip())

            clear_workers(c)
            plain_s, _, plain_each = baseline(c, tuned=False)
            clear_workers(c)
            base_s, base_bytes, base_each = baseline(c, tuned=True)
            clear_workers(c)
            full_s, full_bytes, full_hosts = ship(c)
            same_s, same_bytes, same_hosts = ship(c)
            build(c, Path(tmp), mb_, os.urandom(10_000))
            patch_s, patch_bytes, patch_hosts = ship(c)
    finally:
        c.down()
    return {
        "engine": engine,
        "image": {"name": IMAGE, "size": size, "save_bytes": save_bytes},
        "baseline_serial_plain_ssh": {"seconds": round(plain_s, 2), "per_worker_s": [round(x, 2) for x in plain_each]},
        "baseline_serial": {"seconds": round(base_s, 2), "per_worker_s": [round(x, 2) for x in base_each],
                            "bytes": base_bytes},
        "full": {"seconds": round(full_s, 2), "bytes": full_bytes, "deployctl": full_hosts},
        "unchanged": {"seconds": round(same_s, 2), "bytes": same_bytes, "deployctl": same_hosts},
        "patch": {"seconds": round(patch_s, 2), "bytes": patch_bytes, "deployctl": patch_hosts,
                  "fraction_of_full": round(patch_bytes["workers_rx"] / full_bytes["workers_rx"], 5)},
        "wall_time_ratio_baseline_over_full": round(base_s / full_s, 2),
        "wall_time_ratio_plain_baseline_over_full": round(plain_s / full_s, 2),
        "load_average": os.getloadavg(),
    }


def report(doc: dict) -> None:
    size, save_bytes = doc["image"]["size"], doc["image"]["save_bytes"]
    print(f"\nDocker {doc['engine']}: image {IMAGE}: {mb(size)} (docker save stream {mb(save_bytes)}), 3 workers")
    print(f"{'run':<34}{'wall s':>8}{'head sent':>14}{'workers got':>14}")
    print(f"{'baseline: plain ssh, serial':<34}{doc['baseline_serial_plain_ssh']['seconds']:>8.1f}")
    rows = [("baseline: same ssh opts, serial", doc["baseline_serial"]),
            ("deployctl ship, full", doc["full"]),
            ("deployctl ship, unchanged", doc["unchanged"]),
            ("deployctl ship, patch layer only", doc["patch"])]
    for label, r in rows:
        print(f"{label:<34}{r['seconds']:>8.1f}{mb(r['bytes']['head_tx']):>14}{mb(r['bytes']['workers_rx']):>14}")
    print(f"wall-time ratio baseline / deployctl full: {doc['wall_time_ratio_baseline_over_full']}x "
          f"(plain-ssh baseline: {doc['wall_time_ratio_plain_baseline_over_full']}x); "
          f"load average {' '.join(f'{x:.1f}' for x in doc['load_average'])} (2 cores shared by all hosts)")
    same = doc["unchanged"]
    print(f"unchanged: {same['bytes']['workers_rx']:,} bytes reached the workers (SSH chatter: probes and checks), "
          f"deployctl reports {sum(h['bytes_sent'] for h in same['deployctl'].values())} image bytes")
    print(f"patch: {doc['patch']['fraction_of_full']:.4%} of the full ship's bytes "
          f"(deployctl: {', '.join(str(h['bytes_sent']) for h in doc['patch']['deployctl'].values())} bytes per worker)")


def side_by_side(docs: list[dict]) -> None:
    """The engines next to each other: wire bytes (veth counters), wall time, ratio to the serial loop."""
    print("\n| engine | full: workers got | full wall | serial save\\|load wall | baseline / ship "
          "| unchanged: workers got | patch: workers got | patch / full |")
    print("|---|---|---|---|---|---|---|---|")
    for d in docs:
        print(f"| {d['engine']} | {mb(d['full']['bytes']['workers_rx'])} | {d['full']['seconds']:.1f} s "
              f"| {d['baseline_serial']['seconds']:.1f} s | {d['wall_time_ratio_baseline_over_full']}x "
              f"| {d['unchanged']['bytes']['workers_rx'] / 1e3:,.1f} KB | {d['patch']['bytes']['workers_rx'] / 1e3:,.1f} KB "
              f"| {d['patch']['fraction_of_full']:.3%} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=300, help="random data in the image's three big layers (MB)")
    ap.add_argument("--name", default="shipbench", help="test cluster name (its own netns, daemons)")
    ap.add_argument("--engine", action="append", default=None,
                    help="Docker engine of the hosts (repeatable): 20.10 | 26 | 26-containerd | HEAD,WORKER,...")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    docs = [run_engine(e, a.name, a.mb) for e in (a.engine or ["20.10", "26", "26-containerd"])]
    if a.json:
        print(json.dumps(docs if len(docs) > 1 else docs[0], indent=2))
        return 0
    for d in docs:
        report(d)
    side_by_side(docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
