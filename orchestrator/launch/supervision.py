"""The supervisor's side effects on the hosts: install (the `supervise` stage of `up`), remove (`down`),
read its state and incidents (`status`, `incidents`). What it does on the cluster is
orchestrator/hostside/supervisor.py; docs/supervisor.md says why it is built this way.

Per host one container `deployctl-<deployment>-supervisor` from the serving image (already on
every host: ship put it there), labelled `deployctl.supervisor=<deployment>` (not the engines' label:
launch, status and down count engines by theirs), `--restart unless-stopped`, host network, with:
  <nvme_dir>/.deployctl/supervisor/<deployment>/  -> /state (config.json, the host-side zipapp,
      token 0600; on the head api_key 0600, state.json, incidents/, fabric.json: the last passing
      fabric check, rewritten by every `up`, which its /metrics exports)
  the host's Docker socket                       -> /run/deployctl/docker.sock
  the head's /var/lock (the deployment's lock)    -> /run/deployctl/lock
  the head's release history folder              -> /run/deployctl/releases (read-only unless
      supervise.rollback: a rollback after giving up records its release there, under the lock)
An install is identified by a digest of every host's config and the zipapp: an `up` that finds every
agent running with this digest changes nothing; otherwise every agent is replaced together, with a
new per-install token (the workers' only credential, good for this install only).
"""
from __future__ import annotations

import base64
import hashlib
import json
import secrets as pysecrets
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from .. import releases as rel
from ..executors.docker_cli import docker_argv
from ..hostside import bundle
from ..outcomes import HostFailure, parallel
from ..paths import LOCK_DIR, lock_path
from .containerspec import start_sequence, start_step
from .diagnosis import ORIGIN

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..executors.shells import HostShell, Shells
    from ..inventory import Host

LABEL = "deployctl.supervisor"
INSTALL_LABEL = "deployctl.supervisor.install"
MOUNT = "/run/deployctl"
GIB_KIB = 1024 * 1024
TIMEOUT_S = 60.0
# One round trip per host. $1 dir, $2 the zipapp's name (its digest in it), $3 config JSON, $4...: the
# `docker run` argv (printed: the container ID). stdin: the token, a newline, the serving API key (head)
# or nothing, a newline, then the zipapp in base64 (read(1) takes its lines byte by byte: base64 gets
# the rest). Files are written beside their names and moved; older zipapps removed.
INSTALL_SH = ('umask 077 && mkdir -p "$1" && IFS= read -r t && IFS= read -r k && '
              'base64 -d > "$1/$2.tmp" && printf %s "$t" > "$1/token.tmp" && printf %s "$3" > "$1/config.json.tmp" && '
              'if [ -n "$k" ]; then printf %s "$k" > "$1/api_key.tmp" && mv -f "$1/api_key.tmp" "$1/api_key"; '
              'else rm -f "$1/api_key"; fi && mv -f "$1/$2.tmp" "$1/$2" && mv -f "$1/token.tmp" "$1/token" && '
              'mv -f "$1/config.json.tmp" "$1/config.json" && '
              'for f in "$1"/deployctl-tables-*.pyz; do [ "$f" = "$1/$2" ] || rm -f "$f"; done && shift 3 && exec "$@"')
FABRIC_FILE = "fabric.json"
WRITE_SH = 'umask 022; mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv -f "$1.tmp" "$1"'
# $1 the state dir: state.json, then each incident (newest last), one JSON document per line
READ_SH = ('[ -d "$1" ] || exit 4; python3 -c \'import json,os,sys; d=sys.argv[1]\n'
           'def rd(p):\n try: return json.load(open(p))\n except (OSError, ValueError): return None\n'
           'i=os.path.join(d,"incidents"); names=sorted(os.listdir(i)) if os.path.isdir(i) else []\n'
           'print(json.dumps({"state": rd(os.path.join(d,"state.json")), '
           '"incidents": [x for x in (rd(os.path.join(i,n)) for n in names if n.endswith(".json")) if x]}))\' "$1"')


def enabled(dep: "Deployment") -> bool:
    return dep.supervisor_port is not None


def container_name(dep: "Deployment") -> str:
    return f"deployctl-{dep.name}-supervisor"


def state_dir(dep: "Deployment", host: "Host") -> str:
    return str(PurePosixPath(host.nvme_dir) / ".deployctl" / "supervisor" / rel._slug(dep.name))


def head_port(dep: "Deployment") -> int | None:
    """The port the head's supervisor listens on (its /metrics; the workers' reports when there are
    workers), on the head's management address; None: not supervised."""
    return dep.supervisor_port


def configs(dep: "Deployment") -> dict[str, dict[str, Any]]:
    """Every host's config.json (pure: no secret in it; `install` is their common digest)."""
    c, r = dep.cluster, dep.recipe
    s, e = r.supervise, r.engine
    head = c.head_host
    workers = [h.name for h in c.workers]
    seq = [list(g) for g in start_sequence(dep)]     # up's order: workers together, then the head
    common = {"deployment": dep.name, "stop_timeout_s": s.stop_timeout_s, "socket": f"{MOUNT}/docker.sock",
              "silent_s": s.silent_s}
    origin = [p.pattern for p in ORIGIN]      # the lines by which a rank says its own process died
    head_cfg = {**common, "role": "head", "host": head.name, "workers": workers,
                "ranks": {h.name: h.rank for h in c.hosts},
                "listen": head.address, "port": s.port,
                "api": {"url": dep.api_url, "served_name": e.served_name, "health_timeout_s": 10.0,
                        "poll_s": 0.25, "key_id": dep.api_key.key_id if dep.api_key else None},
                "wedge": {"interval_s": s.wedge_interval_s, "timeout_s": s.wedge_timeout_s,
                          "max_tokens": s.wedge_max_tokens, "prompt": r.health.prompt},
                "interval_s": s.interval_s, "health_failures": s.health_failures,
                "mem_floor_kib": int(s.mem_floor_gib * GIB_KIB), "mem_sustain_s": s.mem_sustain_s,
                "gate_kib": int(e.min_mem_available_gib * GIB_KIB),
                "max_restarts": s.max_restarts, "window_s": s.window_s, "backoff_s": s.backoff_s,
                "backoff_max_s": s.backoff_max_s, "keep_incidents": s.keep_incidents,
                "startup_timeout_s": r.health.startup_timeout_s, "order": seq,
                "wait_before_head_s": start_step(dep, head.name)["wait_before_s"],
                "origin": origin, "lock_file": f"{MOUNT}/lock/{PurePosixPath(lock_path(dep.name)).name}",
                "release_history": f"{MOUNT}/releases/{rel._slug(dep.name)}.json", "rollback": s.rollback,
                "page": page_config(dep)}      # the status page it serves (docs/status-page.md)
    out = {head.name: head_cfg}
    for h in c.workers:
        out[h.name] = {**common, "role": "worker", "host": h.name, "head_url": f"http://{_url_host(head.address)}:{s.port}"}
    digest = hashlib.sha256(json.dumps(out, sort_keys=True).encode() + bundle.digest().encode()).hexdigest()[:12]
    for cfg in out.values():
        cfg["install"] = digest
    return out


def page_config(dep: "Deployment") -> dict[str, Any] | None:
    """The status page the head's supervisor serves (hostside/status_page.py; launch/status_page.py pushes
    its facts): where the API listens, on supervise.page_port; None: no page. Pure; no secret."""
    port = dep.recipe.supervise.page_at if enabled(dep) else None
    if port is None:
        return None
    host = dep.cluster.head_host.address if dep.api_listens_everywhere else dep.api_listen
    return {"listen": dep.api_listen, "port": port, "url": f"http://{_url_host(host)}:{port}/", "key": bool(dep.api_key)}


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def run_argv(dep: "Deployment", h: "Host", install: str) -> list[str]:
    head = h.name == dep.cluster.head
    sock = h.docker_host[len("unix://"):] if h.docker_host.startswith("unix://") else "/var/run/docker.sock"
    d = state_dir(dep, h)
    mounts = ["-v", f"{d}:/state", "-v", f"{sock}:{MOUNT}/docker.sock"]
    if head:
        hist = str(PurePosixPath(rel.history_path(h.nvme_dir, dep.name)).parent)
        ro = "" if dep.recipe.supervise.rollback else ":ro"
        mounts += ["-v", f"{LOCK_DIR}:{MOUNT}/lock", "-v", f"{hist}:{MOUNT}/releases{ro}"]
    return docker_argv(h, "run", "-d", "--name", container_name(dep), "--label", f"{LABEL}={dep.name}",
                     "--label", f"{INSTALL_LABEL}={install}", "--restart", "unless-stopped",
                     "--network", "host", "--log-opt", "max-size=10m", "--log-opt", "max-file=2",
                     *mounts, "--entrypoint", "python3", dep.recipe.engine.image,
                     f"/state/{bundle.file_name()}", "supervise", "/state/config.json")


def list_argv(sh: "HostShell", dep: "Deployment") -> list[str]:
    return sh.docker("ps", "-a", "--filter", f"label={LABEL}={dep.name}",
                     "--format", "{{.ID}} {{.State}} {{.Label \"" + INSTALL_LABEL + "\"}}")


def agents(sh: "HostShell", dep: "Deployment") -> list[tuple[str, str, str]]:
    """(id, state, install) of the deployment's agent containers on the host."""
    r = sh.run(list_argv(sh, dep), timeout=TIMEOUT_S)
    if r.rc != 0:
        raise HostFailure(f"docker ps on {sh.host.name} failed: {(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)
    return [tuple((line.split() + ["", "", ""])[:3]) for line in r.stdout.splitlines() if line.strip()]  # type: ignore[misc]


def remove(sh: "HostShell", dep: "Deployment") -> list[str]:
    """Remove the deployment's agent containers on the host (verified); returns the removed IDs."""
    ids = [a[0] for a in agents(sh, dep)]
    if ids:
        r = sh.run(sh.docker("rm", "-f", *ids), timeout=TIMEOUT_S)
        if r.rc != 0:
            raise HostFailure(f"docker rm -f {' '.join(ids)} failed: {(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)
        left = agents(sh, dep)
        if left:
            raise HostFailure(f"the supervisor's container {left[0][0]} is still there after docker rm -f")
    return ids


def install(dep: "Deployment", shells: "Shells") -> dict[str, str]:
    """Every host's agent (idempotent: the same install running everywhere is kept). {host: message}."""
    cfgs = configs(dep)
    install_id = next(iter(cfgs.values()))["install"]
    names = list(cfgs)
    found = parallel(names, lambda n: agents(shells[n], dep))
    if found.failed:
        raise HostFailure("; ".join(f"{n}: {e}" for n, e in found.failed.items()))
    if all(len(a) == 1 and a[0][1] == "running" and a[0][2] == install_id for a in found.ok.values()):
        return {n: f"supervisor {install_id} already running ({found.ok[n][0][0][:12]})" for n in names}
    token = pysecrets.token_urlsafe(32)
    payload = base64.b64encode(bundle.data()).decode()
    key = dep.api_key.value if dep.api_key else ""

    def one(n: str) -> str:
        sh = shells[n]
        gone = [a[0] for a in found.ok[n]]
        if gone:      # a container left under the name would make docker run fail, naming it
            sh.run(sh.docker("rm", "-f", *gone), timeout=TIMEOUT_S)
        d = state_dir(dep, sh.host)
        r = sh.run(["sh", "-c", INSTALL_SH, "sh", d, bundle.file_name(), json.dumps(cfgs[n], indent=1),
                    *run_argv(dep, sh.host, install_id)], timeout=TIMEOUT_S,
                   stdin=f"{token}\n{key if n == dep.cluster.head else ''}\n{payload}\n")
        if r.rc != 0:
            raise HostFailure(f"supervisor not started on {n} (its files under {d}, then docker run "
                              f"{container_name(dep)}): exit {r.rc}: {(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)
        role = "supervisor" if n == dep.cluster.head else "agent"
        return (f"{role} {install_id} started ({r.stdout.strip()[:12]}, --restart unless-stopped)"
                + (f", replaced {', '.join(i[:12] for i in gone)}" if gone else ""))
    # all at once: the head's supervisor waits for every worker's first report before it judges
    done = parallel(names, one)
    if done.failed:
        raise HostFailure("; ".join(f"{n}: {e}" for n, e in done.failed.items()))
    return done.ok


def fabric_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """What the head's supervisor exports of the controller's last passing fabric check (fabric/cache.py
    `last`): when, and what each link carried (iperf3, a -> b). Pure."""
    links = []
    for lk in (doc.get("report") or {}).get("links") or []:
        gbps = (lk.get("throughput") or {}).get("gbps")
        if isinstance(gbps, (int, float)) and lk.get("a") and lk.get("b"):
            links.append({"link": f"{lk['a']}-{lk['b']}", "src": lk["a"], "dst": lk["b"], "gbps": gbps})
    at = doc.get("at")
    return {"at": at if isinstance(at, (int, float)) else None, "links": links}


def write_fabric(dep: "Deployment", sh: "HostShell", summary: dict[str, Any]) -> None:
    """SUMMARY as fabric.json in the head's state folder (atomic; no secret in it)."""
    path = str(PurePosixPath(state_dir(dep, sh.host)) / FABRIC_FILE)
    r = sh.run(["sh", "-c", WRITE_SH, "sh", path], timeout=TIMEOUT_S, stdin=json.dumps(summary) + "\n")
    if r.rc != 0:
        raise HostFailure(f"cannot write {path} on {sh.host.name}: exit {r.rc}: "
                          f"{(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)


def read(dep: "Deployment", sh: "HostShell") -> dict[str, Any] | None:
    """The head's state.json and incidents (oldest first); None when no supervisor was ever installed."""
    r = sh.run(["sh", "-c", READ_SH, "sh", state_dir(dep, sh.host)], timeout=TIMEOUT_S)
    if r.rc == 4:
        return None
    if r.rc != 0:
        raise HostFailure(f"cannot read the supervisor's records on {sh.host.name}: "
                          f"{(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)
    return json.loads(r.stdout.strip().splitlines()[-1])
