"""Events the kernel does not run kvtrace's program for are counted, not silently lost.

A tracepoint's BPF program is skipped when it interrupts another BPF program on that CPU.
Here a BPF program of the test's own spins ~2 ms in every getppid() of a busy process
pinned to CPU 0, and the workload, pinned to CPU 0 too, reads a loop device whose
completions are forced back onto the submitting CPU (rq_affinity=2): most completions land
inside the spin, so the kernel skips kvtrace's block_rq_complete program for them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.capture import progstats
from kvtrace.dataset.reader import Dataset
from tests.conftest import run_kvtrace
from tests.privileged.conftest import disk_stat
from tests.privileged.test_capture import WORKLOAD

pytestmark = pytest.mark.root

SPIN = r"""
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    if ((bpf_get_current_pid_tgid() >> 32) != SPINNER)
        return 0;
    u64 x = 0;
    for (int i = 0; i < 60000; i++)
        x += bpf_ktime_get_ns();
    return x == 1;
}
"""


@pytest.fixture
def spinner():
    """A process on CPU 0 that spends nearly all its time inside a BPF program."""
    from bcc import BPF

    if os.cpu_count() < 2:
        pytest.skip("needs 2 CPUs: completions must come from another CPU")
    proc = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", "import os\nwhile True: os.getppid()"])
    b = BPF(text=SPIN.replace("SPINNER", str(proc.pid)).encode())
    try:
        yield b
    finally:
        proc.kill()
        proc.wait()
        b.cleanup()


def test_skipped_completions_are_counted(tmp_path, loopdev, spinner):
    disk = os.path.basename(loopdev)
    affinity = Path(f"/sys/block/{disk}/queue/rq_affinity")
    old = affinity.read_text().strip()
    affinity.write_text("2")
    try:
        # the spinner's program really is skipped-over work: it runs, and costs ~2 ms a call
        (fd,) = [f.fd for f in spinner.funcs.values()]
        assert progstats.recursion_misses(fd) is not None, "this kernel does not report recursion_misses"
        before = disk_stat(loopdev)
        out, result = tmp_path / "ds", tmp_path / "result.json"
        p = run_kvtrace("attach", "--quiet", "--out", str(out), "--", "taskset", "-c", "0", *WORKLOAD, "direct",
                        "--path", loopdev, "--chunk", "4096", "--count", "40", "--result", str(result), timeout=300)
        assert p.returncode == 0, p.stderr
        after = disk_stat(loopdev)
    finally:
        affinity.write_text(old)
    ds, truth = Dataset.open(out), json.loads(result.read_text())
    (run,) = ds.runs()
    block = [r for r in ds.table("block_io").to_pylist() if r["disk"] == disk]
    untimed = [r for r in block if r["latency_ns"] is None]
    skipped = run["kernel_skips"].get("block:block_rq_complete", 0)
    # every request is in the dataset, as the kernel counts them; the ones whose completion
    # the kernel did not run the probe for have no latency, and each of them is counted
    assert len(block) == 40 == after["reads"] - before["reads"]
    assert sum(r["bytes"] for r in block) == truth["bytes"] == 40 * 4096
    assert len(untimed) >= 1, "no completion landed inside the spinning program"
    assert skipped >= len(untimed), run["kernel_skips"]
    (agg,) = [s for s in json.loads(run["sidecars"]) if s["name"] == "io_agg"]
    assert agg["block_unseen_at_stop"] == len(untimed) and agg["block_open_at_stop"] == 0
    # and the summary says so
    summary = run_kvtrace("summary", str(tmp_path / "ds"))
    assert summary.returncode == 0 and f"block:block_rq_complete {skipped}" in summary.stdout, summary.stdout
