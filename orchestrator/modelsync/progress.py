"""Per-worker progress of a push: bytes, rate and ETA from rsync's --info=progress2 lines.

Console (unless --json / -q): a line per worker at every further 10 % or every 30 s, whichever
comes first; the host's log gets a line every 2 s. Rate and ETA are our own (bytes over wall time),
so they do not depend on rsync's unit formatting.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from .manifest import gb
from .rsync import parse_progress

if TYPE_CHECKING:
    from ..runrecord import HostLog, RunContext

CONSOLE_STEP_PCT = 10
CONSOLE_EVERY_S = 30.0
LOG_EVERY_S = 2.0


def hms(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    def __init__(self, host: str, total: int, ctx: "RunContext", log: "HostLog",
                 clock: Callable[[], float] = time.monotonic):
        self.host, self.total, self.ctx, self.log, self.clock = host, total, ctx, log, clock
        self.t0 = clock()
        self.done = 0
        self._said_pct = -CONSOLE_STEP_PCT
        self._said_t = self._logged_t = self.t0 - CONSOLE_EVERY_S

    def line(self, text: str) -> None:
        """One output line of rsync: progress lines update the counters, others go to the log."""
        p = parse_progress(text)
        if p is None:
            self.log.write(text)
            return
        self.update(p[0])

    def update(self, done: int, what: str = "") -> None:
        """DONE bytes so far (WHAT: e.g. the current file, said after the figures): logged every
        LOG_EVERY_S, said at every further CONSOLE_STEP_PCT or CONSOLE_EVERY_S."""
        self.done = done
        now = self.clock()
        tail = f"; {what}" if what else ""
        if now - self._logged_t >= LOG_EVERY_S:
            self._logged_t = now
            self.log.write(self.describe(now) + tail)
        step = int(self.pct // CONSOLE_STEP_PCT) * CONSOLE_STEP_PCT
        if step > self._said_pct or now - self._said_t >= CONSOLE_EVERY_S:
            self._said_pct = step
            self._said_t = now
            self.ctx.say(f"  [dim]{self.host}[/dim] {self.describe(now)}{tail}")

    def rate(self, now: float | None = None) -> float:
        dt = (now if now is not None else self.clock()) - self.t0
        return self.done / dt if dt > 0 else 0.0

    @property
    def pct(self) -> float:
        return 100 * self.done / self.total if self.total else 100.0

    def describe(self, now: float) -> str:
        rate = self.rate(now)
        # The first bytes arrive before the transfer reaches speed: no ETA from under 1% done.
        eta = hms((self.total - self.done) / rate) if rate > 0 and self.done * 100 >= self.total else "?"
        return f"{gb(self.done)} of {gb(self.total)} ({self.pct:.0f}%) at {rate / 1e6:.1f} MB/s, ETA {eta}"
