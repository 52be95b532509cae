"""deployctl monitor config: a Prometheus configuration for the inventory's deployment (orchestrator/monitor/).
Reads the head's release history and the controller's last fabric check; writes nothing on a host."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import click
import yaml

from ..deployment import load_deployment
from ..errors import InputError
from .common import STDERR, deployment_options, emit_json, handle_errors

DURATION = r"^[0-9]+(ms|s|m|h)$"


def _duration(value: str, key: str) -> str:
    if not re.match(DURATION, value):
        raise InputError(f"expected a Prometheus duration like 15s or 1m, got {value!r}", key=key)
    return value


@click.group("monitor")
def group():
    """Prometheus for the deployment: scrape configuration, thresholds and alert rules."""


@group.command("config")
@deployment_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="monitoring", show_default=True,
              help="The folder to write (prometheus.yml, rules/, targets/); other deployments' files in it are kept.")
@click.option("--merge", "merge", type=click.Path(dir_okay=False, exists=True), default=None,
              help="An existing prometheus.yml to add deployctl's jobs and rule files to (its other jobs kept).")
@click.option("--scrape-interval", default="15s", show_default=True)
@click.option("--evaluation-interval", default="15s", show_default=True)
@click.option("--node-exporter-port", default=9100, show_default=True, type=click.IntRange(1, 65535))
@click.option("--promtool", default=None, help="promtool to validate with (default: the one on PATH).")
@handle_errors
def config_command(inventory, recipe, sets, as_json, verbose, quiet, out_dir, merge, scrape_interval,
                   evaluation_interval, node_exporter_port, promtool):
    """Write a Prometheus configuration for the deployment, validated by promtool first.

    Scrapes the engine's /metrics, the supervisor's /metrics and the node exporter on every host,
    labelled deployment, host, rank and release; alert rules with runbook links; the thresholds
    the alerts compare against, from the plan. Run it again after an `up` (the release label) and
    Prometheus re-reads the target files by itself. docs/monitoring.md has the dashboard queries.
    """
    from ..fabric import cache
    from ..launch import supervision
    from ..monitor import promconfig
    from ..monitor.files import files
    from ..monitor.write import find_promtool, merge_into, write_folder
    tool = find_promtool(promtool)
    dep = load_deployment(inventory, recipe, tuple(sets))
    release, why = _release(dep)
    if why and not quiet:
        STDERR.print(f"[yellow]warning:[/yellow] {why}: the targets carry no release label", markup=True,
                     highlight=False, soft_wrap=True)
    fabric_doc = cache.last(str(Path(dep.cluster.run_dir)), dep.name)
    out = Path(out_dir)
    written = write_folder(out, files(dep, release=release, fabric_doc=fabric_doc, supervised=supervision.enabled(dep),
                                      scrape_interval=_duration(scrape_interval, "--scrape-interval"),
                                      evaluation_interval=_duration(evaluation_interval, "--evaluation-interval"),
                                      node_port=node_exporter_port), tool)
    if merge:
        target = Path(merge)
        try:
            existing = yaml.safe_load(target.read_text()) or {}
        except yaml.YAMLError as e:
            raise InputError(f"not YAML: {e}", file=str(target)) from None
        if not isinstance(existing, dict):
            raise InputError("expected a Prometheus configuration (a mapping)", file=str(target))
        ours = yaml.safe_load(Path(written[-1]).read_text())
        merge_into(target, promconfig.merge(existing, ours, str(out.resolve())), tool)
        written.append(str(target))
    doc = {"deployment": dep.name, "release": release, "files": written,
           "targets": json.loads(Path(out, "targets", f"deployctl-engine-{dep.name}.json").read_text()),
           "fabric_check": bool(fabric_doc)}
    note = _reach_note(dep)
    if note:
        doc["note"] = note
    if as_json:
        emit_json(doc)
        return
    if not quiet:
        click.echo(f"{dep.name}: Prometheus configuration in {out}/ (checked by {tool})")
        for f in written:
            click.echo(f"  {f}")
        if note:
            click.echo(f"  note: {note}")
        click.echo(f"  prometheus --config.file={Path(written[-1] if merge else out / 'prometheus.yml')}"
                   if not merge else "  reload your Prometheus (SIGHUP or POST /-/reload) to read it")
    sys.stdout.flush()


def _release(dep) -> tuple[int | None, str]:
    """The deployment's current release number from the head's history, or why it is unknown."""
    from .. import releases as rel
    from ..executors.shells import HostShell
    from ..launch import release_store
    sh = HostShell(dep.cluster, dep.cluster.head_host)
    try:
        cur = rel.current(release_store.read_history(dep, sh))
    except Exception as e:  # noqa: BLE001 - the config is still useful without it
        return None, f"cannot read the release history on {dep.cluster.head}: {e}"
    finally:
        sh.close()
    return (cur.number, "") if cur else (None, f"{dep.name} has no release on {dep.cluster.head} yet")


def _reach_note(dep) -> str:
    """What keeps an outside Prometheus from the supervisor's port, if anything (launch/firewall.py)."""
    from ..launch import supervision
    if not supervision.enabled(dep) or not dep.cluster.workers or dep.cluster.firewall == "none" \
            or dep.cluster.metrics_allow:
        return ""
    return (f"the head's supervisor port {dep.recipe.supervise.port} admits only the deployment's hosts "
            "(its firewall chain): list the Prometheus host under all.vars.metrics_allow and run `up`")
