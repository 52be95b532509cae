"""A rich progress bar per worker for `ship` (none with --json or -q)."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runrecord import RunContext


class ShipProgress:
    def __init__(self, ctx: "RunContext"):
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        self._done: dict[str, int] = {}
        self._lock = threading.Lock()
        if ctx.console is not None and not ctx.quiet:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TransferSpeedColumn)
            self._bar = Progress(TextColumn("  {task.description:<10}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
                                 console=ctx.console, transient=False)

    def __enter__(self) -> "ShipProgress":
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def add(self, host: str, total: int | None, status: str) -> None:
        if self._bar is None:
            return
        with self._lock:
            if host not in self._tasks:
                self._tasks[host] = self._bar.add_task(host, total=total, status=status)
            else:
                self._bar.update(self._tasks[host], total=total, status=status)

    def update(self, host: str, completed: int | None = None, status: str | None = None,
               finished: bool = False) -> None:
        if self._bar is None:
            return
        with self._lock:
            task = self._tasks.get(host)
            if task is None:
                task = self._tasks[host] = self._bar.add_task(host, total=None, status="")
            kw: dict[str, Any] = {}
            if completed is not None:
                self._done[host] = completed
                kw["completed"] = completed
            if status is not None:
                kw["status"] = status
            if finished:
                kw["total"] = kw["completed"] = self._done.get(host, 0)
            self._bar.update(task, **kw)
