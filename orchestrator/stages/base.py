"""The contract every pipeline stage implements.

A stage has a pure `plan(dep, options) -> (actions, note)` (options: the command's RunOptions; each
action carries the typed job apply runs) and an `apply(dep, actions, ctx)`
that performs them and returns one HostResult per action (orchestrator/outcomes.py:
`HostResult`, `HostFailure`, `run_per_host`). Failures are values: one failed host
never loses the others' results.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..outcomes import HostResult
    from ..plan import Action
    from ..runoptions import RunOptions
    from ..runrecord import RunContext

PlanFn = Callable[["Deployment", "RunOptions"], "tuple[list[Action], str]"]
ApplyFn = Callable[["Deployment", "list[Action]", "RunContext"], "list[HostResult]"]


@dataclass(frozen=True)
class Stage:
    name: str
    plan: PlanFn
    apply: ApplyFn
    help: str = ""
