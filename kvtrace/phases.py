"""Phase marks for benchmarks: with KVTRACE_TIMINGS=1 in its environment, kvtrace writes one
stderr line per phase boundary, ``kvtrace: timing NAME [DETAIL ...] MONOTONIC_NS``
(CLOCK_MONOTONIC, the clock of every record).  Used by bench/attach.py to split the time from
``kvtrace attach`` to the first hook record into discovery, BPF build and load, and injection.
Off (one dict lookup at import) otherwise.
"""
from __future__ import annotations

import os
import sys
import time

ON = os.environ.get("KVTRACE_TIMINGS") == "1"


def mark(name: str, *detail) -> None:
    if not ON:
        return
    words = " ".join([name, *map(str, detail), str(time.monotonic_ns())])
    try:
        sys.stderr.write(f"kvtrace: timing {words}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def parse(lines) -> list[tuple[str, list[str], int]]:
    """(name, detail, t_ns) of every timing line among ``lines``."""
    out = []
    for line in lines:
        if line.startswith("kvtrace: timing "):
            words = line.split()[2:]
            out.append((words[0], words[1:-1], int(words[-1])))
    return out
