"""What runs on each host: the engine's argv (from jinja2 templates), its environment,
and the container around it. Pure: facts detected on hosts come in as arguments.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any

import jinja2

from .. import apikey
from ..deployment import Deployment
from ..errors import InputError
from ..inventory import Host
from ..recipe import PleSpec
from ..paths import RECIPES_DIR
from ..fabric.detect import Fabric, fabric_env, head_address, topology_note

STOP_TIMEOUT_S = 10          # docker stop -t: SIGTERM, then SIGKILL after this long (launch, down, the supervisor)

# Where host folders appear inside the engine container.
MODEL_MOUNT = "/model"
ENGRAM_MOUNT = "/engram"
PLE_MOUNT = "/ple"
LABEL = "deployctl.deployment"
TABLES_LABEL = "deployctl.tables"
SPEC_LABEL = "deployctl.spec"            # the spec digest: same digest = same container (skip a relaunch)
MASTER = "\x00master-addr\x00"          # stands for the head's address while rendering (bind_fabric fills it)

# Flags deployctl renders from structured recipe fields; setting them in engine.args would
# contradict those fields, so it is an error that names the field to change instead.
RESERVED = {
    "vllm": {"served-model-name": "engine.served_name", "port": "engine.port (or api_port)",
             "host": "all.vars.api_listen", "tensor-parallel-size": "parallelism.tensor_parallel",
             "nnodes": "parallelism.nodes", "node-rank": "the inventory's ranks",
             "master-addr": "the head's fabric address", "master-port": "engine.master_port",
             "headless": "(ranks > 0)", "api-key": "the inventory's api_key_file or api_key_env (never argv)"},
    "sglang": {"served-model-name": "engine.served_name", "port": "engine.port (or api_port)",
               "host": "all.vars.api_listen", "tp-size": "parallelism.tensor_parallel",
               "model-path": "model / engine.model", "ple-offload-backend": "ple.placement",
               "ple-offload-dir": "ple.placement and the host's nvme_dir",
               "api-key": "the inventory's api_key_file or api_key_env (never argv)",
               "config": "(deployctl passes the API key through SGLang's --config file)"},
}
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class ContainerSpec:
    host: str
    rank: int
    name: str
    image: str
    argv: tuple[str, ...]
    env: dict[str, str]                   # values may hold ${VAR} references (expanded at run)
    mounts: tuple[tuple[str, str, str], ...]   # (host path, container path, "ro"|"rw")
    labels: dict[str, str]
    shm_size: str
    gpus: bool                            # request all GPUs (--gpus all)
    rdma_devices: bool                    # pass /dev/infiniband
    fabric_note: str = ""
    options: dict[str, Any] = field(default_factory=dict)   # docker run resource options: memory, memory-swap
    start: dict[str, Any] = field(default_factory=dict)     # place in the start order (start_sequence); not in the digest
    master_slots: tuple[tuple[int, str], ...] = ()          # (argv index, element with MASTER): bind_fabric re-fills them
    api_key_id: str = ""                  # apikey.ApiKey.key_id (in the digest: a new key relaunches); the key is never here
    secret_files: tuple[tuple[str, str], ...] = ()          # (host path, what) launch writes before starting: SGLang's key file
    tables: tuple[tuple[str, str], ...] = ()                # (table, content digest) of the staged tables (bind_tables)

    @property
    def digest(self) -> str:
        """Same digest = the same container would be started (used to skip a relaunch)."""
        doc = {"image": self.image, "argv": self.argv, "env": self.env, "mounts": self.mounts,
               "shm": self.shm_size, "gpus": self.gpus, "rdma": self.rdma_devices,
               "options": self.options}
        if self.api_key_id:
            doc["api_key_id"] = self.api_key_id
        if self.tables:
            doc["tables"] = dict(self.tables)
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def docker_run_argv(self) -> list[str]:
        """The equivalent `docker run` command line (shown in plans and runbooks)."""
        a = ["docker", "run", "-d", "--name", self.name, "--network", "host", "--ipc", "host",
             "--shm-size", self.shm_size]
        for opt in ("memory", "memory-swap"):
            if self.options.get(opt):
                a += [f"--{opt}", str(self.options[opt])]
        if self.gpus or self.rdma_devices:
            # pinned memory (CUDA host buffers, RDMA registration); raising the hard limit needs
            # CAP_SYS_RESOURCE, which a GPU-less host (the test cluster) may not grant
            a += ["--ulimit", "memlock=-1:-1"]
        a += ["--ulimit", "stack=67108864:67108864"]
        if self.gpus:
            a += ["--gpus", "all"]
        if self.rdma_devices:
            a += ["--device", "/dev/infiniband"]
        for k, v in sorted(self.labels.items()):
            a += ["--label", f"{k}={v}"]
        for src, dst, mode in self.mounts:
            a += ["-v", f"{src}:{dst}:{mode}"]
        for k, v in self.env.items():
            a += ["-e", f"{k}={v}"]
        return a + [self.image, *self.argv]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "image": self.image, "argv": list(self.argv), "env": self.env,
                "mounts": [list(m) for m in self.mounts], "labels": self.labels,
                "shm_size": self.shm_size, "gpus": self.gpus, "rdma_devices": self.rdma_devices,
                "digest": self.digest, "fabric": self.fabric_note, "options": self.options,
                "start": self.start, "api_key_id": self.api_key_id, "tables": dict(self.tables),
                "docker_run": self.docker_run_argv()}


def _argval(v: Any) -> str:
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, separators=(", ", ": "))
    if isinstance(v, float) and v.is_integer():
        return str(v)
    return str(v)


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    """One environment per process: it keeps the templates it compiled (a plan renders one per host)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(RECIPES_DIR / "engines")),
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined,
                             autoescape=False, keep_trailing_newline=False)
    env.filters["argval"] = _argval
    return env


def _check_args(dep: Deployment) -> list[tuple[str, Any]]:
    e = dep.recipe.engine
    reserved = RESERVED[e.kind]
    for flag in e.args:
        if flag.startswith("-"):
            raise InputError(f"flag names are given without dashes (write {flag.lstrip('-')!r})",
                             file=str(dep.loaded.path), key=f"engine.args.{flag}")
        if flag in reserved:
            raise InputError(f"--{flag}: deployctl sets it from {reserved[flag]}; change that instead",
                             file=str(dep.loaded.path), key=f"engine.args.{flag}")
    # false / null mean "leave the flag out".
    return [(k, v) for k, v in e.args.items() if v is not False and v is not None]


def model_path(dep: Deployment, host: Host) -> str:
    """The checkpoint's path inside the container (see Deployment.checkpoint_mount)."""
    inner = dep.checkpoint_mount(host)[1]
    return f"{MODEL_MOUNT}/{inner}" if inner else MODEL_MOUNT


def ple_env(ple: PleSpec | None) -> dict[str, str]:
    """SGLang's environment for the file-backed PLE table (sglang/srt/environ.py names):
    the mapping's resident-set budget (qwen4_exp_ple_table.py make_ple_file_rss_trimmer, GiB),
    and the external model package that keeps a table deployctl wrote and checked instead of
    rewriting it at every boot (dockerfiles/sglang-qwen38/patches/deployctl_sglang_ple)."""
    if ple is None or ple.placement != "nvme":
        return {}
    env = {"SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB": f"{ple.page_cache_budget_gib:g}"}
    if ple.prewritten_package:
        env["SGLANG_EXTERNAL_MODEL_PACKAGE"] = ple.prewritten_package
    return env


def api_host(dep: Deployment, host: Host) -> str:
    """--host: the API's address on the head (dep.api_listen). A headless vLLM rank serves no API
    (vllm/entrypoints/cli/serve.py run_headless); its --host is its own management address, or
    every interface when the inventory asks for that."""
    if host.name == dep.cluster.head:
        return dep.api_listen
    return "0.0.0.0" if dep.api_listens_everywhere else host.address


def engine_argv(dep: Deployment, host: Host, master_addr: str) -> tuple[str, ...]:
    return _engine_argv(dep, host, master_addr)[0]


def _engine_argv(dep: Deployment, host: Host, master_addr: str) -> tuple[tuple[str, ...], tuple[tuple[int, str], ...]]:
    """The argv, and where in it the master address stands (so a detected fabric can re-fill it)."""
    r, e = dep.recipe, dep.recipe.engine
    ple = r.ple
    ctx = {
        "model": e.model or model_path(dep, host), "served_name": e.served_name, "port": dep.api_port,
        "api_host": api_host(dep, host),
        "tp": r.parallelism.tensor_parallel, "nnodes": r.parallelism.nodes, "rank": host.rank,
        "master_addr": MASTER, "master_port": e.master_port, "args": _check_args(dep),
        "ple_backend": {"nvme": "file", "pinned": "pinned"}.get(ple.placement) if ple else None,
        "ple_dir": PLE_MOUNT if ple and ple.placement == "nvme" else None,
        "api_key_config": apikey.SGLANG_CONFIG if dep.api_key is not None and e.kind == "sglang" else None,
    }
    text = _env().get_template(f"{e.kind}.argv.j2").render(**ctx)
    raw = [line.strip() for line in text.splitlines() if line.strip()]
    slots = tuple((i, a) for i, a in enumerate(raw) if MASTER in a)
    return tuple(a.replace(MASTER, master_addr) for a in raw), slots


def container_spec(dep: Deployment, host: Host, fabric: Fabric | None,
                   head_fabric: Fabric | None) -> ContainerSpec:
    """The container for `host` with the detected fabrics bound (None: as planned)."""
    return bind_fabric(planned_spec(dep, host), fabric, head_fabric.address if head_fabric else None,
                       dep.recipe.engine.nccl_roce_env)


def bind_fabric(spec: ContainerSpec, fabric: Fabric | None, master: str | None,
                roce_env: dict[str, str] | None = None) -> ContainerSpec:
    """The planned SPEC with what launch detects on the hosts: the host's fabric (its NCCL/GLOO/UCX
    environment, RDMA devices) and the head's fabric address as the master address. Everything else
    stays exactly as planned. Pure."""
    argv = list(spec.argv)
    if master:
        for i, element in spec.master_slots:
            argv[i] = element.replace(MASTER, master)
    env, note = dict(spec.env), spec.fabric_note
    if fabric is not None:
        env.update(fabric_env(fabric, roce_env))
        note = fabric.reason
    bound = replace(spec, argv=tuple(argv), env=env, rdma_devices=bool(fabric and fabric.hcas), fabric_note=note)
    # The digest covers everything but the labels, so it can be one of them.
    return replace(bound, labels={**bound.labels, SPEC_LABEL: bound.digest})


def bind_tables(spec: ContainerSpec, digests: dict[str, str]) -> ContainerSpec:
    """SPEC with the content digests of the staged tables it serves (probe.table_digests): they are
    in its digest, so a restaged Engram folder or a rewritten PLE file restarts the engine that
    maps the old bytes. Pure."""
    bound = replace(spec, tables=tuple(sorted(digests.items())))
    labels = {**bound.labels, TABLES_LABEL: tables_id(bound.tables)} if bound.tables else bound.labels
    return replace(bound, labels={**labels, SPEC_LABEL: bound.digest})


def tables_id(tables: tuple[tuple[str, str], ...]) -> str:
    """A short id of the staged tables' digests (a container label: launch says when they changed)."""
    return hashlib.sha256(json.dumps(list(tables)).encode()).hexdigest()[:16]


def planned_spec(dep: Deployment, host: Host) -> ContainerSpec:
    """The container for `host` as the plan shows it: the inventory's fabric overrides or the
    management addresses stand in for what launch detects (bind_fabric), and the note says so."""
    r, e, c = dep.recipe, dep.recipe.engine, dep.cluster
    head = c.head_host
    master = head_address(c)
    env: dict[str, str] = {}
    env.update(e.env)
    if r.engram and r.engram.placement == "nvme":
        env.update(r.engram.nvme_env)
        if r.engram.local_dir_env:   # the rank's staged rows (docs/engram-contract.md): the mount below
            env[r.engram.local_dir_env] = ENGRAM_MOUNT
    env.update(ple_env(r.ple))
    note = ""
    if r.parallelism.nodes > 1:
        note = topology_note(c, host)
    mounts = [(dep.checkpoint_mount(host)[0], MODEL_MOUNT, "ro")]
    if r.engram and r.engram.placement == "nvme":
        mounts.append((dep.engram_dir(host), ENGRAM_MOUNT, "ro"))
    if r.ple and r.ple.placement == "nvme":
        # read-write: SGLang maps the table with torch.from_file(shared=True) (qwen4_exp_ple_table.py
        # allocate_ple_host_table), which fails with EROFS on a read-only mount
        mounts.append((dep.ple_dir(host), PLE_MOUNT, "rw"))
    if e.cache_dir:      # kernel/compile/Hub caches on the host: they survive container restarts
        mounts.append((e.cache_dir, e.cache_mount, "rw"))
    secret_files: tuple[tuple[str, str], ...] = ()
    if dep.api_key is not None:     # orchestrator/apikey.py: how each engine gets the key without argv
        if e.kind == "vllm":
            env[apikey.VLLM_ENV] = "${" + apikey.ENV_NAME + "}"
        else:
            path = api_key_file(host, dep.name)
            mounts.append((path, apikey.SGLANG_CONFIG, "ro"))
            secret_files = ((path, "sglang-config"),)
    options = {k: v for k, v in (("memory", e.memory_limit), ("memory-swap", e.memory_swap)) if v}
    if e.cpu_bind_env and host.compute_cpus:     # vLLM CPU: its OpenMP threads (vllm/utils/ompmultiprocessing.py)
        env[e.cpu_bind_env] = host.compute_cpus
    labels = {LABEL: dep.name, "deployctl.rank": str(host.rank), "deployctl.recipe": r.name,
              "deployctl.role": "head" if host.name == head.name else "worker"}
    key_id = dep.api_key.key_id if dep.api_key is not None else ""
    if key_id:
        labels[apikey.LABEL] = key_id
    argv, slots = _engine_argv(dep, host, master)
    spec = ContainerSpec(
        host=host.name, rank=host.rank, name=e.container_name or f"deployctl-{dep.name}",
        image=e.image, argv=argv, env=env, mounts=tuple(mounts),
        labels=labels, shm_size=e.shm_size, gpus=host.gpus > 0 and host.expect_gpus,
        rdma_devices=False, fabric_note=note, options=options,
        start=start_step(dep, host.name), master_slots=slots, api_key_id=key_id, secret_files=secret_files)
    return replace(spec, labels={**labels, SPEC_LABEL: spec.digest})


def api_key_file(host: Host, deployment: str) -> str:
    """Where launch writes SGLang's --config file holding the key on HOST (mode 0600, mounted read-only)."""
    return str(PurePosixPath(host.nvme_dir) / ".deployctl" / "secrets" / f"{deployment}-sglang-api-key.yaml")


def start_sequence(dep: Deployment) -> list[tuple[str, ...]]:
    """The hosts in start order: groups started one after another (a group's hosts in parallel).
    head-first: the head, then every worker. workers-first (boot 10's launch/boot_dsv41.sh): every
    worker, then (after engine.start_wait_s) the head. The boot script starts its workers one by one
    in descending rank; the engines need the workers before the head, not an order among them (the
    script itself starts every worker before the master, so each already waits for it), and one by
    one cost 0.2 s per worker over SSH."""
    c, e = dep.cluster, dep.recipe.engine
    if e.start_order == "workers-first" and c.workers:
        return [tuple(h.name for h in sorted(c.workers, key=lambda h: -h.rank)), (c.head,)]
    return [(c.head,)] + ([tuple(h.name for h in c.workers)] if c.workers else [])


def start_step(dep: Deployment, host: str) -> dict[str, Any]:
    """HOST's place in start_sequence (shown in plans and dry runs)."""
    seq = start_sequence(dep)
    step = next(i for i, g in enumerate(seq) if host in g)
    wait = dep.recipe.engine.start_wait_s if (host == dep.cluster.head and step > 0) else 0.0
    return {"order": dep.recipe.engine.start_order, "step": step + 1, "of": len(seq),
            "after": [n for g in seq[:step] for n in g], "wait_before_s": wait}


def env_references(env: dict[str, str]) -> list[str]:
    """Names of operator variables that `${VAR}` values refer to."""
    return sorted({m for v in env.values() for m in _ENV_REF.findall(v)})


def expand_env(env: dict[str, str], source: dict[str, str], where: str) -> dict[str, str]:
    """Resolve ${VAR} from the operator's environment at launch (never stored in plans)."""
    missing = [n for n in env_references(env) if n not in source]
    if missing:
        raise InputError(f"engine.env refers to ${{{missing[0]}}}, which is not set in your environment",
                         file=where, key="engine.env")
    return {k: _ENV_REF.sub(lambda m: source[m.group(1)], v) for k, v in env.items()}
