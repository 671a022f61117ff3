"""The recorded tables the correlator reads, as columns of numpy arrays.

Every table may be absent (a probe skipped, no hook in vLLM, no NVMe on this host): an absent
table reads as zero rows with the columns the correlator uses.  Strings are kept as numpy
object arrays; the few per-row strings that are joined on (request ids) are interned.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Columns used per table: name -> numpy dtype ("O" = string).
HOOK = {
    "step": {"pid": "u4", "step": "u8", "t_start_ns": "u8", "t_sched_end_ns": "u8", "t_end_ns": "u8",
             "num_reqs": "u4", "total_tokens": "u4", "prefill_reqs": "u4", "prefill_tokens": "u4",
             "decode_reqs": "u4", "decode_tokens": "u4", "new_reqs": "u4", "resumed_reqs": "u4",
             "preempted": "u4", "evicted": "u4", "running": "u4", "waiting": "u4", "free_blocks": "u4"},
    "chunk": {"pid": "u4", "step": "u8", "request": "O", "attempt": "u4", "chunk_index": "i4", "start": "u4",
              "length": "u4", "prompt_len": "u4", "prefill_len": "u4", "last": "u1", "resumed": "u1"},
    "admit": {"pid": "u4", "step": "u8", "request": "O", "attempt": "u4", "prompt_len": "u4", "prefill_len": "u4",
              "cached_local": "u4", "cached_external": "u4", "start": "u4", "hit_blocks": "u4",
              "last_hit_hash": "u8", "resumed": "u1"},
    "evict": {"pid": "u4", "step": "u8", "t_ns": "u8", "block_hash": "u8", "group": "u4", "block_id": "u4",
              "medium": "O", "request": "O"},
    "preempt": {"pid": "u4", "step": "u8", "t_ns": "u8", "request": "O", "computed_before": "u4",
                "num_tokens": "u4", "num_preemptions": "u4", "for_request": "O"},
    "kv_load": {"pid": "u4", "tid": "u4", "t_start_ns": "u8", "t_end_ns": "u8", "t_issue_end_ns": "u8",
                "seq": "u8", "layer_waits": "u4", "wait_ns": "u8", "blocks": "u4", "nbytes": "u8",
                "request": "O", "source": "O"},
    "kv_store": {"pid": "u4", "tid": "u4", "t_start_ns": "u8", "t_end_ns": "u8", "t_issue_end_ns": "u8",
                 "seq": "u8", "layer_waits": "u4", "wait_ns": "u8", "blocks": "u4", "nbytes": "u8",
                 "request": "O", "source": "O"},
    # First admission of a request: its arrival (CLOCK_MONOTONIC) and W3C trace context, if any.
    "arrive": {"pid": "u4", "step": "u8", "t_ns": "u8", "request": "O", "traceparent": "O", "tracestate": "O"},
    # A request vLLM reported finished (in the SchedulerOutput of step `step`).
    "finish": {"pid": "u4", "step": "u8", "t_ns": "u8", "request": "O"},
    "hook_start": {"pid": "u4", "role": "O"},
    # Any KV connector as the scheduler drove it (docs/hook.md): a load granted, an async one done.
    "kv_alloc": {"pid": "u4", "step": "u8", "t_ns": "u8", "request": "O", "external": "u4", "blocks": "u4",
                 "nbytes": "u8", "async": "u1", "connector": "O"},
    "kv_done": {"pid": "u4", "t_ns": "u8", "request": "O", "direction": "O", "ok": "u1"},
}
KERNEL = {
    "block_io": {"ts_ns": "u8", "start_ns": "u8", "pid": "u4", "tid": "u4", "dev_major": "u4",
                 "dev_minor": "u4", "bytes": "u8", "error": "i4", "queue_ns": "i8", "device_ns": "i8",
                 "latency_ns": "i8", "sector": "u8"},
    "file_io": {"ts_ns": "u8", "start_ns": "u8", "pid": "u4", "tid": "u4", "bytes": "u8", "ret": "i8",
                "latency_ns": "i8"},
    "io_uring": {"ts_ns": "u8", "submit_ns": "u8", "pid": "u4", "tid": "u4", "bytes": "u8", "res": "i4",
                 "latency_ns": "i8"},
    "processes": {"pid": "u4", "event": "O", "child_pid": "u4"},
}
COLUMNS = {**HOOK, **KERNEL}
# The hook's records the miss-cause replay reads whole (kvtrace.correlate.stages.causes).
STRUCTURE = ("prompt_blocks", "resume_blocks", "prompt_plain", "lookup", "cached", "engine", "tiers", "kv_group",
             "cached_in")
TABLES_USED = tuple(COLUMNS) + STRUCTURE
# NVMe commands and NIC counter deltas (kvtrace.capture.nvme, kvtrace.fabric) go to the steps they overlap.
OVERLAP_PREFIXES = ("nvme_cmd", "nic_counters")


class Cols(dict):
    """name -> numpy array, all of one length ``n``."""

    n: int = 0

    def take(self, idx) -> "Cols":
        out = Cols({k: v[idx] for k, v in self.items()})
        out.n = len(next(iter(out.values()))) if out else 0
        return out


def _np(col: pa.ChunkedArray | pa.Array, dtype: str) -> np.ndarray:
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if dtype == "O":
        if not pa.types.is_string(col.type) and not pa.types.is_large_string(col.type):
            col = col.cast(pa.string())
        col = pc.fill_null(col, "")
        return np.asarray(col.to_numpy(zero_copy_only=False), dtype=object)
    if col.null_count:
        col = pc.fill_null(col, 0)
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def columns(table: pa.Table | None, name: str) -> Cols:
    """The correlator's columns of one table (zero rows when absent; missing columns are zeros)."""
    spec = COLUMNS[name]
    n = 0 if table is None else table.num_rows
    out = Cols()
    for col, dt in spec.items():
        if table is not None and col in table.column_names:
            out[col] = _np(table[col], dt)
        else:
            out[col] = np.full(n, "", dtype=object) if dt == "O" else np.zeros(n, dtype=dt)
    out.n = n
    if name == "file_io":
        out["path_code"], out["paths"] = _codes(table, "path", n)
        out["storage"] = storage_paths(out["paths"])[out["path_code"]] if n else np.zeros(0, bool)
        codes, names = _codes(table, "syscall", n)
        out["is_read"] = np.isin(names, list(READ_SYSCALLS))[codes] if n else np.zeros(0, bool)
    elif name == "block_io":
        if n and table is not None and "latency_ns" in table.column_names and table["latency_ns"].null_count:
            # a request that ended without its completion traced (kvtrace.capture.settle): its end
            # is unknown, so it is placed at its start
            untimed = pc.is_null(table["latency_ns"]).to_numpy(zero_copy_only=False)
            out["ts_ns"] = np.where(untimed, out["start_ns"], out["ts_ns"])
        out["disk_code"], out["disks"] = _codes(table, "disk", n)
        codes, ops = _codes(table, "op", n)
        out["is_read"] = (ops == "R")[codes] if n else np.zeros(0, bool)
        out["is_write"] = (ops == "W")[codes] if n else np.zeros(0, bool)
    elif name == "io_uring":
        codes, names = _codes(table, "op", n)
        out["storage"] = uring_storage_ops(names)[codes] if n else np.zeros(0, bool)
        out["is_read"] = np.array([o.upper().startswith("READ") for o in names], bool)[codes] if n else np.zeros(0, bool)
    return out


def _codes(table: pa.Table | None, col: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Dictionary codes (int32, one per row) and the distinct values (object array) of a text column."""
    if table is None or col not in table.column_names or n == 0:
        return np.zeros(n, np.int32), np.array([""], dtype=object)
    arr = table[col]
    if not pa.types.is_dictionary(arr.type):
        arr = pc.dictionary_encode(arr)
    arr = arr.unify_dictionaries() if isinstance(arr, pa.ChunkedArray) else arr
    chunks = arr.chunks if isinstance(arr, pa.ChunkedArray) else [arr]
    if not chunks:
        return np.zeros(n, np.int32), np.array([""], dtype=object)
    values = chunks[0].dictionary.cast(pa.string()).fill_null("")
    names = np.asarray(values.to_numpy(zero_copy_only=False), dtype=object)
    idx = np.concatenate([c.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int32) for c in chunks])
    if len(names) == 0:
        names = np.array([""], dtype=object)
    return idx, names


def overlap_columns(table: pa.Table) -> Cols | None:
    """An NVMe/NIC table as [start, end] intervals plus its numeric columns, or None when it has no time.

    start = the first of start_ns, t_start_ns, submit_ns, setup_ns, interval_start_ns, prev_ts_ns
    present; end = ts_ns, t_end_ns or complete_ns.  A row with only a time is a point."""
    names = table.column_names
    end = next((c for c in ("ts_ns", "t_end_ns", "complete_ns") if c in names), None)
    if end is None:
        return None
    start = next((c for c in ("start_ns", "t_start_ns", "submit_ns", "setup_ns")
                  if c in names), None)
    out = Cols()
    out["end"] = _np(table[end], "u8")
    if start:
        out["start"] = _np(table[start], "u8")
    elif "interval_ns" in names:
        iv = _np(table["interval_ns"], "u8")
        out["start"] = np.where(iv < out["end"], out["end"] - iv, out["end"])
    else:
        out["start"] = out["end"].copy()
    bad = (out["start"] == 0) | (out["start"] > out["end"])
    out["start"] = np.where(bad, out["end"], out["start"])
    for c in names:
        t = table.schema.field(c).type
        if c in (end, start) or not (pa.types.is_integer(t) or pa.types.is_floating(t)):
            continue
        out["n:" + c] = _np(table[c], "f8")
    for c in ("counter", "name", "metric", "device", "port"):
        if c in names:
            out["s:" + c] = _np(table[c], "O")
    out.n = table.num_rows
    return out


STORAGE_DEV_PREFIXES = ("/dev/nvme", "/dev/sd", "/dev/vd", "/dev/xvd", "/dev/hd", "/dev/loop", "/dev/dm-",
                        "/dev/md", "/dev/mapper/", "/dev/disk/", "/dev/pmem", "/dev/rbd", "/dev/nbd", "/dev/mmcblk")
NOT_STORAGE_PREFIXES = ("/proc/", "/sys/", "/dev/")
READ_SYSCALLS = frozenset({"read", "pread64", "readv", "preadv", "preadv2"})


def storage_paths(paths) -> np.ndarray:
    """True for file_io paths on storage: absolute, not under /proc, /sys or /dev except block devices.

    Sockets, pipes, eventfds ("socket:[…]", "pipe:[…]", "anon_inode:…") and unknown fds ("") are not storage."""
    return np.array([p.startswith("/") and (not p.startswith(NOT_STORAGE_PREFIXES) or p.startswith(STORAGE_DEV_PREFIXES))
                     for p in paths], dtype=bool)


def uring_storage_ops(ops) -> np.ndarray:
    """io_uring data ops that move file data (READ*, WRITE*), not SEND/RECV."""
    return np.array([o.upper().startswith(("READ", "WRITE")) for o in ops], dtype=bool)
