"""`--update-lock`: re-resolve the chain's moving base tag to a digest and rewrite the lock file.

Where the digest comes from, best first:
1. registry: the engine asks the registry for the tag's current manifest digest (distribution
   inspect). This is what lets a scheduled rebuild notice an upstream change: a new digest changes the
   base image ID, so every step rebuilds; the same digest means every step is reused.
2. repo-digests: no registry answered, but the image in the engine was pulled once and knows the
   digest it came with. That is the state of the last pull, not of upstream: said so in the note.
3. local-only: no registry and no RepoDigests (an image made with `docker import` or built here, as
   in this project's test cluster). There is no digest to pin; the lock records the local image ID,
   so a changed local image is noticed, but upstream changes cannot be.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import yaml

from .. import schema
from ..fsutil import atomic_write_text
from .spec import BaseLock, LoadedChain

if TYPE_CHECKING:
    import docker


def resolve_base(client: "docker.DockerClient", base: BaseLock) -> tuple[BaseLock, str]:
    """A new BaseLock for BASE.image as the engine can see it, and a sentence saying how."""
    from ..executors import docker_engine as de

    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    repo = de.repository(base.image)
    local_id = de.image_id(client, base.image)
    try:
        digest = de.registry_digest(client, base.image)
    except de.EngineError as e:
        registry_error = str(e).split(": ", 1)[-1]
    else:
        note = f"registry digest of {base.image} on {now}"
        changed = "" if digest == base.digest else f" (was {base.digest or 'not pinned'})"
        return (dataclasses.replace(base, digest=digest, image_id=local_id, source="registry",
                                    resolved_at=now, note=note),
                f"base {base.image}: registry digest {digest}{changed}")
    for rd in de.repo_digests(client, base.image):
        if rd.split("@", 1)[0] == repo:
            digest = rd.split("@", 1)[1]
            note = (f"no registry answered ({registry_error[:160]}); digest from the local image's RepoDigests "
                    f"on {now}: the state of its last pull, not necessarily upstream")
            return (dataclasses.replace(base, digest=digest, image_id=local_id, source="repo-digests",
                                        resolved_at=now, note=note),
                    f"base {base.image}: no registry reachable; pinned the digest of the local image's last "
                    f"pull, {digest}")
    if local_id is None:
        return (dataclasses.replace(base, resolved_at=now, note=f"unresolved: no registry ({registry_error[:160]}) "
                                    "and the image is not in the engine"),
                f"base {base.image}: cannot resolve: no registry reachable ({registry_error}) and the image is "
                "not in the engine; the lock keeps its previous pin")
    note = (f"local-only: no registry answered and the local image has no RepoDigests (imported or built "
            f"locally); pinned its image ID on {now}. Upstream changes cannot be detected from here")
    return (dataclasses.replace(base, digest=None, image_id=local_id, source="local-only", resolved_at=now,
                                note=note),
            f"base {base.image}: no registry reachable and no RepoDigests: pinned the local image ID "
            f"{local_id[:19]} (upstream changes cannot be detected from this engine)")


def pin_changed(old: BaseLock, new: BaseLock) -> bool:
    return (old.image, old.digest, old.image_id, old.source) != (new.image, new.digest, new.image_id, new.source)


def write_lock(chain: LoadedChain, base: BaseLock) -> LoadedChain:
    """Rewrite the lock file with BASE (atomically), keeping its leading comment block.

    Nothing is written when the pin itself (image, digest, image ID, source) did not change, so a
    scheduled `--update-lock` leaves the file alone (and proposes nothing) until upstream moves."""
    if not pin_changed(chain.lock.base, base):
        return chain
    lock = dataclasses.replace(chain.lock, base=base)
    text = chain.lock_file.read_text()
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    body = yaml.safe_dump(schema.to_dict(lock), sort_keys=False, default_flow_style=False, width=200)
    atomic_write_text(chain.lock_file, "\n".join(header) + ("\n" if header else "") + body)
    return dataclasses.replace(chain, lock=lock)
