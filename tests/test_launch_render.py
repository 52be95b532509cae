"""Engine command lines and environments rendered from recipes, checked flag by flag."""
from __future__ import annotations

import json

import pytest

from orchestrator.deployment import load_deployment
from orchestrator.errors import InputError
from orchestrator.fabric.detect import Fabric, choose_fabric, fabric_env
from orchestrator.launch.containerspec import container_spec, expand_env
from orchestrator.paths import INVENTORIES_DIR


def flags(argv) -> dict[str, object]:
    """--flag value / --flag (bare -> True) pairs of an argv."""
    out, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a[2:]] = argv[i + 1]
                i += 2
                continue
            out[a[2:]] = True
        i += 1
    return out


def test_vllm_tp4_every_recipe_argument_on_every_rank():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    e = dep.recipe.engine
    fab = {h.name: Fabric(f"enp1s0f{h.rank % 2}np{h.rank % 2}", f"10.10.0.{h.rank + 1}", ("mlx5_0",), "t")
           for h in dep.cluster.hosts}
    head = fab["spark1"]
    for h in dep.cluster.hosts:
        spec = container_spec(dep, h, fab[h.name], head)
        # HF cache layout: the repo folder is mounted so snapshot links into ../../blobs resolve.
        assert spec.argv[:3] == ("vllm", "serve", "/model/snapshots/main")
        assert (f"{h.model_cache}/models--deepseek-ai--DeepSeek-V4.1-Flash", "/model", "ro") in spec.mounts
        f = flags(spec.argv)
        for k, v in e.args.items():
            if v is True:
                assert f[k] is True, k
            elif isinstance(v, dict):
                assert json.loads(f[k]) == v, k
            else:
                assert str(f[k]) == str(v) or float(f[k]) == float(v), k
        assert f["tensor-parallel-size"] == "4" and f["nnodes"] == "4"
        assert f["node-rank"] == str(h.rank)
        assert f["master-addr"] == "10.10.0.1", "workers join the head's FABRIC address"
        assert f["master-port"] == str(e.master_port)
        assert f["served-model-name"] == "deepseek-v4.1-flash" and f["port"] == "8000"
        assert ("headless" in f) == (h.rank > 0)
        # Environment: recipe env, Engram-on-disk env (placement nvme), this host's own fabric.
        assert spec.env["OMP_NUM_THREADS"] == "1"
        assert spec.env["DSV41_ENGRAM_DISK"] == "1" and spec.env["DSV41_ENGRAM_DISK_THREADS"] == "32"
        assert spec.env["DSV41_ENGRAM_DISK_CHUNK"] == "16"
        assert spec.env["NCCL_SOCKET_IFNAME"] == fab[h.name].iface, "never the head's iface name"
        assert spec.env["VLLM_HOST_IP"] == fab[h.name].address
        assert spec.env["NCCL_IB_HCA"] == "mlx5_0" and spec.env["NCCL_IB_DISABLE"] == "0"
        assert ("/mnt/nvme/deployctl/engram", "/engram", "ro") in spec.mounts
        assert spec.gpus and spec.rdma_devices
        run = spec.docker_run_argv()
        for opt in ("--network", "--ipc", "--shm-size", "--gpus"):
            assert opt in run
        assert "memlock=-1:-1" in run and "--device" in run


def test_plain_checkpoint_folder_is_mounted_as_is():
    dep = load_deployment(INVENTORIES_DIR / "spark1.yml", sets=("model.checkpoint_dir=qwen-plain",))
    spec = container_spec(dep, dep.cluster.hosts[0], None, None)
    assert ("/mnt/nvme/huggingface/qwen-plain", "/model", "ro") in spec.mounts
    assert flags(spec.argv)["model-path"] == "/model"


def test_engram_in_memory_drops_disk_env_and_mount():
    dep = load_deployment(INVENTORIES_DIR / "spark8.yml", "deepseek-v41-flash-tp8-mem")
    spec = container_spec(dep, dep.cluster.hosts[0], None, None)
    assert not any(k.startswith("DSV41_ENGRAM") for k in spec.env)
    assert not any(m[1] == "/engram" for m in spec.mounts)
    assert flags(spec.argv)["max-model-len"] == "300000"
    nvme = load_deployment(INVENTORIES_DIR / "spark8.yml", "deepseek-v41-flash-tp8-nvme")
    assert flags(container_spec(nvme, nvme.cluster.hosts[0], None, None).argv)["max-model-len"] == "1048576"


def test_sglang_spark_file_backend():
    dep = load_deployment(INVENTORIES_DIR / "spark1.yml")
    spec = container_spec(dep, dep.cluster.hosts[0], None, None)
    assert spec.argv[:3] == ("python3", "-m", "sglang.launch_server")
    f = flags(spec.argv)
    assert f["model-path"] == "/model/snapshots/main" and f["tp-size"] == "1"
    assert f["ple-offload-backend"] == "file" and f["ple-offload-dir"] == "/ple"
    assert f["speculative-algorithm"] == "NEXTN" and f["speculative-num-steps"] == "3"
    assert f["speculative-eagle-topk"] == "1" and f["speculative-num-draft-tokens"] == "4"
    assert f["max-running-requests"] == "8" and f["mem-fraction-static"] == "0.8"
    # released SGLang's contract: the offload asked for, the folder mapped read-write (from_file shared)
    assert "--ple-offload-embedding" in spec.argv
    assert ("/mnt/nvme/deployctl/ple", "/ple", "rw") in spec.mounts
    assert spec.env["SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB"] == "8"          # ple.page_cache_budget_gib
    assert spec.env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "deployctl_sglang_ple"
    assert "NCCL_SOCKET_IFNAME" not in spec.env, "single node: no fabric variables"


def test_sglang_rtx_pinned_backend():
    dep = load_deployment(INVENTORIES_DIR / "rtx1.yml")
    spec = container_spec(dep, dep.cluster.hosts[0], None, None)
    f = flags(spec.argv)
    assert f["ple-offload-backend"] == "pinned" and "ple-offload-dir" not in f
    assert "--ple-offload-embedding" in spec.argv
    assert [m for m in spec.mounts if m[1] == "/ple"] == [] and "SGLANG_EXTERNAL_MODEL_PACKAGE" not in spec.env
    assert f["max-running-requests"] == "16"


def test_reserved_flag_in_args_is_refused():
    with pytest.raises(InputError) as e:
        dep = load_deployment(INVENTORIES_DIR / "spark4.yml", sets=("engine.args.tensor-parallel-size=8",))
        container_spec(dep, dep.cluster.hosts[0], None, None)
    assert "engine.args.tensor-parallel-size" in str(e.value)
    assert "parallelism.tensor_parallel" in str(e.value)


def test_false_leaves_a_flag_out():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", sets=("engine.args.enable-auto-tool-choice=false",))
    assert "--enable-auto-tool-choice" not in container_spec(dep, dep.cluster.hosts[0], None, None).argv


def test_env_references_expand_at_launch_only():
    env = {"HF_TOKEN": "${HF_TOKEN}", "A": "x"}
    assert expand_env(env, {"HF_TOKEN": "secret"}, "r.yml")["HF_TOKEN"] == "secret"
    with pytest.raises(InputError, match=r"\$\{HF_TOKEN\}, which is not set"):
        expand_env(env, {}, "r.yml")


FACTS = {
    "net": {"lo": {"operstate": "unknown", "addrs": ["127.0.0.1"]},
            "enP7s7": {"operstate": "up", "addrs": ["192.168.1.20"]},
            "wlP9s9": {"operstate": "up", "wireless": True, "addrs": ["192.168.2.20"]},
            "enp1s0f0np0": {"operstate": "down", "addrs": []},
            "enp1s0f1np1": {"operstate": "up", "addrs": ["10.10.0.2"]}},
    "rdma": [{"dev": "rocep1s0f0", "port": "1", "state": "1: DOWN", "link_layer": "Ethernet",
              "netdevs": ["enp1s0f0np0"]},
             {"dev": "rocep1s0f1", "port": "1", "state": "4: ACTIVE", "link_layer": "Ethernet",
              "netdevs": ["enp1s0f1np1"]}],
    "route_to_head": "enP7s7",
}


def test_fabric_picks_the_active_roce_netdev_not_management_or_wifi():
    f = choose_fabric("spark2", FACTS)
    assert f.iface == "enp1s0f1np1" and f.address == "10.10.0.2" and f.hcas == ("rocep1s0f1",)
    env = fabric_env(f)
    assert env["NCCL_IB_HCA"] == "rocep1s0f1" and env["UCX_NET_DEVICES"] == "enp1s0f1np1"
    assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == "enp1s0f1np1"


def test_fabric_without_rdma_uses_route_to_head_never_wifi():
    facts = {**FACTS, "rdma": [], "route_to_head": "wlP9s9"}
    with pytest.raises(InputError, match="no usable fabric interface"):
        choose_fabric("spark2", facts, mgmt_address="192.168.2.20")
    facts = {**FACTS, "rdma": [], "route_to_head": "enP7s7"}
    f = choose_fabric("spark2", facts)
    assert f.iface == "enP7s7" and f.hcas == () and fabric_env(f)["NCCL_IB_DISABLE"] == "1"


def test_fabric_override_is_checked():
    assert choose_fabric("s", FACTS, override_iface="enP7s7").iface == "enP7s7"
    with pytest.raises(InputError, match="does not exist"):
        choose_fabric("s", FACTS, override_iface="eth9")
    with pytest.raises(InputError, match="wireless"):
        choose_fabric("s", FACTS, override_iface="wlP9s9")
    with pytest.raises(InputError, match="not up"):
        choose_fabric("s", FACTS, override_iface="enp1s0f0np0")


# -- boot 10's runtime (docs/deepseek-runtime-contract.md) -----------------------------------------

def test_dsv41_tp4_dry_run_carries_boot10_runtime():
    from orchestrator.stages import build_plan
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml")
    fab = {h.name: Fabric("enp1s0f0np0", f"192.168.192.{h.rank + 1}", ("rocep1s0f0", "rocep1s0f1"), "t",
                          hca="rocep1s0f0", network="192.168.192.0/24") for h in dep.cluster.hosts}
    for h in dep.cluster.hosts:
        spec = container_spec(dep, h, fab[h.name], fab["spark1"])
        env, f = spec.env, flags(spec.argv)
        # the boot-3 wedge: nothing compiles with many jobs at run time, prebuilt SM 12.1a kernels
        for k, v in {"MAX_JOBS": "2", "FLASHINFER_NVCC_THREADS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0",
                     "TORCH_CUDA_ARCH_LIST": "12.1a", "FLASHINFER_CUDA_ARCH_LIST": "12.1a",
                     "FLASHINFER_DISABLE_VERSION_CHECK": "1", "VLLM_HAS_FLASHINFER_CUBIN": "1",
                     "VLLM_USE_BREAKABLE_CUDAGRAPH": "1", "VLLM_ENGINE_READY_TIMEOUT_S": "3600",
                     "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/cache/huggingface",
                     "TRITON_CACHE_DIR": "/cache/triton", "TILELANG_CACHE_DIR": "/cache/tilelang",
                     "VLLM_CACHE_ROOT": "/cache/vllm", "VLLM_USE_RUST_FRONTEND": "0",
                     # NCCL over RoCE v2: one pinned HCA, the repo's GID index / version / family
                     "NCCL_NET": "IB", "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "rocep1s0f0",
                     "NCCL_IB_GID_INDEX": "3", "NCCL_IB_ROCE_VERSION_NUM": "2", "NCCL_IB_ADDR_FAMILY": "AF_INET",
                     "NCCL_IB_ADDR_RANGE": "192.168.192.0/24", "NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0",
                     "NCCL_CROSS_NIC": "0", "NCCL_IB_MERGE_NICS": "0", "MN_IF_NAME": "enp1s0f0np0",
                     "DSV41_ENGRAM_DISK": "1"}.items():
            assert env[k] == v, k
        assert ("/var/tmp/dsv41-vllm-cache", "/cache", "rw") in spec.mounts
        # launch/dsv41-tp4.sh's capture sizes: multiples of k and k+1 up to SEQS*(k+1), k=5, SEQS=8
        k, seqs = 5, 8
        sizes = sorted(set(range(k, k * seqs + 1, k)) | set(range(k + 1, (k + 1) * seqs + 1, k + 1)))
        assert json.loads(f["compilation-config"]) == {"cudagraph_mode": "FULL_AND_PIECEWISE",
                                                       "cudagraph_capture_sizes": sizes}
        assert sizes == [5, 6, 10, 12, 15, 18, 20, 24, 25, 30, 35, 36, 40, 42, 48]
        assert json.loads(f["engram-config"]) == {"cpu_offload": False}
        assert f["mm-processor-cache-gb"] == "1" and f["block-size"] == "128"
        assert json.loads(f["speculative-config"])["enable_adaptive_verification"] is False
        run = spec.docker_run_argv()
        assert run[run.index("--memory") + 1] == "112g" and run[run.index("--memory-swap") + 1] == "112g"
        assert run[run.index("--shm-size") + 1] == "32g"
    # the dry run (plan) shows the same command, the memory limits and the start order
    acts = {a.host: a for a in build_plan(dep, ("launch",)).stage("launch").actions}
    for a in acts.values():
        assert "--memory" in a.command and "MAX_JOBS=2" in a.command
        assert a.details["container"]["options"] == {"memory": "112g", "memory-swap": "112g"}
    assert {n: a.details["container"]["start"]["step"] for n, a in acts.items()} == \
        {"spark4": 1, "spark3": 1, "spark2": 1, "spark1": 2}
    assert acts["spark1"].details["container"]["start"] == {
        "order": "workers-first", "step": 2, "of": 2, "after": ["spark4", "spark3", "spark2"], "wait_before_s": 5.0}


def test_tp8_recipes_share_the_runtime_block():
    for inv in ("spark8.yml",):
        for recipe in ("deepseek-v41-flash-tp8-mem", "deepseek-v41-flash-tp8-nvme"):
            dep = load_deployment(INVENTORIES_DIR / inv, recipe)
            e = dep.recipe.engine
            assert e.env["MAX_JOBS"] == "2" and e.env["VLLM_USE_BREAKABLE_CUDAGRAPH"] == "1"
            assert e.memory_limit == "112g" and e.min_mem_available_gib == 100 and e.drop_caches
            assert e.start_order == "workers-first"
            assert e.args["engram-config"] == {"cpu_offload": False}


ROCE4 = {
    "net": {"enP7s7": {"operstate": "up", "addrs": ["192.168.2.20"], "cidrs": ["192.168.2.20/24"]},
            "wlP9s9": {"operstate": "up", "wireless": True, "addrs": ["192.168.3.20"]},
            "enp1s0f0np0": {"operstate": "up", "addrs": ["192.168.192.2"], "cidrs": ["192.168.192.2/24"]},
            "enp1s0f1np1": {"operstate": "up", "addrs": ["192.168.193.2"], "cidrs": ["192.168.193.2/24"]},
            "enP2p1s0f0np0": {"operstate": "up", "addrs": []},
            "enP2p1s0f1np1": {"operstate": "up", "addrs": []}},
    "rdma": [{"dev": d, "port": "1", "state": "4: ACTIVE", "link_layer": "Ethernet", "netdevs": [n]}
             for d, n in (("roceP2p1s0f1", "enP2p1s0f1np1"), ("rocep1s0f1", "enp1s0f1np1"),
                          ("rocep1s0f0", "enp1s0f0np0"), ("roceP2p1s0f0", "enP2p1s0f0np0"))],
    "route_to_head": "enp1s0f0np0",
}


def test_fabric_pins_one_hca_per_host_deterministically():
    f = choose_fabric("spark2", ROCE4)
    assert f.iface == "enp1s0f0np0" and len(f.hcas) == 4
    assert f.hca == "rocep1s0f0", "the HCA backing the chosen netdev"
    env = fabric_env(f)
    assert env["NCCL_IB_HCA"] == "rocep1s0f0", "one HCA, not a list"
    assert env["NCCL_IB_ADDR_RANGE"] == "192.168.192.0/24" and env["NCCL_NET"] == "IB"
    # the same facts in another order: the same pin
    shuffled = {**ROCE4, "rdma": list(reversed(ROCE4["rdma"]))}
    assert choose_fabric("spark2", shuffled).hca == "rocep1s0f0"
    # no route through an RDMA netdev: the first RDMA netdev by name and its HCA; never Wi-Fi/management
    g = choose_fabric("spark2", {**ROCE4, "route_to_head": "wlP9s9"})
    assert g.iface not in ("wlP9s9", "enP7s7") and g.hca in g.hcas
    assert fabric_env(g)["NCCL_IB_HCA"] == g.hca
    # override (recipe engine.ib_hca, also through the inventory's recipe_overrides): must be active
    assert choose_fabric("spark2", ROCE4, override_hca="rocep1s0f1").hca == "rocep1s0f1"
    with pytest.raises(InputError, match="not an active RoCE device"):
        choose_fabric("spark2", ROCE4, override_hca="mlx5_9")
    # recipe values override single RoCE settings; sockets without RoCE
    assert fabric_env(f, {"NCCL_IB_GID_INDEX": "1"})["NCCL_IB_GID_INDEX"] == "1"
    s = fabric_env(choose_fabric("spark2", {**ROCE4, "rdma": [], "route_to_head": "enP7s7"}))
    assert s["NCCL_NET"] == "Socket" and s["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in s


def test_ib_hca_override_from_the_recipe_or_inventory():
    dep = load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("engine.ib_hca.spark2=rocep1s0f1",))
    assert dep.recipe.engine.ib_hca == {"spark2": "rocep1s0f1"}


def test_bad_memory_limit_is_refused():
    with pytest.raises(InputError, match="docker memory size"):
        load_deployment(INVENTORIES_DIR / "spark4.yml", None, ("engine.memory_limit=lots",))
