"""bench/router_overhead.py measures both ways in one run: against an engine double reached twice
directly (the "router" is the deployment itself), nothing fails, both ways are measured, and the
ratios sit near 1 (what a router adds is what the bench isolates)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.test_launch_units import _free_port

REPO = Path(__file__).resolve().parents[1]


def test_router_overhead_measures_both_ways(tmp_path):
    port = _free_port()
    env = {**os.environ, "DOUBLE_LOAD_S": "0", "DOUBLE_TTFT_MS": "20", "DOUBLE_TOKENS_PER_S": "400"}
    (tmp_path / "m").mkdir()
    double = subprocess.Popen([sys.executable, str(REPO / "tests/engine_double/engine_double.py"), "vllm", "serve",
                               str(tmp_path / "m"), "--host", "127.0.0.1", "--port", str(port),
                               "--served-model-name", "a", "--api-key", "KEYA"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        p = subprocess.run([sys.executable, str(REPO / "bench/router_overhead.py"), "--direct", url, "--via", url,
                            "--model", "a", "--api-key", "KEYA", "--router-pid", str(double.pid), "--repeats", "2",
                            "--rounds", "3", "--concurrency", "1,2", "--json"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert [r["concurrency"] for r in doc["levels"]] == [1, 2]
        for r in doc["levels"]:
            assert r["failed"] == {"direct": 0, "router": 0}, r
            for metric in ("ttft", "itl"):
                assert r[metric]["direct_ms"] > 0 and r[metric]["router_ms"] > 0, r
                assert 0.5 < r[metric]["ratio"] < 2.0, r
        assert doc["router_rss_mb"] > 5
        # a wrong key on the direct way: the failures are counted, not hidden
        p = subprocess.run([sys.executable, str(REPO / "bench/router_overhead.py"), "--direct", url, "--via", url,
                            "--model", "a", "--api-key", "KEYA", "--direct-api-key", "WRONG", "--repeats", "1",
                            "--rounds", "1", "--concurrency", "1", "--json"], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        (row,) = json.loads(p.stdout)["levels"]
        assert row["failed"]["direct"] == 1 and row["failed"]["router"] == 0, row
    finally:
        os.killpg(double.pid, signal.SIGTERM)          # the double and its worker child
        double.wait(timeout=30)
