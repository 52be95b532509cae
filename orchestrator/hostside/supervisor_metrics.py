"""The supervisor's HTTP side (hostside/supervisor.py): its Prometheus /metrics and the server the agents
report to (/v1/sync) and Prometheus scrapes."""

from __future__ import annotations

import hmac
import http.server
import json
import threading
from typing import Any

from .metrics import CONTENT_TYPE, Family, render
from .supervisor_detect import KINDS, STATES
from .supervisor_host import log



class MetricsServer:
    """Methods of Supervisor (hostside/supervisor.py), moved here as they were."""

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
