"""The group's actions (hostside/supervisor.py): orders to the agents, waiting for the ranks, the recovery of
an incident (the whole group restarted in up's order, under the deployment's lock), giving up, rolling back."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from .command_agent import drop_lock, take_lock
from .supervisor_agent import REPORT_EVERY_S
from .supervisor_detect import Finding, GiB_KIB
from .supervisor_engine import RankView, exit_text
from .supervisor_host import log
from .supervisor_incidents import rollback_target



class GroupActions:
    """Methods of Supervisor (hostside/supervisor.py), moved here as they were."""

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
