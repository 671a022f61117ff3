"""A constructed dataset for the analysis, small enough that every figure is computed by hand
(the expected values in tests/unit/test_analysis.py are derived in the comments below).

One engine (pid 100) of run "r1", block size 32.  Step k starts at k*10 ms; schedule() takes
0.5 ms; the execute window is 7.5 ms (9 ms in step 12, which waits 2 ms for a KV load).

  A  600 tokens, arrives 5 ms, chunks [0,250) s1, [250,500) s2, [500,600) s3 (last); no hit.
     Its admit record is sent twice (a scheduler retry must not count twice).
  B  600 tokens, same 18 block hashes as A, arrives 12 ms, admitted at s2 while A is mid-prefill:
     A has 500 tokens = 15 full blocks hashed, so B hits 480 and misses 3 in-flight blocks (96
     tokens).  Chunk [480,600) s2 (last).
  E  300 tokens, arrives 35 ms, [0,300) s4; preempted at s6 (60.2 ms) after 10 output tokens;
     re-admitted at s7 with 288 cached (never a hit) and recomputes [288,311).
  D  700 tokens, arrives 75 ms, [0,512) s8, [512,700) s9; its allocations evict A's blocks 17,
     16, 15 and an unrelated block at s8 (80.3 ms), F's blocks 0 and 1 at s9 (90.3 ms).
  C  A's prompt again, arrives 95 ms, s10: blocks 15-17 were evicted, so it hits 480 (15
     blocks) and recomputes [480,600): 3 thrashed blocks.
  F  400 tokens (12 blocks), arrives 110 ms, s12: 384 tokens come from storage (external), a
     2 ms load of 12 blocks inside step 12; chunk [384,400).
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.capture.usermark import schema_for
from kvtrace.dataset import schema

MS = 1_000_000
PID = 100
WORKER = 101
RUN = "r1"
BS = 32


def chain(tag: int, n: int) -> list[int]:
    return [(tag << 40) | (i + 1) | (1 << 63) for i in range(n)]  # high bit set: exercises u64


A_CHAIN, D_CHAIN, E_CHAIN, F_CHAIN = chain(0xA, 18), chain(0xD, 21), chain(0xE, 9), chain(0xF, 12)


def write(root: Path, table: str, rows: list[dict], sch: pa.Schema | None = None, run: str = RUN,
          host: str = "h1", date: str = "2026-11-30", name: str | None = None, version: int = schema.SCHEMA_VERSION) -> Path:
    sch = sch or schema_for(table) or schema.TABLES.get(table)
    t = pa.Table.from_pylist(rows, schema=sch) if sch is not None else pa.Table.from_pylist(rows)
    if "run" not in t.column_names:
        t = schema.with_run(t, run)
    meta = {schema.META_KEY: json.dumps({"schema_version": version, "kvtrace_version": "test", "run": run, "table": table}).encode()}
    t = t.replace_schema_metadata(meta)
    path = root / table / f"host={host}" / f"date={date}" / f"{name or run}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(t, path)
    return path


def hook(d: dict, pid: int = PID) -> dict:
    return {"mark_ns": 0, "pid": pid, "tid": pid, **d}


def step_row(k: int, prefill: int, decode: int, *, exec_ms: float = 7.5, preempted=0, evicted=0) -> dict:
    t0 = k * 10 * MS
    return hook({"step": k, "t_start_ns": t0, "t_sched_end_ns": t0 + MS // 2, "t_end_ns": int(t0 + MS // 2 + exec_ms * MS),
                 "num_reqs": 1, "total_tokens": prefill + decode, "prefill_reqs": 1 if prefill else 0,
                 "prefill_tokens": prefill, "decode_reqs": decode, "decode_tokens": decode, "new_reqs": 0,
                 "resumed_reqs": 0, "preempted": preempted, "evicted": evicted, "alloc_failures": 0, "running": 1,
                 "waiting": 0, "free_blocks": 10, "finished": 0})


def chunk(step, req, start, length, prompt, idx, last, attempt=0, prefill_len=None) -> dict:
    return hook({"step": step, "request": req, "attempt": attempt, "chunk_index": idx, "start": start, "length": length,
                 "prompt_len": prompt, "prefill_len": prefill_len or prompt, "last": int(last), "resumed": int(attempt > 0)})


def admit(step, req, prompt, local, external=0, attempt=0, prefill_len=None, hit_blocks=None) -> dict:
    return hook({"step": step, "request": req, "attempt": attempt, "prompt_len": prompt, "prefill_len": prefill_len or prompt,
                 "cached_local": local, "cached_external": external, "start": local + external,
                 "hit_blocks": local // BS if hit_blocks is None else hit_blocks, "last_hit_hash": 0, "resumed": int(attempt > 0)})


def build(root: Path, *, with_prompts: bool = True, with_arrivals: bool = True) -> Path:
    root = Path(root)
    steps = [step_row(1, 250, 0), step_row(2, 370, 0), step_row(3, 100, 0), step_row(4, 300, 0), step_row(5, 0, 2),
             step_row(6, 0, 2, preempted=1), step_row(7, 23, 0), step_row(8, 512, 0, evicted=4),
             step_row(9, 188, 0, evicted=2), step_row(10, 120, 0), step_row(11, 0, 3), step_row(12, 16, 0, exec_ms=9)]
    write(root, "step", steps)
    write(root, "chunk", [
        chunk(1, "A", 0, 250, 600, 0, False), chunk(2, "A", 250, 250, 600, 1, False), chunk(3, "A", 500, 100, 600, 2, True),
        chunk(2, "B", 480, 120, 600, 0, True),
        chunk(4, "E", 0, 300, 300, 0, True), chunk(7, "E", 288, 23, 300, 0, True, attempt=1, prefill_len=311),
        chunk(8, "D", 0, 512, 700, 0, False), chunk(9, "D", 512, 188, 700, 1, True),
        chunk(10, "C", 480, 120, 600, 0, True), chunk(12, "F", 384, 16, 400, 0, True)])
    write(root, "admit", [
        admit(1, "A", 600, 0), admit(1, "A", 600, 0),  # the same admission twice: counted once
        admit(2, "B", 600, 480), admit(4, "E", 300, 0), admit(7, "E", 300, 288, attempt=1, prefill_len=311),
        admit(8, "D", 700, 0), admit(10, "C", 600, 480), admit(12, "F", 400, 0, external=384)])
    evs = [(8, 80.3, A_CHAIN[17], "D"), (8, 80.3, A_CHAIN[16], "D"), (8, 80.3, A_CHAIN[15], "D"), (8, 80.3, 12345, "D"),
           (9, 90.3, F_CHAIN[0], "D"), (9, 90.3, F_CHAIN[1], "D")]
    write(root, "evict", [hook({"step": s, "t_ns": int(t * MS), "block_hash": h, "group": 0, "block_id": i, "medium": "GPU",
                                "request": r}) for i, (s, t, h, r) in enumerate(evs)])
    write(root, "preempt", [hook({"step": 6, "t_ns": int(60.2 * MS), "request": "E", "computed_before": 310,
                                  "num_tokens": 310, "num_preemptions": 1, "for_request": "B"})])
    t12 = 12 * 10 * MS + MS // 2
    write(root, "kv_load", [hook({"t_start_ns": t12 + MS // 10, "t_end_ns": t12 + MS // 10 + 2 * MS,
                                  "t_issue_end_ns": t12 + MS // 10 + 2 * MS, "seq": 0, "layer_waits": 0, "wait_ns": 0,
                                  "blocks": 12, "nbytes": 12 * 65536, "request": "F", "source": "kvtrace-file"}, pid=WORKER)])
    if with_arrivals:
        arrivals = {"A": 5, "B": 12, "E": 35, "D": 75, "C": 95, "F": 110}
        first_step = {"A": 1, "B": 2, "E": 4, "D": 8, "C": 10, "F": 12}
        write(root, "arrive", [hook({"step": first_step[r], "t_ns": t * MS, "request": r, "traceparent": "", "tracestate": ""})
                               for r, t in arrivals.items()])
    if with_prompts:
        prompts = {"A": (1, 600, A_CHAIN), "B": (2, 600, A_CHAIN), "E": (4, 300, E_CHAIN), "D": (8, 700, D_CHAIN),
                   "C": (10, 600, A_CHAIN), "F": (12, 400, F_CHAIN)}
        write(root, "prompt_blocks", [hook({"step": s, "request": r, "block_size": BS, "prompt_len": n, "max_output": 8,
                                            "num_blocks": len(c), "first": 0, "hashes": c}) for r, (s, n, c) in prompts.items()])
    us = 1000
    write(root, "block_io", [{"ts_ns": 200 * MS + i, "start_ns": 200 * MS + i - lat * us, "issue_ns": 0, "pid": WORKER,
                              "tid": WORKER, "comm": "w", "dev_major": 259, "dev_minor": 0, "disk": "nvme0n1", "sector": i,
                              "bytes": 4096, "op": "R", "rwbs": "R", "error": 0, "queue_ns": 10 * us, "device_ns": lat * us - 10 * us,
                              "latency_ns": lat * us} for i, lat in enumerate((100, 200, 300, 400))])
    write(root, "runs", [run_row()], sch=schema.RUNS)
    return root


def run_row(**kw) -> dict:
    """The fixture's run row (a vLLM server's), with the columns in kw changed."""
    return {"run": RUN, "status": "complete", "schema_version": schema.SCHEMA_VERSION, "kvtrace_version": "test",
            "kernel": "6.18", "server_kind": "vllm", "server_version": "0.32.0", "start_ns": 0, "stop_ns": 300 * MS,
            "clock_offset_ns": 0, "start_wall": "", "pids": [PID, WORKER], "command": "", "probes_attached": ["usermark"],
            "probes_skipped": "{}", "events": "{}", "lost_events": "{}", "dropped_events": 0, "sidecars": "[]",
            "sinks": "[]", **kw}


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and raw RGB(A) rows of a non-interlaced 8-bit PNG (what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), (depth, ctype)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa_, pb_, pc_ = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa_ <= pb_ and pa_ <= pc_ else b if pb_ <= pc_ else c)) & 255
        rows.append(bytes(line))
        prev = line
    return w, h, [bytes(r[i:i + 3]) for r in rows for i in range(0, stride, bpp)]


def assert_spark_report_equals(ds, rep: dict) -> None:
    """The Spark engine's report on ``ds`` equals ``rep`` (DuckDB's) but for engine and time;
    skipped with the reason where pyspark or Java is missing."""
    import os
    import shutil

    import pytest

    from kvtrace.analysis.report import analyze

    pytest.importorskip("pyspark", reason="needs pyspark: pip install 'kvtrace[spark]'")
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        pytest.skip("needs Java 17+ for Spark")
    a, b = dict(rep), dict(analyze(ds, engine="spark"))
    for k in ("engine", "elapsed_s"):
        a.pop(k), b.pop(k)
    assert a == b
