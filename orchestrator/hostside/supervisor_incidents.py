"""The supervisor's incidents and release history (hostside/supervisor.py): each event's record on the head,
the release the kept previous generation is, and the rollback recorded as a release."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..fsutil import atomic_write_text
from .supervisor_detect import Finding, GiB_KIB
from .supervisor_engine import RankView, exit_text
from .supervisor_host import read_file



def rollback_target(history: list[dict[str, Any]], ranks: dict[str, "RankView"]) -> tuple[dict[str, Any] | None, str]:
    """The release the kept previous generation is (every rank's kept container has that release's
    spec), or why there is none to go back to: it must be an earlier release than the current one,
    map the tables staged now and have served the checkpoint the nodes hold now."""
    if not history:
        return None, "no release history"
    cur = history[-1]
    missing = sorted(n for n, r in ranks.items() if not r.previous)
    if missing:
        return None, f"no previous generation kept on {', '.join(missing)}"
    kept = {n: r.previous.get("spec", "") for n, r in ranks.items()}
    match = [x for x in history[:-1] if {n: (x.get("specs") or {}).get(n, "") for n in ranks} == kept]
    if not match or kept == {n: (cur.get("specs") or {}).get(n, "") for n in ranks}:
        return None, "the kept containers are no earlier release's"
    target = match[-1]
    moved = sorted(n for n, r in ranks.items() if r.container and r.previous.get("tables", "") != r.container.get("tables", ""))
    if moved:
        return None, f"the tables staged on {', '.join(moved)} changed since release {target['number']}"
    if (target.get("checkpoint") or {}) != (cur.get("checkpoint") or {}):
        return None, (f"release {target['number']} served another checkpoint than the nodes hold now "
                      f"(release {cur['number']})")
    return target, ""


class Incidents:
    """Methods of Supervisor (hostside/supervisor.py), moved here as they were."""

    def incident(self, f: Finding, ranks: dict[str, RankView]) -> dict[str, Any]:
        now = f.at
        inc = {"id": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + f"-{f.kind}",
               "deployment": self.cfg["deployment"], "time": now,
               "time_text": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now)),
               "kind": f.kind, "summary": self.mask(f.summary), "evidence": json.loads(self.mask(json.dumps(f.evidence))),
               "ranks": {n: {"container": r.container, "exit": exit_text(r.container) if r.container else "no container",
                             "log_tail": [self.mask(x) for x in r.log_tail], "boot_id": r.boot_id,
                             "report_age_s": round(r.age_s, 1)} for n, r in ranks.items()},
               "mem_available_gib": {n: None if r.mem_kib is None else round(r.mem_kib / GiB_KIB, 2)
                                     for n, r in ranks.items()},
               "specs": {n: (r.container or {}).get("spec", "") for n, r in ranks.items()},
               "images": {n: (r.container or {}).get("image", "") for n, r in ranks.items()},
               "release": self.release(), "actions": [], "outcome": "open", "recovery_s": None}
        self.incident_counts[f.kind] = self.incident_counts.get(f.kind, 0) + 1
        self.write_incident(inc)
        return inc


    def release(self) -> Any:
        last = (self.history() or [None])[-1]
        return {k: last.get(k) for k in ("number", "time", "image_id", "command", "rollback_of", "specs")
                if k in last} if last else None


    def fabric(self) -> dict[str, Any]:
        """The last fabric result `up` left beside the state (launch/supervision.py fabric_summary)."""
        try:
            doc = json.loads(read_file(os.path.join(self.dir, "fabric.json"), "{}") or "{}")
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}


    def write_incident(self, inc: dict[str, Any]) -> None:
        d = os.path.join(self.dir, "incidents")
        os.makedirs(d, exist_ok=True)
        atomic_write_text(os.path.join(d, inc["id"] + ".json"), json.dumps(inc, indent=1) + "\n")
        self.last_incident = {k: inc[k] for k in ("id", "kind", "summary", "time", "outcome")}
        names = sorted(n for n in os.listdir(d) if n.endswith(".json"))
        for old in names[:-self.cfg["keep_incidents"]]:
            os.unlink(os.path.join(d, old))
        self.save_state()


    def history(self) -> list[dict[str, Any]]:
        """The deployment's releases, oldest first (orchestrator/releases.py dump/Release.to_json)."""
        try:
            doc = json.loads(read_file(self.cfg["release_history"], "{}") or "{}")
        except ValueError:
            return []
        items = doc.get("releases", []) if isinstance(doc, dict) else doc
        return sorted((r for r in items if isinstance(r, dict) and "number" in r), key=lambda r: r["number"])


    def record_rollback(self, target: dict[str, Any]) -> int:
        """A release that is TARGET again (as `deployctl rollback` records one), written atomically
        under the lock this process holds (launch/release_store.py writes the same file the same way)."""
        path = self.cfg["release_history"]
        doc = json.loads(read_file(path, "{}") or "{}")
        items = doc.get("releases") or []
        number = max((int(r["number"]) for r in items), default=0) + 1
        items.append({**target, "number": number, "time": time.time(), "command": "supervisor",
                      "rollback_of": target["number"], "run_dir": "", "overrides": list(target.get("overrides") or [])})
        doc["releases"] = items
        atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
        return number
