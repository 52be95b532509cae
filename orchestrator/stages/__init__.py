"""The pipeline's stages, in the order `up` runs them.

Each stage lives in its own module (orchestrator/stages/<name>.py) and exposes
STAGE, a `Stage(name, plan, apply)`.
"""
from __future__ import annotations

from ..errors import InputError
from . import (build, health, launch, preflight, ship, stage_engram, sync_model, write_ple)
from .base import HostResult, Stage

STAGES: tuple[Stage, ...] = (
    preflight.STAGE, build.STAGE, ship.STAGE, sync_model.STAGE, stage_engram.STAGE,
    write_ple.STAGE, launch.STAGE, health.STAGE,
)
NAMES = tuple(s.name for s in STAGES)


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


__all__ = ["STAGES", "NAMES", "Stage", "HostResult", "get", "select"]
