"""Apply a plan: stage by stage, hosts in parallel inside a stage, results per host as values."""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rich.markup import escape

from .errors import DeployctlError
from .outcomes import HostResult
from .plan import Plan, StagePlan
from .runrecord import RunContext


@dataclass
class StageOutcome:
    name: str
    status: str                         # ok | failed | skipped
    results: list[HostResult] = field(default_factory=list)
    note: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3),
             "results": [r.to_json() for r in self.results]}
        if self.note:
            d["note"] = self.note
        return d


@dataclass
class RunOutcome:
    run_dir: str
    status: str                         # ok | failed | cancelled | error
    exit_code: int
    stages: list[StageOutcome]
    error: str = ""

    @property
    def failures(self) -> list[HostResult]:
        return [r for s in self.stages for r in s.results if r.status == "failed"]

    def to_json(self) -> dict[str, Any]:
        d = {"run_dir": self.run_dir, "status": self.status, "exit_code": self.exit_code,
             "stages": [s.to_json() for s in self.stages]}
        if self.error:
            d["error"] = self.error
        return d


SERVES = "health"      # the stage after which what launch started is a deployment that serves


def served(outcome: "RunOutcome") -> bool:
    """Whether OUTCOME's run passed its health check: every stage up to health went well, whatever
    failed after it. A run that served made a release, even when a later stage failed."""
    names = [s.name for s in outcome.stages]
    if SERVES not in names or outcome.status == "cancelled":
        return False
    upto = outcome.stages[:names.index(SERVES) + 1]
    return all(s.status != "failed" for s in upto)


def run(plan: Plan, ctx: RunContext, command: str = "up") -> RunOutcome:
    """Apply PLAN. Ctrl-C sets ctx.cancel at once (stages' loops stop within a poll), then runs the
    callables in ctx.state.cleanups; a failed stage runs ctx.state.failure_cleanups."""
    ctx.write_json("plan.json", plan.to_json())
    started = time.time()
    outcomes: list[StageOutcome] = []
    status, code, error = "ok", 0, ""
    previous = signal.getsignal(signal.SIGINT) if _main_thread() else None
    # Libraries the stages use leave signal handlers as they found them (the Ansible executor restores
    # what ansible-runner installs), so arming once holds for the whole run.
    _cancel_on_sigint(ctx)
    try:
        for sp in plan.stages:
            if ctx.cancel.is_set():
                status, code = "cancelled", 130
                break
            ctx.event("stage-start", stage=sp.name, actions=len(sp.actions))
            t0 = time.monotonic()
            if not sp.actions:
                ctx.say(f"[dim]- {sp.name}: skipped ({sp.note or 'nothing to do'})[/dim]")
                outcomes.append(StageOutcome(sp.name, "skipped", note=sp.note))
                ctx.event("stage-end", stage=sp.name, status="skipped", note=sp.note)
                continue
            ctx.say(f"[bold]> {sp.name}[/bold] ({len(sp.actions)} action(s))")
            results = _stage_of(sp).apply(plan.deployment, list(sp.actions), ctx)
            failed = [r for r in results if r.status == "failed"]
            st_status = "failed" if failed else (
                "skipped" if results and all(r.status == "skipped" for r in results) else "ok")
            out = StageOutcome(sp.name, st_status, results, sp.note, time.monotonic() - t0)
            outcomes.append(out)
            say_results(ctx, results)
            ctx.event("stage-end", stage=sp.name, status=st_status, seconds=round(out.seconds, 3))
            if failed:
                status, code = "failed", 1
                _run_cleanups(ctx, ctx.state.failure_cleanups)
                break
            if sp.name == SERVES:
                # the new engines answered: a later stage's failure (supervise) is said, never undone
                # by removing a deployment that serves (nothing would run, and no rollback follows)
                ctx.state.failure_cleanups.clear()
    except KeyboardInterrupt:
        ctx.cancel.set()
        status, code, error = "cancelled", 130, "interrupted (Ctrl-C)"
        ctx.say("[yellow]interrupted (Ctrl-C): cleaning up[/yellow]")
        _run_cleanups(ctx, ctx.state.cleanups)
    except DeployctlError as e:
        status, code, error = "error", e.exit_code, str(e)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    outcome = RunOutcome(str(ctx.run_dir), status, code, outcomes, error)
    ctx.write_json("status.json", {"command": command, "started": started, "finished": time.time(),
                                   **outcome.to_json()})
    ctx.event("run-end", status=status, exit_code=code)
    return outcome


def _stage_of(sp: StagePlan):
    """The Stage a StagePlan carries (`orchestrator.stages.build_plan` puts it there)."""
    if sp.stage is None:
        raise DeployctlError(f"internal error: the plan's stage {sp.name!r} carries no Stage to apply it "
                             "(build plans with orchestrator.stages.build_plan)")
    return sp.stage


def say_results(ctx: RunContext, results: list[HostResult]) -> None:
    for r in results:
        mark = {"ok": "[green]ok[/green]", "skipped": "[dim]skip[/dim]",
                "failed": "[red]FAILED[/red]"}[r.status]
        ctx.say(f"  {r.host}: {mark} {escape(r.message)}")


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _cancel_on_sigint(ctx: RunContext) -> None:
    """Ctrl-C: set ctx.cancel before KeyboardInterrupt unwinds, so worker threads (which the main
    thread waits for) see it and stop at once. Signal handlers can only be set in the main thread."""
    if not _main_thread():
        return

    def on_sigint(signum, frame):
        ctx.cancel.set()
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, on_sigint)


def _run_cleanups(ctx: RunContext, registered: "list[Callable[[], None]]") -> None:
    """Registered cleanups, newest first; a second Ctrl-C does not cut them short (each is bounded)."""
    fns = list(reversed(registered))
    if not fns:
        return
    main = _main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        for fn in fns:
            try:
                fn()
            except Exception as e:  # cleanup must not hide the interrupt or the failure
                ctx.event("cleanup-error", error=str(e))
                ctx.say(f"[red]cleanup failed:[/red] {e}")
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


def describe_failure(r: HostResult) -> str:
    """host, stage, exit code, message, log tail and log path: what an operator needs at 3 a.m."""
    rc = f" (exit code {r.rc})" if r.rc is not None else ""
    lines = [f"{r.host}: stage {r.stage} failed{rc}: {r.message}"]
    if r.tail:
        lines.append("  last lines:")
        lines.extend(f"    | {t}" for t in r.tail[-10:])
    if r.log_path:
        lines.append(f"  log: {r.log_path}")
    return "\n".join(lines)
