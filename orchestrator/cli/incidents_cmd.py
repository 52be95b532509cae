"""deployctl incidents: what the supervisor recorded on the head (orchestrator/hostside/supervisor.py).
Read-only: no lock, no pipeline."""
from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..deployment import load_deployment
from ..errors import InputError, StageFailed
from ..secrets import mask_data
from .common import deployment_options, emit_json, handle_errors


@click.command("incidents")
@deployment_options
@click.argument("incident", required=False)
@handle_errors
def incidents_command(inventory, recipe, sets, as_json, verbose, quiet, incident):
    """List the supervisor's incidents (newest last), or show INCIDENT (an id, or a unique prefix).

    Each incident: when, what was detected with its evidence (exit code and signal, OOM kill, the
    failed probe), each rank's container state and last log lines, MemAvailable per node, the
    release and spec digests, what the supervisor did and how long recovery took. Secrets masked.
    """
    from ..executors.shells import HostShell
    from ..launch import supervision
    dep = load_deployment(inventory, recipe, tuple(sets), together=False)
    sh = HostShell(dep.cluster, dep.cluster.head_host)
    try:
        found = supervision.read(dep, sh)
    except Exception as e:  # noqa: BLE001 - an unreachable head is the answer
        raise StageFailed(f"cannot read the incidents on the head {dep.cluster.head}: {e}") from None
    finally:
        sh.close()
    found = mask_data(found or {"state": None, "incidents": []})
    items = found["incidents"]
    if incident:
        hits = [i for i in items if str(i.get("id", "")).startswith(incident)]
        if len(hits) != 1:
            known = ", ".join(str(i.get("id")) for i in items[-5:]) or "none recorded"
            raise InputError(f"{'no' if not hits else 'more than one'} incident matches {incident!r} "
                             f"(latest: {known}; `deployctl incidents -i {dep.cluster.file}` lists them)",
                             key="INCIDENT")
        if as_json:
            emit_json(hits[0])
        else:
            _show(hits[0])
        return
    if as_json:
        emit_json(found)
        return
    out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    st = found.get("state") or {}
    out.print(f"{dep.name}: supervisor {escape(str(st.get('state', 'not installed')))}"
              + (f" ({escape(st['detail'])})" if st.get("detail") else ""))
    t = Table(title=f"incidents on {dep.cluster.head} ({supervision.state_dir(dep, dep.cluster.head_host)}/incidents)",
              title_justify="left")
    for col in ("id", "kind", "summary", "outcome", "recovery"):
        t.add_column(col)
    for i in items:
        rec = i.get("recovery_s")
        t.add_row(escape(str(i.get("id"))), escape(str(i.get("kind"))), escape(str(i.get("summary"))),
                  escape(str(i.get("outcome"))), "-" if rec is None else f"{rec:g}s")
    out.print(t)


def _show(i: dict) -> None:
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"[bold]{escape(str(i['id']))}[/bold] {i.get('time_text')}: {escape(str(i.get('kind')))}")
    out.print(f"  detected: {escape(str(i.get('summary')))}")
    out.print(f"  outcome: {escape(str(i.get('outcome')))}"
              + (f" in {i['recovery_s']:g}s" if i.get("recovery_s") is not None else ""))
    rel = i.get("release")
    if rel:
        out.print(f"  release: {escape(str(rel))}")
    for host, r in (i.get("ranks") or {}).items():
        mem = (i.get("mem_available_gib") or {}).get(host)
        out.print(f"  [cyan]{escape(host)}[/cyan]: {escape(str(r.get('exit')))}; spec "
                  f"{(i.get('specs') or {}).get(host) or '-'}; MemAvailable {'-' if mem is None else f'{mem:g} GiB'}")
        for line in r.get("log_tail") or []:
            out.print(f"      {escape(line)}")
    for a in i.get("actions") or []:
        out.print(f"  +{a.get('t')}s {escape(str(a.get('what')))}")
