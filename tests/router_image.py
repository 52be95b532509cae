"""The router image (dockerfiles/chains/router.yml) for the test cluster's router host: built once on
this machine (cached by its step digest in the local engine: a later session reuses it), then moved
into the host's engine with its step cache tag and its base, so the `route` stage of an `up` there
finds it built. The build itself is the same ChainBuilder run `up` does on a router host (the
real-vLLM tier lets `up` build it on the host: tests/test_real_vllm.py)."""
from __future__ import annotations

from orchestrator.executors import docker_engine as de
from orchestrator.imagechain.builder import ChainBuilder, cache_ref
from orchestrator.imagechain.spec import ready_chain
from orchestrator.router.config import CHAIN, DEFAULT_IMAGE
from tests.cluster.images import DEBIAN_IMAGE, ensure_base_images


class _Log:
    def __init__(self, path):
        self.path = path
        self._lines: list[str] = []

    def write(self, line: str) -> None:
        self._lines.append(line)

    def tail(self, n: int = 40) -> list[str]:
        return self._lines[-n:]

    def close(self) -> None:
        self.path.write_text("\n".join(self._lines) + "\n")


def build_locally(folder, arch: str = "x86_64") -> list[str]:
    """[base, step cache ref, tag] of the router image built in the local engine for ARCH (the router
    host's `uname -m`; the local engine needs a base of that platform)."""
    ensure_base_images()
    chain, _ = ready_chain(CHAIN, arch=arch)
    client = de.local_client()
    try:
        report = ChainBuilder(client, chain, final_tag=DEFAULT_IMAGE, where="local engine",
                              log_for=lambda step: _Log(folder / f"router-build-{step}.log")).build()
    finally:
        client.close()
    refs = [cache_ref(chain.name, s.name, s.digest) for s in report.steps]
    return [DEBIAN_IMAGE, *refs, DEFAULT_IMAGE]


def preload(cluster, host: str, folder, arch: str = "x86_64") -> str:
    cluster.load_image(host, build_locally(folder, arch))
    return DEFAULT_IMAGE
