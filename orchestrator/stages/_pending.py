"""Shared by stages that are planned but not built yet: apply refuses, exit 2."""
from __future__ import annotations

from ..errors import NotImplementedStage


def not_implemented(stage: str, issue: str):
    def apply(dep, actions, ctx):
        raise NotImplementedStage(f"stage {stage!r} is not implemented yet ({issue}); "
                                  "nothing was done")
    return apply
