"""Which system-call entries the ptrace injector takes as a safe point (kvtrace/inject/ptrace.py)."""
from __future__ import annotations

from kvtrace.inject import ptrace


def regs(nr: int, rdi: int = 0) -> ptrace.Regs:
    r = ptrace.Regs()
    r.orig_rax, r.rdi = nr, rdi
    return r


def test_safe_points():
    t = ptrace.Tracee.__new__(ptrace.Tracee)   # no process: the lock areas are given
    t._areas = [(0x1000, 0x2000)]               # e.g. libpython's data, where the GIL lives
    assert t.safe_point(regs(7))                        # poll
    assert t.safe_point(regs(230))                      # clock_nanosleep (time.sleep)
    assert t.safe_point(regs(ptrace.SYS_FUTEX, 0x7000))  # a heap lock (threading.Lock)
    assert not t.safe_point(regs(ptrace.SYS_FUTEX, 0x1800))  # the GIL's futex
    assert not t.safe_point(regs(ptrace.SYS_RESTART))   # resumes an unknown wait
    assert not t.safe_point(regs(12))                   # brk: malloc holds its arena lock
    assert not t.safe_point(regs(228))                  # clock_gettime off the vDSO: the GIL's mutex may be held
    assert not t.safe_point(regs(96))                   # gettimeofday, the same
    assert not t.safe_point(regs(186))                  # gettid: caught there in CI, PyRun then hung on the GIL
    assert not t.safe_point(regs(14))                   # rt_sigprocmask, the same here
    assert t.safe_point(regs(232)) and t.safe_point(regs(24))   # epoll_wait, sched_yield
    assert not t.safe_point(regs(ptrace.SYS_WRITE, -4242 & (2**64 - 1)))  # the hook's marker write
    assert t.safe_point(regs(ptrace.SYS_WRITE, 1))
