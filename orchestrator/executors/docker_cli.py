"""The one builder of `docker ...` commands for a host: always `docker -H <the host's engine> ...`.

Every stage that runs the Docker CLI on a host (preflight, build's dial-stdio tunnel, ship, launch,
health, status/logs/down) builds its argv here, so all of them talk to the same engine: the
inventory's `docker_host` (default unix:///var/run/docker.sock), passed explicitly with -H even when
it is the default, never whatever DOCKER_HOST the host's login environment happens to set.

Pure and standard library only (plans import it; it touches nothing). Argv lists are passed as
they are; `docker_sh` is the same argv quoted with shlex for a shell command line.
"""
from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from ..inventory import Host

DEFAULT_ENGINE = "unix:///var/run/docker.sock"     # inventory.Host.docker_host's default

HostOrEngine = Union["Host", str]


def engine(host: HostOrEngine) -> str:
    """The engine a host's docker commands target: its docker_host (a Host, or that string itself)."""
    value = host if isinstance(host, str) else host.docker_host
    return value or DEFAULT_ENGINE


def docker_argv(host: HostOrEngine, *args: str) -> list[str]:
    """`docker -H ENGINE ARGS...` for HOST (a Host or its docker_host string), as an argv list."""
    return ["docker", "-H", engine(host), *args]


def docker_sh(host: HostOrEngine, *args: str) -> str:
    """docker_argv as one shell command line, every word quoted (nothing reaches a shell unquoted)."""
    return shlex.join(docker_argv(host, *args))
