"""deployctl bench against the real engine double (tests/engine_double/engine_double.py) on 127.0.0.1.

Truth configured in the double: first token after TTFT_MS, then RATE tokens/s, one token per chunk, so a
request of n tokens takes ttft + (n-1)/rate and its TPS (TTFT included) is n / (ttft + (n-1)/rate).
Tolerances (scheduling noise of a shared 2-core machine plus HTTP overhead; the double sleeps until
monotonic deadlines, so there is no drift): TTFT +0..+TTFT_SLACK_MS, ITL +-ITL_TOL, TPS -TPS_TOL..+2 %.
Every process started here is killed by its own handle; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from click.testing import CliRunner

from orchestrator.benchmark.loadgen import LevelRun, LoadSpec, RequestResult, one_request, run_level
from orchestrator.benchmark.plot import MEASURED, REFERENCE, build_figure, save_png
from orchestrator.benchmark.report import build_report, compare, level_stats, max_concurrency, verdict
from orchestrator.cli import cli
from orchestrator.recipe import BenchPoint, BenchSpec

ROOT = Path(__file__).resolve().parent.parent
DOUBLE = ROOT / "tests" / "engine_double" / "engine_double.py"
RECIPE = ROOT / "recipes" / "qwen38-flash-next-rtx.yml"
MODEL = "qwen3.8-flash-next"          # engine.served_name of that recipe
LOOP = "127.0.0.1"

TTFT_MS, RATE = 150.0, 40.0
TTFT_SLACK_MS = 60.0
ITL_TOL = 0.10
TPS_TOL = 0.10


def expected_tps(n: int) -> float:
    return n / (TTFT_MS / 1000 + (n - 1) / RATE)


def expected_latency(n: int) -> float:
    return TTFT_MS / 1000 + (n - 1) / RATE


# ------------------------------------------------------------------------------------------ fixtures

def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOP, 0))
        return s.getsockname()[1]


def start_double(tmp: Path, **env_extra: str):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOUBLE_")}
    env.update(DOUBLE_TTFT_MS=str(TTFT_MS), DOUBLE_TOKENS_PER_S=str(RATE), DOUBLE_LOAD_S="0",
               PYTHONUNBUFFERED="1", **env_extra)
    log = open(tmp / f"double-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, str(DOUBLE), "vllm", "serve", "/models/qwen", "--port", str(port),
                             "--host", LOOP, "--served-model-name", MODEL],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{LOOP}:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / f"double-{port}.log").read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, port, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the engine double did not answer /health within 20 s")


def stop_double(proc: subprocess.Popen, log) -> None:
    proc.kill()                      # by its own handle
    proc.wait(timeout=10)
    log.close()


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    proc, port, url, log = start_double(tmp_path_factory.mktemp("double"))
    yield port, url
    stop_double(proc, log)


def write_inventory(tmp: Path, port: int) -> Path:
    inv = {"all": {"vars": {"deployment": "loop", "recipe": str(RECIPE), "head": "h0", "api_port": port},
                   "hosts": {"h0": {"ansible_host": LOOP, "rank": 0, "hardware": "rtx-pro-6000", "gpus": 1,
                                    "nvme_dir": str(tmp / "nvme"), "model_cache": str(tmp / "hf")}}}}
    path = tmp / "inv.yml"
    path.write_text(yaml.safe_dump(inv))
    return path


def bench(inv: Path, *args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, ["bench", "-i", str(inv), *args], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def reference_set(points: list[dict]) -> str:
    return "bench.reference=" + json.dumps(points)


# ------------------------------------------------------------------------- measured against the truth

def measure(url: str, concurrency: int, rounds: int, n: int, input_tokens: int = 16):
    spec = LoadSpec(url=url, model=MODEL, input_tokens=input_tokens, max_tokens=n, timeout_s=20)
    run = asyncio.run(run_level(spec, concurrency, rounds))
    return run, level_stats(run)


def test_measured_figures_match_the_configured_truth(double):
    _, url = double
    n = 32
    _, lv = measure(url, 1, 3, n, input_tokens=64)
    print(f"\ntruth: TTFT {TTFT_MS} ms, ITL {1000 / RATE} ms, TPS {expected_tps(n):.2f}, "
          f"latency {expected_latency(n):.3f} s; measured: TTFT {lv.ttft_ms:.1f} ms, ITL {lv.itl_ms:.2f} ms, "
          f"TPS {lv.tps:.2f}, latency {lv.latency_s:.3f} s, RPS {lv.rps:.3f}")
    assert (lv.requests, lv.completed, lv.errors) == (3, 3, 0)
    assert lv.output_tokens == n                       # from the usage chunk (= the double's word count)
    assert lv.prompt_tokens == 64                      # ~input_tokens words, one token each in the double
    assert TTFT_MS <= lv.ttft_ms <= TTFT_MS + TTFT_SLACK_MS
    assert lv.itl_ms == pytest.approx(1000 / RATE, rel=ITL_TOL)
    assert expected_tps(n) * (1 - TPS_TOL) <= lv.tps <= expected_tps(n) * 1.02
    assert lv.latency_s == pytest.approx(expected_latency(n), rel=TPS_TOL)
    # C=1, back to back: RPS = completed / wall ~ 1 / latency, and the per-stream figure is the same
    assert lv.rps == pytest.approx(1 / lv.latency_s, rel=0.1)
    assert lv.rps_per_stream == lv.rps


def test_concurrency_is_real(double):
    _, url = double
    n = 24
    run, lv = measure(url, 4, 1, n)
    one = expected_latency(n)
    print(f"\nC=4, one round: wall {run.wall_s:.3f} s vs one request {one:.3f} s (sequential would be {4 * one:.2f})")
    assert lv.completed == 4
    assert one <= run.wall_s < 1.5 * one               # 4 in flight at once, not one after another
    starts = sorted(r.start for r in run.results)
    assert starts[-1] - starts[0] < 0.1 * one          # all four sent together
    assert TTFT_MS <= lv.ttft_ms <= TTFT_MS + TTFT_SLACK_MS   # no queueing in the double
    assert lv.rps == pytest.approx(4 / run.wall_s)
    assert lv.rps_per_stream == pytest.approx(lv.rps / 4)


def test_ttft_includes_queueing(tmp_path):
    # the double generates for 2 requests at once and queues the rest: at C=4 two requests wait one
    # whole request time, so the mean TTFT is ttft + latency / 2 and the level takes two request times
    proc, _, url, log = start_double(tmp_path, DOUBLE_MAX_CONCURRENCY="2")
    try:
        n = 12
        run, lv = measure(url, 4, 1, n)
    finally:
        stop_double(proc, log)
    one = expected_latency(n)
    print(f"\nqueue of 2, C=4: mean TTFT {lv.ttft_ms:.1f} ms (truth {1000 * (TTFT_MS / 1000 + one / 2):.1f}), "
          f"wall {run.wall_s:.3f} s (truth {2 * one:.3f})")
    assert lv.ttft_ms == pytest.approx(TTFT_MS + 1000 * one / 2, abs=TTFT_SLACK_MS)
    assert run.wall_s == pytest.approx(2 * one, rel=0.15)


def test_each_worker_keeps_its_connection(tmp_path):
    # vLLM's own client (aiohttp, one session) reuses its connections; a stream left unread after
    # [DONE] would close its connection and every request would open a new one (found against the
    # real vLLM: at C=4 the requests then reached the engine spread out, TTFT 15-30 ms longer)
    proc, _, url, log = start_double(tmp_path)
    try:
        run, lv = measure(url, 2, 3, 4)
    finally:
        stop_double(proc, log)
    assert lv.completed == 6
    peers = re.findall(r'(\S+:\d+) - "POST /v1/chat/completions', next(tmp_path.glob("double-*.log")).read_text())
    assert len(peers) == 6 and len(set(peers)) == 2, peers


def test_requests_have_deadlines_when_the_server_never_answers():
    with socket.socket() as s:                         # listens (connect succeeds) but never answers
        s.bind((LOOP, 0))
        s.listen(8)
        spec = LoadSpec(url=f"http://{LOOP}:{s.getsockname()[1]}", model=MODEL, max_tokens=4, timeout_s=0.5)
        t0 = time.monotonic()
        res = asyncio.run(one_request_client(spec))
        assert time.monotonic() - t0 < 3
    assert not res.ok and "timed out" in res.error


async def one_request_client(spec: LoadSpec) -> RequestResult:
    async with httpx.AsyncClient(timeout=spec.timeout_s) as client:
        return await one_request(client, spec, 0)


# ------------------------------------------------------------------------------- pure: verdicts, Max C

def lvl(c: int, ttft: float | None, tps: float | None, errors: int = 0, requests: int = 10):
    from orchestrator.benchmark.report import LevelStats
    done = requests - errors
    return LevelStats(concurrency=c, requests=requests, completed=done, errors=errors, wall_s=10.0,
                      ttft_ms=ttft if done else None, tps=tps if done else None)


def test_max_c_is_the_highest_level_meeting_both_targets():
    # the DeepSeek 4x Spark sweep of the reports: Max C = 2
    sweep = [lvl(1, 271.6, 29.5), lvl(2, 395.8, 21.3), lvl(4, 577.4, 13.1), lvl(8, 805.9, 8.8)]
    vs = [verdict(x, 1000, 20) for x in sweep]
    assert [v.meets_slo for v in vs] == [True, True, False, False]
    assert max_concurrency(vs) == 2
    # the RTX sweep: TTFT fails first at 32 (3222.7 ms), TPS at 16 (43.2 >= 40 passes, 22.2 < 40 fails)
    rtx = [lvl(c, t, p) for c, t, p in [(1, 139.2, 155.8), (2, 195.8, 120.0), (4, 220.6, 90.8), (8, 252.3, 63.7),
                                        (16, 257.2, 43.2), (32, 3222.7, 22.2)]]
    assert max_concurrency([verdict(x, 1000, 40) for x in rtx]) == 16
    assert max_concurrency([verdict(x, 1000, 20) for x in rtx]) == 16      # 32 fails on TTFT only
    v32 = verdict(rtx[-1], 1000, 20)
    assert (v32.ttft_ok, v32.tps_ok) == (False, True) and "TTFT 3222.7 ms > 1000 ms" in v32.why
    # the boundaries are inclusive
    assert verdict(lvl(1, 1000.0, 20.0), 1000, 20).meets_slo
    # none -> None
    assert max_concurrency([verdict(x, 100, 20) for x in sweep]) is None
    # a level with errors cannot meet the SLO even with good means; one with no figures neither
    assert not verdict(lvl(1, 100, 50, errors=1), 1000, 20).meets_slo
    dead = verdict(lvl(2, None, None, errors=10), 1000, 20)
    assert not dead.meets_slo and dead.why == "10/10 request(s) failed"
    assert max_concurrency([verdict(lvl(1, 100, 50), 1000, 20), verdict(lvl(2, 100, 50, errors=2), 1000, 20)]) == 1


def test_failed_requests_are_counted_not_averaged():
    ok = [RequestResult(ok=True, start=0.0, end=1.0, ttft_s=0.2, last_token_s=0.9, output_tokens=8)] * 2
    bad = [RequestResult(ok=False, start=0.0, end=0.01, error="HTTP 500: boom")] * 3
    lv = level_stats(LevelRun(2, 2.0, ok + bad))
    assert (lv.requests, lv.completed, lv.errors) == (5, 2, 3)
    assert lv.ttft_ms == pytest.approx(200) and lv.tps == pytest.approx(8.0) and lv.latency_s == 1.0
    assert lv.itl_ms == pytest.approx(100)            # (0.9 - 0.2) / 7
    assert lv.rps == pytest.approx(1.0)               # completed / wall
    assert lv.error_samples == (("HTTP 500: boom", 3),)
    none = level_stats(LevelRun(4, 0.1, bad))
    assert none.completed == 0 and none.ttft_ms is none.tps is none.itl_ms is none.rps is None


def test_regressions_beyond_tolerance_are_flagged():
    ref = (BenchPoint(1, ttft_ms=200, tps=30, rps=0.2), BenchPoint(2, ttft_ms=300, tps=20), BenchPoint(8, tps=9))
    levels = [lvl(1, 229.0, 25.6), lvl(2, 346.0, 16.9), lvl(4, 500, 10)]
    rows, regs = compare(levels, ref, 0.15)
    assert [r["concurrency"] for r in rows] == [1, 2]             # only levels with a reference point
    m1 = rows[0]["metrics"]
    assert m1["ttft_ms"]["ratio"] == pytest.approx(1.145) and not m1["ttft_ms"]["regression"]
    assert m1["tps"]["ratio"] == pytest.approx(25.6 / 30) and not m1["tps"]["regression"]
    assert m1["rps_per_stream"]["measured"] is None and m1["rps_per_stream"]["ratio"] is None
    assert [(g.concurrency, g.metric) for g in regs] == [(2, "ttft_ms"), (2, "tps")]
    # better than the reference is never a regression
    assert compare([lvl(1, 50, 300)], ref, 0.15)[1] == []


# --------------------------------------------------------------------------------------- the command

def test_bench_command_json_reference_and_fail_on_regression(double, tmp_path):
    port, url = double
    inv = write_inventory(tmp_path, port)                 # default URL: http://<head>:<api_port>
    n = 8
    truth = [{"concurrency": 1, "ttft_ms": TTFT_MS, "tps": round(expected_tps(n), 2)},
             {"concurrency": 2, "ttft_ms": TTFT_MS, "tps": round(expected_tps(n), 2),
              "latency_s": expected_latency(n), "rps": 1 / expected_latency(n)}]
    common = ["--concurrency", "1,2", "--rounds", "2", "--input-tokens", "32", "--max-tokens", str(n),
              "--set", "bench.tolerance=0.25"]
    rc, out, err = bench(inv, *common, "--set", reference_set(truth), "--json", "--fail-on-regression")
    assert rc == 0, err
    doc = json.loads(out)
    assert set(doc) == {"schema", "config", "warmup", "levels", "verdicts", "max_c", "reference", "comparison",
                        "regressions", "failed_levels", "ok"}
    assert doc["schema"] == "deployctl.bench/1"
    assert doc["config"]["url"] == url and doc["config"]["model"] == MODEL
    assert doc["config"]["concurrency"] == [1, 2] and doc["config"]["rounds"] == 2
    # the prompt sized by two probes on the served tokenizer: the double counts one token per word
    assert doc["config"]["prompt"] == {"words": 32, "tokens_per_word": 1.0, "probe_prompt_tokens": [4, 36],
                                       "note": ""}
    assert [x["prompt_tokens"] for x in doc["levels"]] == [32, 32]
    assert doc["warmup"] == {"requests": 1, "errors": 0}
    assert [(x["concurrency"], x["requests"], x["completed"], x["errors"]) for x in doc["levels"]] == \
        [(1, 2, 2, 0), (2, 4, 4, 0)]
    assert set(doc["levels"][0]) >= {"ttft_ms", "itl_ms", "tps", "latency_s", "rps", "rps_per_stream", "wall_s"}
    assert [v["meets_slo"] for v in doc["verdicts"]] == [True, True] and doc["max_c"] == 2
    cmp2 = doc["comparison"][1]["metrics"]
    assert set(cmp2) == {"ttft_ms", "tps", "latency_s", "rps_per_stream"}
    assert cmp2["tps"]["ratio"] == pytest.approx(1.0, abs=TPS_TOL)
    assert cmp2["rps_per_stream"]["ratio"] == pytest.approx(1.0, abs=0.15)   # per stream vs the reports' RPS
    assert doc["regressions"] == [] and doc["ok"] is True

    # a reference the double cannot reach: TTFT 100 ms (x1.5+) and TPS 60 (x0.5) at C=2 -> flagged
    fast = [{"concurrency": 2, "ttft_ms": 100, "tps": 60}]
    rc, out, err = bench(inv, *common, "--set", reference_set(fast), "--json")
    assert rc == 0                                        # flagged but not asked to fail
    doc = json.loads(out)
    assert [(g["concurrency"], g["metric"]) for g in doc["regressions"]] == [(2, "ttft_ms"), (2, "tps")]
    assert doc["ok"] is False and doc["comparison"][0]["metrics"]["tps"]["regression"] is True
    rc, out, err = bench(inv, *common, "--set", reference_set(fast), "--fail-on-regression")
    assert rc == 1
    assert "regression at C=2: TTFT ms" in out and "regression at C=2: TPS" in out
    assert "C=2 ttft_ms" in err and "Max C = 2" in out


def test_plot_draws_both_series_and_the_slo_lines(double, tmp_path):
    _, url = double
    runs = [measure(url, c, 1, 6)[0] for c in (1, 2)]
    bench_spec = BenchSpec(concurrency=(1, 2), rounds=1, max_tokens=6, tps_slo=15.0,
                           reference=(BenchPoint(1, ttft_ms=140, tps=30), BenchPoint(2, ttft_ms=160, tps=25),
                                      BenchPoint(4, ttft_ms=200, tps=20)))
    rep = build_report(runs, bench_spec, {"url": url, "model": MODEL})
    fig = build_figure(rep)
    ttft_ax, tps_ax = fig.axes
    for ax, slo in ((ttft_ax, 1000.0), (tps_ax, 15.0)):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert list(lines[MEASURED].get_xdata()) == [1, 2]
        assert list(lines[REFERENCE].get_xdata()) == [1, 2, 4]
        slo_line = next(ln for label, ln in lines.items() if label.startswith("SLO"))
        assert list(slo_line.get_ydata()) == [slo, slo]
        assert {t.get_text() for t in ax.get_legend().get_texts()} >= {MEASURED, REFERENCE}
    assert list(tps_ax.get_lines()[1].get_ydata()) == [30, 25, 20]
    out = save_png(fig, tmp_path / "bench.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_plot_and_url_override(double, tmp_path):
    port, url = double
    inv = write_inventory(tmp_path, free_port())          # the inventory's port is wrong; --url wins
    png = tmp_path / "sweep.png"
    rc, out, err = bench(inv, "--url", url, "--concurrency", "1", "--rounds", "1", "--max-tokens", "4",
                         "--no-warmup", "--plot", str(png), "--json")
    assert rc == 0, err
    assert json.loads(out)["warmup"] == {}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_api_that_does_not_answer_or_serves_another_model(tmp_path, double):
    _, url = double
    inv = write_inventory(tmp_path, free_port())          # nothing listens there
    t0 = time.monotonic()
    rc, out, err = bench(inv, "--concurrency", "1", "--rounds", "1")
    assert rc == 1 and "does not answer GET /v1/models" in err and time.monotonic() - t0 < 15
    rc, out, err = bench(inv, "--url", url, "--set", "engine.served_name=other", "--concurrency", "1")
    assert rc == 1 and "does not serve 'other'" in err and f"served: {MODEL}" in err
    rc, out, err = bench(inv, "--url", url, "--concurrency", "1,x")
    assert rc == 2 and "--concurrency" in err


def test_server_erroring_mid_sweep_is_reported_not_averaged(tmp_path):
    # 2 prompt-sizing probes + warm-up 1 + C=1: 3 successes = 6; C=2: both first requests arrive at
    # 6 < 7 and succeed, the other 4 get HTTP 500; C=4: every request fails.
    proc, port, url, log = start_double(tmp_path, DOUBLE_FAIL="error-mid", DOUBLE_ERROR_AFTER="7")
    try:
        inv = write_inventory(tmp_path, port)
        n = 8
        rc, out, err = bench(inv, "--concurrency", "1,2,4", "--rounds", "3", "--max-tokens", str(n),
                             "--json", "--fail-on-regression")
    finally:
        stop_double(proc, log)
    assert rc == 1 and "C=2 had failed requests" in err and "C=4 had failed requests" in err
    doc = json.loads(out)
    lv = {x["concurrency"]: x for x in doc["levels"]}
    assert (lv[1]["completed"], lv[1]["errors"]) == (3, 0)
    assert (lv[2]["requests"], lv[2]["completed"], lv[2]["errors"]) == (6, 2, 4)
    assert (lv[4]["requests"], lv[4]["completed"], lv[4]["errors"]) == (12, 0, 12)
    # the two good requests at C=2 keep the true figures: the instant 500s are not averaged in
    assert TTFT_MS <= lv[2]["ttft_ms"] <= TTFT_MS + TTFT_SLACK_MS
    assert lv[2]["tps"] == pytest.approx(expected_tps(n), rel=TPS_TOL)
    assert lv[2]["error_samples"] == [{"message": "HTTP 500: simulated engine error (DOUBLE_FAIL=error-mid)",
                                      "count": 4}]
    assert all(lv[4][k] is None for k in ("ttft_ms", "itl_ms", "tps", "latency_s", "rps"))
    verdicts = {v["concurrency"]: v for v in doc["verdicts"]}
    assert verdicts[1]["meets_slo"] and not verdicts[2]["meets_slo"] and not verdicts[4]["meets_slo"]
    assert "4/6 request(s) failed" in verdicts[2]["why"]
    assert doc["max_c"] == 1 and doc["failed_levels"] == [2, 4] and doc["ok"] is False
