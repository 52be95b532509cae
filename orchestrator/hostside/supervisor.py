"""The deployment's supervisor: what brings a deployment back by itself (issue #35), on the cluster.

`deployctl up` (its `supervise` stage, orchestrator/launch/supervision.py) starts one agent container
per host, from the serving image that is already there (it has python3), with
`--restart unless-stopped`: Docker brings the agent back after its own crash, a restart of the
engine and a reboot. It runs `python3 deployctl-tables-<digest>.pyz supervise /state/config.json`
(this module, standard library only), with the host's Docker socket and its state folder mounted.

- On the head it is the supervisor: it watches its own rank's container and the API, hears each
  worker's agent over HTTP on the head's management address (bearer token, a per-install secret
  in a 0600 file; on a multi-node deployment the firewall chain admits the deployment's hosts
  only), decides, and restarts the whole group the way `up` starts it.
- On a worker it is an agent: it reports its rank's container, MemAvailable, boot id and log tail
  once a second and carries out the head's numbered stop/start orders. It never acts alone.

A multi-node group is restarted as a group, in order (eugr/spark-vllm-docker #257: a head that
restarts alone leaves the cluster orphaned): every rank stopped, the memory gate on the reports,
then the start order of `up` (containerspec.start_sequence: workers first or head first), with the
same containers (`docker start`: the current release's exact specs, nothing re-rendered). With
exponential backoff, at most `max_restarts` in `window_s`; then it marks the deployment failed
and stops trying.

It never fights a person: it acts only while holding the deployment's lock (the flock(2) file
`deployctl up/down/rollback` hold on the head, orchestrator/launch/lock.py), so it is paused while
one of them runs; `down` removes the agents before the engines; a rank whose container is gone
(removed by someone) is not recreated.

Each event leaves an incident record on the head (incidents/<time>-<kind>.json, the last
`keep_incidents` kept); the supervisor's state is state.json. Both are written atomically.
"""
from __future__ import annotations

import hmac
import http.server
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..fsutil import atomic_write_text
from .command_agent import drop_lock, take_lock
from .host_read import EngineAPI
from .httpcall import call
from .metrics import CONTENT_TYPE, Family, render
from . import status_page

SOCKET = "/run/deployctl/docker.sock"    # the host's Docker socket, mounted here
ENGINE_LABEL = "deployctl.deployment"     # the engines' label (launch/containers.py)
TABLES_LABEL = "deployctl.tables"         # the staged tables' digests a rank maps (launch/containerspec.py)
PREVIOUS_SUFFIX = "-prev"                 # the generation an up replaced, kept stopped (launch/containers.py)
LOG_TAIL = 30
REPORT_EVERY_S = 1.0
FAST_REPORT_S = 0.2     # while the head restarts the group: agents report (and take orders) this often
API_KINDS = ("health-failing", "wedge", "serving-errors")
KINDS = ("rank-exited", "rank-missing", "node-rebooted", "memory-low", *API_KINDS)    # what an incident can be
STATES = ("watching", "recovering", "degraded", "paused", "waiting", "failed")
GiB_KIB = 1024 * 1024


# ----------------------------------------------------------------------------------------- engine

class Engine(EngineAPI):
    """The Docker Engine API over the mounted socket (moby api/swagger.yaml: ContainerList,
    ContainerInspect, ContainerStop, ContainerStart, ContainerLogs; unversioned paths)."""

    def __init__(self, path: str = SOCKET, timeout: float = 30.0):
        super().__init__(f"unix://{path}", timeout)

    def _call(self, method: str, url: str, timeout: float | None = None) -> tuple[int, bytes]:
        return self._get(url, method, timeout)

    def containers(self, deployment: str) -> list[dict[str, Any]]:
        """The deployment's engine containers (any state), inspected."""
        q = urllib.parse.urlencode({"all": "1", "filters": json.dumps({"label": [f"{ENGINE_LABEL}={deployment}"]})})
        status, body = self._call("GET", f"/containers/json?{q}")
        if status != 200:
            raise OSError(f"docker ps: HTTP {status}: {body[:200]!r}")
        out = []
        for c in json.loads(body):
            st, doc = self._call("GET", f"/containers/{c['Id']}/json")
            if st == 200:
                out.append(json.loads(doc))
        return out

    def stop(self, cid: str, t: int) -> None:
        status, body = self._call("POST", f"/containers/{cid}/stop?t={t}", timeout=t + 30)
        if status not in (204, 304):
            raise OSError(f"docker stop {cid[:12]}: HTTP {status}: {body[:200]!r}")

    def start(self, cid: str) -> None:
        status, body = self._call("POST", f"/containers/{cid}/start", timeout=120)
        if status not in (204, 304):
            raise OSError(f"docker start {cid[:12]}: HTTP {status}: {body[:200]!r}")

    def remove(self, cid: str) -> None:
        status, body = self._call("DELETE", f"/containers/{cid}?force=1", timeout=60)
        if status not in (204, 404):
            raise OSError(f"docker rm {cid[:12]}: HTTP {status}: {body[:200]!r}")

    def rename(self, cid: str, name: str) -> None:
        status, body = self._call("POST", f"/containers/{cid}/rename?{urllib.parse.urlencode({'name': name})}")
        if status != 204:
            raise OSError(f"docker rename {cid[:12]} {name}: HTTP {status}: {body[:200]!r}")

    def logs_tail(self, cid: str, n: int = LOG_TAIL) -> list[str]:
        status, body = self._call("GET", f"/containers/{cid}/logs?stdout=1&stderr=1&tail={n}")
        if status != 200:
            return [f"(its log could not be read: HTTP {status})"]
        return demux(body).decode(errors="replace").splitlines()[-n:]


def demux(raw: bytes) -> bytes:
    """A non-TTY container's log stream: 8-byte frame headers (stream, 0, 0, 0, size BE32) + payload."""
    out, i = bytearray(), 0
    while i + 8 <= len(raw) and raw[i] in (0, 1, 2) and raw[i + 1:i + 4] == b"\0\0\0":
        size = int.from_bytes(raw[i + 4:i + 8], "big")
        out += raw[i + 8:i + 8 + size]
        i += 8 + size
    return bytes(out) if i else raw


# --------------------------------------------------------------------------------- observation

@dataclass
class RankView:
    """One rank as last seen: its container (None: no container of the deployment on that host)."""
    host: str
    container: dict[str, Any] | None
    boot_id: str = ""
    mem_kib: int | None = None
    age_s: float = 0.0                  # since the report (0 for the head's own rank)
    log_tail: list[str] = field(default_factory=list)
    disk_avail: int | None = None       # bytes free where the state folder is (the host's NVMe folder)
    previous: dict[str, Any] | None = None      # the generation an up replaced, kept stopped (rollback)

    @property
    def running(self) -> bool:
        return bool(self.container) and self.container.get("status") == "running"


def container_view(doc: dict[str, Any]) -> dict[str, Any]:
    st = doc.get("State") or {}
    labels = (doc.get("Config") or {}).get("Labels") or {}
    return {"id": doc.get("Id", ""), "name": (doc.get("Name") or "").lstrip("/"),
            "status": st.get("Status", ""), "exit_code": int(st.get("ExitCode") or 0),
            "oom_killed": bool(st.get("OOMKilled")), "error": st.get("Error") or "",
            "started_at": st.get("StartedAt", ""), "finished_at": st.get("FinishedAt", ""),
            "spec": labels.get("deployctl.spec", ""), "image": doc.get("Image", ""),
            "tables": labels.get(TABLES_LABEL, "")}


def exit_text(c: dict[str, Any]) -> str:
    code = c.get("exit_code", 0)
    sig = ""
    if code > 128:
        try:
            sig = f" ({signal.Signals(code - 128).name})"
        except ValueError:
            pass
    oom = ", OOM-killed by the kernel" if c.get("oom_killed") else ""
    err = f", {c['error']}" if c.get("error") else ""
    return f"{c.get('status')} with exit code {code}{sig}{oom}{err}"


def rollback_target(history: list[dict[str, Any]], ranks: dict[str, "RankView"]) -> tuple[dict[str, Any] | None, str]:
    """The release the kept previous generation is (every rank's kept container has that release's
    spec), or why there is none to go back to: it must be an earlier release than the current one,
    map the tables staged now and have served the checkpoint the nodes hold now."""
    if not history:
        return None, "no release history"
    cur = history[-1]
    missing = sorted(n for n, r in ranks.items() if not r.previous)
    if missing:
        return None, f"no previous generation kept on {', '.join(missing)}"
    kept = {n: r.previous.get("spec", "") for n, r in ranks.items()}
    match = [x for x in history[:-1] if {n: (x.get("specs") or {}).get(n, "") for n in ranks} == kept]
    if not match or kept == {n: (cur.get("specs") or {}).get(n, "") for n in ranks}:
        return None, "the kept containers are no earlier release's"
    target = match[-1]
    moved = sorted(n for n, r in ranks.items() if r.container and r.previous.get("tables", "") != r.container.get("tables", ""))
    if moved:
        return None, f"the tables staged on {', '.join(moved)} changed since release {target['number']}"
    if (target.get("checkpoint") or {}) != (cur.get("checkpoint") or {}):
        return None, (f"release {target['number']} served another checkpoint than the nodes hold now "
                      f"(release {cur['number']})")
    return target, ""


@dataclass
class Finding:
    kind: str              # rank-exited | rank-missing | node-rebooted | health-failing | wedge | memory-low
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    act: bool = True       # False: recorded, nothing restarted (rank-missing: someone removed it)
    at: float = field(default_factory=time.time)     # when it was seen (the incident's time)


class Detector:
    """What is wrong, from the views (no I/O: tests/test_supervisor_units.py drives it)."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.boot_ids: dict[str, str] = dict(cfg.get("boot_ids") or {})
        self.health_failures = 0
        self.mem_low_since: dict[str, float] = {}

    def reset(self) -> None:
        """After a restart or a pause: what was counted belongs to the containers before."""
        self.health_failures = 0
        self.mem_low_since.clear()

    def observe(self, ranks: dict[str, RankView], health: tuple[bool, str] | None,
                wedge: tuple[bool, str] | None, now: float) -> Finding | None:
        cfg = self.cfg
        for name, r in ranks.items():             # a boot id that changed: the node rebooted
            if r.boot_id:
                was = self.boot_ids.setdefault(name, r.boot_id)
                if was != r.boot_id:
                    self.boot_ids[name] = r.boot_id
                    return Finding("node-rebooted", f"{name} rebooted (boot id {was[:8]} -> {r.boot_id[:8]})",
                                   {"host": name, "boot_id_before": was, "boot_id": r.boot_id})
        for name, r in ranks.items():
            if r.container is None:
                return Finding("rank-missing", f"{name}: no container of {cfg['deployment']} (removed by "
                                               "someone): not restarting", {"host": name}, act=False)
        stopped = [n for n, r in ranks.items() if not r.running]
        if stopped:
            # the cause: a rank whose own log says its process died (cfg "origin": diagnosis.ORIGIN),
            # else the first to stop (RFC 3339 UTC times sort); the others followed it
            origin = [re.compile(p) for p in cfg.get("origin") or ()]
            name = min(stopped, key=lambda n: (not any(p.search(x) for p in origin for x in ranks[n].log_tail),
                                               (ranks[n].container or {}).get("finished_at") or "~"))
            r = ranks[name]
            return Finding("rank-exited", f"{name}: {r.container.get('name')} {exit_text(r.container)}"
                           + (f" (then {', '.join(n for n in stopped if n != name)})" if len(stopped) > 1 else ""),
                           {"host": name, "container": r.container, "log_tail": r.log_tail,
                            "also_stopped": [n for n in stopped if n != name]})
        floor = cfg.get("mem_floor_kib") or 0
        for name, r in ranks.items():
            if floor and r.mem_kib is not None and r.mem_kib < floor:
                since = self.mem_low_since.setdefault(name, now)
                if now - since >= cfg["mem_sustain_s"]:
                    return Finding("memory-low", f"{name}: MemAvailable {r.mem_kib / GiB_KIB:.1f} GiB below the "
                                                 f"floor {floor / GiB_KIB:.1f} GiB for {now - since:.0f}s",
                                   {"host": name, "mem_available_kib": r.mem_kib, "floor_kib": floor})
            else:
                self.mem_low_since.pop(name, None)
        if health is not None:
            ok, detail = health
            self.health_failures = 0 if ok else self.health_failures + 1
            if self.health_failures >= cfg["health_failures"]:
                return Finding("health-failing", f"{cfg['api']['url']}/health failed {self.health_failures} "
                                                 f"times in a row: {detail}", {"detail": detail})
            if ok and wedge is not None and not wedge[0]:
                if wedge[1].startswith("HTTP"):      # it answered, with an error (vLLM: EngineDeadError)
                    return Finding("serving-errors", f"/health answers but a {cfg['wedge']['max_tokens']}-token "
                                                     f"completion failed: {wedge[1]}", {"detail": wedge[1]})
                return Finding("wedge", f"/health answers but a {cfg['wedge']['max_tokens']}-token completion "
                                        f"did not finish within {cfg['wedge']['timeout_s']:g}s: {wedge[1]}",
                               {"detail": wedge[1]})
        return None


# --------------------------------------------------------------------------------------- probes

def _request(url: str, key: str | None, body: dict | None, timeout: float) -> tuple[int, bytes]:
    return call(url, key, body, timeout)


def health(api: dict[str, Any], key: str | None) -> tuple[bool, str]:
    try:
        code, _ = _request(api["url"] + "/health", key, None, api["health_timeout_s"])
    except (OSError, ValueError) as e:
        return False, f"{type(e).__name__}: {e}"
    return code == 200, f"HTTP {code}"


def completion(api: dict[str, Any], wedge: dict[str, Any], key: str | None) -> tuple[bool, str]:
    """A small real completion: what /health cannot tell (hasso5703/dgx-spark-qwen38 #2)."""
    body = {"model": api["served_name"], "messages": [{"role": "user", "content": wedge["prompt"]}],
            "max_tokens": wedge["max_tokens"], "temperature": 0}
    t0 = time.monotonic()
    try:
        code, raw = _request(api["url"] + "/v1/chat/completions", key, body, wedge["timeout_s"])
    except (OSError, ValueError) as e:
        return False, f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    if code != 200:
        return False, f"HTTP {code}: {raw[:200].decode(errors='replace')}"
    try:
        json.loads(raw)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return False, f"HTTP 200 without choices: {raw[:200].decode(errors='replace')}"
    return True, f"answered in {time.monotonic() - t0:.2f}s"


# ------------------------------------------------------------------------------------- the host

def read_file(path: str, default: str = "") -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip()
    except OSError:
        return default


def mem_available_kib() -> int | None:
    for line in read_file("/proc/meminfo").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return None


def disk_avail(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def masker(secrets: list[str]) -> Callable[[str], str]:
    """Secrets out of every line kept: the serving key's value and `--api-key X`-like arguments."""
    pat = re.compile(r"(?i)((?:api[-_]?key|token|secret|password)[\"']?\s*[=:]?\s*[\"']?)([^\s\"',]{6,})")
    values = [s for s in secrets if s]

    def mask(line: str) -> str:
        for v in values:
            line = line.replace(v, "***")
        return pat.sub(lambda m: m.group(1) + "***", line)
    return mask


class Local:
    """This host's rank: its container, memory, boot id."""

    def __init__(self, cfg: dict[str, Any], engine: Engine):
        self.cfg, self.engine = cfg, engine
        self.boot_id_file = cfg.get("boot_id_file") or "/proc/sys/kernel/random/boot_id"

    def generations(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """The rank's container and the previous generation kept beside it (None: none)."""
        docs = [container_view(d) for d in self.engine.containers(self.cfg["deployment"])]
        prev = [c for c in docs if c["name"].endswith(PREVIOUS_SUFFIX)]
        docs = sorted((c for c in docs if c not in prev), key=lambda c: c["status"] == "running")   # running last
        return (docs[-1] if docs else None), (prev[0] if prev else None)

    def view(self, mask: Callable[[str], str]) -> RankView:
        c, prev = self.generations()
        tail = [mask(x) for x in self.engine.logs_tail(c["id"])] if c and c["status"] != "running" else []
        return RankView(self.cfg["host"], c, read_file(self.boot_id_file), mem_available_kib(), 0.0, tail,
                        disk_avail(self.cfg.get("disk_path") or "/state"), prev)

    def do(self, verb: str) -> str:
        c, prev = self.generations()
        if verb == "swap":          # the rollback: the kept generation takes the current one's place
            if prev is None:
                raise OSError(f"no previous generation of {self.cfg['deployment']} on {self.cfg['host']}")
            name = prev["name"][:-len(PREVIOUS_SUFFIX)]
            if c is not None:
                self.engine.remove(c["id"])
            self.engine.rename(prev["id"], name)
            return f"removed {c['name'] if c else 'nothing'}; {prev['name']} is {name} again"
        if c is None:
            raise OSError(f"no container of {self.cfg['deployment']} on {self.cfg['host']}")
        if verb == "stop":
            if c["status"] in ("running", "restarting", "paused"):
                self.engine.stop(c["id"], self.cfg["stop_timeout_s"])
            return f"stopped {c['name']}"
        if verb == "start":
            self.engine.start(c["id"])
            return f"started {c['name']}"
        raise ValueError(f"unknown order {verb!r}")


def log(msg: str) -> None:
    print(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) + " " + msg, flush=True)


# ------------------------------------------------------------------------------------- the head

class Supervisor:
    def __init__(self, cfg: dict[str, Any], state_dir: str, engine: Engine):
        self.cfg, self.dir, self.engine = cfg, state_dir, engine
        self.local = Local(cfg, engine)
        self.token = read_file(os.path.join(state_dir, "token"))
        self.key = read_file(os.path.join(state_dir, "api_key")) or None
        self.mask = masker([self.token, self.key or ""])
        self.reports: dict[str, tuple[float, dict[str, Any]]] = {}     # host -> (received, report)
        self.orders: dict[str, dict[str, Any]] = {}                     # host -> {"id", "verb"}
        self.done: dict[str, dict[str, Any]] = {}                       # host -> the last order carried out
        self.lock = threading.Lock()
        self.next_order = int(time.time() * 1000)
        saved = self.load_state()
        same = saved.get("install") == cfg["install"]      # what a previous process of this install kept
        self.restarts: list[float] = [t for t in saved.get("restarts", []) if isinstance(t, (int, float))]
        self.detector = Detector(dict(cfg, boot_ids=saved.get("boot_ids") or {}) if same else cfg)
        self.state = saved.get("state", "watching") if same else "watching"
        self.detail = saved.get("detail", "") if self.state == "failed" else ""
        self.last_incident = saved.get("last_incident") if same else None
        self.failed_ids: list[str] = saved.get("failed_ids", []) if self.state == "failed" else []
        self.restarts_total = int(saved.get("restarts_total", 0)) if same else 0       # counters: per install
        self.incident_counts: dict[str, int] = dict(saved.get("incident_counts") or {}) if same else {}
        self.probes: dict[str, tuple[bool, float]] = {}                                 # probe -> (ok, when)
        self.last_wedge = 0.0
        self.stopping = threading.Event()
        self.wake = threading.Event()          # a worker's rank changed state: tick at once
        self.local_seen: tuple[float, RankView] | None = None       # the last look at this host's rank
        self.locks: dict[str, int] = {}                              # the deployment's lock while acting

    # -- state and incidents -----------------------------------------------------------------
    def load_state(self) -> dict[str, Any]:
        try:
            return json.loads(read_file(os.path.join(self.dir, "state.json"), "{}"))
        except ValueError:
            return {}

    def save_state(self) -> None:
        doc = {"deployment": self.cfg["deployment"], "install": self.cfg["install"], "state": self.state,
               "detail": self.detail, "since": time.time(), "restarts": self.restarts[-50:],
               "boot_ids": self.detector.boot_ids, "last_incident": self.last_incident, "pid": os.getpid(),
               "failed_ids": self.failed_ids, "restarts_total": self.restarts_total,
               "incident_counts": self.incident_counts,
               "workers": {h: {"seen_s_ago": round(time.time() - t, 1)} for h, (t, _) in self.reports.items()}}
        atomic_write_text(os.path.join(self.dir, "state.json"), json.dumps(doc, indent=1) + "\n")

    def set_state(self, state: str, detail: str = "") -> None:
        if (state, detail) != (self.state, self.detail):
            log(f"state {state}" + (f": {detail}" if detail else ""))
        self.state, self.detail = state, detail
        self.save_state()

    def incident(self, f: Finding, ranks: dict[str, RankView]) -> dict[str, Any]:
        now = f.at
        inc = {"id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + f"-{f.kind}",
               "deployment": self.cfg["deployment"], "time": now,
               "time_text": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now)),
               "kind": f.kind, "summary": self.mask(f.summary), "evidence": json.loads(self.mask(json.dumps(f.evidence))),
               "ranks": {n: {"container": r.container, "exit": exit_text(r.container) if r.container else "no container",
                             "log_tail": [self.mask(x) for x in r.log_tail], "boot_id": r.boot_id,
                             "report_age_s": round(r.age_s, 1)} for n, r in ranks.items()},
               "mem_available_gib": {n: None if r.mem_kib is None else round(r.mem_kib / GiB_KIB, 2)
                                     for n, r in ranks.items()},
               "specs": {n: (r.container or {}).get("spec", "") for n, r in ranks.items()},
               "images": {n: (r.container or {}).get("image", "") for n, r in ranks.items()},
               "release": self.release(), "actions": [], "outcome": "open", "recovery_s": None}
        self.incident_counts[f.kind] = self.incident_counts.get(f.kind, 0) + 1
        self.write_incident(inc)
        return inc

    def release(self) -> Any:
        last = (self.history() or [None])[-1]
        return {k: last.get(k) for k in ("number", "time", "image_id", "command", "rollback_of", "specs")
                if k in last} if last else None

    def fabric(self) -> dict[str, Any]:
        """The last fabric result `up` left beside the state (launch/supervision.py fabric_summary)."""
        try:
            doc = json.loads(read_file(os.path.join(self.dir, "fabric.json"), "{}") or "{}")
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def write_incident(self, inc: dict[str, Any]) -> None:
        d = os.path.join(self.dir, "incidents")
        os.makedirs(d, exist_ok=True)
        atomic_write_text(os.path.join(d, inc["id"] + ".json"), json.dumps(inc, indent=1) + "\n")
        self.last_incident = {k: inc[k] for k in ("id", "kind", "summary", "time", "outcome")}
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
        for old in names[:-self.cfg["keep_incidents"]]:
            os.unlink(os.path.join(d, old))
        self.save_state()

    # -- what the workers say ----------------------------------------------------------------
    def sync(self, report: dict[str, Any]) -> dict[str, Any]:
        host = report.get("host")
        if host not in self.cfg["workers"]:
            raise ValueError(f"unknown host {host!r}")
        with self.lock:
            was = self.reports.get(host, (0.0, {}))[1].get("container") or {}
            now = report.get("container") or {}
            if (was.get("id"), was.get("status")) != (now.get("id"), now.get("status")):
                self.wake.set()          # a rank started or stopped: look now, not at the next tick
            self.reports[host] = (time.monotonic(), report)
            if report.get("done"):
                self.done[host] = report["done"]
            return {"order": self.orders.get(host), "report_every_s": self.report_every()}

    def report_every(self) -> float:
        """How often the agents report: fast while a restart waits on their orders and reports."""
        return FAST_REPORT_S if self.state == "recovering" else REPORT_EVERY_S

    def views(self, cached: bool = False) -> dict[str, RankView]:
        """Every rank as last seen: this host's asked of its Docker engine now (CACHED: as the last
        call saw it, its age as the report's age), the workers' from their agents' last reports."""
        seen = self.local_seen
        if cached and seen is not None:
            local = replace(seen[1], age_s=time.monotonic() - seen[0])
        else:
            local = self.local.view(self.mask)
            self.local_seen = (time.monotonic(), local)
        out = {self.cfg["host"]: local}
        now = time.monotonic()
        with self.lock:
            for h in self.cfg["workers"]:
                t, r = self.reports.get(h, (None, None))
                if r is None:
                    continue
                out[h] = RankView(h, r.get("container"), r.get("boot_id", ""), r.get("mem_kib"), now - t,
                                  r.get("log_tail") or [], r.get("disk_avail"), r.get("previous"))
        return out

    def silent(self) -> list[str]:
        now = time.monotonic()
        with self.lock:
            return [h for h in self.cfg["workers"]
                    if h not in self.reports or now - self.reports[h][0] > self.cfg["silent_s"]]

    # -- orders ------------------------------------------------------------------------------
    def order(self, hosts: list[str], verb: str, timeout: float) -> dict[str, str]:
        """Give HOSTS (the head included: done here) VERB; wait until each says it is done.
        Returns {host: problem} for those that did not (an error or silence)."""
        problems: dict[str, str] = {}
        ids = {}
        with self.lock:
            for h in hosts:
                if h == self.cfg["host"]:
                    continue
                self.next_order += 1
                ids[h] = self.next_order
                self.orders[h] = {"id": self.next_order, "verb": verb}
        if self.cfg["host"] in hosts:
            try:
                log(self.local.do(verb))
            except OSError as e:
                problems[self.cfg["host"]] = str(e)
        deadline = time.monotonic() + timeout
        while ids and time.monotonic() < deadline and not self.stopping.is_set():
            with self.lock:
                for h in list(ids):
                    d = self.done.get(h) or {}
                    if d.get("id") == ids[h]:
                        if d.get("error"):
                            problems[h] = d["error"]
                        del ids[h]
            time.sleep(0.2)
        problems.update({h: f"its agent did not carry out `{verb}` within {timeout:g}s" for h in ids})
        return problems

    def wait_for(self, cond: Callable[[dict[str, RankView]], str | None], timeout: float) -> str | None:
        """Poll the views until COND returns None (met); returns COND's last complaint on timeout."""
        deadline = time.monotonic() + timeout
        why: str | None = "not checked"
        while time.monotonic() < deadline and not self.stopping.is_set():
            time.sleep(self.report_every())
            why = cond(self.views())
            if why is None:
                return None
        return why

    def probe(self, name: str, result: tuple[bool, str]) -> tuple[bool, str]:
        self.probes[name] = (result[0], time.time())
        return result

    def ready(self) -> tuple[bool, str]:
        ok, detail = self.probe("health", health(self.cfg["api"], self.key))
        if not ok:
            return False, f"/health: {detail}"
        return self.probe("completion", completion(self.cfg["api"], self.cfg["wedge"], self.key))

    # -- recovery ----------------------------------------------------------------------------
    def recover(self, f: Finding, ranks: dict[str, RankView]) -> None:
        cfg = self.cfg
        now = time.time()
        inc = self.incident(f, ranks)
        log(f"incident {inc['id']}: {inc['summary']}")
        if not f.act:
            inc.update(outcome="not restarted", actions=[{"t": 0, "what": f.summary}])
            self.write_incident(inc)
            self.set_state("paused", f.summary)
            return
        self.restarts = [t for t in self.restarts if now - t < cfg["window_s"]]
        if len(self.restarts) >= cfg["max_restarts"]:
            self.give_up(f, inc, ranks)
            return
        act = self.locked(inc)
        if act is None:
            inc.update(outcome="not restarted: the deployment's lock is held (a deployctl command runs)")
            self.write_incident(inc)
            return
        try:
            delay = 0.0 if not self.restarts else min(cfg["backoff_max_s"], cfg["backoff_s"] * 2 ** (len(self.restarts) - 1))
            self.restarts.append(now)
            self.restarts_total += 1
            self.set_state("recovering", f"{f.kind}: restart {len(self.restarts)} of at most {cfg['max_restarts']} "
                                         f"in {cfg['window_s']:g}s")
            if delay:
                act(f"backoff: waiting {delay:g}s before restart {len(self.restarts)}")
                self.stopping.wait(delay)
            outcome = self.restart_group(act)
            inc.update(outcome=outcome, recovery_s=round(time.time() - f.at, 1))      # from detection
            self.write_incident(inc)
            self.set_state("watching" if outcome == "recovered" else "degraded", "" if outcome == "recovered" else outcome)
        finally:
            self.unlock()
            self.detector.reset()

    def locked(self, inc: dict[str, Any]) -> Callable[[str], None] | None:
        """Take the deployment's lock (None: a deployctl command holds it); returns how each step
        is recorded in INC's actions (offsets from now). unlock() lets it go."""
        cfg = self.cfg
        r = take_lock(self.locks, cfg["lock_file"], f"deployctl supervisor on {cfg['host']} pid {os.getpid()} "
                                                    f"since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        if r["rc"] != 0:
            return None
        t0 = time.monotonic()

        def act(what: str) -> None:
            inc["actions"].append({"t": round(time.monotonic() - t0, 2), "what": self.mask(what)})
            log(what)
            self.write_incident(inc)
        return act

    def unlock(self) -> None:
        drop_lock(self.locks, self.cfg["lock_file"])

    def give_up(self, f: Finding, inc: dict[str, Any], ranks: dict[str, RankView]) -> None:
        """The budget is spent: stop trying; with supervise.rollback, bring the previous release back."""
        cfg = self.cfg
        spent = f"{len(self.restarts)} restarts in the last {cfg['window_s']:g}s"
        inc.update(outcome="gave up", actions=[{"t": 0, "what": f"{spent}: not trying again"}])
        self.write_incident(inc)
        why = f"gave up after {spent} (last: {inc['summary']})"
        if cfg.get("rollback"):
            history = self.history()
            target, no = rollback_target(history, ranks)
            if target is None:
                inc["actions"].append({"t": 0, "what": f"no rollback: {no}"})
                why += f"; no rollback: {no}"
            else:
                act = self.locked(inc)
                if act is None:
                    why += "; no rollback: the deployment's lock is held (a deployctl command runs)"
                else:
                    try:
                        self.set_state("recovering", f"{why}; rolling back to release {target['number']}")
                        outcome = self.roll_back(target, act)
                    finally:
                        self.unlock()
                        self.detector.reset()
                    inc.update(outcome=f"gave up; {outcome}", recovery_s=round(time.time() - f.at, 1))
                    self.write_incident(inc)
                    if outcome.startswith("rolled back"):
                        self.restarts, self.failed_ids = [], []
                        self.set_state("watching", f"{outcome}: release {history[-1]['number']} {why}")
                        return
                    why += f"; {outcome}"
            self.write_incident(inc)
        views = self.views()
        self.failed_ids = sorted((r.container or {}).get("id", "") for r in views.values())
        self.set_state("failed", f"{why}; run `deployctl up` (or `deployctl rollback`) to start it again")

    def roll_back(self, target: dict[str, Any], act: Callable[[str], None]) -> str:
        """Every rank's kept generation (release TARGET) in place of the failed one, started as `up`
        starts a group; recorded as a new release when it serves."""
        everyone = [self.cfg["host"], *self.cfg["workers"]]
        act(f"rolling back to release {target['number']}: its containers, kept stopped on every host")
        bad = self.order(everyone, "swap", self.cfg["stop_timeout_s"] + 60)
        if bad:
            return "rollback failed: " + "; ".join(f"{h}: {p}" for h, p in bad.items())
        outcome = self.restart_group(act)
        if outcome != "recovered":
            return f"rollback to release {target['number']} failed: {outcome}"
        number = self.record_rollback(target)
        act(f"recorded release {number} (rollback of {target['number']})")
        return f"rolled back to release {target['number']} (now release {number})"

    def history(self) -> list[dict[str, Any]]:
        """The deployment's releases, oldest first (orchestrator/releases.py dump/Release.to_json)."""
        try:
            doc = json.loads(read_file(self.cfg["release_history"], "{}") or "{}")
        except ValueError:
            return []
        items = doc.get("releases", []) if isinstance(doc, dict) else doc
        return sorted((r for r in items if isinstance(r, dict) and "number" in r), key=lambda r: r["number"])

    def record_rollback(self, target: dict[str, Any]) -> int:
        """A release that is TARGET again (as `deployctl rollback` records one), written atomically
        under the lock this process holds (launch/release_store.py writes the same file the same way)."""
        path = self.cfg["release_history"]
        doc = json.loads(read_file(path, "{}") or "{}")
        items = doc.get("releases") or []
        number = max((int(r["number"]) for r in items), default=0) + 1
        items.append({**target, "number": number, "time": time.time(), "command": "supervisor",
                      "rollback_of": target["number"], "run_dir": "", "overrides": list(target.get("overrides") or [])})
        doc["releases"] = items
        atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
        return number

    def restart_group(self, act: Callable[[str], None]) -> str:
        cfg = self.cfg
        everyone = [cfg["host"], *cfg["workers"]]
        silent = self.silent()
        if silent:
            return f"not restarted: no report from {', '.join(silent)} (host down or its agent not running)"
        act(f"stopping every rank ({', '.join(everyone)})")
        bad = self.order(everyone, "stop", cfg["stop_timeout_s"] + 30)
        if bad:
            return "stop failed: " + "; ".join(f"{h}: {p}" for h, p in bad.items())
        why = self.wait_for(lambda v: next((f"{n} still {r.container.get('status')}" for n, r in v.items()
                                            if r.running), None), 30)
        if why:
            return f"stop failed: {why}"
        gate = cfg["gate_kib"]
        if gate:
            why = self.wait_for(lambda v: next((f"{n}: MemAvailable {r.mem_kib / GiB_KIB:.1f} GiB < "
                                                f"{gate / GiB_KIB:.1f} GiB" for n, r in v.items()
                                                if r.mem_kib is not None and r.mem_kib < gate), None), 60)
            if why:
                return f"memory gate: {why}"
            act(f"memory gate passed (MemAvailable >= {gate / GiB_KIB:.1f} GiB on every host)")
        for group in cfg["order"]:
            if group == [cfg["host"]] and cfg["wait_before_head_s"]:
                act(f"waiting {cfg['wait_before_head_s']:g}s after the workers before starting the head")
                self.stopping.wait(cfg["wait_before_head_s"])
            act(f"starting {', '.join(group)}")
            bad = self.order(group, "start", 60)
            if bad:
                return "start failed: " + "; ".join(f"{h}: {p}" for h, p in bad.items())
        t_start = time.monotonic()
        deadline = t_start + cfg["startup_timeout_s"]
        while time.monotonic() < deadline and not self.stopping.is_set():
            views = self.views()
            dead = [n for n, r in views.items() if not r.running]
            if dead and time.monotonic() - t_start > 3 * REPORT_EVERY_S:
                n = dead[0]
                return f"{n} exited during the start: {exit_text(views[n].container) if views[n].container else 'gone'}"
            ok, detail = self.ready()
            if ok:
                act(f"ready: the API answers ({detail}) {time.monotonic() - t_start:.1f}s after the start")
                return "recovered"
            time.sleep(cfg["api"]["poll_s"])
        return f"not ready within the startup timeout {cfg['startup_timeout_s']:g}s"

    # -- the loop ----------------------------------------------------------------------------
    def lock_busy(self) -> str | None:
        path = self.cfg["lock_file"]
        locks: dict[str, int] = {}
        r = take_lock(locks, path, None)        # held for an instant, the file (who held it last) left as it is
        if r["rc"] == 0:
            drop_lock(locks, path)
            return None
        return "a deployctl command holds the deployment's lock"

    def tick(self) -> None:
        cfg = self.cfg
        if self.state == "failed":
            self.revive()
            return
        busy = self.lock_busy()
        if busy:
            self.detector.reset()
            self.set_state("paused", busy)
            return
        ranks = self.views()
        missing = [h for h in cfg["workers"] if h not in ranks]
        if missing:
            self.set_state("waiting", f"no report yet from {', '.join(missing)}")
            return
        stale = [h for h, r in ranks.items() if r.age_s > cfg["silent_s"]]
        if stale:
            self.set_state("waiting", f"no report from {', '.join(stale)} for {cfg['silent_s']:g}s")
            return
        if self.state == "paused" and ranks and all(r.container is None for r in ranks.values()):
            return          # nothing deployed any more (a down in progress): keep still
        looked = time.monotonic()
        if all(r.running for r in ranks.values()):
            hc = self.probe("health", health(cfg["api"], self.key))
        else:                           # the API cannot serve without every rank: /metrics says it is down
            hc = None
            self.probes["health"] = (False, time.time())
        wedge = None
        if hc and hc[0] and time.monotonic() - self.last_wedge >= cfg["wedge"]["interval_s"]:
            self.last_wedge = time.monotonic()
            wedge = self.probe("completion", completion(cfg["api"], cfg["wedge"], self.key))
        f = self.detector.observe(ranks, hc, wedge, time.monotonic())
        if f is None:       # a note of watching (a rollback) stays until something else happens
            self.set_state("watching", self.detail if self.state == "watching" else "")
            return
        if f.kind in API_KINDS:
            # The API fails first when a rank dies (the head's next request fails at once): look at the
            # ranks again when a worker reports its rank stopped, or once every agent has reported since
            # the probes began, and name the rank if one stopped (a probe that timed out has already
            # waited that long: no wait).
            self.wake.wait(max(0.0, 2.5 * REPORT_EVERY_S - (time.monotonic() - looked)))
            again = self.views()
            cause = Detector({**cfg, "mem_floor_kib": 0}).observe(again, None, None, time.monotonic())
            if cause is not None and cause.kind == "rank-exited":
                cause.evidence["api"] = f.summary
                cause.at = f.at          # seen when the API failed: the second look only names the rank
                f, ranks = cause, again
        if f.kind == "rank-missing" and self.state == "paused" and self.detail == f.summary:
            return
        self.recover(f, ranks)

    def revive(self) -> None:
        """After giving up: a person brought it back (`deployctl up` made new containers and they all
        run): watch again with a fresh budget. The same containers stay failed."""
        if self.lock_busy():
            return
        ranks = self.views()
        ids = sorted((r.container or {}).get("id", "") for r in ranks.values())
        if len(ranks) == 1 + len(self.cfg["workers"]) and all(r.running for r in ranks.values()) \
                and not set(ids) & set(self.failed_ids):
            self.restarts, self.failed_ids = [], []
            self.detector.reset()
            self.set_state("watching", "")

    # -- what Prometheus reads ----------------------------------------------------------------
    def metrics(self) -> str:
        """GET /metrics: what the supervisor knows, in Prometheus' text format (docs/monitoring.md).
        This host's rank as the loop last saw it: a scrape never waits on the Docker engine, whose
        container list can block while a container of it is being stopped (up to the stop timeout,
        far past a scrape's timeout)."""
        cfg, dep = self.cfg, self.cfg["deployment"]
        ranks = self.views(cached=True)
        rank_of = cfg.get("ranks") or {}
        fam = [Family("deployctl_supervisor_info", "The supervisor of a deployment (1), by install digest")
               .add(1, deployment=dep, host=cfg["host"], install=cfg["install"]),
               Family("deployctl_supervisor_state", "1 for the supervisor's current state, 0 for the others")]
        for s in STATES:
            fam[1].add(self.state == s, deployment=dep, state=s)
        ok, when = Family("deployctl_probe_ok", "1 when the supervisor's last probe passed (health: /health "
                          "with every rank running; completion: a small completion)"), \
            Family("deployctl_probe_timestamp_seconds", "When the probe last ran (Unix time)")
        for name, (passed, t) in sorted(self.probes.items()):
            ok.add(passed, deployment=dep, probe=name)
            when.add(round(t, 3), deployment=dep, probe=name)
        fam += [ok, when]
        running = Family("deployctl_rank_running", "1 when the rank's engine container runs")
        age = Family("deployctl_rank_report_age_seconds", "Since the host's agent last reported (the head: "
                     "since the supervisor last looked at its own rank)")
        mem = Family("deployctl_host_mem_available_bytes", "MemAvailable of the host (/proc/meminfo)")
        disk = Family("deployctl_host_disk_avail_bytes", "Free bytes on the filesystem of the host's nvme_dir")
        for h, r in sorted(ranks.items()):
            lab = {"deployment": dep, "host": h, "rank": rank_of.get(h, "")}
            running.add(r.running, **lab)
            age.add(round(r.age_s, 3), **lab)
            mem.add(None if r.mem_kib is None else r.mem_kib * 1024, **lab)
            disk.add(r.disk_avail, **lab)
        fam += [running, age, mem, disk,
                Family("deployctl_restarts_total", "Group restarts the supervisor began (this install)",
                       "counter").add(self.restarts_total, deployment=dep)]
        inc = Family("deployctl_incidents_total", "Incidents recorded (this install), by kind", "counter")
        for kind in sorted(set(KINDS) | set(self.incident_counts)):
            inc.add(self.incident_counts.get(kind, 0), deployment=dep, kind=kind)
        fam.append(inc)
        last = self.last_incident or {}
        fam.append(Family("deployctl_last_incident_timestamp_seconds", "When the last incident began")
                   .add(last.get("time"), deployment=dep, kind=last.get("kind", "")))
        fab = self.fabric()
        fam.append(Family("deployctl_fabric_check_timestamp_seconds", "When the last passing fabric check ran "
                          "(deployctl up's fabric stage, on the controller)").add(fab.get("at"), deployment=dep))
        tput = Family("deployctl_fabric_link_throughput_bytes", "What each link carried in that check (iperf3, "
                      "src -> dst), bytes/s")
        for lk in fab.get("links") or []:
            if isinstance(lk, dict) and isinstance(lk.get("gbps"), (int, float)):
                tput.add(round(lk["gbps"] * 1e9 / 8), deployment=dep, link=lk.get("link", ""),
                         src=lk.get("src", ""), dst=lk.get("dst", ""))
        fam.append(tput)
        r = self.release() or {}
        fam.append(Family("deployctl_release_number", "The deployment's current release (its history on the head)")
                   .add(r.get("number"), deployment=dep, command=r.get("command", "")))
        fam.append(Family("deployctl_release_timestamp_seconds", "When the current release was made")
                   .add(r.get("time"), deployment=dep))
        return render(fam)

    def serve(self) -> http.server.ThreadingHTTPServer | None:
        sup = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:    # no access log (the token never shows)
                pass

            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = sup.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                auth = self.headers.get("Authorization", "")
                if self.path != "/v1/sync" or not hmac.compare_digest(auth.encode(), f"Bearer {sup.token}".encode()):
                    self.send_error(401 if self.path == "/v1/sync" else 404)
                    return
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                    answer = sup.sync(json.loads(self.rfile.read(min(n, 1 << 20))))
                except (ValueError, TypeError) as e:
                    self.send_error(400, str(e)[:200])
                    return
                body = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        try:
            srv = http.server.ThreadingHTTPServer((self.cfg["listen"], self.cfg["port"]), Handler)
        except OSError as e:
            if self.cfg["workers"]:
                raise               # the agents cannot report: Docker restarts this container
            log(f"cannot listen on {self.cfg['listen']}:{self.cfg['port']} ({e}): no /metrics; supervising anyway")
            return None
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True, name="sync").start()
        log(f"listening on {self.cfg['listen']}:{self.cfg['port']} (/metrics"
            + (f", the reports of {', '.join(self.cfg['workers'])})" if self.cfg["workers"] else ")"))
        return srv

    def run(self) -> int:
        self.serve()
        log(f"supervising {self.cfg['deployment']} (install {self.cfg['install']}), state {self.state}")
        self.save_state()
        while not self.stopping.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the supervisor keeps going; Docker restarts it if it dies
                log(f"tick failed: {type(e).__name__}: {e}")
            self.pause()
        return 0

    def pause(self) -> None:
        """Until the next tick: interval_s, or the completion probe's due time when sooner (a wedge is
        then seen within wedge_interval_s + its bound, not a tick later), or at once when a worker
        reports a change of its rank (or the supervisor is stopped)."""
        wait = self.cfg["interval_s"]
        due = self.last_wedge + self.cfg["wedge"]["interval_s"] - time.monotonic()
        if self.state == "watching" and 0 < due < wait:      # overdue: the probe waits for /health
            wait = due
        self.wake.wait(wait)
        self.wake.clear()


# ------------------------------------------------------------------------------------- a worker

def agent(cfg: dict[str, Any], state_dir: str, engine: Engine, stopping: threading.Event) -> int:
    token = read_file(os.path.join(state_dir, "token"))
    mask = masker([token])
    local = Local(cfg, engine)
    done: dict[str, Any] | None = None
    last_id = None
    url = f"{cfg['head_url']}/v1/sync"
    log(f"agent of {cfg['deployment']} on {cfg['host']}: reporting to {cfg['head_url']}")
    every = REPORT_EVERY_S
    while not stopping.is_set():
        try:
            v = local.view(mask)
            report = {"host": cfg["host"], "container": v.container, "boot_id": v.boot_id, "mem_kib": v.mem_kib,
                      "disk_avail": v.disk_avail, "log_tail": v.log_tail, "previous": v.previous, "done": done}
            code, raw = _request(url, token, report, 10)
            if code == 200:
                answer = json.loads(raw)
                asked = float(answer.get("report_every_s") or REPORT_EVERY_S)
                every = min(max(asked, FAST_REPORT_S), REPORT_EVERY_S)      # never faster, never slower
                order = answer.get("order")
                if order and order.get("id") != last_id:
                    last_id = order["id"]
                    try:
                        log(local.do(order["verb"]))
                        done = {"id": order["id"], "error": ""}
                    except (OSError, ValueError) as e:
                        done = {"id": order["id"], "error": str(e)}
                        log(f"order {order['verb']} failed: {e}")
                    continue         # report the result at once
            else:
                log(f"the supervisor answered HTTP {code}")
        except Exception as e:  # noqa: BLE001 - the head may be down: keep reporting, never act alone
            log(f"report failed: {type(e).__name__}: {e}")
        stopping.wait(every)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: supervise CONFIG.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        cfg = json.load(fh)
    state_dir = os.path.dirname(os.path.abspath(argv[0]))
    engine = Engine(cfg.get("socket") or SOCKET)
    stopping = threading.Event()
    if cfg["role"] == "head":
        sup = Supervisor(cfg, state_dir, engine)
        sup.stopping = stopping
        status_page.start(sup, exit_text, log)      # its own socket and thread (docs/status-page.md)
        signal.signal(signal.SIGTERM, lambda *a: (stopping.set(), sup.wake.set()))
        return sup.run()
    signal.signal(signal.SIGTERM, lambda *a: stopping.set())
    return agent(cfg, state_dir, engine, stopping)
