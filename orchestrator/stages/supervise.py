"""supervise: the deployment's supervisor on the cluster (orchestrator/launch/supervision.py), after
health: it watches what `up` just proved healthy and restarts the group when it fails."""
from __future__ import annotations

from ..launch import status_page, supervision
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage


def plan(dep, options: RunOptions):
    if not supervision.enabled(dep):
        why = "supervise.enabled is false in the recipe" if not dep.recipe.supervise.enabled else \
              "all.vars.supervise is false in the inventory"
        return [], f"no supervisor ({why}): nothing restarts the deployment after a failure"
    s = dep.recipe.supervise
    port = supervision.head_port(dep)
    install = next(iter(supervision.configs(dep).values()))["install"]
    acts = []
    for h in dep.cluster.hosts:
        head = h.name == dep.cluster.head
        what = (f"supervisor container {supervision.container_name(dep)} (--restart unless-stopped): watches "
                f"every rank and {dep.api_url} (/health every {s.interval_s:g}s, a {s.wedge_max_tokens}-token "
                f"completion every {s.wedge_interval_s:g}s), restarts the group, at most {s.max_restarts} in "
                f"{s.window_s:g}s; records incidents under {supervision.state_dir(dep, h)}/incidents"
                + f"; serves /metrics on {h.address}:{port}"
                + (", where it hears the workers' agents" if dep.cluster.workers else "")
                + (f"; the status page on {status_page.url(dep)}" if status_page.url(dep) else "")
                if head else
                f"agent container {supervision.container_name(dep)} (--restart unless-stopped): reports rank "
                f"{h.rank} to the head's supervisor ({dep.cluster.head_host.address}:{port}) and carries out "
                "its stop/start orders")
        acts.append(Action("supervise", h.name, "docker-run", what,
                           command=tuple(supervision.run_argv(dep, h, install)),
                           details={"state_dir": supervision.state_dir(dep, h), "role": "head" if head else "worker",
                                    **({"port": port} if head and port else {})}))
    return acts, ""


def apply(dep, actions, ctx):
    from ..executors.shells import run_shells
    from ..fabric import cache
    from ..launch.results import failure, record
    names = [a.host for a in actions]
    logs = {n: ctx.host_log(n, "supervise") for n in names}
    try:
        try:
            shells = run_shells(dep.cluster, ctx.state)
            done = supervision.install(dep, shells)
            fabric = cache.last(str(ctx.run_dir.parent), dep.name)      # where the fabric stage keeps it
            if fabric:                  # the last fabric result, for the supervisor's /metrics
                supervision.write_fabric(dep, shells[dep.cluster.head], supervision.fabric_summary(fabric))
            page = status_page.push_up(dep, shells[dep.cluster.head], fabric)     # the page's controller facts
            logs[dep.cluster.head].write(page)
        except Exception as e:  # noqa: BLE001 - every host gets the reason
            f = failure(e)
            return [record(ctx, logs[n], "supervise", n, "failed", f"supervisor not installed: {f}", rc=f.rc)
                    for n in names]
        return [record(ctx, logs[n], "supervise", n,
                       "skipped" if "already running" in done[n] else "ok", done[n]) for n in names]
    finally:
        for log in logs.values():
            log.close()


STAGE = Stage("supervise", plan, apply, "install the supervisor that restarts the deployment after a failure")
