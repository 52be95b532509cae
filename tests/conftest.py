"""Shared fixtures. The cluster lives in tests/cluster/ (also usable by hand: python -m tests.cluster)."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from tests.cluster import TestCluster, cluster_lock, ensure_base_images

CLUSTER_HOSTS = 4


@pytest.fixture(scope="session")
def cluster() -> Iterator[TestCluster]:
    """A real 4-host cluster (netns + sshd + dockerd each), named $DCTL_CLUSTER_NAME or 'pytest'
    (never 'local', a person's demo cluster). Leftovers of a killed run of the same name are
    removed first; everything it started is removed at the end."""
    name = os.environ.get("DCTL_CLUSTER_NAME", "pytest")
    with cluster_lock(name, log=print):       # another session of the same name: wait, don't trample
        c = TestCluster.up(name, CLUSTER_HOSTS)
        try:
            yield c
        finally:
            c.down()


@pytest.fixture(scope="session")
def base_images() -> tuple[str, str]:
    """dctl-busybox:latest and dctl-debian:bookworm in the local engine (made once, then cached)."""
    ensure_base_images()
    return ("dctl-busybox:latest", "dctl-debian:bookworm")


@pytest.fixture(scope="session")
def docker_client():
    """Docker SDK client for the local engine (the default socket)."""
    import docker
    client = docker.DockerClient(base_url="unix:///var/run/docker.sock", timeout=120)
    try:
        client.ping()
    except Exception as e:  # noqa: BLE001 - any failure here means no engine
        pytest.fail(f"the local Docker engine does not answer on /var/run/docker.sock: {e} "
                    f"(start dockerd; .ci/run does)")
    yield client
    client.close()
