"""The router's side effects on its host (layout.py says what goes where; docs/router.md why).

image()     the router image on the router host: built there from dockerfiles/chains/router.yml for
            that host's architecture (cached per step, like the serving image) unless the inventory
            names its own; image_plan() is what the plan says of it (and refuses a host the chain
            cannot be built for)
install()   its files and container, replaced only when its config, image, client key or keeper
            changed (an entry in its release record each time); otherwise left running
join()      a deployment's workers file, then wait until the keeper registered it (healthy) with the
            router: `up` ends with the model listed at the endpoint
leave()     the workers file removed and the registration gone; the last deployment out stops the router
read()      container, registry and release record, for `status`
Every remote step has a timeout; the keys go through stdin into 0600 files, never into an argv.
"""
from __future__ import annotations

import base64
import json
import secrets as pysecrets
import time
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from ..apikey import ApiKey, load_key
from ..errors import InputError
from ..hostside import bundle, httpcall
from ..outcomes import HostFailure
from . import layout
from .config import CHAIN, DEFAULT_IMAGE

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..executors.shells import HostShell
    from ..runrecord import RunContext
    from .config import RouterConf

TIMEOUT_S = 60.0
JOIN_WAIT_S = 120.0          # the keeper's rounds until a new deployment is registered (the router
LEAVE_WAIT_S = 30.0          # probes a posted worker before it serves it)
# $1 state dir, $2 zipapp name, $3 config JSON, $4...: the docker run argv. stdin: admin key, client key
# (or an empty line), the zipapp in base64. Files written beside their names, then moved.
INSTALL_SH = ('umask 077 && mkdir -p "$1/workers" && IFS= read -r a && IFS= read -r k && '
              'base64 -d > "$1/$2.tmp" && printf %s "$a" > "$1/admin_key.tmp" && printf %s "$3" > "$1/config.json.tmp" && '
              'if [ -n "$k" ]; then printf %s "$k" > "$1/api_key.tmp" && mv -f "$1/api_key.tmp" "$1/api_key"; '
              'else rm -f "$1/api_key"; fi && mv -f "$1/$2.tmp" "$1/$2" && mv -f "$1/admin_key.tmp" "$1/admin_key" && '
              'mv -f "$1/config.json.tmp" "$1/config.json" && rm -f "$1/registry.json" && '
              'for f in "$1"/deployctl-tables-*.pyz; do [ "$f" = "$1/$2" ] || rm -f "$f"; done && shift 3 && exec "$@"')
WRITE_SH = 'umask 077 && mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv -f "$1.tmp" "$1"'
# $1 state dir: registry.json, releases.json and the workers files' names, one JSON document per line
READ_SH = ('[ -d "$1" ] || exit 4; for f in registry.json releases.json; do '
           'if [ -s "$1/$f" ]; then cat "$1/$f"; else printf null; fi; echo; done; '
           'ls "$1/workers" 2>/dev/null | sed -n "s/\\.json$//p" | tr "\\n" " "; echo')


def client_key(conf: "RouterConf", inventory_file: str) -> ApiKey | None:
    return load_key(conf.api_key_file, conf.api_key_env, inventory_file, "all.vars.router")


def check(dep: "Deployment") -> "RouterConf":
    """The router of DEP's inventory, refusing (exit 2) a keyed deployment behind an open router."""
    conf = dep.cluster.router
    assert conf is not None
    if dep.api_key and not client_key(conf, str(dep.cluster.file)):
        raise InputError(f"deployment {dep.name} requires an API key but the router would admit anyone to it: "
                         "set all.vars.router.api_key_file (or api_key_env), the key clients send to the router",
                         file=str(dep.cluster.file), key="all.vars.router.api_key_file")
    return conf


# ------------------------------------------------------------------------------------ image

def image_plan(conf: "RouterConf") -> dict[str, Any]:
    """What the plan says of the router image (pure: reads the chain and its lock): built from the
    router chain for the router host's architecture, with that architecture's wheel count; an
    InputError (exit 2) when the chain's lock pins nothing for it, naming the host, its architecture
    and why. The inventory's own image (all.vars.router.image) is taken as it is."""
    from ..imagechain.spec import chain_for
    if conf.image != DEFAULT_IMAGE:
        return {"image": conf.image, "built": False}
    chain = chain_for(CHAIN, conf.host, "the router (all.vars.router)")
    w = chain.wheelhouse
    return {"image": conf.image, "built": True, "chain": chain.name, "arch": chain.arch, "platform": chain.platform,
            **({"wheels": len(w.pins), "lock": str(w.lock_file)} if w else {})}


def image(dep: "Deployment", ctx: "RunContext") -> tuple[str, str]:
    """(image id, what happened) for the router image on the router host, built for its architecture."""
    from ..executors import docker_engine as de
    from ..imagechain.builder import ChainBuilder, ChainFailed
    from ..imagechain.spec import chain_for, ready_chain
    conf = dep.cluster.router
    assert conf is not None
    client = de.engine_client(dep.cluster, conf.host)
    try:
        if conf.image != DEFAULT_IMAGE:
            iid = de.image_id(client, conf.image)
            if iid is None:
                raise HostFailure(f"the router image {conf.image} (all.vars.router.image) is not in "
                                  f"{conf.host.name}'s engine: load it there, or drop the key to have deployctl "
                                  f"build {DEFAULT_IMAGE}")
            return iid, f"{conf.image} = {iid[:19]} (the inventory's own)"
        chain, _ = chain_for(CHAIN, conf.host, "the router (all.vars.router)", ready_chain, say=ctx.say)
        where = f"{conf.host.name} ({conf.host.ssh_url}): {de.engine_name(client)}"
        builder = ChainBuilder(client, chain, final_tag=conf.image, where=where,
                               host=conf.host.name,
                               log_for=lambda step: ctx.host_log(conf.host.name, f"router-build-{step}"),
                               say=ctx.say, cancel=ctx.cancel)
        try:
            report = builder.build()
        except ChainFailed as f:
            raise HostFailure(f"router image not built on {conf.host.name}: {f}") from None
        if report.built:
            return report.image_id, (f"{conf.image} built for {report.platform} ({', '.join(report.built)}) "
                                     f"in {report.seconds:.1f}s")
        return report.image_id, f"{conf.image} is up to date ({report.image_id[:19]}, {report.platform})"
    finally:
        client.close()


# ------------------------------------------------------------------------------------ container

def _container(sh: "HostShell") -> tuple[str, str, str] | None:
    """(id, state, install) of the router's container on its host, or None."""
    r = sh.run(sh.docker("ps", "-a", "--filter", f"name=^{layout.CONTAINER}$", "--format",
                         "{{.ID}} {{.State}} {{.Label \"" + layout.INSTALL_LABEL + "\"}}"), timeout=TIMEOUT_S)
    if r.rc != 0:
        raise HostFailure(f"docker ps on {sh.host.name} failed: {(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)
    for line in r.stdout.splitlines():
        parts = (line.split() + ["", "", ""])[:3]
        if parts[0]:
            return parts[0], parts[1], parts[2]
    return None


def install(dep: "Deployment", sh: "HostShell", image_id: str) -> str:
    conf = dep.cluster.router
    assert conf is not None
    key = client_key(conf, str(dep.cluster.file))
    iid = layout.install_id(conf, image_id, key.key_id if key else None)
    found = _container(sh)
    if found and found[1] == "running" and found[2] == iid:
        return f"router {iid} already running ({found[0][:12]}) at {conf.url}"
    if found:
        rm = sh.run(sh.docker("rm", "-f", found[0]), timeout=TIMEOUT_S)
        if rm.rc != 0:             # docker run would fail on the name, and say less
            raise HostFailure(f"the router's old container {found[0][:12]} ({found[2] or 'no install label'}) on "
                              f"{conf.host.name} could not be removed: exit {rm.rc}: "
                              f"{(rm.stderr or rm.stdout).strip()[-300:]}", rc=rm.rc)
    d = layout.state_dir(conf)
    admin = pysecrets.token_urlsafe(32)
    payload = base64.b64encode(bundle.data()).decode()
    r = sh.run(["sh", "-c", INSTALL_SH, "sh", d, bundle.file_name(), json.dumps(layout.config(conf), indent=1),
                *layout.run_argv(conf, iid, dep.cluster.file.stem)], timeout=TIMEOUT_S,
               stdin=f"{admin}\n{key.value if key else ''}\n{payload}\n")
    if r.rc != 0:
        raise HostFailure(f"router not started on {conf.host.name} (its files under {d}, then docker run "
                          f"{layout.CONTAINER}): exit {r.rc}: {(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)
    n = _record_release(sh, conf, {"image": conf.image, "image_id": image_id, "install": iid,
                                   "key_id": key.key_id if key else None,
                                   "replaced": found[2] if found else None})
    return (f"router {iid} started ({r.stdout.strip()[:12]}) at {conf.url}, release {n}"
            + (f", replaced {found[2] or found[0][:12]}" if found else ""))


def _record_release(sh: "HostShell", conf: "RouterConf", entry: dict[str, Any]) -> int:
    path = str(PurePosixPath(layout.state_dir(conf)) / "releases.json")
    r = sh.run(["sh", "-c", 'cat "$1" 2>/dev/null || true', "sh", path], timeout=TIMEOUT_S)
    try:
        history = json.loads(r.stdout) if r.stdout.strip() else []
    except ValueError:
        history = []
    n = (history[-1]["n"] + 1) if history else 1
    history = (history + [{"n": n, "at": time.time(), **entry}])[-20:]
    w = sh.run(["sh", "-c", WRITE_SH, "sh", path], timeout=TIMEOUT_S, stdin=json.dumps(history) + "\n")   # one line: read() reads it as one
    if w.rc != 0:
        raise HostFailure(f"cannot write {path} on {conf.host.name}: {(w.stderr or w.stdout).strip()[-300:]}", rc=w.rc)
    return n


def _wait(sh: "HostShell", timeout_s: float) -> tuple[int, dict[str, Any]]:
    r = sh.run(sh.docker("exec", layout.CONTAINER, "python3", f"/state/{bundle.file_name()}", "router", "wait",
                         "/state/config.json", str(int(timeout_s))), timeout=timeout_s + 30)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    try:
        return r.rc, json.loads(lines[-1]) if lines else {"error": (r.stderr or r.stdout).strip()[-300:]}
    except ValueError:
        return r.rc, {"error": lines[-1][-300:]}


def join(dep: "Deployment", sh: "HostShell") -> str:
    """DEP behind the router: its workers file, then the keeper's registration of it, waited for."""
    conf = dep.cluster.router
    assert conf is not None
    w = layout.worker(dep)
    path = layout.worker_file(conf, dep.name)
    r = sh.run(["sh", "-c", WRITE_SH, "sh", path], timeout=TIMEOUT_S, stdin=json.dumps(w) + "\n")
    if r.rc != 0:
        raise HostFailure(f"cannot write {path} on {conf.host.name}: {(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)
    rc, doc = _wait(sh, JOIN_WAIT_S)
    row = next((x for x in doc.get("deployments") or [] if x.get("deployment") == dep.name), None)
    if rc != 0 or not row or not row.get("registered"):
        why = doc.get("error") or doc.get("router") or (
            "its engine did not answer the router host's /health" if row and not row.get("healthy") else "not registered")
        raise HostFailure(f"the router at {conf.url} did not take {dep.name} (model {w['model']}, {w['url']}) "
                          f"within {JOIN_WAIT_S:g}s: {why}", rc=rc or 1)
    others = [x["deployment"] for x in doc.get("deployments") or [] if x.get("registered") and x["deployment"] != dep.name]
    return (f"model {w['model']} served at {conf.url} (router on {conf.host.name})"
            + (f" beside {', '.join(others)}" if others else ""))


def leave(dep: "Deployment", sh: "HostShell") -> str:
    """DEP out of the router; the router itself stopped and removed when no deployment is left."""
    conf = dep.cluster.router
    assert conf is not None
    path = layout.worker_file(conf, dep.name)
    r = sh.run(["sh", "-c", 'rm -f "$1"; ls "$(dirname "$1")" 2>/dev/null | grep -c "\\.json$" || true', "sh", path],
               timeout=TIMEOUT_S)
    left = int((r.stdout.strip().splitlines() or ["0"])[-1] or 0)
    found = _container(sh)
    if not found:
        return f"no router on {conf.host.name}"
    if left == 0:
        stop = sh.run(sh.docker("rm", "-f", found[0]), timeout=TIMEOUT_S)
        if stop.rc != 0:
            raise HostFailure(f"the router's container {found[0][:12]} on {conf.host.name} was not removed: "
                              f"{(stop.stderr or stop.stdout).strip()[-300:]}", rc=stop.rc)
        return f"{dep.name} was the last deployment behind the router: router stopped and removed on {conf.host.name}"
    if found[1] == "running":
        rc, doc = _wait(sh, LEAVE_WAIT_S)
        if rc != 0:
            raise HostFailure(f"the router at {conf.url} still routes to {dep.name} after {LEAVE_WAIT_S:g}s: "
                              f"{doc.get('error') or doc.get('router') or 'not removed'}", rc=rc)
    return f"{dep.name} removed from the router at {conf.url} ({left} deployment(s) still behind it)"


def step_out(dep: "Deployment", sh: "HostShell") -> str:
    """Replica DEP out of the router before its engine is replaced (orchestrator/rolling.py), when another
    worker of its model is registered and healthy there (the model keeps serving); the keeper's round that
    removed it waited for. Its route stage puts it back. What happened ("out of the router ..." when out)."""
    conf = dep.cluster.router
    assert conf is not None
    model = layout.worker(dep)["model"]
    r = sh.run(["sh", "-c", 'cat "$1/registry.json" 2>/dev/null || true', "sh", layout.state_dir(conf)], timeout=TIMEOUT_S)
    try:
        rows = (json.loads(r.stdout) if r.stdout.strip() else {}).get("deployments") or []
    except ValueError:
        rows = []
    others = [x["deployment"] for x in rows if x.get("model") == model and x.get("deployment") != dep.name
              and x.get("registered") and x.get("healthy")]
    if not any(x.get("deployment") == dep.name and x.get("registered") for x in rows):
        return "not routed (nothing to take out of the router)"
    if not others:
        return (f"stays in the router: no other replica of {model} is registered there (the model does not serve "
                f"while this one is replaced)")
    path = layout.worker_file(conf, dep.name)
    rm = sh.run(["rm", "-f", path], timeout=TIMEOUT_S)
    if rm.rc != 0:
        raise HostFailure(f"cannot remove {path} on {conf.host.name}: {(rm.stderr or rm.stdout).strip()[-300:]}", rc=rm.rc)
    rc, doc = _wait(sh, LEAVE_WAIT_S)
    if rc != 0:
        raise HostFailure(f"the router at {conf.url} still routes to {dep.name} after {LEAVE_WAIT_S:g}s: "
                          f"{doc.get('error') or doc.get('router') or 'not removed'}", rc=rc)
    return f"out of the router at {conf.url} ({model} served by {', '.join(others)} meanwhile)"


def verify(dep: "Deployment", sh: "HostShell") -> str:
    """`health`: the router runs, answers /health, lists DEP's model, and its keeper routes DEP (read-only)."""
    conf = dep.cluster.router
    assert conf is not None
    model = layout.worker(dep)["model"]
    key = client_key(conf, str(dep.cluster.file))
    doc = read(conf, sh, key.value if key else None)
    c, h = doc["container"], doc["health"]
    if not c or c["state"] != "running":
        raise HostFailure(f"the router's container {layout.CONTAINER} on {conf.host.name} is "
                          f"{c['state'] if c else 'not there'}: `deployctl up -d {dep.name}` starts it")
    if not h.get("healthy"):
        raise HostFailure(f"the router at {conf.url} does not answer /health ({h.get('/health')})")
    if model not in (h.get("models") or []):
        row = next((x for x in (doc.get("registry") or {}).get("deployments") or [] if x.get("deployment") == dep.name),
                   None)
        why = ("no workers file: `deployctl up` puts it behind the router" if row is None else
               "its engine does not answer the router host's /health" if not row.get("healthy") else "being registered")
        raise HostFailure(f"the router at {conf.url} does not list {model} (it lists "
                          f"{', '.join(h.get('models') or []) or 'nothing'}): {why}")
    return f"router at {conf.url} healthy, routes model {model} (release {(doc.get('release') or {}).get('n', '-')})"


def read(conf: "RouterConf", sh: "HostShell", key: str | None = None) -> dict[str, Any]:
    """The router's container, registry (the keeper's last round) and last release, for status; KEY:
    the clients' key (its /v1/models needs it)."""
    found = _container(sh)
    r = sh.run(["sh", "-c", READ_SH, "sh", layout.state_dir(conf)], timeout=TIMEOUT_S)
    registry, releases, workers = None, None, []
    if r.rc == 0:
        lines = r.stdout.splitlines() + ["null", "null", ""]
        registry, releases = json.loads(lines[0]), json.loads(lines[1])
        workers = lines[2].split()
    return {"host": conf.host.name, "url": conf.url,
            "container": {"id": found[0][:12], "state": found[1], "install": found[2]} if found else None,
            "registry": registry, "release": (releases or [None])[-1], "deployments": workers,
            "health": probe(conf.url, key)}


def probe(url: str, key: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """The router's /health (open) and /v1/models with the clients' KEY (with a key, every /v1/ path
    needs it: hostside/router_front.py checks it where sglang-router 0.3.2 does not)."""
    out: dict[str, Any] = {}
    for path in ("/health", "/v1/models"):
        try:
            out[path], body = httpcall.call(url + path, key if path != "/health" else None, timeout=timeout)
            if path == "/v1/models" and out[path] == 200:
                out["models"] = [m.get("id") for m in json.loads(body).get("data") or []]
        except (OSError, ValueError) as e:
            out[path] = f"no answer ({type(e).__name__})"
    out["healthy"] = out.get("/health") == 200
    return out
