"""Where a stage's per-host threads meet so that one collective transfer runs for all of them.

Each host's thread calls `join(name, what)` (what it needs) or `leave(name)` (it needs nothing, or
failed before); the transfer runs once every expected host did one of them, and each joined host
gets its own outcome back.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Gather(Generic[T]):
    def __init__(self, expected: set[str], run: Callable[[dict[str, Any]], dict[str, T]],
                 on_error: Callable[[str, Exception], T]):
        self._expected = set(expected)
        self._run, self._on_error = run, on_error
        self._wants: dict[str, Any] = {}
        self._results: dict[str, T] = {}
        self._cond = threading.Condition()
        self._started = self._finished = False

    def leave(self, name: str) -> None:
        with self._cond:
            self._expected.discard(name)
            self._maybe_start()

    def join(self, name: str, what: Any, timeout: float) -> T:
        with self._cond:
            self._wants[name] = what
            self._maybe_start()
            if not self._cond.wait_for(lambda: self._finished, timeout=timeout):
                return self._on_error(name, TimeoutError(f"the transfer did not finish within {timeout:g}s"))
            if name not in self._results:
                return self._on_error(name, RuntimeError("the transfer gave no result for this host"))
            return self._results[name]

    def _maybe_start(self) -> None:
        if self._started or not self._expected.issubset(self._wants):
            return
        self._started = True
        threading.Thread(target=self._go, args=(dict(self._wants),), daemon=True).start()

    def _go(self, wants: dict[str, Any]) -> None:
        try:
            results = self._run(wants) if wants else {}
        except Exception as e:  # a bug or a failure of the whole transfer: still a value per host
            results = {n: self._on_error(n, e) for n in wants}
        with self._cond:
            self._results = results
            self._finished = True
            self._cond.notify_all()
