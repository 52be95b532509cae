#!/usr/bin/env python3
"""What a router in front of a deployment adds: TTFT and ITL through the router against the same
deployment directly, in the same run, interleaved (direct, router, direct, router, ...), so the
machine's drift hits both alike.

    python3 bench/router_overhead.py --direct http://127.0.0.1:18100 --via http://127.0.0.1:4000 \\
        --model a [--api-key K] [--direct-api-key K2] [--router-pid PID] [--repeats 6] [--concurrency 1,4]
        [--rounds 8]

Prints per concurrency level the medians (over every request of every repeat) of TTFT and ITL, both
ways, their ratios and the absolute difference in ms, the failed requests, and with --router-pid the
router's resident memory (VmRSS of the process and its children) after the run; --json prints the
same as JSON. Streaming chat completions through orchestrator/benchmark/loadgen.py, as `deployctl
bench` sends them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.benchmark.loadgen import LoadSpec, run_level  # noqa: E402


def rss_mb(pid: int) -> float:
    """VmRSS of PID and every descendant, MB."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            for t in Path(f"/proc/{p}/task").iterdir():
                kids = (t / "children").read_text().split()
                todo.extend(int(k) for k in kids)
        except (OSError, StopIteration):
            pass
    return total / 1024


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


async def measure(args) -> dict:
    levels = [int(c) for c in args.concurrency.split(",")]
    ways = {"direct": args.direct, "router": args.via}
    keys = {"direct": args.direct_api_key or args.api_key, "router": args.api_key}
    got: dict[int, dict[str, dict[str, list]]] = {c: {w: {"ttft": [], "itl": [], "failed": []} for w in ways}
                                                  for c in levels}
    for c in levels:                                   # warm both paths (connections, the router's caches)
        for way, url in ways.items():
            await run_level(LoadSpec(url, args.model, args.input_tokens, args.max_tokens, 1, args.timeout,
                                     api_key=keys[way]), c, 1)
    for rep in range(args.repeats):
        for c in levels:
            for way, url in (ways.items() if rep % 2 == 0 else reversed(list(ways.items()))):
                spec = LoadSpec(url, args.model, args.input_tokens, args.max_tokens, args.rounds, args.timeout,
                                api_key=keys[way])
                run = await run_level(spec, c, args.rounds, salt0=rep * 100000 + c * 1000)
                g = got[c][way]
                for r in run.results:
                    if not r.ok:
                        g["failed"].append(r.error)
                        continue
                    if r.ttft_s is not None:
                        g["ttft"].append(r.ttft_s)
                    if r.itl_s is not None:
                        g["itl"].append(r.itl_s)
    out = {"model": args.model, "direct": args.direct, "router": args.via, "repeats": args.repeats,
           "rounds": args.rounds, "levels": []}
    for c in levels:
        row = {"concurrency": c}
        for metric in ("ttft", "itl"):
            d, r = median(got[c]["direct"][metric]), median(got[c]["router"][metric])
            row[metric] = {"direct_ms": d and d * 1e3, "router_ms": r and r * 1e3,
                           "ratio": (r / d) if d and r else None, "added_ms": (r - d) * 1e3 if d and r else None}
        row["failed"] = {w: len(got[c][w]["failed"]) for w in ways}
        row["errors"] = sorted({e for w in ways for e in got[c][w]["failed"] if e})[:3]
        out["levels"].append(row)
    if args.router_pid:
        out["router_rss_mb"] = round(rss_mb(args.router_pid), 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--direct", required=True, help="the deployment's own API base URL")
    ap.add_argument("--via", required=True, help="the router's base URL")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default=None, help="the key the router takes (and the deployment, unless "
                                                    "--direct-api-key)")
    ap.add_argument("--direct-api-key", default=None, help="the deployment's own key, when it differs")
    ap.add_argument("--router-pid", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"router {args.via} vs direct {args.direct}, model {args.model}: {args.repeats} repeats x "
          f"{args.rounds} rounds per level, interleaved; medians")
    print(f"{'C':>3} {'TTFT direct':>12} {'router':>9} {'ratio':>6} {'added':>8}   {'ITL direct':>11} {'router':>9} "
          f"{'ratio':>6} {'added':>8}   failed d/r")
    for row in out["levels"]:
        t, i = row["ttft"], row["itl"]

        def f(x, fmt):
            return format(x, fmt) if x is not None else "-"
        print(f"{row['concurrency']:>3} {f(t['direct_ms'], '10.2f')}ms {f(t['router_ms'], '7.2f')}ms "
              f"{f(t['ratio'], '6.3f')} {f(t['added_ms'], '6.2f')}ms   {f(i['direct_ms'], '9.2f')}ms "
              f"{f(i['router_ms'], '7.2f')}ms {f(i['ratio'], '6.3f')} {f(i['added_ms'], '6.2f')}ms   "
              f"{row['failed']['direct']}/{row['failed']['router']}")
    if "router_rss_mb" in out:
        print(f"router resident memory after the run: {out['router_rss_mb']} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
