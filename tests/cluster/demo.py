"""`python -m tests.cluster demo`: the local test cluster ready for `deployctl up`.

Brings the 4-host cluster `local` up (or keeps it when every host already answers), puts the base
image the build stage starts from into the head's engine, and writes a synthetic checkpoint shaped
like the inventory's (scaled) recipe into the head's model cache; the pipeline does the rest
(build, ship, sync-model to the workers, staging, launch of the engine double, health).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .cluster import TestCluster, cluster_lock
from .images import DEBIAN_IMAGE, ensure_base_images


def _healthy(name: str, n: int) -> TestCluster | None:
    try:
        c = TestCluster.attach(name)
    except Exception:  # noqa: BLE001 - no state, or a broken one: make it anew
        return None
    st = c.status()
    if len(st) == n and all(s["link"] == "up" and s["sshd"] and s["dockerd"] and s["docker"] for s in st):
        return c
    return None


def prepare(name: str = "local", n_hosts: int = 4, log: Callable[[str], None] = print) -> TestCluster:
    from orchestrator.deployment import load_deployment
    from tests import synth

    with cluster_lock(name, timeout=60, log=log):
        c = _healthy(name, n_hosts)
        if c is None:
            c = TestCluster.up(name, n_hosts, log=log)
        else:
            log(f"cluster {name}: all {n_hosts} hosts answer, kept as it is")
    ensure_base_images()
    head = c.hosts[0]
    c.load_image(head, DEBIAN_IMAGE)          # what the build stage's chain starts from
    dep = load_deployment(c.inventory_path)
    folder = Path(dep.checkpoint_dir(dep.cluster.head_host))
    tensors = synth.recipe_tensors(dep.recipe)
    marker = folder / ".synthetic.json"
    config = synth.recipe_config(dep.recipe)
    want = json.dumps([[t.__dict__ for t in tensors], config], sort_keys=True)
    if not (marker.exists() and marker.read_text() == want):
        synth.write_checkpoint(folder, tensors, config=config)
        marker.write_text(want)
        log(f"wrote a synthetic checkpoint for {dep.recipe.name} to {folder} on {head.name}")
    else:
        log(f"synthetic checkpoint already in {folder}")
    log(f"ready: deployctl up -i {c.inventory_path}")
    return c
