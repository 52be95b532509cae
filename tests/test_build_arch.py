"""A chain built for linux/arm64 on real Docker engines from this x86-64 machine: the local Docker 20.10
and a test host's Docker 26 (the suite's default engine), both with the classic builder (no BuildKit
here). A two-step chain (a docker-build whose RUN runs under qemu-user, then a patch) FROM an arm64
base (the test bed's arm64 busybox, tests/cluster/arm64.py) must give images whose config says linux/arm64, and `uname -m` inside says
aarch64; a base of the wrong platform is refused before anything is built, naming the image, its
platform, the host and its architecture; a cached image of the wrong platform is refused too."""
from __future__ import annotations

import shutil
from pathlib import Path

import docker
import pytest

from orchestrator.imagechain.builder import (CACHE_REPO, BuildReport, ChainBuilder, ChainFailed, cache_ref,
                                              is_platform)
from orchestrator.imagechain.spec import check_inputs, load_chain
from orchestrator.runrecord import HostLog
from tests.cluster import arm64
from tests.cluster.images import BUSYBOX_IMAGE, LOCAL_ENGINE, copy_image, ensure_base_images

ARM = arm64.BUSYBOX_IMAGE                  # the test bed's arm64 busybox, config linux/arm64/v8
WRONG = BUSYBOX_IMAGE                      # this machine's busybox, config linux/amd64: the wrong platform
FINAL = "dctl-chainarch:test"
CHAIN = """\
name: archtest
description: two steps FROM an arm64 base
steps:
  - name: app
    kind: docker-build
    parent: base
    dockerfile_input: {src: app.Dockerfile, check: file}
    inputs: [{src: app.txt, check: file}]
    verify: {command: [cat, /etc/built-arch], expect_lines: [aarch64], timeout_s: 60}
    timeout_s: 120
  - name: patch
    kind: patch
    target: /opt/app
    patches: [{file: app.txt, dest: app.txt, purpose: the patched file}]
    verify: {command: [cat, /opt/app/app.txt], expect: patched, timeout_s: 60}
    timeout_s: 120
"""
DOCKERFILE = """\
ARG BASE
FROM ${BASE}
RUN uname -m > /etc/built-arch && echo "built on $(cat /etc/built-arch)"
COPY app.txt /opt/app/app.txt
"""


def chain_dir(tmp_path: Path, base: str) -> Path:
    d = tmp_path / "chain"
    (d / "inputs" / "patches").mkdir(parents=True)
    (d / "archtest.yml").write_text(CHAIN)
    (d / "archtest.lock.yml").write_text(f"chain: archtest\nbase: {{image: '{base}'}}\ninputs_dir: inputs\n")
    (d / "inputs" / "app.Dockerfile").write_text(DOCKERFILE)
    (d / "inputs" / "app.txt").write_text("original\n")
    (d / "inputs" / "patches" / "app.txt").write_text("patched\n")
    return d / "archtest.yml"


def build(client, chain_file: Path, arch: str, logs: Path, host: str = "head1") -> BuildReport:
    chain = load_chain(str(chain_file), arch=arch)
    check_inputs(chain)
    return ChainBuilder(client, chain, final_tag=FINAL, where="test engine", host=host,
                        log_for=lambda step: HostLog(logs / f"{step}.log", [])).build()


def clean(client) -> None:
    for img in client.api.images(name=f"{CACHE_REPO}/archtest") + client.api.images(name=FINAL.split(":")[0]):
        for tag in img.get("RepoTags") or []:
            try:
                client.api.remove_image(tag, force=True)
            except docker.errors.APIError:
                pass


def load_bases(engine: str) -> None:
    """ARM and WRONG in ENGINE: made in the local engine once (cached), copied to another engine. The arm64
    one is made and run under qemu-user: without it this fails, saying what to install (.ci/setup does)."""
    arm64.ensure_emulation()
    ensure_base_images(debian=False)
    ensure_base_images(debian=False, arch="aarch64")
    if engine != LOCAL_ENGINE:
        copy_image([ARM, WRONG], LOCAL_ENGINE, engine)


def check_arm64_build(client, engine: str, tmp_path: Path) -> None:
    """The chain built for aarch64 in CLIENT's engine, checked; then rebuilt (every step reused and
    checked); then a cache image of the wrong platform is refused."""
    load_bases(engine)
    chain_file = chain_dir(tmp_path, ARM)
    clean(client)
    try:
        rep = build(client, chain_file, "aarch64", tmp_path / "logs")
        assert rep.status == "ok" and (rep.platform, rep.arch) == ("linux/arm64", "aarch64")
        assert rep.base["platform"] == "linux/arm64/v8"
        assert [(s.name, s.status, s.platform) for s in rep.steps] == [
            ("app", "built", "linux/arm64/v8"), ("patch", "built", "linux/arm64/v8")]
        attrs = client.api.inspect_image(FINAL)
        assert attrs["Id"] == rep.image_id and is_platform(attrs, "aarch64") and not is_platform(attrs, "x86_64")
        out = client.containers.run(FINAL, ["sh", "-c", "uname -m; cat /etc/built-arch /opt/app/app.txt"], remove=True)
        assert out.decode().split() == ["aarch64", "aarch64", "patched"]
        assert "built on aarch64" in (tmp_path / "logs" / "app.log").read_text()

        again = build(client, chain_file, "aarch64", tmp_path / "logs2")
        assert [(s.status, s.platform) for s in again.steps] == [("reused", "linux/arm64/v8")] * 2
        assert again.image_id == rep.image_id

        # a cache tag of the right digest on an image of another platform (not this build's doing)
        app = again.steps[0]
        ref = cache_ref("archtest", "app", app.digest)
        stray = client.images.build(fileobj=_dockerfile(f"FROM {WRONG}\nLABEL deployctl.digest={app.digest}\n"),
                                    platform="linux/amd64", rm=True)[0]
        client.api.tag(stray.id, *ref.split(":", 1), force=True)
        with pytest.raises(ChainFailed) as e:
            build(client, chain_file, "aarch64", tmp_path / "logs3")
        assert e.value.step == "app" and f"the cached image of step app, {ref}" in str(e.value)
        assert "is linux/amd64, not linux/arm64" in str(e.value) and "docker rmi" in str(e.value)
    finally:
        clean(client)


def _dockerfile(text: str):
    import io
    return io.BytesIO(text.encode())


def check_wrong_base_refused(client, engine: str, tmp_path: Path) -> None:
    """An amd64 base for an aarch64 head, and an arm64 base for an x86_64 head: refused before any step."""
    load_bases(engine)
    clean(client)
    for base, arch, found, want in ((WRONG, "aarch64", "linux/amd64", "linux/arm64"),
                                    (ARM, "x86_64", "linux/arm64/v8", "linux/amd64")):
        with pytest.raises(ChainFailed) as e:
            build(client, chain_dir(tmp_path / arch, base), arch, tmp_path / arch / "logs", host="spark1")
        msg = str(e.value)
        assert e.value.step == "base", msg
        for words in (f"base image {base}", f"is {found}", f"spark1, whose architecture is {arch} ({want})",
                      f"docker pull --platform {want}", "archtest.lock.yml"):
            assert words in msg, (words, msg)
        assert [s.status for s in e.value.report.steps] == ["not-run", "not-run"]
    assert not client.api.images(name=f"{CACHE_REPO}/archtest") and not client.api.images(name="dctl-chainarch")


# ------------------------------------------------------------------------------------------ Docker 20.10

@pytest.mark.docker
def test_an_arm64_chain_on_the_local_engine(docker_client, tmp_path):
    check_arm64_build(docker_client, LOCAL_ENGINE, tmp_path)


@pytest.mark.docker
def test_a_base_of_the_wrong_platform_is_refused_on_the_local_engine(docker_client, tmp_path):
    check_wrong_base_refused(docker_client, LOCAL_ENGINE, tmp_path)


# ------------------------------------------------------------------------------------------ Docker 26

@pytest.mark.cluster
def test_an_arm64_chain_on_a_docker_26_test_host(tmp_path):
    from tests.cluster import TestCluster, cluster_lock
    with cluster_lock("chainarch", log=print):
        c = TestCluster.up("chainarch", 1, engine="26")
        try:
            client = docker.DockerClient(base_url=c.hosts[0].docker_host, timeout=120)
            try:
                assert client.version()["Version"].startswith("26."), client.version()["Version"]
                check_arm64_build(client, c.hosts[0].docker_host, tmp_path / "build")
                check_wrong_base_refused(client, c.hosts[0].docker_host, tmp_path / "refuse")
            finally:
                client.close()
        finally:
            c.down()
            shutil.rmtree(tmp_path, ignore_errors=True)
