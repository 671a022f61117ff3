"""Decoder for probes/fdopen.bpf.c: opened files (table ``file_open``); feeds fd→path resolution.

Closes and dup2/dup3 onto a number come as records without a path: after a close the number
is no longer the file opened on it, and is resolved from /proc (a socket or eventfd created
on it since) rather than named after a closed file; after a dup it is what the copied number
was.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_FDOPEN, DecodeContext, cstr, decode_array, struct_dtype

NAME = "fdopen"
KIND = KIND_FDOPEN
SOURCE = "fdopen.bpf.c"
STRUCT = "kv_fdopen_event"
TABLE = "file_open"
DTYPE = struct_dtype(
    [
        ("ts_enter", "<u8"),
        ("fd", "<i4"),
        ("dfd", "<i4"),
        ("flags", "<u4"),
        ("op", "<u4"),
        ("path", "S256"),
    ]
)
AT_FDCWD = -100
OP_OPEN, OP_CLOSE, OP_DUP = 0, 1, 2   # KV_FD_*


# system calls whose result is a new descriptor that is never a file (probes/fdopen.bpf.c)
BORN_NOT_FILES = ("accept", "accept4", "socket", "eventfd", "eventfd2", "timerfd_create", "signalfd", "signalfd4",
                  "epoll_create", "epoll_create1")
# ... and those returning two through a user array, read at exit
BORN_PAIRS = ("pipe", "pipe2", "socketpair")


def config(tp) -> tuple[list[str], str | None]:
    if not (tp("syscalls", "sys_enter_openat") and tp("syscalls", "sys_exit_openat")):
        return [], "syscalls:sys_enter/exit_openat missing: paths only from /proc at attach"
    flags = []
    if all(tp("syscalls", f"sys_enter_{c}") for c in ("close", "dup2", "dup3")):
        flags.append("-DKV_HAVE_FD_GONE")
    if tp("syscalls", "sys_enter_openat2"):
        flags.append("-DKV_HAVE_OPENAT2")
    if tp("syscalls", "sys_enter_open"):
        flags.append("-DKV_HAVE_OPEN")
    # numbers born not files, skipped from their first call where the fileio probe skips (KV_FD_SKIP)
    flags += [f"-DKV_BORN_{c.upper()}" for c in BORN_NOT_FILES if tp("syscalls", f"sys_exit_{c}")]
    if all(tp("syscalls", f"sys_{end}_{c}") for c in BORN_PAIRS for end in ("enter", "exit")):
        flags.append("-DKV_BORN_PAIRS")
    return flags, None


def absolute(ctx: DecodeContext, pid: int, dfd: int, path: str, ts: int) -> str:
    if path.startswith("/") or not path:
        return path
    if dfd == AT_FDCWD:
        base = ctx.cwd.get(pid)
        if base is None:
            try:
                base = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                base = ""
            ctx.cwd[pid] = base
    else:
        base = resolve(ctx, pid, dfd, ts)
    return os.path.normpath(os.path.join(base, path)) if base else path


def remember(ctx: DecodeContext, pid: int, fd: int, ts: int, path: str | None) -> None:
    """pid's fd referred to path from ts on (None: no longer to what was opened on it)."""
    hist = ctx.fd_paths.setdefault((pid, fd), [])
    hist.append((ts, path))
    if len(hist) > 1 and hist[-2][0] > ts:
        hist.sort(key=lambda h: h[0])


def trim(ctx: DecodeContext) -> None:
    """After a batch: keep only the latest open per (pid, fd); later batches need no older one."""
    for hist in ctx.fd_paths.values():
        del hist[:-1]


def resolve(ctx: DecodeContext, pid: int, fd: int, ts: int) -> str:
    """The path fd referred to at time ts: the latest open before ts, else /proc (best effort)."""
    hist = ctx.fd_paths.get((pid, fd))
    since = 0
    if hist:
        for t, p in reversed(hist):
            if t <= ts:
                if p is not None:
                    return p
                since = t + 1   # closed or duplicated onto since its open: /proc says what it is now
                break
    try:
        path = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        path = ""
    remember(ctx, pid, fd, since, path)
    return path


def snapshot(ctx: DecodeContext, pid: int) -> None:
    """Record the files pid has open now (fds opened before the attach)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        ctx.cwd[pid] = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return
    for fd in fds:
        try:
            remember(ctx, pid, int(fd), 0, os.readlink(f"/proc/{pid}/fd/{fd}"))
        except (OSError, ValueError):
            pass


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    a = a[np.argsort(a["ts"], kind="stable")]   # a dup names what the copied number was at its time
    paths = cstr(a["path"])
    full = []
    for i, path in enumerate(paths):
        pid, fd, ts, op, dfd = int(a["tgid"][i]), int(a["fd"][i]), int(a["ts"][i]), int(a["op"][i]), int(a["dfd"][i])
        if op != OP_OPEN:   # a close: the number no longer refers to its file; a dup: to the copied one's
            remember(ctx, pid, fd, ts, resolve(ctx, pid, dfd, ts) if op == OP_DUP and dfd >= 0 else None)
            continue
        p = absolute(ctx, pid, dfd, path, ts)
        full.append(p)
        if fd >= 0:
            remember(ctx, pid, fd, ts, p)
    a = a[a["op"] == OP_OPEN]
    return pa.table(
        {
            "ts_ns": pa.array(a["ts"], pa.uint64()),
            "start_ns": pa.array(a["ts_enter"], pa.uint64()),
            "pid": pa.array(a["tgid"], pa.uint32()),
            "tid": pa.array(a["tid"], pa.uint32()),
            "fd": pa.array(a["fd"], pa.int32()),
            "flags": pa.array(a["flags"], pa.uint32()),
            "path": pa.array(full, pa.string()),
            "latency_ns": pa.array(a["ts"].astype(np.int64) - a["ts_enter"].astype(np.int64), pa.int64()),
        }
    )
