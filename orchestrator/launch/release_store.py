"""The side effects of releases (orchestrator/releases.py decides): the history file on the head, what
runs on every host now, and the pin tags that keep the last releases' images on every node.

The history lives on the head (`<nvme_dir>/.deployctl/releases/<deployment>.json`), not in the
controller's runs/: any checkout or controller sees the same releases. It is written while the
deployment's lock is held (the commands that record run under it), atomically (a temp file, then
mv), with the JSON on stdin and the path as an argument: no value ever becomes shell text.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import releases as rel
from ..errors import StageFailed
from ..executors.host_batch import run_batch
from ..executors.shells import HostShell, Shells
from ..executors.ssh import SSHError
from ..outcomes import HostFailure, parallel
from ..secrets import mask_override
from . import probe

if TYPE_CHECKING:
    from ..deployment import Deployment

TIMEOUT_S = 30.0
# $1: the history file. umask 022: readable by every controller's login; mv -f: atomic on one filesystem.
WRITE_SH = 'umask 022; mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv -f "$1.tmp" "$1"'
# $1: the history file; exit 4 when absent (an empty history), else its content.
READ_SH = 'if [ -e "$1" ]; then cat "$1"; else exit 4; fi'


def path_of(dep: "Deployment") -> str:
    return rel.history_path(dep.cluster.head_host.nvme_dir, dep.name)


def read_history(dep: "Deployment", sh: HostShell) -> list[rel.Release]:
    """The deployment's releases, oldest first, read from the head (SH: the head's shell)."""
    path = path_of(dep)
    try:
        r = sh.run(["sh", "-c", READ_SH, "sh", path], timeout=TIMEOUT_S)
    except SSHError as e:
        raise StageFailed(f"cannot read the release history {path} on the head {sh.host.name}: {e}") from None
    if r.rc == 4:
        return []
    if r.rc != 0:
        raise StageFailed(f"cannot read the release history {path} on the head {sh.host.name} "
                          f"(exit {r.rc}): {r.stderr.strip()[-300:]}")
    try:
        return rel.parse(json.loads(r.stdout))
    except (ValueError, KeyError, TypeError) as e:
        raise StageFailed(f"the release history {path} on the head {sh.host.name} is unreadable: {e}") from None


def write_history(dep: "Deployment", sh: HostShell, history: list[rel.Release]) -> None:
    path = path_of(dep)
    text = json.dumps(rel.dump(dep.name, history), indent=2) + "\n"
    r = sh.run(["sh", "-c", WRITE_SH, "sh", path], timeout=TIMEOUT_S, stdin=text)
    if r.rc != 0:
        raise StageFailed(f"cannot write the release history {path} on the head {sh.host.name} "
                          f"(exit {r.rc}): {r.stderr.strip()[-300:]}")


@dataclass(frozen=True)
class Running:
    """What one host runs now (from its one running container of the deployment)."""
    image_id: str
    spec: str
    tables: dict[str, str]


def read_running(dep: "Deployment", shells: Shells) -> dict[str, Running]:
    """Every host's running container: raises HostFailure naming the host that has not exactly one."""
    def one(name: str) -> Running:
        read = probe.read_host(dep, shells[name], timeout=TIMEOUT_S * 2)
        up = [c for c in read.containers if c.running]
        if len(up) != 1 or len(read.containers) != 1:
            raise HostFailure(f"{name}: {len(up)} running of {len(read.containers)} container(s) of {dep.name}")
        return Running(up[0].image_id, up[0].spec, probe.table_digests(read.staged))
    names = [h.name for h in dep.cluster.hosts]
    res = parallel(names, one)
    if res.failed:
        raise HostFailure("; ".join(str(e) for e in res.failed.values()))
    return dict(res.ok)


def matches(release: rel.Release | None, running: dict[str, Running]) -> bool:
    """Whether every host runs RELEASE (its image ID there and that host's spec)."""
    return (release is not None and all(r.image_id == release.image_on(h) for h, r in running.items())
            and {h: r.spec for h, r in running.items()} == release.specs)


def same_image(dep: "Deployment", shells: Shells, ids: dict[str, str], cache_root: str) -> bool:
    """Whether the hosts' image IDs name one image: compared by config digest, the identity every
    image store keeps (a graph-driver store's ID; read from the manifest on a containerd store)."""
    from ..ship.stores import INFO_FORMAT, facts_from_line
    from ..ship.transfer import ShipError, manifest_of

    def config(host: str) -> str:
        sh, h = shells[host], dep.cluster.host(host)
        (r,) = run_batch(sh, [sh.docker("info", "--format", INFO_FORMAT)], TIMEOUT_S)
        if r.rc != 0 or not facts_from_line(r.stdout).containerd_store:
            return ids[host]
        return manifest_of(sh, h.docker_host, ids[host], "", cache_root).config
    try:
        res = parallel(sorted(ids), config)
    except ShipError:
        return False
    return not res.failed and len(set(res.ok.values())) == 1


def record(dep: "Deployment", shells: Shells, *, command: str, run_dir: str, recipe_ref: str | None,
           overrides: tuple[str, ...], rollback_of: int | None = None, checkpoint: dict[str, str] | None = None
           ) -> tuple[rel.Release | None, rel.Release | None, list[str]]:
    """After a healthy run: a new release when the image or a spec changed (else None), then the pins.
    CHECKPOINT: what the run served (releases.checkpoint_of).
    Secret-named overrides are recorded masked: the history is readable by every controller's login.
    Returns (the new release or None, the current release, notes about pins not set or not removed)."""
    head = shells[dep.cluster.head]
    running = read_running(dep, shells)
    by_host = {h: r.image_id for h, r in running.items()}
    image_id = by_host[dep.cluster.head]
    image_ids: dict[str, str] = {}
    if len(set(by_host.values())) != 1:
        # one image has other IDs in other image stores (docs/docker-engines.md): the same config?
        if not same_image(dep, shells, by_host, str(Path(run_dir).parent)):
            raise HostFailure("the hosts run different images: " + ", ".join(
                f"{h} {rel.short_id(i)}" for h, i in sorted(by_host.items())))
        image_ids = by_host
    specs = {h: r.spec for h, r in running.items()}
    history = read_history(dep, head)
    new = None
    if rel.is_new(history, image_id, specs, image_ids):
        new = rel.Release(number=rel.next_number(history), time=time.time(), image_id=image_id, image_ids=image_ids,
                          image=dep.recipe.engine.image, recipe=dep.recipe.name, recipe_ref=recipe_ref,
                          overrides=tuple(mask_override(o) for o in overrides), specs=specs,
                          tables={h: r.tables for h, r in running.items() if r.tables},
                          run_dir=run_dir, command=command, rollback_of=rollback_of,
                          checkpoint=rel.with_manifest(checkpoint or {}, history) if checkpoint else {})
        history = [*history, new]
        write_history(dep, head, history)
    return new, rel.current(history), pin(dep, shells, history)


PIN_LABEL = "deployctl.pin"     # the holder containers' label (never deployctl.deployment: launch and down ignore them)


def pin(dep: "Deployment", shells: Shells, history: list[rel.Release]) -> list[str]:
    """On every host: the last `releases.keep` releases' images tagged with their pin tags and held by
    a created, never started container (so no prune removes them); older pins and holders removed
    (the image goes only if nothing else holds it). Returns what could not be done, per host."""
    keep = rel.kept(history, dep.recipe.releases.keep)
    drop = rel.released(history, dep.recipe.releases.keep)

    def one(name: str) -> list[str]:
        sh, notes = shells[name], []
        for r in keep:
            why = _pin_one(sh, dep.name, r, r.image_on(name))
            if why:
                notes.append(f"{name}: release {r.number} not pinned ({why})")
        for r in drop:
            why = _unpin_one(sh, dep.name, r)
            if why:
                notes.append(f"{name}: release {r.number}'s pin not removed ({why})")
        return notes
    res = parallel([h.name for h in dep.cluster.hosts], one)
    return [n for notes in res.ok.values() for n in notes] + [f"{n}: pins not updated ({e})"
                                                              for n, e in res.failed.items()]


def _pin_one(sh: HostShell, deployment: str, r: rel.Release, image_id: str) -> str:
    tag, holder = rel.pin_tag(deployment, r.number), rel.holder_name(deployment, r.number)
    # the usual case (pinned before) in one round trip (executors/host_batch.py)
    res, held = run_batch(sh, [sh.docker("tag", image_id, tag),
                               sh.docker("container", "inspect", "--format", "{{.Image}}", holder)], TIMEOUT_S)
    if res.rc != 0:
        return res.stderr.strip()[-200:]
    res = held
    if res.rc == 0 and res.stdout.strip() == image_id:
        return ""
    if res.rc == 0:          # a holder of another image under this name: not ours to keep
        sh.run(sh.docker("rm", "-f", holder), timeout=TIMEOUT_S)
    res = sh.run(sh.docker("create", "--name", holder, "--label", f"{PIN_LABEL}={deployment}", "--network", "none",
                           "--entrypoint", "", tag, "true"), timeout=TIMEOUT_S)
    return "" if res.rc == 0 else f"holder container: {res.stderr.strip()[-200:]}"


def _unpin_one(sh: HostShell, deployment: str, r: rel.Release) -> str:
    tag, holder = rel.pin_tag(deployment, r.number), rel.holder_name(deployment, r.number)
    sh.run(sh.docker("rm", "-f", holder), timeout=TIMEOUT_S)       # absent: nothing to do
    res = sh.run(sh.docker("image", "ls", "-q", tag), timeout=TIMEOUT_S)
    if res.rc == 0 and res.stdout.strip():
        res = sh.run(sh.docker("rmi", tag), timeout=TIMEOUT_S)
        if res.rc != 0:
            return res.stderr.strip()[-200:]
    return ""


def image_present(sh: HostShell, ref: str) -> bool:
    r = sh.run(sh.docker("image", "inspect", "--format", "{{.Id}}", ref), timeout=TIMEOUT_S)
    return r.rc == 0
