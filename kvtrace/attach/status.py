"""The one-line live status while attached: events/s, bytes, lost."""
from __future__ import annotations

import sys
import time

from kvtrace.units import human_bytes


class StatusLine:
    def __init__(self, stream=sys.stderr, quiet: bool = False, every_s: float = 5.0):
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()
        self.every_s = 1.0 if self.tty else every_s
        self.t0 = self.last = time.monotonic()
        self.last_total = 0

    def update(self, total: int, read: int, written: int, lost: int, dropped: int = 0) -> None:
        now = time.monotonic()
        if self.quiet or now - self.last < self.every_s:
            return
        rate = (total - self.last_total) / max(now - self.last, 1e-9)
        self.last, self.last_total = now, total
        line = (
            f"kvtrace {now - self.t0:6.0f}s  events {total:,} ({rate:,.0f}/s)  "
            f"read {human_bytes(read)}  written {human_bytes(written)}  lost {lost:,}"
            + (f"  dropped {dropped:,}" if dropped else "")
        )
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()
