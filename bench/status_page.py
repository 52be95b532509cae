"""The status page's own cost (#60) on its host, each figure a ratio to a baseline measured in the same run:

    python3 bench/status_page.py [--window-s 30] [--browsers 5] [--json] [--keep] [--screenshot docs/status-page.png]

The demo cluster `benchpage` (`python3 -m tests.cluster demo`: 4 hosts, the DeepSeek TP=4 recipe on the
engine double), `deployctl up`, then on the head, over --window-s seconds each:

  alone      the head's supervisor with the page off (`--set supervise.page=false`): CPU (utime + stime
             of every process of its container, /proc) and resident memory: the baseline
  idle       the same supervisor serving the page, nobody looking
  browsers   --browsers real headless Chromium processes (tests/browser.py) with the page open: each polls
             /api/state by itself (every 2 s while healthy) and the bench reloads each every 5 s
  load       the page's load time in those browsers (navigation to the first rendered state), and one
             /api/state answer against one /metrics answer of the same process (median of 50 each)

Before the windows it kills the last rank's engine once (an incident for the timeline) and runs a small
`deployctl bench` (the plot on the page); with --screenshot it keeps a screenshot of the demo's page
(PNG, reduced to 64 colours). The machine's 2 vCPUs carry the cluster too: read the ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.real_vllm import dctl, must  # noqa: E402
from bench.supervisor import container_pids, cpu_s, docker, rss_mb  # noqa: E402
from orchestrator.deployment import load_deployment  # noqa: E402
from orchestrator.launch import status_page, supervision  # noqa: E402
from tests.browser import Browser  # noqa: E402
from tests.cluster.cluster import cleanup  # noqa: E402

NAME = "benchpage"


def supervisor_pids(dep) -> list[int]:
    h = dep.cluster.head_host
    (cid,) = docker(h, "ps", "-q", "--filter", f"label={supervision.LABEL}={dep.name}").split()
    return container_pids(h, cid)


def window(dep, seconds: float) -> dict:
    pids = supervisor_pids(dep)
    c0, t0 = cpu_s(pids), time.monotonic()
    time.sleep(seconds)
    used, took = cpu_s(pids) - c0, time.monotonic() - t0
    return {"cpu_percent_of_a_core": round(100 * used / took, 3), "rss_mb": round(rss_mb(pids), 1)}


FETCH = """import statistics, sys, time, urllib.request
t = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    with urllib.request.urlopen(sys.argv[1], timeout=10) as r:
        r.read()
    t.append((time.perf_counter() - t0) * 1000)
print(statistics.median(t))
"""


def fetch_ms(head: str, url: str, n: int = 50) -> float:
    """Median time of N GETs of URL, asked on the head itself (its supervisor's /metrics admits only the
    deployment's hosts and metrics_allow: the firewall chain), ms."""
    p = subprocess.run(["ip", "netns", "exec", f"dctl-{NAME}-{head}", sys.executable, "-c", FETCH, url, str(n)],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        sys.exit(f"timing {url} on {head} failed: {p.stderr[-2000:]}")
    return float(p.stdout.strip())


def load_once(page, url: str) -> float:
    """Navigation to the first rendered state (the page's own data-rendered mark), ms."""
    t0 = time.perf_counter()
    page.send("Page.navigate", {"url": url})
    page.wait("document.readyState === 'complete' && document.body && document.body.dataset.rendered", 30, 0.01)
    return (time.perf_counter() - t0) * 1000


def up(inv: str, *sets: str) -> None:
    p, took = dctl("up", "-i", inv, *sets)
    must(p, "deployctl up " + " ".join(sets))
    print(f"up {' '.join(sets)}: {took:.1f}s", file=sys.stderr)


def wait_watching(url: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url + "api/state", timeout=5) as r:
                if json.load(r)["verdict"] == "healthy":
                    return
        except OSError:
            pass
        time.sleep(1)
    sys.exit(f"the page at {url} did not say healthy within {timeout:g}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--browsers", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--screenshot", default=None, metavar="FILE.png")
    args = ap.parse_args()
    from tests.cluster.demo import prepare
    c = prepare(NAME, 4, log=lambda m: print(m, file=sys.stderr))
    inv = str(c.inventory_path)
    try:
        up(inv)
        dep = load_deployment(inv)
        url = status_page.url(dep)
        wait_watching(url)
        # an incident for the timeline, and a bench for its plot
        (cid,) = docker(dep.cluster.hosts[-1], "ps", "-q", "--filter", f"label=deployctl.deployment={dep.name}").split()
        docker(dep.cluster.hosts[-1], "kill", cid)
        time.sleep(5)
        wait_watching(url, 180)
        p, _ = dctl("bench", "-i", inv, "--concurrency", "1,2,4", "--rounds", "2", "--max-tokens", "32")
        must(p, "deployctl bench")
        time.sleep(2)

        up(inv, "--set", "supervise.page=false")
        time.sleep(3)
        alone = window(dep, args.window_s)
        up(inv)
        wait_watching(url)
        time.sleep(3)
        idle = window(dep, args.window_s)
        head = dep.cluster.head
        api_ms = fetch_ms(head, url + "api/state")
        metrics_ms = fetch_ms(head, f"http://{dep.cluster.head_host.address}:{dep.supervisor_port}/metrics")
        state_bytes = len(urllib.request.urlopen(url + "api/state", timeout=10).read())

        browsers = [Browser() for _ in range(args.browsers)]
        loads: list[float] = []
        try:
            pages = [b.page() for b in browsers]
            for p_ in pages:
                loads.append(load_once(p_, url))
            stop = threading.Event()

            def reload_loop() -> None:
                i = 0
                while not stop.is_set():
                    stop.wait(5.0 / len(pages))
                    if not stop.is_set():
                        loads.append(load_once(pages[i % len(pages)], url))
                        i += 1
            t = threading.Thread(target=reload_loop, daemon=True)
            t.start()
            under = window(dep, args.window_s)
            stop.set()
            t.join(30)
            chrome_rss = sum(rss_mb(b.pids()) for b in browsers)
            if args.screenshot:
                shot = pages[0]
                shot.eval("document.querySelector('#s-incidents details') && (document.querySelector('#s-incidents details').open = true); true")
                time.sleep(0.5)
                raw = shot.screenshot(Path(tempfile.mkdtemp()) / "page.png")
                from PIL import Image
                Image.open(raw).convert("RGB").quantize(64).save(args.screenshot, optimize=True)
                print(f"screenshot: {args.screenshot} ({Path(args.screenshot).stat().st_size} bytes)", file=sys.stderr)
        finally:
            for b in browsers:
                b.close()
        base = alone["cpu_percent_of_a_core"] or 0.001
        doc = {"window_s": args.window_s, "browsers": args.browsers, "alone": alone, "idle": idle, "browsing": under,
               "cpu_ratio_idle": round(idle["cpu_percent_of_a_core"] / base, 2),
               "cpu_ratio_browsing": round(under["cpu_percent_of_a_core"] / base, 2),
               "rss_ratio_idle": round(idle["rss_mb"] / alone["rss_mb"], 2),
               "rss_ratio_browsing": round(under["rss_mb"] / alone["rss_mb"], 2),
               "load_ms": {"n": len(loads), "median": round(statistics.median(loads), 1),
                           "p95": round(sorted(loads)[int(0.95 * (len(loads) - 1))], 1), "max": round(max(loads), 1)},
               "api_state_ms": round(api_ms, 2), "metrics_ms": round(metrics_ms, 2),
               "api_state_vs_metrics": round(api_ms / metrics_ms, 2), "api_state_bytes": state_bytes,
               "chromium_rss_mb_all": round(chrome_rss, 1)}
        if args.json:
            print(json.dumps(doc, indent=1))
        else:
            print(f"supervisor alone      CPU {alone['cpu_percent_of_a_core']:.3f} % of a core, RSS {alone['rss_mb']} MB")
            print(f"+ page, idle          CPU {idle['cpu_percent_of_a_core']:.3f} % (x{doc['cpu_ratio_idle']}), "
                  f"RSS {idle['rss_mb']} MB (x{doc['rss_ratio_idle']})")
            print(f"+ page, {args.browsers} browsers    CPU {under['cpu_percent_of_a_core']:.3f} % (x{doc['cpu_ratio_browsing']}), "
                  f"RSS {under['rss_mb']} MB (x{doc['rss_ratio_browsing']})")
            lm = doc["load_ms"]
            print(f"load time             median {lm['median']} ms, p95 {lm['p95']} ms, max {lm['max']} ms ({lm['n']} loads)")
            print(f"/api/state            {api_ms:.2f} ms ({state_bytes} bytes) vs /metrics {metrics_ms:.2f} ms: "
                  f"x{doc['api_state_vs_metrics']}")
        return 0
    finally:
        if not args.keep:
            p, _ = dctl("down", "-i", inv, timeout=300)
            cleanup(NAME, log=lambda m: print(m, file=sys.stderr))


if __name__ == "__main__":
    sys.exit(main())
