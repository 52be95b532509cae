"""The stage registry: the pipeline's stages in the order `up` runs them, and plan building.

Each stage lives in its own module (orchestrator/stages/<name>.py) and exposes
STAGE, a `Stage(name, plan, apply)`. `build_plan` asks each selected stage for its actions
and puts the Stage itself in its StagePlan, so the runner applies it without a lookup.
"""
from __future__ import annotations

from typing import Any

from ..deployment import Deployment
from ..errors import InputError
from ..plan import Plan, StagePlan
from ..runoptions import RunOptions
from ..sizing import plan_extra
from ..sizing import require_fit as check_fit
from . import (build, fabric, fetch_model, health, launch, preflight, route, ship, stage_engram, supervise,
               sync_model, write_ple)
from .base import Stage

STAGES: tuple[Stage, ...] = (
    preflight.STAGE, fabric.STAGE, build.STAGE, ship.STAGE, fetch_model.STAGE, sync_model.STAGE, stage_engram.STAGE,
    write_ple.STAGE, launch.STAGE, health.STAGE, supervise.STAGE, route.STAGE,
)
NAMES = tuple(s.name for s in STAGES)

# Stages that need the model to fit in memory: a plan with one of them refuses a recipe that cannot.
NEEDS_FIT = ("preflight", "launch")


def get(name: str) -> Stage:
    for s in STAGES:
        if s.name == name:
            return s
    raise InputError(f"unknown stage {name!r} (stages: {', '.join(NAMES)})")


def select(only: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    for n in (*only, *skip):
        get(n)
    names = [n for n in NAMES if (not only or n in only) and n not in skip]
    if not names:
        raise InputError("--only/--skip leave no stage to run", key="--only")
    return tuple(names)


def build_plan(dep: Deployment, only: tuple[str, ...] = (), skip: tuple[str, ...] = (),
               require_fit: bool = True, options: RunOptions | None = None) -> Plan:
    """The plan; with `require_fit` (what `up` and the stage commands use) a plan that includes
    preflight or launch raises InputError (exit 2) naming each node that cannot hold its budget,
    the shortfall and the fix. `deployctl plan` passes False: it prints the budget, then exits 2.
    OPTIONS: the command's RunOptions (the flags some stages' commands depend on, e.g. sync-model's)."""
    names = select(only, skip)
    if require_fit and any(n in names for n in NEEDS_FIT):
        check_fit(dep)
    stages = []
    for st in STAGES:
        if st.name not in names:
            continue
        actions, note = st.plan(dep, options or RunOptions())
        stages.append(StagePlan(st.name, tuple(actions), note, stage=st))
    extra: dict[str, Any] = {}
    extra.update(plan_extra(dep))
    if dep.checkpoint is not None:           # the resolved commit: in plan.json of the run record
        extra["checkpoint"] = dep.checkpoint.to_json()
    return Plan(dep, tuple(stages), extra)


__all__ = ["STAGES", "NAMES", "NEEDS_FIT", "Stage", "build_plan", "get", "select"]
