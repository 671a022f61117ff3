"""Decoder for probes/filemap.bpf.c: the traced processes' page-cache fills and page faults on
mapped files, the reads that mmap makes without a system call (table ``file_map``).  The faults
need kernel 6.10's tracepoints; without them only the fills are recorded."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrace.capture.events import KIND_FILEMAP, DecodeContext, decode_array, struct_dtype

NAME = "filemap"
KIND = KIND_FILEMAP
SOURCE = "filemap.bpf.c"
STRUCT = "kv_filemap_event"
TABLE = "file_map"
DTYPE = struct_dtype([("ino", "<u8"), ("index", "<u8"), ("last", "<u8"), ("dev", "<u4"), ("op", "<u4")])
OPS = {1: "fault", 2: "map", 3: "fill"}
MINORBITS = 20   # the kernel's dev_t: major << 20 | minor


def config(tp) -> tuple[list[str], str | None]:
    if not tp("filemap", "mm_filemap_add_to_page_cache"):
        return [], "filemap:mm_filemap_add_to_page_cache missing: reads through mmap are not seen"
    if tp("filemap", "mm_filemap_fault") and tp("filemap", "mm_filemap_map_pages"):
        return ["-DKV_HAVE_FILEMAP_FAULT"], None
    return [], None   # kernels before 6.10: page-cache fills only, no faults


def decode(raw: list[bytes], ctx: DecodeContext) -> pa.Table:
    a = decode_array(raw, DTYPE)
    dev = a["dev"].astype(np.uint32)
    first, last = a["index"].astype(np.uint64), a["last"].astype(np.uint64)
    return pa.table({
        "ts_ns": pa.array(a["ts"], pa.uint64()),
        "pid": pa.array(a["tgid"], pa.uint32()),
        "tid": pa.array(a["tid"], pa.uint32()),
        "op": pa.array([OPS.get(int(o), str(int(o))) for o in a["op"]], pa.string()),
        "dev_major": pa.array(dev >> MINORBITS, pa.uint32()),
        "dev_minor": pa.array(dev & ((1 << MINORBITS) - 1), pa.uint32()),
        "ino": pa.array(a["ino"], pa.uint64()),
        "first_page": pa.array(first, pa.uint64()),
        "pages": pa.array(np.where(last >= first, last - first + 1, 0).astype(np.uint64), pa.uint64()),
    })
