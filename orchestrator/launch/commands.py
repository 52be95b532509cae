"""The exact commands deployctl runs on a host to see and read the deployment's containers (pure:
plans show them, containers.py runs them over SSH). Every `docker` word comes from the one builder
(executors/docker_cli.py: `docker -H <the host's engine>`, shlex-quoted); the other values reach the
shell only as "$1" "$2" ... (read_argv has no shell: hostside/host_read.py gets argv lists as JSON).
"""
from __future__ import annotations

import json

from ..executors.docker_cli import docker_argv, docker_sh, engine
from ..executors.host_batch import HOST_READ
from .containerspec import LABEL


def _logs_sh(docker_host: str, follow: bool) -> str:
    """The container's logs ($1 lines, $2 container), stderr folded into stdout."""
    return f'{docker_sh(docker_host, "logs", *(["-f"] if follow else []))} --tail "$1" "$2" 2>&1'


def read_argv(docker_host: str, deployment: str, image: str, head_address: str, facts_script: str,
              staged_script: str, engram_dir: str, ple_dir: str) -> list[str]:
    """One round trip for everything launch reads on a host: hostside/host_read.py with its SPEC
    (the network facts only with a HEAD_ADDRESS, i.e. on more than one node; the staged tables of
    ENGRAM_DIR and PLE_DIR; the image; the deployment's containers). No shell: the docker argv lists
    go to the program as JSON."""
    spec = {"facts": facts_script, "facts_args": [head_address] if head_address else [],
            "staged": staged_script, "staged_args": [engram_dir, ple_dir],
            "image": image, "image_inspect": docker_argv(docker_host, "image", "inspect", "--format", "{{.Id}}", image),
            **_containers_spec(docker_host, deployment)}
    return ["python3", "-c", HOST_READ, json.dumps(spec)]


def list_argv(docker_host: str, deployment: str) -> list[str]:
    """Prints the host's clock (uptimes are measured there: no clock skew), then `docker inspect` of
    every container of the deployment (any state), or nothing; exit 3: the engine does not answer.
    hostside/host_read.py's list form: the Engine API on a unix socket, else these docker argv lists."""
    return ["python3", "-c", HOST_READ, json.dumps({"list": True, **_containers_spec(docker_host, deployment)})]


def _containers_spec(docker_host: str, deployment: str) -> dict:
    """How host_read.py lists the deployment's containers: the engine (its API when a unix socket),
    the label, and the CLI's argv for the same (ids of every container with the label, then inspect)."""
    label = f"{LABEL}={deployment}"
    return {"engine": engine(docker_host), "label": label,
            "ps": docker_argv(docker_host, "ps", "-aq", "--no-trunc", "--filter", f"label={label}"),
            "inspect": docker_argv(docker_host, "inspect")}


def logs_argv(docker_host: str, container: str, lines: int, follow: bool = False) -> list[str]:
    return ["sh", "-c", _logs_sh(docker_host, follow), "sh", str(lines), container]
