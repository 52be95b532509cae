"""The supervisor's detection (hostside/supervisor.py): what is wrong with the group, from the ranks' views and
the API's probes (its /health and a completion), as Findings."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .httpcall import call
from .supervisor_engine import RankView, exit_text

API_KINDS = ("health-failing", "wedge", "serving-errors")
KINDS = ("rank-exited", "rank-missing", "node-rebooted", "memory-low", *API_KINDS)    # what an incident can be
STATES = ("watching", "recovering", "degraded", "paused", "waiting", "failed")
GiB_KIB = 1024 * 1024


@dataclass
class Finding:
    kind: str              # rank-exited | rank-missing | node-rebooted | health-failing | wedge | memory-low
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    act: bool = True       # False: recorded, nothing restarted (rank-missing: someone removed it)
    at: float = field(default_factory=time.time)     # when it was seen (the incident's time)


class Detector:
    """What is wrong, from the views (no I/O: tests/test_supervisor_units.py drives it)."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.boot_ids: dict[str, str] = dict(cfg.get("boot_ids") or {})
        self.health_failures = 0
        self.mem_low_since: dict[str, float] = {}

    def reset(self) -> None:
        """After a restart or a pause: what was counted belongs to the containers before."""
        self.health_failures = 0
        self.mem_low_since.clear()

    def observe(self, ranks: dict[str, RankView], health: tuple[bool, str] | None,
                wedge: tuple[bool, str] | None, now: float) -> Finding | None:
        cfg = self.cfg
        for name, r in ranks.items():             # a boot id that changed: the node rebooted
            if r.boot_id:
                was = self.boot_ids.setdefault(name, r.boot_id)
                if was != r.boot_id:
                    self.boot_ids[name] = r.boot_id
                    return Finding("node-rebooted", f"{name} rebooted (boot id {was[:8]} -> {r.boot_id[:8]})",
                                   {"host": name, "boot_id_before": was, "boot_id": r.boot_id})
        for name, r in ranks.items():
            if r.container is None:
                return Finding("rank-missing", f"{name}: no container of {cfg['deployment']} (removed by "
                                               "someone): not restarting", {"host": name}, act=False)
        stopped = [n for n, r in ranks.items() if not r.running]
        if stopped:
            # the cause: a rank whose own log says its process died (cfg "origin": diagnosis.ORIGIN),
            # else the first to stop (RFC 3339 UTC times sort); the others followed it
            origin = [re.compile(p) for p in cfg.get("origin") or ()]
            name = min(stopped, key=lambda n: (not any(p.search(x) for p in origin for x in ranks[n].log_tail),
                                               (ranks[n].container or {}).get("finished_at") or "~"))
            r = ranks[name]
            return Finding("rank-exited", f"{name}: {r.container.get('name')} {exit_text(r.container)}"
                           + (f" (then {', '.join(n for n in stopped if n != name)})" if len(stopped) > 1 else ""),
                           {"host": name, "container": r.container, "log_tail": r.log_tail,
                            "also_stopped": [n for n in stopped if n != name]})
        floor = cfg.get("mem_floor_kib") or 0
        for name, r in ranks.items():
            if floor and r.mem_kib is not None and r.mem_kib < floor:
                since = self.mem_low_since.setdefault(name, now)
                if now - since >= cfg["mem_sustain_s"]:
                    return Finding("memory-low", f"{name}: MemAvailable {r.mem_kib / GiB_KIB:.1f} GiB below the "
                                                 f"floor {floor / GiB_KIB:.1f} GiB for {now - since:.0f}s",
                                   {"host": name, "mem_available_kib": r.mem_kib, "floor_kib": floor})
            else:
                self.mem_low_since.pop(name, None)
        if health is not None:
            ok, detail = health
            self.health_failures = 0 if ok else self.health_failures + 1
            if self.health_failures >= cfg["health_failures"]:
                return Finding("health-failing", f"{cfg['api']['url']}/health failed {self.health_failures} "
                                                 f"times in a row: {detail}", {"detail": detail})
            if ok and wedge is not None and not wedge[0]:
                if wedge[1].startswith("HTTP"):      # it answered, with an error (vLLM: EngineDeadError)
                    return Finding("serving-errors", f"/health answers but a {cfg['wedge']['max_tokens']}-token "
                                                     f"completion failed: {wedge[1]}", {"detail": wedge[1]})
                return Finding("wedge", f"/health answers but a {cfg['wedge']['max_tokens']}-token completion "
                                        f"did not finish within {cfg['wedge']['timeout_s']:g}s: {wedge[1]}",
                               {"detail": wedge[1]})
        return None


def _request(url: str, key: str | None, body: dict | None, timeout: float) -> tuple[int, bytes]:
    return call(url, key, body, timeout)


def health(api: dict[str, Any], key: str | None) -> tuple[bool, str]:
    try:
        code, _ = _request(api["url"] + "/health", key, None, api["health_timeout_s"])
    except (OSError, ValueError) as e:
        return False, f"{type(e).__name__}: {e}"
    return code == 200, f"HTTP {code}"


def completion(api: dict[str, Any], wedge: dict[str, Any], key: str | None) -> tuple[bool, str]:
    """A small real completion: what /health cannot tell (hasso5703/dgx-spark-qwen38 #2)."""
    body = {"model": api["served_name"], "messages": [{"role": "user", "content": wedge["prompt"]}],
            "max_tokens": wedge["max_tokens"], "temperature": 0}
    t0 = time.monotonic()
    try:
        code, raw = _request(api["url"] + "/v1/chat/completions", key, body, wedge["timeout_s"])
    except (OSError, ValueError) as e:
        return False, f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
    if code != 200:
        return False, f"HTTP {code}: {raw[:200].decode(errors='replace')}"
    try:
        json.loads(raw)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return False, f"HTTP 200 without choices: {raw[:200].decode(errors='replace')}"
    return True, f"answered in {time.monotonic() - t0:.2f}s"
