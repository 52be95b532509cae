"""The fabric check's wall time at 4 and 8 hosts, and the rate it reports for a tc-shaped link.

    python3 bench/fabric.py [--sizes 4,8] [--rates 100,500] [--name benchfab]

For each cluster size: a test cluster of that many hosts (tests/cluster/, its fabric bridge at MTU 9000),
then `deployctl fabric --json` (every pair measured: reachability, DF ping, iperf3 -P 4 -t 2 in
round-robin rounds) timed end to end, twice (the faster counts). On the 4-host cluster one link
(node2-node3) is then shaped with tc to each RATE (Mbit/s) and measured twice: by the check (its
reported a -> b rate) and, as the baseline in the same run, by iperf3 run directly between the two
namespaces with the same flags. Prints the check's time, the pairs and rounds, and reported/shaping and
reported/direct ratios (target: within 10 % of the shaping rate).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.cluster import TestCluster, cluster_lock  # noqa: E402

PORT = 5301          # the direct baseline's port (the check uses the recipe's 5201)


def inventory(c: TestCluster, tmp: Path) -> Path:
    doc = yaml.safe_load(c.inventory_path.read_text())
    doc["all"]["vars"]["run_dir"] = str(tmp / "runs")
    over = doc["all"]["vars"].setdefault("recipe_overrides", {})
    over.update({"fabric.expected_gbps": 1, "fabric.iperf_seconds": 2})    # the recipes' default 2 s per pair
    p = tmp / f"inventory-{len(c.hosts)}.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def check(inv: Path) -> tuple[float, dict]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", "fabric", "-i", str(inv), "--json"],
                       capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    doc = json.loads(p.stdout)
    rep = next(r["data"]["fabric"] for s in doc["stages"] for r in s["results"] if r.get("data", {}).get("fabric"))
    return took, rep


def direct(c: TestCluster, a: str, b: str, seconds: int = 2, streams: int = 4) -> float:
    """iperf3 between A and B's namespaces with the check's flags: the baseline, Gb/s received."""
    ha, hb = c.host(a), c.host(b)
    srv = subprocess.Popen(["nsenter", f"--net={hb.netns_path}", "iperf3", "-s", "-1", "-B", hb.fabric_address,
                            "-p", str(PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            out = c.nsexec(a, ["iperf3", "-c", hb.fabric_address, "-B", ha.fabric_address, "-p", str(PORT),
                               "-t", str(seconds), "-P", str(streams), "-J"], timeout=60).stdout
            if "refused" not in out:
                break
            time.sleep(0.1)
    finally:
        srv.wait(timeout=60)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,8")
    ap.add_argument("--rates", default="100,500", help="shaping rates in Mbit/s for one link")
    ap.add_argument("--name", default="benchfab")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    rates = [int(x) for x in a.rates.split(",")]
    rows, shaped = [], []
    with tempfile.TemporaryDirectory(prefix="deployctl-bench-fabric-") as tmp, cluster_lock(a.name, timeout=60):
        for n in sizes:
            c = TestCluster.up(a.name, n)
            try:
                inv = inventory(c, Path(tmp))
                runs = [check(inv) for _ in range(2)]
                took, rep = min(runs, key=lambda r: r[0])
                assert rep["ok"], rep["findings"]
                rounds = n - 1 if n % 2 == 0 else n
                rows.append((n, len(rep["links"]), rounds, took, rep["seconds"], min(
                    x["throughput"]["gbps"] for x in rep["links"])))
                if n == sizes[0]:
                    for rate in rates:
                        c.throttle_link("node2", "node3", rate)
                        try:
                            got = []
                            for _ in range(2):
                                _, rep = check(inv)
                                got.append(next(x["throughput"]["gbps"] for x in rep["links"]
                                                if (x["a"], x["b"]) == ("node2", "node3")))
                            base = direct(c, "node2", "node3")
                        finally:
                            c.unthrottle_link("node2", "node3")
                        shaped.append((rate, got, base))
            finally:
                c.down()
    print("| hosts | pairs | rounds | `deployctl fabric` wall | check itself | slowest pair |")
    print("|---|---|---|---|---|---|")
    for n, pairs, rounds, took, inner, slow in rows:
        print(f"| {n} | {pairs} | {rounds} | {took:.1f} s | {inner:.1f} s | {slow:.2f} Gb/s |")
    print()
    print("| shaped link (tc) | reported by the check (2 runs) | reported / shaping | iperf3 direct | reported / direct |")
    print("|---|---|---|---|---|")
    for rate, got, base in shaped:
        r = [g * 1000 / rate for g in got]
        print(f"| {rate} Mbit/s | {', '.join(f'{g * 1000:.1f}' for g in got)} Mbit/s | "
              f"{', '.join(f'{x:.3f}' for x in r)} | {base * 1000:.1f} Mbit/s | "
              f"{', '.join(f'{g / base:.3f}' for g in got)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
