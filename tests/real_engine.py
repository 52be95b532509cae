"""The released vLLM's serving image on a test cluster's head, shared by tests/test_real_vllm.py and
bench/real_vllm.py: the vllm-cpu chain built once on this machine by `deployctl build --local` (cached
by its step digests in the local engine: a later session finds every step built), then moved into the
head's engine with its step cache tags and its base, so the `build` stage of an `up` there finds every
step built (the real build on a head is what the demo's `up` does)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.cluster.cluster import inventory_data
from tests.cluster.images import DEBIAN_IMAGE, ensure_base_images

REPO = Path(__file__).resolve().parents[1]
RECIPE = "vllm-cpu"


def build_locally(cluster, folder: Path) -> tuple[str, list[str]]:
    """(the image tag, the step cache refs) after `deployctl build --local` of the recipe's chain."""
    ensure_base_images()
    data = inventory_data(cluster.name, cluster.hosts[:1], "rvbuild", RECIPE, None)
    data["all"]["vars"]["run_dir"] = str(folder / "runs")
    inv = folder / "build.yml"
    inv.write_text(yaml.safe_dump(data, sort_keys=False))
    p = subprocess.run([sys.executable, "-m", "orchestrator", "build", "-i", str(inv), "--local", "--json"],
                       capture_output=True, text=True, timeout=1800, cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    if p.returncode != 0:
        raise RuntimeError(f"deployctl build --local failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    doc = json.loads(p.stdout)
    rep = next(r["data"]["report"] for st in doc["stages"] for r in st["results"] if st["name"] == "build")
    refs = [f"deployctl-cache/{rep['chain']}:{s['name']}-{s['digest'].split(':', 1)[1]}" for s in rep["steps"]]
    return rep["image"], refs


def preload_head(cluster, folder: Path) -> str:
    """The serving image, its step cache tags and its base in the head's engine; its tag."""
    tag, refs = build_locally(cluster, folder)
    cluster.load_image(cluster.hosts[0], [DEBIAN_IMAGE, *refs, tag])
    return tag
