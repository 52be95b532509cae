"""Releases: every deployment that came up healthy is a numbered record that can be brought back.

Pure planning only (no I/O): the record, its numbering, whether a run made a new release, which
releases keep their image pinned, the pin tag, and the --set values that relaunch a release. The
side effects (the history file on the head, the pin tags on every node) are in
orchestrator/launch/release_store.py.

A release names its image by ID, never by tag: a moved `:latest` must not change what "release 3"
means. The image stays on every node under the pin tag (`deployctl-release/<deployment>:<N>`) while
the release is among the last `releases.keep`, so `docker image prune` (a moved tag leaves the old
image dangling) and `build --prune` cannot remove it, and a created, never started holder container
(`deployctl-pin-<deployment>-<N>`) keeps it in use against `docker image prune -a`. Launching the pin
tag launches exactly that image.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

FORMAT = "deployctl-releases"
PIN_REPO = "deployctl-release"
HISTORY_SUBDIR = ".deployctl/releases"     # under the head's nvme_dir: one file per deployment


@dataclass(frozen=True)
class Release:
    number: int
    time: float                                   # epoch seconds (the controller's clock)
    image_id: str                                 # sha256:... what the containers run
    image: str                                    # the engine.image reference the run launched (for people)
    recipe: str                                   # the recipe's name
    recipe_ref: str | None = None                 # the --recipe the command was given (None: the inventory's)
    overrides: tuple[str, ...] = ()               # the command's --set values (the inventory's apply anyway)
    specs: dict[str, str] = field(default_factory=dict)            # host -> launch spec digest
    tables: dict[str, dict[str, str]] = field(default_factory=dict)  # host -> {engram|ple: content digest}
    run_dir: str = ""                             # the run record that made it
    command: str = ""                             # up | launch | rollback
    rollback_of: int | None = None                # a rollback: the release it brought back
    # host -> that host's image ID, kept only where the hosts' IDs differ: the same image has its
    # manifest digest as ID on a containerd-store engine, its config digest elsewhere
    image_ids: dict[str, str] = field(default_factory=dict)
    # the checkpoint it served (checkpoint_of): repo, revision as the recipe wrote it, the commit the run
    # resolved it to, and the digest of the manifest sync-model verified the nodes against; or the
    # recipe's plain folder (dir). Empty in histories written before releases recorded it.
    checkpoint: dict[str, str] = field(default_factory=dict)

    def image_on(self, host: str) -> str:
        """The release's image ID in HOST's engine."""
        return self.image_ids.get(host, self.image_id)

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "time": self.time, "image_id": self.image_id, "image": self.image,
                "recipe": self.recipe, "recipe_ref": self.recipe_ref, "overrides": list(self.overrides),
                "specs": dict(self.specs), "tables": {h: dict(t) for h, t in self.tables.items()},
                "run_dir": self.run_dir, "command": self.command, "rollback_of": self.rollback_of,
                **({"image_ids": dict(self.image_ids)} if self.image_ids else {}),
                "checkpoint": dict(self.checkpoint)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Release":
        return cls(number=int(d["number"]), time=float(d.get("time") or 0), image_id=str(d["image_id"]),
                   image=str(d.get("image", "")), recipe=str(d.get("recipe", "")),
                   recipe_ref=d.get("recipe_ref"), overrides=tuple(d.get("overrides") or ()),
                   specs=dict(d.get("specs") or {}), tables={h: dict(t) for h, t in (d.get("tables") or {}).items()},
                   run_dir=str(d.get("run_dir", "")), command=str(d.get("command", "")),
                   rollback_of=d.get("rollback_of"), image_ids=dict(d.get("image_ids") or {}),
                   checkpoint={k: str(v) for k, v in (d.get("checkpoint") or {}).items()})

    def describe(self) -> str:
        what = f"rollback of {self.rollback_of}" if self.rollback_of is not None else self.command
        return (f"release {self.number} ({what}, {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.time))} UTC): "
                f"image {short_id(self.image_id)} ({self.image})" + (f", {self.served()}" if self.checkpoint else ""))

    def served(self) -> str:
        """The checkpoint in a few words: repo@commit (manifest), or the folder."""
        c = self.checkpoint
        what = f"{c.get('repo', '')}@{c['commit'][:12]}" if c.get("commit") else c.get("dir", "")
        return what + (f" (manifest {c['manifest'][:12]})" if c.get("manifest") else "")


def short_id(image_id: str) -> str:
    return image_id.split(":", 1)[-1][:12]


def history_path(nvme_dir: str, deployment: str) -> str:
    return str(PurePosixPath(nvme_dir) / HISTORY_SUBDIR / f"{_slug(deployment)}.json")


def _slug(deployment: str) -> str:
    """A Docker repository path component: lowercase letters, digits, '.', '_', '-'."""
    return re.sub(r"[^a-z0-9._-]", "-", deployment.lower()).strip("._-") or "deployment"


def pin_tag(deployment: str, number: int) -> str:
    return f"{PIN_REPO}/{_slug(deployment)}:{number}"


def holder_name(deployment: str, number: int) -> str:
    """A created, never started container of the release's image: `docker image prune -a` removes every
    image no container uses, whatever its tags; this one keeps the image in use."""
    return f"deployctl-pin-{_slug(deployment)}-{number}"


def parse(doc: Any) -> list[Release]:
    """The history file's releases, oldest first (an absent file: None -> [])."""
    if doc is None:
        return []
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not a deployctl release history")
    return sorted((Release.from_json(d) for d in doc.get("releases") or []), key=lambda r: r.number)


def dump(deployment: str, history: list[Release]) -> dict[str, Any]:
    return {"format": FORMAT, "version": 1, "deployment": deployment,
            "releases": [r.to_json() for r in history]}


def current(history: list[Release]) -> Release | None:
    return history[-1] if history else None


def find(history: list[Release], number: int) -> Release | None:
    return next((r for r in history if r.number == number), None)


def previous(history: list[Release]) -> Release | None:
    """The release before the current one (rollback's default target)."""
    return history[-2] if len(history) >= 2 else None


def is_new(history: list[Release], image_id: str, specs: dict[str, str],
           image_ids: dict[str, str] | None = None) -> bool:
    """Whether what runs now differs from the current release (a no-op `up` adds no release)."""
    cur = current(history)
    return cur is None or cur.image_id != image_id or cur.specs != specs or cur.image_ids != (image_ids or {})


def next_number(history: list[Release]) -> int:
    return max((r.number for r in history), default=0) + 1


def kept(history: list[Release], keep: int) -> list[Release]:
    """The releases whose images stay pinned: the last KEEP."""
    return history[-keep:] if keep > 0 else []


def released(history: list[Release], keep: int) -> list[Release]:
    """The releases whose pin tags are removed (their images may be pruned, unless a kept one shares it)."""
    keep_set = {r.number for r in kept(history, keep)}
    return [r for r in history if r.number not in keep_set]


MASKED = "=***"      # secrets.MASK after the '=': a secret-named override is recorded without its value


def masked_overrides(release: Release) -> tuple[str, ...]:
    """The release's overrides whose secret value was never recorded (the operator passes them again)."""
    return tuple(o for o in release.overrides if o.endswith(MASKED))


def checkpoint_of(repo: str, revision: str, commit: str, folder: str, manifest: str) -> dict[str, str]:
    """What a release records of its checkpoint: the Hub repo, the revision the recipe named and the
    commit the run resolved it to (FOLDER: the recipe's plain checkpoint_dir instead), and the
    manifest digest sync-model verified the nodes against ("" when no sync-model ran)."""
    if folder:
        return {"dir": folder, "manifest": manifest}
    return {"repo": repo, "revision": revision, "commit": commit, "manifest": manifest}


def with_manifest(checkpoint: dict[str, str], history: list[Release]) -> dict[str, str]:
    """CHECKPOINT, its manifest digest taken from the newest release of the same commit (or folder)
    when this run verified none (a launch or rollback without sync-model serves the same bytes)."""
    if checkpoint.get("manifest"):
        return checkpoint
    same = [r for r in history if r.checkpoint.get("manifest")
            and all(r.checkpoint.get(k) == checkpoint.get(k) for k in ("repo", "commit", "dir"))]
    return {**checkpoint, "manifest": same[-1].checkpoint["manifest"]} if same else checkpoint


def rollback_sets(deployment: str, release: Release, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """--set values that relaunch RELEASE: its own overrides (but the secret ones, never recorded), EXTRA
    (the operator's --set, e.g. those secrets), then (last wins) the commit it served, so a branch that
    moved since is not resolved again, and its image by the pin tag."""
    own = tuple(o for o in release.overrides if not o.endswith(MASKED))
    commit = release.checkpoint.get("commit", "")
    pinned = (f"model.revision={commit}",) if commit else ()
    return (*own, *extra, *pinned, f"engine.image={pin_tag(deployment, release.number)}")
