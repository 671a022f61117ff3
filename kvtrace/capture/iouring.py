"""Decoder for probes/iouring.bpf.c: io_uring requests, submit paired with complete (table ``io_uring``)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_URING, DecodeContext, decode_array, struct_dtype, weights

NAME = "iouring"
KIND = KIND_URING
SOURCE = "iouring.bpf.c"
STRUCT = "kv_uring_event"
TABLE = "io_uring"
DTYPE = struct_dtype(
    [
        ("ts_submit", "<u8"),
        ("user_data", "<u8"),
        ("res", "<i4"),
        ("cflags", "<u4"),
        ("opcode", "<u2"),
        ("weight", "<u2"),
        ("complete_tid", "<u4"),
    ]
)
# enum io_uring_op (include/uapi/linux/io_uring.h); stable numbering.
OPCODES = [
    "NOP", "READV", "WRITEV", "FSYNC", "READ_FIXED", "WRITE_FIXED", "POLL_ADD", "POLL_REMOVE",
    "SYNC_FILE_RANGE", "SENDMSG", "RECVMSG", "TIMEOUT", "TIMEOUT_REMOVE", "ACCEPT", "ASYNC_CANCEL",
    "LINK_TIMEOUT", "CONNECT", "FALLOCATE", "OPENAT", "CLOSE", "FILES_UPDATE", "STATX", "READ",
    "WRITE", "FADVISE", "MADVISE", "SEND", "RECV", "OPENAT2", "EPOLL_CTL", "SPLICE",
    "PROVIDE_BUFFERS", "REMOVE_BUFFERS", "TEE", "SHUTDOWN", "RENAMEAT", "UNLINKAT", "MKDIRAT",
    "SYMLINKAT", "LINKAT", "MSG_RING", "FSETXATTR", "SETXATTR", "FGETXATTR", "GETXATTR",
    "SOCKET", "URING_CMD", "SEND_ZC", "SENDMSG_ZC", "READ_MULTISHOT", "WAITID", "FUTEX_WAIT",
    "FUTEX_WAKE", "FUTEX_WAITV", "FIXED_FD_INSTALL", "FTRUNCATE", "BIND", "LISTEN",
]
DATA_OPS = {"READV", "WRITEV", "READ_FIXED", "WRITE_FIXED", "READ", "WRITE", "READ_MULTISHOT"}


def config(tp) -> tuple[list[str], str | None]:
    if not tp("io_uring", "io_uring_complete"):
        return [], "io_uring tracepoints missing (CONFIG_IO_URING off?)"
    if tp("io_uring", "io_uring_submit_req"):
        return ["-DKV_URING_SUBMIT_REQ"], None
    if tp("io_uring", "io_uring_submit_sqe"):
        return [], None
    return [], "io_uring:io_uring_submit_req/sqe missing"


def opname(code: int) -> str:
    return OPCODES[code] if 0 <= code < len(OPCODES) else f"OP_{code}"


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    names = [opname(int(c)) for c in a["opcode"]]
    res = a["res"].astype(np.int64)
    data = np.array([n in DATA_OPS for n in names], dtype=bool)
    return pa.table(
        {
            "ts_ns": pa.array(a["ts"], pa.uint64()),
            "submit_ns": pa.array(a["ts_submit"], pa.uint64()),
            "pid": pa.array(a["tgid"], pa.uint32()),
            "tid": pa.array(a["tid"], pa.uint32()),
            "complete_tid": pa.array(a["complete_tid"], pa.uint32()),
            "opcode": pa.array(a["opcode"], pa.uint32()),
            "op": pa.array(names, pa.string()),
            "user_data": pa.array(a["user_data"], pa.uint64()),
            "res": pa.array(a["res"], pa.int32()),
            "bytes": pa.array(np.where(data & (res > 0), res, 0).astype(np.uint64), pa.uint64()),
            "latency_ns": pa.array(a["ts"].astype(np.int64) - a["ts_submit"].astype(np.int64), pa.int64()),
            "weight": pa.array(weights(a["weight"]), pa.uint32()),
        }
    )
