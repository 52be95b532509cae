"""source: shared — every node must see the head's checkpoint on the same shared filesystem (NFS ...).

Nothing is copied. The head lists and hashes its copy (manifest, cached) and writes a marker file
with a fresh random nonce into the checkpoint folder. Each worker then must:
- have the folder at all (a missing one: the share is not mounted there);
- when model.shared_path is set, hold it on the filesystem mounted exactly at shared_path (a folder
  on / at that path means the mount is missing and this is a local folder);
- see the head's nonce there: proof that it is the very same storage, not a local copy or another
  export that happens to look alike (same device names and paths on two machines prove nothing;
  a file the head wrote a moment ago does). This is what makes the check meaningful on the test
  cluster too, where every host shares one machine's filesystem;
- see every manifest file with its size (the bytes are the ones the head hashed: same storage).
The mount (type, source, path in the filesystem) of each node is reported next to the head's.
The marker is removed at the end.
"""
from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING

from ..outcomes import HostFailure, HostResult
from . import remote
from .manifest import Manifest, Verdict
from .jobs import MARKER, HostsideOp
from .push import STAGE_NAME, head_first, head_manifest, job_of, verify
from .settings import Settings

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..plan import Action
    from ..runrecord import HostLog, RunContext

def mount_text(mount: dict) -> str:
    return f"{mount.get('fstype', '?')} {mount.get('source', '?')} mounted at {mount.get('target', '?')}"


def not_on_shared_path(host: str, root: str, mount: dict, shared_path: str) -> str | None:
    want = os.path.normpath(shared_path)
    if mount.get("target") == want:
        return None
    return (f"{root} on {host} is on {mount_text(mount)}, not on the shared mount {want}: "
            f"{want} is not mounted on {host}, or the checkpoint there is a local folder")


def problems(host: str, v: Verdict, nonce: str, shared_path: str) -> list[str]:
    """Why a worker's view is not the head's shared checkpoint (empty: it is)."""
    if not v.exists:
        return [f"{v.root} does not exist on {host} (the shared storage is not mounted there?)"]
    out = []
    if shared_path:
        p = not_on_shared_path(host, v.root, v.mount, shared_path)
        if p:
            out.append(p)
    if v.marker != nonce:
        out.append(f"{v.root} on {host} is not the head's storage: the marker the head just wrote there "
                   f"is {'different' if v.marker else 'not visible'} (a local copy, or another export)")
    if not v.complete:
        out.append(f"the checkpoint as {host} sees it is incomplete: {v.problems()}")
    return out


def same_mount(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in ("fstype", "source", "path_in_fs"))


def apply(dep: "Deployment", actions: "list[Action]", ctx: "RunContext") -> list[HostResult]:
    st = Settings.from_options(ctx.options)
    head = dep.cluster.head_host
    shared_path = dep.recipe.model.shared_path
    nonce = secrets.token_hex(16)
    got: dict = {}

    def head_fn(action: "Action", log: "HostLog") -> HostResult:
        m, doc = head_manifest(dep, job_of(action).check.with_marker_value(nonce), st, log)
        got["marked"] = True
        mount = doc.get("mount") or {}
        if shared_path:
            p = not_on_shared_path(head.name, m.root, mount, shared_path)
            if p:
                raise HostFailure(p)
        got["m"], got["mount"] = m, mount
        return HostResult(head.name, STAGE_NAME, "ok",
                          f"shared checkpoint {m.describe()} (digest {m.digest}) on {mount_text(mount)}",
                          data={"files_total": len(m.files), "bytes_total": m.total_bytes,
                                "manifest_digest": m.digest, "mount": mount, "checkpoint_dir": m.root})

    def worker_fn(action: "Action", log: "HostLog") -> HostResult:
        m: Manifest = got["m"]
        h = dep.cluster.host(action.host)
        v = verify(dep, h, job_of(action).check, m, st, log)
        bad = problems(h.name, v, nonce, shared_path)
        data = {"files_total": len(m.files), "bytes_total": m.total_bytes, "manifest_digest": m.digest,
                "mount": v.mount, "same_mount_as_head": same_mount(v.mount, got["mount"]),
                "checkpoint_dir": v.root, "files_sent": 0}
        if bad:
            raise HostFailure("; ".join(bad) + "; nothing was copied (source: shared)")
        why = f"shared storage verified: same files as the head's ({m.describe()}), on {mount_text(v.mount)}"
        if not data["same_mount_as_head"]:
            why += f" (the head has {mount_text(got['mount'])})"
        return HostResult(h.name, STAGE_NAME, "skipped", why, data={**data, "skipped_reason": why})

    try:
        return head_first(dep, actions, ctx, head_fn, worker_fn, "not verified")
    finally:
        if got.get("marked"):
            _unmark(dep, st)


def _unmark(dep: "Deployment", st: Settings) -> None:
    head = dep.cluster.head_host
    try:
        with remote.connect(head, dep.cluster, st.connect_timeout) as s:
            remote.hostside(s, HostsideOp("unmark", ("--root", dep.checkpoint_dir(head), "--marker", MARKER)),
                            timeout=60)
    except Exception:  # noqa: BLE001 - a leftover marker is harmless (hidden, never listed)
        pass
