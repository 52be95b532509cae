"""The status page's controller side (issue #60; the page itself is orchestrator/hostside/status_page.py,
served by the head's supervisor; docs/status-page.md says why there).

- where it listens and its URL (the API's address, `supervise.page_port`), the `page` entry of the head's
  supervisor config (no secret in it: the key is the `api_key` file the supervisor already has);
- the facts only the controller has, pushed into `<the head's supervisor state>/page/` when it has them,
  each file written atomically (a temp file, then mv) with the time it was true (`at`), secrets masked:
  `plan.json` (the memory budget and NVMe need per node, `up`), `fabric.json` (the last passing fabric
  check: rate, path MTU and rtt per link, `up` and `deployctl fabric`), `inventory.json` (the
  inventory's deployments and their pages, the router and the models behind it, `up`), `bench.json`
  and `bench.png` (the last `deployctl bench`).
A push that fails never fails the command that made the facts: it returns why, the caller says so.
"""
from __future__ import annotations

import json
import time
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from .. import sizing
from ..secrets import mask_data
from . import supervision

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..executors.shells import HostShell

GB = 10 ** 9
GiB = 1024 ** 3
TIMEOUT_S = 30.0
SUBDIR = "page"
# $1 the file; stdin its content. umask 077 like the rest of the state folder; mv -f: atomic.
WRITE_SH = 'umask 077; mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv -f "$1.tmp" "$1"'
WRITE_B64_SH = 'umask 077; mkdir -p "$(dirname "$1")" && base64 -d > "$1.tmp" && mv -f "$1.tmp" "$1"'


def port(dep: "Deployment") -> int | None:
    """The page's port on the head; None: no page (not supervised, or supervise.page: false)."""
    c = supervision.page_config(dep)
    return c["port"] if c else None


def url(dep: "Deployment") -> str | None:
    """http://<where the API listens>:<page port>/ (the head's address when it listens everywhere)."""
    c = supervision.page_config(dep)
    return c["url"] if c else None


# ---------------------------------------------------------------------------------------- facts

def plan_facts(dep: "Deployment", now: float | None = None) -> dict[str, Any]:
    """Per node: the planned memory in use (sizing's budget of host or unified memory), the recipe's
    memory floor, what staging needs on the NVMe (the same figures as monitor/thresholds.py)."""
    budget = sizing.size(dep)
    floor = dep.recipe.supervise.mem_floor_gib
    hosts = {}
    for h in dep.cluster.hosts:
        node = budget.node(h.name)
        mem = node.budget(sizing.UNIFIED) or node.budget(sizing.HOST_RAM)
        need = sum(gb for _, gb in node.nvme_needs())
        hosts[h.name] = {"rank": h.rank, "planned_bytes": round(mem.total_gb * GB) if mem and mem.total_gb > 0 else None,
                         "mem_floor_bytes": round(floor * GiB) if floor > 0 else None,
                         "staging_need_bytes": round(need * GB) if need > 0 else None}
    return {"at": now or time.time(), "recipe": dep.recipe.name, "hosts": hosts}


def fabric_facts(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """The last passing fabric check (fabric/cache.py `last`) as the page shows it: per link its iperf3
    rate, the path MTU the don't-fragment ping proved, rtt; None: no check kept."""
    if not doc or not isinstance(doc.get("report"), dict):
        return None
    rep = doc["report"]
    links = []
    for lk in rep.get("links") or []:
        t = lk.get("throughput") or {}
        reach, df = lk.get("reach") or {}, lk.get("df") or {}
        ok = all(reach.values()) and not any(v is False for v in df.values()) and not t.get("error")
        links.append({"a": lk.get("a"), "b": lk.get("b"), "gbps": t.get("gbps"), "mtu": lk.get("mtu"),
                      "rtt_ms": lk.get("rtt_ms"), "expected_gbps": lk.get("expected_gbps"), "ok": ok,
                      "detail": "; ".join(f"{k}: {v}" for k, v in (lk.get("detail") or {}).items())})
    return {"at": doc.get("at"), "topology": rep.get("topology"), "links": links}


def inventory_facts(dep: "Deployment", now: float | None = None) -> dict[str, Any]:
    """Every deployment of the inventory with its page (a team opens any page and finds the others),
    and the router with the models it routes (by model name: the router's registry decides live)."""
    from ..deployment import load_deployment
    from ..inventory import InventoryRef, deployment_names
    rows = []
    for name in deployment_names(dep.cluster.file) or [dep.name]:
        try:
            d = dep if name == dep.name else load_deployment(InventoryRef.of(dep.cluster.file, name), together=False)
        except Exception as e:  # noqa: BLE001 - one deployment that does not load is named, not fatal
            rows.append({"name": name, "error": str(e)[:300]})
            continue
        rows.append({"name": name, "model": d.recipe.engine.served_name or d.recipe.model.repo,
                     "hosts": [h.name for h in d.cluster.hosts], "head": d.cluster.head, "api_url": d.api_url,
                     "page_url": url(d)})
    out: dict[str, Any] = {"at": now or time.time(), "deployments": rows}
    r = dep.cluster.router
    if r is not None:
        out["router"] = {"url": r.url, "host": r.host.name,
                         "routes": [{"model": x.get("model"), "deployment": x["name"]} for x in rows if "model" in x]}
    return out


def bench_facts(report: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The last `deployctl bench` (its --json document, benchmark/report.py to_json) in a few figures."""
    verdicts = {v["concurrency"]: v for v in report.get("verdicts") or []}
    levels = [{"concurrency": lv["concurrency"], "ttft_ms": lv.get("ttft_ms"), "tps": lv.get("tps"),
               "itl_ms": lv.get("itl_ms"), "errors": lv.get("errors"),
               "meets_slo": bool((verdicts.get(lv["concurrency"]) or {}).get("meets_slo"))}
              for lv in report.get("levels") or []]
    cfg = report.get("config") or {}
    return {"at": now or time.time(), "max_c": report.get("max_c"), "levels": levels,
            "url": cfg.get("url"), "model": cfg.get("model"), "ok": report.get("ok")}


# ---------------------------------------------------------------------------------------- push

def page_dir(dep: "Deployment") -> str:
    return str(PurePosixPath(supervision.state_dir(dep, dep.cluster.head_host)) / SUBDIR)


def push(dep: "Deployment", sh: "HostShell", name: str, doc: dict[str, Any]) -> None:
    """DOC (masked) as <page dir>/NAME.json on the head, atomically."""
    path = f"{page_dir(dep)}/{name}.json"
    r = sh.run(["sh", "-c", WRITE_SH, "sh", path], timeout=TIMEOUT_S, stdin=json.dumps(mask_data(doc)) + "\n")
    if r.rc != 0:
        raise RuntimeError(f"cannot write {path} on {sh.host.name}: exit {r.rc}: {(r.stderr or r.stdout).strip()[-300:]}")


def push_file(dep: "Deployment", sh: "HostShell", name: str, data: bytes) -> None:
    import base64
    path = f"{page_dir(dep)}/{name}"
    r = sh.run(["sh", "-c", WRITE_B64_SH, "sh", path], timeout=TIMEOUT_S, stdin=base64.b64encode(data).decode() + "\n")
    if r.rc != 0:
        raise RuntimeError(f"cannot write {path} on {sh.host.name}: exit {r.rc}: {(r.stderr or r.stdout).strip()[-300:]}")


def push_up(dep: "Deployment", sh: "HostShell", fabric_doc: dict[str, Any] | None) -> str:
    """What `up` knows: the plan, the fabric check, the inventory. Returns what was pushed or why not."""
    if port(dep) is None:
        return "no status page"
    try:
        push(dep, sh, "plan", plan_facts(dep))
        pushed = ["plan"]
        fab = fabric_facts(fabric_doc)
        if fab:
            push(dep, sh, "fabric", fab)
            pushed.append("fabric")
        push(dep, sh, "inventory", inventory_facts(dep))
        pushed.append("inventory")
    except Exception as e:  # noqa: BLE001 - the page shows older facts; the run goes on
        return f"status page facts not pushed: {e}"
    return f"status page {url(dep)}: pushed {', '.join(pushed)}"


def push_fabric(dep: "Deployment", fabric_doc: dict[str, Any] | None) -> str | None:
    """After `deployctl fabric`: its passing check to the page (None: nothing to push)."""
    fab = fabric_facts(fabric_doc)
    if port(dep) is None or not fab:
        return None
    return _with_head(dep, lambda sh: push(dep, sh, "fabric", fab))


def push_bench(dep: "Deployment", report: dict[str, Any], png: bytes | None) -> str | None:
    """After `deployctl bench`: its figures and plot to the page; None when there is no page."""
    if port(dep) is None:
        return None

    def go(sh: "HostShell") -> None:
        if png:
            push_file(dep, sh, "bench.png", png)
        push(dep, sh, "bench", bench_facts(report))
    return _with_head(dep, go)


def _with_head(dep: "Deployment", fn) -> str:
    from ..executors.shells import HostShell
    try:
        sh = HostShell(dep.cluster, dep.cluster.head_host)
        try:
            fn(sh)
        finally:
            sh.close()
    except Exception as e:  # noqa: BLE001 - the command's own result stands; the page keeps older facts
        return f"status page not updated: {e}"
    return f"status page {url(dep)} updated"
