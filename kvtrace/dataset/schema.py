"""Schemas of the dataset's tables (documented in docs/schema.md). Bump SCHEMA_VERSION on
any incompatible change; readers refuse other versions with a message naming them."""
from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
META_KEY = b"kvtrace"

u32, u64, i32, i64, s = pa.uint32(), pa.uint64(), pa.int32(), pa.int64(), pa.string()

TABLES: dict[str, pa.Schema] = {
    "block_io": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("issue_ns", u64), ("pid", u32), ("tid", u32),
        ("comm", s), ("dev_major", u32), ("dev_minor", u32), ("disk", s), ("sector", u64),
        ("bytes", u64), ("op", s), ("rwbs", s), ("error", i32), ("queue_ns", i64),
        ("device_ns", i64), ("latency_ns", i64),
    ]),
    "file_io": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("pid", u32), ("tid", u32), ("syscall", s), ("fd", i32),
        ("path", s), ("offset", i64), ("requested", u64), ("iovcnt", u32), ("bytes", u64),
        ("ret", i64), ("latency_ns", i64),
    ]),
    "file_open": pa.schema([
        ("ts_ns", u64), ("start_ns", u64), ("pid", u32), ("tid", u32), ("fd", i32), ("flags", u32),
        ("path", s), ("latency_ns", i64),
    ]),
    "io_uring": pa.schema([
        ("ts_ns", u64), ("submit_ns", u64), ("pid", u32), ("tid", u32), ("complete_tid", u32),
        ("opcode", u32), ("op", s), ("user_data", u64), ("res", i32), ("bytes", u64),
        ("latency_ns", i64),
    ]),
    "processes": pa.schema([
        ("ts_ns", u64), ("pid", u32), ("tid", u32), ("event", s), ("child_pid", u32), ("comm", s),
    ]),
}

RUNS = pa.schema([
    ("run", s), ("status", s), ("schema_version", i32), ("kvtrace_version", s), ("kernel", s),
    ("start_ns", u64), ("stop_ns", u64), ("clock_offset_ns", i64), ("start_wall", s),
    ("pids", pa.list_(u32)), ("command", s), ("probes_attached", pa.list_(s)),
    ("probes_skipped", s), ("events", s), ("lost_events", s), ("dropped_events", u64),
])


def with_run(table: pa.Table, run: str) -> pa.Table:
    """The table with a leading ``run`` column (dictionary-encoded: cheap per row)."""
    col = pa.DictionaryArray.from_arrays(pa.array([0] * table.num_rows, pa.int32()), pa.array([run]))
    return table.add_column(0, pa.field("run", pa.dictionary(pa.int32(), s)), col)
