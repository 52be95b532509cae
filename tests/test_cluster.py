"""The test cluster itself: real hosts (netns + sshd + dockerd), reached through deployctl's SSH executor."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.executors.ssh import HostKeyError, SSHError, SSHTimeout
from tests.cluster import BUSYBOX_IMAGE, ensure_base_images, plan_hosts, render_inventory
from tests.cluster.cluster import demo_hub_url

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[1]


def test_each_host_has_its_own_address_and_engine(cluster):
    for h in cluster.hosts:
        r = cluster.ssh_target(h).run(["sh", "-c", "ip -4 -o addr show eth0; echo $DOCKER_HOST"], timeout=20)
        assert r.rc == 0, r
        assert f"inet {h.address}/24" in r.stdout, (h.name, r.stdout)
        assert r.stdout.strip().endswith(h.docker_host), r.stdout
        assert (h.nvme_dir.is_dir(), h.model_cache.is_dir()) == (True, True)


def test_hosts_reach_each_other(cluster):
    a, b = cluster.hosts[0], cluster.hosts[1]
    r = cluster.ssh_target(a).run(["timeout", "5", "bash", "-c", f"echo > /dev/tcp/{b.address}/{b.ssh_port}"],
                                  timeout=20)
    assert r.rc == 0, r


def test_image_loaded_on_one_host_only(cluster):
    ensure_base_images(debian=False)
    one, other = cluster.hosts[0], cluster.hosts[1]
    cluster.load_image(one, BUSYBOX_IMAGE)
    assert cluster.ssh_target(one).run(["docker", "image", "inspect", BUSYBOX_IMAGE], timeout=30).rc == 0
    r = cluster.ssh_target(other).run(["docker", "image", "inspect", BUSYBOX_IMAGE], timeout=30)
    assert r.rc != 0 and "No such image" in r.stderr, r
    # a host-network container runs "on" that host: it sees the host's address
    r = cluster.ssh_target(one).run(["docker", "run", "--rm", "--network", "host", BUSYBOX_IMAGE,
                                     "ip", "-4", "-o", "addr", "show", "eth0"], timeout=60)
    assert r.rc == 0 and f"inet {one.address}/24" in r.stdout, r


def test_streamed_docker_load_over_ssh(cluster):
    ensure_base_images(debian=False)
    h = cluster.hosts[2]
    save = subprocess.Popen(["docker", "save", BUSYBOX_IMAGE], stdout=subprocess.PIPE)
    with cluster.ssh_target(h).connect() as s:
        with s.open_exec(["docker", "load"]) as ex:
            sent = ex.copy_from(save.stdout)
            r = ex.finish(timeout=120)
        assert save.wait() == 0
        assert r.rc == 0 and f"Loaded image: {BUSYBOX_IMAGE}" in r.stdout, r
        assert sent > 1_000_000
        assert s.run(["docker", "image", "inspect", BUSYBOX_IMAGE]).rc == 0


def test_argv_is_quoted(cluster):
    r = cluster.ssh_target(cluster.hosts[0]).run(["echo", "a b; rm -rf /nonexistent", "$HOME", "it's"])
    assert r.stdout == "a b; rm -rf /nonexistent $HOME it's\n"


def test_sftp_roundtrip(cluster, tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(1 << 20))
    h = cluster.hosts[0]
    with cluster.ssh_target(h).connect() as s:
        s.put_file(src, f"{h.nvme_dir}/a.bin", mode=0o600)
        s.get_file(f"{h.nvme_dir}/a.bin", tmp_path / "b.bin")
    assert (tmp_path / "b.bin").read_bytes() == src.read_bytes()


def test_unknown_host_key_is_refused(cluster, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    h = cluster.hosts[1]
    with pytest.raises(HostKeyError) as e:
        cluster.ssh_target(h, known_hosts=empty).run(["true"])
    msg = str(e.value)
    assert h.name in msg and h.address in msg and "ssh-keyscan" in msg and "host_key_checking" in msg


def test_link_down_fails_fast_naming_the_host(cluster):
    h = cluster.hosts[2]
    cluster.link_down(h)
    try:
        t0 = time.monotonic()
        with pytest.raises(SSHTimeout) as e:
            cluster.ssh_target(h, connect_timeout=3).run(["true"], timeout=5)
        assert time.monotonic() - t0 < 8
        assert h.name in str(e.value)
    finally:
        cluster.link_up(h)
    assert cluster.ssh_target(h).run(["true"], timeout=20).rc == 0


def test_sshd_stopped_then_started(cluster):
    h = cluster.hosts[3]
    cluster.stop_sshd(h)
    try:
        with pytest.raises(SSHError) as e:
            cluster.ssh_target(h, connect_timeout=3).run(["true"])
        assert h.name in str(e.value)
    finally:
        cluster.start_sshd(h)
    assert cluster.ssh_target(h).run(["true"], timeout=20).rc == 0


def test_small_fs_gives_enospc(cluster):
    h = cluster.hosts[1]
    p = cluster.small_fs(h, "nvme", 2)
    try:
        r = cluster.ssh_target(h).run(["dd", "if=/dev/zero", f"of={p}/fill", "bs=1M", "count=4"], timeout=30)
        assert r.rc != 0 and "No space left on device" in r.stderr, r
    finally:
        cluster.unmount_small_fs(h, "nvme")


def test_generated_inventory_loads_and_matches_renderer(cluster):
    from orchestrator.inventory import load_inventory
    text = cluster.inventory_path.read_text()
    assert text == render_inventory(cluster.name, cluster.hosts, cluster.deployment)
    inv = load_inventory(cluster.inventory_path)
    assert [h.address for h in inv.hosts] == [h.address for h in cluster.hosts]
    assert inv.known_hosts_file == str(cluster.known_hosts) and inv.host_key_checking is True


def test_ansible_reaches_every_host(cluster):
    """The inventory works for Ansible itself: ssh with host key checking on, the python it names."""
    env = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_NOCOLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "ansible.cli.adhoc", "all", "-i", str(cluster.inventory_path),
                        "-m", "ping", "-o"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(cluster.hosts), r.stdout


@pytest.mark.parametrize("file, name, n", [("local4.yml", "local", 4), ("local1.yml", "local1", 1)])
def test_checked_in_inventory_is_what_up_generates(file, name, n):
    checked_in = yaml.safe_load((REPO / "inventories" / file).read_text())
    hosts = plan_hosts(name, n)
    generated = yaml.safe_load(render_inventory(name, hosts, hub=demo_hub_url(hosts)))
    assert checked_in == generated, (f"inventories/{file} differs from what "
                                     f"`python -m tests.cluster demo --hosts {n} --name {name}` writes; regenerate it")


def test_a_synthetic_checkpoint_that_cannot_fit_is_refused_before_a_byte_is_written(tmp_path):
    from tests import synth
    huge = [synth.TensorPlan("model.engram.0.weight", "BF16", 1 << 40, 1 << 10)]     # 1 PiB
    folder = tmp_path / "ckpt" / "deep"
    with pytest.raises(synth.SpaceError) as e:
        synth.write_checkpoint(folder, huge)
    assert "1125899.9 GB does not fit in" in str(e.value) and str(folder) in str(e.value)
    assert not (tmp_path / "ckpt").exists()                     # nothing made
    small = [synth.TensorPlan("model.embed_tokens.weight", "BF16", 16, 512)]
    assert synth.checkpoint_bytes(small) == 8192
    synth.write_checkpoint(folder, small)
    assert (folder / "model.safetensors.index.json").exists()
