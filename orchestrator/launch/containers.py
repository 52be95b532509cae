"""The deployment's containers on one host, through the Docker CLI over SSH (see remote.py).

A container belongs to a deployment by its label `deployctl.deployment=<name>`; its spec digest is
the label `deployctl.spec` (render.py). Removal is always verified by listing again: nothing is
reported "stopped" while a container of the deployment is still there.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from ..apikey import LABEL as API_KEY_LABEL
from ..executors.docker_cli import docker_argv
from ..outcomes import HostFailure
from ..secrets import is_secret_name
from .commands import list_argv, logs_argv
from .memgate import GIB, MEMGATE_SH, mem_available_kib, memgate_argv, memgate_verdict  # noqa: F401
from ..executors.shells import HostShell
from .containerspec import SPEC_LABEL, STOP_TIMEOUT_S, ContainerSpec, env_references

LOG_TAIL = 20

@dataclass(frozen=True)
class Container:
    id: str
    name: str
    status: str                  # created | running | restarting | exited | dead | paused
    exit_code: int
    restart_count: int
    image_id: str
    labels: dict[str, str] = field(default_factory=dict)
    uptime_s: float | None = None     # running: seconds since it started (host clock)
    error: str = ""                   # Docker's State.Error (e.g. a mount that failed)
    oom_killed: bool = False
    finished_s: float | None = None   # stopped: when (epoch seconds, the host's clock)
    image_ref: str = ""               # the image as the container was created with it (a tag, an ID)

    @property
    def running(self) -> bool:
        return self.status == "running"

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @property
    def spec(self) -> str:
        return self.labels.get(SPEC_LABEL, "")

    def describe(self) -> str:
        if self.running:
            up = f", up {fmt_duration(self.uptime_s)}" if self.uptime_s is not None else ""
            return f"{self.name} ({self.short_id}) running{up}, restarts {self.restart_count}"
        why = f", {self.error}" if self.error else (", OOM-killed" if self.oom_killed else "")
        return f"{self.name} ({self.short_id}) {self.status} with exit code {self.exit_code}{why}"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "status": self.status, "exit_code": self.exit_code,
                "restart_count": self.restart_count, "image_id": self.image_id, "spec": self.spec,
                "uptime_s": None if self.uptime_s is None else round(self.uptime_s, 1),
                "rank": self.labels.get("deployctl.rank"), "error": self.error,
                "api_key_id": self.labels.get(API_KEY_LABEL), "oom_killed": self.oom_killed,
                "finished_at": None if self.running or self.finished_s is None else round(self.finished_s, 3)}


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _parse_time(text: str) -> float | None:
    """Docker's RFC 3339 times (nanoseconds, Z) -> epoch seconds; the zero time -> None."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?$", text or "")
    if not m or m.group(1).startswith("0001-"):
        return None
    frac = (m.group(2) or ".0")[:7]
    tz = m.group(3) or "Z"
    dt = datetime.fromisoformat(m.group(1) + frac + ("+00:00" if tz == "Z" else tz))
    return dt.astimezone(timezone.utc).timestamp()


def _container(doc: dict[str, Any], host_now: float | None) -> Container:
    st = doc.get("State") or {}
    started = _parse_time(st.get("StartedAt", ""))
    status = st.get("Status") or ("running" if st.get("Running") else "exited")
    uptime = host_now - started if status == "running" and started and host_now else None
    return Container(id=doc.get("Id", ""), name=(doc.get("Name") or "").lstrip("/"), status=status,
                     exit_code=int(st.get("ExitCode") or 0), restart_count=int(doc.get("RestartCount") or 0),
                     image_id=doc.get("Image", ""), labels=dict((doc.get("Config") or {}).get("Labels") or {}),
                     uptime_s=uptime, error=st.get("Error") or "", oom_killed=bool(st.get("OOMKilled")),
                     finished_s=_parse_time(st.get("FinishedAt", "")),
                     image_ref=(doc.get("Config") or {}).get("Image") or "")


def list_containers(sh: HostShell, deployment: str, timeout: float = 30.0,
                    previous: bool = False) -> list[Container]:
    """Every container (any state) of DEPLOYMENT on the host, by label; the stopped previous
    generation kept for the supervisor's rollback (PREVIOUS_SUFFIX) only when PREVIOUS."""
    r = sh.run(list_argv(sh.host.docker_host, deployment), timeout=timeout)
    return parse_list(r.rc, r.stdout, r.stderr, sh.host.docker_host, previous)


def is_previous(c: Container) -> bool:
    return c.name.endswith(PREVIOUS_SUFFIX)


def parse_list(rc: int, out: str, err: str, docker_host: str, previous: bool = False) -> list[Container]:
    """The output of commands.list_argv: the host's clock, then `docker inspect` JSON (or nothing).
    The previous generation (is_previous) is left out unless PREVIOUS: it never serves, and what
    counts a deployment's containers (launch, status, health) must not see it."""
    lines = out.splitlines()
    if rc == 3 or not lines:
        raise HostFailure(f"the Docker engine {docker_host} does not answer: "
                          f"{(err.strip() or out.strip())[-500:]}", rc=rc)
    try:
        host_now: float | None = float(lines[0].strip())
    except ValueError:
        host_now = None
    body = "\n".join(lines[1:]).strip()
    try:
        docs = json.loads(body) if body else []
    except ValueError:
        raise HostFailure(f"cannot read `docker inspect` output: {body[:200]!r}", rc=rc) from None
    # rc 1 with output: a container vanished between ps and inspect; the others are listed.
    found = (_container(d, host_now) for d in docs)
    return sorted((c for c in found if previous or not is_previous(c)), key=lambda c: c.name)


def logs_tail(sh: HostShell, container: str, lines: int = LOG_TAIL, timeout: float = 30.0) -> list[str]:
    """The container's last LINES log lines (stdout and stderr as the engine interleaved them)."""
    r = sh.run(logs_argv(sh.host.docker_host, container, lines), timeout=timeout)
    return r.stdout.splitlines()[-lines:]


def remove_all(sh: HostShell, deployment: str, stop_timeout: int = STOP_TIMEOUT_S,
               keep: frozenset[str] = frozenset(), keep_previous: bool = False) -> list[Container]:
    """Stop (SIGTERM, then SIGKILL after STOP_TIMEOUT) and remove every container of DEPLOYMENT but
    the ones in KEEP (IDs: launch's prepared containers) and, with KEEP_PREVIOUS, the stopped previous
    generation (is_previous: what the supervisor's rollback returns to), then list again: a container
    still there is a failure naming it (the previous generation too, unless kept). Returns what was
    removed."""
    def kept(c: Container) -> bool:
        return c.id in keep or (keep_previous and is_previous(c))
    found = [c for c in list_containers(sh, deployment, previous=True) if not kept(c)]
    if not found:
        return []
    ids = [c.id for c in found]
    running = [c.id for c in found if c.status in ("running", "restarting", "paused")]
    if running:
        sh.run(sh.docker("stop", "-t", str(stop_timeout), *running), timeout=stop_timeout + 60)
    r = sh.run(sh.docker("rm", "-f", *ids), timeout=120)
    left = [c for c in list_containers(sh, deployment, previous=True) if not kept(c)]
    if left:
        detail = (r.stderr.strip().splitlines() or [""])[-1]
        raise HostFailure(f"{len(left)} container(s) of {deployment} still present after docker stop/rm: "
                          + ", ".join(c.describe() for c in left) + (f" ({detail})" if detail else ""),
                          rc=r.rc)
    return found


def memory_gate(sh: HostShell, drop: bool, min_gib: float, mkdir: str = "",
                timeout: float = 300.0) -> tuple[list[str], str]:
    """Drop the page cache (when DROP), create MKDIR, read MemAvailable and judge it; returns the
    drop lines and the verdict. A host below MIN_GIB raises HostFailure naming it."""
    r = sh.run(memgate_argv(drop, mkdir), timeout=timeout)
    lines = r.stdout.strip().splitlines()
    notes = [x for x in lines if x.startswith("drop:")]
    if r.rc == 5:
        raise HostFailure(f"cannot create {mkdir} (engine.cache_dir): {r.stderr.strip()[-200:]}", rc=r.rc)
    try:
        kib = mem_available_kib(r.stdout)
    except ValueError:
        raise HostFailure(f"cannot read MemAvailable (exit {r.rc}): "
                          f"{(r.stderr.strip() or r.stdout.strip())[-200:]}", rc=r.rc) from None
    ok, msg = memgate_verdict(sh.host.name, kib, min_gib)
    if not ok:
        raise HostFailure("refused: " + msg + (f" [{'; '.join(notes)}]" if notes else ""))
    return notes, msg


PREPARED_SUFFIX = "-next"
# The generation an `up` replaced, stopped and kept under this suffix when the recipe asks the
# supervisor to roll back after giving up (supervise.rollback; hostside/supervisor.py PREVIOUS_SUFFIX)
PREVIOUS_SUFFIX = "-prev"


def keep_as_previous(sh: HostShell, c: Container, stop_timeout: int = STOP_TIMEOUT_S) -> None:
    """Stop C and give it the name of the previous generation (a former one is removed first)."""
    name = f"{c.name}{PREVIOUS_SUFFIX}"
    sh.run(sh.docker("rm", "-f", name), timeout=60)            # absent: nothing to remove
    for argv, t in ((sh.docker("stop", "-t", str(stop_timeout), c.id), stop_timeout + 60),
                    (sh.docker("rename", c.id, name), 60)):
        r = sh.run(argv, timeout=t)
        if r.rc != 0:
            tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-10:]
            raise HostFailure(f"cannot keep {c.name} as {name} (the previous generation): {docker_reason(tail)}",
                              rc=r.rc, tail=tail)


def secret_keys(spec: ContainerSpec) -> list[str]:
    """Variables passed through `--env-file /dev/stdin`, never on a command line: those referring to
    the operator's ${VAR}s (expanded only when starting) and those whose name says secret (a literal
    HF_TOKEN from the recipe or --set: not in the host's `ps` either)."""
    return [k for k, v in spec.env.items() if env_references({k: v}) or is_secret_name(k)]


def run_argv(spec: ContainerSpec, docker_host: str) -> list[str]:
    """The `docker -H ENGINE run -d ...` argv for SPEC: its docker_run_argv, except that variables
    referring to ${VAR}s come from `--env-file /dev/stdin`, so a secret never appears on a command
    line (the host's `ps`) or in a log."""
    secret = secret_keys(spec)
    plain = replace(spec, env={k: v for k, v in spec.env.items() if k not in secret})
    argv = plain.docker_run_argv()
    assert argv[:3] == ["docker", "run", "-d"]
    extra = ["--env-file", "/dev/stdin"] if secret else []
    return docker_argv(docker_host, "run", "-d", *extra, *argv[3:])


def env_file(env: dict[str, str]) -> str:
    for k, v in env.items():
        if "\n" in v:
            raise HostFailure(f"engine.env.{k}: a value with a newline cannot be passed to docker")
    return "".join(f"{k}={v}\n" for k, v in env.items())


def write_secret_file(sh: HostShell, path: str, text: str, timeout: float = 30.0) -> None:
    """TEXT into PATH on the host, mode 0600, atomically; the text goes on stdin (never argv or a log)."""
    script = 'umask 077 && mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv -f "$1.tmp" "$1"'
    r = sh.run(["sh", "-c", script, "sh", path], timeout=timeout, stdin=text)
    if r.rc != 0:
        raise HostFailure(f"cannot write the API key file {path}: {(r.stderr or r.stdout).strip()[-300:]}", rc=r.rc)


def prepared_name(spec: ContainerSpec) -> str:
    """The name a prepared container has until it replaces the running one."""
    return f"{spec.name}{PREPARED_SUFFIX}"


def create_argv(spec: ContainerSpec, docker_host: str) -> list[str]:
    """run_argv as `docker create` under prepared_name: the same options, checked the same way."""
    argv = run_argv(spec, docker_host)
    i = argv.index("run")
    assert argv[i + 1] == "-d"
    argv[i:i + 2] = ["create"]
    argv[argv.index("--name") + 1] = prepared_name(spec)
    return argv


def create(sh: HostShell, spec: ContainerSpec, expanded_env: dict[str, str], timeout: float = 180.0) -> str:
    """docker create SPEC on the host beside the running container (prepare before destroy: what
    Docker would refuse, a bad size, option or image, it refuses here while the old engine still
    serves); returns the container ID. EXPANDED_ENV: the spec's ${VAR} values (see run_argv)."""
    sh.run(sh.docker("rm", "-f", prepared_name(spec)), timeout=60)     # a crashed run's leftover
    secret = {k: expanded_env[k] for k in secret_keys(spec)}
    r = sh.run(create_argv(spec, sh.host.docker_host), timeout=timeout,
               stdin=env_file(secret) if secret else None)
    if r.rc != 0:
        tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-10:]
        raise HostFailure(f"docker create {spec.image} failed (exit {r.rc}): {docker_reason(tail)}",
                          rc=r.rc, tail=tail)
    return r.stdout.strip().splitlines()[-1]


def docker_reason(lines: list[str]) -> str:
    """The line of a docker CLI error that says what is wrong (not its usage hints)."""
    hints = ("Usage:", "See '", "Run '")
    useful = [x.strip() for x in lines if x.strip() and not x.strip().startswith(hints)]
    return useful[0] if useful else (lines[-1] if lines else "")


def start(sh: HostShell, spec: ContainerSpec, cid: str, timeout: float = 180.0) -> str:
    """Give the prepared container CID its real name and start it; returns CID."""
    for argv in (sh.docker("rename", cid, spec.name), sh.docker("start", cid)):
        r = sh.run(argv, timeout=timeout)
        if r.rc != 0:
            tail = (r.stderr.strip() or r.stdout.strip()).splitlines()[-10:]
            raise HostFailure(f"docker {argv[argv.index(cid) - 1]} {spec.name} failed (exit {r.rc}): "
                              f"{docker_reason(tail)}", rc=r.rc, tail=tail)
    return cid


def discard(sh: HostShell, cid: str) -> None:
    """Remove a prepared container that will not be started."""
    sh.run(sh.docker("rm", "-f", cid), timeout=60)
