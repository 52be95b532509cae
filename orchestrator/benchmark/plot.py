"""TTFT and TPS against concurrency (two panels): measured, reference and the SLO lines. PNG via Agg."""
from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..fsutil import atomic_write_bytes
from .report import Report

MEASURED, REFERENCE = "measured", "reference (recipe)"


def build_figure(rep: Report) -> Figure:
    """A Figure (no pyplot global state) with panels "TTFT" and "TPS"; lines are labelled
    `measured`, `reference (recipe)` and `SLO ...`; levels with failed requests get a red x."""
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    b = rep.bench
    panels = (("ttft_ms", "TTFT (ms)", b.ttft_slo_ms, f"SLO TTFT <= {b.ttft_slo_ms:g} ms"),
              ("tps", "TPS (tok/s per request)", b.tps_slo, f"SLO TPS >= {b.tps_slo:g}"))
    concurrency = sorted({lv.concurrency for lv in rep.levels} | {p.concurrency for p in rep.reference})
    for i, (metric, title, slo, slo_label) in enumerate(panels):
        ax = fig.add_subplot(1, 2, i + 1)
        pts = [(lv.concurrency, getattr(lv, metric)) for lv in rep.levels if getattr(lv, metric) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=MEASURED, color="tab:blue")
        ref = [(p.concurrency, getattr(p, metric)) for p in rep.reference if getattr(p, metric) is not None]
        if ref:
            ax.plot(*zip(*ref), marker="s", linestyle="--", label=REFERENCE, color="tab:gray")
        bad = [(lv.concurrency, getattr(lv, metric) or 0.0) for lv in rep.levels if lv.errors]
        if bad:
            ax.plot(*zip(*bad), linestyle="none", marker="x", markersize=10, color="tab:red",
                    label="level with failed requests")
        ax.axhline(slo, color="tab:red", linestyle=":", label=slo_label)
        if rep.max_c is not None:
            ax.axvline(rep.max_c, color="tab:green", alpha=0.4, label=f"Max C = {rep.max_c}")
        ax.set_xscale("log", base=2)
        if concurrency:
            ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{rep.config.get('model', '')} at {rep.config.get('url', '')}: "
                 f"~{b.input_tokens} in / {b.max_tokens} out tokens")
    return fig


def save_png(fig: Figure, path: str | Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    out = Path(path)
    atomic_write_bytes(out, buf.getvalue())
    return out
