"""The agent's resident memory in steady state stays under 150 MB (kvtrace.capture.memory),
while it records every call of a traced command and streams spans over OTLP.

The traced command is the agent's child: it reads the agent's VmRSS (/proc/<agent>/status, the
kernel's count) twice a second while it makes its own paced reads, from 3 s after the agent
let it start (past the start-up flushes)."""
from __future__ import annotations

import json
import statistics
import sys

import pytest

from kvtrace.dataset.reader import Dataset
from tests.conftest import run_kvtrace
from tests.otlp_receiver import Receiver

pytestmark = pytest.mark.root

TARGET = 150_000_000      # bytes (#9: "under 150 MB")
SECONDS, RATE = 20, 1000  # paced preads
PACED = r"""
import json, os, sys, time
agent = os.getppid()
def rss():
    for line in open(f"/proc/{agent}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
path, seconds, rate, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fd = os.open(path, os.O_RDONLY)
time.sleep(3.0)
samples, calls = [], 0
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    for _ in range(rate // 2):
        os.pread(fd, 4096, 0)
        calls += 1
        time.sleep(0.0008)
    samples.append(rss())
json.dump({"pid": os.getpid(), "calls": calls, "rss": samples}, open(out, "w"))
"""


def test_steady_state_rss_under_150_mb(tmp_path):
    data = tmp_path / "data"
    data.write_bytes(b"k" * 4096)
    out, result = tmp_path / "ds", tmp_path / "result.json"
    rx = Receiver().start()
    try:
        p = run_kvtrace("attach", "--quiet", "--out", str(out), "--otlp", rx.url("grpc"), "--",
                        sys.executable, "-c", PACED, str(data), str(SECONDS), str(RATE), str(result), timeout=600)
    finally:
        rx.stop(grace=1)
    assert p.returncode == 0, p.stderr
    truth = json.loads(result.read_text())
    rss = truth["rss"]
    assert len(rss) >= SECONDS, rss
    assert max(rss) < TARGET, (f"agent RSS MiB {[x >> 20 for x in rss]}", statistics.fmean(rss) / 2**20)
    # and it kept every call meanwhile
    reads = [r for r in Dataset.open(out).table("file_io").to_pylist()
             if r["pid"] == truth["pid"] and r["path"] == str(data) and r["syscall"] == "pread64"]
    assert len(reads) == truth["calls"] and sum(r["bytes"] * r["weight"] for r in reads) == truth["calls"] * 4096
    (run,) = Dataset.open(out).runs()
    assert run["lost_events"] == {} and run["dropped_events"] == 0
