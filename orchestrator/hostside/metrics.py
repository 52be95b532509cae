"""The Prometheus text exposition format (version 0.0.4), standard library only: what the supervisor's
GET /metrics answers (orchestrator/hostside/supervisor.py). Format: prometheus/docs
content/docs/instrumenting/exposition_formats.md (HELP/TYPE lines, label values escaped for
backslash, double quote and newline, one sample per line)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
