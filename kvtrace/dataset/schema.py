"""Schemas of the dataset's tables (documented in docs/schema.md). Bump SCHEMA_VERSION on
any incompatible change; readers refuse other versions with a message naming them."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = 1
META_KEY = b"kvtrace"

u32, u64, i32, i64, s = pa.uint32(), pa.uint64(), pa.int32(), pa.int64(), pa.string()
# Low-cardinality text (paths, syscalls, names) is dictionary-encoded: cheap to write and read.
d = pa.dictionary(pa.int32(), pa.string())
f64, b = pa.float64(), pa.bool_()

TABLES: dict[str, pa.Schema] = {
    "block_io": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("issue_ns", u64), ("pid", u32), ("tid", u32),
        ("comm", d), ("dev_major", u32), ("dev_minor", u32), ("disk", d), ("sector", u64),
        ("bytes", u64), ("op", d), ("rwbs", d), ("error", i32), ("queue_ns", i64),
        ("device_ns", i64), ("latency_ns", i64),
    ]),
    "file_io": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("pid", u32), ("tid", u32), ("syscall", d), ("fd", i32),
        ("path", d), ("offset", i64), ("requested", u64), ("iovcnt", u32), ("bytes", u64),
        ("ret", i64), ("latency_ns", i64),
    ]),
    "file_open": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("pid", u32), ("tid", u32), ("fd", i32), ("flags", u32),
        ("path", d), ("latency_ns", i64),
    ]),
    "io_uring": pa.schema([
        ("ts_ns", u64), ("submit_ns", u64), ("pid", u32), ("tid", u32), ("complete_tid", u32),
        ("opcode", u32), ("op", d), ("user_data", u64), ("res", i32), ("bytes", u64),
        ("latency_ns", i64),
    ]),
    "processes": pa.schema([
        ("ts_ns", u64), ("pid", u32), ("tid", u32), ("event", d), ("child_pid", u32), ("comm", d),
    ]),
    # vLLM's KV-event stream (kvtrace.vllm.kvevents): one row per block of each event.
    "kv_events": pa.schema([
        ("recv_ns", u64), ("seq", i64), ("batch_wall_ns", i64), ("dp_rank", i32), ("event_idx", u32),
        ("event", d), ("block_idx", u32), ("block_hash", u64), ("parent_hash", u64), ("token_count", u32),
        ("tokens_hash", u64), ("block_size", u32), ("medium", s), ("group_idx", i32), ("spec_kind", s),
        ("lora_id", i64), ("lora_name", s), ("session_id", s), ("replayed", b),
    ]),
    # vLLM's Prometheus /metrics, vllm:* samples per scrape (kvtrace.vllm.metrics).
    "vllm_metrics": pa.schema([
        ("ts_ns", u64), ("name", s), ("labels", s), ("value", f64), ("type", s),
    ]),
}

RUNS = pa.schema([
    ("run", s), ("status", s), ("schema_version", i32), ("kvtrace_version", s), ("kernel", s),
    ("start_ns", u64), ("stop_ns", u64), ("clock_offset_ns", i64), ("start_wall", s),
    ("pids", pa.list_(u32)), ("command", s), ("probes_attached", pa.list_(s)),
    ("probes_skipped", s), ("events", s), ("lost_events", s), ("dropped_events", u64),
    ("sidecars", s),
])


def with_run(table: pa.Table, run: str) -> pa.Table:
    """The table with a leading ``run`` column (dictionary-encoded: cheap per row)."""
    col = pa.DictionaryArray.from_arrays(pa.array(np.zeros(table.num_rows, np.int32)), pa.array([run]))
    return table.add_column(0, pa.field("run", d), col)
