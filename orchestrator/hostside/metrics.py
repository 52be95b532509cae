"""The Prometheus text exposition format (version 0.0.4), standard library only: what the supervisor's
GET /metrics answers (orchestrator/hostside/supervisor.py), and the engines' own /metrics read back
(`samples`, `in_flight`: the status page on the head, `deployctl status` and the rolling change's drain
on the controller). Format: prometheus/docs content/docs/instrumenting/exposition_formats.md
(HELP/TYPE lines, label values escaped for backslash, double quote and newline, one sample per line)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The engines' own gauges of requests being generated and waiting: released vLLM 0.33.0
# vllm/v1/metrics/loggers.py (vllm:num_requests_running, vllm:num_requests_waiting); released SGLang
# 0.5.23 sglang/srt/observability/metrics_collector.py (sglang:num_running_reqs, sglang:num_queue_reqs).
IN_FLIGHT = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "waiting"}
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEnaNIif]+)")


def _label(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _value(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if isinstance(v, float) and math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) else str(int(v))


@dataclass
class Family:
    """One metric family: name, help, type (gauge|counter) and its samples (labels, value)."""
    name: str
    help: str
    kind: str = "gauge"
    samples: list[tuple[dict[str, object], float]] = field(default_factory=list)

    def add(self, value: float | None, **labels: object) -> "Family":
        if value is not None:
            self.samples.append((labels, value))
        return self


def render(families: list[Family]) -> str:
    out = []
    for f in families:
        out.append(f"# HELP {f.name} {f.help.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        out.append(f"# TYPE {f.name} {f.kind}")
        for labels, value in f.samples:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            out.append(f"{f.name}{{{text}}} {_value(value)}" if text else f"{f.name} {_value(value)}")
    return "\n".join(out) + "\n"


def samples(text: str):
    """(metric name, value) of every sample line of a /metrics text; comments and unreadable lines skipped."""
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                yield m.group(1), float(m.group(3))
            except ValueError:
                continue


def in_flight(text: str) -> dict[str, int] | None:
    """{"running": N, "waiting": M} from an engine's /metrics text (summed over its label sets); None
    when it reports neither (unknown, not 0)."""
    got: dict[str, float] = {}
    for name, v in samples(text):
        k = IN_FLIGHT.get(name)
        if k is not None:
            got[k] = got.get(k, 0.0) + v
    return {k: int(v) for k, v in got.items()} or None
