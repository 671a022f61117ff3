"""Decoder for probes/proc.bpf.c: forks and exits of traced processes (table ``processes``)."""
from __future__ import annotations

import pyarrow as pa

from kvtrace.capture.events import KIND_PROC, DecodeContext, cstr, decode_array, struct_dtype

NAME = "proc"
KIND = KIND_PROC
SOURCE = "proc.bpf.c"
STRUCT = "kv_proc_event"
TABLE = "processes"
DTYPE = struct_dtype([("child", "<u4"), ("op", "<u4"), ("comm", "S16")])
OPS = {1: "fork", 2: "exit"}


def config(tp) -> tuple[list[str], str | None]:
    """cflags for this kernel, or a reason to skip the probe."""
    if not (tp("sched", "sched_process_fork") and tp("sched", "sched_process_exit")):
        return [], "sched:sched_process_fork/exit missing: children started later are not followed"
    return [], None


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    return pa.table(
        {
            "ts_ns": pa.array(a["ts"], pa.uint64()),
            "pid": pa.array(a["tgid"], pa.uint32()),
            "tid": pa.array(a["tid"], pa.uint32()),
            "event": pa.array([OPS.get(int(o), str(int(o))) for o in a["op"]], pa.string()),
            "child_pid": pa.array(a["child"], pa.uint32()),
            "comm": pa.array(cstr(a["comm"]), pa.string()),
        }
    )
