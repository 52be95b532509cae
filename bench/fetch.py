"""fetch-model's download against curl, from the same local Hub endpoint, in one run.

    python3 bench/fetch.py [--files 4] [--mb 512] [--dir /var/tmp/deployctl-bench-fetch]

Publishes FILES safetensors shards of MB each on tests/hub_endpoint.py (served on 127.0.0.1), then:
- curl: each file from its resolve URL to disk, one after the other, then `sync` of the files (the
  baseline: no client, no hash; fetch also ends with its files on disk before it writes its state);
- fetch: orchestrator/hostside/hubfetch.py `fetch`, what the head runs (the released huggingface_hub
  client's http_get, every byte hashed as it is written, published into the HF cache layout);
- no-op: `check` of the complete snapshot (what decides that a re-run has nothing to do).
Both transfers start with the source files in the page cache (read once before) and nothing dirty to
write back (`sync`); each runs twice from empty and the faster run counts (the first carries the
start-up of new files and, for fetch, python's imports). Prints the throughputs and fetch/curl (target
>= 0.9), and the no-op time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.hub_endpoint import publish, set_faults  # noqa: E402

HUBFETCH = REPO / "orchestrator" / "hostside" / "hubfetch.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--dir", default="/var/tmp/deployctl-bench-fetch")
    ap.add_argument("--rate-mbps", type=float, default=0,
                    help="serve file bodies at this many MB/s (an uplink's rate); 0: as fast as loopback goes")
    a = ap.parse_args()
    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    src = work / "src"
    src.mkdir(parents=True)
    for i in range(a.files):
        with open(src / f"model-{i + 1:05d}-of-{a.files:05d}.safetensors", "wb") as f:
            for _ in range(a.mb):
                f.write(os.urandom(1 << 20))
    (src / "config.json").write_text('{"model_type": "bench"}')
    commit = publish(work / "hub", "bench/model", src)
    if a.rate_mbps:
        set_faults(work / "hub", "bench/model", rate=int(a.rate_mbps * 1e6))
    total = sum(p.stat().st_size for p in src.iterdir())
    subprocess.run(["sync"], check=True)           # the sources' own writeback must not land on a run
    for p in src.iterdir():                       # both runs read the source from the page cache
        p.read_bytes()
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-m", "tests.hub_endpoint", "--root", str(work / "hub"), "--port",
                            str(port)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        names = sorted(p.name for p in src.iterdir())
        curl_s = []
        for attempt in range(2):
            out = work / f"curl{attempt}"
            out.mkdir()
            subprocess.run(["sync"], check=True)
            t0 = time.monotonic()
            for n in names:
                subprocess.run(["curl", "-sf", "-o", str(out / n), f"{url}/bench/model/resolve/{commit}/{n}"],
                               check=True)
            subprocess.run(["sync", *[str(out / n) for n in names]], check=True)   # on disk, as fetch ends
            curl_s.append(time.monotonic() - t0)
            shutil.rmtree(out)
        job = {"endpoint": url, "repo": "bench/model", "revision": "main", "allow": [],
               "model_cache": str(work / "cache"), "state": str(work / "state.json"), "ask_hub": True}
        res = json.loads(subprocess.run([sys.executable, str(HUBFETCH), "resolve"], input=json.dumps(job),
                                        capture_output=True, text=True, check=True).stdout)
        job.update(commit=res["commit"], files=res["files"])
        fetch_runs = []
        for attempt in range(2):                  # each from an empty cache, as curl's runs
            shutil.rmtree(work / "cache", ignore_errors=True)
            (work / "state.json").unlink(missing_ok=True)
            subprocess.run(["sync"], check=True)
            t0 = time.monotonic()
            f = subprocess.run([sys.executable, str(HUBFETCH), "fetch"], input=json.dumps(job),
                               capture_output=True, text=True)
            fetch_runs.append(time.monotonic() - t0)
            if f.returncode != 0:
                print(f.stderr, file=sys.stderr)
                return 1
        fetch_s = min(fetch_runs)
        t0 = time.monotonic()
        chk = json.loads(subprocess.run([sys.executable, str(HUBFETCH), "check"], input=json.dumps(job),
                                        capture_output=True, text=True, check=True).stdout)
        noop_s = time.monotonic() - t0
        assert chk["up_to_date"], chk
    finally:
        srv.terminate()
        srv.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    curl = min(curl_s)
    print(f"{a.files} files, {total / 1e9:.2f} GB from {url}"
          f"{f' at {a.rate_mbps:g} MB/s per connection' if a.rate_mbps else ' (loopback, unthrottled)'}")
    print(f"curl (baseline):      {curl:6.2f} s  {total / curl / 1e6:8.0f} MB/s")
    print(f"fetch-model (verify): {fetch_s:6.2f} s  {total / fetch_s / 1e6:8.0f} MB/s   "
          f"ratio fetch/curl {curl / fetch_s:.2f} (target >= 0.9)")
    print(f"no-op check:          {noop_s:6.3f} s  (complete snapshot, no byte read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
