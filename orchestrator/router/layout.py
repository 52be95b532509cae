"""The router's container, files and registrations, as data (pure): what control.py writes and runs.

On the router host, <nvme_dir>/.deployctl/router/ (mounted at /state in the container):
  config.json        listen address, ports, the keeper's interval (no secret)
  api_key            the clients' key (0600; absent: the router's API is open)
  admin_key          the keeper's admin key, new per install (0600)
  workers/<dep>.json one per deployment behind the router: deployment, model, url, api_key (0600)
  registry.json      what the keeper last saw and did (written by it)
  releases.json      the router's own release record: one entry per install
  deployctl-tables-<digest>.pyz   the host-side zipapp (hostside/router_keeper.py runs from it)
"""
from __future__ import annotations

import hashlib
import json
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from ..executors.docker_cli import docker_argv
from ..hostside import bundle

if TYPE_CHECKING:
    from ..deployment import Deployment
    from .config import RouterConf

CONTAINER = "deployctl-router"
LABEL = "deployctl.router"                 # value: the inventory file's stem (who installed it)
INSTALL_LABEL = "deployctl.router.install"
KEEPER = PurePosixPath(__file__).parent.parent / "hostside" / "router_keeper.py"
FRONT = KEEPER.with_name("router_front.py")


def state_dir(conf: "RouterConf") -> str:
    return str(PurePosixPath(conf.host.nvme_dir) / ".deployctl" / "router")


def config(conf: "RouterConf") -> dict[str, Any]:
    """config.json (hostside/router_keeper.py reads it): with a client key the router listens on
    127.0.0.1:backend_port behind the key check (hostside/router_front.py) on listen:port."""
    return {"listen": conf.address, "port": conf.port, "metrics_port": conf.metrics_port,
            "backend_port": conf.backend, "interval_s": conf.check_interval_s}


def install_id(conf: "RouterConf", image_id: str, client_key_id: str | None) -> str:
    """What the running router must match: its config, image, client key and keeper code. A deployment's
    up or down changes none of them (only its workers file), so it never restarts the router."""
    material = json.dumps({"config": config(conf), "image": image_id, "key": client_key_id,
                           "keeper": hashlib.sha256(open(KEEPER, "rb").read() + open(FRONT, "rb").read()).hexdigest()},
                          sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:12]


def run_argv(conf: "RouterConf", install: str, owner: str) -> list[str]:
    """`docker run` of the router: host network (it reaches every deployment's API as the controller
    does, and listens on conf.address), restarted by the engine after a crash or reboot. One added
    capability, CAP_SYS_PTRACE, for one thing: the launcher takes a duplicate of its own child's (the
    router's) listening socket with pidfd_getfd, which Docker's seccomp profile admits only with it, to
    set TCP_NODELAY there (hostside/router_keeper.py `nodelay`: -20 to -40 ms per request); it reaches
    no process outside the container's own PID namespace. Without it the router runs, slower."""
    return docker_argv(conf.host, "run", "-d", "--name", CONTAINER, "--label", f"{LABEL}={owner}",
                       "--label", f"{INSTALL_LABEL}={install}", "--restart", "unless-stopped",
                       "--network", "host", "--cap-add", "SYS_PTRACE",
                       "--log-opt", "max-size=10m", "--log-opt", "max-file=2",
                       "-v", f"{state_dir(conf)}:/state", "--entrypoint", "python3", conf.image,
                       f"/state/{bundle.file_name()}", "router", "launch", "/state/config.json")


REPLICA_POLICY = "cache_aware"      # a replicated model's balancing policy (docs/router.md "Replicas")


def worker(dep: "Deployment") -> dict[str, Any]:
    """DEP's entry for the keeper (its api_key is the engine's own: the router sends it to that engine).
    A replica's entry carries its model's policy and its set: every replica is one worker of the model."""
    rep = dep.cluster.replica
    return {"deployment": dep.name, "model": dep.recipe.engine.served_name, "url": dep.api_url,
            **({"api_key": dep.api_key.value} if dep.api_key else {}),
            **({"policy": REPLICA_POLICY, "replica_of": rep[0]} if rep else {})}


def worker_file(conf: "RouterConf", deployment: str) -> str:
    return str(PurePosixPath(state_dir(conf)) / "workers" / f"{deployment}.json")
