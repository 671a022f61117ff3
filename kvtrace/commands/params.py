"""Option types shared by the commands: one place that says what a number of seconds may be."""
from __future__ import annotations

import math

import click

# The bounds of the time options, each stated in its --help and its error message.
# attach's loop polls every 0.05 s (kvtrace/attach/session.py), so a flush interval at or below
# that flushes at every poll, as 0 did: a part file per table 20 times a second.  0.1 s still
# allows a short interval; a crash loses at most one.
FLUSH_MIN_S = 0.1
METRICS_MIN_S = 0.1    # a /metrics scrape costs vLLM's API server about 10 ms of CPU: 10% of a core


class Seconds(click.ParamType):
    """A finite number of seconds, greater than zero and at least ``minimum``.

    nan, inf and values at or below zero are refused with one line naming the option and the bound
    (nan compares False with everything, so a plain ``<= 0`` check lets it through)."""

    name = "seconds"

    def __init__(self, minimum: float = 0.0):
        self.minimum = minimum

    def bound(self) -> str:
        return f"at least {self.minimum:g}" if self.minimum > 0 else "more than 0"

    def convert(self, value, param, ctx) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number: give a finite number of seconds, {self.bound()}", param, ctx)
        if not math.isfinite(v) or v <= 0 or v < self.minimum:
            self.fail(f"{value} is out of range: give a finite number of seconds, {self.bound()}", param, ctx)
        return v
