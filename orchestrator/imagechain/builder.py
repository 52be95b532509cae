"""Run an image chain against one Docker engine: per step, reuse the image whose digest matches or
build it, with the checks that catch real mistakes; tag the last step's image.

Cache: a finished step's image carries labels deployctl.chain/step/digest and the tag
`deployctl-cache/<chain>:<step>-<digest hex>`. The tag is written last, after the step's checks and
verification passed, so it means "this digest was built and verified"; lookup is one inspect of that
tag (labels are inherited by child images, so a label search could return a descendant). A no-op run
therefore costs one inspect per step plus hashing the inputs.

Platform: every step is built for the chain's platform (its head's architecture: linux/arm64 for
aarch64, linux/amd64 for x86_64; the build API's `platform`, `docker build --platform`), the base
image is checked to be that platform before anything is built (its config's Architecture/Variant),
and so is every step's image after it is built or reused; a mismatch fails naming the image.

Checks: inputs exist and have the expected shape (spec.check_inputs, before the engine is contacted);
a patch step's destinations exist in the image below (a moved module fails naming the patch and the
path); a verification whose output lacks its marker or one of its required lines fails with the
output tail, naming each line that is missing or reports another status (MISS), and the image is
removed; a run-copy-out output glob that matches nothing fails naming it.
"""
from __future__ import annotations

import json
import posixpath
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import docker

from .. import schema
from .. import platforms as oci
from ..executors import docker_engine as de
from .context import TarBuilder
from .digest import file_sha256, hash_tree, step_digest, step_material
from .spec import InputRef, LoadedChain, StepSpec

CACHE_REPO = "deployctl-cache"
DOCKERFILE_NAME = ".deployctl.Dockerfile"     # in the context root; never clashes with an input's Dockerfile
OUT_DIR = "/deployctl/out"
# Runs in the build container of a run-copy-out step: the step's script in WORKDIR, then every output
# glob copied to OUT_DIR (a glob matching nothing is an error naming it). Globs arrive as arguments.
WRAPPER = """#!/bin/sh
# deployctl run-copy-out: $1 = workdir, $2 = shell for the step script, $3... = output globs
set -e
cd "$1"
sh_="$2"
shift 2
"$sh_" -e /deployctl/step.sh
rm -rf /deployctl/out
mkdir -p /deployctl/out
missing=0
for pat in "$@"; do
  found=0
  for f in $pat; do
    if [ -e "$f" ]; then cp -a "$f" /deployctl/out/; found=1; fi
  done
  if [ "$found" = 0 ]; then echo "deployctl: no file matches output pattern $pat (in $PWD)"; missing=1; fi
done
[ "$missing" = 0 ]
echo "deployctl: copied out:"; ls -l /deployctl/out
"""


class StepLog(Protocol):
    path: Path

    def write(self, text: str) -> None: ...
    def tail(self, n: int = ...) -> list[str]: ...
    def close(self) -> None: ...


@dataclass
class StepReport:
    name: str
    kind: str
    status: str = "not-run"                 # built | reused | failed | not-run
    digest: str = ""
    image_id: str = ""
    platform: str = ""                      # the image's platform as its config says it (linux/arm64/v8)
    seconds: float = 0.0
    log: str = ""
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class BuildReport:
    chain: str
    engine: str
    image: str
    status: str = "running"                 # ok | failed
    platform: str = ""                      # what every step is built for: linux/arm64 | linux/amd64
    arch: str = ""                          # the head's architecture (uname -m) it is for
    base: dict[str, Any] = field(default_factory=dict)
    steps: list[StepReport] = field(default_factory=list)
    seconds: float = 0.0
    image_id: str = ""
    tag_changed: bool = False               # the final tag moved (or was created) in this run
    notes: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)

    @property
    def built(self) -> list[str]:
        return [s.name for s in self.steps if s.status == "built"]

    @property
    def reused(self) -> list[str]:
        return [s.name for s in self.steps if s.status == "reused"]

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "steps"}
        d["seconds"] = round(self.seconds, 3)
        d["steps"] = [s.to_json() for s in self.steps]
        d["built"], d["reused"] = self.built, self.reused
        return d


class ChainFailed(Exception):
    """A step failed; the report says which and how far the chain got."""

    def __init__(self, report: BuildReport, step: str, message: str, tail: list[str]):
        super().__init__(message)
        self.report, self.step, self.tail = report, step, tail


class _StepError(Exception):
    def __init__(self, message: str, tail: list[str] | None = None):
        super().__init__(message)
        self.tail = tail or []


def platform_of(attrs: dict[str, Any]) -> str:
    """An image's platform as its config (an inspect result) says it: linux/arm64/v8, linux/amd64."""
    return oci.describe(attrs.get("Architecture") or "", attrs.get("Variant") or "", attrs.get("Os") or "")


def is_platform(attrs: dict[str, Any], arch: str) -> bool:
    """Whether an image (its inspect result) is the platform a `uname -m` ARCH host runs: linux, and
    arm64 with variant v8 or none for aarch64, amd64 for x86_64 (orchestrator/platforms.py)."""
    return (attrs.get("Os") or "linux") == "linux" and \
        oci.runs_on(attrs.get("Architecture") or "", attrs.get("Variant") or "", arch)


def cache_ref(chain: str, step: str, digest: str) -> str:
    return f"{CACHE_REPO}/{chain}:{step}-{digest.split(':', 1)[-1]}"


def labels_for(chain: str, step: StepSpec, digest: str) -> dict[str, str]:
    return {"deployctl.chain": chain, "deployctl.step": step.name, "deployctl.kind": step.kind,
            "deployctl.digest": digest}


class ChainBuilder:
    """Builds CHAIN in CLIENT's engine for the chain's platform (chain.arch: the head's architecture).
    WHERE names the engine in messages; HOST the host the image is for (default: WHERE)."""

    def __init__(self, client: docker.DockerClient, chain: LoadedChain, *, final_tag: str, where: str,
                 log_for: Callable[[str], StepLog], say: Callable[[str], None] = lambda s: None,
                 cancel: threading.Event | None = None, no_cache: bool = False, host: str = ""):
        self.client, self.chain, self.final_tag, self.where = client, chain, final_tag, where
        self.host = host or where
        self.log_for, self.say, self.cancel, self.no_cache = log_for, say, cancel, no_cache
        self._hashes: dict[tuple[str, tuple[str, ...]], str] = {}
        self._platforms: dict[str, str] = {}       # image ID -> the platform its config says (checked)
        self.current_refs: set[str] = set()

    # -- the chain ----------------------------------------------------------------------------
    def build(self) -> BuildReport:
        t0 = time.monotonic()
        report = BuildReport(self.chain.name, self.where, self.final_tag, platform=self.chain.platform,
                             arch=self.chain.arch)
        report.steps = [StepReport(s.name, s.kind) for s in self.chain.steps]
        ids: dict[str, str] = {}
        try:
            ids["base"] = self._base(report)
        except (_StepError, de.EngineError) as e:
            report.status, report.seconds = "failed", time.monotonic() - t0
            raise ChainFailed(report, "base", str(e), getattr(e, "tail", [])) from None
        for step, rep in zip(self.chain.steps, report.steps):
            log = self.log_for(step.name)
            rep.log = str(log.path)
            t = time.monotonic()
            try:
                log.write(f"== step {step.name} ({step.kind}) on {self.where}")
                ids[step.name] = self._step(step, ids, rep, log)
            except Exception as e:   # noqa: BLE001 - any failure of a step is reported with the chain so far
                if not isinstance(e, (_StepError, de.EngineError)):
                    e = _StepError(f"{type(e).__name__}: {e}")
                rep.status, rep.message = "failed", str(e)
                rep.seconds = time.monotonic() - t
                log.write(f"FAILED: {e}")
                tail = getattr(e, "tail", None) or log.tail()
                log.close()
                report.status, report.seconds = "failed", time.monotonic() - t0
                self.say(f"  {step.name}: FAILED after {rep.seconds:.1f}s (log {rep.log})")
                raise ChainFailed(report, step.name, f"step {step.name}: {e}", tail) from None
            rep.seconds = time.monotonic() - t
            log.write(f"== step {step.name}: {rep.status} {rep.image_id} digest {rep.digest} "
                      f"in {rep.seconds:.1f}s")
            log.close()
            short = rep.digest.split(":")[-1][:12]
            self.say(f"  {step.name}: {rep.status} in {rep.seconds:.1f}s (digest {short})")
        final = ids[self.chain.steps[-1].name]
        report.tag_changed = de.image_id(self.client, self.final_tag) != final
        de.tag_image(self.client, final, self.final_tag)
        report.image_id, report.status = final, "ok"
        report.seconds = time.monotonic() - t0
        return report

    def _base(self, report: BuildReport) -> str:
        b = self.chain.lock.base
        ref = f"{de.repository(b.image)}@{b.digest}" if b.digest else b.image
        platform, arch = self.chain.platform, self.chain.arch
        iid = de.image_id(self.client, ref)
        if iid is None:
            self.say(f"  base image {ref} is not in the engine: pulling it for {platform}")
            try:
                iid = de.pull(self.client, ref, where=self.where, platform=platform)
            except de.EngineError as e:
                raise _StepError(f"base image {ref} is not in the engine ({self.where}) and could not be pulled "
                                 f"for {platform} ({e}). Load its {platform} build there (`docker save {b.image} "
                                 f"| ssh HEAD docker load`) or give the engine registry access") from None
        attrs = self.client.api.inspect_image(iid)
        found = platform_of(attrs)
        if not is_platform(attrs, arch):
            raise _StepError(
                f"base image {ref} ({iid[:19]}) in the engine of {self.where} is {found}, but the image is for "
                f"{self.host}, whose architecture is {arch} ({platform}): every step would be built on the "
                f"wrong platform. Put the {platform} build of {b.image} in that engine (`docker pull --platform "
                f"{platform} {b.image}` there, or `docker save` it on a {arch} machine and `docker load` it "
                f"there), or point the lock's base ({self.chain.lock_file}) at a {platform} image")
        if not b.digest and b.image_id and b.image_id != iid:
            report.notes.append(f"base {b.image} is now image {iid[:19]}, the lock recorded {b.image_id[:19]}: "
                                "every step rebuilds on the new base (run --update-lock to record it)")
        report.base = {"image": b.image, "ref": ref, "image_id": iid, "digest": b.digest, "source": b.source,
                       "platform": found}
        return iid

    def _check_platform(self, step: StepSpec, image: str, cached: str = "",
                        attrs: dict[str, Any] | None = None) -> str:
        """The platform IMAGE's config says (linux/arm64/v8); _StepError naming STEP when it is not
        the chain's. CACHED: the cache tag it was reused from; ATTRS: its inspect result, if read."""
        attrs = attrs or self.client.api.inspect_image(image)
        found = platform_of(attrs)
        if is_platform(attrs, self.chain.arch):
            return found
        want = self.chain.platform
        if cached:
            raise _StepError(f"the cached image of step {step.name}, {cached} ({image[:19]}), is {found}, not "
                             f"{want} (the platform of {self.host}, {self.chain.arch}): something other than this "
                             f"build tagged it. Remove it (`docker rmi {cached}` there) and build again")
        why = de.remove_image(self.client, image)
        raise _StepError(f"step {step.name} built image {image[:19]} as {found}, not {want} (the platform of "
                         f"{self.host}, {self.chain.arch}): the engine ({self.where}) did not build for the platform "
                         f"asked; the image was removed" + (f" (not: {why})" if why else ""))

    def _step(self, step: StepSpec, ids: dict[str, str], rep: StepReport, log: StepLog) -> str:
        if self.cancel is not None and self.cancel.is_set():
            raise _StepError("cancelled")
        parent_id = ids[self.chain.parent_of(step)]
        uses = {u: ids[u] for u in step.uses}
        if step.kind == "run-copy-out":
            plan = self._plan_run_copy_out(step, parent_id)
        elif step.kind == "patch":
            plan = self._plan_patch(step, parent_id, uses)
        else:
            plan = self._plan_docker_build(step, parent_id, uses)
        digest = step_digest(plan["material"])
        rep.digest = digest
        ref = cache_ref(self.chain.name, step.name, digest)
        self.current_refs.add(ref)
        checked = step.kind != "run-copy-out"      # an artifact image is files for COPY --from, no platform's
        if not self.no_cache:
            attrs = self._lookup(ref, digest)
            if attrs:
                cached = attrs["Id"]
                if checked:
                    rep.platform = self._check_platform(step, cached, ref, attrs)
                rep.status, rep.image_id = "reused", cached
                log.write(f"reused {cached} ({ref})" + (f", {rep.platform}" if checked else ""))
                return cached
        log.write(f"building for {self.chain.platform}: digest {digest} (no image {ref})")
        image = plan["run"](log, digest)
        if checked:
            rep.platform = self._platforms.get(image) or self._check_platform(step, image)
        de.tag_image(self.client, image, ref)      # last: the tag means built, verified and of its platform
        rep.status, rep.image_id = "built", image
        return image

    def _lookup(self, ref: str, digest: str) -> dict[str, Any] | None:
        """The inspect result of the cache image REF when it is DIGEST's (one inspect)."""
        try:
            attrs = self.client.api.inspect_image(ref)
        except docker.errors.NotFound:
            return None
        labels = (attrs.get("Config") or {}).get("Labels") or {}
        return attrs if labels.get("deployctl.digest") == digest else None

    # -- inputs -------------------------------------------------------------------------------
    def _hash(self, ref: InputRef) -> str:
        fixed = self.chain.root_key(ref.root)
        if fixed:
            return f"{fixed}:{ref.src}"
        path = self.chain.input_path(ref)
        key = (str(path), ref.exclude)
        if key not in self._hashes:
            self._hashes[key] = hash_tree(path, ref.exclude)
        return self._hashes[key]

    def _input_material(self, refs: tuple[InputRef, ...]) -> list[tuple[str, str]]:
        return [(r.target, self._hash(r)) for r in refs]

    def _add_inputs(self, tar: TarBuilder, refs: tuple[InputRef, ...], below: str = "") -> None:
        for r in refs:
            tar.add_tree(self.chain.input_path(r), posixpath.join(below, r.target), r.exclude)

    def _render(self, template: str, **extra: Any) -> str:
        env = self.chain.template_env()
        return env.get_template(template).render(**self.chain.vars, chain=self.chain.name, **extra)

    # -- docker-build -------------------------------------------------------------------------
    def _plan_docker_build(self, step: StepSpec, parent_id: str, uses: dict[str, str]) -> dict[str, Any]:
        if step.dockerfile_input is not None:
            text = self.chain.input_path(step.dockerfile_input).read_text()
        else:
            text = self._render(step.dockerfile, step=step, steps=uses, parent=parent_id)
        args = {"BASE": parent_id, **step.args}
        material = step_material(kind=step.kind, chain=self.chain.name, step=step.name, platform=self.chain.platform,
                                 text=text, args=args, inputs=self._input_material(step.inputs), parent_id=parent_id,
                                 uses=uses, extra={"verify": schema.to_dict(step.verify)})

        def run(log: StepLog, digest: str) -> str:
            tar = TarBuilder()
            self._add_inputs(tar, step.inputs)
            marker = _MarkerWatch(bool(step.verify and not step.verify.command), log)
            image = self._docker_build(step, tar, text, args, digest, marker.line)
            if step.verify:
                self._verify(step, image, log, "\n".join(marker.lines))
            return image
        return {"material": material, "run": run}

    def _docker_build(self, step: StepSpec, tar: TarBuilder, text: str, args: dict[str, str], digest: str,
                      on_line: Callable[[str], None]) -> str:
        # The labels go in as one LABEL line (the API's `labels` adds one instruction, and with the
        # legacy builder one container, per label). They name the digest, so they are not hashed.
        labels = " ".join(f"{json.dumps(k)}={json.dumps(v)}"
                          for k, v in labels_for(self.chain.name, step, digest).items())
        tar.add_bytes(DOCKERFILE_NAME, f"{text.rstrip()}\nLABEL {labels}\n".encode())
        ctx = tar.finish()
        try:
            image = de.build_image(self.client, ctx, where=self.where, dockerfile=DOCKERFILE_NAME, buildargs=args,
                                   on_line=on_line, timeout=step.timeout_s, nocache=self.no_cache,
                                   cancel=self.cancel, platform=self.chain.platform)
        except de.BuildError as e:
            raise _StepError(e.args[0].split(": ", 1)[-1], e.tail) from None
        finally:
            ctx.close()
        if step.kind != "run-copy-out":            # before any verification runs it
            self._platforms[image] = self._check_platform(step, image)
            on_line(f"deployctl: image {image} is {self._platforms[image]}")
        return image

    def _verify(self, step: StepSpec, image: str, log: StepLog, build_output: str) -> None:
        v = step.verify
        assert v is not None
        want = repr(v.expect) if v.expect else "lines " + ", ".join(map(repr, v.expect_lines))
        if v.command:
            log.write(f"verify: {' '.join(v.command)} (expect {want})")
            res = de.run_container(self.client, image, v.command, where=self.where, gpus=v.gpus,
                                   on_line=log.write, timeout=v.timeout_s, cancel=self.cancel,
                                   labels={"deployctl.chain": self.chain.name, "deployctl.verify": step.name})
            problems, detail, tail = v.check(res.output), f"exit code {res.rc}", res.tail
            if res.rc != 0:
                problems.append(f"it exited {res.rc}")
        else:
            problems, detail, tail = v.check(build_output), "in the build output", log.tail()
        if not problems:
            log.write(f"verify: found {want}")
            return
        why = de.remove_image(self.client, image)     # an unverified image must never be reused
        log.write(f"verify: {'; '.join(problems)} ({detail}); image {image} removed" + (f" (not: {why})" if why else ""))
        what = f"`{' '.join(v.command)}`" if v.command else "the build"
        raise _StepError(f"verification failed: the output of {what}: {'; '.join(problems)} ({detail})", tail)

    # -- patch --------------------------------------------------------------------------------
    def _plan_patch(self, step: StepSpec, parent_id: str, uses: dict[str, str]) -> dict[str, Any]:
        pdir = self.chain.roots[step.patches_root] / step.patches_dir
        patches = []
        for i, p in enumerate(step.patches, 1):
            src = pdir / p.file
            patches.append({"n": i, "file": p.file, "purpose": p.purpose, "src": f"patches/{i}/{Path(p.file).name}",
                            "dest": posixpath.join(step.target, p.dest), "path": src, "sha": file_sha256(src),
                            "adds": p.adds, "requires": [posixpath.join(step.target, r) for r in p.requires]})
        text = self._render(step.dockerfile or self.chain.spec.patch_template, step=step, steps=uses,
                            parent=parent_id, patches=patches)
        args = {"BASE": parent_id, **step.args}
        material = step_material(kind=step.kind, chain=self.chain.name, step=step.name, platform=self.chain.platform,
                                 text=text, args=args, inputs=[(p["src"], p["sha"]) for p in patches],
                                 parent_id=parent_id, uses=uses,
                                 extra={"verify": schema.to_dict(step.verify)} if step.verify else None)

        def run(log: StepLog, digest: str) -> str:
            self._check_destinations(step, patches, parent_id, log)
            tar = TarBuilder()
            for p in patches:
                tar.add_tree(p["path"], p["src"], ())
            image = self._docker_build(step, tar, text, args, digest, log.write)
            if step.verify:
                self._verify(step, image, log, "")
            return image
        return {"material": material, "run": run}

    def _check_destinations(self, step: StepSpec, patches: list[dict[str, Any]], parent_id: str,
                            log: StepLog) -> None:
        below = self.chain.parent_of(step)
        paths = sorted({q for p in patches for q in [p["dest"], *p["requires"]]})
        found = de.stat_paths(self.client, parent_id, paths, where=self.where)
        lines = []
        for p in patches:
            log.write(f"patch {p['n']} {p['file']} -> {p['dest']}: {found[p['dest']]}"
                      + (" (added)" if p["adds"] else ""))
            kind = found[p["dest"]]
            if p["adds"] and kind != "missing":
                lines.append(f"patch {p['n']} ({p['file']}) adds {p['dest']}, but the image already has it "
                             f"(a {kind}): upstream now ships a file there")
            elif not p["adds"] and kind != "file":
                lines.append(f"patch {p['n']} ({p['file']}): destination {p['dest']} "
                             f"{'does not exist' if kind == 'missing' else 'is a ' + kind + ', not a file'}")
            for r in p["requires"]:
                log.write(f"patch {p['n']} requires {r}: {found[r]}")
                if found[r] != "file":
                    lines.append(f"patch {p['n']} ({p['file']}) builds on {r}, which "
                                 f"{'does not exist' if found[r] == 'missing' else 'is not a file'}")
        bad = lines
        if bad:
            raise _StepError(f"{len(bad)} patch destination problem(s) in the image below ({below}, "
                             f"{parent_id[:19]}): " + "; ".join(lines) + ". The module moved or the tree "
                             "changed: fix the patch's dest in the chain (or the tree it patches)", lines)

    # -- run-copy-out -------------------------------------------------------------------------
    def _plan_run_copy_out(self, step: StepSpec, parent_id: str) -> dict[str, Any]:
        argv = ["/bin/sh", "/deployctl/run.sh", step.workdir, step.shell, *step.outputs]
        artifact = self._render(self.chain.spec.artifact_template, step=step)
        material = step_material(kind=step.kind, chain=self.chain.name, step=step.name, platform=self.chain.platform,
                                 text=step.script, args={}, inputs=self._input_material(step.inputs),
                                 parent_id=parent_id, uses={},
                                 extra={"argv": argv, "wrapper": WRAPPER, "env": step.env, "gpus": step.gpus,
                                        "artifact": artifact})

        def run(log: StepLog, digest: str) -> str:
            up = TarBuilder()
            up.add_bytes("deployctl/run.sh", WRAPPER.encode(), 0o755)
            up.add_bytes("deployctl/step.sh", step.script.encode(), 0o755)
            self._add_inputs(up, step.inputs, below=step.workdir)
            upload = up.finish()
            log.write(f"run in a container of {parent_id[:19]}: {' '.join(argv)}")
            with tempfile.TemporaryFile(prefix="deployctl-out-") as out:
                try:
                    res = de.run_container(self.client, parent_id, argv, where=self.where, env=step.env,
                                           gpus=step.gpus, upload=("/", upload), download=OUT_DIR,
                                           download_to=out, on_line=log.write, timeout=step.timeout_s,
                                           cancel=self.cancel,
                                           labels={"deployctl.chain": self.chain.name, "deployctl.run": step.name})
                finally:
                    upload.close()
                if res.rc != 0:
                    raise _StepError(f"the build script exited {res.rc}", res.tail)
                out.seek(0)
                members = de.tar_members(out)
            files = [(m, data) for m, data in members if m.isfile()]
            if not files:
                raise _StepError("the build script produced none of the outputs", log.tail())
            for m, data in files:
                log.write(f"output {m.name}: {m.size} bytes")
            tar = TarBuilder()
            tar.add_members(members, "")
            return self._docker_build(step, tar, artifact, {}, digest, log.write)
        return {"material": material, "run": run}

    # -- prune --------------------------------------------------------------------------------
    def prune(self) -> list[str]:
        """After a successful build: remove this chain's images that the build did not use.

        Stale cache entries (other digests: an older patch layer, a previous base...) and dangling
        leftovers go; the current steps' images stay: they are the layers of the final image (removing
        them frees nothing) and the cache of the next run.
        """
        removed: list[str] = []
        repo = f"{CACHE_REPO}/{self.chain.name}"
        images = sorted(self.client.api.images(name=repo), key=lambda i: i.get("Created", 0), reverse=True)
        for img in images:
            for tag in img.get("RepoTags") or []:
                if tag.startswith(repo + ":") and tag not in self.current_refs:
                    why = de.remove_image(self.client, tag)
                    removed.append(tag if why is None else f"{tag} (kept: {why})")
        for img in self.client.api.images(filters={"dangling": True, "label": f"deployctl.chain={self.chain.name}"}):
            why = de.remove_image(self.client, img["Id"])
            if why is None:
                removed.append(img["Id"])
        return removed


class _MarkerWatch:
    """Passes build output to the log and keeps it when a verification reads the build output."""

    def __init__(self, keep: bool, log: StepLog):
        self.keep, self.log, self.lines = keep, log, []

    def line(self, text: str) -> None:
        if self.keep:
            self.lines.append(text)
        self.log.write(text)
