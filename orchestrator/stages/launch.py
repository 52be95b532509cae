"""launch: the engine containers on every host."""
from __future__ import annotations

from ..executors.docker_cli import docker_argv
from ..launch.containerspec import planned_spec
from ..launch.firewall import ruleset
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage


def plan(dep, options: RunOptions):
    e = dep.recipe.engine
    acts = []
    for h in dep.cluster.hosts:
        spec = planned_spec(dep, h)
        role = "head" if h.name == dep.cluster.head else "worker"
        fw = ruleset(dep, h)       # launch adds the fabric addresses it detects to the admitted sources
        acts.append(Action("launch", h.name, "docker-run",
                           f"start {e.kind} rank {h.rank} ({role}) from {e.image} on {h.name}"
                           + (f"; {dep.api_key.describe()}, required on /v1" if dep.api_key else "")
                           + (f"; firewall: {'; '.join(fw.summary)}" if not fw.empty else ""),
                           command=tuple(docker_argv(h, *spec.docker_run_argv()[1:])),
                           details={"container": spec.to_json(),
                                    **({"firewall": fw.to_json()} if not fw.empty else {})}, job=spec))
    return acts, ""


def apply(dep, actions, ctx):
    """Probe every host, prove the staged tables it will serve (prove_tables.py: unless this run's
    table stages did), refuse early, clear every host, start the head then the workers
    (orchestrator/launch/launcher.py): each host runs its action's planned ContainerSpec, bound to
    the fabric detected there; a cluster already running these specs is skipped."""
    # Imported here, not at the top: launcher reaches paramiko (executors/ssh.py), and planning must
    # not import the executors' libraries (tests/test_plan.py test_planning_is_pure). Not a cycle.
    from ..launch import launcher
    from .prove_tables import prove_host
    return launcher.apply(dep, actions, ctx, prove=lambda sh, staged: prove_host(dep, sh, ctx, staged))


STAGE = Stage("launch", plan, apply, "start the engine on every host")
