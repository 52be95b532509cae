"""Lifecycle of a running deployment: status, logs (tail and follow), down (and the removal launch's
cleanups use). The CLI (cli/launch_cmd.py, cli/status_cmd.py) only parses arguments and prints what these return.

`down` and the cleanups list the containers again after removing them: a host is reported clear
only when no container of the deployment is left on it; a host that cannot be reached is a failure.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from .. import apikey
from ..executors.ssh import SSHError
from ..outcomes import HostFailure, HostResult
from ..secrets import mask_text
from . import api, diagnosis, probe, supervision
from .firewall import chain_name, jump_comment, remove_host
from .commands import list_argv, logs_argv
from .containers import Container, list_containers, logs_tail, remove_all
from ..executors.shells import HostShell, Shells
from ..outcomes import parallel

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..runrecord import HostLog, RunContext

SAVED_LOG_LINES = 500
STOPPED_TAIL = 30             # status: log lines read of a stopped container (its cause is near its end)
CLEANUP_CONNECT_S = 5.0
DOWN_CONNECT_S = 10.0
LOGS_TAIL_TIMEOUT_S = 60


def save_engine_logs(sh: HostShell, containers: list[Container], ctx: "RunContext") -> None:
    """The last lines of each container's log into the run record (logs/<host>/engine.log, masked)."""
    log = ctx.host_log(sh.host.name, "engine")
    try:
        for c in containers:
            log.write(f"===== {c.describe()}: last {SAVED_LOG_LINES} lines =====")
            log.write("\n".join(logs_tail(sh, c.id, SAVED_LOG_LINES)))
    finally:
        log.close()


def remove_everywhere(dep: "Deployment", names: list[str], ctx: "RunContext | None" = None,
                      keep_previous: bool = False) -> dict[str, "list[Container] | BaseException"]:
    """Stop, remove and verify gone on every host in NAMES, in parallel (logs saved to CTX first);
    with KEEP_PREVIOUS the stopped previous generation (`-prev`) stays (containers.remove_all)."""
    with Shells(dep.cluster, CLEANUP_CONNECT_S) as shells:
        def one(name: str) -> list[Container]:
            sh = shells[name]
            if ctx is not None:
                found = list_containers(sh, dep.name)
                if found:
                    try:
                        save_engine_logs(sh, found, ctx)
                    except Exception:  # noqa: BLE001 - the logs are a courtesy; removal is the point
                        pass
            return remove_all(sh, dep.name, keep_previous=keep_previous)
        return parallel(names, one)


# ---------------------------------------------------------------------------------------------------
# status

def host_status(dep: "Deployment", sh: HostShell) -> dict[str, Any]:
    h = sh.host
    row: dict[str, Any] = {"host": h.name, "rank": h.rank,
                           "role": "head" if h.name == dep.cluster.head else "worker", "address": h.address}
    try:
        read = probe.read_host(dep, sh)
    except Exception as e:  # noqa: BLE001 - unreachable hosts are part of the answer
        row.update(reachable=False, error=str(e))
        return row
    row.update(reachable=True, containers=[c.to_json() for c in read.containers],
               image={"ref": dep.recipe.engine.image, "id": read.image_id})
    try:
        agent = supervision.agents(sh, dep)
        row["supervisor"] = {"id": agent[0][0], "state": agent[0][1], "install": agent[0][2]} if agent else None
    except Exception as e:  # noqa: BLE001 - the engines' state is known without it
        row["supervisor"] = {"state": "unknown", "error": str(e)}
    for c, doc in zip(read.containers, row["containers"]):
        if not c.running:     # the evidence of why it stopped (diagnosis.first_failure reads it)
            try:
                doc["log_tail"] = mask_text("\n".join(logs_tail(sh, c.id, STOPPED_TAIL))).splitlines()
            except Exception as e:  # noqa: BLE001 - the state is known without it
                doc["log_tail"] = [f"(its log could not be read: {e})"]
    data: dict[str, Any] = {}
    if "engram" in read.staged:
        e = read.staged["engram"]
        problem = probe.engram_problem(dep, h, read.staged)
        texts = e.get("texts") or {}
        data["engram"] = {"dir": e["dir"], "local": texts.get("engram-local.json") is not None,
                          "manifest": texts.get("engram-manifest.json") is not None,
                          "rank_ok": problem is None, "problem": problem}
    if "ple" in read.staged:
        p = read.staged["ple"]
        data["ple"] = {"dir": p["dir"], "tables": p["tables"], "manifest": p["manifest"]}
    row["staged"] = data
    return row


def cluster_status(dep: "Deployment") -> dict[str, Any]:
    names = [h.name for h in dep.cluster.hosts]
    r = dep.recipe

    def ask_api() -> api.ApiCheck:
        with api.http_client(dep.api_key) as client:
            return api.check(client, dep.api_url, r.engine.served_name, None, 1, r.health.request_timeout_s,
                             dep.api_key)
    with ThreadPoolExecutor(1, thread_name_prefix="status-api") as pool:
        asked = pool.submit(ask_api)            # while the hosts answer
        with Shells(dep.cluster, CLEANUP_CONNECT_S) as shells:
            rows = parallel(names, lambda n: host_status(dep, shells[n]))
            sup = supervisor_status(dep, shells[dep.cluster.head])
        chk = asked.result()
    hosts = [rows[n] if isinstance(rows[n], dict) else {"host": n, "reachable": False, "error": str(rows[n])}
             for n in names]
    return {"deployment": dep.name, "recipe": r.name, "image": r.engine.image,
            "api": {"url": dep.api_url, "healthy": chk.ok, "detail": chk.detail, "key_rejected": chk.rejected,
                    "api_key_id": dep.api_key.key_id if dep.api_key else None},
            "hosts": hosts, "failure": diagnosis.first_failure([h for h in hosts if h.get("reachable")]),
            "supervisor": sup}


def supervisor_status(dep: "Deployment", sh: HostShell) -> dict[str, Any]:
    """The supervisor's state (state.json on the head) and its last incident."""
    if not supervision.enabled(dep):
        return {"enabled": False}
    try:
        found = supervision.read(dep, sh)
    except Exception as e:  # noqa: BLE001 - status reports what it can
        return {"enabled": True, "error": str(e)}
    if found is None:
        return {"enabled": True, "state": "not installed"}
    st = found.get("state") or {}
    incidents = found.get("incidents") or []
    last = incidents[-1] if incidents else None
    return {"enabled": True, "state": st.get("state", "unknown"), "detail": st.get("detail", ""),
            "install": st.get("install"), "since": st.get("since"), "incidents": len(incidents),
            "last_incident": None if last is None else
            {k: last.get(k) for k in ("id", "kind", "time_text", "summary", "outcome", "recovery_s")}}


def key_rotation(dep: "Deployment") -> str | None:
    """What the next launch does about the API key, read from the key-id label of each host's running
    engine (apikey.rotation); None when nothing runs or every engine has this key. Read-only."""
    names = [h.name for h in dep.cluster.hosts]
    with Shells(dep.cluster, CLEANUP_CONNECT_S) as shells:
        found = parallel(names, lambda n: list_containers(shells[n], dep.name))
    running = {n: cs[-1].labels.get(apikey.LABEL) for n, cs in found.ok.items() if cs and cs[-1].running}
    return apikey.rotation(running, dep.api_key) if running else None


def staged_summary(row: dict[str, Any]) -> str:
    parts = []
    st = row.get("staged") or {}
    if "engram" in st:
        e = st["engram"]
        parts.append("engram " + ("ok" if e["rank_ok"] else ("wrong rank" if e["local"] else "missing"))
                     + ("" if e["manifest"] else ", no manifest"))
    if "ple" in st:
        p = st["ple"]
        n = len(p["tables"])
        parts.append(f"ple {'1 table' if n == 1 else f'{n} tables'}" + ("" if p["manifest"] else ", no manifest"))
    return "; ".join(parts) or "-"


# ---------------------------------------------------------------------------------------------------
# logs

def container_name(dep: "Deployment", sh: HostShell) -> str | None:
    """The deployment's newest container on the host (by name), None when there is none."""
    cs = list_containers(sh, dep.name)
    return cs[-1].id if cs else None


def follow(sh: HostShell, container: str, tail: int, emit: Callable[[str], None],
           stop: threading.Event) -> None:
    """Stream `docker logs -f` from the host line by line into EMIT until STOP is set or it ends."""
    with sh.target.connect() as session:
        with session.open_exec(logs_argv(sh.host.docker_host, container, tail, follow=True)) as ex:
            ex.close_stdin()
            # No overall deadline: following lasts until STOP (Ctrl-C) or the container's end.
            ex.read(lambda kind, line: emit(line), timeout=float("inf"), cancel=stop)


def find_containers(dep: "Deployment", shells: Shells, names: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Per host in NAMES, in parallel: the deployment's newest container ID, or why there is none.
    Returns (ids, problems), both keyed by host name in the order of NAMES."""
    found = parallel(names, lambda n: container_name(dep, shells[n]))
    problems = {n: f"unreachable: {e}" for n, e in found.failed.items()}
    problems.update({n: f"no container of {dep.name}" for n, v in found.ok.items() if v is None})
    ids = {n: v for n, v in found.ok.items() if v is not None}
    return ids, problems


def tail_logs(dep: "Deployment", names: list[str], tail: int
              ) -> tuple[dict[str, str], dict[str, list[str]], dict[str, str]]:
    """The last TAIL lines (masked) of each host's container, fetched in parallel.
    Returns (container ids, lines per host, problems per host), in the order of NAMES."""
    with Shells(dep.cluster) as shells:
        ids, problems = find_containers(dep, shells, names)
        texts = parallel(list(ids), lambda n: logs_tail(shells[n], ids[n], tail, timeout=LOGS_TAIL_TIMEOUT_S))
    problems.update({n: str(e) for n, e in texts.failed.items()})
    docs = {n: [mask_text(line) for line in lines] for n, lines in texts.ok.items()}
    return ids, docs, problems


def follow_logs(dep: "Deployment", names: list[str], tail: int, emit: Callable[[str, str], None]) -> dict[str, str]:
    """Stream every host's container log into EMIT(host, masked line), one thread a host, until every
    stream ends or Ctrl-C (which stops them all and returns). EMIT is called under one lock, so lines
    never interleave. Returns the problems per host (unreachable, no container, stream failed)."""
    with Shells(dep.cluster) as shells:
        ids, problems = find_containers(dep, shells, names)
        stop = threading.Event()
        lock = threading.Lock()

        def emit_line(n: str, line: str) -> None:
            with lock:
                emit(n, mask_text(line))

        def stream(n: str) -> None:
            try:
                follow(shells[n], ids[n], tail, lambda line: emit_line(n, line), stop)
            except Exception as e:  # noqa: BLE001 - report, keep the other streams
                problems[n] = str(e)
        threads = [threading.Thread(target=stream, args=(n,), daemon=True) for n in ids]
        for t in threads:
            t.start()
        try:
            while any(t.is_alive() for t in threads):
                for t in threads:
                    t.join(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            for t in threads:
                t.join(5)
    return problems


# ---------------------------------------------------------------------------------------------------
# down

def down_preview(dep: "Deployment") -> list[tuple[str, list[str]]]:
    """`down --dry-run`: per host, the command that lists the containers down removes (and lists again)."""
    return [(h.name, list_argv(h.docker_host, dep.name)) for h in dep.cluster.hosts]


def remove_supervisors(dep: "Deployment") -> dict[str, "list[str] | BaseException"]:
    """The supervisor's containers off every host, before `down` takes the lock: a supervisor in the
    middle of a restart holds it, and must not start anything once down has begun. Never fails the
    caller: down_host removes (and verifies) them again, naming a host where it could not."""
    with Shells(dep.cluster, CLEANUP_CONNECT_S) as shells:
        return parallel([h.name for h in dep.cluster.hosts], lambda n: supervision.remove(shells[n], dep))


def down_host(dep: "Deployment", host: str, log: "HostLog") -> "HostResult | str":
    """Stop and remove the deployment's supervisor and containers on HOST and verify none is left
    (listing again). An unreachable host is a HostFailure; a host with nothing to remove is skipped."""
    sh = HostShell(dep.cluster, dep.cluster.host(host), connect_timeout=DOWN_CONNECT_S)
    try:
        agents = supervision.remove(sh, dep)
        if agents:
            log.write(f"removed the supervisor's container {', '.join(a[:12] for a in agents)}")
        gone = remove_all(sh, dep.name)
        rules = remove_host(sh, chain_name(dep.name), jump_comment(dep.name))   # after the engines
    except SSHError as e:
        raise HostFailure(f"could not reach the host, its containers (if any) are still there: {e}") from None
    except RuntimeError as e:
        raise HostFailure(str(e)) from None
    finally:
        sh.close()
    log.write(rules)
    if not gone:
        log.write(f"no container of {dep.name}")
        return HostResult(host, "down", "skipped", f"no container of {dep.name} here (verified); {rules}")
    msg = (f"stopped and removed {', '.join(f'{c.name} ({c.short_id})' for c in gone)}; "
           f"verified: none of {dep.name} left; {rules}")
    log.write(msg)
    return msg
