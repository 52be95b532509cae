"""The exact commands deployctl runs on a host to see and read the deployment's containers (pure:
plans show them, containers.py runs them over SSH). Every `docker` word comes from the one builder
(executors/docker_cli.py: `docker -H <the host's engine>`, shlex-quoted); the other values reach the
shell only as "$1" "$2" ...
"""
from __future__ import annotations

from ..executors.docker_cli import docker_sh
from .containerspec import LABEL


def _list_sh(docker_host: str) -> str:
    """Prints the host's clock (uptimes are measured there: no clock skew), then `docker inspect` of
    every container of the deployment (any state; $1 the label filter), or nothing. Exit 3: the
    engine does not answer."""
    return (f'date +%s || exit 3; ids=$({docker_sh(docker_host, "ps", "-aq", "--no-trunc")} --filter "label=$1") '
            f'|| exit 3; if [ -n "$ids" ]; then {docker_sh(docker_host, "inspect")} $ids; fi')


def _logs_sh(docker_host: str, follow: bool) -> str:
    """The container's logs ($1 lines, $2 container), stderr folded into stdout."""
    return f'{docker_sh(docker_host, "logs", *(["-f"] if follow else []))} --tail "$1" "$2" 2>&1'


def _read_sh(docker_host: str) -> str:
    """One round trip for everything launch reads on a host: $1 label filter, $2 image, $3 head
    address ("" on one node: no network facts), $4 facts script, $5 staged-tables script, $6 Engram
    folder, $7 PLE folder. Sections start with "@@<name>" lines."""
    return ('echo @@facts; if [ -n "$3" ]; then python3 -c "$4" "$3" || echo "exit $?"; fi; '
            'echo @@staged; python3 -c "$5" "$6" "$7" || echo "exit $?"; '
            f'echo @@image; {docker_sh(docker_host, "image", "inspect", "--format", "{{.Id}}")} "$2" 2>&1; '
            'echo "exit $?"; echo @@containers; ' + _list_sh(docker_host))


def read_argv(docker_host: str, deployment: str, image: str, head_address: str, facts_script: str,
              staged_script: str, engram_dir: str, ple_dir: str) -> list[str]:
    return ["sh", "-c", _read_sh(docker_host), "sh", f"{LABEL}={deployment}", image, head_address,
            facts_script, staged_script, engram_dir, ple_dir]


def list_argv(docker_host: str, deployment: str) -> list[str]:
    return ["sh", "-c", _list_sh(docker_host), "sh", f"{LABEL}={deployment}"]


def logs_argv(docker_host: str, container: str, lines: int, follow: bool = False) -> list[str]:
    return ["sh", "-c", _logs_sh(docker_host, follow), "sh", str(lines), container]
