"""route: the deployment behind the inventory's one endpoint (all.vars.router; orchestrator/router/),
after health: the router image on the router host, the router running, and this deployment's model
registered there (docs/router.md)."""
from __future__ import annotations

from ..plan import Action
from ..router import layout
from ..runoptions import RunOptions
from .base import Stage


def plan(dep, options: RunOptions):
    conf = dep.cluster.router
    if conf is None:
        return [], "no router (all.vars.router is unset): clients use the deployment's own API"
    from ..router.control import check, image_plan
    check(dep)
    w = layout.worker(dep)
    if options.route_check_only:
        return [Action("route", conf.host.name, "router-check",
                       f"check the router at {conf.url}: /health answers, /v1/models lists {w['model']}, its keeper "
                       f"routes {dep.name} to {w['url']} (read-only)", details={"router": conf.url, "model": w["model"]})], ""
    image = image_plan(conf)
    built = (f"built there for {image['platform']} from dockerfiles/chains/router.yml when missing"
             if image["built"] else "the inventory's own")
    what = (f"router {layout.CONTAINER} at {conf.url} ({conf.image}, {built}; started unless running as "
            f"configured): model {w['model']} -> {w['url']} registered once its /health answers")
    return [Action("route", conf.host.name, "router", what,
                   details={"router": conf.url, "model": w["model"], "engine": w["url"],
                            "state_dir": layout.state_dir(conf), "image": image})], ""


def apply(dep, actions, ctx):
    from ..executors.shells import HostShell
    from ..launch.results import failure, record
    from ..router import control
    conf = dep.cluster.router
    (act,) = actions
    log = ctx.host_log(act.host, "route")
    sh = HostShell(dep.cluster, conf.host)
    try:
        try:
            if ctx.options.route_check_only:
                return [record(ctx, log, "route", act.host, "ok", control.verify(dep, sh))]
            iid, built = control.image(dep, ctx)
            log.write(built)
            log.write(control.install(dep, sh, iid))
            msg = control.join(dep, sh)
        except Exception as e:  # noqa: BLE001 - the router host gets the reason
            f = failure(e)
            return [record(ctx, log, "route", act.host, "failed", f"not behind the router: {f}", rc=f.rc)]
        return [record(ctx, log, "route", act.host, "ok", msg)]
    finally:
        sh.close()
        log.close()


STAGE = Stage("route", plan, apply, "put the deployment behind the inventory's one endpoint (the router)")
