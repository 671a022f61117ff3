"""Decoder for probes/blockio.bpf.c: one row per completed block request (table ``block_io``;
under sampling one row per ``weight`` requests, see kvtrace/capture/agg.py).  A request whose
completion the probe never saw (the kernel dropped that event) comes as a row with error
``UNSEEN``, found when the next request starts at its sector: its error, device time and
latency are null."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_BLOCK, DecodeContext, cstr, decode_array, struct_dtype, weights

NAME = "blockio"
KIND = KIND_BLOCK
SOURCE = "blockio.bpf.c"
STRUCT = "kv_block_event"
TABLE = "block_io"
UNSEEN = -(2**31)   # KV_BLOCK_UNSEEN in probes/blockio.bpf.c
DTYPE = struct_dtype(
    [
        ("ts_start", "<u8"),
        ("ts_issue", "<u8"),
        ("sector", "<u8"),
        ("dev", "<u4"),
        ("bytes", "<u4"),
        ("error", "<i4"),
        ("weight", "<u4"),
        ("rwbs", "S8"),
        ("comm", "S16"),
    ]
)


def config(tp) -> tuple[list[str], str | None]:
    if not (tp("block", "block_rq_issue") and tp("block", "block_rq_complete")):
        return [], "block:block_rq_issue/complete missing"
    if tp("block", "block_io_start"):
        return ["-DKV_HAVE_BLOCK_IO_START"], None
    if tp("block", "block_bio_queue"):
        # before 6.5: follow a bio remapped before it became a request (native-multipath head
        # to its path device, dm), and drop the records of bios merged into a request
        flags = ["-DKV_HAVE_BIO_REMAP"] if tp("block", "block_bio_remap") else []
        flags += ["-DKV_HAVE_BIO_BACKMERGE"] if tp("block", "block_bio_backmerge") else []
        return flags, None
    return [], "neither block:block_io_start nor block:block_bio_queue exists: the submitter is unknown"


def op_of(rwbs: str) -> str:
    """The request's operation from its rwbs flags: R, W, D (discard), F (flush), or N."""
    for c in rwbs:
        if c in "RWDF":
            return c
    return "N"


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    rwbs = cstr(a["rwbs"])
    end = a["ts"].astype(np.int64)
    start = a["ts_start"].astype(np.int64)
    issue = a["ts_issue"].astype(np.int64)
    issued = issue > 0
    dev = a["dev"].astype(np.int64)
    unseen = a["error"] == UNSEEN
    mask = unseen if unseen.any() else None
    return pa.table(
        {
            "ts_ns": pa.array(a["ts"], pa.uint64()),
            "start_ns": pa.array(a["ts_start"], pa.uint64()),
            "issue_ns": pa.array(np.where(issued, issue, 0).astype(np.uint64), pa.uint64()),
            "pid": pa.array(a["tgid"], pa.uint32()),
            "tid": pa.array(a["tid"], pa.uint32()),
            "comm": pa.array(cstr(a["comm"]), pa.string()),
            "dev_major": pa.array((dev >> 20).astype(np.uint32), pa.uint32()),
            "dev_minor": pa.array((dev & ((1 << 20) - 1)).astype(np.uint32), pa.uint32()),
            "disk": pa.array([ctx.dev_name(int(d)) for d in a["dev"]], pa.string()),
            "sector": pa.array(a["sector"], pa.uint64()),
            "bytes": pa.array(a["bytes"], pa.uint64()),
            "op": pa.array([op_of(r) for r in rwbs], pa.string()),
            "rwbs": pa.array(rwbs, pa.string()),
            "error": pa.array(a["error"], pa.int32(), mask=mask),
            "queue_ns": pa.array(np.where(issued, issue - start, 0), pa.int64()),
            "device_ns": pa.array(np.where(issued, end - issue, end - start), pa.int64(), mask=mask),
            "latency_ns": pa.array(end - start, pa.int64(), mask=mask),
            "weight": pa.array(weights(a["weight"]), pa.uint32()),
        }
    )
