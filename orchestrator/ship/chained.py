"""ship with `distribution: chain`: the head sends the image's bytes once.

One `docker save` on the head, filtered to the union of the layers the workers lack (ship_agent.py,
as for a direct ship), goes to the first worker over the fabric; every worker forwards each chunk to
the next as it arrives and feeds its own `ship_relay.py -> docker load` (chain_node.py, stream mode).
The agent's one "worker" is the chain's source on the head (chain_node.py pipe), which gets the
per-run secret in its environment from the controller's channel. A worker gets the layers any worker
lacks; docker load keeps the ones it has.

A node that dies mid-chain is cut out, and the nodes after it get the image in a second pass from
the head (for the checkpoint the second pass starts at the node before the dead one; an image would
first have to be saved from that node's engine, whose store may name it differently).
Verification stays per worker in stages/ship.py: config digest and diff_ids, as for a direct ship.
"""
from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Callable

from ..chain import route
from ..chain.run import NodeOutcome, SCRIPT, Timeouts as ChainTimeouts, run_pass, slowest_note
from ..hostside.chain_node import SECRET_ENV
from . import transfer as tr

if TYPE_CHECKING:
    from ..inventory import Cluster, Host

MAX_PASSES = 2


def source_argv(address: str, port: int, run_id: str, t: tr.Timeouts) -> list[str]:
    """The chain's source on the head: its stdin (the agent's frames) to the first worker."""
    spec = {"role": "source", "mode": "stream", "run": run_id, "next": [address, port], "stall_s": t.stall_s,
            "bind": ""}
    return ["python3", "-c", SCRIPT.read_text(), "pipe", json.dumps(spec)]


def chain_timeouts(t: tr.Timeouts) -> ChainTimeouts:
    return ChainTimeouts(connect_s=t.connect_s, accept_s=max(60.0, 3 * t.connect_s), stall_s=t.stall_s,
                         deadline_s=t.deadline_s + t.load_s)


def transfer(cluster: "Cluster", head_host: "Host", head: tr.HeadImage, sends: dict[str, list[int]],
             t: tr.Timeouts, on_agent: Callable[[dict], None], on_node: Callable[[str, dict], None],
             say: Callable[[str], None], cancel: threading.Event) -> dict[str, tr.WorkerOutcome]:
    from ..executors.ssh import SSHError, SSHTarget
    left = dict(sends)
    results: dict[str, tr.WorkerOutcome] = {}
    dead: list[str] = []
    for n in range(1, MAX_PASSES + 1):
        targets = sorted(left, key=lambda x: cluster.host(x).rank)
        if not targets:
            break
        union = sorted(set().union(*(left[x] for x in targets)))
        hops = route.route(cluster, head_host.name, targets)
        say(f"  ship pass {n}: {len(union)} of {len(head.diff_ids)} layers; {route.networks_note(hops)}")
        specs = {h.host: {"mode": "stream", "sink": tr.worker_load_argv(cluster.host(h.host), t),
                          "sink_timeout_s": t.load_s} for h in hops[1:]}
        unidentified = [0]

        def agent_event(ev: dict) -> None:
            if ev.get("ev") == "layer":
                if ev.get("index") is None and "chain" in ev.get("to", ()):
                    unidentified[0] += 1
                on_agent({**ev, "to": targets if "chain" in ev.get("to", ()) else []})
            elif ev.get("ev") == "p":
                on_agent({**ev, "b": {}})

        def source(address: str, port: int, secret: str, run_id: str) -> str:
            argv = source_argv(address, port, run_id, t)
            spec = {**tr.agent_spec(head, head_host, {"chain": union}, {"chain": argv}, [], t), "env_from_stdin": True}
            try:
                with SSHTarget.for_host(head_host, cluster, t.connect_s).connect() as s:
                    done = tr.run_agent(s, spec, agent_event, cancel, t,
                                        stdin=json.dumps({SECRET_ENV: secret}).encode() + b"\n")
            except (SSHError, tr.ShipError) as e:
                return f"the head's agent: {e}"
            w = done["workers"]["chain"]
            return "" if w.get("ok") else "the head's agent: " + tr.explain(f"the first hop {hops[1].host}", w)

        outs = run_pass(cluster, hops, specs, chain_timeouts(t), on_node, cancel, source=source)
        say(f"  ship pass {n} done{slowest_note(outs, hops)}")
        for h in targets:
            o: NodeOutcome = outs[h]
            d = o.done or {}
            results[h] = tr.WorkerOutcome(
                o.ok, o.recv, list(union), unidentified[0],
                o.stream_s,
                message="" if o.ok else _why(o, outs[head_host.name], d),
                rc=d.get("sink_rc") if d.get("sink_rc") not in (None, 0) else o.rc if o.error else None,
                tail=list(d.get("sink_tail") or o.tail),
                chain={"upstream": o.upstream, "network": o.network, "forwarded": o.fwd, "passes": n,
                       "order": [x.host for x in hops]})
            if o.ok or o.dead:
                left.pop(h)
            if o.dead:
                dead.append(h)
        if not any(h in dead for h in targets):
            break                              # nobody to cut out: a second pass would fail the same way
    for h, r in results.items():
        if not r.ok and h not in dead and dead:
            r.message += f" (cut out of the chain: {', '.join(dead)})"
        if r.chain:
            r.chain["cut"] = [d for d in dead if d != h]
    return results


def _why(o: NodeOutcome, src: NodeOutcome, d: dict) -> str:
    tail = [x for x in d.get("sink_tail") or [] if x.strip()]
    why = o.why()
    if src.error and not o.dead:
        why = f"{why}; the source: {src.error}"
    return why + (f": {tail[-1]}" if tail and o.sink_failed else "")
