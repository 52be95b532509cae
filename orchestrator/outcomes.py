"""Per-host outcomes (a leaf: standard library only) and the one per-host runner.

Failures are values: `fn` raises `HostFailure` (or anything else) and the runner turns it into a
failed `HostResult`; one failed host never loses the others' results. `run_per_host` returns a
`HostResults`, a list with `.succeeded` and `.failed` (like fabric's GroupResult); `parallel` runs a
plain function per host (or any item) and returns a `PerItem` dict with `.ok` and `.failed`.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Literal, TypeVar

if TYPE_CHECKING:   # annotations only: never imported at run time (keeps this module a leaf)
    from .plan import Action
    from .runrecord import HostLog, RunContext

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


class HostResults(list):
    """The results of one step on several hosts, in action order: a list of HostResult with
    `.succeeded` (ok or skipped) and `.failed`. Adding two keeps the type."""

    def __init__(self, results: Iterable[HostResult] = ()):
        super().__init__(results)

    @property
    def succeeded(self) -> list[HostResult]:
        return [r for r in self if r.status != "failed"]

    @property
    def failed(self) -> list[HostResult]:
        return [r for r in self if r.status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed

    def __add__(self, other: Iterable[HostResult]) -> "HostResults":
        return HostResults([*self, *other])

    def __radd__(self, other: Iterable[HostResult]) -> "HostResults":
        return HostResults([*other, *self])


K = TypeVar("K")
T = TypeVar("T")


class PerItem(dict, Generic[K, T]):
    """{item: fn(item)} from `parallel`, where a value may be the exception that item raised;
    `.ok` and `.failed` split them."""

    @property
    def ok(self) -> "dict[K, T]":
        return {k: v for k, v in self.items() if not isinstance(v, BaseException)}

    @property
    def failed(self) -> "dict[K, BaseException]":
        return {k: v for k, v in self.items() if isinstance(v, BaseException)}


def _map(items: list, fn: Callable, max_workers: int | None = None) -> list:
    """fn over items, all at once (one thread each unless MAX_WORKERS), in order."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=max_workers or len(items)) as pool:
        return list(pool.map(fn, items))


def parallel(items: "Iterable[K]", fn: "Callable[[K], T]") -> "PerItem[K, T]":
    """fn(item) for every item at once; an exception is that item's value (never lost, never raised)."""
    items = list(items)

    def one(item: K) -> "T | BaseException":
        try:
            return fn(item)
        except Exception as e:  # noqa: BLE001 - per-item failures are values
            return e
    return PerItem(zip(items, _map(items, one)))


PerHostFn = Callable[["Action", "HostLog"], "HostResult | str | None"]


def run_per_host(actions: "list[Action]", ctx: "RunContext", fn: PerHostFn,
                 max_workers: int | None = None) -> HostResults:
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

    return HostResults(_map(list(actions), one, max_workers))
