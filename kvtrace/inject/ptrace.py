"""Run Python code in a live CPython process with ptrace alone (x86-64).

Why not gdb: gdb saves and restores the full extended register state around an inferior
call, and on CPUs with AMX that write fails ("Couldn't write extended state status: Bad
address") and can leave the target broken.  This injector touches only the general
registers, and only at a point where nothing else is live: the main thread is caught at a
system-call entry (inside a libc wrapper, where the ABI makes every caller-saved register,
vector registers included, dead).  There it calls

    gstate = PyGILState_Ensure(); PyRun_SimpleStringFlags(code, NULL); PyGILState_Release(gstate)

each returning to address 0 (caught as SIGSEGV), then puts the registers back with the
instruction pointer on the `syscall` instruction and the syscall number in rax, so the
interrupted system call simply runs again, and detaches.  Other threads never stop.

Not every system call is a safe point: the thread may be inside the interpreter's GIL hand-over
or inside malloc, in a state the injected call then waits on forever (seen on a vLLM EngineCore
and on any GIL-contended interpreter: caught in the GIL's own wait, resumed through
restart_syscall after the interrupt, or at gettid or rt_sigprocmask, the injected call waited
for the GIL forever).  So only waits and I/O count (SYS_WAITS), which CPython makes with the GIL
released: not a futex on a lock of libc, libpython or the executable (the GIL, its mutexes,
malloc's arena locks live there; Python-level locks live on the heap), and not the hook's own
marker write (made under the hook's lock).  The thread is found at such a call's entry, or
interrupted while blocked inside one.  The timeout bounds that search; a call once begun is
waited for longer (CALL_S), since one abandoned inside the GIL's wait breaks the interpreter.
"""
from __future__ import annotations

import ctypes
import os
import random
import signal
import struct
import time

from kvtrace.errors import TargetError
from kvtrace.inject import elfsym

libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]

PTRACE_CONT, PTRACE_DETACH, PTRACE_GETREGS, PTRACE_SETREGS, PTRACE_SYSCALL = 7, 17, 12, 13, 24
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_O_TRACESYSGOOD = 1
WALL = 0x40000000
ENOSYS = 38
SYS_WRITE, SYS_FUTEX, SYS_FUTEX_WAITV = 1, 202, 449
RESTARTS = {512, 513, 514, 516}  # -ERESTARTSYS -ERESTARTNOINTR -ERESTARTNOHAND -ERESTART_RESTARTBLOCK
CALL_S = 60.0   # how long an injected call, once begun, may take before it is abandoned
STEP_S = 0.02   # how long to step a thread from call to call before letting it run free
SYS_RESTART = 219  # restart_syscall: resumes a timed wait our interrupt broke, which may be the GIL's
# The only system calls that count: waits and I/O, which CPython makes with the GIL released
# and no lock of its own held.  Anything else may sit inside the interpreter's or libc's
# critical sections: caught at gettid (CI) or rt_sigprocmask, the injected PyRun waited on the
# GIL's futex for good; malloc holds its arena lock around mmap and brk; CPython's timed GIL
# wait reads the clock (a system call where the vDSO cannot serve it) holding the GIL's mutex.
SYS_WAITS = {0, 1, 7, 19, 20, 23, 24, 35, 44, 45, 46, 47, SYS_FUTEX, 230, 232, 270, 271, 281, 441, SYS_FUTEX_WAITV}
# read write poll readv writev select sched_yield nanosleep sendto recvfrom sendmsg recvmsg futex
# clock_nanosleep epoll_wait pselect6 ppoll epoll_pwait epoll_pwait2 futex_waitv
MARKER_FD = -4242 & 0xFFFFFFFF        # the hook's marker write (kvtrace/hook/transport.py), under its lock
FIELDS = ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss "
          "fs_base gs_base ds es fs gs").split()


class Regs(ctypes.Structure):
    _fields_ = [(f, ctypes.c_ulonglong) for f in FIELDS]

    def copy(self) -> "Regs":
        r = Regs()
        ctypes.pointer(r)[0] = self
        return r


def _ptrace(req: int, pid: int, addr=None, data=None) -> int:
    r = libc.ptrace(req, pid, addr, data)
    if r == -1:
        err = ctypes.get_errno()
        if err == 3 and req != PTRACE_SEIZE:   # ESRCH on a seized thread: it is gone
            raise TargetError(f"process {pid} exited during injection")
        raise OSError(err, os.strerror(err))
    return r


class Tracee:
    """The main thread of pid, seized; every method keeps it stopped unless it says so."""

    def __init__(self, pid: int):
        self.pid = pid
        self._areas: list[tuple[int, int]] | None = None
        self.entry_nr = -1  # the system call of the safe point
        self.sig = 0        # a signal the thread stopped for, delivered when it next resumes
        try:
            _ptrace(PTRACE_SEIZE, pid, None, ctypes.c_void_p(PTRACE_O_TRACESYSGOOD))
        except OSError as e:
            if e.errno == 3:
                raise TargetError(f"process {pid} exited before injection") from None
            raise TargetError(f"ptrace of {pid} was denied ({e.strerror}: another tracer, Yama ptrace_scope, or a user namespace): cannot inject") from None
        self.attached = True
        # each stop of the tracee sends us SIGCHLD: held for this thread, it wakes our waits at once
        # (only where no handler of the process wants SIGCHLD)
        self.wake = signal.getsignal(signal.SIGCHLD) in (signal.SIG_DFL, None)
        if self.wake:
            self.mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            _ptrace(PTRACE_INTERRUPT, pid)
            self._wait()
        except BaseException:
            self.detach()
            raise

    def _wait(self, deadline: float | None = None) -> int | None:
        """The next stop; None when deadline (monotonic s) passes first."""
        return self._next_stop(deadline if deadline is not None else float("inf"))

    def _lock_areas(self) -> list[tuple[int, int]]:
        """Writable data of libc, libpython and the executable, each with the anonymous mapping
        right after it (.bss): where the GIL, the interpreter's mutexes and malloc's arena locks are."""
        try:
            exe = os.readlink(f"/proc/{self.pid}/exe")
            lines = open(f"/proc/{self.pid}/maps").read().splitlines()
        except OSError:
            return []
        areas, prev = [], None
        for line in lines:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            name = path.rsplit("/", 1)[-1]
            ours = path == exe or name.startswith("libc.so") or name.startswith("libc-") or name.startswith("libpython")
            if "w" in parts[1] and (ours or not path and prev is not None and prev[1] == lo):
                areas.append((lo, hi))
                prev = (lo, hi)
            else:
                prev = None
        return areas

    def safe_point(self, r: Regs) -> bool:
        nr = r.orig_rax
        if nr not in SYS_WAITS:
            return False
        if nr == SYS_WRITE and r.rdi & 0xFFFFFFFF == MARKER_FD:
            return False
        if nr in (SYS_FUTEX, SYS_FUTEX_WAITV):
            return not self._in_lock_areas(r.rdi)
        return True

    def lock_wait(self, r: Regs) -> bool:
        """A wait on the interpreter's or libc's own locks (the GIL among them), or its resumption."""
        return r.orig_rax == SYS_RESTART or r.orig_rax == SYS_FUTEX and self._in_lock_areas(r.rdi)

    def _in_lock_areas(self, addr: int) -> bool:
        if self._areas is None:
            self._areas = self._lock_areas()
        return any(lo <= addr < hi for lo, hi in self._areas)

    def regs(self) -> Regs:
        r = Regs()
        _ptrace(PTRACE_GETREGS, self.pid, None, ctypes.byref(r))
        return r

    def set_regs(self, r: Regs) -> None:
        _ptrace(PTRACE_SETREGS, self.pid, None, ctypes.byref(r))

    def write(self, addr: int, data: bytes) -> None:
        with open(f"/proc/{self.pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(addr)
            mem.write(data)

    def read(self, addr: int, n: int) -> bytes:
        with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as mem:
            mem.seek(addr)
            return mem.read(n)

    def blocked_in_wait(self, r: Regs) -> bool:
        """Stopped inside a safe wait that our interrupt broke: it reruns from its entry on resume."""
        return (r.orig_rax < (1 << 63) and (1 << 64) - r.rax in RESTARTS and self.safe_point(r)
                and self.read(r.rip - 2, 2) == b"\x0f\x05")

    def _next_stop(self, deadline: float) -> int | None:
        """The next stop, watched closely at first (a stepped thread waits on us), or None at deadline."""
        while True:
            try:
                pid, status = os.waitpid(self.pid, WALL | os.WNOHANG)
            except ChildProcessError:   # reaped elsewhere: gone
                pid, status = self.pid, 0
            if pid:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    self.attached = False
                    raise TargetError(f"process {self.pid} exited during injection")
                return status
            left = deadline - time.monotonic()
            if left < 0:
                return None
            if self.wake:   # SIGCHLD, held for us, says the tracee stopped (or another child changed)
                signal.sigtimedwait({signal.SIGCHLD}, min(left, 0.002))
            else:
                time.sleep(0.0002)

    def _step(self, deadline: float) -> Regs | None:
        """Resume from system call to system call for a while; a safe entry, or None, stopped."""
        until = min(deadline, time.monotonic() + STEP_S)
        while True:
            _ptrace(PTRACE_SYSCALL, self.pid, None, ctypes.c_void_p(self.sig))
            self.sig = 0
            status = self._next_stop(until)
            if status is None:
                self._interrupt()
                return None
            stopsig = os.WSTOPSIG(status)
            if stopsig == signal.SIGTRAP | 0x80:
                r = self.regs()
                # a syscall-enter-stop right after a `syscall` instruction (an exit-stop has its result)
                if r.rax == (1 << 64) - ENOSYS and self.read(r.rip - 2, 2) == b"\x0f\x05":
                    if self.safe_point(r):
                        return r
                    if self.lock_wait(r):
                        return None   # waiting for the GIL (or a lock of libc's): stepped, it would not get it
            elif not status >> 16:
                self.sig = stopsig  # a real signal: delivered on resume
            if time.monotonic() > until:
                return None

    def _interrupt(self) -> Regs:
        """Stop the running thread; its registers at the stop (signals on the way are kept)."""
        _ptrace(PTRACE_INTERRUPT, self.pid)
        while True:
            status = self._next_stop(time.monotonic() + 5)
            if status is None:
                raise TargetError(f"process {self.pid} did not stop when interrupted: injection abandoned")
            if status >> 16 or os.WSTOPSIG(status) == signal.SIGTRAP | 0x80:
                return self.regs()
            self.sig = os.WSTOPSIG(status)   # a signal first: the interrupt's stop is still to come
            _ptrace(PTRACE_CONT, self.pid, None, ctypes.c_void_p(0))

    def to_syscall_entry(self, timeout: float) -> Regs:
        """Find a safe point: the thread at the entry of an allowed system call, or blocked in one.
        Stepped from call to call, a thread that waits for a contended GIL loses every hand-over
        (each futex return stops for us first), so stepping alternates with letting it run free
        for a few milliseconds and interrupting it, until it is caught in one of its waits."""
        deadline = time.monotonic() + timeout
        rng = random.Random(self.pid)
        r = self.regs()   # the seize stop
        while not self.blocked_in_wait(r):
            if time.monotonic() > deadline:
                raise TargetError(f"process {self.pid} made no system call within {timeout:.0f}s (no safe point): injection abandoned, target untouched")
            r = self._step(deadline)
            if r is not None:
                break
            _ptrace(PTRACE_CONT, self.pid, None, ctypes.c_void_p(self.sig))
            self.sig = 0
            time.sleep(rng.uniform(0.0005, 0.005))
            r = self._interrupt()
        self.entry_nr = r.orig_rax
        return r

    def where(self) -> str:
        """Where the (running) thread is: its system call and kernel wait, for a timeout's message."""
        try:
            call = open(f"/proc/{self.pid}/task/{self.pid}/syscall").read().split()
            wchan = open(f"/proc/{self.pid}/task/{self.pid}/wchan").read().strip() or "-"
        except OSError:
            return "unknown"
        if not call or not call[0].lstrip("-").isdigit():
            return "running"
        return f"in system call {call[0]} ({' '.join(call[1:3])}), waiting in {wchan}"

    def call(self, func: int, args: tuple[int, ...], stack_top: int, timeout: float, name: str = "") -> int:
        """Call func(*args) on a scratch stack below stack_top; returns rax."""
        r = self.regs().copy()
        sp = (stack_top & ~0xF) - 8  # at entry, (rsp + 8) % 16 == 0
        self.write(sp, struct.pack("<Q", 0))  # return address 0: the return faults, we catch it
        for reg, val in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), args):
            setattr(r, reg, val)
        r.rsp, r.rip, r.rax, r.orig_rax = sp, func, 0, (1 << 64) - 1  # orig_rax -1: no syscall restart
        self.set_regs(r)
        sig = 0
        deadline = time.monotonic() + timeout
        while True:
            _ptrace(PTRACE_CONT, self.pid, None, ctypes.c_void_p(sig))
            status = self._wait(deadline)
            if status is None:  # stuck in the call: stop the thread, so run_code can put it back
                where = self.where()
                _ptrace(PTRACE_INTERRUPT, self.pid)
                if self._wait(time.monotonic() + 5) is None:
                    self.attached = False  # cannot stop it again: leave it to the kernel at our exit
                raise TargetError(f"the injected {name or 'call'} in {self.pid} did not return within {timeout:.0f}s "
                                  f"({where}; caught at system call {self.entry_nr}): abandoned mid-call, so the "
                                  f"process may no longer run Python threads normally: restart it")
            sig = os.WSTOPSIG(status)
            if sig == signal.SIGSEGV and self.regs().rip == 0:
                return self.regs().rax
            if sig == signal.SIGSEGV:
                raise TargetError(f"the injected call crashed in process {self.pid} at {self.regs().rip:#x}")
            if status >> 16:
                sig = 0
            elif time.monotonic() > deadline:
                raise TargetError(f"the injected call in {self.pid} did not return within {timeout:.0f}s")

    def restore(self, saved: Regs) -> None:
        """Back to the interrupted syscall instruction, which then runs again."""
        r = saved.copy()
        r.rip = saved.rip - 2
        r.rax = saved.orig_rax
        self.set_regs(r)

    def detach(self) -> None:
        if self.attached:
            try:
                _ptrace(PTRACE_DETACH, self.pid, None, ctypes.c_void_p(self.sig))  # a signal held back goes now
            except (OSError, TargetError):
                pass
            self.attached = False
        if self.wake:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
            self.wake = False


SYMBOLS = {"PyGILState_Ensure", "PyGILState_Release", "PyRun_SimpleStringFlags"}


def run_code(pid: int, code: str, timeout: float = 10.0) -> int:
    """Run code in pid's main thread with the GIL held; returns PyRun's result (0 ok, -1 error)."""
    addrs = elfsym.resolve(pid, SYMBOLS)
    src = code.encode() + b"\0"
    if len(src) > 3000:
        raise ValueError("injected code must be short: exec a file instead")
    t = Tracee(pid)
    saved = None
    try:
        saved = t.to_syscall_entry(timeout)
        text_at = (saved.rsp - 128 - 4096) & ~0xF  # below the red zone
        stack_top = text_at - 256
        t.write(text_at, src)
        # Once a call has begun it is waited for far longer: a thread abandoned inside the GIL's
        # wait, or holding the GIL, leaves the interpreter broken (seen: its main thread never
        # ran again).  From a safe point the wait is for the GIL alone, which others give up.
        wait = max(timeout, CALL_S)
        gstate = t.call(addrs["PyGILState_Ensure"], (), stack_top, wait, "PyGILState_Ensure") & 0xFFFFFFFF
        rc = t.call(addrs["PyRun_SimpleStringFlags"], (text_at, 0), stack_top, wait, "PyRun_SimpleStringFlags") & 0xFFFFFFFF
        t.call(addrs["PyGILState_Release"], (gstate,), stack_top, wait, "PyGILState_Release")
        return -1 if rc == 0xFFFFFFFF else rc
    finally:
        try:
            if saved is not None and t.attached:
                t.restore(saved)
        except TargetError:
            pass   # gone: nothing to put back
        t.detach()
