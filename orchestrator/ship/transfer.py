"""Controller side of `ship`: what the head has, what each worker has, running the agent, verifying.

The bytes go head -> worker: the controller SSHes to the head and runs the agent there (agent.py,
standard library only, sent as `python3 -c`), which runs one `docker save <image id>` and streams a
filtered archive to each worker over the head's own `ssh worker docker load`. The controller only
orchestrates: it reads the agent's JSON lines (progress, per-worker results) and checks results.
"""
from __future__ import annotations

import json
import shlex
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import platforms
from ..executors.docker_cli import docker_argv
from ..executors.host_batch import run_batch
from ..fsutil import atomic_write_text
from ..hostside.image_layers import layers_to_send, present_chains
from ..signals import describe_exit, exit_text
from .stores import INFO_FORMAT, EngineFacts, facts_from_line

if TYPE_CHECKING:
    from ..executors.shells import HostShell
    from ..executors.ssh import SSHSession
    from ..inventory import Cluster, Host

HOSTSIDE = Path(__file__).resolve().parent.parent / "hostside"   # the programs sent to the head and the workers
INSPECT_TIMEOUT = 60.0
CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
           "aes128-ctr", "aes192-ctr", "aes256-ctr")


class ShipError(Exception):
    """A failure of the ship for one or all hosts; the message says where and what happened."""

    def __init__(self, message: str, tail: list[str] | None = None, rc: int | None = None):
        super().__init__(message)
        self.tail, self.rc = tail or [], rc


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0       # SSH connect, from the controller and from the head
    stall_s: float = 60.0         # a worker that takes no bytes this long is cut off
    deadline_s: float = 7200.0    # the whole transfer (docker save + streams + loads)
    load_s: float = 1800.0        # a worker's docker load after its last byte
    head_silence_s: float = 60.0  # no line from the agent this long: the head is lost


def short(image_id: str) -> str:
    return image_id.split(":", 1)[-1][:12]


# --------------------------------------------------------------------------------------------------
# What the head and the workers hold

@dataclass(frozen=True)
class Manifest:
    """What an image's OCI manifest says: its config digest and its layer blobs (in diff_id order)."""
    digest: str
    config: str
    layers: tuple[str, ...]


@dataclass(frozen=True)
class HeadImage:
    name: str
    id: str
    diff_ids: tuple[str, ...]
    size: int                                  # bytes, as the engine reports (uncompressed)
    layer_sizes: tuple[int, ...] | None = None  # estimate per layer (docker history), display only
    engine: EngineFacts = EngineFacts("")
    manifest: Manifest | None = None           # containerd store: read out of docker save (manifest_of)
    arch: str = ""                             # the image's GOARCH (picks the manifest of an index)
    variant: str = ""                          # its config's variant (v8 for some arm64 images)

    @property
    def platform(self) -> str:
        return platforms.describe(self.arch, self.variant)

    def refusal_for(self, host: "Host") -> str | None:
        """Why this image cannot be sent to HOST (its platform is not the host's), else None."""
        if platforms.runs_on(self.arch, self.variant, host.arch):
            return None
        return (f"image {self.name} ({short(self.id)}) is {self.platform}, but {host.name} is {host.arch}: it "
                f"would not run there. Build it on the head for the hosts' architecture (deployctl build), or "
                f"put hosts of one architecture in the deployment")

    @property
    def config(self) -> str:
        """The config digest: the identity every image store keeps (a graph-driver store's ID)."""
        return self.manifest.config if self.manifest else self.id

    def blob_diffs(self) -> dict[str, str]:
        """Layer blob digest -> diff_id, where blob names are not diff_ids (compressed layers)."""
        if not self.manifest:
            return {}
        return {b: d for b, d in zip(self.manifest.layers, self.diff_ids) if b != d}

    def estimate(self, indices: list[int]) -> int | None:
        if self.layer_sizes is None:
            return self.size if len(indices) == len(self.diff_ids) else None
        return sum(self.layer_sizes[i] for i in indices) + 4096 * (len(indices) + 1)


def _batch(s: "SSHSession", items: list, what: str) -> list:
    """run_batch (one round trip), its SSHError as a ShipError saying WHAT could not be done."""
    from ..executors.ssh import SSHError     # not at module level: plans import this module
    try:
        return run_batch(s, items, INSPECT_TIMEOUT)
    except SSHError as e:
        raise ShipError(f"{what}: {e}") from None


def inspect_head(s: "SSHSession", image: str, docker_host: str) -> HeadImage:
    """The head's engine and image, with its layers' sizes, in one round trip (executors/host_batch.py)."""
    info, r, history = _batch(s, [
        docker_argv(docker_host, "info", "--format", INFO_FORMAT),
        docker_argv(docker_host, "image", "inspect", "--format", "{{json .}}", image),
        docker_argv(docker_host, "history", "--no-trunc", "--human=false", "--format", "{{.Size}}", image)],
        f"cannot read the head's Docker engine ({docker_host})")
    if info.rc != 0 or r.rc != 0:
        bad = info if info.rc != 0 else r
        err = (bad.stderr or bad.stdout).strip()
        if "No such image" in err or "no such image" in err.lower():
            raise ShipError(f"image {image} is not in the head's engine ({docker_host}): build it there "
                            f"first (deployctl build) or pass --image")
        raise ShipError(f"`docker image inspect {image}` on the head failed (exit {bad.rc}): {err[-500:]}",
                        rc=bad.rc)
    doc = json.loads(r.stdout)
    diff_ids = tuple(doc["RootFS"].get("Layers") or ())
    if not diff_ids:
        raise ShipError(f"image {image} on the head has no layers to ship")
    return HeadImage(image, doc["Id"], diff_ids, int(doc.get("Size") or 0),
                     history_layer_sizes(history.stdout, len(diff_ids)) if history.rc == 0 else None,
                     engine=facts_from_line(info.stdout), arch=str(doc.get("Architecture") or ""),
                     variant=str(doc.get("Variant") or ""))


def with_manifest(s: "SSHSession", head: HeadImage, docker_host: str, cache_root: str | None) -> HeadImage:
    """HEAD with its manifest when its store keeps one apart from the config (containerd store)."""
    if not head.engine.containerd_store:
        return head
    m = manifest_of(s, docker_host, head.id, head.arch, cache_root)
    if len(m.layers) != len(head.diff_ids):
        raise ShipError(f"the manifest of {head.name} lists {len(m.layers)} layers, its config "
                        f"{len(head.diff_ids)}: not shipping an image that does not add up")
    return replace(head, manifest=m)


def manifest_of(s: "SSHSession | HostShell", docker_host: str, image_id: str, arch: str, cache_root: str | None,
                timeout: float = 1800.0) -> Manifest:
    """IMAGE_ID's manifest on a containerd-store engine, read out of its `docker save` on that host
    (hostside/image_manifest.py). Kept in <cache_root>/image-manifests/<hex>.json: a manifest digest
    names the same manifest forever, so the answer never goes stale."""
    hex_ = image_id.split(":", 1)[-1]
    path = Path(cache_root) / "image-manifests" / f"{hex_}.json" if cache_root else None
    if path is not None and path.exists():
        try:
            doc = json.loads(path.read_text())
            return Manifest(doc["manifest"], doc["config"], tuple(doc["layers"]))
        except (OSError, ValueError, KeyError):
            pass
    spec = {"save": docker_argv(docker_host, "save", image_id), "image_id": image_id, "arch": arch}
    r = s.run(["python3", "-c", with_layers("image_manifest.py"), json.dumps(spec)], timeout=timeout)
    try:
        doc = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        doc = {"error": (r.stderr or r.stdout).strip()[-400:] or f"exit {r.rc}"}
    if "error" in doc or not doc.get("config"):
        raise ShipError(f"cannot read the manifest of {short(image_id)}: {doc.get('error', 'no config')}", rc=r.rc)
    m = Manifest(doc["manifest"], doc["config"], tuple(doc["layers"]))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(doc) + "\n")
    return m


def history_layer_sizes(text: str, n_layers: int) -> tuple[int, ...] | None:
    """Per-layer sizes from `docker history` (newest first): exact mapping only when unambiguous."""
    try:
        sizes = [int(x) for x in text.split()][::-1]
    except ValueError:
        return None
    nonzero = [x for x in sizes if x > 0]
    if len(nonzero) == n_layers:
        return tuple(nonzero)
    if len(sizes) == n_layers:
        return tuple(sizes)
    return None


@dataclass(frozen=True)
class WorkerImages:
    image_ids: frozenset[str]
    chains: frozenset[str]
    tags: dict[str, tuple[str, ...]] = field(default_factory=dict)     # image ID -> its RepoTags
    layers: dict[str, tuple[str, ...]] = field(default_factory=dict)   # image ID -> its diff_ids
    engine: EngineFacts = EngineFacts("")

    def tagged(self, head: HeadImage, image_id: str | None = None) -> bool:
        """The worker's tag for the image already names IMAGE_ID (default the head's image ID)."""
        return normal_ref(head.name) in self.tags.get(image_id or head.id, ())

    def candidates(self, head: HeadImage) -> list[str]:
        """Images with the head's layers, other IDs than the head's: the same image in another store
        (or another config over the same layers); the one tagged with the image's name first."""
        same = [i for i, d in self.layers.items() if d == head.diff_ids]
        return sorted(same, key=lambda i: (normal_ref(head.name) not in self.tags.get(i, ()), i))


def find_image(head: HeadImage, have: WorkerImages, config_of: Callable[[str], str]) -> str | None:
    """The worker's ID for the head's image, or None when it lacks it. IDs are comparable only within
    one kind of store (stores.py): the same ID; else the head's config digest as a graph-driver
    worker's ID; else, on a containerd-store worker, an image with the same layers whose manifest
    names the same config (CONFIG_OF reads it there)."""
    if head.id in have.image_ids:
        return head.id
    if head.config in have.image_ids:
        return head.config
    if have.engine.containerd_store:
        for candidate in have.candidates(head):
            if config_of(candidate) == head.config:
                return candidate
    return None


def whole_image_reason(head: HeadImage, have: WorkerImages) -> str | None:
    """Why this worker must get every layer even where it has some, or None (a delta is safe)."""
    if have.engine.containerd_store and not head.engine.oci_save:
        return (f"the head's Docker {head.engine.version} saves the legacy archive layout, which a "
                f"containerd-store engine cannot load with layers left out: sending the whole image")
    return None


def normal_ref(ref: str) -> str:
    """How RepoTags spell a reference: an implicit :latest made explicit, docker.io/library/ dropped."""
    for prefix in ("docker.io/library/", "docker.io/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
    return ref if "@" in ref or ":" in ref.rsplit("/", 1)[-1] else ref + ":latest"


def probe_worker(s: "SSHSession", docker_host: str) -> WorkerImages:
    """The worker's engine and every image in it with its tags and layers, in one SSH round trip
    (executors/host_batch.py: through the Engine API where the engine is a unix socket)."""
    items = [docker_argv(docker_host, "info", "--format", INFO_FORMAT),
             docker_argv(docker_host, "image", "ls", "-aq", "--no-trunc"),
             {"argv": docker_argv(docker_host, "image", "inspect", "--format",
                                  "{{.Id}} {{json .RepoTags}} {{json .RootFS.Layers}}"), "ids_from": 1}]
    what = f"cannot read its Docker engine ({docker_host})"
    info, ls, inspect = _batch(s, items, what)
    if info.rc == 0 and ls.rc == 0 and inspect.rc != 0:        # an image went away meanwhile: once more
        info, ls, inspect = _batch(s, items, what)
    bad = next((r for r in (info, ls, inspect) if r.rc != 0), None)
    if bad is not None:
        raise ShipError(f"its Docker engine ({docker_host}) does not answer: "
                        f"{(bad.stderr or bad.stdout).strip()[-500:]}", rc=3 if bad is not inspect else bad.rc)
    first = info.stdout.partition("\n")[0]
    ids, tags, layers, by_id = set(), {}, [], {}
    dec = json.JSONDecoder()
    for line in inspect.stdout.splitlines():
        if not line.strip():
            continue
        image_id, rest = line.split(" ", 1)
        repo_tags, end = dec.raw_decode(rest)
        ids.add(image_id)
        tags[image_id] = tuple(repo_tags or ())
        diffs = json.loads(rest[end:]) or []
        layers.append(diffs)
        by_id[image_id] = tuple(diffs)
    return WorkerImages(frozenset(ids), frozenset(present_chains(layers)), tags, by_id, facts_from_line(first))


def tag_and_verify(s: "SSHSession", docker_host: str, head: HeadImage, image_id: str | None = None) -> None:
    """Point the worker's tag at its ID for the head's image (IMAGE_ID, default the head's ID) and
    check the tag resolves to it with the head's layers (one round trip)."""
    want = image_id or head.id
    tag, r = _batch(s, [docker_argv(docker_host, "tag", want, head.name),
                        docker_argv(docker_host, "image", "inspect", "--format", "{{.Id}} {{json .RootFS.Layers}}",
                                    head.name)], f"cannot tag {head.name} on this worker")
    if tag.rc != 0:
        r = tag
    got, _, layers = r.stdout.strip().partition(" ")
    try:
        same_layers = tuple(json.loads(layers or "null") or ()) == head.diff_ids
    except ValueError:
        same_layers = False
    if r.rc != 0 or got != want or not same_layers:
        theirs = f"{head.id}" + (f" (config {head.config})" if head.config != head.id else "")
        raise ShipError(f"verification failed: {head.name} on this worker is {got or '(missing)'}"
                        + ("" if same_layers or r.rc else " with other layers")
                        + f", the head's is {theirs}"
                        + (f" ({(r.stderr or '').strip()[-300:]})" if r.rc else ""), rc=r.rc or None)


# --------------------------------------------------------------------------------------------------
# The agent

def with_layers(program: str) -> str:
    """hostside/PROGRAM with image_layers.py before it: one standard-library program for `python3 -c`."""
    layers = (HOSTSIDE / "image_layers.py").read_text()
    body = (HOSTSIDE / program).read_text().replace("from __future__ import annotations\n", "")
    return layers + f"\n\n# ---- {program} ----\n" + body


def agent_program() -> str:
    return with_layers("ship_agent.py")


def worker_ssh_argv(worker: "Host", cluster: "Cluster", key_file: str | None, known_hosts: str | None,
                    t: Timeouts) -> list[str]:
    """The head's `ssh worker docker load`: host keys checked, no prompts, dead links detected."""
    argv = ["ssh", "-T", "-p", str(worker.port), "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={int(t.connect_s)}", "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3", "-o", "Compression=no", "-o", "LogLevel=ERROR",
            # OpenSSH's default ciphers, AES-GCM first: with AES instructions (x86 AES-NI, Arm AES)
            # it costs about half of chacha20's CPU per byte (measured here: 300 MB in 3.5 s vs 7.6 s)
            "-o", "Ciphers=" + ",".join(CIPHERS)]
    if key_file:
        argv += ["-i", key_file, "-o", "IdentitiesOnly=yes"]
    if cluster.host_key_checking:
        argv += ["-o", "StrictHostKeyChecking=yes"]
        if known_hosts:
            argv += ["-o", f"UserKnownHostsFile={known_hosts}"]
    else:
        argv += ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"]
    return argv + [f"{worker.user}@{worker.address}", shlex.join(worker_load_argv(worker, t))]


def worker_load_argv(worker: "Host", t: Timeouts) -> list[str]:
    """What runs on the worker: the relay (it stops docker load when the stream goes quiet or ends
    without its end mark, see ship_relay.py) in front of `docker load`."""
    return ["python3", "-c", (HOSTSIDE / "ship_relay.py").read_text(), f"{t.stall_s:g}",
            *docker_argv(worker, "load")]


@dataclass(frozen=True)
class ShipJob:
    """What ship runs for one worker, as planned: the head's `ssh worker ... relay ... docker load`
    argv, the files the head must hold for it (its key, known_hosts), and the timeouts. CHAIN: the
    worker's own `relay ... docker load` (fed by its chain node, orchestrator/ship/chained.py); the
    head then needs no SSH credential for the workers."""
    load_argv: tuple[str, ...]
    need_files: tuple[str, ...]
    timeouts: Timeouts
    chain: bool = False

    def shown(self) -> str:
        """The load command for people, as ssh sends it (its last word is the worker's command line,
        which ssh passes on as is), with the relay program (sent inline) named, not printed."""
        relay = (HOSTSIDE / "ship_relay.py").read_text()
        if self.chain:
            return ("<hostside/chain_node.py> | "
                    + shlex.join(self.load_argv).replace(shlex.quote(relay), "<hostside/ship_relay.py>"))
        relay = shlex.quote(relay)
        *ssh, remote = self.load_argv
        return f"{shlex.join(ssh)} {remote.replace(relay, '<hostside/ship_relay.py>')}"


def ship_job(worker: "Host", cluster: "Cluster", key_file: str | None, known_hosts: str | None,
             t: Timeouts) -> ShipJob:
    if cluster.distribution == "chain":
        return ShipJob(tuple(worker_load_argv(worker, t)), (), t, chain=True)
    need = tuple(p for p in (key_file, known_hosts if cluster.host_key_checking else None) if p)
    return ShipJob(tuple(worker_ssh_argv(worker, cluster, key_file, known_hosts, t)), need, t)


def agent_spec(head: HeadImage, head_host: "Host", sends: dict[str, list[int]], argvs: dict[str, list[str]],
               need_files: list[str], t: Timeouts) -> dict[str, Any]:
    return {"image_id": head.id, "diff_ids": list(head.diff_ids), "blob_diffs": head.blob_diffs(),
            "save": docker_argv(head_host, "save", head.id),
            "workers": [{"name": n, "argv": argvs[n], "send": sends[n]} for n in sorted(sends)],
            "need_files": need_files, "stall_s": t.stall_s, "deadline_s": t.deadline_s,
            "load_timeout_s": t.load_s, "progress_s": 0.5, "queue": 8,
            "heartbeat_s": min(2.0, t.stall_s / 4)}


def run_agent(s: "SSHSession", spec: dict[str, Any], on_event: Callable[[dict], None],
              cancel: threading.Event, t: Timeouts, stdin: bytes = b"") -> dict[str, Any]:
    """Run the agent on the head; each JSON line goes to on_event; returns its final "done" record.
    STDIN: the first line the agent reads with spec env_from_stdin (secrets for its workers)."""
    # Imported here: planning imports this module (plan_sends) and must not load paramiko
    # (tests/test_plan.py test_planning_is_pure). Not a cycle.
    from ..executors.ssh import SSHSilent, SSHTimeout
    argv = ["python3", "-c", agent_program(), json.dumps(spec)]
    done: dict[str, Any] | None = None

    def line(kind: str, text: str) -> None:
        nonlocal done
        if kind != "out":
            return
        try:
            ev = json.loads(text)
        except ValueError:
            return
        if ev.get("ev") == "done":
            done = ev
        on_event(ev)

    # The agent beats every heartbeat_s: silence longer than head_silence_s is a lost head.
    with s.open_exec(argv, keep=16384) as ex:
        if stdin:
            ex.write(stdin)
        try:
            rc = ex.read(line, timeout=t.deadline_s + t.load_s + 120, idle_timeout=t.head_silence_s,
                         cancel=cancel)
        except SSHSilent:
            raise ShipError(f"lost contact with the head: no word from it for {t.head_silence_s:g}s") from None
        except SSHTimeout:
            raise ShipError("the transfer did not finish in time") from None
        if rc is None:
            raise ShipError("cancelled")
        err = ex.stderr
    # leaving the block closes the channel: the agent sees its stdin end and stops what it started
    if done is None:
        tail = err.strip().splitlines()[-10:]
        raise ShipError(f"the ship agent on the head ended without a result: it {exit_text(rc, ssh=True)}",
                        tail=tail, rc=rc)
    return done


# --------------------------------------------------------------------------------------------------
# Reading a worker's result

HINTS = (
    ("no space left on device", "its disk is full: docker load reported 'no space left on device' "
                                "(free space under Docker's data root, or prune old images, then re-run)"),
    ("host key verification failed", "the head does not know its SSH host key (the head's known_hosts "
                                     "needs the worker's key)"),
    ("permission denied", "the head's SSH login to it was refused (the head's key is not authorized there)"),
    ("timeout, server not responding", "the connection from the head was lost mid-transfer (network cut?)"),
    ("connection timed out", "unreachable from the head (connection timed out)"),
    ("no route to host", "unreachable from the head (no route to host)"),
    ("connection refused", "its SSH server refused the head's connection"),
    ("broken pipe", "the connection from the head broke mid-transfer"),
    ("cannot connect to the docker daemon", "its Docker engine does not answer"),
)


def explain(name: str, res: dict[str, Any]) -> str:
    """One clear sentence for a failed worker result from the agent."""
    text = " ".join(res.get("tail") or []).lower()
    why = next((hint for key, hint in HINTS if key in text), None)
    # rc: the head's `ssh worker ... relay ... docker load` (Popen: -N for a signal; the relay
    # reports docker load's own signal as 128+N); not when the agent killed that ssh itself
    rc = res.get("rc")
    killed = describe_exit(rc) if isinstance(rc, int) and not res.get("killed") else None
    base = res.get("error") or f"docker load {killed or f'exited {rc}'}"
    if killed and res.get("error"):
        base = f"{base}; it {killed}"
    return f"{base}; {why}" if why else base


@dataclass
class WorkerOutcome:
    ok: bool
    bytes: int = 0
    layers_sent: list[int] = field(default_factory=list)
    unidentified: int = 0
    stream_s: float = 0.0
    message: str = ""
    rc: int | None = None
    tail: list[str] = field(default_factory=list)
    chain: dict = field(default_factory=dict)      # a chain's hop: upstream, network, forwarded, pass, cut


# --------------------------------------------------------------------------------------------------
# One transfer for all workers (the workers' threads meet in orchestrator/chain/gather.py)

def failed_outcome(name: str, e: Exception) -> WorkerOutcome:
    """A transfer that failed as a whole (or never finished), as WORKER's outcome."""
    if isinstance(e, ShipError):
        return WorkerOutcome(False, message=str(e), tail=e.tail, rc=e.rc)
    if isinstance(e, (TimeoutError, RuntimeError)):
        return WorkerOutcome(False, message=str(e))
    return WorkerOutcome(False, message=f"{type(e).__name__}: {e}")


def outcomes_from(done: dict[str, Any], layer_events: list[dict]) -> dict[str, WorkerOutcome]:
    out = {}
    for name, res in done.get("workers", {}).items():
        sent = sorted(ev["index"] if ev["index"] is not None else -1
                      for ev in layer_events if name in ev.get("to", ()))
        unidentified = sum(1 for ev in layer_events if ev["index"] is None and name in ev.get("to", ()))
        rc = None if res.get("kind") in ("stall", "deadline", "aborted") else res.get("rc")  # we killed it
        o = WorkerOutcome(bool(res.get("ok")), int(res.get("bytes") or 0), sent, unidentified,
                          float(res.get("stream_s") or 0.0), rc=rc, tail=list(res.get("tail") or []))
        if not o.ok:
            o.message = explain(name, res)
        out[name] = o
    return out


def plan_sends(head: HeadImage, have: WorkerImages) -> list[int]:
    if whole_image_reason(head, have):
        return list(range(len(head.diff_ids)))
    return layers_to_send(list(head.diff_ids), set(have.chains))
