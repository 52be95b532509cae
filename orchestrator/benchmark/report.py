"""Benchmark figures, SLO verdicts, Max C, reference comparison and the JSON document. Pure functions.

Failed requests are counted per level and never enter the means; a level with any failed request cannot
meet the SLO; a level where every request failed has no figures (None).

RPS: `rps` = completed requests / wall time of the level (all C streams together). The reports' "requests/s"
(0.23 / 0.16 / 0.10 / 0.07 at C = 1/2/4/8 with latencies 4.39 / 6.13 / 9.96 / 14.81 s) is 1 / latency, i.e.
per stream, so the reference `rps` is compared with `rps_per_stream` = rps / C.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

from ..recipe import BenchPoint, BenchSpec
from ..schema import to_dict
from .loadgen import LevelRun, LoadSpec

SCHEMA = "deployctl.bench/1"
# metric -> (level attribute, reference attribute, direction a regression goes: +1 higher is worse)
COMPARED = {
    "ttft_ms": ("ttft_ms", "ttft_ms", +1),
    "tps": ("tps", "tps", -1),
    "itl_ms": ("itl_ms", "itl_ms", +1),
    "latency_s": ("latency_s", "latency_s", +1),
    "rps_per_stream": ("rps_per_stream", "rps", -1),
}
FLAGGED = ("ttft_ms", "tps")          # metrics whose regressions are flagged (the SLO metrics)


@dataclass(frozen=True)
class LevelStats:
    concurrency: int
    requests: int
    completed: int
    errors: int
    wall_s: float
    ttft_ms: float | None = None
    itl_ms: float | None = None
    tps: float | None = None
    latency_s: float | None = None
    rps: float | None = None
    rps_per_stream: float | None = None
    output_tokens: float | None = None
    prompt_tokens: float | None = None
    error_samples: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Verdict:
    concurrency: int
    meets_slo: bool
    ttft_ok: bool
    tps_ok: bool
    why: str


@dataclass(frozen=True)
class Regression:
    concurrency: int
    metric: str
    measured: float
    reference: float
    ratio: float


@dataclass
class Report:
    config: dict[str, Any]
    levels: list[LevelStats]
    verdicts: list[Verdict]
    max_c: int | None
    comparison: list[dict[str, Any]]
    regressions: list[Regression]
    reference: tuple[BenchPoint, ...]
    bench: BenchSpec
    warmup: dict[str, int] = field(default_factory=dict)

    @property
    def failed_levels(self) -> list[int]:
        return [lv.concurrency for lv in self.levels if lv.errors]

    @property
    def ok(self) -> bool:
        """No regression flagged and no failed request."""
        return not self.regressions and not self.failed_levels


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return fmean(vals) if vals else None


def level_stats(run: LevelRun) -> LevelStats:
    good = [r for r in run.results if r.ok]
    errors = Counter(r.error or "failed" for r in run.results if not r.ok)
    base = dict(concurrency=run.concurrency, requests=len(run.results), completed=len(good),
                errors=sum(errors.values()), wall_s=run.wall_s, error_samples=tuple(errors.most_common(3)))
    if not good:
        return LevelStats(**base)
    rps = len(good) / run.wall_s if run.wall_s > 0 else None
    ttft = _mean([r.ttft_s for r in good])
    itl = _mean([r.itl_s for r in good])
    return LevelStats(
        **base,
        ttft_ms=ttft * 1000 if ttft is not None else None,
        itl_ms=itl * 1000 if itl is not None else None,
        tps=fmean(r.tps for r in good),
        latency_s=fmean(r.latency_s for r in good),
        rps=rps,
        rps_per_stream=rps / run.concurrency if rps is not None else None,
        output_tokens=fmean(r.output_tokens for r in good),
        prompt_tokens=_mean([r.prompt_tokens for r in good]))


def verdict(lv: LevelStats, ttft_slo_ms: float, tps_slo: float) -> Verdict:
    ttft_ok = lv.ttft_ms is not None and lv.ttft_ms <= ttft_slo_ms
    tps_ok = lv.tps is not None and lv.tps >= tps_slo
    why = []
    if lv.errors:
        why.append(f"{lv.errors}/{lv.requests} request(s) failed")
    if lv.completed:
        if not ttft_ok:
            why.append(f"TTFT {lv.ttft_ms:.1f} ms > {ttft_slo_ms:g} ms")
        if not tps_ok:
            why.append(f"TPS {lv.tps:.1f} < {tps_slo:g} tok/s")
    meets = ttft_ok and tps_ok and not lv.errors
    return Verdict(lv.concurrency, meets, ttft_ok, tps_ok, "; ".join(why) if why else "meets both")


def max_concurrency(verdicts: list[Verdict]) -> int | None:
    """The highest concurrency meeting both targets (None when no level does)."""
    passing = [v.concurrency for v in verdicts if v.meets_slo]
    return max(passing) if passing else None


def compare(levels: list[LevelStats], reference: tuple[BenchPoint, ...],
            tolerance: float) -> tuple[list[dict[str, Any]], list[Regression]]:
    """Measured vs reference per level that has a reference point; ratio = measured / reference.

    A regression: TTFT above the reference by more than `tolerance`, or TPS below it by more than
    `tolerance` (relative). The other metrics are shown with their ratios only.
    """
    refs = {p.concurrency: p for p in reference}
    rows, regressions = [], []
    for lv in levels:
        ref = refs.get(lv.concurrency)
        if ref is None:
            continue
        metrics: dict[str, Any] = {}
        for name, (attr, ref_attr, worse) in COMPARED.items():
            r = getattr(ref, ref_attr)
            if r is None:
                continue
            m = getattr(lv, attr)
            ratio = m / r if m is not None and r else None
            flagged = (name in FLAGGED and ratio is not None
                       and (ratio > 1 + tolerance if worse > 0 else ratio < 1 - tolerance))
            metrics[name] = {"measured": m, "reference": r, "ratio": ratio, "regression": flagged}
            if flagged:
                regressions.append(Regression(lv.concurrency, name, m, r, ratio))
        rows.append({"concurrency": lv.concurrency, "metrics": metrics})
    return rows, regressions


def build_report(runs: list[LevelRun], bench: BenchSpec, config: dict[str, Any],
                 warm: LevelRun | None = None) -> Report:
    levels = [level_stats(r) for r in runs]
    verdicts = [verdict(lv, bench.ttft_slo_ms, bench.tps_slo) for lv in levels]
    comparison, regressions = compare(levels, bench.reference, bench.tolerance)
    warmup = {}
    if warm is not None:
        warmup = {"requests": len(warm.results), "errors": sum(not r.ok for r in warm.results)}
    return Report(config, levels, verdicts, max_concurrency(verdicts), comparison, regressions,
                  bench.reference, bench, warmup)


def run_config(spec: LoadSpec, bench: BenchSpec, warmup: bool, **extra: Any) -> dict[str, Any]:
    return {**extra, "url": spec.url, "model": spec.model, "concurrency": list(bench.concurrency),
            "rounds": bench.rounds, "requests_per_level": "concurrency x rounds",
            "input_tokens": bench.input_tokens, "max_tokens": bench.max_tokens, "warmup": warmup,
            "timeout_s": spec.timeout_s, "ttft_slo_ms": bench.ttft_slo_ms, "tps_slo": bench.tps_slo,
            "tolerance": bench.tolerance}


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def to_json(rep: Report) -> dict[str, Any]:
    """The stable document printed by `deployctl bench --json` (keys are only ever added)."""
    levels = []
    for lv in rep.levels:
        levels.append({
            "concurrency": lv.concurrency, "requests": lv.requests, "completed": lv.completed,
            "errors": lv.errors, "wall_s": _r(lv.wall_s), "ttft_ms": _r(lv.ttft_ms, 2),
            "itl_ms": _r(lv.itl_ms, 2), "tps": _r(lv.tps, 2), "latency_s": _r(lv.latency_s),
            "rps": _r(lv.rps, 4), "rps_per_stream": _r(lv.rps_per_stream, 4),
            "output_tokens": _r(lv.output_tokens, 1), "prompt_tokens": _r(lv.prompt_tokens, 1),
            "error_samples": [{"message": m, "count": n} for m, n in lv.error_samples]})
    comparison = [{"concurrency": row["concurrency"],
                   "metrics": {k: {"measured": _r(v["measured"], 4), "reference": v["reference"],
                                   "ratio": _r(v["ratio"]), "regression": v["regression"]}
                               for k, v in row["metrics"].items()}}
                  for row in rep.comparison]
    return {
        "schema": SCHEMA,
        "config": rep.config,
        "warmup": rep.warmup,
        "levels": levels,
        "verdicts": [{"concurrency": v.concurrency, "meets_slo": v.meets_slo, "ttft_ok": v.ttft_ok,
                      "tps_ok": v.tps_ok, "why": v.why} for v in rep.verdicts],
        "max_c": rep.max_c,
        "reference": [{k: v for k, v in to_dict(p).items() if v is not None} for p in rep.reference],
        "comparison": comparison,
        "regressions": [{"concurrency": g.concurrency, "metric": g.metric, "measured": _r(g.measured, 4),
                         "reference": g.reference, "ratio": _r(g.ratio)} for g in rep.regressions],
        "failed_levels": rep.failed_levels,
        "ok": rep.ok,
    }
