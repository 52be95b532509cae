"""Human rendering of a benchmark report: measurements with SLO verdicts, Max C, reference comparison."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .report import Report

_FMT = {"ttft_ms": "{:.1f}", "itl_ms": "{:.2f}", "tps": "{:.1f}", "latency_s": "{:.2f}",
        "rps": "{:.3f}", "rps_per_stream": "{:.3f}"}
_TITLES = {"ttft_ms": "TTFT ms", "itl_ms": "ITL ms", "tps": "TPS", "latency_s": "latency s",
           "rps": "RPS", "rps_per_stream": "RPS/C"}


def _fmt(metric: str, value: float | None) -> str:
    return "-" if value is None else _FMT[metric].format(value)


def print_report(rep: Report, console: Console | None = None) -> None:
    c = console or Console(highlight=False, soft_wrap=True)
    cfg, b = rep.config, rep.bench
    c.print(f"[bold]bench[/bold] {escape(str(cfg.get('url')))} model {escape(str(cfg.get('model')))}: "
            f"~{b.input_tokens} input / {b.max_tokens} output tokens, {b.rounds} round(s) per worker, "
            f"C x {b.rounds} requests per level; RPS = completed / wall time, RPS/C per stream")
    if (note := (cfg.get("prompt") or {}).get("note")):
        c.print(f"[yellow]{escape(note)}[/yellow]")
    if rep.warmup.get("errors"):
        c.print(f"[yellow]warm-up: {rep.warmup['errors']}/{rep.warmup['requests']} request(s) failed[/yellow]")

    t = Table(title=f"SLO: TTFT <= {b.ttft_slo_ms:g} ms and TPS >= {b.tps_slo:g} tok/s (means per level)")
    for col in ("C", *(_TITLES[m] for m in ("ttft_ms", "itl_ms", "tps", "latency_s", "rps", "rps_per_stream")),
                "errors", "SLO"):
        t.add_column(col, justify="left" if col == "SLO" else "right")
    for lv, v in zip(rep.levels, rep.verdicts):
        err = f"[red]{lv.errors}/{lv.requests}[/red]" if lv.errors else "0"
        slo = "[green]meets[/green]" if v.meets_slo else "[red]no[/red]"
        t.add_row(str(lv.concurrency), *(_fmt(m, getattr(lv, m)) for m in
                  ("ttft_ms", "itl_ms", "tps", "latency_s", "rps", "rps_per_stream")), err, slo)
    c.print(t)
    if rep.max_c is not None:
        c.print(f"[bold]Max C = {rep.max_c}[/bold] (highest concurrency meeting both targets)")
    else:
        c.print("[bold]Max C: none[/bold] - no level met both targets")
    for lv, v in zip(rep.levels, rep.verdicts):
        if not v.meets_slo:
            c.print(f"C={lv.concurrency} misses the SLO: {escape(v.why)}")
        for msg, n in lv.error_samples:
            c.print(f"[red]C={lv.concurrency}: {n} x {escape(msg)}[/red]")

    if rep.comparison:
        rt = Table(title=f"reference (recipe): ratio = measured / reference; TTFT and TPS flagged beyond "
                         f"{b.tolerance:.0%}")
        for col in ("C", "metric", "measured", "reference", "ratio", ""):
            rt.add_column(col, justify="left" if col in ("metric", "") else "right")
        for row in rep.comparison:
            for m, x in row["metrics"].items():
                ratio = "-" if x["ratio"] is None else f"{x['ratio']:.2f}x"
                flag = "[red]regression[/red]" if x["regression"] else ""
                rt.add_row(str(row["concurrency"]), _TITLES[m], _fmt(m, x["measured"]), _fmt(m, x["reference"]),
                           ratio, flag)
            rt.add_section()
        c.print(rt)
    elif rep.reference:
        c.print("reference: no reference point at the measured concurrency levels")
    else:
        c.print("reference: the recipe has no reference figures")
    for g in rep.regressions:
        c.print(f"[red]regression at C={g.concurrency}: {_TITLES[g.metric]} {_fmt(g.metric, g.measured)} vs "
                f"reference {_fmt(g.metric, g.reference)} ({g.ratio:.2f}x)[/red]")
