"""The health stage's apply: watch every host's container and the head's API together until the
deployment answers and has stayed up, or something fails.

One loop (not one thread per host) because the checks depend on each other: a worker whose
container exits makes the head's API wait forever, so every round looks at all hosts at once.
Each round (every health.poll_interval_s, bounded by health.startup_timeout_s):
- every host's container of the deployment (in parallel over SSH): it must exist, be running, and
  keep the ID and restart count it had when first seen. An exit, a restart or an unreachable host
  fails that host, with its `docker logs --tail` lines;
- the head's API: /health 200, the served name in /v1/models, a real chat completion
  (health.prompt, health.max_tokens, health.request_timeout_s). Until it answers it is probed every
  API_POLL_S between the rounds, so readiness is seen as it happens, not up to a round later; the
  last progress-looking line of the head's engine log is shown once a round ("Loading weights: 40%");
- once it answered, containers must stay up: health.stay_up_s from the answer to /health of the
  check that passed (its completion runs inside the wait) when this run started them, else until
  each has been up that long. The last round falls on the end of that wait, not on the next poll
  after it.
"""
from __future__ import annotations

import math
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
API_POLL_S = 0.25      # between API probes while the engine is not ready yet


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
        done_at: float | None = None       # answered: when the stay-up wait ends
        next_round = t0                    # the next look at every host's container
        stay_check = math.inf              # answered: one round at done_at, then the rounds decide
        answer = ""
        last_shown = None
        last = api.ApiCheck(False, "health", "not checked yet")
        while True:
            if ctx.cancel.is_set():
                return [self.result(n, "failed", "cancelled (Ctrl-C)") for n in self.names]
            now = time.monotonic()
            round_due = now >= next_round or now >= stay_check
            if round_due:
                bad = self.containers()
                if bad:
                    return self.fail(bad, f"check stopped: {', '.join(sorted(bad))} failed")
                next_round = time.monotonic() + h.poll_interval_s
            if done_at is None:
                asked = time.monotonic()
                last = api.check(self.client, dep.api_url, e.served_name, h.prompt, h.max_tokens,
                                 h.request_timeout_s, dep.api_key)
                now = time.monotonic()
                if last.ok:
                    answer = last.detail
                    # the wait counts from /health's answer: the completion (0.5 s of 8 CPU tokens)
                    # runs inside it, not before it
                    done_at = stay_check = max(now, asked + h.stay_up_s) if fresh else now
                    self.logs[self.head].write(f"API answered after {now - t0:.1f}s: {answer}")
                    ctx.say(f"  {self.head}: API answered after {now - t0:.0f}s: {escape(answer)}")
                    continue
                if last.rejected:
                    return self.rejected(last)
                if last.fatal:
                    return self.fail({self.head: last.detail}, f"check stopped: the API on {self.head} is wrong")
                if round_due:              # the head's log over SSH: once a round, not once a probe
                    line = self.progress()
                    shown = line or last.detail
                    self.logs[self.head].write(f"waiting ({now - t0:.0f}s): {last.detail}; engine: {line}")
                    if shown != last_shown:
                        ctx.say(f"  {self.head}: waiting for the API ({now - t0:.0f}s of "
                                f"{h.startup_timeout_s:g}s): {escape(shown)}")
                        last_shown = shown
                if now >= deadline:
                    return self.timeout(last, now - t0)
                # The API alone is probed every API_POLL_S (a refused connection costs nothing), so
                # the answer is seen within a fraction of a second of the engine's readiness; the
                # containers, over SSH, every poll_interval_s.
                ctx.cancel.wait(max(0.0, min(API_POLL_S, next_round - time.monotonic())))
                continue
            if round_due and now >= done_at:
                # stayed up long enough: every container (also those an earlier run started) up
                # for stay_up_s by now
                ups = [c.uptime_s for c in self.current.values()]
                short = [h.stay_up_s - u for u in ups if u is not None and u < h.stay_up_s]
                if None in ups:
                    short.append(h.poll_interval_s)
                if not short:
                    return self.ok(answer, now - t0)
                stay_check = math.inf
                next_round = min(next_round, now + max(short))
            # wake for the next round or the end of the stay-up wait, whichever comes first
            ctx.cancel.wait(max(0.0, min(next_round, stay_check) - time.monotonic()))

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
