"""health: every container stays up and the API really answers (a chat completion)."""
from __future__ import annotations

from ..launch.commands import list_argv
from ..plan import Action
from ..runoptions import RunOptions
from .base import Stage


def plan(dep, options: RunOptions):
    c, r = dep.cluster, dep.recipe
    base = dep.api_url
    name = r.engine.container_name or f"deployctl-{dep.name}"
    acts = []
    for h in c.hosts:
        watch = (f"container {name} of {dep.name} running, no restart, up {r.health.stay_up_s:g}s "
                 f"after the API answers")
        if h.name == c.head:
            acts.append(Action(
                "health", h.name, "http-checks",
                f"wait up to {r.health.startup_timeout_s:g}s for {base}/health, {r.engine.served_name} in "
                f"/v1/models, a chat completion; {watch}",
                api=f"GET {base}/health; GET {base}/v1/models; POST {base}/v1/chat/completions "
                    f"{{\"messages\": [{{\"role\": \"user\", \"content\": \"{r.health.prompt}\"}}], "
                    f"\"max_tokens\": {r.health.max_tokens}}}"))
        else:
            acts.append(Action("health", h.name, "watch-container", watch,
                               command=tuple(list_argv(h.docker_host, dep.name))))
    return acts, ""


def apply(dep, actions, ctx):
    """One loop over all hosts and the API (orchestrator/launch/monitor.py)."""
    # Imported here, not at the top: monitor reaches paramiko (executors/ssh.py), and planning must
    # not import the executors' libraries (tests/test_plan.py test_planning_is_pure). Not a cycle.
    from ..launch import monitor
    return monitor.apply(dep, actions, ctx)


STAGE = Stage("health", plan, apply, "check the API until it really answers")
