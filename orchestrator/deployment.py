"""A deployment: one inventory plus the recipe it runs, cross-checked."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .apikey import ApiKey, load_api_key
from .errors import InputError
from .hardware import KINDS
from .colocation import refuse
from .inventory import Cluster, Host, InventoryRef, load_inventory
from .recipe import LoadedRecipe, Recipe, load_recipe, resolve_path
from .secrets import register_named

if TYPE_CHECKING:
    from .modelfetch.resolved import Resolved


WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::"})   # --host values that bind every interface


@dataclass(frozen=True)
class Deployment:
    cluster: Cluster
    loaded: LoadedRecipe
    api_key: ApiKey | None = field(default=None, repr=False)   # the serving key the inventory points at
    # The commit (and files) this run uses, resolved once before planning (modelfetch/resolve.py);
    # None: not resolved, the snapshot folder is named by model.revision as written.
    checkpoint: "Resolved | None" = None

    @property
    def recipe(self) -> Recipe:
        return self.loaded.recipe

    @property
    def name(self) -> str:
        return self.cluster.name

    @property
    def api_port(self) -> int:
        """The inventory's api_port, else the recipe's engine.port."""
        return self.cluster.api_port or self.recipe.engine.port

    @property
    def api_listen(self) -> str:
        """The address the API listens on: the inventory's api_listen, else the head's management
        address (not every interface: docs/exposure.md)."""
        return self.cluster.api_listen or self.cluster.head_host.address

    @property
    def api_listens_everywhere(self) -> bool:
        return self.api_listen in WILDCARD_ADDRESSES

    @property
    def api_url(self) -> str:
        """Where the controller reaches the API: the address it listens on, or the head's management
        address when it listens on every interface."""
        host = self.cluster.head_host.address if self.api_listens_everywhere else self.api_listen
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.api_port}"

    def checkpoint_dir(self, host: Host) -> str:
        """The checkpoint folder on `host`: HF cache layout unless the recipe names a folder."""
        root, inner = self.checkpoint_mount(host)
        return str(PurePosixPath(root) / inner) if inner else root

    def checkpoint_mount(self, host: Host) -> tuple[str, str]:
        """(folder to mount into the engine, the checkpoint's path inside it).

        In the HF cache layout `snapshots/REV/` holds links into `../../blobs/`, so the whole
        `models--ORG--NAME` folder is mounted for those links to resolve in the container.
        """
        m = self.recipe.model
        if m.checkpoint_dir:
            return str(PurePosixPath(host.model_cache) / m.checkpoint_dir), ""
        repo = PurePosixPath(host.model_cache) / f"models--{m.repo.replace('/', '--')}"
        return str(repo), f"snapshots/{self.snapshot}"

    @property
    def snapshot(self) -> str:
        """The snapshot folder's name: the resolved commit, else model.revision as written."""
        return self.checkpoint.commit if self.checkpoint and self.checkpoint.commit else self.recipe.model.revision

    @property
    def supervisor_port(self) -> int | None:
        """The port the head's supervisor listens on; None: not supervised (launch/supervision.py)."""
        return self.recipe.supervise.port if self.recipe.supervise.enabled and self.cluster.supervise else None

    def engram_dir(self, host: Host) -> str:
        assert self.recipe.engram is not None
        return str(PurePosixPath(host.nvme_dir) / self.recipe.engram.subdir)

    def ple_dir(self, host: Host) -> str:
        assert self.recipe.ple is not None
        return str(PurePosixPath(host.nvme_dir) / self.recipe.ple.subdir)


def load_deployment(inventory: str | Path | None, recipe: str | None = None,
                    sets: tuple[str, ...] = (), together: bool = True) -> Deployment:
    """One deployment of the inventory (--recipe and --set apply to it). When the inventory holds several
    (all.vars.deployments), the others are loaded too and what cannot work together with this one is
    refused here, before any host is touched (colocation.py); TOGETHER=False for the commands that only
    read or stop (status, logs, down, incidents, history): they must work whatever the others say."""
    dep = _load(inventory, recipe, sets)
    if (dep.cluster.peers or dep.cluster.router) and together:
        refuse(dep, [_load(InventoryRef.of(dep.cluster.file, n), key=False) for n in dep.cluster.peers])
    return dep


def _load(inventory: str | Path | None, recipe: str | None = None, sets: tuple[str, ...] = (),
          key: bool = True) -> Deployment:
    cluster = load_inventory(inventory)
    ref = recipe or cluster.recipe
    if not ref:
        raise InputError(f"no recipe: pass --recipe or set {cluster.vars_key}.recipe", file=str(cluster.file),
                         key=f"{cluster.vars_key}.recipe")
    if not recipe:
        ref = _inventory_recipe(cluster, str(ref))
    loaded = load_recipe(ref, (*cluster.recipe_overrides, *sets))
    check_fit(cluster, loaded)
    # Secret-named engine.env / engine.args values (hf-token, MY_SECRET ...) are masked like the API key
    # wherever they turn up in text (secrets.py); argvs and mappings mask them by name anyway.
    register_named(loaded.recipe.engine.env)
    register_named(loaded.recipe.engine.args)
    return Deployment(cluster, loaded, load_api_key(cluster) if key else None)


def _inventory_recipe(cluster: Cluster, ref: str) -> str:
    """The recipe file the inventory names (all.vars.recipe, or the deployment's own): its errors name
    the inventory's key, not --recipe."""
    if "/" in ref or ref.endswith((".yml", ".yaml")):
        p = Path(ref)                     # a path in the inventory is relative to the inventory file
        p = p if p.is_absolute() else cluster.file.parent / p
        if not p.is_file():
            raise InputError(f"no recipe file {str(p)!r}", file=str(cluster.file), key=f"{cluster.vars_key}.recipe")
        return str(p)
    try:
        return str(resolve_path(ref))
    except InputError as e:
        raise InputError(e.detail, file=str(cluster.file), key=f"{cluster.vars_key}.recipe") from None


def check_fit(cluster: Cluster, loaded: LoadedRecipe) -> None:
    """The inventory must be the cluster the recipe was written for."""
    r, f = loaded.recipe, str(cluster.file)
    par = r.parallelism
    if len(cluster.hosts) != par.nodes:
        raise InputError(
            f"recipe {r.name} needs {par.nodes} node(s) (tensor_parallel {par.tensor_parallel} = "
            f"{par.nodes} nodes x {par.gpus_per_node} GPU); the inventory has {len(cluster.hosts)}",
            file=f, key=cluster.hosts_key)
    for h in cluster.hosts:
        if h.hardware != r.hardware:
            raise InputError(f"host {h.name} is {h.hardware} but recipe {r.name} is for {r.hardware}",
                             file=f, key=f"all.hosts.{h.name}.hardware")
        if KINDS[r.hardware].gpu_ranks and h.gpus < par.gpus_per_node:
            raise InputError(f"host {h.name} has {h.gpus} GPU(s); recipe {r.name} needs "
                             f"{par.gpus_per_node} per node (tensor_parallel {par.tensor_parallel} = "
                             f"nodes x GPUs per node)", file=f, key=f"all.hosts.{h.name}.gpus")
    arches = {h.arch for h in cluster.hosts}
    if len(arches) > 1:
        # one image serves every rank: it is built for the head's platform and cannot run on another
        by = ", ".join(f"{h.name} {h.arch}" for h in cluster.hosts)
        raise InputError(f"the hosts of deployment {cluster.name} differ in architecture ({by}): every rank "
                         f"runs the one image built on the head {cluster.head}; put hosts of one architecture "
                         f"in a deployment (several deployments may differ: all.vars.deployments)",
                         file=f, key=cluster.hosts_key)
