"""The contract every pipeline stage implements, and the per-host result type.

A stage has a pure `plan(dep) -> (actions, note)` and an `apply(dep, actions, ctx)`
that performs them and returns one HostResult per action. Failures are values:
one failed host never loses the others' results.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

if TYPE_CHECKING:
    from ..deployment import Deployment
    from ..plan import Action
    from ..runrecord import HostLog, RunContext

Status = Literal["ok", "skipped", "failed"]


@dataclass
class HostResult:
    host: str
    stage: str
    status: Status
    message: str = ""
    rc: int | None = None
    log_path: str | None = None
    tail: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    def to_json(self) -> dict[str, Any]:
        d = {"host": self.host, "stage": self.stage, "status": self.status, "message": self.message}
        if self.rc is not None:
            d["rc"] = self.rc
        if self.log_path:
            d["log"] = self.log_path
        if self.tail:
            d["tail"] = self.tail
        if self.data:
            d["data"] = self.data
        return d


class HostFailure(Exception):
    """Raised inside a per-host apply function: becomes a failed HostResult."""

    def __init__(self, message: str, rc: int | None = None, tail: list[str] | None = None):
        super().__init__(message)
        self.rc, self.tail = rc, tail or []


PlanFn = Callable[["Deployment"], "tuple[list[Action], str]"]
ApplyFn = Callable[["Deployment", "list[Action]", "RunContext"], "list[HostResult]"]


@dataclass(frozen=True)
class Stage:
    name: str
    plan: PlanFn
    apply: ApplyFn
    help: str = ""


PerHostFn = Callable[["Action", "HostLog"], "HostResult | str | None"]


def run_per_host(actions: "list[Action]", ctx: "RunContext", fn: PerHostFn,
                 max_workers: int | None = None) -> list[HostResult]:
    """Run `fn(action, log)` for every action in parallel; exceptions become failed results.

    `fn` returns a HostResult, or a message string (status ok), or None.
    """
    def one(action: "Action") -> HostResult:
        log = ctx.host_log(action.host, action.stage)
        ctx.event("action-start", host=action.host, stage=action.stage, op=action.op)
        try:
            out = fn(action, log)
            if isinstance(out, HostResult):
                res = out
            else:
                res = HostResult(action.host, action.stage, "ok", out or "done")
        except HostFailure as e:
            log.write(f"FAILED: {e}")
            res = HostResult(action.host, action.stage, "failed", str(e), rc=e.rc,
                             tail=e.tail or log.tail())
        except Exception as e:  # a bug or an unexpected error: still a per-host value
            log.write(f"FAILED: {type(e).__name__}: {e}")
            res = HostResult(action.host, action.stage, "failed", f"{type(e).__name__}: {e}",
                             tail=log.tail())
        res.log_path = res.log_path or str(log.path)
        log.close()
        ctx.event("action-end", **res.to_json())
        return res

    if not actions:
        return []
    with ThreadPoolExecutor(max_workers=max_workers or len(actions)) as pool:
        return list(pool.map(one, actions))
