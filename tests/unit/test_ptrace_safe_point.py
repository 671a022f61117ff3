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


def test_caught_blocked_inside_a_wait():
    """Interrupted inside a system call, the thread stops with -ERESTART* in rax (the kernel
    reruns the call on resume): a safe point when that call is one."""
    t = ptrace.Tracee.__new__(ptrace.Tracee)
    t._areas = [(0x1000, 0x2000)]
    t.read = lambda addr, n: b"\x0f\x05"        # a `syscall` instruction before rip

    def stopped(nr: int, rax: int, rdi: int = 0) -> ptrace.Regs:
        r = regs(nr, rdi)
        r.rax, r.rip = rax & (2**64 - 1), 0x401002
        return r

    assert t.blocked_in_wait(stopped(230, -516))              # clock_nanosleep, to be restarted
    assert t.blocked_in_wait(stopped(7, -514))                # poll
    assert t.blocked_in_wait(stopped(ptrace.SYS_FUTEX, -512, 0x7000))  # a heap lock
    assert not t.blocked_in_wait(stopped(ptrace.SYS_FUTEX, -516, 0x1800))  # the GIL's wait
    assert not t.blocked_in_wait(stopped(232, -4))            # epoll_wait returned EINTR: done, not rerun
    assert not t.blocked_in_wait(stopped(230, 0))             # finished
    assert not t.blocked_in_wait(stopped(-1 & (2**64 - 1), -516))  # not in a system call
    assert not t.blocked_in_wait(stopped(186, -516))          # gettid: never a safe point
    t.read = lambda addr, n: b"\x90\x90"
    assert not t.blocked_in_wait(stopped(230, -516))          # rip is not after a `syscall`


def test_lock_waits_run_free():
    """Waits on the GIL (or libc's locks), and their resumption, are where stepping would starve
    the thread: the injector lets it run instead."""
    t = ptrace.Tracee.__new__(ptrace.Tracee)
    t._areas = [(0x1000, 0x2000)]
    assert t.lock_wait(regs(ptrace.SYS_FUTEX, 0x1800))
    assert t.lock_wait(regs(ptrace.SYS_RESTART))
    assert not t.lock_wait(regs(ptrace.SYS_FUTEX, 0x7000))
    assert not t.lock_wait(regs(230))
