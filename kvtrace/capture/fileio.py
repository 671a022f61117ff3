"""Decoder for probes/fileio.bpf.c: read/write system calls with path, bytes and latency
(table ``file_io``)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.capture import fdopen, fdskip
from kvtrace.capture.events import KIND_FILEIO, DecodeContext, decode_array, struct_dtype, weights

NAME = "fileio"
KIND = KIND_FILEIO
SOURCE = "fileio.bpf.c"
STRUCT = "kv_fileio_event"
TABLE = "file_io"
DTYPE = struct_dtype(
    [
        ("ts_enter", "<u8"),
        ("ret", "<i8"),
        ("pos", "<i8"),
        ("count", "<u8"),
        ("fd", "<i4"),
        ("sys", "<u2"),
        ("weight", "<u2"),
    ]
)
SYSCALLS = ["read", "pread64", "readv", "preadv", "preadv2", "write", "pwrite64", "writev", "pwritev", "pwritev2"]
VECTOR = {2, 3, 4, 7, 8, 9}
READS = set(SYSCALLS[:5])


def config(tp, trace_writes: bool = True, skip_fds: bool = False) -> tuple[list[str], str | None]:
    needed = [("sys_enter_read", "sys_exit_read"), ("sys_enter_pread64", "sys_exit_pread64")]
    for enter, exit_ in needed:
        if not (tp("syscalls", enter) and tp("syscalls", exit_)):
            return [], f"syscalls:{enter} missing (CONFIG_FTRACE_SYSCALLS off?)"
    flags = ["-DKV_TRACE_WRITES"] if trace_writes else []
    # skipping descriptors that are not files needs to see every way a number is reused
    if skip_fds and all(tp("syscalls", f"sys_enter_{c}") for c in ("close", "dup2", "dup3", "openat")):
        flags.append("-DKV_FD_SKIP")
    return flags, None


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    n = len(a)
    pids = a["tgid"].astype(np.int64)
    fds = a["fd"].astype(np.int64)
    # paths as a dictionary: one resolution per distinct (pid, fd) unless it was reopened
    path_index = np.zeros(n, dtype=np.int32)
    dictionary: dict[str, int] = {}
    if n:
        keys = (pids << 32) | (fds & 0xFFFFFFFF)
        uniq, inverse = np.unique(keys, return_inverse=True)
        for j, key in enumerate(uniq.tolist()):
            pid, fd = key >> 32, key & 0xFFFFFFFF
            hist = ctx.fd_paths.get((pid, fd))
            if not hist or len(hist) == 1:
                path = fdopen.resolve(ctx, pid, fd, 1 << 63)
                path_index[inverse == j] = dictionary.setdefault(path, len(dictionary))
            else:
                for r in np.flatnonzero(inverse == j).tolist():
                    path = fdopen.resolve(ctx, pid, fd, int(a["ts_enter"][r]))
                    path_index[r] = dictionary.setdefault(path, len(dictionary))
            if ctx.skip_fd is not None and fdskip.not_a_file(path):
                ctx.skip_fd(pid, fd)   # a socket, pipe or eventfd (its latest row): the kernel skips it from now on
    ret = a["ret"].astype(np.int64)
    sys = np.clip(a["sys"].astype(np.int32), 0, len(SYSCALLS))
    is_vec = np.isin(sys, list(VECTOR))
    return pa.table(
        {
            "ts_ns": pa.array(a["ts"], pa.uint64()),
            "start_ns": pa.array(a["ts_enter"], pa.uint64()),
            "pid": pa.array(a["tgid"], pa.uint32()),
            "tid": pa.array(a["tid"], pa.uint32()),
            "syscall": pa.DictionaryArray.from_arrays(pa.array(sys, pa.int32()), pa.array(SYSCALLS + ["?"])),
            "fd": pa.array(a["fd"], pa.int32()),
            "path": pa.DictionaryArray.from_arrays(pa.array(path_index, pa.int32()), pa.array(list(dictionary), pa.string())),
            "offset": pa.array(a["pos"], pa.int64()),
            "requested": pa.array(np.where(is_vec, 0, a["count"]).astype(np.uint64), pa.uint64()),
            "iovcnt": pa.array(np.where(is_vec, a["count"], 0).astype(np.uint32), pa.uint32()),
            "bytes": pa.array(np.maximum(ret, 0).astype(np.uint64), pa.uint64()),
            "ret": pa.array(ret, pa.int64()),
            "latency_ns": pa.array(a["ts"].astype(np.int64) - a["ts_enter"].astype(np.int64), pa.int64()),
            "weight": pa.array(weights(a["weight"]), pa.uint32()),
        }
    )
