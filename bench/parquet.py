"""Parquet write rate of the dataset writer (kvtrace/dataset/writer.py), as the agent uses it.

Rows made the way the agent makes them (raw ring-buffer records of realistic values through
the probes' own decoders for file_io and block_io; the hook's step records through the
usermark decoder), then written in part files of one flush's worth of rows each (LZ4 parts, zstd once compacted, 0600,
atomic rename, the run row rewritten every flush), then compacted as at a clean stop.
Reported per table: rows/s and MiB/s of Parquet written, on one core, plus the compaction rate.

    .venv/bin/python bench/parquet.py [--short] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtrace.capture import blockio, fileio, usermark  # noqa: E402
from kvtrace.capture.events import KIND_BLOCK, KIND_FILEIO, DecodeContext  # noqa: E402
from kvtrace.dataset.writer import DatasetWriter  # noqa: E402
from kvtrace.hook.wire import CODEC, MAGIC  # noqa: E402


def file_records(n: int, rng) -> bytes:
    a = np.zeros(n, fileio.DTYPE)
    a["kind"], a["size"] = KIND_FILEIO, fileio.DTYPE.itemsize
    start = np.cumsum(rng.integers(500, 5000, n)).astype(np.uint64) + 10**12
    a["ts_enter"], a["ts"] = start, start + rng.integers(1000, 200_000, n).astype(np.uint64)
    a["tgid"], a["tid"] = 4242, 4242 + rng.integers(0, 8, n)
    a["fd"] = rng.integers(10, 74, n)
    a["sys"] = rng.choice([1, 4, 5, 6], n)
    a["count"] = 65536
    a["ret"] = np.where(rng.random(n) < 0.01, -11, 65536)
    a["pos"] = rng.integers(0, 1 << 30, n) & ~4095
    a["weight"] = 1
    return a.tobytes()


def block_records(n: int, rng) -> bytes:
    a = np.zeros(n, blockio.DTYPE)
    a["kind"], a["size"] = KIND_BLOCK, blockio.DTYPE.itemsize
    start = np.cumsum(rng.integers(1000, 10_000, n)).astype(np.uint64) + 10**12
    a["ts_start"], a["ts_issue"] = start, start + 2000
    a["ts"] = start + rng.integers(20_000, 500_000, n).astype(np.uint64)
    a["tgid"], a["tid"] = 4242, 4243
    a["dev"] = (259 << 20) | rng.integers(0, 4, n)
    a["sector"] = rng.integers(0, 1 << 32, n) & ~7
    a["bytes"] = rng.choice([4096, 65536, 131072], n)
    a["rwbs"] = rng.choice([b"R", b"RS", b"W", b"WS"], n)
    a["comm"] = b"VLLM::Worker_TP0"
    a["weight"] = 1
    return a.tobytes()


def step_frames(n: int) -> list[bytes]:
    """Marker events carrying one step record each, as the hook sends them."""
    import struct

    out = []
    for i in range(n):
        rec = CODEC.encode("step", i, 10**12 + i * 20_000_000, 10**12 + i * 20_000_000 + 200_000, 10**12 + (i + 1) * 20_000_000,
                           8, 256, 2, 248, 6, 8, 1, 0, 0, 0, 0, 6, 2, 37, 0)
        frame = MAGIC + rec
        hdr = struct.pack("<BBHIQII", 6, 1, 32 + 256, 0, 10**12 + i * 20_000_000, 4242, 4242)
        out.append(hdr + struct.pack("<II", len(frame), 0) + frame.ljust(256, b"\0"))
    return out


def bench_table(name: str, table, per_flush: int, d: str) -> dict:
    w = DatasetWriter(os.path.join(d, name), "bench", "h")
    row = {"run": "bench", "status": "running"}
    n = table.num_rows
    t0 = time.perf_counter()
    c0 = time.process_time()
    for off in range(0, n, per_flush):
        w.add(name, table.slice(off, per_flush))
        w.flush(row)
    t1 = time.perf_counter()
    c1 = time.process_time()
    size = sum(p.stat().st_size for p in Path(d, name).rglob("*.parquet"))
    w.compact()
    t2 = time.perf_counter()
    return {"rows": n, "rows_per_flush": per_flush, "rows_per_s": round(n / (t1 - t0)), "rows_per_cpu_s": round(n / (c1 - c0)),
            "mib_per_s": round(size / 2**20 / (t1 - t0), 1), "bytes_per_row": round(size / n, 1),
            "compact_rows_per_s": round(n / (t2 - t1))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = np.random.default_rng(3)
    n = 200_000 if a.short else 2_000_000
    ctx = DecodeContext(dev_names={(259 << 20) | i: f"nvme0n{i + 1}" for i in range(4)})
    for fd in range(10, 74):
        ctx.fd_paths[(4242, fd)] = [(0, f"/var/lib/kv/shard{fd % 16}/blocks.bin")]
    tables = {
        "file_io": fileio.decode([file_records(n, rng)], ctx),
        "block_io": blockio.decode([block_records(n, rng)], ctx),
        "step": usermark.decode(step_frames(n // 20), ctx)["step"],
    }
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, t in tables.items():
            out[name] = bench_table(name, t, 100_000 if name != "step" else 5_000, d)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
