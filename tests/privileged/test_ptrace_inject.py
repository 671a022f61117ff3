"""The ptrace injector against real Python processes: it runs code in a live interpreter, and
where it cannot it gives up within its timeout with one reason, leaving the target running and
untraced (no safe point reached, the target dying mid-injection, another tracer)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from kvtrace.errors import TargetError
from kvtrace.inject import ptrace

pytestmark = pytest.mark.root

SLEEPER = "import time\nwhile True: time.sleep(0.05)\n"
SPINNER = "x = 0\nwhile True: x += 1\n"   # pure bytecode: no system call, so no safe point


def _start(src: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", src])
    time.sleep(1.0)   # past interpreter start-up
    assert p.poll() is None
    return p


def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def _untouched(p: subprocess.Popen) -> None:
    """Alive, not stopped, no tracer left attached."""
    assert p.poll() is None
    st = _status(p.pid)
    assert st["TracerPid"] == "0", st["TracerPid"]
    assert st["State"][0] in "RS", st["State"]


def test_code_runs_in_a_live_interpreter_which_carries_on(tmp_path):
    out = tmp_path / "ran"
    p = _start(SLEEPER)
    try:
        rc = ptrace.run_code(p.pid, f"import os; open({str(out)!r}, 'w').write(str(os.getpid()))", timeout=10)
        assert rc == 0 and out.read_text() == str(p.pid)
        _untouched(p)
        rc = ptrace.run_code(p.pid, "raise ValueError('refused inside')", timeout=10)
        assert rc == -1   # an exception in the injected code is its result, not the target's death
        time.sleep(0.3)
        _untouched(p)
    finally:
        p.kill()


def test_no_safe_point_gives_up_within_the_timeout_and_leaves_the_target_running():
    p = _start(SPINNER)
    try:
        t0 = time.monotonic()
        with pytest.raises(TargetError, match=r"made no system call within 2s \(no safe point\): injection abandoned, target untouched"):
            ptrace.run_code(p.pid, "pass", timeout=2)
        assert time.monotonic() - t0 < 60   # bounded: it returns, it does not wait for the target
        time.sleep(0.3)
        _untouched(p)
        assert _status(p.pid)["State"][0] == "R"   # still spinning
    finally:
        p.kill()


def test_target_dying_during_injection_is_one_reason():
    p = _start(SPINNER)
    killer = threading.Timer(1.0, p.kill)
    killer.start()
    try:
        with pytest.raises(TargetError, match=rf"process {p.pid} exited during injection"):
            ptrace.run_code(p.pid, "pass", timeout=20)
    finally:
        killer.cancel()
        p.kill()
        p.wait(10)


def test_another_tracer_means_denied_and_untouched():
    import shutil

    if not shutil.which("strace"):
        pytest.skip("strace is not installed (scripts/setup-host installs it)")
    p = _start(SLEEPER)
    tracer = subprocess.Popen(["strace", "-p", str(p.pid), "-o", "/dev/null"], stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if _status(p.pid)["TracerPid"] != "0":
                break
            time.sleep(0.05)
        with pytest.raises(TargetError, match=r"ptrace of \d+ was denied"):
            ptrace.run_code(p.pid, "pass", timeout=5)
        tracer.terminate()
        tracer.wait(10)
        time.sleep(0.3)
        _untouched(p)
    finally:
        tracer.kill()
        p.kill()


# Two threads that want the GIL all the time: the main thread waits for it most of the time.
# They give it up now and then (sleep(0)); with sched_yield there instead, CPython left the
# main thread without the GIL for seconds at a time on its own, so no test could say when it
# would next make a system call.
CONTENDED = """
import os, threading, time
def spin():
    x = 0
    while True:
        x += 1
        if x % 100000 == 0:
            time.sleep(0)
for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
n = 0
while True:
    n += sum(range(200))
    if n % 7 == 0:
        time.sleep(0.0005)
"""


# Each time the main thread goes to sleep, a second thread then takes the GIL and keeps it
# for about 3 s inside one C call (sum over a range never lets go of it).
GIL_HELD = """
import sys, threading, time
go = threading.Event()
def hold():
    while True:
        go.wait()
        go.clear()
        time.sleep(0.1)     # the main thread goes to sleep first
        sum(range(HOLD))
threading.Thread(target=hold, daemon=True).start()
while True:
    go.set()
    print("asleep", flush=True)
    time.sleep(2.9)
"""


def _hold_for(seconds: float) -> int:
    """A range whose sum takes about `seconds` here."""
    t0 = time.perf_counter()
    sum(range(2_000_000))
    return int(2_000_000 * seconds / max(time.perf_counter() - t0, 1e-6))


def test_an_injected_call_waits_for_the_gil_past_the_timeout(tmp_path):
    """The timeout bounds the search for a safe point.  A call once begun is waited for: abandoned
    inside the GIL's wait, an interpreter's main thread was seen never to run again."""
    out = tmp_path / "ran"
    p = subprocess.Popen([sys.executable, "-c", GIL_HELD.replace("HOLD", str(_hold_for(3.0)))],
                         stdout=subprocess.PIPE, text=True)
    try:
        for i in range(2):
            assert p.stdout.readline() == "asleep\n"
            time.sleep(0.3)   # main thread asleep; the other has had time to take the GIL for ~3 s
            t0 = time.monotonic()
            assert ptrace.run_code(p.pid, f"open({str(out)!r}, 'a').write('{i}\\n')", timeout=1) == 0
            assert time.monotonic() - t0 > 1.0   # the call outwaited the timeout of 1 s
        assert out.read_text().split() == ["0", "1"]
        _untouched(p)
    finally:
        p.kill()


def test_repeated_injection_into_a_gil_contended_interpreter(tmp_path):
    """The main thread waits for the GIL most of the time.  Caught in that wait (a futex of the
    GIL, or restart_syscall resuming it after the interrupt), the injected PyGILState_Ensure
    waited forever and so did the injector; those are not safe points, and every call returns."""
    out = tmp_path / "ran"
    p = _start(CONTENDED)
    try:
        for i in range(20):
            assert ptrace.run_code(p.pid, f"open({str(out)!r}, 'a').write('{i}\\n')", timeout=10) == 0
        assert out.read_text().split() == [str(i) for i in range(20)]
        _untouched(p)
    finally:
        p.kill()
