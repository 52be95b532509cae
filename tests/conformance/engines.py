"""The released engines, from the main test process (standard library only: it has no torch).

`venv_python(engine)` runs .ci/conformance-venv, which answers at once with the venv's python when
the venv is complete and builds it first otherwise (minutes, once per engine version).
`run_probe(name, payload)` runs tests/conformance/probes/<name>.py with that python, JSON in and
JSON out, and raises ProbeError with the probe's error and the tail of its stderr on failure.
`run_probes(name, payloads)` runs it once for several payloads (one process: the engine's imports
once), answers in order.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = ROOT / ".ci" / "conformance-venv"
PROBES = HERE / "probes"
VERSIONS = HERE / "versions.txt"

# which venv each probe runs in
PROBE_ENGINE = {"vllm_argv": "vllm", "vllm_engram_ranges": "vllm", "vllm_auth": "vllm",
                "sglang_argv": "sglang", "sglang_ple_table": "sglang", "sglang_patch": "sglang",
                "sglang_auth": "sglang", "transformers_greedy": "vllm", "vllm_stream_chunks": "vllm"}
BUILD_TIMEOUT_S = 1800
PROBE_TIMEOUT_S = 600
TAIL_LINES = 40


class ProbeError(RuntimeError):
    pass


def versions() -> dict[str, str]:
    """NAME -> VERSION from tests/conformance/versions.txt (the one place they are written)."""
    out = {}
    for line in VERSIONS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, ver = line.split("==", 1)
            out[name.strip()] = ver.strip()
    return out


def _tail(text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-n:])


@functools.lru_cache(maxsize=None)
def venv_python(engine: str) -> str:
    """The python of the conformance venv for `engine` ("vllm" or "sglang"), built if missing."""
    try:
        p = subprocess.run(["bash", str(SCRIPT), engine], capture_output=True, text=True,
                           timeout=BUILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise ProbeError(f"{SCRIPT} {engine} did not finish in {BUILD_TIMEOUT_S} s:\n"
                         f"{_tail(e.stderr or '') if isinstance(e.stderr, str) else ''}") from None
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines or not os.access(lines[-1], os.X_OK):
        raise ProbeError(f"{SCRIPT} {engine} failed (exit {p.returncode}):\n{_tail(p.stderr)}")
    return lines[-1].strip()


def _probe_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env.update(PYTHONNOUSERSITE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def run_probe(name: str, payload: dict[str, Any], timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Run probe `name` in its engine's venv with `payload` on stdin; its JSON answer."""
    if name not in PROBE_ENGINE:
        raise ValueError(f"unknown probe {name!r} (one of {sorted(PROBE_ENGINE)})")
    py = venv_python(PROBE_ENGINE[name])
    script = PROBES / f"{name}.py"
    try:
        p = subprocess.run([py, str(script)], input=json.dumps(payload), capture_output=True,
                           text=True, timeout=timeout, env=_probe_env(), cwd=str(PROBES))
    except subprocess.TimeoutExpired as e:
        err = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        raise ProbeError(f"probe {name} did not answer in {timeout} s; stderr tail:\n{_tail(err)}") from None
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else None
    except (json.JSONDecodeError, IndexError):
        out = None
    if p.returncode != 0 or not isinstance(out, dict):
        why = out.get("probe_error") if isinstance(out, dict) else f"no JSON on stdout ({p.stdout[-500:]!r})"
        tb = out.get("traceback", "") if isinstance(out, dict) else ""
        raise ProbeError(f"probe {name} failed (exit {p.returncode}): {why}\n{tb}"
                         f"stderr tail:\n{_tail(p.stderr)}")
    return out


def run_probes(name: str, payloads: list[dict[str, Any]], timeout: float = PROBE_TIMEOUT_S) -> list[dict[str, Any]]:
    """Probe `name` over every payload in one process (probes/_common.py `run`'s batch); their answers,
    in order. ProbeError naming the payload (its index) and its error when one failed."""
    answers = run_probe(name, {"batch": payloads}, timeout)["batch"]
    for i, ans in enumerate(answers):
        if "probe_error" in ans:
            raise ProbeError(f"probe {name} failed on payload {i}: {ans['probe_error']}\n{ans.get('traceback', '')}")
    return answers
