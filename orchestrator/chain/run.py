"""One pass of a distribution chain: start a node on every host over SSH, wire them, stream, collect.

Every node is hostside/chain_node.py run with the host's python3 (nothing installed, nothing left
behind). The controller starts all nodes at once; each relay reports the port the kernel gave it on
its data address; once all listen, each node is told its next hop and the source starts. The per-run
secret (32 random bytes) goes only into the nodes' SSH channels. A node ends when its stream ends,
when the run's deadline passes, or when its SSH channel closes (the controller gone, Ctrl-C).
"""
from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..signals import exit_text
from .route import Hop

if TYPE_CHECKING:
    from ..inventory import Cluster

SCRIPT = Path(__file__).resolve().parent.parent / "hostside" / "chain_node.py"
# `python3 -c BOOTSTRAP N`: the first N bytes of stdin are the node's source (nothing installed on the
# host), the JSON lines after them its spec and wiring; the name shows in tracebacks and `ps`
BOOTSTRAP = ("import sys;n=int(sys.argv.pop(1));"
             "exec(compile(sys.stdin.buffer.read(n),'deployctl-chain-node','exec'))")
KEEP = 64 * 1024


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0      # SSH to a node
    accept_s: float = 60.0       # a node started, listening and connected to by its upstream
    stall_s: float = 60.0        # no byte from the upstream (or taken by the downstream) for this long
    deadline_s: float = 3600.0   # the whole pass


@dataclass
class NodeOutcome:
    host: str
    upstream: str = ""
    network: str = ""
    done: dict | None = None            # the node's last report ({"ev": "done", ...})
    error: str = ""                     # why the node itself failed (start, SSH, killed): it is dead to this run
    rc: int | None = None
    tail: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)    # files it completed (sha256 checked)
    recv: int = 0
    fwd: int = 0
    stream_s: float = 0.0               # the node's own clock: first to last byte received

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.done and self.done.get("ok"))

    @property
    def dead(self) -> bool:
        """Failed itself, as opposed to cut off by a dead upstream (which a repair pass can finish)."""
        d = self.done or {}
        return bool(self.error) or bool(d.get("bad")) or bool(d.get("local_error")) or self.sink_failed

    @property
    def sink_failed(self) -> bool:
        """Stream mode: the whole stream came and the local command (docker load) still failed."""
        d = self.done or {}
        return d.get("sink_rc") not in (None, 0) and not d.get("up_lost")

    def rate(self) -> float:
        return self.recv / self.stream_s if self.stream_s > 0 else 0.0

    def why(self) -> str:
        if self.error:
            return self.error
        d = self.done or {}
        if d.get("bad"):
            return "received file(s) that do not match the manifest: " + "; ".join(d["bad"][:3])
        if d.get("local_error"):
            return f"it could not write what it received ({d['local_error']}); it still forwarded everything"
        if self.sink_failed:
            return f"the whole stream arrived and its load failed (exit {d['sink_rc']})"
        if d.get("up_lost"):
            return f"cut off from {self.upstream or 'its upstream'}: {d['up_lost']}"
        if d.get("missing_count"):
            return f"{d['missing_count']} file(s) still missing"
        return "no result"


def run_pass(cluster: "Cluster", hops: list[Hop], specs: dict[str, dict], t: Timeouts,
             on_event: Callable[[str, dict], None], cancel: threading.Event | None = None,
             source: "Callable[[str, int, str, str], str] | None" = None) -> dict[str, NodeOutcome]:
    """One pass through HOPS (hops[0] is the source). SPECS: each node's part of its spec (files mode:
    root, files (the source's), need; stream mode: mode, sink). SOURCE: instead of a node on hops[0],
    a function run once the chain is wired, SOURCE(next address, next port, secret, run id) -> "" or
    why it failed (the image: the ship agent on the head). ON_EVENT(host, doc) gets every node report."""
    secret, run_id = secrets.token_hex(32), secrets.token_hex(6)
    script = SCRIPT.read_bytes()
    ports: dict[str, int] = {}
    barrier = threading.Barrier(len(hops), timeout=t.accept_s)
    outs = {h.host: NodeOutcome(h.host, h.upstream, h.network) for h in hops}

    def external(hop: Hop) -> None:
        o = outs[hop.host]
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            o.error = "the chain was not wired: a node failed to start (see it)"
            return
        nxt = hops[1]
        o.error = source(nxt.address, ports[nxt.host], secret, run_id) if source else "no source"
        o.done = {"ok": not o.error}

    def node(i: int, hop: Hop) -> None:
        from ..executors.ssh import SSHError, SSHTarget
        o = outs[hop.host]
        host = cluster.host(hop.host)
        spec = {"role": "source" if i == 0 else "relay", "run": run_id, "secret": secret, "bind": hop.address,
                "stall_s": t.stall_s, "deadline_s": t.deadline_s, "accept_s": t.accept_s, **specs.get(hop.host, {})}
        wired = False
        def line(kind: str, text: str) -> None:
            if kind != "out":
                o.tail = (o.tail + [text])[-20:]
                return
            try:
                doc = json.loads(text)
            except ValueError:
                return
            ev = doc.get("ev")
            if ev in ("p", "done"):
                o.recv, o.fwd = int(doc.get("recv") or 0), int(doc.get("fwd") or 0)
                o.stream_s = float(doc.get("stream_s") or 0.0)
            if ev == "file":
                o.written.append(doc["path"])
            if ev == "done":
                o.done = doc
            on_event(hop.host, doc)

        try:
            with SSHTarget.for_host(host, cluster, t.connect_s).connect() as s:
                with s.open_exec(["python3", "-c", BOOTSTRAP, str(len(script))],
                                 idle_timeout=t.stall_s + 30, keep=KEEP) as ex:
                    ex.write(script + json.dumps(spec).encode() + b"\n")
                    got: dict = {}

                    def started(kind: str, text: str) -> bool:
                        if kind == "out" and text.startswith("{"):
                            got.update(json.loads(text))
                            return got.get("ev") in ("listen", "ready")
                        o.tail = (o.tail + [text])[-20:]
                        return False
                    rc = ex.read(timeout=t.accept_s, until=started)
                    if rc is not None:
                        raise RuntimeError(f"the chain node ended before it was wired ({exit_text(rc, ssh=True)})"
                                           + (": " + o.tail[-1] if o.tail else ""))
                    if "port" in got:
                        ports[hop.host] = int(got["port"])
                    barrier.wait()
                    wired = True
                    nxt = hops[i + 1] if i + 1 < len(hops) else None
                    ex.write(json.dumps({"next": [nxt.address, ports[nxt.host]] if nxt else None}).encode() + b"\n")
                    rc = ex.read(line, timeout=t.deadline_s + 60, idle_timeout=t.stall_s + 30, cancel=cancel)
                    o.rc = rc
                    if rc is None:
                        o.error = "cancelled"
                    elif o.done is None:
                        o.error = (f"its chain node ended without a result ({exit_text(rc, ssh=True)}; "
                                   f"killed, or its host went down?)")
        except threading.BrokenBarrierError:
            o.error = o.error or "the chain was not wired: another node failed to start (see it)"
        except SSHError as e:
            o.error = f"SSH: {e}" if not wired else f"lost during the transfer: {e}"
        except Exception as e:
            o.error = str(e) or type(e).__name__
        if not wired:
            barrier.abort()               # a node that cannot start stops the wiring for all

    threads = [threading.Thread(target=external, args=(h,), daemon=True) if i == 0 and source else
               threading.Thread(target=node, args=(i, h), daemon=True) for i, h in enumerate(hops)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(t.deadline_s + t.accept_s + 120)
    for o in outs.values():
        if o.done is None and not o.error:
            o.error = "its chain node did not end in time"
    return outs


def slowest_note(outs: dict[str, NodeOutcome], hops: list[Hop]) -> str:
    """"; slowest hop: A -> B at R MB/s": the relay with the lowest receive rate, the hop that bounds
    the chain ("" when none received anything)."""
    relays = [outs[h.host] for h in hops[1:] if outs[h.host].rate() > 0]
    if not relays:
        return ""
    low = min(relays, key=NodeOutcome.rate)
    return f"; slowest hop: {low.upstream} -> {low.host} at {low.rate() / 1e6:.1f} MB/s"
