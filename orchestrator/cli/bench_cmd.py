"""deployctl bench: concurrency sweep against the deployment's API with SLO verdicts and reference comparison."""
from __future__ import annotations

import asyncio
import dataclasses
import sys

import click
import httpx

from ..deployment import load_deployment
from ..errors import InputError, StageFailed
from .common import STDERR, deployment_options, emit_json, handle_errors


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise InputError(f"expected a comma-separated list of positive integers such as 1,2,4,8, got {text!r}",
                         key="--concurrency")
    return tuple(sorted(set(levels)))


def _positive(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise InputError(f"must be > 0, got {value:g}", key=name)


@click.command("bench")
@deployment_options
@click.option("--url", default=None, metavar="URL",
              help="API base URL (default: http://<head address>:<api_port> from the inventory).")
@click.option("--via-router", is_flag=True,
              help="Through the inventory's one endpoint (all.vars.router), with the router's key, instead of "
                   "the deployment's own API.")
@click.option("--concurrency", "concurrency", default=None, metavar="C1,C2,...",
              help="Concurrency levels (default: the recipe's bench.concurrency).")
@click.option("--rounds", type=int, default=None,
              help="Requests each of the C workers sends back to back per level (default: bench.rounds).")
@click.option("--input-tokens", type=int, default=None, help="Prompt size, about this many tokens.")
@click.option("--max-tokens", type=int, default=None, help="Output tokens per request.")
@click.option("--ttft-slo-ms", type=float, default=None, help="TTFT target, ms (default: bench.ttft_slo_ms).")
@click.option("--tps-slo", type=float, default=None, help="TPS target per request (default: bench.tps_slo).")
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True,
              help="Deadline per request, s (whole stream).")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="One unmeasured round at the first level before the sweep.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, metavar="FILE.png",
              help="Write TTFT and TPS against concurrency (measured, reference, SLO lines) as PNG.")
@click.option("--fail-on-regression", is_flag=True,
              help="Exit 1 when a level regressed beyond bench.tolerance against the recipe's reference "
                   "or had failed requests.")
@handle_errors
def bench_command(inventory, recipe, sets, as_json, verbose, quiet, url, via_router, concurrency, rounds, input_tokens,
                  max_tokens, ttft_slo_ms, tps_slo, timeout_s, warmup, plot_path, fail_on_regression):
    """Concurrency sweep against the deployment's OpenAI-compatible API (streaming chat completions).

    At each level C, C workers each send --rounds requests back to back (C x rounds requests, C in
    flight). Per level: mean TTFT, ITL, TPS (output tokens / whole request time), latency, RPS, errors;
    the SLO verdict (TTFT <= target and TPS >= target, no failed request) and Max C, the highest level
    meeting both; the recipe's reference figures with ratios, regressions flagged beyond bench.tolerance.

    Exit codes: 0 done (whatever the verdicts), 1 the API did not answer, or --fail-on-regression and a
    regression or failed request, 2 bad input.
    """
    from ..benchmark.loadgen import LoadSpec, list_models, size_prompt, sweep
    from ..benchmark.report import build_report, run_config, to_json

    from ..inventory import InventoryRef, replica_names
    if reps := replica_names(inventory, getattr(inventory, "deployment", None)):
        inventory = InventoryRef.of(inventory, reps[0])     # -d NAME of replicas: the one model they serve
    dep = load_deployment(inventory, recipe, tuple(sets))
    r = dep.recipe
    overrides = {k: v for k, v in (("rounds", rounds), ("input_tokens", input_tokens), ("max_tokens", max_tokens),
                                   ("ttft_slo_ms", ttft_slo_ms), ("tps_slo", tps_slo)) if v is not None}
    for k, v in overrides.items():
        _positive("--" + k.replace("_", "-"), v)
    _positive("--timeout", timeout_s)
    if concurrency is not None:
        overrides["concurrency"] = parse_levels(concurrency)
    bench = dataclasses.replace(r.bench, **overrides)
    key = dep.api_key
    if via_router:
        from ..router.control import client_key
        if url:
            raise InputError("--via-router and --url both say where to send: give one", key="--via-router")
        if dep.cluster.router is None:
            raise InputError("--via-router: this inventory has no router (all.vars.router)",
                             file=str(dep.cluster.file), key="all.vars.router")
        url, key = dep.cluster.router.url, client_key(dep.cluster.router, str(dep.cluster.file))
    base = (url or dep.api_url).rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise InputError(f"expected an http:// or https:// URL, got {base!r}", key="--url")
    spec = LoadSpec(url=base, model=r.engine.served_name, input_tokens=bench.input_tokens,
                    max_tokens=bench.max_tokens, rounds=bench.rounds, timeout_s=timeout_s,
                    api_key=key.value if key else None)

    def say(msg: str) -> None:
        if not quiet:
            STDERR.print(f"[dim]{msg}[/dim]", markup=True, highlight=False)

    try:
        served = asyncio.run(list_models(base, timeout_s=min(10.0, timeout_s), api_key=spec.api_key))
    except httpx.HTTPStatusError as e:
        if e.response.status_code in (401, 403):
            who = key.describe() if key else "no key (set api_key_file or api_key_env in the inventory)"
            raise StageFailed(f"the API at {base} rejects the key (HTTP {e.response.status_code} on GET /v1/models); "
                              f"deployctl sent {who}") from None
        raise StageFailed(f"the API at {base} answers GET /v1/models with HTTP {e.response.status_code}") from None
    except (httpx.HTTPError, ValueError) as e:
        raise StageFailed(f"the API at {base} does not answer GET /v1/models ({type(e).__name__}: {e}); "
                          f"is the deployment up (deployctl up / launch)?") from None
    if spec.model not in served:
        raise StageFailed(f"{base} does not serve {spec.model!r} (served: {', '.join(served) or 'none'}); "
                          f"check engine.served_name in recipe {r.name}")
    size = asyncio.run(size_prompt(spec))
    spec = dataclasses.replace(spec, prompt_words=size.words)
    say(f"prompt: {size.words} words for {spec.input_tokens} tokens"
        + (f" ({size.tokens_per_word:.2f} tokens per word on {spec.model})" if size.tokens_per_word else
           f"; {size.why}"))
    replicas = []
    if via_router and dep.cluster.replica:          # #58: how many requests each replica served
        from ..rolling import served_by
        replicas = [dep] + [load_deployment(InventoryRef.of(inventory, n), recipe, tuple(sets), together=False)
                            for n in dep.cluster.siblings]
        replicas.sort(key=lambda d: d.name)
        before = {d.name: served_by(d) for d in replicas}
    warm, runs = asyncio.run(sweep(spec, bench.concurrency, warmup=warmup, progress=say))
    served_per = None
    if replicas:
        from ..rolling import per_replica
        served_per = per_replica(before, {d.name: served_by(d) for d in replicas})
    rep = build_report(runs, bench, run_config(spec, bench, warmup, deployment=dep.name, recipe=r.name,
                                               prompt=size.to_json()), warm)
    if plot_path:
        from ..benchmark.plot import build_figure, save_png
        save_png(build_figure(rep), plot_path)
        say(f"plot written to {plot_path}")
    _to_status_page(dep, rep, plot_path, say)
    if as_json:
        emit_json({**to_json(rep), **({"served_per_replica": served_per} if served_per is not None else {})})
    elif not quiet:
        from ..benchmark.report_text import print_report
        print_report(rep)
    if served_per is not None and not as_json:
        known = [v for v in served_per.values() if v is not None]
        spread = f"; max/min {max(known) / min(known):.2f}" if len(known) > 1 and min(known) > 0 else ""
        STDERR.print("served per replica (each engine's /metrics, warm-up and sizing probes included): "
                     + ", ".join(f"{n} {v:g}" if v is not None else f"{n} unreadable" for n, v in served_per.items())
                     + spread, markup=False, highlight=False)
    if fail_on_regression and not rep.ok:
        what = [f"C={g.concurrency} {g.metric} {g.ratio:.2f}x reference" for g in rep.regressions]
        what += [f"C={c} had failed requests" for c in rep.failed_levels]
        STDERR.print(f"[red]failed:[/red] {'; '.join(what)}", markup=True, highlight=False, soft_wrap=True)
        sys.exit(1)


def _to_status_page(dep, rep, plot_path: str | None, say) -> None:
    """The result and its plot to the deployment's status page (docs/status-page.md); never fails bench."""
    import os
    import tempfile

    from ..benchmark.plot import build_figure, save_png
    from ..benchmark.report import to_json
    from ..launch import status_page
    if status_page.port(dep) is None:
        return
    with tempfile.TemporaryDirectory(prefix="deployctl-bench-") as tmp:
        png = plot_path or os.path.join(tmp, "bench.png")
        try:
            if not plot_path:
                save_png(build_figure(rep), png)
            with open(png, "rb") as fh:
                data: bytes | None = fh.read()
        except (OSError, ValueError):
            data = None
        said = status_page.push_bench(dep, to_json(rep), data)
    if said:
        say(said)
