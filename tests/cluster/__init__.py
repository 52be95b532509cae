"""A real multi-host test cluster on this machine: network namespaces, each with an sshd and a dockerd.

    python -m tests.cluster up --hosts 4 [--name local] [--arch aarch64]
    python -m tests.cluster status
    python -m tests.cluster down [--name local]

From Python / pytest: `TestCluster.up(name, n_hosts)`, `.down()`, `.hosts`, `.inventory_path`,
`.known_hosts`, `.client_key`, fault helpers (`link_down`, `stop_sshd`, `small_fs`, ...).
`TestCluster.up(name, n_hosts, arch="aarch64")`: arm64 hosts under qemu-user (tests/cluster/arm64.py),
`.load_base_images(host)` the base images of that host's architecture under the canonical names.
"""
from .cluster import (ClusterError, TestCluster, TestHost, cleanup, cluster_lock, list_clusters, plan_hosts,
                      render_inventory, state_dir, subnet_index)
from .images import BUSYBOX_IMAGE, DEBIAN_IMAGE, base_image_names, copy_image, ensure_base_images, image_present

__all__ = ["BUSYBOX_IMAGE", "DEBIAN_IMAGE", "ClusterError", "TestCluster", "TestHost", "base_image_names", "cleanup",
           "cluster_lock", "copy_image", "ensure_base_images", "image_present", "list_clusters", "plan_hosts",
           "render_inventory", "state_dir", "subnet_index"]
