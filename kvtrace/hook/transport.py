"""How the hook's records reach the agent: a marker write(2) on a fixed negative fd.

The agent's BPF program (probes/usermark.bpf.c) catches ``write(MARK_FD, frame)`` at
syscalls:sys_enter_write in the traced processes and copies the frame into the same ring
buffer as the kernel events; the call itself fails with EBADF and costs ~1 µs.  Records
carry their own CLOCK_MONOTONIC times, so one frame can carry several steps (each process
sends one every 100 ms while it steps; the engine also at once when it runs out of requests).

While no agent is attached (no live agent pid in the flag directory) the hook buffers nothing:
``enabled`` is re-checked at most once per second, so an idle hook costs one function call
and a time comparison per step.
"""
from __future__ import annotations

import fcntl
import os
import time

from .wire import CODEC, MAGIC, MAX_FRAME

MARK_FD = -4242
# A directory with one file per attached agent, named by its pid (several agents may attach at
# once); a plain file naming one pid is read too.  An agent holds an exclusive flock on its file
# and writes "PID lock" in it: the lock, not the pid, says it is alive, which holds across pid
# namespaces (a server in a container sees the entry the agent put in its /dev/shm) and after a
# SIGKILL (the kernel drops the lock).  Entries without "lock" are judged by their pid.
FLAG_PATH = os.environ.get("KVTRACE_FLAG", "/dev/shm/kvtrace-agents")
RECHECK_NS = 1_000_000_000


def entry_live(path: str, name: str = "", dir_fd: int | None = None) -> bool:
    """Whether one flag entry names a live agent (see FLAG_PATH); a link or FIFO is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        words = os.read(fd, 64).split()
        if b"lock" in words:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True     # the agent holds its lock
            except OSError:
                return False
            return False        # nobody holds it: the agent is gone
        pid = int(words[0] if words else name)
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def agent_pids(flag_path: str = FLAG_PATH) -> list[int]:
    """Live agents named by the flag directory (or a flag file), by pid."""
    try:
        names = os.listdir(flag_path)
    except NotADirectoryError:
        return [p for p in _file_pid(flag_path) if entry_live(flag_path, str(p))]
    except OSError:
        return []
    live = []
    for name in names:
        if name.isdigit() and entry_live(os.path.join(flag_path, name), name):
            live.append(int(name))
    return sorted(live)


def _file_pid(path: str) -> list[int]:
    try:
        with open(path) as f:
            word = f.read(64).split()[:1]
        return [int(word[0])] if word else []
    except (OSError, ValueError):
        return []


def owner_live(flag_path: str, owner: int) -> bool:
    """Whether the agent that injected the hook (its entry in the flag directory) is alive."""
    if os.path.isdir(flag_path):
        return entry_live(os.path.join(flag_path, str(owner)), str(owner))
    return owner in agent_pids(flag_path)


def agent_alive(flag_path: str = FLAG_PATH) -> bool:
    """True when the flag directory names a live agent."""
    return bool(agent_pids(flag_path))


class Transport:
    def __init__(self, max_buffer: int = 1 << 20, flag_path: str = FLAG_PATH, mark_fd: int = MARK_FD):
        self.buf: list[bytes] = []
        self.size = 0
        self.max_buffer = max_buffer
        self.flag_path = flag_path
        self.mark_fd = mark_fd
        self.enabled = False
        self.next_check = 0
        self.emitted = self.dropped = self.errors = 0
        self.last_error = ""

    def refresh(self, now: int | None = None) -> bool:
        now = time.monotonic_ns() if now is None else now
        if now >= self.next_check:
            self.next_check = now + RECHECK_NS
            was, self.enabled = self.enabled, agent_alive(self.flag_path)
            if was and not self.enabled:
                self.buf, self.size = [], 0
        return self.enabled

    def emit(self, name: str, *values) -> None:
        if not self.enabled:
            return
        try:
            rec = CODEC.encode(name, *values)
        except Exception as e:  # a bad value must never reach the server
            self.error(e)
            return
        if self.size + len(rec) > self.max_buffer:
            self.dropped += 1
            return
        self.buf.append(rec)
        self.size += len(rec)
        self.emitted += 1

    def error(self, e: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(e).__name__}: {e}"[:200]

    def flush(self, recs: list[bytes] | None = None, lead: bytes = b"") -> None:
        """Send the encoded records ``recs`` (the caller counted them), then what emit()
        buffered, as frames of at most MAX_FRAME bytes: usually one write.  ``lead`` (an
        encoded record) heads every frame."""
        if self.buf:
            recs = recs + self.buf if recs else self.buf
            self.buf, self.size = [], 0
        if not recs:
            return
        start = MAGIC + lead
        head = len(start)
        if head + sum(map(len, recs)) <= MAX_FRAME:
            frames = [start + b"".join(recs)]
        else:
            frames, part, size = [], [start], head
            for rec in recs:
                n = len(rec)
                if size + n > MAX_FRAME:
                    if n + head > MAX_FRAME:
                        self.dropped += 1
                        continue
                    frames.append(b"".join(part))
                    part, size = [start], head
                part.append(rec)
                size += n
            if size > head:
                frames.append(b"".join(part))
        write, fd = os.write, self.mark_fd
        for f in frames:
            try:
                write(fd, f)
            except OSError:
                pass  # EBADF is the expected answer: the BPF program already copied the frame
