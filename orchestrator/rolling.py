"""Replicas changed one at a time (#58; docs/deployments.md "Replicas", docs/router.md "Replicas").

A deployment with `replicas: N` is N ordinary deployments NAME.r1 .. NAME.rN (inventory.py
expand_replicas), each registered with the router as one worker of the model. `up -d NAME` runs `up` of
each replica in turn (roll_order), and stops at the first that fails (its own `up` brought its previous
release back: --rollback-on-failure is on for a roll). Within a replica's `up`, when launch is about to
replace its engine (a new image, argument, table ...; an unchanged replica is never taken out), the
replica first steps out of the router and its in-flight requests finish (step_out_and_drain, called by
launch/launcher.py): out of the router only when another replica of the model is registered (so the model
keeps serving), then the engine's own gauge of running and waiting requests read from its /metrics until
it is 0, within DRAIN_S. Its route stage, after health, puts it back. So at every moment N-1 replicas serve.

The pure parts (requests_in_flight, drain, roll_order) are tested in tests/test_replicas_units.py.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from .hostside import metrics

if TYPE_CHECKING:
    from .deployment import Deployment

DRAIN_S = 120.0              # the bound on waiting for a replica's in-flight requests to finish
DRAIN_POLL_S = 0.5
def requests_in_flight(text: str) -> float | None:
    """The requests an engine is running or holding (its running and waiting gauges, hostside/metrics.py
    in_flight) from its /metrics text; None when it exposes none of them (then the drain cannot read it)."""
    got = metrics.in_flight(text)
    return float(sum(got.values())) if got is not None else None


def requests_served(text: str) -> float | None:
    """The requests an engine finished (vLLM's vllm:request_success_total, summed over its finish reasons;
    SGLang's sglang:num_requests_total) from its /metrics text; None when it exposes neither."""
    got = [v for name, v in metrics.samples(text) if name in ("vllm:request_success_total", "sglang:num_requests_total")]
    return sum(got) if got else None


def drain(read: Callable[[], float | None], bound_s: float = DRAIN_S, poll_s: float = DRAIN_POLL_S,
          clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> tuple[bool, str]:
    """Wait until READ() (the requests in flight) is 0, at most BOUND_S. (drained, what happened). A
    reading that fails (None: no answer, no gauge) ends the wait at once: nothing to wait for that can
    be read (an engine that does not answer serves nothing)."""
    t0 = clock()
    first = last = None
    while True:
        n = read()
        if n is None:
            return True, ("no in-flight gauge could be read: not waited" if first is None
                          else f"drained ({first:g} in flight at first; the engine stopped answering)")
        first = n if first is None else first
        last = n
        if n <= 0:
            return True, (f"drained in {clock() - t0:.1f}s ({first:g} request(s) in flight at first)"
                          if first else "nothing in flight")
        if clock() - t0 >= bound_s:
            return False, f"{last:g} request(s) still in flight after {bound_s:g}s: replaced anyway"
        sleep(poll_s)


def roll_order(names: list[str]) -> list[str]:
    """The replicas in the order a roll changes them: by index (NAME.r1 first). Pure."""
    def index(n: str) -> int:
        tail = n.rsplit(".r", 1)[-1]
        return int(tail) if tail.isdigit() else 0
    return sorted(names, key=index)


def _metrics_text(dep: "Deployment") -> str | None:
    from .hostside import httpcall
    try:
        code, body = httpcall.call(dep.api_url + "/metrics", dep.api_key.value if dep.api_key else None, timeout=5)
    except OSError:
        return None
    return body.decode(errors="replace") if code == 200 else None


def _metrics(dep: "Deployment") -> float | None:
    text = _metrics_text(dep)
    return requests_in_flight(text) if text is not None else None


def served_by(dep: "Deployment") -> float | None:
    """The requests DEP's engine has finished since it started (its own /metrics); None: not readable."""
    text = _metrics_text(dep)
    return requests_served(text) if text is not None else None


def per_replica(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    """Requests each replica finished between two readings (None where either is missing, or the engine
    restarted in between: its counter went back). Pure."""
    out: dict[str, float | None] = {}
    for n, a in after.items():
        b = before.get(n)
        out[n] = a - b if a is not None and b is not None and a >= b else None
    return out


def step_out_and_drain(dep: "Deployment", say: Callable[[str], None]) -> None:
    """Before launch replaces replica DEP's engine: out of the router (when another replica of its model is
    registered there), then its in-flight requests finish (bounded). Never fails the launch: what could
    not be done is said."""
    conf = dep.cluster.router
    if not dep.cluster.replica or conf is None:
        return
    from .executors.shells import HostShell
    from .router import control
    sh = HostShell(dep.cluster, conf.host)
    try:
        try:
            out = control.step_out(dep, sh)
        except Exception as e:  # noqa: BLE001 - said; the launch goes on
            say(f"replica {dep.name}: could not leave the router first ({e}): replaced while it may still get requests")
            return
    finally:
        sh.close()
    say(f"replica {dep.name}: {out}")
    if not out.startswith("out of the router"):
        return
    ok, what = drain(lambda: _metrics(dep))
    say(f"replica {dep.name}: {what}")
