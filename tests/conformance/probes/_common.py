"""Shared plumbing of the conformance probes (run with the conformance venv's python).

A probe reads one JSON object on stdin and writes one JSON object on stdout. The engines log
to stdout (vLLM's logger does), so `run()` moves fd 1 onto stderr before the probe imports
anything and keeps a private handle on the real stdout for the answer alone.

`{"batch": [payload, ...]}` runs the probe once per payload in this one process and answers
`{"batch": [answer, ...]}` (a failed payload's answer is its probe_error): the engines' imports
cost 5-7 s a process, the probes themselves well under one.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback
from typing import Any, Callable


def _claim_stdout() -> io.TextIOWrapper:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)                     # anything printed from here on (C or Python) goes to stderr
    sys.stdout = sys.stderr
    return out


def run(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    out = _claim_stdout()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        payload = json.load(sys.stdin)
        if isinstance(payload, dict) and set(payload) == {"batch"}:
            result = {"batch": [_one(fn, p) for p in payload["batch"]]}
        else:
            result = fn(payload)
        rc = 0
    except Exception as e:  # noqa: BLE001 - any failure is reported to the caller as data
        result = _failure(e)
        rc = 1
    out.write(json.dumps(result, sort_keys=True))
    out.write("\n")
    out.flush()
    sys.exit(rc)


def _failure(e: BaseException) -> dict[str, Any]:
    return {"probe_error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _one(fn: Callable[[dict[str, Any]], dict[str, Any]], payload: dict[str, Any]) -> dict[str, Any]:
    try:
        return fn(payload)
    except Exception as e:  # noqa: BLE001 - this payload's failure, the others still answered
        return _failure(e)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def captured_stderr():
    """Collect what argparse writes before it exits (usage + 'error: ...')."""
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        yield buf


def argparse_error(buf: io.StringIO, exc: SystemExit) -> str:
    """The parser's own message: from its last 'PROG: error:' line to the end (argparse exits 2;
    a type that validates JSON adds the validator's lines after it)."""
    lines = [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if ": error:" in ln]
    if starts:
        return "\n".join(lines[starts[-1]:]).strip()
    return lines[-1].strip() if lines else f"SystemExit({exc.code})"


def argv_result() -> tuple[dict[str, Any], Callable[[str, str], dict[str, Any]]]:
    """An argv probe's result record and its `fail(stage, msg)`: the first failed check names the
    stage and the engine's message; every check's outcome is kept under "checks"."""
    res: dict[str, Any] = {"ok": False, "stage": None, "error": None, "checks": {},
                           "flags": {}, "parsed": {}}

    def fail(stage: str, msg: str) -> dict[str, Any]:
        res["checks"][stage] = msg
        res.update(stage=stage, error=msg)
        return res
    return res, fail
