"""The ring reader wakes on a timer, not once per event (probes/kvtrace.h, kvtrace.capture.loader).

Each wakeup of the agent lands on a CPU the traced server is using, so an event stream paced
one call per millisecond must not wake the reader once per call; every call must still be
recorded.  The traced command is the agent's child: it reads the reader thread's context
switches (/proc/<agent>/task/*/comm is "kvtrace-ring") before and after its own calls."""
from __future__ import annotations

import json
import sys

import pytest

from kvtrace.dataset.reader import Dataset
from tests.conftest import run_kvtrace

pytestmark = pytest.mark.root

CALLS = 2000
PACED = r"""
import json, os, sys, time
agent = os.getppid()
def ring_switches():
    for t in os.listdir(f"/proc/{agent}/task"):
        try:
            if open(f"/proc/{agent}/task/{t}/comm").read().strip() == "kvtrace-ring":
                st = open(f"/proc/{agent}/task/{t}/status").read()
                return int(st.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        except OSError:
            pass
    return None
path, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fd = os.open(path, os.O_RDONLY)
time.sleep(0.5)                       # past the agent's start
s0, t0 = ring_switches(), time.monotonic()
for _ in range(n):
    os.pread(fd, 4096, 0)
    time.sleep(0.001)
s1, t1 = ring_switches(), time.monotonic()
json.dump({"pid": os.getpid(), "before": s0, "after": s1, "seconds": t1 - t0}, open(out, "w"))
"""


def test_paced_events_do_not_wake_the_reader_each(tmp_path):
    data = tmp_path / "data"
    data.write_bytes(b"k" * 4096)
    out, result = tmp_path / "ds", tmp_path / "result.json"
    p = run_kvtrace("attach", "--quiet", "--probe", "fileio", "--no-writes", "--out", str(out), "--",
                    sys.executable, "-c", PACED, str(data), str(CALLS), str(result), timeout=300)
    assert p.returncode == 0, p.stderr
    truth = json.loads(result.read_text())
    assert truth["before"] is not None and truth["after"] is not None, "no kvtrace-ring thread in the agent"
    wakeups = truth["after"] - truth["before"]
    ticks = truth["seconds"] * 1000 / 50          # the reader's 50 ms timer over the paced calls
    # one wakeup per call would be ~CALLS; the timer gives ~ticks (slack for the flushes' lock)
    assert wakeups <= 2 * ticks + 20, (wakeups, ticks)
    reads = [r for r in Dataset.open(out).table("file_io").to_pylist()
             if r["pid"] == truth["pid"] and r["path"] == str(data) and r["syscall"] == "pread64"]
    assert len(reads) == CALLS and sum(r["bytes"] for r in reads) == CALLS * 4096
    (run,) = Dataset.open(out).runs()
    assert run["lost_events"] == {} and run["dropped_events"] == 0
