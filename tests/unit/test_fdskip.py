"""Which file a descriptor is, across closes and dups (fdopen's records), and which
descriptors the kernel is told to skip as not files (kvtrace.capture.fdskip).  No root."""
from __future__ import annotations

import numpy as np

from kvtrace.capture import fdopen, fdskip, fileio
from kvtrace.capture.events import KIND_FDOPEN, KIND_FILEIO, DecodeContext

PID = 4242


def fd_rec(ts, fd, op=fdopen.OP_OPEN, path=b"", dfd=fdopen.AT_FDCWD):
    e = np.zeros(1, dtype=fdopen.DTYPE)
    e["kind"], e["version"], e["size"], e["ts"], e["ts_enter"] = KIND_FDOPEN, 1, fdopen.DTYPE.itemsize, ts, ts - 10
    e["tgid"], e["tid"], e["fd"], e["dfd"], e["op"], e["path"] = PID, PID, fd, dfd, op, path
    return e.tobytes()


def read_rec(ts, fd, n=4096):
    e = np.zeros(1, dtype=fileio.DTYPE)
    e["kind"], e["version"], e["size"], e["ts"], e["ts_enter"] = KIND_FILEIO, 1, fileio.DTYPE.itemsize, ts, ts - 5
    e["tgid"], e["tid"], e["fd"], e["ret"], e["count"], e["pos"], e["sys"], e["weight"] = PID, PID, fd, n, n, 0, 1, 1
    return e.tobytes()


def test_a_closed_number_is_not_named_after_its_old_file_and_a_dup_is_the_copied_file(monkeypatch):
    asked, real = [], fdopen.os.readlink

    def readlink(path):
        if not str(path).startswith("/proc/"):
            return real(path)   # not the decoder asking (a module imported on first use may)
        asked.append(path)
        return "anon_inode:[eventfd]"

    monkeypatch.setattr(fdopen.os, "readlink", readlink)
    ctx = DecodeContext()
    # fd 3 opened as /a, closed; an eventfd gets 3 (no open record); /b opened as 9, dup2'ed onto 3
    opens = fdopen.decode([fd_rec(100, 9, path=b"/b"), fd_rec(10, 3, path=b"/a"), fd_rec(50, 3, fdopen.OP_CLOSE),
                           fd_rec(200, 3, fdopen.OP_DUP, dfd=9)], ctx)   # out of order: sorted by time
    assert opens.column("path").to_pylist() == ["/a", "/b"]           # closes and dups are no open rows
    rows = fileio.decode([read_rec(20, 3), read_rec(60, 3), read_rec(150, 3), read_rec(250, 3)], ctx).to_pylist()
    assert [r["path"] for r in rows] == ["/a", "anon_inode:[eventfd]", "anon_inode:[eventfd]", "/b"]
    assert asked == [f"/proc/{PID}/fd/3"]                              # /proc asked once, after the close


class Table(dict):
    Key = staticmethod(lambda tgid, fd: (tgid, fd))
    Leaf = staticmethod(lambda v: v)


def test_only_descriptors_proc_says_are_not_files_before_and_after_the_insert():
    t = Table()
    now = {(1, 3): "socket:[77]", (1, 4): "/data/kv/0001.bin", (1, 5): "pipe:[9]"}
    skip = fdskip.FdSkip(t, current=lambda pid, fd: now.get((pid, fd), ""))
    skip(1, 3)
    skip(1, 4)        # a file now (the number was reused since the row): still traced
    assert t == {(1, 3): 1}
    calls = []

    def flips(pid, fd):   # closed and reopened as a file between the two looks: taken out again
        calls.append(fd)
        return "pipe:[9]" if len(calls) == 1 else "/data/kv/0002.bin"

    skip.current = flips
    skip(1, 5)
    assert t == {(1, 3): 1} and skip.stats() == {"skipped_fds": 1, "undone": 1}
    assert [fdskip.not_a_file(p) for p in ("socket:[1]", "pipe:[2]", "anon_inode:[eventfd]", "/dev/shm/x", "")] == [
        True, True, True, False, False]


def test_seed_puts_in_the_descriptors_open_at_the_attach_that_proc_says_are_not_files(tmp_path):
    import os
    import socket

    r, w = os.pipe()
    a, b = socket.socketpair()
    ev = os.eventfd(0)
    f = open(tmp_path / "kv.bin", "wb")
    try:
        t = Table()
        skip = fdskip.FdSkip(t)                # /proc itself is asked
        skip.seed([os.getpid(), 2 ** 22 + 1])  # the second pid does not exist: nothing from it
        me = os.getpid()
        for fd in (r, w, a.fileno(), b.fileno(), ev):
            assert (me, fd) in t, fd
        assert (me, f.fileno()) not in t
        theirs = {fd for (pid, fd) in t}
        assert all(fdskip.not_a_file(os.readlink(f"/proc/{me}/fd/{fd}")) for fd in theirs)   # only those
        assert skip.stats()["seeded_fds"] == len(t)
    finally:
        for fd in (r, w, ev):
            os.close(fd)
        a.close(), b.close(), f.close()
