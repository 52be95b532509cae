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

The code, one concern a module (#58 item 5; moved as it was, behaviour unchanged): supervisor_engine.py
the engine client (Docker over the socket, a rank's view); supervisor_detect.py detection (Detector, the
API probes); supervisor_host.py this host (its rank, memory, masking, the log); supervisor_incidents.py
incidents and the release history; supervisor_actions.py the group's actions (orders, recovery, give up,
roll back); supervisor_metrics.py /metrics and the HTTP server; supervisor_agent.py a worker's agent. This
module: the Supervisor (its state and tick, with the three as mixins) and main; it re-exports the names
the rest of deployctl and the tests use.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from ..fsutil import atomic_write_text
from . import status_page
from .supervisor_engine import SOCKET, ENGINE_LABEL, TABLES_LABEL, PREVIOUS_SUFFIX, LOG_TAIL, Engine, demux, RankView, container_view, exit_text  # noqa: F401
from .supervisor_detect import API_KINDS, KINDS, STATES, GiB_KIB, Finding, Detector, _request, health, completion  # noqa: F401
from .supervisor_host import read_file, mem_available_kib, disk_avail, masker, Local, log  # noqa: F401
from .supervisor_incidents import rollback_target, Incidents  # noqa: F401
from .supervisor_actions import GroupActions  # noqa: F401
from .supervisor_metrics import MetricsServer  # noqa: F401
from .supervisor_agent import REPORT_EVERY_S, FAST_REPORT_S, agent  # noqa: F401


# ------------------------------------------------------------------------------------- the head

class Supervisor(GroupActions, Incidents, MetricsServer):
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


    def probe(self, name: str, result: tuple[bool, str]) -> tuple[bool, str]:
        self.probes[name] = (result[0], time.time())
        return result


    def ready(self) -> tuple[bool, str]:
        ok, detail = self.probe("health", health(self.cfg["api"], self.key))
        if not ok:
            return False, f"/health: {detail}"
        return self.probe("completion", completion(self.cfg["api"], self.cfg["wedge"], self.key))


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
