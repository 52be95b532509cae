"""The exact commands deployctl runs on a host to see and read the deployment's containers (pure:
plans show them, containers.py runs them over SSH). Values reach the shell only as "$1" "$2" ...
"""
from __future__ import annotations

from .render import LABEL

# Prints the host's clock (uptimes are measured there: no clock skew), then `docker inspect` of
# every container of the deployment (any state), or nothing. Exit 3: the engine does not answer.
_LIST = ('date +%s || exit 3; ids=$(docker -H "$1" ps -aq --no-trunc --filter "label=$2") || exit 3; '
         'if [ -n "$ids" ]; then docker -H "$1" inspect $ids; fi')
_LOGS = 'docker -H "$1" logs --tail "$2" "$3" 2>&1'
_FOLLOW = 'docker -H "$1" logs -f --tail "$2" "$3" 2>&1'


# One round trip for everything launch reads on a host: $1 engine, $2 label filter, $3 image,
# $4 head address ("" on one node: no network facts), $5 facts script, $6 staged-tables script,
# $7 Engram folder, $8 PLE folder. Sections start with "@@<name>" lines.
_READ = ('echo @@facts; if [ -n "$4" ]; then python3 -c "$5" "$4" || echo "exit $?"; fi; '
         'echo @@staged; python3 -c "$6" "$7" "$8" || echo "exit $?"; '
         'echo @@image; docker -H "$1" image inspect --format "{{.Id}}" "$3" 2>&1; echo "exit $?"; '
         'echo @@containers; ' + _LIST)


def read_argv(docker_host: str, deployment: str, image: str, head_address: str, facts_script: str,
              staged_script: str, engram_dir: str, ple_dir: str) -> list[str]:
    return ["sh", "-c", _READ, "sh", docker_host, f"{LABEL}={deployment}", image, head_address,
            facts_script, staged_script, engram_dir, ple_dir]


def list_argv(docker_host: str, deployment: str) -> list[str]:
    return ["sh", "-c", _LIST, "sh", docker_host, f"{LABEL}={deployment}"]


def logs_argv(docker_host: str, container: str, lines: int, follow: bool = False) -> list[str]:
    return ["sh", "-c", _FOLLOW if follow else _LOGS, "sh", docker_host, str(lines), container]
