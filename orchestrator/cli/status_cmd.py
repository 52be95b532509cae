"""deployctl status / logs: read the running deployment, change nothing (no lock, no pipeline)."""
from __future__ import annotations

import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import releases as rel
from ..deployment import load_deployment
from ..errors import DeployctlError
from ..inventory import InventoryRef
from ..secrets import mask_data
from .common import STDERR, deployment_options, emit_json, every_deployment, handle_errors

def _status_table(doc: dict[str, Any]) -> Table:
    from ..launch.containers import fmt_duration
    t = Table(title=f"{doc['deployment']} ({doc['recipe']}, image {doc['image']})", title_justify="left")
    for col in ("host", "rank", "container", "image ID", "uptime", "restarts", "staged data"):
        t.add_column(col)
    from ..launch.lifecycle import staged_summary
    for row in doc["hosts"]:
        name = f"{row['host']}{' (head)' if row.get('role') == 'head' else ''}"
        if not row.get("reachable"):
            t.add_row(name, str(row.get("rank", "")), f"[red]no answer[/red]: {escape(row.get('error', ''))}",
                      "", "", "", "")
            continue
        cs = row["containers"]
        if not cs:
            state, img, up, rs = "[yellow]none[/yellow]", (row["image"]["id"] or "image absent")[7:19], "-", "-"
        else:
            c = cs[-1]
            color = "green" if c["status"] == "running" else "red"
            state = f"[{color}]{c['status']}[/{color}]" + (f" (exit {c['exit_code']})" if c["status"] != "running"
                                                           else "") + (f" +{len(cs) - 1} more" if len(cs) > 1 else "")
            img, up, rs = c["image_id"][7:19], fmt_duration(c["uptime_s"]), str(c["restart_count"])
            if c.get("api_key_id"):
                state += f", key id {c['api_key_id']}"
        t.add_row(name, str(row["rank"]), state, img, up, rs, escape(staged_summary(row)))
    return t


@click.command("status")
@deployment_options
@click.option("--verify", is_flag=True,
              help="Also re-hash every staged table on every host (in parallel) against its manifest.")
@click.option("--exposure", is_flag=True,
              help="Also list every socket the deployment's containers listen on, per host (ss, read there), "
                   "and who can reach it.")
@handle_errors
def status_command(inventory, recipe, sets, as_json, verbose, quiet, verify, exposure):
    """Per host: container state, image ID, uptime, restarts, staged data; and the API's health.

    Read-only (with --verify, a table found corrupt loses its manifest, so the next `up` restages it).
    --exposure adds, per host, the listening sockets of the deployment's containers (protocol, address,
    port, process), the networks that reach each, and a concern where an internal port is reachable
    from the management network. Exit 0 when every host answered (whatever their state), 1 when a host
    or its Docker engine could not be reached, a table failed --verify, or a host's sockets could not be read.
    On an inventory with several deployments and no --deployment: one row per deployment (model, hosts,
    current release, containers running, API health, supervisor), then each one's table.
    """
    from ..launch.lifecycle import cluster_status
    if names := every_deployment(inventory, recipe=recipe, set=sets, verify=verify, exposure=exposure):
        sys.exit(_every_deployment(inventory, names, as_json))
    dep = load_deployment(inventory, recipe, tuple(sets), together=False)
    doc = cluster_status(dep)
    bad_tables = False
    if verify:
        doc["tables_verified"] = _verify_tables(dep)
        bad_tables = any(not r.get("up_to_date") for rows in doc["tables_verified"].values() for r in rows.values())
    if exposure:
        from ..launch.exposure import collect
        doc["exposure"] = collect(dep)
    if dep.cluster.router:
        doc["router"] = _router_status(dep)
    from ..launch.status_page import url as page_url
    doc["status_page"] = page_url(dep) if (doc.get("supervisor") or {}).get("enabled") else None
    doc = mask_data(doc)     # the table too: container errors and table reasons are hosts' text
    if as_json:
        emit_json(doc)
    else:
        out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
        out.print(_status_table(doc))
        a = doc["api"]
        verdict = ("[green]healthy[/green]" if a["healthy"] else
                   "[yellow]up, but it rejects the key[/yellow]" if a.get("key_rejected") else "[red]not answering[/red]")
        key = f"; API key id {a['api_key_id']}" if a.get("api_key_id") else ""
        out.print(f"API {a['url']}: {verdict} ({escape(a['detail'])}){key}")
        _print_failure(out, doc.get("failure"), a["healthy"])
        _print_supervisor(out, doc.get("supervisor") or {}, doc["hosts"])
        if doc.get("status_page"):
            out.print(f"Status page: {doc['status_page']} (docs/status-page.md)")
        for host, rows in doc.get("tables_verified", {}).items():
            for stage, r in rows.items():
                mark = "[green]verified[/green]" if r.get("up_to_date") else "[red]NOT current[/red]"
                out.print(f"{host} {stage}: {mark}: {escape(str(r.get('reason')))}")
        if exposure:
            out.print(_exposure_table(doc["exposure"]))
        if doc.get("router"):
            _print_router(out, doc["router"])
    unread = any("error" in v for v in doc.get("exposure", {}).values())
    sys.exit(0 if all(r.get("reachable") for r in doc["hosts"]) and not bad_tables and not unread else 1)


def _every_deployment(inventory, names: list[str], as_json: bool) -> int:
    """`status` on an inventory with several deployments: one row each (recipe, model, hosts, current
    release, containers running, API health, requests in flight as the engine counts them, supervisor),
    then each deployment's own table."""
    from ..launch import api
    from ..launch.lifecycle import cluster_status
    from .release_cmd import _read
    docs = []
    for name in names:
        dep = load_deployment(InventoryRef.of(inventory, name), together=False)
        doc = cluster_status(dep)
        try:
            cur = rel.current(_read(dep))
            doc["release"] = cur.number if cur else None
        except DeployctlError as e:
            doc["release"], doc["release_error"] = None, str(e)
        doc["model"] = dep.recipe.engine.served_name or dep.recipe.model.repo
        if doc["api"]["healthy"]:
            with api.http_client(dep.api_key) as client:
                doc["in_flight"] = api.in_flight(client, dep.api_url)
        docs.append(mask_data(doc))
    router = _router_status(dep) if docs else None
    if as_json:
        emit_json({"deployments": docs, **({"router": router} if router else {})})
    else:
        out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
        t = Table(title=f"{len(docs)} deployments", title_justify="left")
        for col in ("deployment", "model", "hosts", "release", "containers", "API", "in flight", "supervisor"):
            t.add_column(col)
        for d in docs:
            hosts = d["hosts"]
            running = sum(1 for h in hosts for c in h.get("containers", []) if c["status"] == "running")
            api = "[green]healthy[/green]" if d["api"]["healthy"] else "[red]not answering[/red]"
            t.add_row(escape(d["deployment"]), escape(str(d["model"])), escape(", ".join(h["host"] for h in hosts)),
                      str(d["release"] if d["release"] is not None else "-"), f"{running}/{len(hosts)} running",
                      f"{api} {escape(d['api']['url'])}", _in_flight_text(d.get("in_flight")),
                      escape(str((d.get("supervisor") or {}).get("state", "off"))))
        out.print(t)
        if router:
            _print_router(out, router)
        for d in docs:
            out.print(_status_table(d))
    router_ok = router is None or "error" not in router
    return 0 if all(h.get("reachable") for d in docs for h in d["hosts"]) and router_ok else 1


def _router_status(dep) -> dict[str, Any] | None:
    """The inventory's router (all.vars.router): its container, health, models and release; None: none."""
    from ..executors.shells import HostShell
    from ..router import control
    conf = dep.cluster.router
    if conf is None:
        return None
    sh = HostShell(dep.cluster, conf.host)
    try:
        key = control.client_key(conf, str(dep.cluster.file))       # its /v1/models needs the clients' key
        return mask_data(control.read(conf, sh, key.value if key else None))
    except DeployctlError as e:
        return {"host": conf.host.name, "url": conf.url, "error": str(e)}
    finally:
        sh.close()


def _print_router(out: Console, r: dict[str, Any]) -> None:
    if "error" in r:
        out.print(f"router {escape(r['url'])} on {escape(r['host'])}: [red]not read[/red]: {escape(r['error'])}")
        return
    c, h = r.get("container"), r.get("health") or {}
    if not c:
        out.print(f"router {escape(r['url'])} on {escape(r['host'])}: [yellow]not running[/yellow] (no container)")
        return
    verdict = "[green]healthy[/green]" if h.get("healthy") else f"[red]not answering[/red] ({escape(str(h.get('/health')))})"
    rel_ = r.get("release") or {}
    out.print(f"router {escape(r['url'])} on {escape(r['host'])}: {verdict}, container {c['id']} {c['state']}, "
              f"release {rel_.get('n', '-')} ({escape(str(rel_.get('image', '')))}); models listed: "
              f"{escape(', '.join(h.get('models') or []) or 'none')}")
    for row in (r.get("registry") or {}).get("deployments") or []:
        mark = "[green]routed[/green]" if row.get("registered") else (
            "[red]not routed: its /health does not answer[/red]" if not row.get("healthy") else "[yellow]being registered[/yellow]")
        out.print(f"  {escape(str(row.get('deployment')))}: model {escape(str(row.get('model')))} -> "
                  f"{escape(str(row.get('url')))}: {mark}")


def _in_flight_text(n: dict | None) -> str:
    """The engine's own count of requests generating and waiting (its /metrics), or "-"."""
    if not n:
        return "-"
    return f"{n.get('running', 0)} running, {n.get('waiting', 0)} waiting"


def _print_supervisor(out: Console, sup: dict[str, Any], hosts: list[dict[str, Any]]) -> None:
    if not sup.get("enabled"):
        out.print("Supervisor: [yellow]off[/yellow] (nothing restarts the deployment after a failure)")
        return
    if "error" in sup:
        out.print(f"Supervisor: [red]unknown[/red] ({escape(sup['error'])})")
        return
    state = sup.get("state", "unknown")
    color = {"watching": "green", "recovering": "yellow", "paused": "yellow", "waiting": "yellow"}.get(state, "red")
    agents = [f"{h['host']} {(h.get('supervisor') or {}).get('state', 'none')}" for h in hosts if h.get("reachable")]
    out.print(f"Supervisor: [{color}]{escape(state)}[/{color}]" + (f" ({escape(sup['detail'])})" if sup.get("detail") else "")
              + (f"; install {sup['install']}" if sup.get("install") else "") + f"; containers: {escape(', '.join(agents))}")
    last = sup.get("last_incident")
    if last:
        took = f", {last['recovery_s']:g}s" if last.get("recovery_s") is not None else ""
        out.print(f"  last incident {escape(str(last['id']))} ({last['time_text']}): {escape(str(last['summary']))} "
                  f"-> {escape(str(last['outcome']))}{took}; `deployctl incidents` lists all {sup.get('incidents')}")


def _exposure_table(found: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="listening sockets of the deployment's containers (ss on each host)", title_justify="left")
    for col in ("host", "proto", "address:port", "process", "reachable from", "concern"):
        t.add_column(col)
    for host, v in found.items():
        if "error" in v:
            t.add_row(host, "", "", "", f"[red]not read[/red]: {escape(v['error'])}", "")
            continue
        if not v["sockets"]:
            t.add_row(host, "", "", "", "no listening socket" if v["containers"] else "no running container", "")
        for x in v["sockets"]:
            addr = f"[{x['address']}]" if ":" in x["address"] else x["address"]
            t.add_row(host, x["proto"], f"{addr}:{x['port']}", f"{escape(x['process'])} ({x['pid']})"
                      + (f": {escape(x['serves'])}" if x.get("serves") else ""),
                      escape(x["reachable_from"]), f"[yellow]{escape(x['concern'])}[/yellow]" if x["concern"] else "")
    return t


def _print_failure(out: Console, f: dict[str, Any] | None, api_healthy: bool) -> None:
    """Which rank stopped first, how and why (launch/diagnosis.py), the others after it, its last lines."""
    if not f:
        return
    import time as _time
    at = _time.strftime("%H:%M:%S", _time.localtime(f["finished_at"])) if f.get("finished_at") else "?"
    role = " head" if f.get("role") == "head" else ""
    out.print(f"[red]FAILED[/red]: {escape(f['host'])} (rank {f['rank']}{role}) stopped first, at {at}, "
              f"{escape(f['how'])}" + (f": {escape(f['cause'])}" if f["cause"] else ""))
    for t in f["then"]:
        out.print(f"  then {escape(t['host'])} (rank {t['rank']}): {escape(t['how'])}"
                  + (f": {escape(t['cause'])}" if t["cause"] else ""))
    if api_healthy and f["still_running"]:
        out.print("  [yellow]the head still answers /health, but its group lost a rank: requests fail "
                  "(EngineDeadError) or wait forever (a wedge); relaunch the group: deployctl up[/yellow]")
    for line in f["tail"]:
        out.print(f"  | {escape(line)}")


def _verify_tables(dep) -> dict[str, dict[str, dict]]:
    """{host: {stage: {up_to_date, reason, bytes, seconds, gb_per_s}}} (every chunk re-hashed)."""
    import tempfile

    from ..hostside import bundle
    from ..stages.prove_tables import verify_cluster
    with tempfile.TemporaryDirectory(prefix="deployctl-bundle-") as tmp:
        found = verify_cluster(dep, bundle.build(tmp))
    out: dict[str, dict[str, dict]] = {}
    for host, res in found.items():
        if "error" in res and isinstance(res["error"], str):
            out[host] = {"tables": {"up_to_date": False, "reason": res["error"]}}
            continue
        out[host] = {}
        for stage, d in res.items():
            proof = d.get("proof") or {}
            secs, n = float(proof.get("seconds") or 0), int(proof.get("bytes") or 0)
            out[host][stage] = {"up_to_date": d.get("up_to_date") is True, "reason": d.get("reason"),
                                "bytes": n, "seconds": round(secs, 3),
                                "gb_per_s": round(n / secs / 1e9, 2) if secs > 0 else None}
    return out

@click.command("logs")
@deployment_options
@click.option("--host", "hosts", multiple=True, metavar="HOST", help="Only this host (repeatable).")
@click.option("--tail", type=click.IntRange(min=0), default=100, show_default=True,
              help="Lines from the end of each log.")
@click.option("--follow", "-f", is_flag=True, help="Keep streaming new lines until Ctrl-C.")
@handle_errors
def logs_command(inventory, recipe, sets, as_json, verbose, quiet, hosts, tail, follow):
    """Show the engine logs (docker logs over SSH) of every host, or of --host H.

    Without --follow: the last --tail lines of each host, one block per host. With --follow: the
    lines of all selected hosts as they come, prefixed with the host, until Ctrl-C. Exit 1 when a
    host could not be reached or has no container of the deployment.
    """
    from ..launch.lifecycle import follow_logs, tail_logs
    dep = load_deployment(inventory, recipe, tuple(sets), together=False)
    names = [dep.cluster.host(h).name for h in hosts] or [h.name for h in dep.cluster.hosts]
    out = Console(highlight=False, soft_wrap=True)
    if follow:
        problems = follow_logs(dep, names, tail,
                               lambda n, line: out.print(f"[cyan]{n}[/cyan] | {escape(line)}"))
    else:
        ids, docs, problems = tail_logs(dep, names, tail)
        if as_json:
            emit_json({"deployment": dep.name, "logs": docs, "problems": problems})
        else:
            for n, lines in docs.items():
                out.print(f"[bold]==> {n} ({ids[n][:12]}) <==[/bold]")
                for line in lines:
                    out.print(escape(line))
    for n, why in problems.items():
        STDERR.print(f"[red]{n}[/red]: {escape(why)}")
    sys.exit(1 if problems else 0)
