"""Descriptors that are not files, told to the kernel so fileio.bpf.c skips them
(on by default; ``kvtrace attach --trace-nonfile-fds`` turns it off).

A serving process reads and writes sockets, pipes and eventfds far more often than files
(vLLM's engine and API processes talk over ZeroMQ and wake each other with eventfds); none
of it is storage.  When a decoded file_io row's descriptor resolves to one of those, its
(pid, fd) goes into the probe's ``fd_skip`` map, and from then on the kernel does not even
time those calls.  The kernel takes the number out on close, dup2/dup3 onto it, or an open
returning it (kvtrace.h).  /proc is asked right before and right after the insert, so a
number closed and reopened as a file in between is taken out again at once.  Numbers a traced
process makes with accept, socket, eventfd, timerfd_create, signalfd, epoll_create, pipe or
socketpair are put in the map by the kernel itself as they are made (probes/fdopen.bpf.c), and
those open at the attach by ``seed`` as capture starts; rows cover the rest (dup, fcntl,
descriptors passed over a socket).
"""
from __future__ import annotations

import os
from collections import Counter

NOT_FILES = ("socket:", "pipe:", "anon_inode:")


def not_a_file(path: str) -> bool:
    return path.startswith(NOT_FILES)


def _current(pid: int, fd: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return ""


class FdSkip:
    """``skip(pid, fd)`` puts a descriptor that is not a file into the probe's map; a pipeline
    sidecar for its counts (run row)."""

    name = "fd_skip"

    def __init__(self, table, current=_current):
        self.t = table
        self.current = current
        self.c = Counter()

    def __call__(self, pid: int, fd: int) -> bool:
        """True when the number is now skipped."""
        if not not_a_file(self.current(pid, fd)):
            return False   # closed, or reused for a file, since the event: keep tracing it
        key = self.t.Key(pid, fd)
        try:
            self.t[key] = self.t.Leaf(1)
        except Exception:
            self.c["map_errors"] += 1
            return False
        if not not_a_file(self.current(pid, fd)):
            try:
                del self.t[key]
            except Exception:
                pass
            self.c["undone"] += 1
            return False
        self.c["skipped_fds"] += 1
        return True

    def seed(self, pids) -> None:
        """Put in the descriptors of pids that are not files now, before their first row."""
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            self.c["seeded_fds"] += sum(self(pid, int(name)) for name in fds if name.isdigit())

    def drain(self) -> dict:
        return {}

    def stats(self) -> dict:
        return dict(self.c)

    def close(self) -> None:
        """Nothing to release: the map belongs to the BPF program."""


def start(pipeline, source, running: list[int]) -> FdSkip | None:
    """When the fileio probe skips descriptors (KV_FD_SKIP), let its decoder tell it which, and
    put in now those of the running processes named (not a command kvtrace starts: until its
    exec it holds the agent's own descriptors, which it then closes with close_range, unseen)."""
    try:
        table = source.bpf["fd_skip"]
    except Exception:   # no bcc source, fileio not attached, or --trace-nonfile-fds
        return None
    skip = FdSkip(table)
    pipeline.ctx.skip_fd = skip
    pipeline.add_sidecar(skip)
    try:
        skip.seed(running)
    except Exception:   # never stops the capture: rows still teach the map
        skip.c["map_errors"] += 1
    return skip
