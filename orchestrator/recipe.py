"""Recipes: what to serve and how (model facts, table geometry, engine arguments).

A recipe is a YAML file in recipes/ (or any path). It is loaded into frozen
dataclasses; unknown keys are errors; `--set key.path=value` (and an inventory's
recipe_overrides) overrides any field before validation, so an override goes through
the same checks as the file, and its errors name where it came from (overrides.py).
Value rules (ports, counts, sizes, image references, paths) are in checks.py.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from . import checks, schema, yamlfile
from .errors import InputError
from .overrides import Override, apply, as_override, blame, origin_of, precedence, where
from .paths import RECIPES_DIR
from .hostside.geometry import TableGeometry

Placement = Literal["nvme", "memory", "pinned", "gpu"]


@dataclass(frozen=True)
class EngramSpec:
    """DeepSeek-V4.1-Flash Engram conditional memory."""
    placement: Placement
    geometry: TableGeometry
    weight_tensor: str = "layers.{layer}.engram.embed.weight"
    scale_tensor: str | None = "layers.{layer}.engram.embed.scale"
    scale_dtype: str = "U8"
    scale_values_per_row: int = 8        # one E8M0 scale per 32 FP8 values
    # "sparse": per rank, sparse copies of the checkpoint's own Engram shards (original header, the
    # rank's rows at their original offsets) + the index + engram-local.json: what the patched vLLM reads
    # through local_dir_env (docs/engram-contract.md). The only layout: nothing reads any other.
    layout: Literal["sparse"] = "sparse"
    # auto: on a node whose checkpoint is its own (model.source head) and on the same filesystem as the
    # staged folder, hard-link the Engram shards instead of copying the rank's rows (no bytes written:
    # reading the checkpoint costs the engine what reading a copy does; docs/engram-contract.md has the
    # figures); otherwise (source shared, another filesystem) copy. copy: always copy.
    staging: Literal["auto", "copy"] = "auto"
    # rows: with `distribution: chain` and model.source head, a worker keeps of the Engram shards only
    # its rank's rows (and every byte that is not an Engram row; modelsync/rows.py), the rest holes;
    # full: every worker keeps the whole checkpoint (to re-rank it later without a transfer).
    receive: Literal["rows", "full"] = "rows"
    subdir: str = "engram"               # below the host's nvme_dir
    free_margin_gb: float = 5.0          # NVMe free space kept beyond the staged bytes
    # Engine environment for Engram-on-disk (patched vLLM); set only when placement is nvme.
    nvme_env: dict[str, str] = field(default_factory=lambda: {
        "DSV41_ENGRAM_DISK": "1", "DSV41_ENGRAM_DISK_THREADS": "32", "DSV41_ENGRAM_DISK_CHUNK": "16"})
    # The variable naming the folder of node-local rows to the engine; launch sets it to the container
    # mount of the host's staged folder (placement nvme only). null: not set (the engine then reads
    # every row from the checkpoint folder).
    local_dir_env: str | None = "DSV41_ENGRAM_DIR"

    def validate(self, path: str, file: str) -> None:
        # a negative margin would silently turn the NVMe free-space guard off
        checks.fields(self, path, file, non_negative=("free_margin_gb",), count=("scale_values_per_row",),
                      subdir=("subdir",))


@dataclass(frozen=True)
class PleSpec:
    """Qwen3.8-Flash-Next n-gram ("PLE") table."""
    placement: Placement
    geometry: TableGeometry
    shard_tensor: str = ("model.language_model.layers.{layer}.ple.ple_embedding."
                         "ngram_embedding.shard_{shard}.weight")
    shards: int = 128
    # How SGLang lays the table out (hostside/ple_layout.py); the checkpoint's config.json
    # (text_config) has the same keys and write-ple refuses a recipe that disagrees with it.
    make_ngram_vocab_size_divisible_by: int = 128
    split_ngram_parts: int = 512          # upstream default; the 128-shard checkpoint says 128
    # The image's patch package (SGLang's SGLANG_EXTERNAL_MODEL_PACKAGE) that skips the engine's
    # boot-time rewrite of a table write-ple wrote and checked; "" runs upstream's loader.
    prewritten_package: str = "deployctl_sglang_ple"
    subdir: str = "ple"
    page_cache_budget_gib: float = 8.0
    min_host_ram_gb: float = 64.0        # pinned placement: available RAM the host needs
    free_margin_gb: float = 5.0

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file,
                      count=("shards", "make_ngram_vocab_size_divisible_by", "split_ngram_parts"),
                      non_negative=("page_cache_budget_gib", "min_host_ram_gb", "free_margin_gb"),
                      subdir=("subdir",))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    repo: str                            # e.g. deepseek-ai/DeepSeek-V4.1-Flash
    revision: str = "main"
    checkpoint_gb: float = 0.0           # whole checkpoint, decimal GB
    checkpoint_dir: str = ""             # below the host's model_cache; default HF cache layout
    # sync-model: "head" pushes the head's copy to every worker (rsync, head -> worker);
    # "shared" verifies that every node sees the same mounted copy (NFS ...) and copies nothing.
    source: Literal["head", "shared"] = "head"
    shared_path: str = ""                # source shared: the mount point of the shared filesystem,
                                         # the same on every node; the checkpoint must be on it
    # fetch-model downloads only the repo files these select (huggingface_hub's allow_patterns:
    # fnmatch, "dir/" = everything below); empty: every file of the repo
    allow_patterns: tuple[str, ...] = ()
    params_b: float = 0.0
    active_params_b: float = 0.0
    kv_bytes_per_token: int = 0
    max_context: int = 0

    def validate(self, path: str, file: str) -> None:
        checks.hf_repo(self.repo, file, f"{path}.repo")
        # revision and checkpoint_dir are folders below the host's model_cache (snapshots/REV)
        checks.fields(self, path, file, subdir=("revision", "checkpoint_dir"), path=("shared_path",),
                      non_negative=("checkpoint_gb", "params_b", "active_params_b", "kv_bytes_per_token",
                                    "max_context"))
        if self.shared_path and not self.shared_path.startswith("/"):
            raise InputError(f"must be an absolute path (the mount point on every node), got "
                             f"{self.shared_path!r}", file=file, key=f"{path}.shared_path")
        if self.shared_path and self.source != "shared":
            raise InputError("shared_path is only used with source: shared", file=file,
                             key=f"{path}.shared_path")


@dataclass(frozen=True)
class Parallelism:
    tensor_parallel: int
    nodes: int
    gpus_per_node: int = 1

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file, count=("tensor_parallel", "nodes", "gpus_per_node"))
        if self.tensor_parallel != self.nodes * self.gpus_per_node:
            raise InputError(f"tensor_parallel {self.tensor_parallel} != nodes {self.nodes} x "
                             f"gpus_per_node {self.gpus_per_node}", file=file,
                             key=f"{path}.tensor_parallel")


@dataclass(frozen=True)
class EngineSpec:
    kind: Literal["vllm", "sglang"]
    version: str
    image: str                           # the serving image tag
    served_name: str
    model: str = ""                      # model argument; default: the checkpoint path in the container
    chain: str | None = None             # image chain in dockerfiles/chains/ that builds `image`
    port: int = 8000
    master_port: int = 29501             # vLLM mp-backend rendezvous
    args: dict[str, Any] = field(default_factory=dict)   # --flag: value, in order; true = bare flag
    env: dict[str, str] = field(default_factory=dict)
    shm_size: str = "64g"
    container_name: str = ""             # default: deployctl-<deployment>-<host>
    # The released PyPI version of the engine whose own argument parsers and file rules this recipe
    # is checked against (the conformance tier, tests/conformance/versions.txt must name the same:
    # bumping it here without there fails the tier, and a new version there builds new venvs).
    release: str = ""
    # docker run --memory / --memory-swap (e.g. "112g"); "" = no limit (docs/deepseek-runtime-contract.md)
    memory_limit: str = ""
    memory_swap: str = ""
    # a host folder mounted read-write at cache_mount (kernel, compile and Hub caches that survive
    # container restarts); "" = none. The launcher creates it before the container starts.
    cache_dir: str = ""
    cache_mount: str = "/cache"
    # before the container starts on a host: drop its page cache (`sync; echo 3 > drop_caches`,
    # needs root or passwordless sudo there, else skipped with a message), then refuse to start
    # unless MemAvailable >= min_mem_available_gib (GiB; 0 = no gate). Preflight checks it too.
    drop_caches: bool = False
    min_mem_available_gib: float = 0.0
    # multi-node start order: "head-first" (the head, then the workers in parallel) or
    # "workers-first" (the workers in parallel, then start_wait_s, then the head)
    start_order: Literal["head-first", "workers-first"] = "head-first"
    start_wait_s: float = 0.0
    # RoCE HCA pinned in NCCL_IB_HCA, by host name ("*": every host); default: detected per host
    ib_hca: dict[str, str] = field(default_factory=dict)
    # NCCL RoCE settings added when a host has an active RoCE HCA (fabric.py ROCE_ENV is the default)
    nccl_roce_env: dict[str, str] = field(default_factory=dict)
    # the environment variable through which the engine binds its compute threads to the host's
    # `compute_cpus` (inventory), e.g. VLLM_CPU_OMP_THREADS_BIND for vLLM's CPU build (vllm/envs.py)
    cpu_bind_env: str = ""

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file, port=("port", "master_port"), size=("shm_size",), image=("image",),
                      path=("model", "chain", "cache_dir", "cache_mount"))
        if self.cpu_bind_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.cpu_bind_env):
            raise InputError(f"must be an environment variable name, got {self.cpu_bind_env!r}", file=file,
                             key=f"{path}.cpu_bind_env")
        if self.memory_limit:
            checks.docker_size(self.memory_limit, file, f"{path}.memory_limit")
        if self.memory_swap:
            checks.docker_size(self.memory_swap, file, f"{path}.memory_swap", swap=True)
        if self.container_name:
            checks.name(self.container_name, file, f"{path}.container_name")
        checks.engine_args(self.kind, self.args, file, f"{path}.args")
        if self.memory_swap and not self.memory_limit:
            raise InputError("memory_swap needs memory_limit (docker refuses --memory-swap alone)",
                             file=file, key=f"{path}.memory_swap")
        for name in ("cache_dir", "cache_mount"):
            v = getattr(self, name)
            if v and not v.startswith("/"):
                raise InputError(f"must be an absolute path, got {v!r}", file=file, key=f"{path}.{name}")
        if self.min_mem_available_gib < 0 or self.start_wait_s < 0:
            raise InputError("must not be negative", file=file,
                             key=f"{path}.{'start_wait_s' if self.start_wait_s < 0 else 'min_mem_available_gib'}")


@dataclass(frozen=True)
class HealthSpec:
    startup_timeout_s: float = 3600.0    # loading 510 GB and capturing CUDA graphs takes long
    poll_interval_s: float = 5.0
    request_timeout_s: float = 120.0
    prompt: str = "Count from 1 to 10."
    max_tokens: int = 50
    stay_up_s: float = 10.0              # containers must stay running this long after /health answers

    def validate(self, path: str, file: str) -> None:
        # 0 or less would never wait for the engines, or poll them in a busy loop
        checks.fields(self, path, file,
                      positive=("startup_timeout_s", "poll_interval_s", "request_timeout_s"),
                      count=("max_tokens",), non_negative=("stay_up_s",))


@dataclass(frozen=True)
class BenchPoint:
    concurrency: int
    ttft_ms: float | None = None
    tps: float | None = None
    itl_ms: float | None = None
    latency_s: float | None = None
    rps: float | None = None

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file, count=("concurrency",),
                      non_negative=("ttft_ms", "tps", "itl_ms", "latency_s", "rps"))


@dataclass(frozen=True)
class BenchSpec:
    ttft_slo_ms: float = 1000.0
    tps_slo: float = 20.0
    input_tokens: int = 128
    max_tokens: int = 128
    rounds: int = 10
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    tolerance: float = 0.15              # a regression is worse than reference by more than this
    reference: tuple[BenchPoint, ...] = ()

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file, count=("input_tokens", "max_tokens", "rounds", "concurrency"),
                      positive=("ttft_slo_ms", "tps_slo"), non_negative=("tolerance",))


@dataclass(frozen=True)
class SizingSpec:
    """Memory budget inputs (docs/deployment-facts.md, "Sizing rules"; docs/sizing.md)."""
    os_reserve_gb: float = 8.0           # OS and system services (unified: in the shared pool; else host RAM)
    activations_gb: float = 4.0          # activations, CUDA graphs, CUDA context, NCCL (inside vLLM's
                                         # gpu-memory-utilization; beside SGLang's mem-fraction-static)
    buffers_gb: float = 2.0              # staging / offload buffers, when a table is offloaded
    recurrent_state_gb: float = 0.0      # Gated DeltaNet state pools
    min_kv_gb: float = 4.0               # below this the engine cannot serve the context
    concurrency: int = 8                 # full-context requests the KV cache must hold
    reference: dict[str, str] = field(default_factory=dict)   # budget line key -> the report's figure

    REFERENCE_KEYS = ("weights", "engram", "ple", "activations", "buffers", "recurrent", "kv", "os",
                      "page_cache", "host_ram", "nvme")

    def validate(self, path: str, file: str) -> None:
        for f in ("os_reserve_gb", "activations_gb", "buffers_gb", "recurrent_state_gb", "min_kv_gb"):
            v = getattr(self, f)
            if v < 0 or v != v or v == float("inf"):
                raise InputError(f"must be a number of GB >= 0, got {v!r}", file=file, key=f"{path}.{f}")
        if self.concurrency < 1:
            raise InputError(f"must be >= 1, got {self.concurrency}", file=file, key=f"{path}.concurrency")
        for k in self.reference:
            if k not in self.REFERENCE_KEYS:
                raise InputError(f"unknown budget line {k!r} (known: {', '.join(self.REFERENCE_KEYS)})",
                                 file=file, key=f"{path}.reference.{k}")


@dataclass(frozen=True)
class ReleasesSpec:
    """Releases (orchestrator/releases.py): how many of the last releases keep their image pinned
    on every node (never pruned; `deployctl rollback` can bring them back)."""
    keep: int = 3

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file, count=("keep",))


@dataclass(frozen=True)
class SuperviseSpec:
    """The supervisor `up` installs (orchestrator/hostside/supervisor.py, docs/supervisor.md): what it
    watches and how often it restarts the group before it gives up."""
    enabled: bool = True
    port: int = 8790                     # the head's supervisor: the workers' agents report here; /metrics
    interval_s: float = 2.0              # one look at every rank and the API
    health_failures: int = 3             # /health failing this many looks in a row: restart
    wedge_interval_s: float = 30.0       # a small real completion this often while /health answers ...
    wedge_timeout_s: float = 60.0        # ... that must finish within this (else: a wedge)
    wedge_max_tokens: int = 4
    mem_floor_gib: float = 0.0           # MemAvailable on a node below this (GiB; 0 = not watched) ...
    mem_sustain_s: float = 30.0          # ... for this long: restart before the box locks
    max_restarts: int = 3                # at most this many restarts in window_s, then: failed
    window_s: float = 900.0
    backoff_s: float = 10.0              # the wait before the 2nd restart in the window, doubled after
    backoff_max_s: float = 300.0
    silent_s: float = 15.0               # a worker's agent silent this long: no restart until it reports
    # a restart stops the broken group with docker stop -t this: SIGTERM, then SIGKILL. Short on purpose:
    # the group serves nothing any more, and a wedged engine or a rank blocked in a collective does
    # not exit on SIGTERM (bench/supervisor.py: 10 s of a 26 s restart overhead were this wait)
    stop_timeout_s: int = 3
    keep_incidents: int = 50
    # after giving up, bring back the previous release: an `up` that replaces a serving group keeps
    # its containers, stopped, as <name>-prev on every host (their disk layers only), and the
    # supervisor starts them again if the new release fails for good (docs/supervisor.md)
    rollback: bool = False
    # the status page the head's supervisor serves (docs/status-page.md): on the API's address, admitted
    # like the API; its port, default port + 100
    page: bool = True
    page_port: int | None = None

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file, port=("port", "page_port"),
                      count=("health_failures", "wedge_max_tokens", "max_restarts", "keep_incidents"),
                      positive=("interval_s", "wedge_interval_s", "wedge_timeout_s", "window_s", "silent_s"),
                      non_negative=("mem_floor_gib", "mem_sustain_s", "backoff_s", "backoff_max_s",
                                    "stop_timeout_s"))
        if self.page and self.page_at == self.port:
            raise InputError(f"the status page and the supervisor cannot share port {self.port}: give page_port "
                             "another", file=file, key=f"{path}.page_port")

    @property
    def page_at(self) -> int | None:
        """The status page's port (page_port, else port + 100); None: no page (docs/status-page.md)."""
        if not (self.enabled and self.page):
            return None
        return self.page_port or (self.port + 100 if self.port <= 65435 else self.port - 100)


VERDICTS = ("unreachable", "slow-link", "mtu", "subnet", "management", "link-down", "unmeasured")


@dataclass(frozen=True)
class FabricSpec:
    """What the fabric between the hosts must carry before a multi-node launch (orchestrator/fabric/,
    docs/fabric.md). A verdict named in `warn` is reported and the run goes on; every other stops it."""
    expected_gbps: float = 0.0           # a link's expected TCP rate; 0: its negotiated speed (sysfs)
    min_fraction: float = 0.25           # a link measured under this fraction of expected_gbps is slow
    mtu: int = 9000                      # every fabric interface and path carries this MTU; 0: only equal
    iperf_seconds: float = 2.0           # per pair (iperf3 -t)
    iperf_streams: int = 4               # parallel TCP streams per pair (iperf3 -P): one stream cannot fill 200G
    iperf_port: int = 5201
    cache_s: float = 3600.0              # `up` reuses a passing check this long while nothing changed; 0: never
    warn: tuple[str, ...] = ()           # verdicts that only warn (see VERDICTS)

    def validate(self, path: str, file: str) -> None:
        checks.fields(self, path, file, port=("iperf_port",), count=("iperf_streams",),
                      positive=("iperf_seconds",), non_negative=("expected_gbps", "cache_s"))
        if not 0 < self.min_fraction <= 1:
            raise InputError(f"must be a fraction in (0, 1], got {self.min_fraction!r}", file=file,
                             key=f"{path}.min_fraction")
        if self.mtu and not 576 <= self.mtu <= 65535:
            raise InputError(f"must be an MTU (576..65535) or 0, got {self.mtu!r}", file=file, key=f"{path}.mtu")
        for i, v in enumerate(self.warn):
            if v not in VERDICTS:
                raise InputError(f"unknown verdict {v!r} (verdicts: {', '.join(VERDICTS)})", file=file,
                                 key=f"{path}.warn[{i}]")


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    hardware: Literal["dgx-spark", "rtx-pro-6000", "b300", "cpu"]
    model: ModelSpec
    parallelism: Parallelism
    engine: EngineSpec
    engram: EngramSpec | None = None
    ple: PleSpec | None = None
    health: HealthSpec = HealthSpec()
    bench: BenchSpec = BenchSpec()
    sizing: SizingSpec = SizingSpec()
    releases: ReleasesSpec = ReleasesSpec()
    fabric: FabricSpec = FabricSpec()
    supervise: SuperviseSpec = SuperviseSpec()

    def validate(self, path: str, file: str) -> None:
        from .hardware import KINDS
        kind = KINDS[self.hardware]
        for name in ("engram", "ple"):
            spec = getattr(self, name)
            if spec is None:
                continue
            if spec.placement == "pinned" and kind.unified_memory:
                raise InputError(
                    f"placement 'pinned' on {self.hardware}: its CPU and GPU share one memory pool, "
                    "so pinning the table in host memory frees nothing; use 'nvme' (or 'memory')",
                    file=file, key=f"{name}.placement")
            if spec.placement not in kind.placements:
                raise InputError(f"placement {spec.placement!r} is not possible on {self.hardware} "
                                 f"(possible: {', '.join(kind.placements)})",
                                 file=file, key=f"{name}.placement")

    @property
    def digest(self) -> str:
        return digest_of(schema.to_dict(self))


@dataclass(frozen=True)
class LoadedRecipe:
    recipe: Recipe
    path: Path
    overrides: tuple[str, ...] = ()
    # why engine.chain is not built though the recipe names one (`image_without_chain`), for the plan
    chain_skipped: str = ""


def digest_of(data: Any) -> str:
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def resolve_path(name_or_path: str) -> Path:
    """A recipe name (file in recipes/) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yml", ".yaml") or "/" in name_or_path:
        return p
    candidate = RECIPES_DIR / f"{name_or_path}.yml"
    if not candidate.exists():
        known = ", ".join(sorted(x.stem for x in RECIPES_DIR.glob("*.yml")))
        raise InputError(f"no recipe named {name_or_path!r} (known: {known}; or give a path)",
                         key="--recipe")
    return candidate


def load_recipe(name_or_path: str, sets: Sequence[Override | str] = ()) -> LoadedRecipe:
    """The recipe with the overrides applied in order: each an Override (an inventory's
    recipe_overrides entry, which knows its file and key) or a `--set` string."""
    path = resolve_path(name_or_path)
    raw = yamlfile.load(path)
    overrides = tuple(map(as_override, sets))
    data, origins = apply(dict(raw), overrides)
    skipped = image_without_chain(data, origins, str(path))
    try:
        recipe = schema.from_dict(Recipe, data, "", str(path))
    except InputError as e:
        # a bad value an override set is the override's error, not the recipe file's
        raise blame(e, origins) or schema.at_line(e, raw.lines) from None
    return LoadedRecipe(recipe, path, tuple(o.expr for o in overrides), skipped)


def image_without_chain(data: dict, origins: dict[str, Override], recipe_file: str) -> str:
    """engine.image and engine.chain: the recipe's (or an inventory's) pair names the image its chain
    builds, tagged so. An engine.image given more specifically than the chain (on the command line over
    the recipe's or the inventory's chain, or in an inventory's recipe_overrides over the recipe file's)
    names an image to serve as it is: the chain is dropped from DATA (the build stage builds nothing,
    instead of re-tagging that image to the chain's build) and the reason returned for the plan; "" when
    the chain stays. To build the chain under another tag, give engine.chain in the same place."""
    engine = data.get("engine")
    if not isinstance(engine, dict) or not engine.get("chain"):
        return ""
    image, chain = origin_of(origins, "engine.image"), origin_of(origins, "engine.chain")
    if precedence(image) <= precedence(chain):
        return ""
    name, engine["chain"] = engine["chain"], None
    return (f"engine.image {engine.get('image')} is given by {where(image)} without engine.chain: chain {name} "
            f"({where(chain, recipe_file)}) is not built, that image is served as it is (it must be in the "
            f"head's Docker engine; ship sends it on). To build the chain under this tag, give engine.chain "
            f"beside it (--set engine.chain={name})")

