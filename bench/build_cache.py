"""Benchmark of the image chain's per-step cache, with the miniature chain (dockerfiles/chains/test-double.yml).

    python3 bench/build_cache.py [--engine local|INVENTORY] [--json]

Three builds of the same chain on one engine:
  full       every step built, no cache at all (deployctl's nor the engine's)
  no-op      nothing changed: every step reused
  patch-only one patch file changed: the patch layer (and the step stacked on it) rebuilt
printed with their ratios to the full build. Needs dctl-debian:bookworm in the engine
(`python3 -m tests.cluster images` makes it locally). Stale images are pruned at the end.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.executors import docker_engine as de  # noqa: E402
from orchestrator.imagechain.builder import BuildReport, ChainBuilder  # noqa: E402
from orchestrator.imagechain.spec import check_inputs, load_chain  # noqa: E402
from orchestrator.paths import ROOT  # noqa: E402
from orchestrator.runrecord import HostLog  # noqa: E402

MINI = ROOT / "tests" / "fixtures" / "mini-vllm"
TAG = "dctl-engine:bench"


def client_for(engine: str):
    if engine == "local":
        return de.local_client(), "local engine"
    from orchestrator.inventory import load_inventory
    cluster = load_inventory(engine)
    head = cluster.head_host
    return de.engine_client(cluster, head), f"{head.name} ({head.ssh_url})"


def one(client, where: str, logs: Path, inputs: Path, *, no_cache: bool = False,
        prune: bool = False) -> tuple[BuildReport, float]:
    chain = load_chain("test-double", inputs_dir=str(inputs))
    check_inputs(chain)
    logs.mkdir(parents=True, exist_ok=True)
    b = ChainBuilder(client, chain, final_tag=TAG, where=where, no_cache=no_cache,
                     log_for=lambda s: HostLog(logs / f"{s}.log", []))
    t0 = time.monotonic()
    report = b.build()
    took = time.monotonic() - t0
    if prune:
        report.pruned = b.prune()
    return report, took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="local", help="'local' or an inventory (build on its head over SSH)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    client, where = client_for(a.engine)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dctl-bench-build-") as tmp:
        t = Path(tmp)
        inputs = t / "inputs"
        shutil.copytree(MINI, inputs)
        for name, prep, kw in (("full", None, {"no_cache": True}), ("no-op", None, {}),
                               ("patch-only", "patch", {}), ("restore", "restore", {"prune": True})):
            patch = inputs / "patch" / "attention.py"
            if prep == "patch":
                patch.write_text(patch.read_text() + f"BENCH = {time.time()!r}\n")
            elif prep == "restore":
                shutil.copy(MINI / "patch" / "attention.py", patch)
            report, took = one(client, where, t / name, inputs, **kw)
            if name != "restore":
                rows.append({"build": name, "seconds": round(took, 3), "built": report.built,
                             "reused": report.reused})
    de.remove_image(client, TAG)
    client.close()
    full = rows[0]["seconds"]
    for r in rows:
        r["ratio_to_full"] = round(r["seconds"] / full, 4)
    if a.json:
        print(json.dumps({"engine": where, "chain": "test-double", "builds": rows}, indent=2))
    else:
        print(f"image chain cache, test-double chain on {where}")
        print(f"{'build':<11} {'seconds':>8} {'x full':>8}  built steps")
        for r in rows:
            print(f"{r['build']:<11} {r['seconds']:>8.2f} {r['ratio_to_full']:>8.3f}  {', '.join(r['built']) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
