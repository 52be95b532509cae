"""Per-host results of the launch and health stages, written to the host's log and the run's events."""
from __future__ import annotations

from typing import Any

from ..errors import InputError
from ..executors.ssh import SSHError
from ..outcomes import HostFailure, HostResult
from ..runrecord import HostLog, RunContext
from ..executors.ssh import short_reason


def failure(e: BaseException) -> HostFailure:
    """Any per-host exception as a HostFailure with a one-line message (the result names the host)."""
    if isinstance(e, HostFailure):
        return e
    if isinstance(e, (SSHError, InputError)):
        return HostFailure(short_reason(e))
    return HostFailure(f"{type(e).__name__}: {e}")


def record(ctx: RunContext, log: HostLog, stage: str, host: str, status: str, message: str, *,
           rc: int | None = None, tail: list[str] | None = None,
           data: dict[str, Any] | None = None) -> HostResult:
    """The host's result for STAGE: its log gets the outcome, the run's events the action-end.
    A failure without its own TAIL carries the last lines of the host's stage log."""
    log.write(f"{status.upper()}: {message}")
    if tail is None:
        tail = log.tail() if status == "failed" else []
    res = HostResult(host, stage, status, message, rc=rc, log_path=str(log.path), tail=tail, data=data or {})
    ctx.event("action-end", **res.to_json())
    return res
