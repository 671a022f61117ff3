"""Phase marks (KVTRACE_TIMINGS=1) that bench/attach.py reads from `kvtrace attach`'s stderr."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from kvtrace import phases


def test_marks_only_when_asked_and_parse_back():
    code = "from kvtrace import phases; phases.mark('a'); phases.mark('inject_start', 'install', 42)"
    env = {k: v for k, v in os.environ.items() if k != "KVTRACE_TIMINGS"}
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert off.stderr == ""
    t0 = time.monotonic_ns()
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={**env, "KVTRACE_TIMINGS": "1"}, check=True)
    t1 = time.monotonic_ns()
    marks = phases.parse(on.stderr.splitlines(keepends=True) + ["kvtrace: attached ...\n"])
    assert [(n, d) for n, d, _ in marks] == [("a", []), ("inject_start", ["install", "42"])]
    assert all(t0 <= t <= t1 for _, _, t in marks)  # CLOCK_MONOTONIC, shared across processes
    assert marks[0][2] <= marks[1][2]
