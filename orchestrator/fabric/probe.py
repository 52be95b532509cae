"""What the fabric check runs on the hosts (side effects: SSH through the run's shells).

Per host one round trip for its facts (detect.py FACTS_SCRIPT: netdevs with MTU, speed and state,
RoCE ports, tools) and one for its pings (every peer at once: reachability, then a don't-fragment
ping at the MTU the path must carry). Per link one iperf3 measurement: a one-off server on b bound
to b's fabric address, the client on a bound to a's, so the bytes cross exactly that cable.
Every value that reaches a remote shell is an argv element or a positional parameter of a fixed
script, never spliced into the script text.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..executors.ssh import SSHError
from ..outcomes import HostFailure
from .detect import FACTS_SCRIPT

if TYPE_CHECKING:
    from ..executors.shells import HostShell
    from ..recipe import FabricSpec
    from .topology import Link

ICMP_IP_HEADER = 28          # IPv4 (20) + ICMP (8): ping -s MTU-28 fills exactly one MTU-sized packet

# argv[1]: JSON list of [peer, source address, peer address, DF payload size or 0]. Prints JSON
# {peer: {"reach": bool, "rtt_ms": float|null, "df": bool|null, "detail": str}}. All pings at once.
PING_SCRIPT = r"""
import json, re, subprocess, sys
jobs = json.loads(sys.argv[1])
def start(argv):
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
procs = {}
for peer, src, dst, size in jobs:
    base = ["ping", "-n", "-c", "2", "-i", "0.2", "-W", "1", "-I", src]
    procs[peer] = (start(base + [dst]), start(base + ["-M", "do", "-s", str(size), dst]) if size else None)
def why(text):
    # ping's own error (unreachable, message too long with the local MTU), else the loss summary
    lines = text.strip().splitlines()
    said = [x.strip() for x in lines if "packets transmitted" not in x
            and re.search(r"unreachable|error|too long|mtu|cannot|bind", x, re.I)]
    if said:
        return said[-1]
    loss = [x for x in lines if "packet loss" in x]
    return ("no reply: " + loss[-1].split(",")[2].strip()) if loss and loss[-1].count(",") >= 2 else "no reply"
out = {}
for peer, (p, df) in procs.items():
    text = p.communicate(timeout=15)[0]
    m = re.search(r"= [\d.]+/([\d.]+)/", text)
    rec = {"reach": p.returncode == 0, "rtt_ms": float(m.group(1)) if m else None, "df": None,
           "detail": "" if p.returncode == 0 else why(text)}
    if df is not None:
        dtext = df.communicate(timeout=15)[0]
        rec["df"] = df.returncode == 0
        if df.returncode != 0:
            rec["df_detail"] = why(dtext)
    out[peer] = rec
print(json.dumps(out))
"""

# $1 server address, $2 client address, $3 port, $4 seconds, $5 streams. The server on the other
# host may not listen yet: a refused connection is retried for up to 4 s.
IPERF_CLIENT_SH = r"""
i=0
while :; do
  out=$(iperf3 -c "$1" -B "$2" -p "$3" -t "$4" -P "$5" -J --connect-timeout 2000 2>&1); rc=$?
  case "$out" in
    *"Connection refused"*) i=$((i+1)); if [ "$i" -lt 40 ]; then sleep 0.1; continue; fi ;;
  esac
  printf '%s\n' "$out"; exit "$rc"
done
"""


# The same retry for perftest: its server prints "Waiting for client to connect" once it listens; a
# client started before that fails with "Couldn't connect". $1 server address, $2 HCA, $3 GID index,
# $4 port, $5 seconds, $6 queue pairs.
RDMA_CLIENT_SH = r"""
i=0
while :; do
  out=$(ib_write_bw -d "$2" -x "$3" -p "$4" -D "$5" -q "$6" -F --report_gbits "$1" 2>&1); rc=$?
  case "$out" in
    *"Couldn't connect"*|*"Unable to init the socket"*) i=$((i+1)); if [ "$i" -lt 40 ]; then sleep 0.1; continue; fi ;;
  esac
  printf '%s\n' "$out"; exit "$rc"
done
"""


def read_facts(sh: "HostShell", head_address: str, timeout: float = 30.0) -> dict[str, Any]:
    res = sh.run(["python3", "-c", FACTS_SCRIPT, head_address], timeout=timeout)
    if res.rc != 0:
        raise HostFailure(f"reading the network facts failed (exit {res.rc}): "
                          f"{(res.stderr.strip() or res.stdout.strip())[-300:]}", rc=res.rc)
    try:
        return json.loads(res.stdout)
    except ValueError:
        raise HostFailure(f"reading the network facts failed: {res.stdout.strip()[-300:]!r}") from None


def pings(sh: "HostShell", jobs: list[tuple[str, str, str, int]], timeout: float = 30.0) -> dict[str, Any]:
    """JOBS: (peer, source address, peer address, DF payload size or 0) -> per peer what PING_SCRIPT saw."""
    if not jobs:
        return {}
    res = sh.run(["python3", "-c", PING_SCRIPT, json.dumps([list(j) for j in jobs])], timeout=timeout)
    try:
        return json.loads(res.stdout)
    except ValueError:
        raise HostFailure(f"the pings failed (exit {res.rc}): "
                          f"{(res.stderr.strip() or res.stdout.strip())[-300:]}", rc=res.rc) from None


@dataclass(frozen=True)
class Throughput:
    gbps: float | None              # what b received, Gb/s (None: not measured)
    retransmits: int | None = None
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"gbps": self.gbps, "retransmits": self.retransmits, "error": self.error}


def parse_iperf(text: str) -> Throughput:
    """iperf3 -J output -> what the receiver got (end.sum_received), or the error iperf3 reported."""
    start = text.find("{")
    try:
        doc = json.loads(text[start:]) if start >= 0 else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return Throughput(None, error=(text.strip().splitlines() or ["no output"])[-1][:200])
    if doc.get("error"):
        return Throughput(None, error=str(doc["error"])[:200])
    end = doc.get("end") or {}
    recv = end.get("sum_received") or {}
    if "bits_per_second" not in recv:
        return Throughput(None, error="iperf3 reported no received rate")
    sent = end.get("sum_sent") or {}
    return Throughput(recv["bits_per_second"] / 1e9, sent.get("retransmits"))


def parse_perftest(text: str) -> Throughput:
    """ib_write_bw --report_gbits output -> BW average[Gb/sec] of its result row. The table perftest
    prints (perftest_resources.c print_report_bw; e.g. NVIDIA dgx-spark-playbooks
    performance_benchmarking_guide.md): a header `#bytes #iterations BW peak[Gb/sec] BW average[Gb/sec]
    MsgRate[Mpps]`, then one row per message size; warnings may come between them."""
    lines = text.splitlines()
    head = next((i for i, x in enumerate(lines) if "BW average[Gb/sec]" in x), None)
    if head is None:
        return Throughput(None, error=(text.strip().splitlines() or ["no output"])[-1][:200])
    for line in lines[head + 1:]:
        f = line.split()
        if len(f) >= 4 and f[0].isdigit() and f[1].isdigit():
            try:
                return Throughput(float(f[3]))
            except ValueError:
                break
    return Throughput(None, error="perftest printed no result row")


def rdma(shells: Any, link: "Link", hca_a: str, hca_b: str, gid_index: str, spec: "FabricSpec") -> Throughput:
    """RDMA write bandwidth a -> b with perftest's ib_write_bw over the HCAs backing the link."""
    budget = spec.iperf_seconds + 15
    port = str(spec.iperf_port + 1)
    server_argv = ["timeout", "-k", "2", f"{budget:g}", "ib_write_bw", "-d", hca_b, "-x", gid_index, "-p", port,
                   "-D", f"{spec.iperf_seconds:g}", "-q", str(spec.iperf_streams), "-F", "--report_gbits"]
    client_argv = ["timeout", "-k", "2", f"{budget:g}", "sh", "-c", RDMA_CLIENT_SH, "ib-write-bw-client",
                   link.b_addr, hca_a, gid_index, port, f"{spec.iperf_seconds:g}", str(spec.iperf_streams)]
    return _pair(shells, link, server_argv, client_argv, budget, parse_perftest)


def iperf(shells: Any, link: "Link", spec: "FabricSpec") -> Throughput:
    """One measurement of LINK, a -> b: b runs a one-off server (-1) on its link address, a the client."""
    budget = spec.iperf_seconds + 15
    server_argv = ["timeout", "-k", "2", f"{budget:g}", "iperf3", "-s", "-1", "-B", link.b_addr,
                   "-p", str(spec.iperf_port)]
    client_argv = ["timeout", "-k", "2", f"{budget:g}", "sh", "-c", IPERF_CLIENT_SH, "iperf3-client",
                   link.b_addr, link.a_addr, str(spec.iperf_port), f"{spec.iperf_seconds:g}",
                   str(spec.iperf_streams)]
    return _pair(shells, link, server_argv, client_argv, budget, parse_iperf)


def _pair(shells: Any, link: "Link", server_argv: list[str], client_argv: list[str], budget: float,
          parse) -> Throughput:
    """The server on b (in a thread: b's shell is b's alone this round), then the client on a."""
    server: dict[str, Any] = {}

    def serve() -> None:
        try:
            server["res"] = shells[link.b].run(server_argv, timeout=budget + 5)
        except SSHError as e:
            server["err"] = e

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        res = shells[link.a].run(client_argv, timeout=budget + 5)
    except SSHError as e:
        t.join(budget + 6)
        return Throughput(None, error=f"{link.a}: {e}")
    t.join(budget + 6)
    out = parse(res.stdout)
    if out.gbps is None and "res" in server and server["res"].rc not in (0, None):
        srv = server["res"]
        why = (srv.stderr.strip() or srv.stdout.strip()).splitlines()[-1:] or [f"exit {srv.rc}"]
        return Throughput(None, error=f"{out.error}; server on {link.b}: {why[0][:160]}")
    return out
