"""The fabric report as people read it: a host table, the link matrix, the slowest link, the verdicts (pure)."""
from __future__ import annotations

from .model import FabricReport


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _ok(v: bool | None) -> str:
    return "-" if v is None else ("ok" if v else "FAIL")


def lines(r: FabricReport, host: str | None = None) -> list[str]:
    """The report; with HOST only that host's row, its links and its verdicts (its log)."""
    when = f"cached from {r.cached_from}" if r.cached_from else f"measured in {r.seconds:.1f} s"
    out = [f"fabric ({r.topology}): {len(r.hosts)} host(s), {len(r.links)} link(s), {when}"]
    rows = [["host", "netdev", "address", "subnet", "state", "MTU", "speed", "RoCE", "mgmt"]]
    for h in r.hosts:
        if host not in (None, h.name):
            continue
        f = h.fabric
        roce = ",".join(f"{x.get('dev')}:{x.get('state', '').split(':')[-1].strip()}" for x in h.rdma) or "-"
        rows.append([h.name, f.iface if f else "-", f.address if f else "-", (f.network if f else "") or "-",
                     h.operstate or "-", str(h.mtu or "-"),
                     f"{h.speed_mbps / 1000:g}G" if h.speed_mbps else "?", roce, h.management or "-"])
        for name, lk in sorted(h.link_ifaces.items()):
            rows.append(["", name, lk.get("address", ""), "", str(lk.get("operstate") or "-"),
                         str(lk.get("mtu") or "-"), f"{lk['speed_mbps'] / 1000:g}G" if lk.get("speed_mbps") else "?",
                         "", ""])
    out += ["  " + x for x in _table(rows)]
    if r.links:
        rows = [["link", "addresses", "ping", "DF ping", "RTT ms", "TCP Gb/s", "RDMA Gb/s", "expected"]]
        for x in r.links:
            if host not in (None, x.link.a, x.link.b):
                continue
            lk, t = x.link, x.throughput
            reach = all(x.reach.values())
            df = [v for v in x.df.values() if v is not None]
            rate = ("-" if t is None else f"{t.gbps:.2f}" if t.gbps is not None else "error")
            rows.append([lk.name, f"{lk.a_addr} <-> {lk.b_addr}", _ok(reach),
                         f"{x.df_size} {_ok(all(df)) if df else '-'}", f"{x.rtt_ms:.2f}" if x.rtt_ms else "-",
                         rate, "-" if x.rdma is None else f"{x.rdma.gbps:.2f}" if x.rdma.gbps is not None
                         else "error", f"{x.expected_gbps:g}" if x.expected_gbps else "?"])
        out += ["  " + x for x in _table(rows)]
    slow = r.slowest()
    if slow and slow.throughput and slow.throughput.gbps is not None:
        out.append(f"slowest link: {slow.link.name} {slow.throughput.gbps:.2f} Gb/s")
    for f in r.findings:
        if host is not None and host not in f.hosts:
            continue
        out.append(f"{'STOP' if f.stop else 'WARN'} {f.kind} {f.where}: {f.message}")
    out.append("fabric ok" if r.ok else f"fabric NOT ok: {sum(f.stop for f in r.findings)} problem(s) stop the launch")
    return out
