"""The plan: what `up` will do, stage by stage and host by host. Data only: no I/O, no executors.
Plans are built by the stage registry (`orchestrator.stages.build_plan`); each StagePlan carries
the Stage that applies it.

Each action describes itself (the exact command or API call) for `plan` and `--dry-run`, and
carries the typed job its stage's `apply` executes (a table job, a container spec, ...): what the
plan shows is what runs. Re-runs skip what is done by asking the hosts (manifests, spec labels), not by
comparing plan digests.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from . import schema
from .deployment import Deployment

PLAN_VERSION = 1


class AppliesStage(Protocol):
    """What a StagePlan carries to be applied: an `orchestrator.stages.base.Stage` (named by shape
    here, not imported: plan.py is data, below the stages)."""
    name: str

    def apply(self, dep: Deployment, actions: list, ctx: Any) -> list: ...


@dataclass(frozen=True)
class Action:
    stage: str
    host: str
    op: str                               # short verb: docker-build, ansible-playbook, docker-run ...
    summary: str                          # one line for people
    command: tuple[str, ...] = ()         # the argv it runs, where it runs one
    api: str = ""                         # or the API call it makes
    details: dict[str, Any] = field(default_factory=dict)
    job: Any = field(default=None, compare=False, repr=False)   # what apply executes (the stage's type)

    def to_json(self) -> dict[str, Any]:
        d = {"stage": self.stage, "host": self.host, "op": self.op, "summary": self.summary}
        if self.command:
            d["command"] = list(self.command)
        if self.api:
            d["api"] = self.api
        if self.details:
            d["details"] = schema.to_dict(self.details)
        return d


@dataclass(frozen=True)
class StagePlan:
    name: str
    actions: tuple[Action, ...]
    note: str = ""                        # e.g. why a stage has nothing to do for this recipe
    stage: AppliesStage | None = field(default=None, compare=False, repr=False)   # what applies it

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
            "api_listen": {"address": dep.api_listen,
                           "scope": "every interface (all.vars.api_listen)" if dep.api_listens_everywhere
                           else "the head's management address" if dep.api_listen == dep.cluster.head_host.address
                           else "one address (all.vars.api_listen)"},
            "hosts": [{"name": h.name, "address": h.address, "rank": h.rank, "hardware": h.hardware,
                       "gpus": h.gpus, "nvme_dir": h.nvme_dir, "model_cache": h.model_cache}
                      for h in dep.cluster.hosts],
            **({"replica": {"of": dep.cluster.replica[0], "index": dep.cluster.replica[1],
                            "count": dep.cluster.replica[2]}} if dep.cluster.replica else {}),
            **self.extra,
            "stages": [s.to_json() for s in self.stages],
        }
        return mask_data(doc)
