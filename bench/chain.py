"""Chain distribution against the link's rate: checkpoint and image to 1, 3 and 7 workers.

    python3 bench/chain.py [--sizes 2,4,8] [--rate-mbit 200] [--mgmt-mbit 20] [--checkpoint-mb 600]
                           [--image-mb 300] [--no-unshaped] [--direct] [--keep] [--reuse]

One 8-host test cluster (`benchchain`); per size N an inventory of its first N hosts with
`distribution: chain`. Every host's fabric egress is shaped to R (tc tbf on its fab0, the test bed's
shape_egress) and its management egress to --mgmt-mbit, well below R. Then, per N:

  checkpoint  the workers' copies removed, `deployctl sync-model` of a synthetic checkpoint on node1
  image       the image removed from the workers, `deployctl ship` of an image with a random layer

Figures (the kernel's, not deployctl's): bytes each host sent on its fabric veth and on its
management veth (both directions there), from the veths' counters in the root namespace. Time: the
command's wall time, and the transfer (sync-model: the longest worker's copy, from joining the
chain to its last file verified; ship: the longest worker's first-to-last byte).

Ratios printed: transfer at 8 hosts / at 2 (goal <= 1.3), head's fabric bytes / payload (<= 1.05),
management bytes / payload (<= 1 %), transfer / (payload / R) (<= 1.25). Then the same unshaped at
the largest N (what bounds it then: the 2 shared cores), and with --direct the direct (rsync per
worker, head -> each) checkpoint sync unshaped, for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster import BUSYBOX_IMAGE, TestCluster, ensure_base_images   # noqa: E402
from tests.cluster.cluster import inventory_data, state_dir                 # noqa: E402
from tests.test_sync_model import worker_snap, write_checkpoint              # noqa: E402

NAME = "benchchain"
REPO = "dctl-bench/chain"
IMAGE = "dctl-bench-chain:1"


def dctl(*args: str, timeout: float = 3600) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    return p, time.monotonic() - t0


def inventory(c: TestCluster, n: int, distribution: str) -> Path:
    doc = inventory_data(NAME, c.hosts[:n], recipe="vllm-cpu")
    doc["all"]["vars"]["distribution"] = distribution
    p = state_dir(NAME) / f"bench-{n}-{distribution}.yml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def counters(c: TestCluster) -> dict[str, dict[str, int]]:
    def n(dev: str, what: str) -> int:
        return int(Path(f"/sys/class/net/{dev}/statistics/{what}_bytes").read_text())
    return {h.name: {"fabric": n(h.fabric_veth, "rx"), "mgmt": n(h.veth, "rx") + n(h.veth, "tx")} for h in c.hosts}


def sent(before: dict, after: dict, hosts) -> dict:
    d = {h.name: {k: after[h.name][k] - before[h.name][k] for k in ("fabric", "mgmt")} for h in hosts}
    return {"head_fabric": d[hosts[0].name]["fabric"], "mgmt": sum(v["mgmt"] for v in d.values()),
            "fabric_total": sum(v["fabric"] for v in d.values())}


def results(doc: dict) -> dict[str, dict]:
    return {r["host"]: r for s in doc.get("stages", []) for r in s["results"]}


def shape(c: TestCluster, n: int, rate: float | None, mgmt: float | None) -> None:
    for h in c.hosts:
        c.unshape_egress(h)
        c.unshape_egress(h, "eth0")
        if rate and h in c.hosts[:n]:
            c.shape_egress(h, rate)
            c.shape_egress(h, mgmt, "eth0")


def run_checkpoint(c: TestCluster, n: int, rev: str, payload: int, distribution: str = "chain") -> dict:
    for h in c.hosts[1:]:
        shutil.rmtree(worker_snap(h, REPO, rev), ignore_errors=True)
    inv = inventory(c, n, distribution)
    before = counters(c)
    p, wall = dctl("sync-model", "-i", str(inv), "--set", f"model.repo={REPO}", "--set", f"model.revision={rev}",
                   "--json")
    if p.returncode != 0:
        raise SystemExit(f"sync-model at {n} hosts failed:\n{p.stderr[-3000:]}")
    res = results(json.loads(p.stdout))
    copy = max(res[h.name]["data"]["copy_s"] for h in c.hosts[1:n])
    return {"what": "checkpoint", "n": n, "payload": payload, "wall_s": wall, "transfer_s": copy,
            **sent(before, counters(c), c.hosts[:n])}


def run_image(c: TestCluster, n: int, payload: int) -> dict:
    for h in c.hosts[1:]:
        subprocess.run(["docker", "-H", h.docker_host, "image", "rm", "-f", IMAGE], capture_output=True, timeout=120)
    inv = inventory(c, n, "chain")
    before = counters(c)
    p, wall = dctl("ship", "-i", str(inv), "--image", IMAGE, "--json")
    if p.returncode != 0:
        raise SystemExit(f"ship at {n} hosts failed:\n{p.stderr[-3000:]}")
    res = results(json.loads(p.stdout))
    stream = max(res[h.name]["data"]["stream_seconds"] for h in c.hosts[1:n])
    stream_bytes = res[c.hosts[1].name]["data"]["bytes_sent"]
    return {"what": "image", "n": n, "payload": stream_bytes, "wall_s": wall, "transfer_s": stream,
            **sent(before, counters(c), c.hosts[:n])}


def row(r: dict, rate_bps: float | None) -> str:
    ideal = r["payload"] / rate_bps if rate_bps else None
    return (f"| {r['what']:10} | {r['n']} | {r['payload'] / 1e6:7.1f} | {r['transfer_s']:6.2f} | {r['wall_s']:6.2f} | "
            f"{r['head_fabric'] / r['payload']:.3f} | {100 * r['mgmt'] / r['payload']:.3f} % | "
            + (f"{r['transfer_s'] / ideal:.2f} |" if ideal else "- |"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--rate-mbit", type=float, default=200.0)
    ap.add_argument("--mgmt-mbit", type=float, default=20.0)
    ap.add_argument("--checkpoint-mb", type=int, default=600)
    ap.add_argument("--image-mb", type=int, default=300)
    ap.add_argument("--no-unshaped", action="store_true")
    ap.add_argument("--direct", action="store_true", help="also the direct checkpoint sync, unshaped")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true")
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    c = TestCluster.attach(NAME) if a.reuse else TestCluster.up(NAME, max(sizes))
    rows: list[tuple[dict, float | None]] = []
    try:
        head = c.hosts[0]
        shard = a.checkpoint_mb * 1_000_000 // 3
        base = head.model_cache / f"models--{REPO.replace('/', '--')}"
        shutil.rmtree(base, ignore_errors=True)
        rev, snap = write_checkpoint(head.model_cache, REPO, shard)
        payload = sum(p.stat().st_size for p in snap.iterdir())
        ensure_base_images(debian=False)
        c.load_image(head.name, BUSYBOX_IMAGE)
        ctx = state_dir(NAME) / "bench-image"
        ctx.mkdir(parents=True, exist_ok=True)
        (ctx / "Dockerfile").write_text(f"FROM {BUSYBOX_IMAGE}\nRUN head -c {a.image_mb * 1_000_000} /dev/urandom > /w\n")
        subprocess.run(["docker", "-H", head.docker_host, "build", "-q", "-t", IMAGE, str(ctx)], check=True,
                       capture_output=True, env={**os.environ, "DOCKER_BUILDKIT": "0"}, timeout=600)
        dctl("sync-model", "-i", str(inventory(c, 2, "chain")), "--set", f"model.repo={REPO}",
             "--set", f"model.revision={rev}", "--json")          # the head's manifest cached: not timed below
        rate_bps = a.rate_mbit * 1e6 / 8
        for n in sizes:
            shape(c, n, a.rate_mbit, a.mgmt_mbit)
            rows.append((run_checkpoint(c, n, rev, payload), rate_bps))
            rows.append((run_image(c, n, 0), rate_bps))
            print(row(*rows[-2]), flush=True)
            print(row(*rows[-1]), flush=True)
        shape(c, max(sizes), None, None)
        if not a.no_unshaped:
            rows.append((run_checkpoint(c, max(sizes), rev, payload), None))
            rows.append((run_image(c, max(sizes), 0), None))
        if a.direct:
            for n in sizes:
                rows.append((run_checkpoint(c, n, rev, payload, "direct") | {"what": "ckpt-direct"}, None))
    finally:
        shape(c, 0, None, None)
        if not a.keep:
            c.down()
    print(f"\nR = {a.rate_mbit:g} Mbit/s per host's fabric egress ({a.rate_mbit / 8:g} MB/s), management "
          f"{a.mgmt_mbit:g} Mbit/s; payload/R ideal; '-' = unshaped\n")
    print("| what       | hosts | payload MB | transfer s | wall s | head fabric / payload | mgmt / payload | "
          "transfer / (payload/R) |")
    print("|---|---|---|---|---|---|---|---|")
    for r, rb in rows:
        print(row(r, rb))
    print()
    for what in ("checkpoint", "image"):
        shaped = {r["n"]: r for r, rb in rows if r["what"] == what and rb}
        if min(sizes) in shaped and max(sizes) in shaped:
            ratio = shaped[max(sizes)]["transfer_s"] / shaped[min(sizes)]["transfer_s"]
            print(f"{what}: transfer at {max(sizes)} hosts / at {min(sizes)}: {ratio:.2f} (goal <= 1.3); "
                  f"head fabric / payload max {max(r['head_fabric'] / r['payload'] for r in shaped.values()):.3f} "
                  f"(<= 1.05); mgmt / payload max {max(r['mgmt'] / r['payload'] for r in shaped.values()) * 100:.3f} % "
                  f"(<= 1 %); transfer / (payload/R) max "
                  f"{max(r['transfer_s'] / (r['payload'] / (a.rate_mbit * 1e6 / 8)) for r in shaped.values()):.2f} "
                  f"(<= 1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
