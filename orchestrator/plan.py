"""The plan: what `up` will do, stage by stage and host by host. Pure: no I/O, no executors.

Each action describes itself (the exact command or API call) for `plan` and
`--dry-run`, and carries a digest of its inputs so a re-run can skip what is done.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import schema
from .deployment import Deployment

PLAN_VERSION = 1


@dataclass(frozen=True)
class Action:
    stage: str
    host: str
    op: str                               # short verb: docker-build, ansible-playbook, docker-run ...
    summary: str                          # one line for people
    command: tuple[str, ...] = ()         # the argv it runs, where it runs one
    api: str = ""                         # or the API call it makes
    details: dict[str, Any] = field(default_factory=dict)
    digest: str = ""                      # of the inputs: same digest + done marker = skip

    def to_json(self) -> dict[str, Any]:
        d = {"stage": self.stage, "host": self.host, "op": self.op, "summary": self.summary}
        if self.command:
            d["command"] = list(self.command)
        if self.api:
            d["api"] = self.api
        if self.details:
            d["details"] = schema.to_dict(self.details)
        if self.digest:
            d["digest"] = self.digest
        return d


@dataclass(frozen=True)
class StagePlan:
    name: str
    actions: tuple[Action, ...]
    note: str = ""                        # e.g. why a stage has nothing to do for this recipe

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "actions": [a.to_json() for a in self.actions]}
        if self.note:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class Plan:
    deployment: Deployment
    stages: tuple[StagePlan, ...]
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. the sizing budget

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)

    def to_json(self) -> dict[str, Any]:
        from .secrets import mask_data, mask_override
        dep = self.deployment
        doc = {
            "version": PLAN_VERSION,
            "deployment": dep.name,
            "inventory": str(dep.cluster.file),
            "recipe": {"name": dep.recipe.name, "path": str(dep.loaded.path),
                       "digest": dep.recipe.digest, "overrides": [mask_override(o) for o in dep.loaded.overrides]},
            "head": dep.cluster.head,
            "api": dep.api_url,
            "hosts": [{"name": h.name, "address": h.address, "rank": h.rank, "hardware": h.hardware,
                       "gpus": h.gpus, "nvme_dir": h.nvme_dir, "model_cache": h.model_cache}
                      for h in dep.cluster.hosts],
            **self.extra,
            "stages": [s.to_json() for s in self.stages],
        }
        return mask_data(doc)


# Stages that need the model to fit in memory: a plan with one of them refuses a recipe that cannot.
NEEDS_FIT = ("preflight", "launch")


def build_plan(dep: Deployment, only: tuple[str, ...] = (), skip: tuple[str, ...] = (),
               require_fit: bool = True) -> Plan:
    """The plan; with `require_fit` (what `up` and the stage commands use) a plan that includes
    preflight or launch raises InputError (exit 2) naming each node that cannot hold its budget,
    the shortfall and the fix. `deployctl plan` passes False: it prints the budget, then exits 2."""
    from .stages import STAGES, select
    names = select(only, skip)
    if require_fit and any(n in names for n in NEEDS_FIT):
        from .sizing import require_fit as check
        check(dep)
    stages = []
    for st in STAGES:
        if st.name not in names:
            continue
        actions, note = st.plan(dep)
        stages.append(StagePlan(st.name, tuple(actions), note))
    extra: dict[str, Any] = {}
    from .sizing import plan_extra
    extra.update(plan_extra(dep))
    return Plan(dep, tuple(stages), extra)
