"""The health stage's apply: watch every host's container and the head's API together until the
deployment answers and has stayed up, or something fails.

One loop (not one thread per host) because the checks depend on each other: a worker whose
container exits makes the head's API wait forever, so every round looks at all hosts at once.
Each round (every health.poll_interval_s, bounded by health.startup_timeout_s):
- every host's container of the deployment (in parallel over SSH): it must exist, be running, and
  keep the ID and restart count it had when first seen. An exit, a restart or an unreachable host
  fails that host, with its `docker logs --tail` lines;
- the head's API: /health 200, the served name in /v1/models, a real chat completion
  (health.prompt, health.max_tokens, health.request_timeout_s). Until it answers, the last
  progress-looking line of the head's engine log is shown ("Loading weights: 40%");
- once it answered, containers must stay up: health.stay_up_s after the answer when this run
  started them, else until each has been up that long.
"""
from __future__ import annotations

import time
from typing import Any

from rich.markup import escape

from ..deployment import Deployment
from ..outcomes import HostResult
from ..plan import Action
from ..runrecord import HostLog, RunContext
from . import api, diagnosis
from .containers import Container, list_containers, logs_tail
from ..executors.shells import Shells, run_shells
from ..outcomes import parallel
from .results import failure, record

STAGE_NAME = "health"


def apply(dep: Deployment, actions: list[Action], ctx: RunContext) -> list[HostResult]:
    names = [a.host for a in actions]
    logs = {n: ctx.host_log(n, STAGE_NAME) for n in names}
    try:
        with api.http_client(dep.api_key) as client:
            return _Watch(dep, ctx, run_shells(dep.cluster, ctx.state), client, names, logs).run()
    finally:
        for log in logs.values():
            log.close()


class _Watch:
    def __init__(self, dep: Deployment, ctx: RunContext, shells: Shells, client, names: list[str],
                 logs: dict[str, HostLog]):
        self.dep, self.ctx, self.shells, self.client, self.names, self.logs = dep, ctx, shells, client, names, logs
        self.head = dep.cluster.head
        self.first: dict[str, Container] = {}
        self.current: dict[str, Container] = {}

    def result(self, host: str, status: str, message: str, tail: list[str] | None = None,
               data: dict[str, Any] | None = None) -> HostResult:
        return record(self.ctx, self.logs[host], STAGE_NAME, host, status, message, tail=tail or [], data=data)

    # -- one round over the containers -----------------------------------------------------------
    def containers(self) -> dict[str, str]:
        """host -> why its container is not fine (empty: all fine). Updates self.current."""
        res = parallel(self.names, lambda n: list_containers(self.shells[n], self.dep.name))
        bad: dict[str, str] = {}
        for n in self.names:
            v = res[n]
            self.current.pop(n, None)
            if isinstance(v, BaseException):
                bad[n] = f"unreachable or its Docker engine does not answer: {failure(v)}"
                continue
            if not v:
                bad[n] = f"no container of {self.dep.name} (removed? run `deployctl launch`)"
                continue
            if len(v) > 1:
                bad[n] = f"{len(v)} containers of {self.dep.name}: " + ", ".join(c.describe() for c in v)
                continue
            c, seen = v[0], self.first.get(n)
            self.current[n] = c
            if not c.running:
                bad[n] = f"container {c.describe()}"
            elif seen and (c.id != seen.id or c.restart_count != seen.restart_count):
                bad[n] = (f"container {c.name} restarted (was {seen.short_id} with {seen.restart_count} "
                          f"restarts, now {c.short_id} with {c.restart_count})")
            else:
                self.first.setdefault(n, c)
        return bad

    def fail(self, bad: dict[str, str], others: str) -> list[HostResult]:
        """The failed hosts with their log tails; every other host with OTHERS."""
        def tail(n: str) -> list[str]:
            c = self.current.get(n)
            return logs_tail(self.shells[n], c.id) if c else []
        tails = parallel([n for n in bad if n in self.current], tail)
        out = []
        for n in self.names:
            if n in bad:
                t = tails.get(n) if isinstance(tails.get(n), list) else None
                why = diagnosis.cause(t) if t else ""
                out.append(self.result(n, "failed", bad[n] + (f": {why}" if why else ""), tail=t))
            else:
                out.append(self.result(n, "skipped", others))
        return out

    def progress(self) -> str:
        c = self.current.get(self.head)
        if not c:
            return ""
        try:
            return api.progress_line(logs_tail(self.shells[self.head], c.id, 40))
        except Exception:  # noqa: BLE001 - progress is a courtesy
            return ""

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> list[HostResult]:
        dep, ctx = self.dep, self.ctx
        h, e = dep.recipe.health, dep.recipe.engine
        t0 = time.monotonic()
        deadline = t0 + h.startup_timeout_s
        fresh = bool(set(self.names) & ctx.state.launched)
        answered_at: float | None = None
        answer = ""
        last_shown = None
        last = api.ApiCheck(False, "health", "not checked yet")
        while True:
            if ctx.cancel.is_set():
                return [self.result(n, "failed", "cancelled (Ctrl-C)") for n in self.names]
            bad = self.containers()
            if bad:
                return self.fail(bad, f"check stopped: {', '.join(sorted(bad))} failed")
            now = time.monotonic()
            if answered_at is None:
                last = api.check(self.client, dep.api_url, e.served_name, h.prompt, h.max_tokens,
                                 h.request_timeout_s, dep.api_key)
                now = time.monotonic()
                if last.ok:
                    answered_at, answer = now, last.detail
                    self.logs[self.head].write(f"API answered after {now - t0:.1f}s: {answer}")
                    ctx.say(f"  {self.head}: API answered after {now - t0:.0f}s: {escape(answer)}")
                elif last.rejected:
                    return self.rejected(last)
                elif last.fatal:
                    return self.fail({self.head: last.detail}, f"check stopped: the API on {self.head} is wrong")
                else:
                    line = self.progress()
                    shown = line or last.detail
                    self.logs[self.head].write(f"waiting ({now - t0:.0f}s): {last.detail}; engine: {line}")
                    if shown != last_shown:
                        ctx.say(f"  {self.head}: waiting for the API ({now - t0:.0f}s of "
                                f"{h.startup_timeout_s:g}s): {escape(shown)}")
                        last_shown = shown
                    if now >= deadline:
                        return self.timeout(last, now - t0)
            if answered_at is not None:
                ups = [c.uptime_s for c in self.current.values()]
                long_enough = all(u is not None and u >= h.stay_up_s for u in ups)
                waited = now - answered_at >= (h.stay_up_s if fresh else 0.0)
                if long_enough and waited:
                    return self.ok(answer, now - t0)
            ctx.cancel.wait(h.poll_interval_s)

    def rejected(self, last: api.ApiCheck) -> list[HostResult]:
        """The engine is up and refuses the key: a failure of the key, not of the engines. The
        deployment keeps running (no failure cleanup removes it) and the run says so."""
        self.ctx.state.failure_cleanups.clear()
        self.ctx.say(f"  [yellow]the engines are left running:[/yellow] {escape(last.detail)}")
        return [self.result(n, "failed", last.detail) if n == self.head else
                self.result(n, "skipped", "container running; left as it is (the API rejects the key)")
                for n in self.names]

    def timeout(self, last: api.ApiCheck, waited: float) -> list[HostResult]:
        lines = parallel(self.names, lambda n: logs_tail(self.shells[n], self.current[n].id, 20))
        out = []
        for n in self.names:
            t = lines[n] if isinstance(lines[n], list) else []
            if n == self.head:
                out.append(self.result(n, "failed", f"the API did not answer within health.startup_timeout_s "
                                                    f"{self.dep.recipe.health.startup_timeout_s:g}s (waited "
                                                    f"{waited:.0f}s): {last.detail}", tail=t))
            else:
                out.append(self.result(n, "skipped", f"container running; last engine line: "
                                                     f"{api.progress_line(t) or '(none)'}"))
        return out

    def ok(self, answer: str, took: float) -> list[HostResult]:
        out = []
        for n in self.names:
            c = self.current[n]
            msg = f"container {c.describe()}"
            if n == self.head:
                msg = f"API healthy after {took:.0f}s: {answer}; {msg}"
            out.append(self.result(n, "ok", msg, data={"container": c.to_json()}))
        return out
