"""Network namespaces of other processes: which one a pid is in, and threads that work inside it.

A server in a container listens on its own loopback.  kvtrace reaches its /metrics and its
ZMQ KV events by running the thread that talks to it inside the server's network namespace
(``setns(2)`` on ``/proc/PID/ns/net``, which needs CAP_SYS_ADMIN).  ``setns`` moves only the
calling thread, and a socket stays in the namespace it was made in: a thread that entered makes
its sockets there, and so do the threads it starts (ZeroMQ's I/O threads among them).
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(OSError):
    """A network namespace that could not be entered (one line, says why)."""


def ident(pid: int | str) -> str | None:
    """``net:[inode]`` of a process's network namespace, or None when it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def foreign(pid: int) -> str | None:
    """``/proc/PID/ns/net`` when that process is in another network namespace than kvtrace, else None."""
    theirs, ours = ident(pid), ident("self")
    return f"/proc/{pid}/ns/net" if theirs and ours and theirs != ours else None


def enter(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsError(e.errno, f"cannot open {path}: {e.strerror}") from None
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            hint = " (needs CAP_SYS_ADMIN)" if err == errno.EPERM else ""
            raise NetnsError(err, f"cannot enter the network namespace {path}: {os.strerror(err)}{hint}")
    finally:
        os.close(fd)


def call(path: str | None, fn, *args, timeout: float | None = None):
    """``fn(*args)`` in a short-lived thread inside ``path`` (None: here); its result or its exception."""
    if path is None:
        return fn(*args)
    box: dict = {}

    def run() -> None:
        try:
            enter(path)
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="kvtrace-netns", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout:g} s inside {path}")
    if "error" in box:
        raise box["error"]
    return box.get("value")
